"""Round notes: short messages one peer hands another directly, so that a two-stage round
(peer/stage_two.py) need not wait for the DHT to carry them. A note only says sooner what the
DHT says anyway: a stage-one seal (signed; the delegate checks it as it checks one read from the
DHT) or "the update on version v is committed, with this result hash" (where to replay from).
Nothing depends on a note arriving: whoever waits for one still reads the DHT, less often.

    box = NoteBox(service, prefix, allow, version)     # every peer that accepts connections
    box.start(); box.wait_until_ready(timeout_s=30)
    box.post(peer, Note.SEAL, version, seal_bytes)     # returns at once; delivered in the loop
    box.received(Note.SEAL, version)                   # {sender: body}
    box.wait(Note.SEAL, version, senders, timeout_s)   # True once all of `senders` posted

Wire protocol (v1), one libp2p stream on the handler `<prefix>-notes`, frames as hivemind's
`P2P.send_raw_data`:

    sender   -> receiver : b"DLNO" + u8 protocol version + u8 kind + u64 base version + body
    receiver -> sender   : b"OK" | b"NO"

A hostile sender is bounded: a note of more than MAX_NOTE_BYTES is refused before it is read; a
sender the allowlist refuses is not read; a note is kept for one of the newest MAX_VERSIONS
(kind, version) pairs, on a version at most WINDOW from the receiver's, from at most
MAX_SENDERS senders each, the first note of a sender only; at most MAX_OPEN streams are read at
once. Many keys (no allowlist) can fill a version's senders first: the notes of the real members
are then refused, and the round reads the DHT, as it did before notes. A note's body is never
trusted: a seal is verified where it is used; an update note only says where to replay from,
and the replayed update's certificate and hash are checked as in any catch-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import struct
import threading
from collections.abc import Callable, Collection

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco_peer.coordinator_free.seals import MAX_SEAL_BYTES
from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S, HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, linger, read_frame

logger = logging.getLogger(__name__)

_HEAD = struct.Struct(">4sBBQ")
_MAGIC = b"DLNO"
_VERSION = 1
_OK, _NO = b"OK", b"NO"
MAX_NOTE_BYTES = _HEAD.size + MAX_SEAL_BYTES
"""The largest note read (a stage-one seal is the largest body)."""
MAX_VERSIONS = 8
"""(kind, version) pairs whose notes are kept; the oldest is forgotten first."""
WINDOW = 2
"""A note is read only for a version at most this far from the receiver's."""
MAX_SENDERS = 64
"""Senders kept per (kind, version): a group of more members (`group_size` above 64) reads the
others' seals from the DHT, as without notes."""
MAX_OPEN = 16
"""Note streams read at once; more are refused."""
SEND_TIMEOUT_S = 5.0
"""One note's delivery (opening the stream, the note, the answer)."""


class Note(enum.IntEnum):
    SEAL = 1
    """A member's stage-one seal, to its group's delegate (body: the seal)."""
    UPDATE = 2
    """The delegate committed the update on the base version, to its group's members (body:
    the update's result hash, 64 hex characters)."""


def pack_note(kind: Note, version: int, body: bytes) -> bytes:
    return _HEAD.pack(_MAGIC, _VERSION, int(kind), version) + body


def unpack_note(raw: bytes) -> tuple[Note, int, bytes]:
    """(kind, base version, body); ValueError for anything but a v1 note of a known kind."""
    if len(raw) < _HEAD.size:
        raise ValueError(f"a note of {len(raw)} bytes")
    magic, version, kind, base = _HEAD.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"unknown note protocol {magic!r} v{version}")
    return Note(kind), base, raw[_HEAD.size :]


class Notes:
    """The notes received, per (kind, version): thread-safe, bounded (see the module
    docstring). The loop thread adds; the training thread reads and waits."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Note, int], dict[str, bytes]] = {}
        self._changed = threading.Condition()

    def add(self, sender: str, kind: Note, version: int, body: bytes) -> bool:
        """Keep `body` unless the bounds say no (False)."""
        with self._changed:
            key = (kind, version)
            notes = self._kept.get(key)
            if notes is None:
                if len(self._kept) >= MAX_VERSIONS:
                    if version <= min(v for _, v in self._kept):
                        return False  # older than everything kept: not worth a newer slot
                    self._kept.pop(min(self._kept, key=lambda k: k[1]))
                notes = self._kept[key] = {}
            if sender in notes or len(notes) >= MAX_SENDERS:
                return False
            notes[sender] = body
            self._changed.notify_all()
            return True

    def received(self, kind: Note, version: int) -> dict[str, bytes]:
        with self._changed:
            return dict(self._kept.get((kind, version), {}))

    def wait(self, kind: Note, version: int, senders: Collection[str], timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every one of `senders` posted a note of `kind` on
        `version`; whether they all did."""
        with self._changed:
            return self._changed.wait_for(
                lambda: set(senders) <= set(self._kept.get((kind, version), {})), timeout_s
            )


class NoteBox(HandlerServer):
    """Both sides of round notes on the process's P2PService: `post` sends, the handler keeps
    what others send in `notes`."""

    def __init__(
        self,
        service: P2PService,
        prefix: str,
        allow: Callable[[str], bool],
        version: Callable[[], int],
    ) -> None:
        super().__init__(service)
        self._handler_name = f"{prefix}-notes"
        self._allow = allow
        self._version = version
        """The receiver's version: notes on versions more than WINDOW away are refused."""
        self.notes = Notes()
        self._open = 0  # loop thread only

    @property
    def handler_name(self) -> str:
        return self._handler_name

    def received(self, kind: Note, version: int) -> dict[str, bytes]:
        return self.notes.received(kind, version)

    def wait(self, kind: Note, version: int, senders: Collection[str], timeout_s: float) -> bool:
        return self.notes.wait(kind, version, senders, timeout_s)

    def post(self, peer: str, kind: Note, version: int, body: bytes = b"") -> None:
        """Send a note to `peer` in the background (bounded by SEND_TIMEOUT_S); a note that
        does not arrive is logged, never raised: the DHT carries the same news."""
        if len(body) + _HEAD.size > MAX_NOTE_BYTES or not self._service.is_running:
            return
        try:
            future = asyncio.run_coroutine_threadsafe(
                self._send(peer, pack_note(kind, version, body)), self._service.loop
            )
        except RuntimeError:  # the loop is closing
            return
        future.add_done_callback(_logged)

    async def _send(self, peer: str, note: bytes) -> None:
        async def deliver() -> bytes:
            _, reader, writer = await self._service.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), self._handler_name
            )
            try:
                await P2P.send_raw_data(note, writer)
                return await read_frame(reader, len(_OK), ValueError)
            finally:
                writer.close()

        answer = await asyncio.wait_for(deliver(), SEND_TIMEOUT_S)
        if answer != _OK:
            raise ValueError(f"note refused by {peer[-6:]}")

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = info.peer_id.to_base58()
        answer = _NO
        try:
            if self._open < MAX_OPEN and self._allow(sender):
                self._open += 1
                try:
                    raw = await asyncio.wait_for(
                        read_frame(reader, MAX_NOTE_BYTES, ValueError), HANDLER_CALL_TIMEOUT_S
                    )
                finally:
                    self._open -= 1
                kind, version, body = unpack_note(raw)
                near = abs(version - self._version()) <= WINDOW
                answer = _OK if near and self.notes.add(sender, kind, version, body) else _NO
            await asyncio.wait_for(P2P.send_raw_data(answer, writer), HANDLER_CALL_TIMEOUT_S)
            await linger(reader, HANDLER_CALL_TIMEOUT_S)
        except (ValueError, *STREAM_ERRORS) as e:
            logger.debug("a note from %s not read: %r", sender[-6:], e)
        finally:
            writer.close()


def _logged(future: concurrent.futures.Future[None]) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        logger.debug("a note was not delivered: %r", error)
