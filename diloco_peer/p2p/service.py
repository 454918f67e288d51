"""P2PService: one background asyncio loop and one P2P replica of a DHT's daemon, per process.

    service = P2PService(dht)
    service.start()
    service.wait_until_ready(timeout_s=30)
    averager = GroupAverager(service, "run1")          # averaging/
    server = StateServer(service, "run1", provide)     # coordinator_free/
    ...
    server.shutdown(); averager.shutdown()             # components first,
    service.shutdown()                                 # then the service

hivemind's `DHT` runs in a forked process that owns the libp2p daemon. Components that serve
streams (part exchange, matchmaking, state download) need a P2P client of that daemon living in an
asyncio loop of *this* process, which keeps running between the training thread's calls so that
handlers answer other peers at any time. `P2P.replicate` gives such a client: a second client of
the same daemon, hence the same peer id (and the same key, DESIGN.md §4). We make our own replica
rather than calling `dht.replicate_p2p()`, which is cached per process and bound to whichever event
loop first asked for it.

Several components share ONE service: one loop thread and one replica per process. Each registers
its own handler names on `service.p2p` from inside `service.loop` (via `run`, or a coroutine of its
own scheduled there), and is shut down before the service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P
from multiaddr import Multiaddr

from diloco_peer.errors import P2PServiceStopped
from diloco_peer.lifecycle import BackgroundPart

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SETUP_TIMEOUT_S = 30.0
"""Asking the DHT process for its daemon's address, and connecting a replica to it (each)."""
_TEARDOWN_TIMEOUT_S = 5.0
"""Closing the replica's client (the daemon itself belongs to the DHT process)."""
_CANCEL_GRACE_S = 3.0
"""How long tasks still pending when the loop stops get to finish their cancellation."""
POLL_S = 2.0
"""How often `P2PService.run` calls its `poll` while a call runs."""


async def _daemon_listen_maddr(_dht: DHT, node: DHTNode) -> Multiaddr:
    """Runs inside the DHT process: where its p2p daemon listens for clients."""
    return node.p2p.daemon_listen_maddr


def _result(
    future: concurrent.futures.Future[T], timeout_s: float, poll: Callable[[], None] | None
) -> T:
    """`future.result(timeout_s)`, calling `poll` every POLL_S meanwhile."""
    if poll is None:
        return future.result(timeout=timeout_s)
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(POLL_S, left)))
        except concurrent.futures.TimeoutError:
            if future.done():  # it ended meanwhile (or its own bound raised TimeoutError)
                return future.result()
            if left <= POLL_S:
                raise
        poll()


class P2PService(BackgroundPart):
    """The loop thread and P2P replica that this process's network components share.

    :param dht: a running hivemind DHT; its peer id is this service's identity.
    """

    def __init__(self, dht: DHT) -> None:
        super().__init__()
        self._dht = dht
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._peer_id: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def _begin(self) -> concurrent.futures.Future[None]:
        """Start the loop thread; it connects a replica to the DHT's daemon."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="P2PService", daemon=True)
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._setup(), self._loop)

    async def ready(self, timeout_s: float) -> P2P:
        """Inside `loop`: wait until the replica is connected, for a component's own setup."""
        if self._ready is None:
            raise P2PServiceStopped("P2PService was not started")
        # shielded: a waiter that times out must not cancel the service's own setup
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._ready)), timeout_s)
        return self.p2p

    def _end(self) -> None:
        """Close the replica and join the loop thread.

        Components using the service should be shut down first: their handlers stop answering
        here, and calls still running on the loop are cancelled.
        """
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            teardown = asyncio.run_coroutine_threadsafe(self._teardown(), loop)
            try:
                teardown.result(timeout=_TEARDOWN_TIMEOUT_S + 1.0)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as e:
                logger.warning("P2PService: teardown incomplete: %r", e)
            except Exception as e:  # the daemon may already be gone with the DHT process
                logger.warning("P2PService: teardown failed: %r", e)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=_TEARDOWN_TIMEOUT_S + _CANCEL_GRACE_S)
        if thread.is_alive():
            logger.warning("P2PService: loop thread did not stop")

    # ------------------------------------------------------------------ accessors

    @property
    def dht(self) -> DHT:
        return self._dht

    @property
    def p2p(self) -> P2P:
        """The replica (once ready); use it only from inside `loop`."""
        if self._p2p is None:
            raise RuntimeError("P2PService is not ready")
        return self._p2p

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background loop (once started)."""
        if self._loop is None:
            raise RuntimeError("P2PService was not started")
        return self._loop

    @property
    def peer_id(self) -> str:
        """This peer's base58 id (once ready), the same as the DHT's."""
        if self._peer_id is None:
            raise RuntimeError("P2PService is not ready")
        return self._peer_id

    @property
    def is_running(self) -> bool:
        """Started, not shut down, and its loop alive."""
        loop = self._loop
        return loop is not None and not self._stopped and loop.is_running()

    # ------------------------------------------------------------------ calls

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout_s: float,
        poll: Callable[[], None] | None = None,
    ) -> T:
        """Run `coro` on the loop from another thread and return its result.

        `timeout_s` is a backstop: the coroutine should bound its own waits, and a
        `TimeoutError` it raises is re-raised as is. If it has not finished after `timeout_s`,
        it is cancelled and `TimeoutError` is raised. Raises P2PServiceStopped if the service is
        not running, or shuts down (cancelling the call) before the call finishes. `poll`, if
        given, is called in the calling thread every POLL_S while the call runs.
        """
        loop = self._loop
        if loop is None or self._stopped or not loop.is_running():
            coro.close()
            raise P2PServiceStopped("P2PService is not running")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("P2PService.run() from the loop thread would wait on itself")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return _result(future, timeout_s, poll)
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError) as e:  # one class on 3.11+
            if future.done():  # the coroutine raised it: its own bound ran out
                raise TimeoutError(str(e) or "timed out") from e
            future.cancel()
            raise TimeoutError(f"call did not finish within {timeout_s} s") from None
        except concurrent.futures.CancelledError:
            # the owner of the call (a component's shutdown) or the service's shutdown cancelled it
            raise P2PServiceStopped("the call was cancelled by a shutdown") from None

    # ------------------------------------------------------------------ loop thread

    def _run_loop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:  # cancelled tasks end at once; the bound is for one that ignores it
                loop.run_until_complete(asyncio.wait(pending, timeout=_CANCEL_GRACE_S))
            loop.close()

    async def _setup(self) -> None:
        maddr = await asyncio.wait_for(
            self._dht.run_coroutine(_daemon_listen_maddr, return_future=True), _SETUP_TIMEOUT_S
        )
        p2p = await asyncio.wait_for(P2P.replicate(maddr), _SETUP_TIMEOUT_S)
        self._peer_id = p2p.peer_id.to_base58()
        self._p2p = p2p
        logger.info("[%s] P2PService ready", self._peer_id[-6:])

    async def _teardown(self) -> None:
        if self._p2p is not None:
            await asyncio.wait_for(self._p2p.shutdown(), _TEARDOWN_TIMEOUT_S)
