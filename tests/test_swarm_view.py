"""The swarm's rules (coordinator_free/swarm_view.py) on hand-built heads: liveness, absent and
departed peers, the head choice (fork vote), whom a round waits for, in-flight counts, and the
views `status` shows. Each rule here was, before, checked only by starting real swarms."""

from __future__ import annotations

from typing import Any

import pytest

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import (
    SPEED_CAP,
    GroupPlan,
    HeadBook,
    HeadChoice,
    SwarmView,
    bans,
    forks,
    group_plan,
    phase_steps,
    probe_steps,
)

A, B, C, D = "Apeer", "Bpeer", "Cpeer", "Dpeer"
ME = "Mepeer"
H0, H1, H2 = "0" * 64, "1" * 64, "2" * 64
NOW = 1_000_000.0


def head(peer: str, version: int = 0, state_hash: str = H0, **fields: Any) -> PeerHead:
    fields.setdefault("updated", NOW)
    return PeerHead(peer_id=peer, version=version, state_hash=state_hash, **fields)


def view(*heads: PeerHead, version: int = 0, state_hash: str = H0) -> SwarmView:
    return SwarmView(ME, version, state_hash, {h.peer_id: h for h in heads})


# ----------------------------------------------------------------------------- HeadBook


def test_a_read_adds_and_refreshes_but_never_forgets_or_goes_back() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, 3, updated=NOW), B: head(B, 3, updated=NOW)}, NOW)
    book.merge({A: head(A, 2, updated=NOW - 5)}, NOW)  # an older head from a slow DHT node
    assert book.seen[A].version == 3
    book.merge({}, NOW)  # a partial read: nobody vanishes
    assert set(book.live(NOW + 1)) == {A, B}
    book.merge({B: head(B, 4, updated=NOW + 2)}, NOW + 2)
    assert book.seen[B].version == 4


def test_heads_older_than_the_ttl_are_not_live() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, updated=NOW - 59.9), B: head(B, updated=NOW - 60.0)}, NOW)
    assert set(book.live(NOW)) == {A}


def test_a_departure_wins_at_once_and_a_quorum_of_them_ends_the_run() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, 6, updated=NOW), B: head(B, 6, updated=NOW)}, NOW)
    book.merge({A: head(A, 7, updated=0.0)}, NOW)  # A leaves at version 7
    assert A not in book.live(NOW) and book.departures == {A: 7}
    assert book.departed_version == -1  # one of two peers: its word alone ends nothing
    book.merge({B: head(B, 7, updated=0.0), ME: head(ME, 9, updated=0.0)}, NOW)
    assert book.departed_version == 7  # both left at 7; our own departure changes nothing
    pair = HeadBook(ME, ttl_s=60)  # with one other peer, its word is all there is
    pair.merge({A: head(A, 6, updated=NOW)}, NOW)
    pair.merge({A: head(A, 7, updated=0.0)}, NOW)
    assert pair.departed_version == 7


def test_one_keys_departure_after_a_forged_head_ends_nobodys_run() -> None:
    """The hostile bench's hijack-leave and poison-heads: a head at v51 (or 2^63 - 1), then a
    departure there, stopped every honest peer at version 1. Now one key is no quorum."""
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, 3), B: head(B, 3), C: head(C, 51)}, NOW)
    book.merge({C: head(C, 2**63 - 1, updated=0.0)}, NOW + 1)
    assert book.departed_version == -1
    book.merge({A: head(A, 4, updated=0.0)}, NOW + 2)  # an honest peer reached the end
    assert book.departed_version == 4  # two peers left at 4 or later


def test_an_absent_peer_is_ignored_until_it_publishes_a_newer_head() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, updated=NOW), B: head(B, updated=NOW)}, NOW)
    book.mark_absent([A, B], present=[ME, B], now=NOW + 1)
    assert set(book.live(NOW + 2)) == {B}
    book.merge({A: head(A, updated=NOW + 1)}, NOW + 2)  # not newer than the mark
    assert A not in book.live(NOW + 2)
    book.merge({A: head(A, updated=NOW + 3)}, NOW + 3)
    assert A in book.live(NOW + 4)


def test_a_head_from_the_future_is_ignored_and_a_date_alone_keeps_nobody_live() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({A: head(A, 9, updated=1e12), B: head(B, 3, updated=NOW + 5)}, NOW)
    assert A not in book.seen  # dated past our clock's skew: it would never expire
    assert set(book.live(NOW + 1)) == {B}  # a few seconds of skew are fine
    book.merge({B: head(B, 3, updated=NOW + 5)}, NOW + 30)  # the same record, read again
    assert B in book.live(NOW + 59)
    assert B not in book.live(NOW + 61)  # first read at NOW: not republished for a TTL


def test_a_departure_counts_only_from_a_peer_seen_live_and_near_its_last_version() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({C: head(C, 2**63 - 1, updated=0.0)}, NOW)  # never seen live: no end of run
    assert book.departed_version == -1 and C not in book.live(NOW)
    book.merge({A: head(A, 5, updated=NOW)}, NOW)
    book.merge({A: head(A, 2**63 - 1, updated=0.0)}, NOW + 1)
    assert book.departed_version == 6  # at most one version past its last live head


def test_a_published_speed_counts_at_most_a_few_times_the_median() -> None:
    fast = view(head(A, speed=1e300), head(B, speed=2.0), head(C, speed=1.0), version=0)
    speeds = fast.speeds(1.5)
    assert speeds[A] == SPEED_CAP * 1.5 and speeds[B] == 2.0 and speeds[ME] == 1.5
    pair = view(head(A, speed=1e300), version=0).speeds(1.0)
    assert pair == {A: SPEED_CAP, ME: 1.0}  # two peers: the slower one is the median
    assert view(head(A, speed=0.0), version=0).speeds(None) == {}


def test_the_phase_the_grace_period_scales_with_is_bounded_by_the_capped_speeds() -> None:
    # a peer claiming an absurd speed cannot shrink the phase (and so the grace period) to 0
    fast = view(head(A, speed=1e300), head(B, speed=2.0), head(C, speed=1.0), version=0)
    assert fast.phase_s(1.5, 60) == pytest.approx(60 / (SPEED_CAP * 1.5))
    assert view(head(A, speed=0.0), version=0).phase_s(None, 60) is None


def test_the_book_forgets_heads_two_ttls_old_and_their_absence_marks() -> None:
    book = HeadBook(ME, ttl_s=60)
    book.merge({C: head(C, 3, updated=NOW - 5)}, NOW - 5)
    book.merge({ME: head(ME, updated=NOW - 1000), A: head(A, updated=NOW - 119),
                B: head(B, updated=NOW - 121), C: head(C, 4, updated=0.0)}, NOW)  # fmt: skip
    book.mark_absent([A, B], present=[ME], now=NOW - 100)
    book.absent["gone"] = NOW - 130  # a peer whose head is long forgotten
    book.forget(NOW)
    assert set(book.seen) == {ME, A}  # ours stays; C left (its version is remembered)
    # marks go with their head, or when as old as a forgotten head
    assert book.absent == {A: NOW - 100, B: NOW - 100} and book.departures == {C: 4}
    book.forget(NOW + 21)
    assert set(book.seen) == {ME} and book.absent == {}
    for i in range(1000):  # keys that publish once do not grow the book
        peer = "Peer" + "".join("abcdefghij"[int(d)] for d in str(i))  # base58
        book.merge({peer: head(peer, updated=NOW + i)}, NOW + i)
        book.forget(NOW + i)
    assert len(book.seen) <= 2 * 60 + 2


def test_in_flight_counts_add_fresh_running_plans_of_others_only() -> None:
    book = HeadBook(ME, ttl_s=60)
    plan = {"0": 40, "2": 8}
    book.merge(
        {
            A: head(A, 5, eta=NOW + 10, plan=plan),
            B: head(B, 5, eta=None, plan=None),  # not training
            C: head(C, 1, eta=NOW + 10, plan={"1": 100}),  # base older than the limit
            D: head(D, 5, eta=NOW + 10, plan={"3": 7, "9": 1000}, updated=NOW - 61),  # stale
            ME: head(ME, 5, eta=NOW + 10, plan={"0": 1000}),  # our own phase is not "other"
        },
        NOW,
    )
    assert book.in_flight([1, 2, 3, 4], now=NOW, oldest_version=2) == [41, 2, 11, 4]
    book.merge({D: head(D, 5, eta=NOW + 10, plan={"3": 7, "9": 1000}, updated=NOW)}, NOW)
    # a shard the run does not have (a hostile or confused plan) is ignored
    assert book.in_flight([0, 0, 0, 0], now=NOW, oldest_version=2) == [40, 0, 8, 7]


# ----------------------------------------------------------------------------- the head choice


def test_nothing_to_do_when_nobody_is_ahead() -> None:
    assert view(head(A, 3), head(B, 2), version=3).choose_head() is None
    assert view(version=0).choose_head() is None  # alone


def test_the_highest_version_wins_even_against_more_peers_below() -> None:
    v = view(head(A, 5, H1), head(B, 4, H2), head(C, 4, H2), version=3)
    choice = v.choose_head(replay_window=2)  # A's word is enough for a verified replay
    assert choice == HeadChoice(5, H1, (A,), lost_fork=False, votes={H1: 1}, endorsed=False)


def test_at_the_top_the_hash_most_peers_hold_wins_ties_by_the_larger_hash() -> None:
    v = view(head(A, 5, H1), head(B, 5, H2), head(C, 5, H1), version=3)
    choice = v.choose_head()
    assert choice is not None and choice.state_hash == H1 and set(choice.donors) == {A, C}
    tie = view(head(A, 5, H1), head(B, 5, H2), version=3).choose_head(replay_window=2)
    assert tie is not None and tie.state_hash == H2 and tie.donors == (B,)


def test_a_group_sees_the_states_a_quorum_moved_to_past_its_base_but_its_own() -> None:
    """While our group averaged on v3, peers moved on (an async lone commit at v4 that others
    followed, or another group's v4): committing our v4 would fork. Our own group's result at
    v4 is no such state; one key's head moves nobody; states at our base are the claims' job."""
    mine = "9" * 64  # our group's result
    moved = view(head(A, 4, H1), head(B, 4, H1), head(C, 5, H2), head(D, 5, H2), version=4)
    assert moved.moved_past(3, mine) == [(5, H2), (4, H1)]
    ours = view(head(A, 4, mine), head(B, 4, mine), head(C, 3), version=4)
    assert ours.moved_past(3, mine) == []
    lone = view(head(A, 4, H1), head(B, 3), head(C, 3), version=4)
    assert lone.moved_past(3, mine) == []
    assert view(head(A, 4, H1), version=4).moved_past(3, mine) == [(4, H1)]  # a swarm of two
    at_base = view(head(A, 3, H1), head(B, 3, H1), version=4)
    assert at_base.moved_past(3, mine) == []


def test_a_group_gives_way_at_its_own_version_only_to_at_least_as_many_peers() -> None:
    """A pair committed v4 while our group of 4 averaged on v3: our v4 forks with theirs, and
    the fork vote keeps the branch more peers hold, ours, so our group commits and the pair
    contributes again. A state two versions past our base wins any vote: we give way to it."""
    mine = "9" * 64
    pair = view(head(A, 4, H1), head(B, 4, H1), head(C, 3), head(D, 3), version=3)
    assert pair.moved_past(3, mine, members=4) == []
    assert pair.moved_past(3, mine, members=2) == [(4, H1)]  # as many as we are: give way
    four = view(*(head(p, 4, H1) for p in (A, B, C, D)), version=3)
    assert four.moved_past(3, mine, members=4) == [(4, H1)]
    ahead = view(head(A, 5, H1), head(B, 5, H1), head(C, 3), version=3)
    assert ahead.moved_past(3, mine, members=4) == [(5, H1)]


def test_a_member_waiting_for_its_groups_update_follows_only_its_delegate() -> None:
    """Our group (delegate D) averages on v3; A committed v4 alone meanwhile. Following A would
    take us from our group's update in the fork vote; the state D holds, one most live peers
    hold, one two versions ahead, or anything once D's head is gone, we follow."""
    lone = view(head(A, 4, H1), head(D, 3), version=3)
    choice = lone.choose_head(replay_window=2)
    assert choice is not None and (choice.version, choice.state_hash) == (4, H1)
    assert not lone.follows_while_awaiting(choice, 3, D)
    joined = view(head(A, 4, H1), head(D, 4, H1), version=3)  # D gave our version up to it
    assert joined.follows_while_awaiting(choice, 3, D)
    ours = HeadChoice(4, H2, (D,), lost_fork=False)
    assert view(head(A, 4, H1), head(D, 4, H2), version=3).follows_while_awaiting(ours, 3, D)
    ahead = HeadChoice(5, H1, (A, B), lost_fork=False)
    assert lone.follows_while_awaiting(ahead, 3, D)
    assert view(head(A, 4, H1), version=3).follows_while_awaiting(choice, 3, D)  # D is gone
    # a combine of others committed without our group: 3 of 5 live peers hold it
    most = view(head(A, 4, H1), head(B, 4, H1), head(C, 4, H1), head(D, 3), version=3)
    assert most.follows_while_awaiting(choice, 3, D)
    half = view(head(A, 4, H1), head(B, 4, H1), head(C, 3), head(D, 3), version=3)
    assert not half.follows_while_awaiting(choice, 3, D)  # 2 of 5: not most


def test_a_search_for_a_group_stops_once_a_quorum_moved_past_our_state() -> None:
    """The losers of a healed 2|2 partition, each alone under its key, waited out the sync
    timeout while the winners went on: a state above ours that a quorum holds, or a fork at our
    version we lose, supersedes ours. One key's head does not; nor a fork we win, nor peers
    behind us or with us."""
    assert view(head(A, 4, H1), head(B, 4, H1), head(C, 3), version=3).superseding() == (4, H1)
    lost = view(head(A, 3, H2), head(B, 3, H2), version=3, state_hash=H1)
    assert lost.superseding() == (3, H2)
    assert view(head(A, 3, H1), head(B, 3, H2), version=3, state_hash=H2).superseding() is None
    assert view(head(A, 1000, H1), head(B, 3), head(C, 3), version=3).superseding() is None
    assert view(head(A, 3), head(B, 2), version=3).superseding() is None
    assert view(version=3).superseding() is None  # alone


def test_one_keys_head_is_never_downloaded_whole() -> None:
    """The hijack of issue 16: one head far ahead (a forged state at v+1000) against honest heads;
    or one head with another hash at our own version. Neither moves us; a quorum does."""
    honest = [head(B, 4, H2), head(C, 4, H2), head(D, 4, H2)]
    choice = view(head(A, 1000, H1), *honest, version=3).choose_head(replay_window=2)
    assert choice is not None and (choice.version, choice.state_hash) == (4, H2)
    assert choice.endorsed and set(choice.donors) == {B, C, D}
    # ... nor at our own version, even with the larger hash of a 1:1 tie: it may only be
    # replayed from our parent state (verified), never downloaded
    fork = view(head(A, 3, H2), head(B, 2, H0), version=3, state_hash=H1)
    assert fork.choose_head() is None
    healed = fork.choose_head(replay_window=2)
    assert healed is not None and healed.lost_fork and not healed.endorsed
    # within the replay window it is a candidate, but only for a replay (endorsed=False)
    near = view(head(A, 5, H1), *honest, version=3).choose_head(replay_window=2)
    assert near is not None and near.version == 5 and not near.endorsed
    # the others left at the run's end: they still count, one key's head is not followed
    alone = SwarmView(ME, 4, H2, {A: head(A, 51, H1)}, departed=frozenset({B, C}))
    assert alone.choose_head() is None
    # two keys that agree are a quorum
    two = view(head(A, 1000, H1), head("Epeer", 1000, H1), *honest, version=3).choose_head()
    assert two is not None and two.version == 1000 and two.endorsed


def test_a_lone_other_peer_is_followed() -> None:
    """With one other live peer its word is all there is (a swarm of two; a joiner of its
    founder): the quorum is the number of live peers when fewer are live. Peers still at the
    genesis state do not count: joiners that arrive together follow a founder that trained
    alone (before, they formed a branch of their own at version 0 and never met it)."""
    choice = view(head(A, 50, H1), version=0).choose_head()
    assert choice is not None and choice.version == 50 and choice.endorsed
    joiners = view(head(A, 3, H1), head(B, 0, H0), head(C, 0, H0), version=0, state_hash=H0)
    joined = joiners.choose_head()
    assert joined is not None and joined.version == 3 and joined.endorsed
    # ... but to the founder those joiners are live peers: a lone hijacker's v51 is not
    # followed while they are still at genesis (CI's slow phase: the founder at v1 took it)
    founder = view(head(A, 51, H1), head(B, 0, H0), head(C, 0, H0), version=1, state_hash=H2)
    assert founder.choose_head() is None


def test_clients_are_never_donors_but_still_vote() -> None:
    choice = view(head(A, 5, H1, client=True), head(B, 5, H1), version=3).choose_head()
    assert choice is not None and choice.donors == (B,) and choice.votes == {H1: 2}
    only_clients = view(head(A, 5, H1, client=True), version=3).choose_head()
    assert only_clients is not None and only_clients.donors == ()


def test_at_our_version_we_vote_for_our_hash() -> None:
    # one other peer on another branch: a tie of one vote each, the larger hash wins
    assert view(head(A, 3, H1), version=3, state_hash=H2).choose_head() is None
    lost = view(head(A, 3, H2), version=3, state_hash=H1).choose_head()
    assert lost is not None and lost.lost_fork and lost.state_hash == H2 and lost.version == 3
    # two others on our branch outvote a larger hash
    assert view(head(A, 3, H0), head(B, 3, H0), head(C, 3, H2), version=3).choose_head() is None


def test_our_own_head_never_votes_twice_or_donates() -> None:
    v = view(head(ME, 3, H0), head(A, 3, H1), head(B, 3, H1), version=3, state_hash=H0)
    choice = v.choose_head()
    assert choice is not None and choice.lost_fork and choice.votes == {H1: 2, H0: 1}
    assert ME not in choice.donors


# ----------------------------------------------------------------------------- whom to wait for


def test_expected_soon_are_grouping_finishing_or_new_peers_not_ahead() -> None:
    grace = 2.0
    v = view(
        head(A, 3, H0, in_group=True, speed=1.0),  # looking for a group at our state
        head(B, 3, H1, in_group=True, speed=1.0),  # grouping on another branch
        head(C, 3, H0, eta=NOW + 1.5, speed=1.0),  # ends within the grace period
        head(D, 3, H0, eta=NOW + 2.5, speed=1.0),  # ends after it
        head("Epeer", 3, H0, speed=0.0),  # new: no speed yet
        head("Fpeer", 4, H0, in_group=True, speed=0.0),  # ahead of us
        head("Gpeer", 2, H0, eta=NOW + 1.0, speed=1.0),  # behind, finishing: will catch up
        head(ME, 3, H0, in_group=True),
        version=3,
        state_hash=H0,
    )
    assert sorted(v.expected_soon(NOW, grace)) == sorted([A, C, "Epeer", "Gpeer"])


def test_someone_grouping_only_counts_others_at_our_state() -> None:
    assert view(head(A, 3, H0, in_group=True), version=3).someone_grouping()
    assert not view(head(A, 3, H1, in_group=True), version=3).someone_grouping()
    assert not view(head(A, 4, H0, in_group=True), version=3).someone_grouping()
    assert not view(head(ME, 3, H0, in_group=True), version=3).someone_grouping()


def test_still_working_is_a_peer_at_or_below_us_in_a_phase_or_a_group() -> None:
    assert view(head(A, 3, eta=NOW + 100), version=3).still_working()
    assert view(head(A, 1, in_group=True), version=3).still_working()
    assert not view(head(A, 4, eta=NOW + 100), version=3).still_working()
    assert not view(head(A, 3), version=3).still_working()


def test_expected_until_is_the_latest_end_within_the_grace_period() -> None:
    v = view(
        head(A, eta=NOW + 0.5),
        head(B, eta=NOW + 1.9),
        head(C, eta=NOW + 2.1),  # beyond the grace period
        head(D, eta=NOW - 1.0),  # already past
        head(ME, eta=NOW + 1.95),
    )
    assert v.expected_until(NOW, 2.0) == NOW + 1.9
    assert view(head(A, eta=NOW + 3)).expected_until(NOW, 2.0) is None
    # a peer at a later version: we catch up to it first, so its phase counts as ending earlier
    ahead = view(head(A, eta=NOW + 1.0), head(B, 1, eta=NOW + 1.9), head(C, 1, eta=NOW + 2.5))
    assert ahead.expected_until(NOW, 2.0, lead_s=1.5) == NOW + 1.0
    assert ahead.expected_until(NOW, 3.0, lead_s=0.2) == NOW + 2.3


# ----------------------------------------------------------------------------- planning


def test_speeds_leave_out_unmeasured_peers() -> None:
    v = view(head(A, speed=2.0), head(B, speed=0.0))
    assert v.speeds(1.5) == {A: 2.0, ME: 1.5}
    assert v.speeds(None) == {A: 2.0}


@pytest.mark.parametrize(
    ("heads", "expected"),
    [
        ([head(A), head(B)], 20),  # sync: every other live peer's H
        ([head(A), head(ME)], 10),
        ([], 0),
    ],
)
def test_unseen_steps_in_sync_mode_are_every_other_peers_h(
    heads: list[PeerHead], expected: int
) -> None:
    v = view(*heads)
    assert (
        v.unseen_steps(
            synchronous=True, inner_steps=10, co_planners=[A], steps_of={}, probe_steps=2
        )
        == expected
    )


def test_unseen_steps_in_async_mode_are_co_planners_not_showing_a_plan() -> None:
    v = view(
        head(A, 3),  # planning now, plan not published yet
        head(B, 3, eta=NOW + 5, plan={"0": 4}),  # its plan is already counted as in flight
        head(C, 2, eta=NOW + 5, plan={"0": 4}),  # a plan for an older base: counts again
        head(D, 3),  # no speed known: a probe phase
        version=3,
    )
    steps = v.unseen_steps(
        synchronous=False,
        inner_steps=10,
        co_planners=[A, B, C, D, "Gone1"],
        steps_of={A: 7, B: 9, C: 5},
        probe_steps=2,
    )
    assert steps == 7 + 5 + 2


# ----------------------------------------------------------------------------- status


def test_forks_and_bans_as_status_shows_them() -> None:
    heads = [
        head(A, 3, H1, bans={C: "norm 4699 above 4 x median"}),
        head(B, 3, H2, bans={C: "norm 4699 above 4 x median", D: "non-finite"}),
        head(C, 2, H0),
        head(D, 2, H0),
    ]
    assert forks(heads) == {3: [H1, H2]}
    banned = bans(heads)
    assert banned[C].by == (A, B) and banned[C].reasons == ("norm 4699 above 4 x median",)
    assert banned[D].by == (B,) and banned[D].reasons == ("non-finite",)
    assert forks(heads[2:]) == {} and bans(heads[2:]) == {}


def test_status_lists_live_peers_newest_first_with_forks_and_bans() -> None:
    from diloco_peer.coordinator_free.status import status_document

    heads = {
        A: head(A, 3, H1, bans={C: "non-finite"}, rss_mb=120.0, utilization=0.93),
        B: head(B, 3, H2, bans={C: "non-finite"}),
        C: head(C, 2, H0),
        D: head(D, 5, H0, updated=0.0),  # left: not listed, not the head
        "Epeer": head("Epeer", 4, H0, updated=NOW - 61),  # silent past the TTL
    }
    doc = status_document("t", heads, NOW + 1)
    assert [p["peer_id"] for p in doc["peers"]] == [A, B, C]
    assert doc["head_version"] == 3 and doc["forks"] == {"3": [H1, H2]}
    assert doc["banned"] == {C: {"by": [A, B], "reasons": ["non-finite"]}}
    assert [p["banned_by"] for p in doc["peers"]] == [0, 0, 2]
    assert doc["peers"][0]["rss_mb"] == 120.0 and doc["peers"][0]["last_seen_s"] == 1.0
    assert doc["peers"][0]["utilization"] == 0.93 and doc["peers"][1]["utilization"] is None
    assert status_document("t", {}, NOW)["head_version"] is None


# ----------------------------------------------------------------------------- round plans


def test_group_plan_sync_waits_for_every_live_peer_capped_at_the_group_size() -> None:
    v = view(head(A), head(B, version=1), head(C, eta=NOW + 999))
    plan = group_plan(v, asynchronous=False, now=NOW, grace_s=5, group_size=64, sync_timeout_s=30)
    assert plan == GroupPlan((A, B, C), target_size=4, timeout_s=30)
    small = group_plan(v, asynchronous=False, now=NOW, grace_s=5, group_size=2, sync_timeout_s=30)
    assert small is not None and small.target_size == 2


def test_group_plan_async_waits_only_for_peers_due_within_the_grace() -> None:
    v = view(
        head(A, eta=NOW + 3, speed=1.0), head(B, eta=NOW + 99, speed=1.0),
        head(C, in_group=True, speed=1.0), head(D, version=2, in_group=True, speed=1.0),
    )  # fmt: skip
    plan = group_plan(v, asynchronous=True, now=NOW, grace_s=5, group_size=64, sync_timeout_s=30)
    assert plan == GroupPlan((A, C), target_size=3, timeout_s=5)
    nobody = view(head(B, eta=NOW + 99, speed=1.0))
    assert group_plan(nobody, asynchronous=True, now=NOW, grace_s=5, group_size=64,
                      sync_timeout_s=30) is None  # fmt: skip
    assert group_plan(view(), asynchronous=False, now=NOW, grace_s=5, group_size=64,
                      sync_timeout_s=30) is None  # fmt: skip


def test_phase_steps_are_h_in_sync_a_probe_first_then_dylu() -> None:
    v = view(head(A, speed=2.0))
    assert phase_steps(v, None, inner_steps=50, asynchronous=False) == 50
    assert phase_steps(v, None, inner_steps=50, asynchronous=True) == probe_steps(50) == 3
    assert probe_steps(2) == 1
    assert phase_steps(v, 1.0, inner_steps=50, asynchronous=True) == 25  # half A's speed
    assert phase_steps(v, 4.0, inner_steps=50, asynchronous=True) == 50
