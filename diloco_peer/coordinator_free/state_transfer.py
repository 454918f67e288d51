"""State download: how a joining or behind peer gets the swarm's state (DESIGN.md §3, 1).

    server = StateServer(service, "run1", provide=lambda: cached_blob,   # every peer with state
                         updates=update_log.get)                          # and its replay log
    server.start()
    ...
    blob = download_state(service, "run1", donor_peer_id, timeout_s=600)  # joining, far behind
    blob = download_state_multi(service, "run1", donor_ids, head_hash,     # or from several
                                timeout_s=600)                              # donors at once
    tensors = safetensors_load(blob.data)      # safetensors, never pickle (DESIGN.md §4)
    if my_state_hash(tensors) != advertised_hash: ...  # the caller checks, see below
    ...
    data = download_update(service, "run1", donor_peer_id, state.version, timeout_s=60)
    record = UpdateRecord.from_bytes(data, shapes=...)   # behind by <= L: replay (update_log.py)

A donor serves the state it holds as one immutable blob: safetensors bytes (tensors plus string
metadata, `safetensors.torch.save(tensors, metadata)`), its version and its state hash. `provide`
is called in the service's loop thread for every request, so it must be cheap: return a blob built
once per version and cached, or None while there is no state yet.

A donor with an update log also serves single updates: `updates(base_version)` (also called in
the loop thread, so a dict lookup such as `UpdateLog.get`) returns the serialised UpdateRecord
that takes its state from `base_version` to `base_version + 1`, or None when it no longer (or
never) had it. `download_update` returns those bytes raw; `UpdateRecord.from_bytes` parses them.

**The requester does not trust the header.** `StateBlob.version` and `StateBlob.state_hash` are
what the donor claims; a buggy or hostile donor can send any bytes under any hash. The caller must
load `data` with safetensors (which never executes code), recompute the state hash itself, and
compare it with the hash the head peers advertise in their signed DHT records before using it.
Likewise an update is checked by replaying it: the result must hash to its `result_hash`, and the
last one to the advertised head.

Wire protocol (v1), one libp2p stream per download on the handler `<run>_state`, every message
framed as hivemind's `P2P.send_raw_data` does (8-byte big-endian length, then the payload;
integers little-endian):

    requester -> donor : _REQUEST (magic b"DLST", protocol version)               the full state
                         | _UPDATE_REQUEST (magic b"DLUP", protocol version,       one update
                                            base version u64)
                         | _RANGE_REQUEST (magic b"DLRG", protocol version,        part of the
                                           offset u64, length u64 >= 1,            full state
                                           hash length u16) + utf-8 state hash
    donor -> requester : b"OK" + _HEADER (version, length, hash length) + utf-8 hash
                         | b"ER" + utf-8 reason (no state yet, no such update, refused, busy,
                                                 bad request, state moved on, bad range)
    donor -> requester : the data bytes, in frames of at most CHUNK_BYTES (1 MiB): all `length`
                         of them, or for a range min(length asked, header length - offset)

For the full state the header carries the state's version and hash; for an update, its base
version and its `result_hash` (the requester checks the version is the one it asked for). A donor
of before the update log refuses a b"DLUP" request as a bad request, so both kinds of peer mix.

A ranged request names the state hash it wants (the head's, from the DHT). The donor answers it
only while the blob it serves has exactly that hash (else "state moved on"), with the same header
as for the full state (the whole blob's version, length and hash), then only the bytes
[offset, offset + length) of that blob, cut short at its end; an offset past the end is refused
("bad range"). So the ranges a requester gathers from several honest donors are parts of one
state, never of two. Ranged requests count against `max_uploads` and pass `allow` like any other.
A donor of before ranged requests reads at most 13 request bytes and refuses the longer b"DLRG"
frame as a bad request: `download_state_multi` then falls back to whole downloads.

Chunking keeps every frame small, so a state of hundreds of MB never becomes one giant frame. The
requester enforces `max_bytes` on the header before reading any data, checks every frame against
what is left, and bounds the whole transfer with one `timeout_s`; the donor bounds each chunk's
send, so a requester that stops reading is dropped. A multi-donor download also bounds each
stream's silence (`stall_timeout_s`), so a donor that stops sending loses its range to another
donor long before the whole download's timeout; see `download_state_multi` for how ranges are
shared out, re-queued and checked. `allow` sees the requester's libp2p-authenticated peer id (the
stream's, never a claimed field), which is how a private swarm refuses downloads to peers outside
its allowlist.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import re
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco_peer.coordinator_free.update_log import peek_update
from diloco_peer.errors import P2PServiceStopped, StateTransferFailed
from diloco_peer.p2p.handler import HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, read_frame

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
"""Run names: they name the stream handler, `<run>_state`."""
_REQUEST = struct.Struct("<4sB")  # magic, protocol version
_MAGIC = b"DLST"
_UPDATE_REQUEST = struct.Struct("<4sBQ")  # magic, protocol version, base version
_UPDATE_MAGIC = b"DLUP"
_RANGE_REQUEST = struct.Struct("<4sBQQH")  # magic, version, offset, length, hash length; + hash
_RANGE_MAGIC = b"DLRG"
_PROTOCOL_VERSION = 1
_MAX_VERSION = 2**63 - 1
_HEADER = struct.Struct("<QQH")  # state version, data length, state hash length; the hash follows
_OK, _ERROR = b"OK", b"ER"
CHUNK_BYTES = 1 << 20
"""Data frame size: large enough that framing costs nothing, small enough to bound buffers."""
RANGE_BYTES = 4 << 20
"""What `download_state_multi` asks one donor for at a time: a few frames, so that a donor that
leaves costs little to redo, and few enough requests that their round trips cost little."""
_FIRST_RANGE_BYTES = 64 << 10
"""The first range of a multi-donor download, asked of one donor before the others start: small,
since it is there to learn the blob's length."""
_MAX_HASH_BYTES = 256
_MAX_REQUEST_BYTES = _RANGE_REQUEST.size + _MAX_HASH_BYTES
_MAX_DISCARD_BYTES = 4096
"""A request longer than any known one but at most this long is read before it is refused."""
_MAX_REASON_BYTES = 512
_MAX_FIRST_FRAME_BYTES = 2 + max(_HEADER.size + _MAX_HASH_BYTES, _MAX_REASON_BYTES)

_REQUEST_TIMEOUT_S = 10.0
"""How long a donor waits for the request on a stream it did not open."""
_CHUNK_SEND_TIMEOUT_S = 30.0
"""How long a donor waits for one chunk to leave (a requester reading under ~35 kB/s is dropped)."""
_HANDLER_TIMEOUT_S = 10.0
"""Registering or removing the handler with the local p2p daemon."""
_SHUTDOWN_GRACE_S = 3.0
"""How long shutdown lets uploads in progress go on before cancelling them."""
_ANSWER_LINGER_S = 10.0
"""How long a donor keeps an answered stream open for the requester to close it (`_linger`)."""
_CALL_SLACK_S = 5.0
"""Backstop on top of a download's own timeout, for the calling thread's wait on the loop."""
_CANCEL_GRACE_S = 1.0
"""How long a download that timed out gets to end its streams before the caller is answered."""
_P2P_ERRORS = STREAM_ERRORS
"""What a broken, refused or timed-out stream raises (ConnectionError is an OSError,
IncompleteReadError an EOFError)."""
_STALL_TIMEOUT_S = 15.0
"""Multi-donor downloads: how long one donor may send nothing (no header, no frame) before its
range goes to another donor (a donor under ~70 kB/s counts as stalled)."""
_BUSY_BACKOFF_S = (0.25, 4.0)
"""Multi-donor downloads: the first and the longest wait before asking a busy donor again."""
_MAX_STREAMS_PER_DONOR = 8
_MAX_STREAM_FAILURES = 3
"""Multi-donor downloads: broken or stalled streams a donor may have before it is dropped (one
broken stream is no proof that a donor left; a refusal other than "busy" drops it at once)."""

T = TypeVar("T")


@dataclass(frozen=True)
class StateBlob:
    """One version of the replicated state as a donor serves it (immutable: share it freely)."""

    version: int
    """The state's version v (DESIGN.md §3)."""
    state_hash: str
    """`state_hash(v)` as the donor computed it: a claim to verify, not a fact."""
    data: bytes
    """safetensors bytes: `safetensors.torch.save(tensors, metadata)`."""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"version must be an int, got {self.version!r}")
        if not 0 <= self.version < 2**63:
            raise ValueError(f"version must be in [0, 2**63), got {self.version}")
        if not isinstance(self.state_hash, str) or not self.state_hash:
            raise ValueError(f"state_hash must be a non-empty str, got {self.state_hash!r}")
        if len(self.state_hash.encode()) > _MAX_HASH_BYTES:
            raise ValueError(f"state_hash must be at most {_MAX_HASH_BYTES} bytes")
        if not isinstance(self.data, bytes):
            raise ValueError(f"data must be bytes, got {type(self.data).__name__}")


def _check_run(run: str) -> str:
    if not isinstance(run, str) or not _NAME.fullmatch(run):
        raise ValueError(f"run must match {_NAME.pattern}, got {run!r}")
    return run


def _handler_name(run: str) -> str:
    return f"{run}_state"


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    return await read_frame(reader, max_bytes, StateTransferFailed)


class _Refusal(Exception):
    """Why a donor answers a request with an error instead of the state."""


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
    :param updates: called in the loop thread with a base version; returns the serialised
        UpdateRecord from that version (e.g. `UpdateLog.get`), or None if not kept. Without it,
        update requests are refused.
    """

    def __init__(
        self,
        service: P2PService,
        run: str,
        provide: Callable[[], StateBlob | None],
        *,
        allow: Callable[[str], bool] = lambda peer_id: True,
        max_uploads: int = 4,
        updates: Callable[[int], bytes | None] | None = None,
    ) -> None:
        self._run = _check_run(run)
        if not callable(provide) or not callable(allow):
            raise ValueError("provide and allow must be callables")
        if updates is not None and not callable(updates):
            raise ValueError("updates must be a callable or None")
        if isinstance(max_uploads, bool) or not isinstance(max_uploads, int) or max_uploads < 1:
            raise ValueError(f"max_uploads must be an integer >= 1, got {max_uploads!r}")
        super().__init__(service)
        self._provide, self._allow = provide, allow
        self._updates = updates
        self._max_uploads = max_uploads
        self._serving: set[asyncio.Task[None]] = set()  # loop thread only

    _max_request_bytes: ClassVar[int] = _MAX_REQUEST_BYTES
    """The longest request frame read. Builds before ranged requests read at most
    `_UPDATE_REQUEST.size` bytes and refused longer ones as a bad request without reading them
    (tests emulate such a donor by lowering this and `_max_discard_bytes`)."""
    _max_discard_bytes: ClassVar[int] = _MAX_DISCARD_BYTES
    """A longer request of at most this many bytes is read before it is refused."""

    @property
    def run(self) -> str:
        """The run name requesters pass to `download_state`."""
        return self._run

    @property
    def handler_name(self) -> str:
        return _handler_name(self._run)

    _shutdown_s = _HANDLER_TIMEOUT_S + _SHUTDOWN_GRACE_S + 1.0
    """Removing the handler, then letting uploads end for a moment before cancelling them."""

    async def _register(self) -> None:
        """From now on, peers may download the state `provide` returns."""
        await super()._register()
        logger.info("[%s] serving state as %s", self._service.peer_id[-6:], self.handler_name)

    async def _unregister(self) -> None:
        await super()._unregister()
        if self._serving:
            _, late = await asyncio.wait(set(self._serving), timeout=_SHUTDOWN_GRACE_S)
            for task in late:
                task.cancel()

    # ------------------------------------------------------------------ donor side

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        requester = info.peer_id.to_base58()  # authenticated by libp2p
        tag = f"[{self._service.peer_id[-6:]} state {self._run}]"
        busy = len(self._serving) >= self._max_uploads
        if task is not None:
            self._serving.add(task)
        try:
            try:
                answer = await self._accept(requester, reader, busy)
            except _Refusal as e:
                logger.info("%s refused %s: %s", tag, requester[-6:], e)
                reason = str(e).encode()[:_MAX_REASON_BYTES]
                await asyncio.wait_for(
                    P2P.send_raw_data(_ERROR + reason, writer), _REQUEST_TIMEOUT_S
                )
                await _linger(reader)
                return
            hashed = answer.hash.encode()
            header = _OK + _HEADER.pack(answer.version, len(answer.data), len(hashed)) + hashed
            await asyncio.wait_for(P2P.send_raw_data(header, writer), _CHUNK_SEND_TIMEOUT_S)
            started = time.perf_counter()
            # slices share the blob's memory: no copy per range or per chunk
            view = memoryview(answer.data)[answer.start : answer.end]
            for offset in range(0, len(view), CHUNK_BYTES):
                chunk = view[offset : offset + CHUNK_BYTES]
                await asyncio.wait_for(P2P.send_raw_data(chunk, writer), _CHUNK_SEND_TIMEOUT_S)
            await _linger(reader)
            logger.log(
                logging.INFO if answer.end is None else logging.DEBUG,  # ranges: many per join
                "%s sent %s (%d bytes) to %s in %.2f s",
                tag,
                answer.what,
                len(view),
                requester[-6:],
                time.perf_counter() - started,
            )
        except _P2P_ERRORS as e:
            logger.info("%s upload to %s broken off: %r", tag, requester[-6:], e)
        finally:
            writer.close()
            if task is not None:
                self._serving.discard(task)

    async def _accept(self, requester: str, reader: asyncio.StreamReader, busy: bool) -> _Answer:
        """Read and check the request; returns what to send, or raises _Refusal."""
        raw = await asyncio.wait_for(
            _read_request(reader, self._max_request_bytes, self._max_discard_bytes),
            _REQUEST_TIMEOUT_S,
        )
        base_version: int | None = None  # None: the full state
        span: tuple[int, int] | None = None  # a ranged request's offset and length
        wanted = ""  # a ranged request's state hash
        if len(raw) == _REQUEST.size:
            magic, version = _REQUEST.unpack(raw)
            known = magic == _MAGIC
        elif len(raw) == _UPDATE_REQUEST.size:
            magic, version, base_version = _UPDATE_REQUEST.unpack(raw)
            known = magic == _UPDATE_MAGIC
        elif len(raw) >= _RANGE_REQUEST.size:
            magic, version, offset, length, hash_len = _RANGE_REQUEST.unpack_from(raw)
            known = magic == _RANGE_MAGIC
            if known and version == _PROTOCOL_VERSION:
                wanted = _range_hash(raw, hash_len)
                if length == 0:
                    raise _Refusal("bad range request: empty range")
                span = (offset, length)
        else:
            raise _Refusal(f"bad request: {len(raw)} bytes")
        if not known or version != _PROTOCOL_VERSION:
            raise _Refusal(
                f"unknown request {magic!r} v{version} ({len(raw)} bytes); this donor speaks v1"
            )
        if busy:
            raise _Refusal(f"busy: {self._max_uploads} downloads in progress, try later")
        try:
            allowed = bool(self._allow(requester))
        except Exception as e:  # a broken allow() refuses rather than serving by accident
            logger.exception("allow(%s) failed", requester[-6:])
            raise _Refusal(f"not allowed ({type(e).__name__} in the donor's check)") from None
        if not allowed:
            raise _Refusal("not allowed: this swarm does not serve its state to this peer")
        if base_version is not None:
            return self._update(base_version)
        try:
            blob = self._provide()
        except Exception as e:  # the caller's code: report it, keep serving others
            logger.exception("provide() failed")
            raise _Refusal(f"the donor failed to provide its state ({type(e).__name__})") from None
        if blob is None:
            raise _Refusal("no state yet")
        if not isinstance(blob, StateBlob):
            logger.error("provide() returned %s, not a StateBlob", type(blob).__name__)
            raise _Refusal("the donor failed to provide its state (not a StateBlob)")
        if span is None:
            return _Answer(f"version {blob.version}", blob.version, blob.state_hash, blob.data)
        # A range is only ever a part of the blob the requester named: it never mixes two states.
        if blob.state_hash != wanted:
            raise _Refusal(
                f"state moved on: this donor serves version {blob.version} "
                f"({blob.state_hash[:16]}), not {wanted[:16]}"
            )
        offset, length = span
        if offset > len(blob.data):
            raise _Refusal(f"bad range: offset {offset} beyond the state's {len(blob.data)} bytes")
        end = min(len(blob.data), offset + length)  # Python ints: no overflow
        what = f"bytes {offset}..{end} of version {blob.version}"
        return _Answer(what, blob.version, blob.state_hash, blob.data, offset, end)

    def _update(self, base_version: int) -> _Answer:
        """The update from `base_version` as `updates` returns it, or raises _Refusal."""
        if self._updates is None:
            raise _Refusal("no update log: this donor serves its full state only")
        failed = f"the donor failed to provide update {base_version}"
        try:
            data = self._updates(base_version)
        except Exception as e:  # the caller's code: report it, keep serving others
            logger.exception("updates(%d) failed", base_version)
            raise _Refusal(f"{failed} ({type(e).__name__})") from None
        if data is None:
            raise _Refusal(f"no update from version {base_version} here")
        if not isinstance(data, bytes):
            logger.error("updates() returned %s, not bytes", type(data).__name__)
            raise _Refusal(f"{failed} (not bytes)")
        try:  # reads the record's header only; the requester checks the rest
            version, result_hash = peek_update(data)
        except ValueError as e:
            logger.error("updates(%d) returned a malformed record: %s", base_version, e)
            raise _Refusal(f"{failed} (malformed record)") from None
        if version != base_version:
            logger.error("updates(%d) returned the update from %d", base_version, version)
            raise _Refusal(f"{failed} (wrong record)")
        return _Answer(f"update {version}->{version + 1}", version, result_hash, data)


async def _linger(reader: asyncio.StreamReader) -> None:
    """Close a served stream only once the requester has read the answer and closed its end (or
    after _ANSWER_LINGER_S): closing right after the last write sometimes cut the answer off on
    the requester's side under load (IncompleteReadError with 0 bytes read, seen in CI), as it
    did for the all-reduce's answers."""
    try:
        await asyncio.wait_for(reader.read(1), _ANSWER_LINGER_S)
    except (asyncio.TimeoutError, *_P2P_ERRORS):
        pass


async def _read_request(reader: asyncio.StreamReader, max_bytes: int, discard_bytes: int) -> bytes:
    """The request frame, or raises _Refusal for one longer than `max_bytes`. One of at most
    `discard_bytes` is read first: closing a stream with unread bytes resets it, and the requester
    would see the reset instead of the refusal (a newer requester needs to read "bad request")."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        if length <= discard_bytes:
            await reader.readexactly(length)
        raise _Refusal(f"bad request: frame of {length} bytes, at most {max_bytes} expected")
    return await reader.readexactly(length)


def _range_hash(raw: bytes, hash_len: int) -> str:
    """The state hash a ranged request names, or raises _Refusal."""
    if hash_len != len(raw) - _RANGE_REQUEST.size or not 0 < hash_len <= _MAX_HASH_BYTES:
        raise _Refusal("bad range request: hash length")
    try:
        return raw[_RANGE_REQUEST.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise _Refusal("bad range request: hash not utf-8") from None


# ---------------------------------------------------------------------- requester side


def download_state(
    service: P2PService,
    run: str,
    peer_id: str,
    *,
    timeout_s: float,
    max_bytes: int = 2**31,
    on_progress: Callable[[int, int], None] | None = None,
) -> StateBlob:
    """Download `peer_id`'s current state for `run`; blocks the calling thread (not the loop's).

    The whole transfer (connecting included) is bounded by `timeout_s`. Returns the blob with the
    donor's *claimed* version and hash: load `data` with safetensors and recompute the hash before
    trusting any of it (module docstring). `on_progress(received_bytes, total_bytes)` is called in
    the loop thread after each chunk (progress bars; keep it cheap).
    Raises StateTransferFailed (with the reason) on any failure, ValueError on bad arguments.
    """
    _check_download(run, timeout_s, max_bytes)
    version, state_hash, _, data = _fetch(
        service,
        run,
        peer_id,
        _REQUEST.pack(_MAGIC, _PROTOCOL_VERSION),
        "state",
        timeout_s,
        max_bytes,
        _Progress(on_progress),
    )
    return StateBlob(version=version, state_hash=state_hash, data=data)


@dataclass(frozen=True)
class StateRange:
    """Part of a donor's state blob, as `download_range` returns it."""

    version: int
    """The version the donor claims for the whole blob."""
    total_bytes: int
    """The whole blob's length, as the donor claims it."""
    offset: int
    data: bytes
    """The blob's bytes [offset, offset + len(data)): the length asked for, or up to the end."""


def download_range(
    service: P2PService,
    run: str,
    donor: str,
    state_hash: str,
    offset: int,
    length: int,
    *,
    timeout_s: float,
    max_bytes: int = 2**31,
) -> StateRange:
    """Download bytes [offset, offset + length) of the state `donor` serves for `run`, provided
    the donor still serves the state `state_hash` names (the bytes never mix two states); blocks
    the calling thread, at most `timeout_s` in all. The range ends early at the blob's end.

    Raises StateTransferFailed on any failure: "state moved on" when the donor serves another
    state, "bad request" from a donor that predates ranged requests, "bad range" for an offset
    past the end, and those of `download_state`. ValueError on bad arguments.
    """
    _check_download(run, timeout_s, max_bytes)
    _check_range_args(state_hash, offset, length)
    version, _, total, data = _fetch(
        service,
        run,
        donor,
        _range_request(state_hash, offset, length),
        f"bytes {offset}+{length}",
        timeout_s,
        max_bytes,
        _Progress(None),
        span=(offset, length),
        state_hash=state_hash,
    )
    return StateRange(version=version, total_bytes=total, offset=offset, data=data)


def download_update(
    service: P2PService,
    run: str,
    donor: str,
    base_version: int,
    *,
    timeout_s: float,
    max_bytes: int = 2**31,
) -> bytes:
    """Download the update from `base_version` to `base_version + 1` that `donor` keeps for
    `run`; blocks the calling thread (not the loop's), at most `timeout_s` in all.

    Returns the serialised record as the donor sent it: parse it with `UpdateRecord.from_bytes`
    and check it by replaying it (module docstring). Raises StateTransferFailed (with the
    reason: the donor lacks that update or any update log, refused, busy, too large, timed out,
    broken stream) on any failure, ValueError on bad arguments.
    """
    _check_download(run, timeout_s, max_bytes)
    if isinstance(base_version, bool) or not isinstance(base_version, int):
        raise ValueError(f"base_version must be an int, got {base_version!r}")
    if not 0 <= base_version < _MAX_VERSION:
        raise ValueError(f"base_version must be in [0, 2**63 - 1), got {base_version}")
    version, _, _, data = _fetch(
        service,
        run,
        donor,
        _UPDATE_REQUEST.pack(_UPDATE_MAGIC, _PROTOCOL_VERSION, base_version),
        f"update {base_version}",
        timeout_s,
        max_bytes,
        _Progress(None),
    )
    if version != base_version:  # the bytes' own base version is checked by the replay
        tag = f"[{service.peer_id[-6:]} update {base_version} {run} from {donor[-6:]}]"
        raise StateTransferFailed(f"{tag} the donor answered with the update from {version}")
    return data


def download_state_multi(
    service: P2PService,
    run: str,
    donors: Sequence[str],
    state_hash: str,
    *,
    timeout_s: float,
    range_bytes: int = RANGE_BYTES,
    streams_per_donor: int = 2,
    stall_timeout_s: float = _STALL_TIMEOUT_S,
    max_bytes: int = 2**31,
    on_progress: Callable[[int, int], None] | None = None,
) -> StateBlob:
    """Download the state `state_hash` names from several donors at once, in ranges; blocks the
    calling thread (not the loop's), at most `timeout_s` in all.

    A first small ranged request (to the donors in turn) gives the blob's length; the rest is split
    into ranges of `range_bytes` that every donor takes from one shared queue, `streams_per_donor`
    at a time, so a faster donor serves more. A range whose donor fails, stalls (nothing for
    `stall_timeout_s`), is busy or has moved on to another state goes back to the queue; the donor
    is dropped (a busy one is asked again later). When the queue is empty, idle donors also fetch
    ranges still in flight elsewhere (the first copy wins), so one slow donor does not hold up the
    end. Fails only when no donor is left or `timeout_s` passes.

    Every range is asked for under `state_hash`, and a donor refuses one unless it serves that
    very state, so honest donors' bytes never mix two states; an answer whose version, length or
    hash differs from the first answer's drops its donor (so a first donor that lies about the
    length gets the honest ones dropped: the download fails, and the caller falls back to single
    donors as below). If no donor understands ranged requests
    (a build before them answers "bad request"), it falls back to `download_state` from those
    donors one by one, keeping the first whose claimed hash is `state_hash`.

    The result is only as good as the donors: a hostile donor can send wrong bytes for its ranges
    under the right hash, and nothing at this layer can tell (the state hash is computed over the
    loaded tensors, not the bytes). As with `download_state`, the caller must load `data` and
    recompute the state hash before trusting it; when that fails, download from single donors.
    `on_progress(received_bytes, total_bytes)` is called in the loop thread after each new range.
    Raises StateTransferFailed (with each donor's reason) on failure, ValueError on bad arguments.
    """
    _check_download(run, timeout_s, max_bytes)
    _check_range_args(state_hash, 0, range_bytes)
    if (
        isinstance(streams_per_donor, bool)
        or not isinstance(streams_per_donor, int)
        or not 1 <= streams_per_donor <= _MAX_STREAMS_PER_DONOR
    ):
        raise ValueError(
            f"streams_per_donor must be an integer in [1, {_MAX_STREAMS_PER_DONOR}], "
            f"got {streams_per_donor!r}"
        )
    if isinstance(stall_timeout_s, bool) or not isinstance(stall_timeout_s, (int, float)):
        raise ValueError(f"stall_timeout_s must be a number, got {stall_timeout_s!r}")
    if not (math.isfinite(stall_timeout_s) and stall_timeout_s > 0):
        raise ValueError(f"stall_timeout_s must be finite and > 0, got {stall_timeout_s!r}")
    if isinstance(donors, (str, bytes)) or not isinstance(donors, Sequence):
        raise ValueError(f"donors must be a sequence of peer ids, got {type(donors).__name__}")
    me = service.peer_id
    tag = f"[{me[-6:]} state {run} from {len(donors)} donors]"
    job = _MultiDownload(run, state_hash, range_bytes, max_bytes, stall_timeout_s, on_progress)
    for donor in dict.fromkeys(donors):  # ids come from DHT records: a network input
        if not isinstance(donor, str):
            job.reasons[repr(donor)] = "not a peer id"
        elif donor == me:
            job.reasons[donor] = "cannot download from myself"
        else:
            try:
                job.peers[donor] = PeerID.from_base58(donor)
            except (ValueError, TypeError) as e:
                job.reasons[donor] = f"malformed peer id: {e}"
    started = time.perf_counter()
    try:
        version, data = service.run(
            _bounded(job.run(service.p2p, streams_per_donor), timeout_s, job.describe),
            timeout_s + _CALL_SLACK_S,
        )
    except StateTransferFailed as e:
        logger.warning("%s failed: %s", tag, e)
        raise StateTransferFailed(f"{tag} {e}") from None
    except TimeoutError:
        reason = f"timed out after {timeout_s} s ({job.describe()})"
        logger.warning("%s %s", tag, reason)
        raise StateTransferFailed(f"{tag} {reason}") from None
    except P2PServiceStopped:
        raise StateTransferFailed(f"{tag} the P2P service was shut down") from None
    except _NoRangeDonors as e:
        left_s = timeout_s - (time.perf_counter() - started)
        return _download_whole(service, run, e.donors, state_hash, left_s, max_bytes, on_progress)
    elapsed_s = time.perf_counter() - started
    logger.info(
        "%s got version %d: %d bytes in %.2f s (%.1f MB/s); ranges per donor: %s",
        tag,
        version,
        len(data),
        elapsed_s,
        len(data) / 1e6 / max(elapsed_s, 1e-9),
        ", ".join(f"{d[-6:]} {n}" for d, n in job.served.most_common()) or "-",
    )
    return StateBlob(version=version, state_hash=state_hash, data=data)


def _download_whole(
    service: P2PService,
    run: str,
    donors: list[str],
    state_hash: str,
    timeout_s: float,
    max_bytes: int,
    on_progress: Callable[[int, int], None] | None,
) -> StateBlob:
    """The fallback to donors that predate ranged requests: whole downloads, one donor at a
    time, within what is left of the multi-donor download's `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    reasons: list[str] = []
    for donor in donors:
        left_s = deadline - time.perf_counter()
        if left_s <= 0:
            reasons.append("out of time")
            break
        try:
            blob = download_state(
                service, run, donor, timeout_s=left_s, max_bytes=max_bytes, on_progress=on_progress
            )
        except StateTransferFailed as e:
            reasons.append(str(e))
            continue
        if blob.state_hash == state_hash:
            return blob
        reasons.append(f"{donor[-6:]} serves {blob.state_hash[:16]}, not {state_hash[:16]}")
    raise StateTransferFailed(
        f"[{service.peer_id[-6:]} state {run}] no donor speaks ranged requests, and the whole "
        f"downloads failed: {'; '.join(reasons)}"
    )


def _check_download(run: str, timeout_s: float, max_bytes: int) -> None:
    _check_run(run)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")


def _check_range_args(state_hash: str, offset: int, length: int) -> None:
    if not isinstance(state_hash, str) or not 0 < len(state_hash.encode()) <= _MAX_HASH_BYTES:
        raise ValueError(f"state_hash must be a non-empty str of <= {_MAX_HASH_BYTES} bytes")
    for name, value, low in (("offset", offset, 0), ("length", length, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**64:
            raise ValueError(f"{name} must be an integer in [{low}, 2**64), got {value!r}")


def _range_request(state_hash: str, offset: int, length: int) -> bytes:
    hashed = state_hash.encode()
    return (
        _RANGE_REQUEST.pack(_RANGE_MAGIC, _PROTOCOL_VERSION, offset, length, len(hashed)) + hashed
    )


def _fetch(
    service: P2PService,
    run: str,
    peer_id: str,
    request: bytes,
    what: str,
    timeout_s: float,
    max_bytes: int,
    progress: _Progress,
    *,
    span: tuple[int, int] | None = None,
    state_hash: str | None = None,
) -> tuple[int, str, int, bytes]:
    """One download of `what` (for messages): the answer's version, hash, whole length and data
    (`span`: the [offset, offset + length) asked for; `state_hash`: what the answer must name)."""
    try:
        donor = PeerID.from_base58(peer_id)
    except (ValueError, TypeError) as e:  # ids come from DHT records: a network input
        raise StateTransferFailed(f"malformed peer id {peer_id!r}: {e}") from None
    me = service.peer_id
    tag = f"[{me[-6:]} {what} {run} from {peer_id[-6:]}]"
    if peer_id == me:
        raise StateTransferFailed(f"{tag} cannot download from myself")
    started = time.perf_counter()
    try:
        version, hash_, total, data = service.run(
            _bounded(
                _transfer(
                    service.p2p, _handler_name(run), donor, request, max_bytes, progress, span=span
                ),
                timeout_s,
                progress.describe,
            ),
            timeout_s + _CALL_SLACK_S,
        )
        if state_hash is not None and hash_ != state_hash:
            raise StateTransferFailed(f"the donor answered for state {hash_[:16]}")
    except StateTransferFailed as e:
        logger.warning("%s failed: %s", tag, e)
        raise StateTransferFailed(f"{tag} {e}") from None
    except TimeoutError:
        reason = f"timed out after {timeout_s} s ({progress.describe()})"
        logger.warning("%s %s", tag, reason)
        raise StateTransferFailed(f"{tag} {reason}") from None
    except P2PServiceStopped:
        raise StateTransferFailed(f"{tag} the P2P service was shut down") from None
    elapsed_s = time.perf_counter() - started
    logger.log(
        logging.INFO if span is None else logging.DEBUG,
        "%s got version %d: %d bytes in %.2f s (%.1f MB/s)",
        tag,
        version,
        len(data),
        elapsed_s,
        len(data) / 1e6 / max(elapsed_s, 1e-9),
    )
    return version, hash_, total, data


class _Progress:
    """Bytes received so far, for the reason of a timeout and for the caller's callback."""

    def __init__(self, callback: Callable[[int, int], None] | None) -> None:
        self.callback = callback
        self.received = 0
        self.total: int | None = None

    def add(self, count: int) -> None:
        self.received += count
        if self.callback is not None and self.total is not None:
            self.callback(self.received, self.total)

    def describe(self) -> str:
        if self.total is None:
            return "no answer from the donor"
        return f"{self.received} of {self.total} bytes received"


# Time bounds here use asyncio.wait on a task, not asyncio.wait_for: before Python 3.12,
# wait_for swallows a cancellation that arrives just as the awaited thing finishes, and a
# multi-donor download is cancelled (at its timeout) while frames arrive all the time: measured,
# a 0.05 s bound then ran on to the end of the download, or hung until the 5 s backstop.


def _consume(task: asyncio.Future[object]) -> None:
    """Done-callback of an abandoned task: fetch its exception so that none is logged unseen."""
    if not task.cancelled():
        task.exception()


async def _first_of(task: asyncio.Future[T], timeout_s: float) -> bool:
    """Wait until `task` is done (True) or `timeout_s` passed (False, `task` cancelled and
    abandoned); a cancellation of the caller cancels `task` too."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_consume)
    return bool(done)


async def _bounded(work: Awaitable[T], timeout_s: float, describe: Callable[[], str]) -> T:
    """`work` within `timeout_s`, with stream failures turned into StateTransferFailed."""
    task = asyncio.ensure_future(work)
    if not await _first_of(task, timeout_s):
        await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)  # lets its streams close
        raise StateTransferFailed(f"timed out after {timeout_s} s ({describe()})")
    try:
        return task.result()
    except asyncio.TimeoutError:  # from inside `work`
        raise StateTransferFailed(f"timed out after {timeout_s} s ({describe()})") from None
    except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
        raise StateTransferFailed(f"{type(e).__name__}: {e}") from None
    except (OSError, EOFError, struct.error) as e:
        raise StateTransferFailed(
            f"stream broken ({describe()}): {type(e).__name__}: {e}"
        ) from None


async def _within(work: Awaitable[T], timeout_s: float | None) -> T:
    """`work`, failing as stalled if it takes longer than `timeout_s` (None: no bound here)."""
    if timeout_s is None:
        return await work
    task = asyncio.ensure_future(work)
    if not await _first_of(task, timeout_s):
        raise StateTransferFailed(f"stalled: nothing for {timeout_s} s")
    return task.result()


def _close_opened(task: asyncio.Future[tuple[StreamInfo, object, asyncio.StreamWriter]]) -> None:
    """Done-callback of an abandoned stream opening: close the stream if it did open."""
    if not task.cancelled() and task.exception() is None:
        task.result()[2].close()


async def _open_stream(
    p2p: P2P, donor: PeerID, handler_name: str, timeout_s: float | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to `donor`'s handler, failing as stalled after `timeout_s` (None: no bound).

    The opening is never cancelled: hivemind's client would leak the half-open stream, and the
    donor would keep an upload slot for it until its request timeout (so that a timed-out
    download made the donor "busy" for the next one). An abandoned opening is closed once done.
    """
    task = asyncio.ensure_future(p2p.call_binary_stream_handler(donor, handler_name))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.add_done_callback(_close_opened)
        raise
    if not done:
        task.add_done_callback(_close_opened)
        raise StateTransferFailed(f"stalled: nothing for {timeout_s} s")
    _, reader, writer = task.result()
    return reader, writer


async def _transfer(
    p2p: P2P,
    handler_name: str,
    donor: PeerID,
    request: bytes,
    max_bytes: int,
    progress: _Progress,
    *,
    span: tuple[int, int] | None = None,
    stall_timeout_s: float | None = None,
) -> tuple[int, str, int, bytes]:
    """One download on one stream: the answer's version, hash, whole length and the data. For a
    ranged request, `span` is its (offset, length): the data is the part of the blob from offset,
    `length` bytes or up to the end. The caller bounds the total time; `stall_timeout_s` bounds
    opening the stream, the header and each frame."""
    reader, writer = await _open_stream(p2p, donor, handler_name, stall_timeout_s)
    try:
        await _within(P2P.send_raw_data(request, writer), stall_timeout_s)
        first = await _within(_read_frame(reader, _MAX_FIRST_FRAME_BYTES), stall_timeout_s)
        status, body = first[:2], first[2:]
        if status == _ERROR:
            raise StateTransferFailed(f"refused: {body.decode('utf-8', errors='replace')}")
        if status != _OK or len(body) < _HEADER.size:
            raise StateTransferFailed("malformed answer (not a header)")
        version, length, hash_len = _HEADER.unpack_from(body)
        if len(body) != _HEADER.size + hash_len or not 0 < hash_len <= _MAX_HASH_BYTES:
            raise StateTransferFailed("malformed header (hash length)")
        try:
            hash_ = body[_HEADER.size :].decode("utf-8")
        except UnicodeDecodeError:
            raise StateTransferFailed("malformed header (hash not utf-8)") from None
        if version > _MAX_VERSION:
            raise StateTransferFailed(f"malformed header (version {version})")
        if length > max_bytes:
            raise StateTransferFailed(f"{length} bytes exceeds max_bytes={max_bytes}")
        count = length
        if span is not None:
            offset, asked = span
            if offset > length:
                raise StateTransferFailed(f"malformed header ({length} bytes, range at {offset})")
            count = min(asked, length - offset)
        progress.total = count
        received = 0
        chunks: list[bytes] = []  # grows with what really arrives, whatever length claims
        while received < count:
            chunk = await _within(
                _read_frame(reader, min(CHUNK_BYTES, count - received)), stall_timeout_s
            )
            if not chunk:
                raise StateTransferFailed("malformed stream (empty data frame)")
            chunks.append(chunk)
            received += len(chunk)
            progress.add(len(chunk))
        return version, hash_, length, b"".join(chunks)
    finally:
        writer.close()


# ---------------------------------------------------------------------- several donors


class _NoRangeDonors(Exception):
    """No donor answered a ranged request; `donors` refused it as an unknown request (builds
    before ranged requests) or broke the stream (such a build closes it on the unread part of the
    request, which may reset it before its refusal arrives), so a whole download from one of them
    may still work."""

    def __init__(self, donors: list[str]) -> None:
        super().__init__(f"{len(donors)} donors predate ranged requests")
        self.donors = donors


def _predates_ranges(reason: str) -> bool:
    """A refusal from a donor that does not know ranged requests (see `_accept`)."""
    return reason.startswith(("refused: bad request", "refused: unknown request"))


def _stream_failed(reason: str) -> bool:
    """A failure of the stream rather than an answer of the donor's (`_range`'s reasons)."""
    return reason.startswith(("stream broken", "stalled"))


class _MultiDownload:
    """One multi-donor download: the queue of ranges and what each donor did, shared by one
    worker per stream. Lives in the service's loop thread only (no locks needed)."""

    def __init__(
        self,
        run: str,
        state_hash: str,
        range_bytes: int,
        max_bytes: int,
        stall_timeout_s: float,
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        self.handler = _handler_name(run)
        self.state_hash, self.range_bytes = state_hash, range_bytes
        self.max_bytes, self.stall_timeout_s = max_bytes, stall_timeout_s
        self.peers: dict[str, PeerID] = {}
        """Donors still in the download."""
        self.reasons: dict[str, str] = {}
        """Donors dropped, and why."""
        self.served: collections.Counter[str] = collections.Counter()
        """Ranges each donor delivered first (for logs and tests)."""
        self.failures: collections.Counter[str] = collections.Counter()
        """Broken or stalled streams per donor (`_MAX_STREAM_FAILURES` drop it)."""
        self.progress = _Progress(on_progress)
        self.expect: tuple[int, int] | None = None
        """(version, length) of the first answer: every later answer must repeat them."""
        self.done: dict[int, bytes] = {}
        self.todo: collections.deque[int] = collections.deque()
        self.fetching: dict[int, list[str]] = {}
        """Ranges in flight, and which donors fetch them (in the order they started)."""
        self.first = 0
        """The first range's length; the others start after it, every `range_bytes`."""
        self.count = 0
        self._changed = asyncio.Event()

    def describe(self) -> str:
        dropped = "; ".join(f"{d[-6:]}: {r}" for d, r in self.reasons.items()) or "none"
        return f"{self.progress.describe()}; donors dropped: {dropped}"

    def span(self, index: int) -> tuple[int, int]:
        """Range `index` as (offset, length): 0 is the first range, then `range_bytes` each."""
        if self.expect is None or index < 1:
            raise RuntimeError(f"range {index} asked before the first answer or out of order")
        offset = self.first + (index - 1) * self.range_bytes
        return offset, min(self.range_bytes, self.expect[1] - offset)

    @property
    def complete(self) -> bool:
        return self.expect is not None and len(self.done) == self.count

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # waiters hold the one that was set

    async def _changes(self, timeout_s: float) -> None:
        """Until `_notify` or `timeout_s` (a bound for the loops that call it, not a failure)."""
        await _first_of(asyncio.ensure_future(self._changed.wait()), timeout_s)

    async def run(self, p2p: P2P, streams_per_donor: int) -> tuple[int, bytes]:
        """The download: the first range, then all donors' workers; (version, data)."""
        await self._first_range(p2p)
        if self.expect is None:  # _first_range returns only once it knows the blob
            raise StateTransferFailed(f"no donor described the state ({self.describe()})")
        workers = [
            asyncio.create_task(self._work(p2p, donor))
            for donor in list(self.peers)
            for _ in range(streams_per_donor)
        ]
        for worker in workers:  # wakes the wait below once the task counts as done
            worker.add_done_callback(lambda _: self._notify())
        try:
            while not self.complete and not all(w.done() for w in workers):
                await self._changes(1.0)
            for worker in workers:  # a bug in a worker surfaces, it does not pass as a drop
                if worker.done() and not worker.cancelled() and worker.exception() is not None:
                    raise worker.exception()  # type: ignore[misc]
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if not self.complete:
            raise StateTransferFailed(f"no donor left ({self.describe()})")
        data = b"".join(self.done[i] for i in range(self.count))
        if len(data) != self.expect[1]:  # the spans add up by construction: a bug otherwise
            raise StateTransferFailed(f"assembled {len(data)} bytes, not {self.expect[1]}")
        return self.expect[0], data

    async def _first_range(self, p2p: P2P) -> None:
        """Ask the donors in turn for the first range, which names the blob's version and
        length; split the rest into ranges. Busy donors are asked again after a while (the
        caller's timeout bounds that). Raises _NoRangeDonors or StateTransferFailed."""
        old: list[str] = []  # refused ranged requests, or broke the stream: perhaps older builds
        later: dict[str, tuple[PeerID, str]] = {}  # busy or broken: perhaps fine for the ranges
        first = min(self.range_bytes, _FIRST_RANGE_BYTES)
        for attempt in itertools.count():
            for donor, peer in list(self.peers.items()):
                data, reason = await self._range(p2p, peer, 0, first)
                if reason is None and data is not None:
                    total = self.expect[1]  # type: ignore[index]
                    self.first = len(data)  # `first` bytes, or the whole blob if shorter
                    self.count = 1 + -(-(total - self.first) // self.range_bytes)
                    self.done[0] = data
                    self.served[donor] += 1
                    self.todo.extend(range(1, self.count))
                    self.progress.total = total
                    self.progress.add(len(data))
                    self.peers.update({d: p for d, (p, _) in later.items()})
                    return
                del self.peers[donor]
                if _stream_failed(reason):
                    self.failures[donor] += 1
                if reason.startswith("refused: busy") or _stream_failed(reason):
                    later[donor] = (peer, reason)
                else:
                    self.reasons[donor] = reason
                    logger.info("dropped donor %s: %s", donor[-6:], reason)
                if _predates_ranges(reason) or _stream_failed(reason):
                    old.append(donor)
            busy = {d: p for d, (p, r) in later.items() if r.startswith("refused: busy")}
            if old or not busy:
                break
            low_s, high_s = _BUSY_BACKOFF_S
            await asyncio.sleep(min(low_s * 2**attempt, high_s))
            for donor in busy:
                del later[donor]
            self.peers.update(busy)
        for donor, (_, reason) in later.items():
            self.reasons[donor] = reason
        if old:
            raise _NoRangeDonors(old)
        raise StateTransferFailed(f"no donor served the first range ({self.describe()})")

    async def _range(
        self, p2p: P2P, peer: PeerID, offset: int, length: int
    ) -> tuple[bytes | None, str | None]:
        """One ranged download, checked against the first answer: (data, None) or (None, why)."""
        try:
            version, hash_, total, data = await _transfer(
                p2p,
                self.handler,
                peer,
                _range_request(self.state_hash, offset, length),
                self.max_bytes,
                _Progress(None),
                span=(offset, length),
                stall_timeout_s=self.stall_timeout_s,
            )
        except StateTransferFailed as e:
            return None, str(e)
        except (OSError, EOFError, struct.error) as e:
            return None, f"stream broken: {type(e).__name__}: {e}"
        except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
            return None, f"{type(e).__name__}: {e}"
        if hash_ != self.state_hash:  # the donor checked the hash we named: it echoes it
            return None, f"answered for state {hash_[:16]}"
        if self.expect is None:
            self.expect = (version, total)
        elif (version, total) != self.expect:
            return None, f"inconsistent: version {version}, {total} bytes (others: {self.expect})"
        return data, None

    def _take(self, donor: str) -> int | None:
        """The next range for `donor`: from the queue, else (the end game) the oldest range in
        flight at one other donor only; None when there is nothing for it to do now."""
        if self.todo:
            return self.todo.popleft()
        for index, fetchers in self.fetching.items():  # dicts keep insertion order: oldest first
            if len(fetchers) == 1 and donor not in fetchers and index not in self.done:
                return index
        return None

    async def _work(self, p2p: P2P, donor: str) -> None:
        """One stream's worth of one donor: ranges from the queue until none is left or the
        donor is dropped."""
        peer = self.peers[donor]
        busy_streak = 0
        while not self.complete and donor in self.peers:
            index = self._take(donor)
            if index is None:
                await self._changes(1.0)
                continue
            self.fetching.setdefault(index, []).append(donor)
            try:
                data, reason = await self._range(p2p, peer, *self.span(index))
            finally:  # also when cancelled: leave the bookkeeping consistent
                fetchers = self.fetching.get(index, [])
                if donor in fetchers:
                    fetchers.remove(donor)
                if not fetchers:
                    self.fetching.pop(index, None)
            if data is not None:
                busy_streak = 0
                if index not in self.done:
                    self.done[index] = data
                    self.served[donor] += 1
                    self.progress.add(len(data))
                self._notify()
                continue
            reason = reason or "no answer"  # _range gives data or a reason, never neither
            if index not in self.done and index not in self.fetching:
                self.todo.appendleft(index)  # first in line for the next free stream
            self._notify()
            if reason.startswith("refused: busy"):
                low_s, high_s = _BUSY_BACKOFF_S
                await asyncio.sleep(min(low_s * 2**busy_streak, high_s))
                busy_streak += 1
                continue
            if _stream_failed(reason):
                self.failures[donor] += 1
                if self.failures[donor] < _MAX_STREAM_FAILURES:
                    continue
            if donor in self.peers:
                del self.peers[donor]
                self.reasons[donor] = reason
                logger.info("dropped donor %s: %s", donor[-6:], reason)


__all__ = [
    "CHUNK_BYTES",
    "RANGE_BYTES",
    "StateBlob",
    "StateRange",
    "StateServer",
    "StateTransferFailed",
    "download_range",
    "download_state",
    "download_state_multi",
    "download_update",
]
