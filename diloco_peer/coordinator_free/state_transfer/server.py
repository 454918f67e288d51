"""StateServer: a donor's side of the state transfer (wire.py), on the process's P2PService.

`provide` and `updates` are called in the service's loop thread for every request, so they must
be cheap: a blob built once per version and cached, a dict lookup such as `UpdateLog.get`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco_peer.coordinator_free.state_transfer.wire import (
    CHUNK_BYTES,
    MAX_DISCARD_BYTES,
    MAX_REQUEST_BYTES,
    Header,
    RangeRequest,
    Refusal,
    Request,
    StateBlob,
    UpdateRequest,
    check_run,
    handler_name,
    parse_request,
)
from diloco_peer.coordinator_free.update_log import peek_update
from diloco_peer.errors import RefusalCode
from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S, HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.slots import SenderSlots
from diloco_peer.p2p.streams import STREAM_ERRORS, linger

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
"""How long a donor waits for the request on a stream it did not open."""
CHUNK_SEND_TIMEOUT_S = 30.0
"""How long a donor waits for one chunk to leave (a requester reading under ~35 kB/s is dropped)."""
MIN_UPLOAD_BYTES_S = 64 << 10
"""The slowest average rate a requester may read an answer at (after UPLOAD_GRACE_S): a peer
that drains slower loses its upload slot, so a slow or hostile reader holds one for at most
UPLOAD_GRACE_S + its bytes / 64 KiB/s (a 40 MB state: ~11 min). 64 KiB/s is half a megabit,
below any link a peer that trains could use, and about what a multi-donor download already
demands of a donor (multi.STALL_TIMEOUT_S: 1 MiB in 15 s)."""
UPLOAD_GRACE_S = 10.0
"""Time an answer gets on top of its bytes at MIN_UPLOAD_BYTES_S: opening a stream over a slow
WAN, the requester's first reads and the buffers between the donor and its stream."""
MAX_UPLOADS_PER_PEER = 2
"""Downloads one requester may have served at once by one donor: a multi-donor download's
default streams per donor. One key cannot take all of `max_uploads`; a busy refusal tells a
requester with more to ask again later."""
SHUTDOWN_GRACE_S = 3.0
"""How long shutdown lets uploads in progress go on before cancelling them."""


class _TooSlow(Exception):
    """A requester read an answer slower than the server's minimum rate (never leaves here)."""


@dataclass(frozen=True)
class _Answer:
    """What a donor sends for one request: the OK header's fields and the data."""

    what: str
    """For logs: "version 7" (the full state), "bytes 0..4194304 of version 7" or "update 3->4"."""
    version: int
    hash: str
    data: bytes
    """The whole blob: the header names its length, whatever part of it is sent."""
    start: int = 0
    end: int | None = None
    """The part of `data` sent after the header: `data[start:end]` (a ranged request)."""


class StateServer(HandlerServer):
    """Serves this peer's current state to peers that download it, on the service's loop.

    :param service: this process's P2PService (ready before `start`); shut the server down
        before the service.
    :param run: names the handler (`<run>_state`); requester and donor must use the same run.
    :param provide: called in the loop thread for each request; returns the current state as a
        cached, immutable blob, or None if there is none yet (the requester gets an error).
    :param allow: called in the loop thread with the requester's authenticated base58 peer id;
        False refuses the download (private swarms). Applies to updates as well.
    :param max_uploads: downloads served at once (full states, ranges and updates together; a
        multi-donor download keeps up to `streams_per_donor` ranges in flight per donor); more are
        refused as "busy", which bounds the upload bandwidth and memory a flock of joiners can take.
        A stream takes a slot only once its request is read and valid and its requester allowed.
    :param max_uploads_per_peer: of those, how many one requester may hold (MAX_UPLOADS_PER_PEER).
    :param min_upload_bytes_s, upload_grace_s: a requester reading an answer slower than this on
        average, after the grace, is dropped and its slot freed (MIN_UPLOAD_BYTES_S, UPLOAD_GRACE_S).
    :param earlier: called in the loop thread; returns the blob of the version just below the
        current one (`Replica.parent`), or None. A ranged request may name its hash: a joiner that
        wants the step that made the head downloads it and replays the head's update on it.
    :param updates: called in the loop thread with a base version; returns the serialised
        UpdateRecord from that version (e.g. `UpdateLog.get`), or None if not kept. Without it,
        update requests are refused.
    :param frame_bytes: the largest data frame sent, at most CHUNK_BYTES (what requesters of
        every build accept); smaller frames let `pace` act within a range.
    :param pace: awaited before each data frame with (the answer's number: 1 for this server's
        first answer with data, then 2, ...; the bytes of it sent so far; the frame's length),
        within CHUNK_SEND_TIMEOUT_S; None sends as fast as the stream takes them. A handed-in
        rate limit or fault: tests make a slow donor (a sleep per frame) or one that stops in
        the middle of an answer (a long sleep) with it.
    """

    max_request_bytes: int = MAX_REQUEST_BYTES
    """The longest request frame read. Builds before ranged requests read at most
    `UPDATE_REQUEST.size` bytes and refused longer ones as a bad request without reading them
    (tests emulate such a donor by lowering this and `max_discard_bytes` in a subclass)."""
    max_discard_bytes: int = MAX_DISCARD_BYTES
    """A longer request of at most this many bytes is read before it is refused."""

    _shutdown_s = HANDLER_CALL_TIMEOUT_S + SHUTDOWN_GRACE_S + 1.0
    """Removing the handler, then letting uploads end for a moment before cancelling them."""

    def __init__(
        self,
        service: P2PService,
        run: str,
        provide: Callable[[], StateBlob | None],
        *,
        allow: Callable[[str], bool] = lambda peer_id: True,
        max_uploads: int = 4,
        max_uploads_per_peer: int = MAX_UPLOADS_PER_PEER,
        updates: Callable[[int], bytes | None] | None = None,
        earlier: Callable[[], StateBlob | None] | None = None,
        frame_bytes: int = CHUNK_BYTES,
        pace: Callable[[int, int, int], Awaitable[None]] | None = None,
        min_upload_bytes_s: float = MIN_UPLOAD_BYTES_S,
        upload_grace_s: float = UPLOAD_GRACE_S,
    ) -> None:
        self._run = check_run(run)
        if not callable(provide) or not callable(allow):
            raise ValueError("provide and allow must be callables")
        for name, value in (("updates", updates), ("earlier", earlier)):
            if value is not None and not callable(value):
                raise ValueError(f"{name} must be a callable or None")
        self._uploads = SenderSlots(max_uploads, max_uploads_per_peer)  # ValueError if not >= 1
        for name, value in (("min_upload_bytes_s", min_upload_bytes_s),
                            ("upload_grace_s", upload_grace_s)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if (
            isinstance(frame_bytes, bool)
            or not isinstance(frame_bytes, int)
            or not 1 <= frame_bytes <= CHUNK_BYTES
        ):
            raise ValueError(f"frame_bytes must be an integer in [1, {CHUNK_BYTES}]")
        if pace is not None and not callable(pace):
            raise ValueError("pace must be a callable or None")
        super().__init__(service)
        self._frame_bytes, self._pace = frame_bytes, pace
        self._answers = 0  # answers with data so far (loop thread only), for `pace`
        self._provide, self._allow = provide, allow
        self._updates, self._earlier = updates, earlier
        self._min_upload_bytes_s, self._upload_grace_s = min_upload_bytes_s, upload_grace_s
        self._serving: set[asyncio.Task[None]] = set()  # loop thread only

    @property
    def run(self) -> str:
        """The run name requesters pass to `download_state`."""
        return self._run

    @property
    def handler_name(self) -> str:
        return handler_name(self._run)

    async def _register(self) -> None:
        """From now on, peers may download the state `provide` returns."""
        await super()._register()
        logger.info("[%s] serving state as %s", self._service.peer_id[-6:], self.handler_name)

    async def _unregister(self) -> None:
        await super()._unregister()
        if self._serving:
            _, late = await asyncio.wait(set(self._serving), timeout=SHUTDOWN_GRACE_S)
            for task in late:
                task.cancel()

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        requester = info.peer_id.to_base58()  # authenticated by libp2p
        tag = f"[{self._service.peer_id[-6:]} state {self._run}]"
        if task is not None:
            self._serving.add(task)
        holds_slot = False
        try:
            try:
                answer = self._answer(await self._read(requester, reader))
                # a slot only for an allowed peer's valid request that has an answer, and never
                # more than max_uploads_per_peer for one peer: a key cannot hold the others'
                if not self._uploads.take(requester):
                    why = self._uploads.why_not(requester)
                    raise Refusal(RefusalCode.BUSY, f"busy: upload slots {why}, try later")
            except Refusal as e:
                logger.info("%s refused %s: %s", tag, requester[-6:], e)
                await asyncio.wait_for(P2P.send_raw_data(e.encode(), writer), REQUEST_TIMEOUT_S)
                await linger(reader)
                return
            holds_slot = True
            started = time.perf_counter()
            sent = await self._send(answer, writer)
            self._uploads.give(requester)  # sent: waiting for the requester to close costs none
            holds_slot = False
            await linger(reader)
            logger.log(
                logging.INFO if answer.end is None else logging.DEBUG,  # ranges: many per join
                "%s sent %s (%d bytes) to %s in %.2f s",
                tag,
                answer.what,
                sent,
                requester[-6:],
                time.perf_counter() - started,
            )
        except _TooSlow as e:
            logger.info("%s upload to %s dropped: %s", tag, requester[-6:], e)
        except STREAM_ERRORS as e:
            logger.info("%s upload to %s broken off: %r", tag, requester[-6:], e)
        finally:
            writer.close()
            if holds_slot:
                self._uploads.give(requester)
            if task is not None:
                self._serving.discard(task)

    async def _send(self, answer: _Answer, writer: asyncio.StreamWriter) -> int:
        """The OK header, then the data in frames, each within CHUNK_SEND_TIMEOUT_S and all of
        them at `min_upload_bytes_s` on average (after `upload_grace_s`): _TooSlow otherwise.
        Only the time spent waiting for the requester to take frames counts, not `pace`.
        Returns the data bytes sent."""
        header = Header(answer.version, len(answer.data), answer.hash).encode()
        await asyncio.wait_for(P2P.send_raw_data(header, writer), CHUNK_SEND_TIMEOUT_S)
        self._answers += 1
        number = self._answers
        sending_s = 0.0  # time the requester took to take the frames so far
        # slices share the blob's memory: no copy per range or per chunk
        view = memoryview(answer.data)[answer.start : answer.end]
        for offset in range(0, len(view), self._frame_bytes):
            chunk = view[offset : offset + self._frame_bytes]
            if self._pace is not None:
                await asyncio.wait_for(self._pace(number, offset, len(chunk)), CHUNK_SEND_TIMEOUT_S)
            # the frame must be out by when the minimum rate would have sent it
            owed_s = self._upload_grace_s + (offset + len(chunk)) / self._min_upload_bytes_s
            left_s = min(CHUNK_SEND_TIMEOUT_S, owed_s - sending_s)
            started = time.perf_counter()
            try:
                await asyncio.wait_for(P2P.send_raw_data(chunk, writer), left_s)
            except asyncio.TimeoutError:
                raise _TooSlow(
                    f"{offset} of {len(view)} bytes taken in {sending_s + left_s:.1f} s, under "
                    f"{self._min_upload_bytes_s} bytes/s or {CHUNK_SEND_TIMEOUT_S} s for a frame"
                ) from None
            sending_s += time.perf_counter() - started
        return len(view)

    async def _read(self, requester: str, reader: asyncio.StreamReader) -> Request:
        """Read and parse the request, and check the requester against `allow`; raises Refusal.
        Nothing here holds an upload slot."""
        raw = await asyncio.wait_for(
            _read_request(reader, self.max_request_bytes, self.max_discard_bytes),
            REQUEST_TIMEOUT_S,
        )
        request = parse_request(raw)
        try:
            allowed = bool(self._allow(requester))
        except Exception as e:  # a broken allow() refuses rather than serving by accident
            logger.exception("allow(%s) failed", requester[-6:])
            raise Refusal(
                RefusalCode.NOT_ALLOWED, f"not allowed ({type(e).__name__} in the donor's check)"
            ) from None
        if not allowed:
            raise Refusal(
                RefusalCode.NOT_ALLOWED,
                "not allowed: this swarm does not serve its state to this peer",
            )
        return request

    def _answer(self, request: Request) -> _Answer:
        """What to send for a valid request of an allowed requester, or raises Refusal."""
        if isinstance(request, UpdateRequest):
            return self._update(request.base_version)
        blob = self._blob()
        if not isinstance(request, RangeRequest):
            return _Answer(f"version {blob.version}", blob.version, blob.state_hash, blob.data)
        # A range is only ever a part of the blob the requester named: it never mixes two states.
        earlier = self._earlier_blob()
        if earlier is not None and earlier.state_hash == request.state_hash:
            blob = earlier
        if blob.state_hash != request.state_hash:
            raise Refusal(
                RefusalCode.STATE_MOVED_ON,
                f"state moved on: this donor serves version {blob.version} "
                f"({blob.state_hash[:16]}), not {request.state_hash[:16]}",
            )
        offset, length = request.span
        if offset > len(blob.data):
            raise Refusal(
                RefusalCode.BAD_RANGE,
                f"bad range: offset {offset} beyond the state's {len(blob.data)} bytes",
            )
        end = min(len(blob.data), offset + length)  # Python ints: no overflow
        what = f"bytes {offset}..{end} of version {blob.version}"
        return _Answer(what, blob.version, blob.state_hash, blob.data, offset, end)

    def _blob(self) -> StateBlob:
        """The blob `provide` returns, or raises Refusal."""
        failed = "the donor failed to provide its state"
        try:
            blob = self._provide()
        except Exception as e:  # the caller's code: report it, keep serving others
            logger.exception("provide() failed")
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} ({type(e).__name__})") from None
        if blob is None:
            raise Refusal(RefusalCode.NO_STATE, "no state yet")
        if not isinstance(blob, StateBlob):
            logger.error("provide() returned %s, not a StateBlob", type(blob).__name__)
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} (not a StateBlob)")
        return blob

    def _earlier_blob(self) -> StateBlob | None:
        """The blob `earlier` returns, or None (none kept, or it failed)."""
        if self._earlier is None:
            return None
        try:
            blob = self._earlier()
        except Exception:  # the caller's code: report it, serve the current state only
            logger.exception("earlier() failed")
            return None
        return blob if isinstance(blob, StateBlob) else None

    def _update(self, base_version: int) -> _Answer:
        """The update from `base_version` as `updates` returns it, or raises Refusal."""
        if self._updates is None:
            raise Refusal(
                RefusalCode.NO_UPDATE_LOG, "no update log: this donor serves its full state only"
            )
        failed = f"the donor failed to provide update {base_version}"
        try:
            data = self._updates(base_version)
        except Exception as e:  # the caller's code: report it, keep serving others
            logger.exception("updates(%d) failed", base_version)
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} ({type(e).__name__})") from None
        if data is None:
            raise Refusal(RefusalCode.NO_UPDATE, f"no update from version {base_version} here")
        if not isinstance(data, bytes):
            logger.error("updates() returned %s, not bytes", type(data).__name__)
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} (not bytes)")
        try:  # reads the record's header only; the requester checks the rest
            version, result_hash = peek_update(data)
        except ValueError as e:
            logger.error("updates(%d) returned a malformed record: %s", base_version, e)
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} (malformed record)") from None
        if version != base_version:
            logger.error("updates(%d) returned the update from %d", base_version, version)
            raise Refusal(RefusalCode.DONOR_FAILED, f"{failed} (wrong record)")
        return _Answer(f"update {version}->{version + 1}", version, result_hash, data)


async def _read_request(reader: asyncio.StreamReader, max_bytes: int, discard_bytes: int) -> bytes:
    """The request frame, or raises Refusal for one longer than `max_bytes`. One of at most
    `discard_bytes` is read first: closing a stream with unread bytes resets it, and the requester
    would see the reset instead of the refusal (a newer requester needs to read "bad request")."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        if length <= discard_bytes:
            await reader.readexactly(length)
        raise Refusal(
            RefusalCode.BAD_REQUEST,
            f"bad request: frame of {length} bytes, at most {max_bytes} expected",
        )
    return await reader.readexactly(length)
