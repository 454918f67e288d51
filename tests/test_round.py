"""The round (peer/round.py) on a real replica and guard with a fake averager and a hand-built
swarm view: every outcome (committed, alone, retry, kept, dropped), whom a sync group marks
absent, and the bounded retry loop. End to end, tests/test_swarm.py runs these with real peers."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco_peer.averaging.certificate import Statement
from diloco_peer.averaging.contribution import ContributionHeader
from diloco_peer.averaging.group_averager import GroupResult
from diloco_peer.averaging.marks import SILENT_HOLD_S
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import SwarmSettings
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HeadBook, SwarmView
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import AllReduceFailed, CommitRefusal, LeftOut, NoGroup
from diloco_peer.identity import Identity
from diloco_peer.peer.certify import Certifier
from diloco_peer.peer.delta import Contribution, Ledger
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.phase import Training
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.round import LOOK_AGAIN_S, Round, RoundStatus
from diloco_peer.peer.telemetry import Counters, TensorBoard
from diloco_peer.peer.trust import Guard

ME = Identity.generate()
OTHER = "PeerBee"


class FakeHeads:
    """The swarm view a round reads: other peers at our version and state, with the fields
    `others` gives each (in a group search, training until eta, ...)."""

    def __init__(self, replica: Replica, others: dict[str, dict[str, Any]]) -> None:
        self.replica, self.others = replica, others
        self.book = HeadBook(ME.peer_id_str)
        self.published: list[bool] = []
        self.sealed: list[UpdateRecord] = []
        """The updates the round sealed (stands in for Certifier.seal)."""
        self.rival: list[Statement] = []
        """What `rivals` answers: another group's claim on the same base, if any."""
        self.voided: list[UpdateRecord] = []

    # Certifier's part (peer/certify.py `Sealer`), on the same fake
    def seal(self, record: UpdateRecord) -> None:
        self.sealed.append(record)

    def rivals(self, record: UpdateRecord) -> list[Statement]:
        return self.rival

    def void(self, record: UpdateRecord) -> None:
        self.voided.append(record)

    def view(self) -> SwarmView:
        # the others are at our published state (while we commit, our replica is one ahead)
        v, h = self.replica.published_version, self.replica.published_hash
        heads = {
            p: PeerHead(peer_id=p, version=v, state_hash=h, **f) for p, f in self.others.items()
        }
        return SwarmView(ME.peer_id_str, self.replica.version, h, heads)

    def publish(self, in_group: bool = False, leaving: bool = False) -> None:
        self.published.append(in_group)

    def mark_absent(self, expected: Any, present: Any, now: float, *, until: Any = None) -> None:
        self.book.mark_absent(expected, present, now, until=until)


class FakeAverager:
    """Answers `average` with each of `answers` in turn (an exception is raised)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[dict[str, Any]] = []

    def average(self, key: str, delta: list[torch.Tensor], **kwargs: Any) -> GroupResult:
        self.calls.append({"key": key, **kwargs})
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **fields: Any) -> None:
        self.emitted.append((event, fields))

    def names(self) -> list[str]:
        return [e for e, _ in self.emitted]


def make_round(
    averager: FakeAverager,
    others: dict[str, dict[str, Any]],
    *,
    protocol: str = "sync",
    catch_up: Any = lambda: False,
) -> tuple[Round, Replica, FakeHeads, Events]:
    swarm = SwarmSettings(protocol=protocol, staleness_limit=2)  # type: ignore[arg-type]
    state = ReplicatedState([torch.zeros(4)], build_outer_optimizer("sgd", lr=1.0), 2, "m" * 64)
    replica = Replica(state, UpdateLog(4))
    replica.snapshot()
    heads, events = FakeHeads(replica, others), Events()
    trainer = SimpleNamespace(speed=SimpleNamespace(steps_per_s=2.0),
                              spec=SimpleNamespace(inner_steps=50))  # fmt: skip
    training = SimpleNamespace(eval_ppl=lambda: 7.0, trainer=trainer)
    training.grace_s = partial(Training.grace_s, training)
    part = Round(
        me=ME.peer_id_str, swarm=swarm, replica=replica, training=training,  # type: ignore[arg-type]
        guard=Guard(ME, "run1", swarm), averager=lambda: averager, heads=heads,  # type: ignore[arg-type]
        activity=Activity(eta=123.0), counters=Counters(), ledger=Ledger(),
        events=events, tensorboard=TensorBoard(None), catch_up=catch_up,  # type: ignore[arg-type]
        certifier=heads,  # type: ignore[arg-type]
    )  # fmt: skip
    return part, replica, heads, events


def delta(base: int = 0) -> Contribution:
    return Contribution([torch.full((4,), 0.5)], base, {1: 40}, 10)


def result(members: list[str]) -> GroupResult:
    return GroupResult(
        average=[torch.full((4,), 0.25)], members=sorted(members), weights={}, gathered={},
        group_id=b"g", bytes_sent=10, bytes_received=12, matchmaking_s=0.1, allreduce_s=0.1,
    )  # fmt: skip


def test_a_delta_older_than_the_staleness_limit_is_dropped_and_counted() -> None:
    part, replica, _, events = make_round(FakeAverager(AssertionError("not asked")), {})
    replica.state.version = 3  # δ of base 0: staleness 3 > limit 2
    outcome = part.run(delta(base=0), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.DROPPED and not outcome.applied
    assert part.counters.dropped == 1 and events.names() == ["dropped"]
    assert part.activity.eta is None and part.ledger.pending is None


def test_a_delta_that_is_not_finite_is_dropped_not_signed() -> None:
    """A diverged δ (NaN or inf) cannot be signed (the header's norm must be finite): it is
    dropped and counted instead of ending the peer (the hostile bench's hijack-lone=1000 left
    every honest peer crashing on one)."""
    part, replica, _, events = make_round(FakeAverager(AssertionError("not asked")), {})
    bad = Contribution([torch.tensor([1.0, float("nan"), 0.0, 0.0])], 0, {1: 40}, 10)
    outcome = part.run(bad, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.DROPPED and replica.version == 0
    assert events.emitted[-1][1]["reason"] == "not finite" and part.counters.dropped == 1


def test_alone_in_the_swarm_a_peer_applies_its_own_delta() -> None:
    part, replica, heads, events = make_round(FakeAverager(AssertionError("not asked")), {})
    mine = delta()
    outcome = part.run(mine, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.ALONE and outcome.report is not None
    assert replica.version == 1 and torch.equal(replica.state.theta[0], torch.full((4,), -0.5))
    assert outcome.report.group_size == 1 and outcome.report.ppl == 7.0
    assert part.ledger.last_own == (1, mine) and part.co_planners == []
    assert part.counters.rounds_done == 1 and events.names() == ["round"]
    # the event says what it contributed (the health page's per-peer totals)
    assert events.emitted[0][1]["contributions"] == {ME.peer_id_str: [mine.steps, 40]}
    assert replica.published_hash == replica.state.hash() and heads.published == [False]
    # its update carries its own signed header, and its seal makes a certificate that verifies
    (record,) = heads.sealed
    check = Certifier(lambda: None, part.guard, recent_norms=lambda: [])
    statement = check.check(record, {ME.peer_id_str: check.seal_bytes(record)})
    assert (
        statement.members == (ME.peer_id_str,) and statement.result_hash == replica.published_hash
    )


def test_a_sync_round_without_a_group_keeps_the_delta() -> None:
    averager = FakeAverager(NoGroup("nobody came"))
    part, replica, heads, events = make_round(averager, {OTHER: {}})
    mine = delta()
    outcome = part.run(mine, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and outcome.reason == "no group formed"
    assert part.ledger.pending is mine and replica.version == 0
    assert events.names() == ["round_failed"] and heads.published == [True]
    assert averager.calls[0]["matchmaking_timeout_s"] == part.swarm.sync_timeout_s
    assert averager.calls[0]["target_size"] == 2 and averager.calls[0]["key"].startswith("v0_")
    assert heads.book.absent == {}  # late is not gone: nobody is marked absent


def test_a_kept_delta_joins_a_delta_that_lost_a_fork_meanwhile() -> None:
    # the catch-up just before the group search found our last branch lost: that δ went into
    # the ledger after ours was taken; a failed group must keep both, not ours alone
    part, _, _, _ = make_round(FakeAverager(NoGroup("nobody came")), {OTHER: {}})
    mine, lost = delta(base=1), delta(base=0)
    part.ledger.pending = lost
    part.replica.state.version = 1
    assert part.run(mine, loss=2.0, t0=0.0).status is RoundStatus.KEPT
    kept = part.ledger.pending
    assert kept is not None and kept.steps == 20 and kept.base_version == 0
    assert torch.equal(kept.delta[0], torch.full((4,), 1.0))


def test_a_failed_all_reduce_keeps_the_delta() -> None:
    part, replica, _, events = make_round(FakeAverager(AllReduceFailed("reducer gone")),
                                          {OTHER: {}})  # fmt: skip
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and outcome.reason.startswith("all-reduce failed")
    assert replica.version == 0 and events.names() == ["round_failed"]


def test_members_a_failed_all_reduce_waited_for_are_absent_and_named_in_the_retry() -> None:
    """Issue 16, item 4: the all-reduce failed because OTHER never sent its parts (our reducer
    names it). The round keeps δ, holds OTHER absent although it keeps heartbeating (the next
    group does not wait for it), and names it in the retry's header, whose admission then
    leaves it out when most members name it."""
    failed = AllReduceFailed("timed out", silent=(OTHER,))
    part, _, heads, events = make_round(FakeAverager(failed), {OTHER: {}, "Thirdpeer": {}})
    before = time.time()
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and part.ledger.pending is not None
    assert events.names() == ["silent", "round_failed"]
    assert events.emitted[0][1]["silent_peers"] == [OTHER]
    book = heads.book
    assert set(book.absent) == {OTHER} and book.held[OTHER] >= before + SILENT_HOLD_S
    fresh = time.time() + 1.0  # a heartbeat after the failure: still absent until the hold ends
    book.merge({OTHER: PeerHead(peer_id=OTHER, version=0, state_hash="ab" * 32, updated=fresh)},
               fresh)  # fmt: skip
    assert OTHER not in book.live(fresh)
    assert OTHER in book.live(book.held[OTHER] + 0.1)
    offer = part.guard.offer([torch.zeros(4)], key="v0_" + "0" * 16, version=0,
                             state_hash="0" * 64, base_version=0, steps=1, shard_samples={1: 4})  # fmt: skip
    header = ContributionHeader.verify_bytes(offer.gather, ME.peer_id_str)
    assert header.silent == (OTHER,)


def test_a_sync_group_commits_the_average_and_marks_who_it_formed_without() -> None:
    others: dict[str, dict[str, Any]] = {OTHER: {}, "Thirdpeer": {}}
    part, replica, _, events = make_round(FakeAverager(result([ME.peer_id_str, OTHER])), others)
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.COMMITTED and outcome.report is not None
    assert outcome.report.group_size == 2 and outcome.report.bytes_sent == 10
    assert torch.equal(replica.state.theta[0], torch.full((4,), -0.25))  # sgd, lr 1: -average
    assert part.co_planners == [OTHER]
    assert set(part.heads.book.absent) == {"Thirdpeer"}
    event = events.emitted[-1][1]  # the stages' seconds, for the simulator's calibration
    assert event["matchmaking_s"] == 0.1 and event["allreduce_s"] == 0.1
    assert event["settle_s"] >= 0 and "combine_s" not in event


def test_a_two_stage_sync_round_marks_absent_only_who_no_group_of_the_update_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Our group is one of several: the others' members are not in our group's result, but the
    combined update names them; a peer no group named is absent."""
    others: dict[str, dict[str, Any]] = {OTHER: {}, "Thirdpeer": {}, "Fourthpeer": {}}
    part, _, _, _ = make_round(FakeAverager(result([ME.peer_id_str, OTHER])), others)
    monkeypatch.setattr("diloco_peer.peer.round.two_stage", lambda headers, size: True)
    union = sorted([ME.peer_id_str, OTHER, "Thirdpeer"])

    def stage_two(rnd: Round, *args: Any) -> Any:
        report = SimpleNamespace(members=union)
        return SimpleNamespace(status=RoundStatus.COMMITTED, report=report)

    part.stage_two = SimpleNamespace(run=stage_two)  # type: ignore[assignment]
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.COMMITTED
    assert set(part.heads.book.absent) == {"Fourthpeer"}


def test_a_group_that_sees_another_group_committed_on_its_base_gives_the_version_up() -> None:
    """Issue 15: one version, one group. Another group's members sealed an update on our base
    before we read the seals: our group keeps its δs for the next round (nothing applied), and
    withdraws its own seal so that no later group takes it for a rival."""
    others: dict[str, dict[str, Any]] = {OTHER: {}}
    part, replica, heads, events = make_round(FakeAverager(result([ME.peer_id_str, OTHER])),
                                              others)  # fmt: skip
    before = replica.published_hash
    heads.rival = [Statement("run1", 0, before, "f" * 64, ("Apeer", "Bpeer"))]
    mine = delta()
    outcome = part.run(mine, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and "committed this version first" in outcome.reason
    assert replica.version == 0 and replica.state.hash() == before == replica.published_hash
    assert len(heads.sealed) == 1 and heads.voided == heads.sealed
    assert part.ledger.pending is mine and events.names() == ["round_failed"]
    assert replica.updates.newest() is None  # nothing kept for replay


@pytest.mark.parametrize("claimant_shows", [False, True])
def test_a_claim_given_way_to_once_must_show_a_head_the_second_time(claimant_shows: bool) -> None:
    """A claim no live head stands for (made up, or its keys serve no such state) costs our
    group one round, not our base forever; one that a head shows is given way to again."""
    members = [ME.peer_id_str, OTHER]
    part, replica, heads, _ = make_round(
        FakeAverager(result(members), result(members)), {OTHER: {}}
    )  # fmt: skip
    claim = Statement("run1", 0, replica.published_hash, "f" * 64, ("Apeer", "Bpeer"))
    heads.rival = [claim]
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.KEPT
    view = heads.view
    if claimant_shows:

        def showing() -> SwarmView:  # Apeer at the version the claim made, with its hash
            seen = view()
            shown = PeerHead(peer_id="Apeer", version=1, state_hash="f" * 64)
            return SwarmView(seen.me, seen.version, seen.state_hash,
                             {**seen.heads, "Apeer": shown})  # fmt: skip

        heads.view = showing  # type: ignore[method-assign]
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    if claimant_shows:
        assert outcome.status is RoundStatus.KEPT and replica.version == 0
    else:
        assert outcome.status is RoundStatus.COMMITTED and replica.version == 1


class MovingOn(FakeAverager):
    """Answers like FakeAverager; while the group averages, `shown` peers move past our base
    (the next view, the commit's, shows them there)."""

    def __init__(self, heads: FakeHeads, shown: dict[str, PeerHead], *answers: Any) -> None:
        super().__init__(*answers)
        self.armed = False
        view = heads.view

        def seen() -> SwarmView:
            before = view()
            if not self.armed:
                return before
            self.armed = False
            return SwarmView(before.me, before.version, before.state_hash,
                             {**before.heads, **shown})  # fmt: skip

        heads.view = seen  # type: ignore[method-assign]

    def average(self, key: str, delta: list[torch.Tensor], **kwargs: Any) -> GroupResult:
        self.armed = True
        return super().average(key, delta, **kwargs)


@pytest.mark.parametrize("protocol", ["sync", "async"])
@pytest.mark.parametrize("holders", [1, 2])
def test_a_group_whose_base_the_swarm_moved_past_gives_its_version_up_once(
    protocol: str, holders: int
) -> None:
    """Peers moved to v1 on another branch while our group averaged on v0 (an async lone
    commit that others followed): committing our v1 would fork, so our group keeps its δs for
    the next round, as it does for a claim; one key's head moves nobody. A state given way to
    once is passed over the second time (catch-up could not reach it: a made-up head)."""
    members = [ME.peer_id_str, OTHER]
    others: dict[str, dict[str, Any]] = {OTHER: {}, "PeerCee": {}, "PeerDee": {}}
    part, replica, heads, _ = make_round(FakeAverager(result(members)), others, protocol=protocol)
    moved = {p: PeerHead(peer_id=p, version=1, state_hash="c" * 64)
             for p in ("PeerCee", "PeerDee")[:holders]}  # fmt: skip
    averager = MovingOn(heads, moved, result(members))
    part.averager = lambda: averager  # type: ignore[method-assign]
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    if holders == 1:
        assert outcome.status is RoundStatus.COMMITTED and replica.version == 1
        return
    assert outcome.status is RoundStatus.KEPT and "moved past our base to v1" in outcome.reason
    assert replica.version == 0 and replica.state.hash() == replica.published_hash
    assert heads.sealed == [] and replica.updates.newest() is None
    outcome = part.run(delta(), loss=2.0, t0=0.0)  # still at v0: the same state again
    assert outcome.status is RoundStatus.COMMITTED and replica.version == 1


def test_a_group_commits_beside_a_smaller_groups_version_at_its_own() -> None:
    """Two peers moved to v1 while our group of 3 averaged on v0: our v1 forks with theirs, a
    fork our branch wins (more peers hold it), so our group commits (SwarmView.moved_past)."""
    members = [ME.peer_id_str, OTHER, "PeerEee"]
    others: dict[str, dict[str, Any]] = {p: {} for p in (OTHER, "PeerEee", "PeerCee", "PeerDee")}
    part, replica, heads, _ = make_round(FakeAverager(result(members)), others)
    moved = {p: PeerHead(peer_id=p, version=1, state_hash="c" * 64)
             for p in ("PeerCee", "PeerDee")}  # fmt: skip
    averager = MovingOn(heads, moved, result(members))
    part.averager = lambda: averager  # type: ignore[method-assign]
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.COMMITTED and replica.version == 1


def test_async_waits_only_for_peers_expected_soon() -> None:
    # the other peer trains a long phase: nobody to wait for, the δ is applied at once
    busy = {OTHER: {"speed": 1.0, "eta": 1e12}}
    part, replica, heads, events = make_round(FakeAverager(AssertionError("not asked")), busy,
                                              protocol="async")  # fmt: skip
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.ALONE
    # a lone commit beside live peers says why (netlab forks start with one)
    assert events.emitted[0][0] == "alone"
    assert events.emitted[0][1]["reason"] == "none of 1 live peers expected"
    assert heads.published[0] is True  # it said it was in a group search and looked again


def test_async_looks_again_before_a_lone_commit_and_groups_with_a_peer_ending_now() -> None:
    # netlab: two peers whose phases ended 0.1 s apart each read the other's head before it
    # changed (an end still ahead), found nobody due and committed alone: a fork
    ahead = {OTHER: {"speed": 1.0, "eta": 1e12}}
    averager = FakeAverager(result([ME.peer_id_str, OTHER]))
    part, _, heads, events = make_round(averager, ahead, protocol="async")
    said = heads.publish

    def publish(in_group: bool = False, leaving: bool = False) -> None:
        said(in_group, leaving)
        if in_group:  # the other peer, ending at this moment, says so too
            heads.others[OTHER] = {"speed": 1.0, "in_group": True}

    heads.publish = publish  # type: ignore[method-assign]
    t = time.monotonic()
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.COMMITTED
    assert time.monotonic() - t >= LOOK_AGAIN_S - 0.05 and "alone" not in events.names()
    assert len(averager.calls) == 1 and averager.calls[0]["target_size"] == 2


def test_an_overlapped_async_round_waits_for_peers_due_before_its_next_phase_ends() -> None:
    # the other peer's phase ends in 40 s, past the grace period (12.5 s: half a 25 s phase)
    later = {OTHER: {"speed": 2.0, "eta": time.time() + 40.0}}
    part, _, _, _ = make_round(FakeAverager(AssertionError("not asked")), later, protocol="async")
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.ALONE
    # ...but our next phase trains for 100 s behind this round: waiting is free until 70 s
    averager = FakeAverager(result([ME.peer_id_str, OTHER]))
    part, _, _, _ = make_round(averager, later, protocol="async")
    part.activity.training, part.activity.eta = True, time.time() + 100.0
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.COMMITTED
    assert averager.calls[0]["matchmaking_timeout_s"] == pytest.approx(70.0, abs=1.0)
    assert Activity(training=False, eta=time.time() + 100.0).free_wait_s(time.time()) == 0.0


def test_async_with_nobody_to_wait_for_follows_a_peer_that_moved_on_before_going_alone() -> None:
    # netlab, overlapped: a peer caught up, then another committed alone before our group
    # search; applying alone at the old version forked the state. Catch up, then try there.
    busy = {OTHER: {"speed": 1.0, "eta": 1e12}}
    moved = iter([True, False, False])
    part, _, _, events = make_round(FakeAverager(AssertionError("not asked")), busy,
                                    protocol="async", catch_up=lambda: next(moved))  # fmt: skip
    assert part.run(delta(), loss=2.0, t0=0.0).status is RoundStatus.ALONE
    assert events.names() == ["alone", "round"]  # once, after the catch-up
    assert next(moved, None) is None  # asked before each lone decision (and the look again)


def test_async_without_a_group_retries_at_a_new_head_or_while_a_peer_is_grouping() -> None:
    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    moved = iter([True, False, False, False])
    averager = FakeAverager(NoGroup("nobody came"))
    heads: list[FakeHeads] = []

    def catch_up() -> bool:
        if len(averager.calls) == 4:  # the other peer's group has ended
            heads[0].others[OTHER]["in_group"] = False
        return next(moved)

    part, replica, fake, _ = make_round(averager, grouping, protocol="async", catch_up=catch_up)
    heads.append(fake)
    # 1: the head moved (catch-up) -> retry; 2, 3: a peer at our state is in a group -> look
    # again; 4: nobody grouping any more -> apply alone
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.ALONE and len(averager.calls) == 4


def test_async_never_applies_its_delta_alone_beside_a_group_at_its_state() -> None:
    """An out-of-phase peer that finds no group while others at its state average (their
    heads say so) keeps looking, and keeps its δ when the retries run out: a lone commit
    beside that group would fork the state (netlab, 16 peers: v3 and v6 of one run)."""
    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    averager = FakeAverager(NoGroup("nobody came"))
    part, replica, _, events = make_round(averager, grouping, protocol="async")
    mine = delta()
    outcome = part.run(mine, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and "kept moving" in outcome.reason
    assert len(averager.calls) == 2 + part.swarm.staleness_limit
    assert replica.version == 0 and part.ledger.pending is mine
    # the grace period scales with the phase: H = 50 steps at the fastest speed, 2 steps/s,
    # is 25 s, and half of it (12.5 s) is longer than grace_s (2 s)
    assert part.swarm.grace_share == 0.5 and part.swarm.grace_s == 2.0
    assert averager.calls[0]["matchmaking_timeout_s"] == 12.5


def test_left_out_of_a_group_keeps_the_delta_even_in_async_mode() -> None:
    """A group formed under our key without us (we did not acknowledge it in time): its members
    move to v+1, so applying our δ alone would be a second group under that key, a fork."""
    averager = FakeAverager(LeftOut("committed without me", refusal=CommitRefusal.TOO_LATE))
    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    part, replica, _, events = make_round(averager, grouping, protocol="async")
    mine = delta()
    outcome = part.run(mine, loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and outcome.reason.endswith("TOO_LATE")
    assert len(averager.calls) == 1 and replica.version == 0
    assert part.ledger.pending is mine and events.names() == ["round_failed"]


def test_the_retry_loop_is_bounded() -> None:
    averager = FakeAverager(NoGroup("nobody came"))
    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    part, replica, _, events = make_round(averager, grouping, protocol="async",
                                          catch_up=lambda: True)  # fmt: skip
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and "kept moving" in outcome.reason
    assert len(averager.calls) == 2 + part.swarm.staleness_limit
    assert replica.version == 0 and part.ledger.pending is not None


def test_round_outcomes_are_values() -> None:
    from diloco_peer.peer.round import RoundOutcome

    kept = RoundOutcome(RoundStatus.KEPT, reason="no group formed")
    assert not kept.applied and dataclasses.replace(kept, reason="x").reason == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.status = RoundStatus.RETRY  # type: ignore[misc]


def test_a_peer_that_says_it_is_grouping_for_a_whole_round_is_not_waited_for_again() -> None:
    """A head that says "in a group" and never commits (stale, or a hostile peer's) costs one
    round: the δ is kept, and the next round at the same state applies it alone; a peer that
    starts grouping afterwards is waited for again."""
    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    averager = FakeAverager(NoGroup("nobody came"))
    part, replica, fake, events = make_round(averager, grouping, protocol="async")
    mine = delta()
    assert part.run(mine, loss=2.0, t0=0.0).status is RoundStatus.KEPT
    tries = len(averager.calls)
    outcome = part.run(part.ledger.take(delta()), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.ALONE and len(averager.calls) == tries + 1
    alone = [f for e, f in events.emitted if e == "alone"]
    assert [f["reason"] for f in alone] == ["no group; 1 grouping outwaited"]
    assert outcome.report is not None and outcome.report.steps == 2 * mine.steps
    fake.others["PeerNew"] = {"in_group": True, "speed": 1.0}
    # at v1 (the lone commit) both say they are grouping there: v0's outwaited peers do not
    # carry over, so the round waits for them again
    outcome = part.run(delta(1), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT and replica.version == 1


def test_a_round_says_it_is_in_a_group_until_it_ends_even_in_the_heartbeats_head() -> None:
    """The heartbeat republishes the head every HEAD_TTL_S / 4 with no arguments: while a round
    runs (a two-stage round outlasts that), that head must still say the peer is in a group,
    and once its δ is kept or applied, no more."""
    from diloco_peer.peer.faults import FaultPlan
    from diloco_peer.peer.heads import Facts, HeadChannel

    seen: list[bool] = []
    part: Round | None = None

    class Watching(FakeAverager):
        def average(self, key: str, delta: list[torch.Tensor], **kwargs: Any) -> GroupResult:
            assert part is not None
            seen.append(channel.head().in_group)  # what a heartbeat now would publish
            return super().average(key, delta, **kwargs)

    grouping = {OTHER: {"in_group": True, "speed": 1.0}}
    part, replica, _, _ = make_round(Watching(AllReduceFailed("a part never came")), grouping)
    facts = Facts(speed=lambda: 1.0, batch_size=4, client_mode=lambda: False,
                  bans=lambda: None, resources=lambda: {})  # fmt: skip
    channel = HeadChannel(
        lambda: None, ME, "run1", allow=lambda p: True, replica=replica, counters=Counters(),
        activity=part.activity, facts=facts, faults=FaultPlan(),
    )  # fmt: skip
    assert channel.head().in_group is False
    outcome = part.run(delta(), loss=2.0, t0=0.0)
    assert outcome.status is RoundStatus.KEPT
    assert seen == [True] and channel.head().in_group is False
