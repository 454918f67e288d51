"""The requester's side of one download on one stream, shared by the single-donor downloads
(single.py) and the multi-donor download (multi.py): open the stream, send the request, read
and check the answer (wire.py), all within the caller's bounds.

Time bounds here use asyncio.wait on a task, not asyncio.wait_for: before Python 3.12,
wait_for swallows a cancellation that arrives just as the awaited thing finishes, and a
multi-donor download is cancelled (at its timeout) while frames arrive all the time: measured,
a 0.05 s bound then ran on to the end of the download, or hung until the 5 s backstop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco_peer.coordinator_free.state_transfer.wire import (
    CHUNK_BYTES,
    MAX_FIRST_FRAME_BYTES,
    MAX_HASH_BYTES,
    Header,
    check_run,
    data_bytes,
    malformed,
    parse_answer,
)
from diloco_peer.errors import P2PServiceStopped, StateTransferFailed, TransferFailure
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import consume, read_frame

logger = logging.getLogger(__name__)

CALL_SLACK_S = 5.0
"""Backstop on top of a download's own timeout, for the calling thread's wait on the loop."""
CANCEL_GRACE_S = 1.0
"""How long a download that timed out gets to end its streams before the caller is answered."""
STALL_TIMEOUT_S = 15.0
"""How long one download's stream may receive nothing (no header, no data) before it fails: a
donor that stops sending is given up long before the download's own timeout (a single-donor
download then tries the next donor; a multi-donor one re-queues the range). A frame may also
take this long: a donor under ~70 kB/s (1 MiB in 15 s) fails, as its server drops a requester
under 64 KiB/s (server.MIN_UPLOAD_BYTES_S). The multi-donor end game takes a range again much
sooner (endgame.py)."""
PIECE_BYTES = 64 << 10
"""The most a data read takes off the stream at once: how finely a download sees its progress
(and a multi-donor download compares two copies of a range, or cancels one)."""

T = TypeVar("T")


class Progress:
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


def check_download(run: str, timeout_s: float, max_bytes: int) -> None:
    """ValueError unless the arguments every download shares are usable."""
    check_run(run)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number, got {timeout_s!r}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be finite and > 0, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")


def check_stall(stall_timeout_s: float) -> None:
    """ValueError unless `stall_timeout_s` is a usable bound."""
    if isinstance(stall_timeout_s, bool) or not isinstance(stall_timeout_s, (int, float)):
        raise ValueError(f"stall_timeout_s must be a number, got {stall_timeout_s!r}")
    if not (math.isfinite(stall_timeout_s) and stall_timeout_s > 0):
        raise ValueError(f"stall_timeout_s must be finite and > 0, got {stall_timeout_s!r}")


def check_range_args(state_hash: str, offset: int, length: int) -> None:
    """ValueError unless a ranged request of these fields can be sent."""
    if not isinstance(state_hash, str) or not 0 < len(state_hash.encode()) <= MAX_HASH_BYTES:
        raise ValueError(f"state_hash must be a non-empty str of <= {MAX_HASH_BYTES} bytes")
    for name, value, low in (("offset", offset, 0), ("length", length, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**64:
            raise ValueError(f"{name} must be an integer in [{low}, 2**64), got {value!r}")


def timed_out(timeout_s: float, describe: Callable[[], str]) -> StateTransferFailed:
    return StateTransferFailed(
        f"timed out after {timeout_s} s ({describe()})", kind=TransferFailure.TIMED_OUT
    )


def stalled(timeout_s: float | None) -> StateTransferFailed:
    return StateTransferFailed(f"stalled: nothing for {timeout_s} s", kind=TransferFailure.STALLED)


def unreachable(error: P2PDaemonError | P2PHandlerError) -> StateTransferFailed:
    """The daemon's error for an unreachable peer or a missing handler."""
    return StateTransferFailed(f"{type(error).__name__}: {error}", kind=TransferFailure.UNREACHABLE)


def run_bounded(
    service: P2PService,
    work: Coroutine[Any, Any, T],
    timeout_s: float,
    describe: Callable[[], str],
    tag: str,
) -> T:
    """`work` on the service's loop within `timeout_s`, from the calling thread; every failure
    becomes a StateTransferFailed whose message starts with `tag` (who downloads what)."""
    try:
        return service.run(bounded(work, timeout_s, describe), timeout_s + CALL_SLACK_S)
    except StateTransferFailed as e:
        raise failed(e, tag) from None
    except TimeoutError:  # the backstop: `bounded` should have answered first
        failure = timed_out(timeout_s, describe)
        logger.warning("%s %s", tag, failure)
        raise failure.retagged(tag) from None
    except P2PServiceStopped:
        raise StateTransferFailed(
            f"{tag} the P2P service was shut down", kind=TransferFailure.STOPPED
        ) from None


def failed(failure: StateTransferFailed, tag: str) -> StateTransferFailed:
    """Log `failure` as the download `tag` names, and return it with `tag` in front."""
    logger.warning("%s failed: %s", tag, failure)
    return failure.retagged(tag)


async def first_of(task: asyncio.Future[T], timeout_s: float) -> bool:
    """Wait until `task` is done (True) or `timeout_s` passed (False, `task` cancelled and
    abandoned); a cancellation of the caller cancels `task` too."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(consume)
    return bool(done)


async def bounded(work: Awaitable[T], timeout_s: float, describe: Callable[[], str]) -> T:
    """`work` within `timeout_s`, with stream failures turned into StateTransferFailed."""
    task = asyncio.ensure_future(work)
    if not await first_of(task, timeout_s):
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)  # lets its streams close
        raise timed_out(timeout_s, describe)
    try:
        return task.result()
    except asyncio.TimeoutError:  # from inside `work`
        raise timed_out(timeout_s, describe) from None
    except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
        raise unreachable(e) from None
    except (OSError, EOFError, struct.error) as e:
        raise StateTransferFailed(
            f"stream broken ({describe()}): {type(e).__name__}: {e}",
            kind=TransferFailure.STREAM_BROKEN,
        ) from None


async def within(work: Awaitable[T], timeout_s: float | None) -> T:
    """`work`, failing as stalled if it takes longer than `timeout_s` (None: no bound here)."""
    if timeout_s is None:
        return await work
    task = asyncio.ensure_future(work)
    if not await first_of(task, timeout_s):
        raise stalled(timeout_s)
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
        raise stalled(timeout_s)
    _, reader, writer = task.result()
    return reader, writer


async def open_answer(
    p2p: P2P,
    handler_name: str,
    donor: PeerID,
    request: bytes,
    *,
    stall_timeout_s: float | None = None,
) -> tuple[Header, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a stream to `donor`, send `request` and read the answer's header; the data follows
    on the reader (`read_data`); the caller closes the writer when done (when this raises, the
    stream is closed already). `stall_timeout_s` bounds opening the stream, the request and the
    header."""
    reader, writer = await _open_stream(p2p, donor, handler_name, stall_timeout_s)
    try:
        await within(P2P.send_raw_data(request, writer), stall_timeout_s)
        first = await within(read_frame(reader, MAX_FIRST_FRAME_BYTES, malformed), stall_timeout_s)
        return parse_answer(first), reader, writer
    except BaseException:
        writer.close()
        raise


async def read_data(
    reader: asyncio.StreamReader,
    count: int,
    on_piece: Callable[[bytes], None],
    stall_timeout_s: float | None = None,
) -> None:
    """The answer's `count` data bytes, in frames of at most CHUNK_BYTES, handed to `on_piece`
    as they arrive (pieces of at most PIECE_BYTES): a caller sees a frame's progress, and can
    stop reading in the middle of one. `stall_timeout_s` bounds each piece's wait; a frame's
    length prefix never sizes an allocation (each piece is at most PIECE_BYTES)."""
    received = 0
    while received < count:
        prefix = await within(reader.readexactly(P2P.HEADER_LEN), stall_timeout_s)
        length = int.from_bytes(prefix, P2P.BYTEORDER)
        if length == 0:
            raise malformed("malformed stream (empty data frame)")
        if length > min(CHUNK_BYTES, count - received):
            raise malformed(
                f"frame of {length} bytes, at most {min(CHUNK_BYTES, count - received)} expected"
            )
        while length:
            piece = await within(reader.read(min(length, PIECE_BYTES)), stall_timeout_s)
            if not piece:
                raise EOFError(f"stream ended {length} bytes into a frame")
            length -= len(piece)
            received += len(piece)
            on_piece(piece)


async def transfer(
    p2p: P2P,
    handler_name: str,
    donor: PeerID,
    request: bytes,
    max_bytes: int,
    progress: Progress,
    *,
    span: tuple[int, int] | None = None,
    stall_timeout_s: float | None = None,
) -> tuple[Header, bytes]:
    """One download on one stream: the answer's header and the data. For a ranged request,
    `span` is its (offset, length): the data is the part of the blob from offset, `length` bytes
    or up to the end. The caller bounds the total time; `stall_timeout_s` bounds opening the
    stream, the header and each frame."""
    header, reader, writer = await open_answer(
        p2p, handler_name, donor, request, stall_timeout_s=stall_timeout_s
    )
    try:
        count = data_bytes(header, max_bytes, span)
        progress.total = count
        received = 0
        chunks: list[bytes] = []  # grows with what really arrives, whatever length claims
        while received < count:
            chunk = await within(
                read_frame(reader, min(CHUNK_BYTES, count - received), malformed),
                stall_timeout_s,
            )
            if not chunk:
                raise malformed("malformed stream (empty data frame)")
            chunks.append(chunk)
            received += len(chunk)
            progress.add(len(chunk))
        return header, b"".join(chunks)
    finally:
        writer.close()
