"""The state from several donors at once, in ranges (DESIGN.md §3, 1): what a joining or far
behind peer downloads first. The ranges' bookkeeping is multi_job.py's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from diloco_peer.coordinator_free.state_transfer.multi_job import MultiDownload, NoRangeDonors
from diloco_peer.coordinator_free.state_transfer.single import download_state
from diloco_peer.coordinator_free.state_transfer.transfer import (
    STALL_TIMEOUT_S,
    check_download,
    check_range_args,
    check_stall,
    run_bounded,
)
from diloco_peer.coordinator_free.state_transfer.wire import StateBlob
from diloco_peer.errors import StateTransferFailed, TransferFailure
from diloco_peer.p2p.service import P2PService

logger = logging.getLogger(__name__)

RANGE_BYTES = 4 << 20
"""What `download_state_multi` asks one donor for at a time: a few frames, so that a donor that
leaves costs little to redo, and few enough requests that their round trips cost little."""
MAX_STREAMS_PER_DONOR = 8


def download_state_multi(
    service: P2PService,
    run: str,
    donors: Sequence[str],
    state_hash: str,
    *,
    timeout_s: float,
    range_bytes: int = RANGE_BYTES,
    streams_per_donor: int = 2,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    max_bytes: int = 2**31,
    on_progress: Callable[[int, int], None] | None = None,
) -> StateBlob:
    """Download the state `state_hash` names from several donors at once, in ranges; blocks the
    calling thread (not the loop's), at most `timeout_s` in all.

    A first small ranged request (to the donors in turn) gives the blob's length; the rest is split
    into ranges of `range_bytes` that every donor takes from one shared queue, `streams_per_donor`
    at a time, so a faster donor serves more. A range whose donor fails, stalls (nothing for
    `stall_timeout_s`), is busy or has moved on to another state goes back to the queue; the donor
    is dropped (a busy one is asked again later), and the next stream asks only for what is
    missing of it. When the queue is empty, a free stream fetches the rest of a range in flight
    elsewhere only if that copy has stalled (endgame.py: silent, or far slower than the free
    donor); the older copy is cancelled, its stream closed, as soon as the newer one is ahead,
    and any other copy once one completes the range: a slow donor neither holds up the end nor
    costs a second copy of its ranges. Fails only when no donor is left or `timeout_s` passes.

    Every range is asked for under `state_hash`, and a donor refuses one unless it serves that
    very state, so honest donors' bytes never mix two states; an answer whose version, length or
    hash differs from the first answer's drops its donor (so a first donor that lies about the
    length gets the honest ones dropped: the download fails, and the caller falls back to single
    donors as below). If no donor understands ranged requests (a build before them answers "bad
    request"), it falls back to `download_state` from those donors one by one, keeping the first
    whose claimed hash is `state_hash`.

    The result is only as good as the donors: a hostile donor can send wrong bytes for its ranges
    under the right hash, and nothing at this layer can tell (the state hash is computed over the
    loaded tensors, not the bytes). As with `download_state`, the caller must load `data` and
    recompute the state hash before trusting it; when that fails, download from single donors.
    `on_progress(received_bytes, total_bytes)` is called in the loop thread after each new range.
    Raises StateTransferFailed (NO_DONOR with each donor's reason, TIMED_OUT, STOPPED) on
    failure, ValueError on bad arguments.
    """
    _check_multi_args(run, donors, state_hash, timeout_s, range_bytes, streams_per_donor,
                      stall_timeout_s, max_bytes)  # fmt: skip
    me = service.peer_id
    tag = f"[{me[-6:]} state {run} from {len(donors)} donors]"
    job = MultiDownload(run, state_hash, range_bytes, max_bytes, stall_timeout_s, on_progress)
    job.admit(list(donors), me)
    started = time.perf_counter()
    try:
        version, data = run_bounded(
            service, job.run(service.p2p, streams_per_donor), timeout_s, job.describe, tag
        )
    except NoRangeDonors as e:
        left_s = timeout_s - (time.perf_counter() - started)
        return _download_whole(
            service, run, e.donors, state_hash, left_s, max_bytes, stall_timeout_s, on_progress
        )
    elapsed_s = time.perf_counter() - started
    logger.info(
        "%s got version %d: %d bytes in %.2f s (%.1f MB/s), %d received (%.3fx), %d ranges "
        "fetched again; ranges per donor: %s",
        tag,
        version,
        len(data),
        elapsed_s,
        len(data) / 1e6 / max(elapsed_s, 1e-9),
        job.received,
        job.received / max(len(data), 1),
        job.again,
        ", ".join(f"{d[-6:]} {n}" for d, n in job.served.most_common()) or "-",
    )
    return StateBlob(version=version, state_hash=state_hash, data=data)


def _check_multi_args(
    run: str,
    donors: Sequence[str],
    state_hash: str,
    timeout_s: float,
    range_bytes: int,
    streams_per_donor: int,
    stall_timeout_s: float,
    max_bytes: int,
) -> None:
    """ValueError unless `download_state_multi`'s arguments are usable."""
    check_download(run, timeout_s, max_bytes)
    check_range_args(state_hash, 0, range_bytes)
    if (
        isinstance(streams_per_donor, bool)
        or not isinstance(streams_per_donor, int)
        or not 1 <= streams_per_donor <= MAX_STREAMS_PER_DONOR
    ):
        raise ValueError(
            f"streams_per_donor must be an integer in [1, {MAX_STREAMS_PER_DONOR}], "
            f"got {streams_per_donor!r}"
        )
    check_stall(stall_timeout_s)
    if isinstance(donors, (str, bytes)) or not isinstance(donors, Sequence):
        raise ValueError(f"donors must be a sequence of peer ids, got {type(donors).__name__}")


def _download_whole(
    service: P2PService,
    run: str,
    donors: list[str],
    state_hash: str,
    timeout_s: float,
    max_bytes: int,
    stall_timeout_s: float,
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
                service, run, donor, timeout_s=left_s, max_bytes=max_bytes,
                stall_timeout_s=stall_timeout_s, on_progress=on_progress,
            )  # fmt: skip
        except StateTransferFailed as e:
            reasons.append(str(e))
            continue
        if blob.state_hash == state_hash:
            return blob
        reasons.append(f"{donor[-6:]} serves {blob.state_hash[:16]}, not {state_hash[:16]}")
    raise StateTransferFailed(
        f"[{service.peer_id[-6:]} state {run}] no donor speaks ranged requests, and the whole "
        f"downloads failed: {'; '.join(reasons)}",
        kind=TransferFailure.NO_DONOR,
    )
