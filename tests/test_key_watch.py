"""Two running processes with one key: the later one leaves (coordinator_free/key_watch.py).

The rule is pure and tested here; tests/test_crash_restart.py runs it with real processes.
"""

from __future__ import annotations

from diloco_peer.coordinator_free.key_watch import MAX_INCARNATIONS, KeyWatch, Rival
from diloco_peer.coordinator_free.records import PeerHead

ME = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def head(updated: float, since: float | None) -> PeerHead:
    return PeerHead(peer_id=ME, version=3, state_hash="ab" * 32, updated=updated, since=since)


def test_our_own_heads_and_heads_of_builds_without_since_are_no_rival() -> None:
    watch = KeyWatch(since=100.0)
    assert watch.see(None) is None
    for t in (101.0, 102.0, 103.0):
        assert watch.see(head(t, 100.0)) is None  # ours
        assert watch.see(head(t, None)) is None  # says nothing about its process


def test_a_dead_incarnation_s_last_head_is_no_rival_however_often_it_is_read() -> None:
    # a crash (or a restart within the head's TTL) leaves the last head it stored: it is
    # dated before we started, and a dead process never stores a newer one
    watch = KeyWatch(since=100.0)
    for _ in range(5):
        assert watch.see(head(95.0, 40.0)) is None
    # older copies of it on other DHT nodes: still before our start
    assert watch.see(head(80.0, 40.0)) is None
    # its departure (updated 0) is not a sign of life either
    assert watch.see(head(0.0, 40.0)) is None


def test_a_rival_is_alive_once_it_stored_two_heads_after_we_started() -> None:
    watch = KeyWatch(since=100.0)
    assert watch.see(head(110.0, 40.0)) is None  # one head after our start: not yet proof
    assert watch.see(head(110.0, 40.0)) is None  # the same head read again
    rival = watch.see(head(125.0, 40.0))  # refreshed: a live process
    assert rival == Rival(since=40.0, newer=False)  # it was there first: we leave


def test_the_later_process_leaves_and_both_agree_on_which_one_it_is() -> None:
    early, late = KeyWatch(since=40.0), KeyWatch(since=100.0)
    # each reads the other's heads: the early one sees the late one's, and the other way round
    assert early.see(head(110.0, 100.0)) is None
    assert late.see(head(111.0, 40.0)) is None
    seen_by_early = early.see(head(125.0, 100.0))
    seen_by_late = late.see(head(126.0, 40.0))
    assert seen_by_early is not None and seen_by_early.newer  # the late one leaves
    assert seen_by_late is not None and not seen_by_late.newer  # so it says so itself


def test_the_incarnations_remembered_are_bounded() -> None:
    watch = KeyWatch(since=100.0)
    for i in range(3 * MAX_INCARNATIONS):
        assert watch.see(head(200.0 + i, float(i))) is None  # each seen once
    assert len(watch._first) == MAX_INCARNATIONS
    last = float(3 * MAX_INCARNATIONS - 1)
    assert watch.see(head(500.0, last)) == Rival(since=last, newer=False)
