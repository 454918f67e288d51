"""Downloads from one donor: the full state, part of it, or one update (DESIGN.md §3, 1).

Each blocks the calling thread (never the service's loop thread) for at most its `timeout_s`,
and returns what the donor *claims*: the caller verifies it (package docstring).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from diloco_peer.coordinator_free.state_transfer.transfer import (
    STALL_TIMEOUT_S,
    Progress,
    check_download,
    check_range_args,
    check_stall,
    failed,
    run_bounded,
    transfer,
)
from diloco_peer.coordinator_free.state_transfer.wire import (
    MAX_VERSION,
    Header,
    RangeRequest,
    StateBlob,
    StateRequest,
    UpdateRequest,
    handler_name,
)
from diloco_peer.errors import StateTransferFailed, TransferFailure
from diloco_peer.p2p.service import P2PService

logger = logging.getLogger(__name__)


def download_state(
    service: P2PService,
    run: str,
    peer_id: str,
    *,
    timeout_s: float,
    max_bytes: int = 2**31,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    on_progress: Callable[[int, int], None] | None = None,
) -> StateBlob:
    """Download `peer_id`'s current state for `run`; blocks the calling thread (not the loop's).

    The whole transfer (connecting included) is bounded by `timeout_s`; a donor that sends
    nothing for `stall_timeout_s` (or takes longer for a frame) fails it sooner, as STALLED, and
    one that announces more than `max_bytes` is refused before its data is read. Returns the blob with the
    donor's *claimed* version and hash: load `data` with safetensors and recompute the hash before
    trusting any of it (package docstring). `on_progress(received_bytes, total_bytes)` is called
    in the loop thread after each chunk (progress bars; keep it cheap).
    Raises StateTransferFailed (its `kind`, and `refusal` for a refusal, say why) on any failure,
    ValueError on bad arguments.
    """
    check_download(run, timeout_s, max_bytes)
    check_stall(stall_timeout_s)
    header, data = fetch(
        service,
        run,
        peer_id,
        StateRequest().encode(),
        "state",
        (timeout_s, stall_timeout_s),
        max_bytes,
        Progress(on_progress),
    )
    return StateBlob(version=header.version, state_hash=header.state_hash, data=data)


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
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> StateRange:
    """Download bytes [offset, offset + length) of the state `donor` serves for `run`, provided
    the donor still serves the state `state_hash` names (the bytes never mix two states); blocks
    the calling thread, at most `timeout_s` in all. The range ends early at the blob's end.

    Raises StateTransferFailed on any failure: refused as STATE_MOVED_ON when the donor serves
    another state, as BAD_REQUEST by a donor that predates ranged requests, as BAD_RANGE for an
    offset past the end, and those of `download_state`. ValueError on bad arguments.
    """
    check_download(run, timeout_s, max_bytes)
    check_stall(stall_timeout_s)
    check_range_args(state_hash, offset, length)
    request = RangeRequest(state_hash, offset, length)
    header, data = fetch(
        service,
        run,
        donor,
        request.encode(),
        f"bytes {offset}+{length}",
        (timeout_s, stall_timeout_s),
        max_bytes,
        Progress(None),
        span=request.span,
        state_hash=state_hash,
    )
    return StateRange(version=header.version, total_bytes=header.length, offset=offset, data=data)


def download_update(
    service: P2PService,
    run: str,
    donor: str,
    base_version: int,
    *,
    timeout_s: float,
    max_bytes: int = 2**31,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> bytes:
    """Download the update from `base_version` to `base_version + 1` that `donor` keeps for
    `run`; blocks the calling thread (not the loop's), at most `timeout_s` in all.

    Returns the serialised record as the donor sent it: parse it with `UpdateRecord.from_bytes`
    and check it by replaying it (package docstring). Raises StateTransferFailed on any failure
    (refused as NO_UPDATE or NO_UPDATE_LOG when the donor lacks that update or any update log;
    not allowed, busy, too large, timed out, broken stream), ValueError on bad arguments.
    """
    check_download(run, timeout_s, max_bytes)
    check_stall(stall_timeout_s)
    if isinstance(base_version, bool) or not isinstance(base_version, int):
        raise ValueError(f"base_version must be an int, got {base_version!r}")
    if not 0 <= base_version < MAX_VERSION:
        raise ValueError(f"base_version must be in [0, 2**63 - 1), got {base_version}")
    header, data = fetch(
        service,
        run,
        donor,
        UpdateRequest(base_version).encode(),
        f"update {base_version}",
        (timeout_s, stall_timeout_s),
        max_bytes,
        Progress(None),
    )
    if header.version != base_version:  # the bytes' own base version is checked by the replay
        tag = f"[{service.peer_id[-6:]} update {base_version} {run} from {donor[-6:]}]"
        raise StateTransferFailed(
            f"{tag} the donor answered with the update from {header.version}",
            kind=TransferFailure.WRONG_ANSWER,
        )
    return data


def fetch(
    service: P2PService,
    run: str,
    peer_id: str,
    request: bytes,
    what: str,
    bounds_s: tuple[float, float],
    max_bytes: int,
    progress: Progress,
    *,
    span: tuple[int, int] | None = None,
    state_hash: str | None = None,
) -> tuple[Header, bytes]:
    """One download of `what` (for messages): the answer's header and the data (`bounds_s`:
    the whole download's timeout and its stall timeout; `span`: the [offset, offset + length)
    asked for; `state_hash`: what the answer must name)."""
    try:
        donor = PeerID.from_base58(peer_id)
    except (ValueError, TypeError) as e:  # ids come from DHT records: a network input
        raise StateTransferFailed(
            f"malformed peer id {peer_id!r}: {e}", kind=TransferFailure.BAD_DONOR
        ) from None
    me = service.peer_id
    tag = f"[{me[-6:]} {what} {run} from {peer_id[-6:]}]"
    if peer_id == me:
        raise StateTransferFailed(
            f"{tag} cannot download from myself", kind=TransferFailure.BAD_DONOR
        )
    started = time.perf_counter()
    timeout_s, stall_timeout_s = bounds_s
    work = transfer(
        service.p2p, handler_name(run), donor, request, max_bytes, progress,
        span=span, stall_timeout_s=stall_timeout_s,
    )  # fmt: skip
    header, data = run_bounded(
        service,
        work,
        timeout_s,
        progress.describe,
        tag,
    )
    if state_hash is not None and header.state_hash != state_hash:
        wrong = f"the donor answered for state {header.state_hash[:16]}"
        raise failed(StateTransferFailed(wrong, kind=TransferFailure.WRONG_ANSWER), tag)
    elapsed_s = time.perf_counter() - started
    logger.log(
        logging.INFO if span is None else logging.DEBUG,
        "%s got version %d: %d bytes in %.2f s (%.1f MB/s)",
        tag,
        header.version,
        len(data),
        elapsed_s,
        len(data) / 1e6 / max(elapsed_s, 1e-9),
    )
    return header, data
