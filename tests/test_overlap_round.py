"""Overlapped rounds in the swarm (peer/overlap.py, ALGORITHMS §1.1): the fold's rule as pure
logic, then real peers that train through their rounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST_RUN

from diloco_peer.config import SwarmSettings
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches
from diloco_peer.peer.delta import Contribution
from diloco_peer.peer.events import read_log
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.inner import InnerTrainer
from diloco_peer.peer.overlap import Overlap
from diloco_peer.peer.round import Round, RoundOutcome, RoundStatus
from diloco_peer.peer.telemetry import Counters, RoundReport


class _Params:
    """The part of InnerTrainer the fold touches: its parameters and its `rebase`."""

    rebase = InnerTrainer.rebase
    snapshot = InnerTrainer.snapshot

    def __init__(self, value: float) -> None:
        self.params = [torch.full((3,), value)]


def _overlap(local: float, theta: float, fold: str = "mix", keep: float = 0.5,
             start_from: str = "phase", activity: Activity | None = None):  # fmt: skip
    trainer = _Params(local)
    state = [torch.full((3,), theta)]
    swarm = SwarmSettings(overlap=True, overlap_fold=fold, overlap_keep=keep,
                          overlap_from=start_from)  # type: ignore[arg-type]  # fmt: skip
    overlap = Overlap(trainer, lambda: state, swarm,  # type: ignore[arg-type]
                      activity or Activity(), Counters())  # fmt: skip
    return trainer, state, overlap


def _value(trainer: _Params) -> float:
    return float(trainer.params[0][0])


APPLIED = RoundOutcome(
    RoundStatus.COMMITTED,
    RoundReport(version=1, state_hash="h", group_size=2, loss=1.0, ppl=None, comm_s=0.1,
                bytes_sent=0, bytes_received=0, steps=10, staleness=0, members=["a", "b"]),
)  # fmt: skip
KEPT = RoundOutcome(RoundStatus.KEPT, reason="no group")


def _round_in_flight(overlap: Overlap, outcome: RoundOutcome | None) -> threading.Event:
    """Hand a round to `overlap` that returns `outcome` once the event is set."""
    release = threading.Event()

    def work() -> RoundOutcome | None:
        assert release.wait(10)
        return outcome

    overlap.start(work)
    return release


def _end(overlap: Overlap) -> None:
    """Wait until the round thread is done (poll folds only then)."""
    deadline = time.time() + 10
    while overlap._thread is not None and overlap._thread.is_alive():  # noqa: SLF001
        assert time.time() < deadline
        time.sleep(0.01)


def test_applied_round_is_mixed_in_at_the_first_step_boundary_after_it_ends() -> None:
    trainer, state, overlap = _overlap(local=1.0, theta=0.0, fold="mix", keep=0.5)
    release = _round_in_flight(overlap, APPLIED)
    assert overlap.begin_phase()  # in flight: the phase starts from its own parameters
    trainer.params[0] += 1.0  # a step: local 2.0
    assert not overlap.poll()  # the round is still running: nothing folded
    state[0].fill_(4.0)  # the round's outer step, then it ends
    release.set()
    _end(overlap)
    assert overlap.poll() and not overlap.in_flight
    assert _value(trainer) == pytest.approx(4.0 + 0.5 * (2.0 - 4.0))  # θ + κ(x − θ)
    assert not overlap.poll()  # once


def test_mix_reports_the_phases_progress_without_what_the_merge_leaves_in_the_delta() -> None:
    # The merge keeps κ(b − θᵗ⁺¹) in the parameters; the δ measured against θᵗ⁺¹ then holds
    # κ(θᵗ⁺¹ − b), our own last δ less the outer step, which points against the other
    # members'. `report` takes it out: the phases' progress, κ of it before the fold (the
    # round adds the term every member of its group shares, `Round._sent`).
    trainer, state, overlap = _overlap(local=-1.0, theta=0.0, fold="mix", keep=0.5)
    release = _round_in_flight(overlap, APPLIED)
    assert overlap.begin_phase()  # b = −1.0
    trainer.params[0] -= 1.0  # progress 1.0 before the fold: local −2.0
    state[0].fill_(-4.0)  # θᵗ⁺¹
    release.set()
    _end(overlap)
    assert overlap.poll()
    assert _value(trainer) == pytest.approx(-3.0)  # −4 + 0.5 (−2 + 4)
    trainer.params[0] -= 0.5  # progress 0.5 after the fold: local −3.5
    measured = state[0] - trainer.params[0]  # κ·1.0 + 0.5 + κ(θᵗ⁺¹ − b) = −0.5
    assert float(measured[0]) == pytest.approx(-0.5)
    sent = overlap.report([measured])[0]
    assert float(sent[0]) == pytest.approx(0.5 * 1.0 + 0.5)
    assert overlap.report([measured])[0].eq(measured).all()  # once


class _Replica:
    def __init__(self, damping: list[torch.Tensor] | None) -> None:
        self.damping = damping
        self.state = SimpleNamespace(part=lambda: [0])  # one tensor, the whole model

    def last_damping(self) -> list[torch.Tensor] | None:
        return self.damping


@pytest.mark.parametrize(
    ("fold", "overlap", "known", "sent"),
    [("mix", True, True, 2.0 + 0.5 * -0.8), ("mix", True, False, 2.0),
     ("rebase", True, True, 2.0), ("mix", False, True, 2.0)],
)  # fmt: skip
def test_a_mix_delta_is_offered_with_the_term_of_the_version_its_group_is_at(
    fold: str, overlap: bool, known: bool, sent: float
) -> None:
    # Round._sent: progress plus κ·(Δ − (θ_{v−1} − θ_v)) of the update that made the replica's
    # version, when the replica knows it; every other rule, and blocking rounds, send δ alone.
    swarm = SwarmSettings(overlap=overlap, overlap_fold=fold, overlap_keep=0.5)  # type: ignore[arg-type]
    replica = _Replica([torch.full((3,), -0.8)] if known else None)
    holder = SimpleNamespace(swarm=swarm, replica=replica)
    mine = Contribution([torch.full((3,), 2.0)], base_version=3, shard_samples={}, steps=1)
    offered = Round._sent(holder, mine)  # type: ignore[arg-type]
    assert offered[0].eq(sent).all() and mine.delta[0].eq(2.0).all()  # the ledger's δ as it was


def test_the_group_start_waits_for_the_rounds_group_or_its_end() -> None:
    activity = Activity()
    _, _, overlap = _overlap(local=1.0, theta=0.0, start_from="group", activity=activity)
    release = _round_in_flight(overlap, APPLIED)
    waiter = threading.Thread(target=overlap.await_group)
    waiter.start()
    waiter.join(0.8)
    assert waiter.is_alive()  # no group yet: the next phase does not start
    activity.formed.set()  # what the round's admission does once the group is formed
    waiter.join(5)
    assert not waiter.is_alive() and overlap.in_flight  # the all-reduce runs behind the phase
    assert overlap.begin_phase()
    release.set()
    overlap.settle()
    release = _round_in_flight(overlap, KEPT)  # the hand-off clears it; no group ever forms
    assert not activity.formed.is_set()
    threading.Timer(0.3, release.set).start()
    overlap.await_group()  # returns once the round is over
    assert not overlap.begin_phase()  # τ = 0: the phase loads θ_global
    _, _, at_once = _overlap(local=1.0, theta=0.0, start_from="phase")
    release = _round_in_flight(at_once, APPLIED)
    at_once.await_group()  # `phase`: returns at once, the round still in flight
    assert at_once.in_flight
    release.set()
    at_once.wait()


def test_rebase_rule_moves_the_progress_since_the_phase_began_onto_the_new_state() -> None:
    trainer, state, overlap = _overlap(local=1.0, theta=0.0, fold="rebase", keep=0.5)
    release = _round_in_flight(overlap, APPLIED)
    assert overlap.begin_phase()  # b = 1.0
    trainer.params[0] += 2.0  # local 3.0: progress 2.0
    state[0].fill_(5.0)
    release.set()
    overlap.settle()  # at the phase's end
    assert _value(trainer) == pytest.approx(5.0 + 0.5 * 2.0)


def test_pull_mixes_the_parameters_but_reports_the_phases_own_progress() -> None:
    trainer, state, overlap = _overlap(local=1.0, theta=0.0, fold="pull", keep=0.5)
    release = _round_in_flight(overlap, APPLIED)
    assert overlap.begin_phase()  # b = 1.0
    trainer.params[0] += 1.0  # progress 1.0 before the fold: local 2.0
    state[0].fill_(4.0)
    release.set()
    _end(overlap)
    assert overlap.poll()
    assert _value(trainer) == pytest.approx(3.0)  # mix's parameters: 4 + 0.5 (2 - 4)
    trainer.params[0] += 0.5  # progress 0.5 after it: local 3.5
    delta = overlap.report([state[0] - trainer.params[0]])  # θ − θ_local = 0.5, as sent:
    assert float(delta[0][0]) == pytest.approx(-1.5)  # minus the phase's progress, 1.0 + 0.5
    assert overlap.report([torch.zeros(3)])[0].eq(0).all()  # once


@pytest.mark.parametrize("outcome", [KEPT, RoundOutcome(RoundStatus.DROPPED), None])
def test_a_round_that_applied_nothing_leaves_only_this_phases_progress(
    outcome: RoundOutcome | None,
) -> None:
    # The previous phase's progress (local 1.0 against θ 0.0) is in the δ ledger (kept), lost
    # (dropped) or never contributed (the run ended): the parameters keep only this phase's.
    trainer, state, overlap = _overlap(local=1.0, theta=0.0, fold="mix", keep=0.5)
    release = _round_in_flight(overlap, outcome)
    assert overlap.begin_phase()
    trainer.params[0] += 0.25
    release.set()
    overlap.settle()
    assert _value(trainer) == pytest.approx(0.25)


def test_a_round_over_before_the_next_phase_is_not_folded_the_phase_loads_the_state() -> None:
    trainer, _, overlap = _overlap(local=1.0, theta=7.0)
    _round_in_flight(overlap, APPLIED).set()
    _end(overlap)
    assert not overlap.begin_phase()  # τ = 0: the blocking phase (it loads θ_global itself)
    assert not overlap.in_flight and _value(trainer) == 1.0


def test_what_the_round_raised_is_raised_in_the_training_thread() -> None:
    _, _, overlap = _overlap(local=1.0, theta=0.0)
    release = threading.Event()

    def work() -> RoundOutcome:
        assert release.wait(10)
        raise RuntimeError("the round broke")

    overlap.start(work)
    assert overlap.begin_phase()
    release.set()
    with pytest.raises(RuntimeError, match="the round broke"):
        overlap.settle()
    assert not overlap.in_flight
    overlap.start(lambda: (_ for _ in ()).throw(RuntimeError("again")))
    _end(overlap)
    with pytest.raises(RuntimeError, match="again"):  # a phase that begins after it: at once
        overlap.begin_phase()


def test_a_peer_is_in_a_round_from_the_hand_off_until_the_round_ends() -> None:
    # its head says "in a group" while its next phase trains: async peers wait for it
    activity = Activity(training=True, eta=123.0)
    overlap = Overlap(_Params(1.0), lambda: [torch.zeros(3)],  # type: ignore[arg-type]
                      SwarmSettings(overlap=True), activity, Counters())  # fmt: skip

    def work() -> RoundOutcome:
        assert activity.grouping  # already at the hand-off, before the group search
        activity.idle()  # what the round does when it ends
        return APPLIED

    overlap.start(work)
    assert overlap.wait() is APPLIED
    assert not activity.grouping and activity.eta == 123.0  # the running phase's eta stays


def test_a_rounds_waits_count_as_idle_only_while_the_training_thread_waits_for_it() -> None:
    counters = Counters(started_training=True, t_first_train=time.time() - 100.0)
    overlap = Overlap(_Params(1.0), lambda: [torch.zeros(3)],  # type: ignore[arg-type]
                      SwarmSettings(overlap=True), Activity(), counters)  # fmt: skip

    def waits(seconds: float) -> RoundOutcome:
        counters.wait_s += seconds  # what the round's group search and all-reduce add
        return APPLIED

    overlap.start(lambda: waits(30.0))  # over while the next phase trained: folded by poll
    _end(overlap)
    overlap.begin_phase()
    assert counters.wait_s == 30.0 and counters.hidden_wait_s == 30.0
    assert counters.idle_fraction() == pytest.approx(0.0, abs=1e-3)
    release = _round_in_flight(overlap, APPLIED)  # the phase ends first and waits for it
    threading.Timer(0.3, release.set).start()
    overlap.settle()
    assert counters.hidden_wait_s == 30.0  # that round added no waits of its own
    overlap.start(lambda: (time.sleep(0.3), waits(10.0))[1])  # 10 s of waits, 0.3 s blocked
    overlap.wait()
    assert 39.0 < counters.hidden_wait_s <= 39.7  # 0.3 s or more of it was not hidden
    assert counters.idle_fraction() == pytest.approx(
        (40.0 - counters.hidden_wait_s) / 100, abs=0.01
    )


def test_one_round_in_flight_at_most() -> None:
    _, _, overlap = _overlap(local=1.0, theta=0.0)
    release = _round_in_flight(overlap, APPLIED)
    with pytest.raises(RuntimeError):
        overlap.start(lambda: APPLIED)
    release.set()
    assert overlap.wait() is APPLIED


# ----- real peers


def _demo(protocol: str, tmp: Path) -> tuple[dict, list[dict]]:
    log = tmp / f"demo-{protocol}.jsonl"
    out = subprocess.run(
        [*PEER_COMMAND, "demo", "--peers", "3", "--total-steps", "200", "--model", "nano",
         "--inner-steps", "20", "--protocol", protocol, "--overlap", "--json",
         "--timeout-s", "200", "--log-json", str(log)],
        capture_output=True, text=True, timeout=230, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout), read_log(log)


# Slow phase: the default suite's overlapped peers are the kill and late-join test below (sync,
# the default rule); async overlapped peers also run in tests/test_swarm.py's kill test (slow too).
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(260)
@pytest.mark.parametrize("protocol", ["sync", "async"])
def test_peers_train_through_their_rounds_and_agree(protocol: str, tmp_path: Path) -> None:
    doc, events = _demo(protocol, tmp_path)
    assert doc["overlap"] and doc["hashes_agree"], doc
    # A run to a number of local steps, not of versions: an async swarm's groups split apart
    # as its peers drift (2+1, 1+1+1), and a version then holds a third to two thirds of a
    # 3-group's steps. Six versions held 131 to 328 steps in six runs (ppl 50.4 to 11.5 from
    # 194); a CI run failed on the 131. 200 steps is four to ten versions.
    assert doc["applied_steps"] >= 200 and doc["final_version"] >= 4, doc
    assert doc["ppl_after"] < doc["ppl_before"] / 5, doc
    rounds = [e for e in events if e["event"] == "round"]
    # The round ran while the next phase trained: the event says so, and it is no rare accident
    # (a peer's last round may end after its last phase; on 2 shared cores a short loopback
    # round often ends before the next phase's first step: 6 and 8 of 18 rounds were overlapped
    # in two runs, at the code before warm-up 50 too, where half was asked). Blocking: none.
    overlapped = [e["overlapped"] for e in rounds]
    assert sum(overlapped) >= len(rounds) // 4, overlapped
    # ...and the peers still met: a peer whose round is in flight says it is in a group, so an
    # async peer does not apply alone beside it (Overlap.start)
    grouped = [e["group_size"] > 1 for e in rounds]
    assert sum(grouped) >= len(rounds) // 2, [e["group_size"] for e in rounds]
    assert all(p["utilization"] is not None for p in doc["peers"]), doc["peers"]


OVERLAP_RUN = FAST_RUN + "overlap = true\n"
REBASE = 'overlap_fold = "rebase"\n'
"""The other fold, with its own defaults (κ 1, from the phase): the default rule with fragments."""


# Slow phase: the report's rule is the unit tests above, the screen's with the shared term in
# tests/test_robust.py; the default suite's peers below mix too (the default rule).
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_mixing_peers_train_through_the_all_reduce_and_pass_each_others_screens(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    # `mix` sends the group's last average where the merge left the peer's own last δ: the
    # members' δs then differ by their phases' progress only, and the cosine screen (on by
    # default) excludes none of them. (Sending the own last δ, honest δs pointed apart.)
    cfg = tmp_path / "run.toml"
    cfg.write_text(OVERLAP_RUN + "expected_peers = 3\n")  # the default rule: mix from the group
    until = ["--until-version", "8"]
    a, log_a = swarm.start("a", "--config", str(cfg), *until)
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    (b, log_b), (c, log_c) = (swarm.start(n, "--swarm", maddr, *until) for n in "bc")
    for proc in (a, b, c):
        assert proc.wait(timeout=200) == 0
    branch = branches(log_a, log_b, log_c)
    assert branch.one_branch and max(branch.agreed) >= 8, branch.conflicts
    events = [e for log in (log_a, log_b, log_c) for e in read_log(log)]
    assert not [e for e in events if e["event"] == "excluded"]
    rounds = [e for e in events if e["event"] == "round"]
    assert sum(e["group_size"] == 3 for e in rounds) >= len(rounds) // 2
    assert sum(e["overlapped"] for e in rounds) >= len(rounds) // 4


@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rule", ["", pytest.param(REBASE, marks=pytest.mark.slow, id="rebase")])
def test_a_late_joiner_and_a_killed_peer_leave_one_branch(
    swarm: LocalSwarm, tmp_path: Path, rule: str
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(OVERLAP_RUN + rule)
    until = ["--until-version", "12"]
    a, log_a = swarm.start("a", "--config", str(cfg), *until)
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until)
    c, log_c = swarm.start("c", "--swarm", maddr, *until)
    swarm.wait_event(log_c, "round", 150, count=2)
    # c's main process alone is killed (its DHT child is left behind, as after the OOM killer)
    # while a round of its runs in the background of a phase
    os.kill(c.pid, signal.SIGKILL)
    d, log_d = swarm.start("d", "--swarm", maddr, *until)  # joins late: downloads the state
    caught = swarm.wait_event(log_d, "catch_up", 150)
    assert caught["version"] >= 2
    # a mixing peer's download (the default rule's) steps from the version below the head, to
    # know the common term; a `rebase` peer's does not
    assert caught["method"] == "download" and caught["stepped"] is (rule != REBASE)
    for proc in (a, b, d):
        assert proc.wait(timeout=200) == 0
    branch = branches(log_a, log_b, log_d)
    assert branch.one_branch, branch.conflicts
    assert max(branch.agreed) >= 12
    # the survivors trained through their rounds (the late joiner may apply only a few rounds,
    # each over before its next phase began: seen once in a fresh-clone CI run)
    assert any(e["event"] == "round" and e["overlapped"]
               for log in (log_a, log_b, log_d) for e in read_log(log))  # fmt: skip
