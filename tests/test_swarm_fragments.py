"""Streaming DiLoCo's fragments in a swarm (ALGORITHMS §1.2, `swarm.fragments`): the update at
version v moves fragment v mod P alone (its parameters and their outer momentum), its record
holds that fragment's average only, and a peer trains the other fragments on from θ − the
progress not yet synced. Pure parts here; the swarm of real peers at the end."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from diloco_peer.averaging.contribution import Limits
from diloco_peer.averaging.fragments import fragment_parts
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free.manifest import Manifest, check_fragments
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import CheckpointError, ConfigError, ManifestError
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import LocalSwarm, branches, kill_main
from diloco_peer.peer import peer_checkpoint
from diloco_peer.peer.delta import Contribution, Ledger, split
from diloco_peer.peer.events import read_log
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.inner import InnerTrainer
from diloco_peer.peer.model import build_model
from diloco_peer.peer.overlap import Overlap
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.round import RoundOutcome, RoundStatus
from diloco_peer.peer.telemetry import Counters

SHAPES = [(3,), (2, 2), (4,)]


def _state(parts: list[list[int]] | None, seed: int = 0) -> ReplicatedState:
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(s, generator=g) for s in SHAPES]
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    return ReplicatedState(theta, outer, 2, "m" * 64, parts=parts)


def _average(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_an_update_moves_its_fragment_and_that_fragments_momentum_alone() -> None:
    """Fragment 0 = parameters 0 and 2, fragment 1 = parameter 1: version 0's update equals a
    Nesterov step of parameters 0 and 2 alone; version 1's moves parameter 1 alone, from
    momentum zero (it has had no step yet), as a whole-model optimizer would on it alone."""
    frag = _state([[0, 2], [1]])
    assert frag.update_shapes() == [(3,), (4,)] and frag.part(1) == [1]
    before = [t.clone() for t in frag.theta]
    a0 = _average(frag.update_shapes(), 1)
    frag.apply(a0, 2, {0: 8})
    assert torch.equal(frag.theta[1], before[1])  # the other fragment stands still
    alone = ReplicatedState([before[0], before[2]], build_outer_optimizer("nesterov", 0.7, 0.9),
                            2, "m" * 64)  # fmt: skip
    alone.apply(a0, 2)
    assert torch.equal(frag.theta[0], alone.theta[0]) and torch.equal(frag.theta[2], alone.theta[1])
    m = frag.outer.state_dict()["tensors"]
    assert torch.equal(m["m.1"], torch.zeros(2, 2))  # no momentum for the fragment not stepped
    assert frag.version == 1 and frag.update_shapes() == [(2, 2)]
    a1 = _average(frag.update_shapes(), 2)
    frag.apply(a1, 3)
    one = ReplicatedState([before[1]], build_outer_optimizer("nesterov", 0.7, 0.9), 2, "m" * 64)
    one.apply(a1, 3)
    assert torch.equal(frag.theta[1], one.theta[0])
    assert frag.shard_samples == [8, 0] and frag.version == 2


def test_one_fragment_is_the_whole_model_bit_for_bit() -> None:
    plain, one = _state(None), _state([[0, 1, 2]])
    for seed in range(3):
        avg = _average(plain.update_shapes(), seed)
        plain.apply(avg, 2)
        one.apply(avg, 2)
    assert plain.hash() == one.hash()


def test_fragments_must_hold_every_parameter_once_and_a_wrong_fragment_is_refused() -> None:
    with pytest.raises(ConfigError, match="every parameter once"):
        _state([[0], [1]])
    with pytest.raises(ConfigError, match="every parameter once"):
        _state([[0, 1], [1, 2]])
    frag = _state([[0, 2], [1]])
    with pytest.raises(ConfigError):  # version 0 moves fragment 0: a fragment-1 average is refused
        frag.apply(_average([(2, 2)], 0), 2)
    assert frag.version == 0


def test_a_models_fragments_follow_its_blocks() -> None:
    names = [n for n, _ in build_model("nano", 64, 0).named_parameters()]
    parts = fragment_parts(names, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(names)))
    assert 0 in parts[0] and len(names) - 1 in parts[2]  # the embedding first, the norm last
    assert all(names[i].startswith("blocks.1.") for i in parts[1])
    assert fragment_parts(names, 1) == [list(range(len(names)))]


def test_a_replayed_record_must_carry_its_versions_fragment(tmp_path: Path) -> None:
    """A peer replaying version v's update reads it with fragment v mod P's shapes (a record of
    the whole model, or of another fragment, is refused), and screens its norm against the
    recent updates of the same fragment."""
    state = _state([[0, 2], [1]])
    replica = Replica(state, UpdateLog(8))
    replica.snapshot()
    record = replica.commit(_average(state.update_shapes(), 3), ["a", "b"], {}, {})
    data = record.to_bytes()
    assert [tuple(a.shape) for a in record.average] == [(3,), (4,)]
    UpdateRecord.from_bytes(data, shapes=state.update_shapes(0))
    with pytest.raises(ValueError):
        UpdateRecord.from_bytes(data, shapes=state.update_shapes(1))
    assert replica.recent_norms() == []  # version 1 moves fragment 1: none of its norms yet
    replica.commit(_average(state.update_shapes(), 4), ["a", "b"], {}, {})
    assert len(replica.recent_norms()) == 1  # version 2: fragment 0's, the first update's
    assert replica.recent_norms()[0] == pytest.approx(
        float(torch.cat([a.reshape(-1) for a in record.average]).norm())
    )


def test_the_progress_not_synced_rides_the_ledger_and_is_trained_on() -> None:
    """The round takes the fragment's δ; the rest waits (no samples: they are the round's),
    and the next phase, started from θ − rest, holds it in its δ (`Ledger.take`), with the samples
    and steps of a δ the round kept."""
    ledger = Ledger()
    ledger.fragmented = True
    mine = Contribution([torch.ones(3), 2 * torch.ones(2, 2), 3 * torch.ones(4)], 5, {1: 16}, 4)
    sent, rest = split(mine, [0, 2])
    assert torch.equal(sent.delta[1], torch.zeros(2, 2)) and torch.equal(
        sent.delta[2], mine.delta[2]
    )
    assert torch.equal(rest.delta[0], torch.zeros(3)) and torch.equal(rest.delta[1], mine.delta[1])
    assert (sent.shard_samples, sent.steps, rest.shard_samples, rest.steps) == ({1: 16}, 4, {}, 0)
    ledger.add(rest)
    carried = ledger.carried()
    assert carried is not None and torch.equal(carried[1], mine.delta[1])
    fresh = Contribution([d + 0.5 for d in carried], 6, {2: 8}, 4)  # trained from θ − carried
    merged = ledger.take(fresh)
    assert ledger.pending is None and merged.delta is fresh.delta
    assert (merged.base_version, merged.shard_samples, merged.steps) == (6, {2: 8}, 4)
    ledger.add(sent)  # the round failed: its δ and samples wait too
    again = ledger.take(Contribution([torch.zeros(3), torch.zeros(2, 2), torch.zeros(4)], 7,
                                       {2: 8}, 4))  # fmt: skip
    assert (again.shard_samples, again.steps) == ({1: 16, 2: 8}, 8)


def test_the_ledger_says_which_fragments_it_holds_and_empties_once_all_are_sent() -> None:
    """What the end's flush reads (`Ledger.unsynced`) and leaves: a send that leaves nothing
    unsynced leaves nothing pending (no zero δ in the checkpoint)."""
    parts = [[0], [1], [2]]
    ledger = Ledger(fragmented=True)
    assert ledger.unsynced(parts) == []
    mine = Contribution([torch.ones(3), torch.zeros(2, 2), 3 * torch.ones(4)], 5, {1: 16}, 4)
    sent = ledger.send(mine, parts[0])
    assert ledger.unsynced(parts) == [2] and sent.steps == 4
    pending, ledger.pending = ledger.pending, None
    assert pending is not None
    last = ledger.send(pending, parts[2])
    assert torch.equal(last.delta[2], 3 * torch.ones(4)) and ledger.pending is None
    assert ledger.unsynced(parts) == []


def test_a_restart_does_not_offer_again_what_rounds_after_its_checkpoint_applied(
    tmp_path: Path,
) -> None:
    """The sent log (`peer_checkpoint.record_sent`): rounds of ours applied after the checkpoint
    carried its pending δ's fragments; a restart forgets those (`Ledger.forget`), keeps the rest,
    and an entry at or below the checkpoint's version (written before it) changes nothing."""
    ckpt = tmp_path / "run.peer.safetensors"
    peer_checkpoint.record_sent(ckpt, 1, 7)  # before the checkpoint at version 8
    peer_checkpoint.clear_sent(ckpt, 8)
    assert not peer_checkpoint.sent_path(ckpt).exists()
    peer_checkpoint.record_sent(ckpt, 2, 9)
    peer_checkpoint.record_sent(ckpt, 0, 10)
    peer_checkpoint.record_sent(ckpt, 0, 8)  # an older entry of the same fragment: kept out
    assert peer_checkpoint.sent_since(ckpt, 9) == [0] and peer_checkpoint.sent_since(ckpt, 8) == [
        0,
        2,
    ]
    ledger = Ledger(fragmented=True)
    ledger.pending = Contribution([torch.ones(3), torch.ones(2, 2), torch.ones(4)], 8, {1: 8}, 4)
    ledger.forget([[2]])
    pending = ledger.pending
    assert pending is not None and (pending.shard_samples, pending.steps) == ({}, 0)
    assert ledger.unsynced([[0], [1], [2]]) == [0, 1] and torch.equal(
        pending.delta[2], torch.zeros(4)
    )
    ledger.forget([[0], [1]])
    assert ledger.pending is None
    peer_checkpoint.clear_sent(ckpt, 9)  # a round applied while the checkpoint was written
    assert peer_checkpoint.sent_since(ckpt, 0) == [0]
    peer_checkpoint.sent_path(ckpt).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="sent log"):
        peer_checkpoint.sent_since(ckpt, 0)


class _Params:
    """The part of InnerTrainer an overlapped fold touches: its parameters and `rebase`."""

    rebase = InnerTrainer.rebase

    def __init__(self, values: list[float]) -> None:
        self.params = [torch.tensor([v]) for v in values]


@pytest.mark.parametrize("applied", [True, False])
def test_an_overlapped_fold_keeps_the_progress_the_round_left_unsynced(applied: bool) -> None:
    """Two fragments of one value each, θ = (0, 0), local (1, 2) at the hand-off: the round
    takes fragment 0's δ (−1), fragment 1's (−2) waits in the ledger. The next phase trains on
    (+0.5 each); the round ends with θ = (3, 0) (applied) or (0, 0) (kept, δ back in the
    ledger): the local parameters are the new θ, the phase's progress, and whatever the
    ledger holds, which the phase's δ then carries (`Ledger.take`)."""
    ledger = Ledger()
    ledger.fragmented = True
    trainer, theta = _Params([1.0, 2.0]), [torch.zeros(1), torch.zeros(1)]
    swarm = SwarmSettings(overlap=True, fragments=2)
    overlap = Overlap(trainer, lambda: theta, swarm,  # type: ignore[arg-type]
                      Activity(), Counters(), carried=ledger.carried)  # fmt: skip
    mine = Contribution([t - p for t, p in zip(theta, trainer.params, strict=True)], 0, {0: 8}, 4)
    release = threading.Event()

    def work() -> RoundOutcome:
        sent = ledger.send(mine, [0])
        assert release.wait(10)
        if applied:
            theta[0] = torch.tensor([3.0])
            return RoundOutcome(RoundStatus.COMMITTED)
        ledger.add(sent)
        return RoundOutcome(RoundStatus.KEPT, reason="no group")

    overlap.start(work)
    assert overlap.begin_phase()
    for p in trainer.params:
        p += 0.5
    release.set()
    overlap.settle()
    local = [float(p) for p in trainer.params]
    assert local == ([3.5, 2.5] if applied else [1.5, 2.5])
    fresh = Contribution([t - p for t, p in zip(theta, trainer.params, strict=True)], 1, {1: 8}, 4)
    merged = ledger.take(fresh)
    assert [float(d) for d in merged.delta] == ([-0.5, -2.5] if applied else [-1.5, -2.5])
    assert merged.shard_samples == ({1: 8} if applied else {0: 8, 1: 8})


def test_a_fragments_norm_bound_counts_the_sub_phases_before_it() -> None:
    run = RunSpec(model="nano", inner_steps=12)
    plain = Limits.of(run, SwarmSettings())
    frag = Limits.of(run, SwarmSettings(fragments=3))
    assert frag.max_norm(4, 100) == pytest.approx(plain.max_norm(16, 100))


def test_fragments_are_refused_where_no_schedule_or_fold_fits_them() -> None:
    with pytest.raises(ConfigError, match="sync protocol"):
        SwarmSettings(fragments=2, protocol="async")
    with pytest.raises(ConfigError, match="overlap_fold 'rebase'"):
        SwarmSettings(fragments=2, overlap=True, overlap_fold="mix")
    SwarmSettings(fragments=2, overlap=True, overlap_keep=0.5)
    with pytest.raises(ConfigError, match=">= 1"):
        SwarmSettings(fragments=0)
    swarm = SwarmSettings(fragments=3)
    for name in ("adam", "delayed-nesterov"):
        with pytest.raises(ConfigError, match="outer optimizer"):
            check_fragments(RunSpec(outer_optimizer=name), swarm)
    with pytest.raises(ConfigError, match="more than H"):
        check_fragments(RunSpec(inner_steps=2), swarm)
    check_fragments(RunSpec(inner_steps=3), swarm)
    run = dataclasses.replace(RunSpec(), outer_optimizer="adam")
    with pytest.raises(ManifestError, match="outer optimizer"):
        Manifest.create("frag", run, swarm, Identity.generate())


FRAGMENT_RUN = """
[run]
model = "nano"
inner_steps = 12
warmup_steps = 5
num_shards = 8

[swarm]
sync_timeout_s = 6.0
allreduce_timeout_s = 6.0
fragments = 3
"""


@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overlap", ["", pytest.param("overlap = true\n", marks=pytest.mark.slow, id="overlapped")]
)
def test_a_fragmented_swarm_agrees_replays_and_outlives_a_killed_peer(
    swarm: LocalSwarm, tmp_path: Path, overlap: str
) -> None:
    """a, b and c train; b pauses mid-phase (its partial δ kept), comes back and replays the
    updates of several fragments; then c's main process is killed (its helpers left to their
    lifeline). Every update a recorded holds its version's fragment alone; a and b end on one
    state, in pairs once c is gone, after two rounds of no steps past version 14 that sync the
    two fragments their last phases left unsynced (the flush: nothing pending at the end)."""
    cfg, records = tmp_path / "run.toml", tmp_path / "records"
    cfg.write_text(FRAGMENT_RUN + overlap)
    until = ["--until-version", "14"]
    a, log_a = swarm.start("a", "--config", str(cfg), "--expected-peers", "3", *until,
                           "--record-updates", str(records))  # fmt: skip
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until)
    c, log_c = swarm.start("c", "--swarm", maddr, *until)
    swarm.wait_event(log_b, "round", 150, version=2)
    b.send_signal(signal.SIGUSR1)
    paused = swarm.wait_event(log_b, "pause", 60)
    swarm.wait_event(log_a, "round", 90, version=paused["version"] + 3)
    b.send_signal(signal.SIGUSR2)
    caught = swarm.wait_event(log_b, "catch_up", 60)
    assert caught["method"] == "replay", caught
    assert caught["version"] - caught["from_version"] >= 3, caught  # every fragment's update
    swarm.wait_event(log_b, "round", 90, count=3)  # b's first since it came back
    os.kill(c.pid, signal.SIGKILL)
    assert a.wait(timeout=200) == 0
    assert b.wait(timeout=60) == 0
    branch = branches(log_a, log_b)
    assert branch.one_branch, branch.conflicts
    ra = {e["version"]: e for e in read_log(log_a) if e["event"] == "round"}
    assert max(ra) == 16 and ra[14]["group_size"] == 2
    # the flush: no phase, but the overlapped phase that trained through the last round (cut
    # short or whole: at most H/P = 4 steps) counts its steps there, as a δ a failed round kept
    failed = sum(1 for e in read_log(log_a) if e["event"] == "round_failed")
    assert all(ra[v]["steps"] <= 4 * (1 + failed) and ra[v]["group_size"] == 2 for v in (15, 16))
    assert any(e["group_size"] == 3 for e in ra.values())
    # nothing left unsynced but, overlapped, the progress on fragment 13 mod 3 of the phase the
    # end cut short (every peer syncs the P - 1 fragments its blocking phase left)
    for log in (log_a, log_b):
        (stop,) = [e for e in read_log(log) if e["event"] == "stop"]
        assert stop["version"] == 16 and set(stop["unsynced"]) <= ({1} if overlap else set())
    names = [n for n, _ in build_model("nano", 256, 0).named_parameters()]
    parts = fragment_parts(names, 3)
    recorded = sorted(records.glob("update-*.safetensors"))
    assert len(recorded) == 16
    for path in recorded:
        base = int(path.stem.split("-")[1])
        record = UpdateRecord.from_bytes(path.read_bytes())
        assert len(record.average) == len(parts[base % 3]), (base, len(record.average))
    # H / fragments a phase; a δ a failed round kept (c killed mid-round) joins the next one
    steps = [e["steps"] for e in read_log(log_a) if e["event"] == "round" and e["version"] <= 14]
    assert steps and all(s % 4 == 0 for s in steps), steps
    assert sum(steps) // 4 - len(steps) <= failed, (steps, failed)


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_fragmented_peer_restarted_from_its_checkpoint_offers_nothing_twice(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """b checkpoints every 3 rounds; its main process is killed (its helpers left) after a
    round that followed a checkpoint, which sent a fragment of the checkpoint's pending δ. The
    restart forgets that fragment (the sent log), keeps the others' progress, rejoins, and both
    end on one state with nothing unsynced after the flush."""
    cfg, ckpt, key = tmp_path / "run.toml", tmp_path / "b-ckpt", tmp_path / "b.key"
    cfg.write_text(FRAGMENT_RUN + "checkpoint_every = 3\n")
    key.write_bytes(Identity.generate().to_bytes())
    until = ["--until-version", "12"]
    a, log_a = swarm.start("a", "--config", str(cfg), "--expected-peers", "2", *until)
    maddr = swarm.wait_event(log_a, "start", 90, proc=a)["maddrs"][0]
    b_args = ["--swarm", maddr, "--identity", str(key), "--checkpoint-dir", str(ckpt), *until]
    b, log_b = swarm.start("b", *b_args)
    swarm.wait_event(log_b, "round", 150, proc=b, count=4)  # the checkpoint came after the 3rd
    kill_main(b)
    sent = peer_checkpoint.sent_path(ckpt / "t.peer.safetensors")
    assert sent.exists()
    # a sent log that does not parse: one line, exit 2, nothing changed
    spoiled = tmp_path / "spoiled"
    shutil.copytree(ckpt, spoiled)
    peer_checkpoint.sent_path(spoiled / "t.peer.safetensors").write_text("{not json")
    bad_args = ["--swarm", maddr, "--identity", str(key), "--checkpoint-dir", str(spoiled)]
    bad, _ = swarm.start("bad", *bad_args)
    assert bad.wait(timeout=90) == 2
    err = (tmp_path / "bad.err").read_text().strip().splitlines()
    assert "sent log" in err[-1] and not any("Traceback" in line for line in err), err
    assert peer_checkpoint.sent_path(spoiled / "t.peer.safetensors").read_text() == "{not json"
    b2, log_b2 = swarm.start("b2", *b_args)
    resume = swarm.wait_event(log_b2, "resume", 90, proc=b2)
    assert resume["forgotten"] and resume["unsynced"], resume
    assert not set(resume["forgotten"]) & set(resume["unsynced"]), resume
    assert a.wait(timeout=200) == 0
    assert b2.wait(timeout=60) == 0
    branch = branches(log_a, log_b2)
    assert branch.one_branch, branch.conflicts
    for log in (log_a, log_b2):
        (stop,) = [e for e in read_log(log) if e["event"] == "stop"]
        assert stop["version"] == 14 and stop["unsynced"] == [], stop
