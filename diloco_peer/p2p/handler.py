"""HandlerServer: one binary stream handler of a component on the process's P2PService, with
the package's one lifecycle (lifecycle.py).

    server = StateServer(service, "run1", provide)   # a HandlerServer
    server.start()                                   # registers the handler on the loop
    server.wait_until_ready(timeout_s=30)            # ... once the service's replica is up
    server.shutdown()                                # removes it; idempotent
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

from diloco_peer.errors import P2PServiceStopped, PartStopped
from diloco_peer.lifecycle import BackgroundPart
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS

logger = logging.getLogger(__name__)

HANDLER_CALL_TIMEOUT_S = 10.0
"""Registering or removing a stream handler with the local p2p daemon."""


class HandlerServer(BackgroundPart):
    """A subclass names its handler (`handler_name`), serves streams (`_handle`), and may extend
    `_unregister` to end the streams it is serving; `_shutdown_s` bounds the whole removal."""

    _shutdown_s: float = 2 * HANDLER_CALL_TIMEOUT_S

    def __init__(self, service: P2PService) -> None:
        super().__init__()
        self._service = service

    @property
    def handler_name(self) -> str:
        raise NotImplementedError

    @property
    def part_name(self) -> str:
        return f"{type(self).__name__} {self.handler_name}"

    async def _handle(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raise NotImplementedError

    async def ready(self, timeout_s: float) -> None:
        """Inside the service's loop: wait until the handler is registered (re-raises what
        registering failed with)."""
        if self._ready is None:
            raise PartStopped(f"{self.part_name} was not started")
        # shielded: a waiter that times out must not cancel the registration itself
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._ready)), timeout_s)

    def _begin(self) -> concurrent.futures.Future[None]:
        """Register the handler on the loop once the service's replica is connected; from then
        on, peers' streams reach `_handle`."""
        return asyncio.run_coroutine_threadsafe(self._register(), self._service.loop)

    def _end(self) -> None:
        if not self._service.is_running:
            return
        try:
            self._service.run(self._unregister(), self._shutdown_s)
        except (TimeoutError, P2PServiceStopped) as e:
            logger.warning("%s: shutdown incomplete: %r", self.handler_name, e)

    async def _register(self) -> None:
        p2p = await self._service.ready(HANDLER_CALL_TIMEOUT_S)
        await asyncio.wait_for(
            p2p.add_binary_stream_handler(self.handler_name, self._handle), HANDLER_CALL_TIMEOUT_S
        )

    async def _unregister(self) -> None:
        try:
            await asyncio.wait_for(
                self._service.p2p.remove_binary_stream_handler(self.handler_name),
                HANDLER_CALL_TIMEOUT_S,
            )
        except STREAM_ERRORS as e:
            logger.debug("removing handler %s failed: %r", self.handler_name, e)
