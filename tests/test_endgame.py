"""The multi-donor download's end game as pure rules (state_transfer/endgame.py): when a range in
flight is fetched again, and how two copies of a range share its bytes and which is cancelled
(multi_job.Range). The downloads between real peers are in test_state_transfer.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies

from diloco_peer.coordinator_free.state_transfer.endgame import (
    JUDGE_S,
    MIN_GAIN_S,
    SILENCE_S,
    SLOWER,
    CopyPace,
    DonorPace,
    pooled,
    stalled,
    take_again,
)
from diloco_peer.coordinator_free.state_transfer.multi_job import Copy, Range

MB = 1_000_000


def pace(got: int, left: int, elapsed_s: float, silent_s: float = 0.0) -> CopyPace:
    return CopyPace(got_bytes=got, left_bytes=left, elapsed_s=elapsed_s, silent_s=silent_s)


@pytest.mark.timeout(10)
def test_time_left_is_the_rest_at_the_copys_own_pace() -> None:
    assert pace(1 * MB, 3 * MB, 2.0).time_left_s() == pytest.approx(6.0)
    assert pace(1 * MB, 0, 2.0).time_left_s() == 0.0
    assert pace(0, 3 * MB, 0.1).time_left_s() == math.inf  # no byte yet: no pace


@pytest.mark.timeout(10)
def test_a_silent_copy_is_stalled_whatever_the_free_donors_pace() -> None:
    assert stalled(pace(0, MB, SILENCE_S, silent_s=SILENCE_S), fresh_s=None)
    assert stalled(pace(MB, MB, 10.0, silent_s=SILENCE_S), fresh_s=100.0)
    assert stalled(pace(0, MB, 1.0, silent_s=1.0), fresh_s=None, silence_s=1.0)
    # not yet silent long enough, and no pace to compare
    assert not stalled(pace(0, MB, 1.9, silent_s=1.9), fresh_s=0.01)
    assert not stalled(pace(MB, MB, 1.0, silent_s=1.9), fresh_s=None)
    # nothing left: never taken again
    assert not stalled(pace(MB, 0, 60.0, silent_s=60.0), fresh_s=0.01)


@pytest.mark.timeout(10)
def test_a_copy_is_stalled_only_when_much_slower_than_a_fresh_one() -> None:
    slow = pace(1 * MB, 3 * MB, 3.0)  # 9 s left at its pace
    assert stalled(slow, fresh_s=1.0)
    assert stalled(slow, fresh_s=9.0 / SLOWER - 0.01)
    assert not stalled(slow, fresh_s=9.0 / SLOWER)  # exactly SLOWER times: left alone
    assert not stalled(slow, fresh_s=8.0)  # about as fast: both would end together
    # SLOWER times slower, but it ends within MIN_GAIN_S of a fresh copy: a range about to end
    almost = pace(MB, 700_000, JUDGE_S)  # 0.7 s left
    fresh_s = 0.3
    assert almost.time_left_s() > SLOWER * fresh_s and almost.time_left_s() < fresh_s + MIN_GAIN_S
    assert not stalled(almost, fresh_s=fresh_s)
    # far slower, but too young to tell: its first moments are a round trip and a slow start
    young = pace(32 << 10, 4 * MB, 0.03)  # what a copy 30 ms old looked like on a 100 Mbit link
    assert young.time_left_s() > 30 * 0.1
    assert not stalled(young, fresh_s=0.1)
    assert stalled(pace(32 << 10, 4 * MB, JUDGE_S), fresh_s=0.1)
    # a copy flowing as fast as the free donor is never duplicated (the end game of before
    # took every range in flight: 1.5x the state received with even donors)
    assert not stalled(pace(2 * MB, 2 * MB, 0.5), fresh_s=0.5)


@pytest.mark.timeout(10)
def test_donor_pace_measures_bytes_per_second_of_its_copies() -> None:
    measured = DonorPace()
    assert measured.time_for(MB) is None
    measured.add(0, 5.0)  # a copy without bytes, or without time, tells nothing
    measured.add(MB, 0.0)
    measured.add(MB, math.inf)
    assert measured.time_for(MB) is None
    measured.add(2 * MB, 1.0)
    measured.add(2 * MB, 3.0)
    assert measured.time_for(MB) == pytest.approx(1.0)
    both = pooled([measured, DonorPace(4 * MB, 1.0), DonorPace()])
    assert (both.bytes, both.seconds) == (8 * MB, 5.0)
    assert pooled([]).time_for(MB) is None


@pytest.mark.timeout(10)
def test_take_again_picks_the_stalled_copy_with_the_most_time_left() -> None:
    fast = DonorPace(10 * MB, 1.0)  # 0.1 s per MB
    copies = [
        (1, pace(10 * MB, 1 * MB, 1.0)),  # flowing: 0.1 s left
        (2, pace(1 * MB, 3 * MB, 3.0)),  # slow: 9 s left
        (3, pace(1 * MB, 3 * MB, 6.0)),  # slower: 18 s left
        (4, pace(0, 2 * MB, 0.2, silent_s=0.2)),  # just asked: no pace, not silent yet
        (6, pace(1 * MB, 99 * MB, 0.5)),  # far slower, but too young to tell
    ]
    assert take_again(copies, fast) == 3
    assert take_again(copies[:2], fast) == 2
    assert take_again([copies[0], copies[3], copies[4]], fast) is None
    assert take_again(copies, DonorPace()) is None  # a donor of unknown pace: silence only
    silent = (5, pace(0, 2 * MB, SILENCE_S, silent_s=SILENCE_S))  # no byte at all: first
    assert take_again([*copies, silent], DonorPace()) == 5
    assert take_again([*copies, silent], fast) == 5
    assert take_again([], fast) is None


@pytest.mark.timeout(10)
def test_a_newer_copy_that_overtakes_cancels_the_older_one() -> None:
    data = bytes(range(256)) * 40  # a range of 10240 bytes
    rng = Range(offset=0, length=len(data))
    old = Copy("slow", start=0, started_s=0.0)
    rng.copies.append(old)
    assert rng.arrived(old, data[0:1000]) == []
    new = Copy("fast", start=rng.have, started_s=1.0)  # asks for the rest only
    rng.copies.append(new)
    assert rng.arrived(old, data[1000:1500]) == []  # the old one still leads
    assert rng.arrived(new, data[1000:1400]) == []  # catching up: nothing new
    assert rng.have == 1500
    assert rng.arrived(new, data[1400:3000]) == [old]  # ahead now: the old one is cancelled
    assert rng.arrived(new, data[3000:4000]) == [old]  # (until the download removes it)
    rng.copies.remove(old)
    assert rng.arrived(new, data[4000:]) == []
    assert (rng.have, b"".join(rng.chunks)) == (len(data), data)
    assert (old.got, new.got) == (1500, len(data) - 1000)


@pytest.mark.timeout(30)
@settings(max_examples=200, deadline=None)
@given(
    strategies.integers(1, 5000),
    strategies.integers(0, 5000),
    strategies.lists(strategies.tuples(strategies.booleans(), strategies.integers(1, 700))),
)
def test_two_copies_in_any_order_give_the_range_exactly(
    length: int, split: int, steps: list[tuple[bool, int]]
) -> None:
    """An old copy gets `split` bytes alone, then a new one asks for the rest; pieces of either
    arrive in any order. The range is always the exact bytes, each kept once, and a copy is
    reported overtaken only when the new one is strictly ahead of it."""
    data = bytes((i * 7 + 3) % 251 for i in range(length))
    rng = Range(offset=0, length=length)
    old = Copy("a", start=0, started_s=0.0)
    rng.copies.append(old)
    split = min(split, length)
    if split:
        rng.arrived(old, data[:split])
    new = Copy("b", start=rng.have, started_s=1.0)
    rng.copies.append(new)
    for from_new, size in steps:
        copy = new if from_new else old
        if copy.end >= length:
            continue
        piece = data[copy.end : copy.end + size]
        overtaken = rng.arrived(copy, piece)
        assert overtaken == ([old] if from_new and old.end < new.end else [])
        assert b"".join(rng.chunks) == data[: rng.have]
        assert rng.have == max(old.end, new.end)
