"""The multi-donor download's end game (multi_job.py): when a donor with a free stream may fetch
again the rest of a range that another donor is still sending. Pure rules of what the requester
measured, unit-tested; the download only calls them.

Once the queue of ranges is empty, a free stream takes the rest of a range in flight elsewhere
only if that range's one copy is *stalled* (`stalled`): it received nothing for `silence_s`, or
at its own pace it would end much later than the free donor would at its measured pace. The two
copies then race for the same bytes (the new one asks for the range from what the requester
already has): the moment the new copy gets ahead of the old one, the old one is cancelled
(everything it would still send is here already), and when a copy completes the range any other
is cancelled. A range taken again costs the bytes the old copy received from the new copy's
request until it was overtaken (or, when the guess was wrong, what the new copy received before
the old one completed the range): a few pieces, not a range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

SILENCE_S = 2.0
"""A copy that received nothing for this long is stalled, whatever the other donors' pace (a
stream that flows delivers a 64 KiB piece within ~1 s even at the ~70 kB/s a 15 s
`stall_timeout_s` tolerates; the download caps it at half its `stall_timeout_s`)."""
SLOWER = 2.0
"""A copy is stalled when, at its own pace, the rest of its range would take more than SLOWER
times what a free donor needs for it..."""
MIN_GAIN_S = 0.5
"""...and at least this much longer: a copy about to end is left to end (a new request costs a
round trip, and the copies' paces are estimates)."""
JUDGE_S = 1.0
"""A copy is judged by its pace only once it has run this long: a stream's first moments (the
request's round trip, TCP's slow start, flow-control windows growing) say little about its pace.
Measured on an emulated 100 Mbit link (bench/wan.py, a joiner whose own link is the bottleneck):
copies judged after 30-130 ms were taken again although nothing was wrong with them, and the
joiner received 1.1-1.5x the state."""


@dataclass(frozen=True)
class CopyPace:
    """How far one copy of a range has come, as the requester measured it."""

    got_bytes: int
    """Data bytes this copy received."""
    left_bytes: int
    """Bytes of its range the requester does not have yet."""
    elapsed_s: float
    """Since this copy's request was sent."""
    silent_s: float
    """Since its last byte arrived (since its request, before the first)."""

    def time_left_s(self) -> float:
        """The rest of the range at this copy's average pace since its request (the first byte's
        latency included); infinite before its first byte."""
        if self.left_bytes <= 0:
            return 0.0
        if self.got_bytes <= 0:
            return math.inf
        return self.left_bytes * self.elapsed_s / self.got_bytes


@dataclass
class DonorPace:
    """One donor's measured pace per stream: the data bytes and seconds of its copies of ranges
    so far (each from its request to its end, the first byte's latency included). The download's
    small first range does not count: it says more about the round trip than the pace, and it
    ran alone, on links nobody else was using yet."""

    bytes: int = 0
    seconds: float = 0.0

    def add(self, count: int, seconds: float) -> None:
        """One copy's end: `count` bytes in `seconds` (ignored without bytes or time)."""
        if count > 0 and seconds > 0 and math.isfinite(seconds):
            self.bytes += count
            self.seconds += seconds

    def time_for(self, count: int) -> float | None:
        """Seconds a new copy of `count` bytes should take at this pace; None before any."""
        if self.bytes <= 0:
            return None
        return count * self.seconds / self.bytes


def pooled(paces: Iterable[DonorPace]) -> DonorPace:
    """All donors' copies as one pace: the guess for a donor that has none of its own yet."""
    total = DonorPace()
    for pace in paces:
        total.add(pace.bytes, pace.seconds)
    return total


def stalled(copy: CopyPace, fresh_s: float | None, silence_s: float = SILENCE_S) -> bool:
    """Whether the rest of `copy`'s range may be fetched again by a free donor that needs
    `fresh_s` for it (None: that donor has no measured pace yet).

    Stalled means: something is left, and either the copy received nothing for `silence_s`, or
    it has run for JUDGE_S and its time left (`CopyPace.time_left_s`) is more than SLOWER x
    `fresh_s` and more than `fresh_s` + MIN_GAIN_S. A copy without bytes yet, or younger than
    JUDGE_S, is judged by its silence alone.
    """
    if copy.left_bytes <= 0:
        return False
    if copy.silent_s >= silence_s:
        return True
    if fresh_s is None or copy.got_bytes <= 0 or copy.elapsed_s < JUDGE_S:
        return False
    left_s = copy.time_left_s()
    return left_s > SLOWER * fresh_s and left_s > fresh_s + MIN_GAIN_S


def take_again(
    copies: Iterable[tuple[int, CopyPace]], fresh: DonorPace, silence_s: float = SILENCE_S
) -> int | None:
    """Which range a free donor of pace `fresh` fetches again, among ranges in flight at one
    other donor each (`copies`: range index, its copy's pace): the stalled one with the most
    time left (the first of equals), or None when none is stalled."""
    best: tuple[float, int] | None = None
    for index, copy in copies:
        if stalled(copy, fresh.time_for(copy.left_bytes), silence_s):
            left_s = copy.time_left_s()
            if best is None or left_s > best[0]:
                best = (left_s, index)
    return None if best is None else best[1]
