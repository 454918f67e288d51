"""State download: how a joining or behind peer gets the swarm's state (DESIGN.md §3, 1).

    server = StateServer(service, "run1", provide=lambda: cached_blob,   # every peer with state
                         updates=update_log.get)                          # and its replay log
    server.start()
    ...
    blob = download_state(service, "run1", donor_peer_id, timeout_s=600)  # joining, far behind
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
framed as hivemind's `P2P.send_raw_data` does (8-byte big-endian length, then the payload):

    requester -> donor : _REQUEST (magic b"DLST", protocol version)               the full state
                         | _UPDATE_REQUEST (magic b"DLUP", protocol version,       one update
                                            base version)
    donor -> requester : b"OK" + _HEADER (version, length, hash length) + utf-8 hash
                         | b"ER" + utf-8 reason (no state yet, no such update, refused, busy,
                                                 bad request)
    donor -> requester : the `length` data bytes, in frames of at most CHUNK_BYTES (1 MiB)

For the full state the header carries the state's version and hash; for an update, its base
version and its `result_hash` (the requester checks the version is the one it asked for). A donor
of before the update log refuses a b"DLUP" request as a bad request, so both kinds of peer mix.

Chunking keeps every frame small, so a state of hundreds of MB never becomes one giant frame. The
requester enforces `max_bytes` on the header before reading any data, checks every frame against
what is left, and bounds the whole transfer with one `timeout_s`; the donor bounds each chunk's
send, so a requester that stops reading is dropped. `allow` sees the requester's
libp2p-authenticated peer id (the stream's, never a claimed field), which is how a private swarm
refuses downloads to peers outside its allowlist.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco_peer.coordinator_free.update_log import peek_update
from diloco_peer.errors import StateTransferFailed
from diloco_peer.p2p_service import STREAM_ERRORS, P2PService, P2PServiceStopped

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
"""Run names: they name the stream handler, `<run>_state`."""
_REQUEST = struct.Struct("<4sB")  # magic, protocol version
_MAGIC = b"DLST"
_UPDATE_REQUEST = struct.Struct("<4sBQ")  # magic, protocol version, base version
_UPDATE_MAGIC = b"DLUP"
_PROTOCOL_VERSION = 1
_MAX_VERSION = 2**63 - 1
_HEADER = struct.Struct("<QQH")  # state version, data length, state hash length; the hash follows
_OK, _ERROR = b"OK", b"ER"
CHUNK_BYTES = 1 << 20
"""Data frame size: large enough that framing costs nothing, small enough to bound buffers."""
_MAX_HASH_BYTES = 256
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
_CALL_SLACK_S = 5.0
"""Backstop on top of a download's own timeout, for the calling thread's wait on the loop."""
_P2P_ERRORS = STREAM_ERRORS
"""What a broken, refused or timed-out stream raises (ConnectionError is an OSError,
IncompleteReadError an EOFError)."""


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
    """One `P2P.send_raw_data` frame, refusing one longer than `max_bytes` before reading it."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise StateTransferFailed(f"frame of {length} bytes, at most {max_bytes} expected")
    return await reader.readexactly(length)


class _Refusal(Exception):
    """Why a donor answers a request with an error instead of the state."""


@dataclass(frozen=True)
class _Answer:
    """What a donor sends for one request: the OK header's fields and the data."""

    what: str
    """For logs: "version 7" (the full state) or "update 3->4"."""
    version: int
    hash: str
    data: bytes


class StateServer:
    """Serves this peer's current state to peers that download it, on the service's loop.

    :param service: this process's P2PService (ready before `start`); shut the server down
        before the service.
    :param run: names the handler (`<run>_state`); requester and donor must use the same run.
    :param provide: called in the loop thread for each request; returns the current state as a
        cached, immutable blob, or None if there is none yet (the requester gets an error).
    :param allow: called in the loop thread with the requester's authenticated base58 peer id;
        False refuses the download (private swarms). Applies to updates as well.
    :param max_uploads: downloads served at once (full states and updates together); more are
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
        self._service, self._provide, self._allow = service, provide, allow
        self._updates = updates
        self._max_uploads = max_uploads
        self._serving: set[asyncio.Task[None]] = set()  # loop thread only
        self._lifecycle = threading.Lock()
        self._started = self._stopped = False

    @property
    def run(self) -> str:
        """The run name requesters pass to `download_state`."""
        return self._run

    @property
    def handler_name(self) -> str:
        return _handler_name(self._run)

    def start(self) -> None:
        """Register the handler; from now on, peers may download the state `provide` returns."""
        with self._lifecycle:
            if self._started or self._stopped:
                raise RuntimeError("a StateServer can be started once")
            self._started = True
        self._service.run(self._register(), _HANDLER_TIMEOUT_S + _CALL_SLACK_S)
        logger.info("[%s] serving state as %s", self._service.peer_id[-6:], self.handler_name)

    def shutdown(self) -> None:
        """Stop serving: remove the handler, let uploads end for a moment, cancel the rest.
        Idempotent; safe before start()."""
        with self._lifecycle:
            if self._stopped:
                return
            self._stopped = True
        if not self._started or not self._service.is_running:
            return
        try:
            self._service.run(self._unregister(), _HANDLER_TIMEOUT_S + _SHUTDOWN_GRACE_S + 1.0)
        except (TimeoutError, P2PServiceStopped) as e:
            logger.warning("StateServer %s: shutdown incomplete: %r", self._run, e)

    async def _register(self) -> None:
        p2p = await self._service.ready(_HANDLER_TIMEOUT_S)
        await asyncio.wait_for(
            p2p.add_binary_stream_handler(self.handler_name, self._handle), _HANDLER_TIMEOUT_S
        )

    async def _unregister(self) -> None:
        try:
            await asyncio.wait_for(
                self._service.p2p.remove_binary_stream_handler(self.handler_name),
                _HANDLER_TIMEOUT_S,
            )
        except _P2P_ERRORS as e:
            logger.debug("removing handler %s failed: %r", self.handler_name, e)
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
                return
            hashed = answer.hash.encode()
            header = _OK + _HEADER.pack(answer.version, len(answer.data), len(hashed)) + hashed
            await asyncio.wait_for(P2P.send_raw_data(header, writer), _CHUNK_SEND_TIMEOUT_S)
            started = time.perf_counter()
            view = memoryview(answer.data)  # slices share the blob's memory, no copy per chunk
            for offset in range(0, len(view), CHUNK_BYTES):
                chunk = view[offset : offset + CHUNK_BYTES]
                await asyncio.wait_for(P2P.send_raw_data(chunk, writer), _CHUNK_SEND_TIMEOUT_S)
            logger.info(
                "%s sent %s (%d bytes) to %s in %.2f s",
                tag,
                answer.what,
                len(answer.data),
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
        try:
            raw = await asyncio.wait_for(
                _read_frame(reader, _UPDATE_REQUEST.size), _REQUEST_TIMEOUT_S
            )
        except StateTransferFailed as e:
            raise _Refusal(f"bad request: {e}") from None
        base_version: int | None = None  # None: the full state
        if len(raw) == _REQUEST.size:
            magic, version = _REQUEST.unpack(raw)
            known = magic == _MAGIC
        elif len(raw) == _UPDATE_REQUEST.size:
            magic, version, base_version = _UPDATE_REQUEST.unpack(raw)
            known = magic == _UPDATE_MAGIC
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
        return _Answer(f"version {blob.version}", blob.version, blob.state_hash, blob.data)

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
    version, state_hash, data = _fetch(
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
    version, _, data = _fetch(
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


def _check_download(run: str, timeout_s: float, max_bytes: int) -> None:
    _check_run(run)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")


def _fetch(
    service: P2PService,
    run: str,
    peer_id: str,
    request: bytes,
    what: str,
    timeout_s: float,
    max_bytes: int,
    progress: _Progress,
) -> tuple[int, str, bytes]:
    """One download of `what` (for messages): the answer's version, hash and data."""
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
        version, hash_, data = service.run(
            _download(service, run, donor, request, timeout_s, max_bytes, progress),
            timeout_s + _CALL_SLACK_S,
        )
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
    logger.info(
        "%s got version %d: %d bytes in %.2f s (%.1f MB/s)",
        tag,
        version,
        len(data),
        elapsed_s,
        len(data) / 1e6 / max(elapsed_s, 1e-9),
    )
    return version, hash_, data


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


async def _download(
    service: P2PService,
    run: str,
    donor: PeerID,
    request: bytes,
    timeout_s: float,
    max_bytes: int,
    progress: _Progress,
) -> tuple[int, str, bytes]:
    try:
        return await asyncio.wait_for(
            _transfer(service.p2p, _handler_name(run), donor, request, max_bytes, progress),
            timeout_s,
        )
    except asyncio.TimeoutError:
        raise StateTransferFailed(
            f"timed out after {timeout_s} s ({progress.describe()})"
        ) from None
    except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
        raise StateTransferFailed(f"{type(e).__name__}: {e}") from None
    except (OSError, EOFError, struct.error) as e:
        raise StateTransferFailed(
            f"stream broken ({progress.describe()}): {type(e).__name__}: {e}"
        ) from None


async def _transfer(
    p2p: P2P,
    handler_name: str,
    donor: PeerID,
    request: bytes,
    max_bytes: int,
    progress: _Progress,
) -> tuple[int, str, bytes]:
    """One download on one stream; the caller bounds its time."""
    _, reader, writer = await p2p.call_binary_stream_handler(donor, handler_name)
    try:
        await P2P.send_raw_data(request, writer)
        first = await _read_frame(reader, _MAX_FIRST_FRAME_BYTES)
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
        progress.total = length
        chunks: list[bytes] = []  # grows with what really arrives, whatever length claims
        while progress.received < length:
            chunk = await _read_frame(reader, min(CHUNK_BYTES, length - progress.received))
            if not chunk:
                raise StateTransferFailed("malformed stream (empty data frame)")
            chunks.append(chunk)
            progress.add(len(chunk))
        return version, hash_, b"".join(chunks)
    finally:
        writer.close()


__all__ = [
    "CHUNK_BYTES",
    "StateBlob",
    "StateServer",
    "StateTransferFailed",
    "download_state",
    "download_update",
]
