"""One lifecycle for every background part of a peer (hivemind's `run_in_background` /
`shutdown`): the P2P service, stream handlers, the averager, the heartbeat, the metrics server.

    part.start()                    # once; begins the work and returns without waiting
    part.wait_until_ready(30)       # blocks until it serves (TimeoutError after 30 s)
    ...
    part.shutdown()                 # idempotent, safe before start(), bounded in time

A subclass implements `_begin` (start the work; return a future that is done once the part is
ready, `ready_now()` if it is ready at once) and `_end` (stop it, bounded in time).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

from diloco_peer.errors import PartStopped


def ready_now() -> concurrent.futures.Future[Any]:
    """A future that is already done: for a part that is ready as soon as `_begin` returns."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(None)
    return future


def wait_ready(ready: concurrent.futures.Future[Any] | None, timeout_s: float, what: str) -> None:
    """Block until a part's ready future is done; re-raise what its setup failed with."""
    if ready is None:
        raise RuntimeError(f"call {what}.start() before wait_until_ready()")
    try:
        ready.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        if ready.done():  # setup itself timed out
            raise
        raise TimeoutError(f"{what} not ready within {timeout_s} s") from None
    except concurrent.futures.CancelledError:
        raise PartStopped(f"{what} was shut down before it was ready") from None


class BackgroundPart:
    """start once, wait until ready with a timeout, shut down (idempotent, safe before start)."""

    def __init__(self) -> None:
        self._lifecycle = threading.Lock()
        self._started = False
        self._stopped = False
        self._ready: concurrent.futures.Future[Any] | None = None

    @property
    def part_name(self) -> str:
        """How errors and logs name this part."""
        return type(self).__name__

    def start(self) -> None:
        """Begin the work (at most once); `wait_until_ready` waits for it to serve."""
        with self._lifecycle:
            if self._started or self._stopped:
                raise RuntimeError(f"a {self.part_name} can be started once")
            self._started = True
            self._ready = self._begin()

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the part serves; TimeoutError after `timeout_s`, or what setup raised."""
        wait_ready(self._ready, timeout_s, self.part_name)

    def shutdown(self) -> None:
        """Stop the part. Idempotent; safe before start() and from any thread."""
        with self._lifecycle:
            if self._stopped:
                return
            self._stopped = True
            started = self._started
        if started:
            self._end()

    @property
    def started(self) -> bool:
        return self._started

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _begin(self) -> concurrent.futures.Future[Any]:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError


class ThreadPart(BackgroundPart):
    """A background part that is one daemon thread running `_run` until `_stop` is set (the
    heartbeat, the DHT rejoiner); `shutdown` waits for it at most `join_timeout_s`."""

    def __init__(self, name: str, join_timeout_s: float) -> None:
        super().__init__()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._join_timeout_s = join_timeout_s

    def _run(self) -> None:
        raise NotImplementedError

    def _begin(self) -> concurrent.futures.Future[Any]:
        self._thread.start()
        return ready_now()

    def _end(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._join_timeout_s)
