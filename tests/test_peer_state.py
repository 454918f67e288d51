"""A peer's state without a network: a phase of inner training, the replica and a replay from
another replica's update log, the peer checkpoint (restart, pending δ, corruption), the end of a
run, metrics and TensorBoard. These were checked only by real swarms before (tests/test_swarm.py
keeps the end-to-end runs, in the slow phase)."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from hivemind.utils import get_dht_time

from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free.dylu import SpeedMeter
from diloco_peer.coordinator_free.manifest import Manifest
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.state_transfer import StateBlob, StateTransferFailed
from diloco_peer.coordinator_free.swarm_view import HeadChoice, SwarmView, run_ended
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import CheckpointError, TransferFailure
from diloco_peer.identity import Identity
from diloco_peer.peer import peer_checkpoint
from diloco_peer.peer.catch_up import CatchUp
from diloco_peer.peer.certify import Certifier
from diloco_peer.peer.delta import Contribution
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.phase import (
    ETA_DRIFT_S,
    Controls,
    Phase,
    PhasePaused,
    StopRequested,
    build_training,
)
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.telemetry import Counters, Gauges, RoundReport, TensorBoard, serve_metrics
from diloco_peer.peer.trust import Guard
from diloco_peer.peer_spec import PeerSpec

OWNER = Identity.generate()
SWARM = SwarmSettings()


def manifest(run: RunSpec, name: str = "t") -> object:
    return Manifest.create(name, run, SWARM, OWNER)


def phase_of(
    run: RunSpec, signed: object, *, peer: str = "PeerA", swarm: SwarmSettings = SWARM,
    **controls: object,
) -> Phase:  # fmt: skip
    training = build_training(run, swarm, PeerSpec(threads=1), peer, signed.digest)  # type: ignore[attr-defined]
    ctl = {
        "stop": threading.Event(), "paused": threading.Event(), "on_step": lambda *a: None,
        "publish_head": lambda: None, "view": lambda: None, **controls,
    }  # fmt: skip
    return Phase(
        training, run=run, swarm=swarm, me=peer, pinned_shard=-1, throttle=1.0,
        in_flight=lambda counts, oldest: counts, activity=Activity(), counters=Counters(),
        controls=Controls(**ctl),  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture(scope="module")
def run() -> RunSpec:
    return RunSpec(
        model="nano", max_tokens=100_000, seq_len=32, batch_size=4, val_sequences=4,
        inner_steps=5, warmup_steps=2, num_shards=4,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_a_phase_trains_h_steps_over_the_shards_and_returns_its_delta(run: RunSpec) -> None:
    phase = phase_of(run, manifest(run))
    view = SwarmView("PeerA", 0, "0" * 64, {})
    steps = phase.plan_steps(view)
    mine, loss = phase.train(steps, phase.unseen_steps(view, []))
    assert steps == run.inner_steps and mine.steps == steps and loss > 0
    assert sum(mine.shard_samples.values()) == steps * run.batch_size
    assert mine.base_version == 0
    theta, local = phase.t.state.theta, phase.t.trainer.params
    assert all(
        torch.equal(d, t - p.detach()) for d, t, p in zip(mine.delta, theta, local, strict=True)
    )
    assert any(d.abs().sum() > 0 for d in mine.delta)
    assert phase.counters.started_training and phase.counters.compute_s > 0


@pytest.mark.timeout(120)
def test_a_pause_mid_phase_keeps_the_partial_delta_and_a_stop_ends_the_phase(
    run: RunSpec,
) -> None:
    paused = threading.Event()
    paused.set()
    phase = phase_of(run, manifest(run), paused=paused)
    with pytest.raises(PhasePaused) as caught:
        phase.train(5)
    partial = caught.value.partial
    assert partial.steps == 1 and sum(partial.shard_samples.values()) == run.batch_size
    stop = threading.Event()
    stop.set()
    with pytest.raises(StopRequested):
        phase_of(run, manifest(run), stop=stop).train(5)


class _RoundInFlight:
    """A round in flight (phase.Folds) that never folds anything: the phase trains on."""

    def await_group(self) -> None:
        pass

    def begin_phase(self) -> bool:
        return True

    def poll(self) -> bool:
        return False

    def settle(self) -> None:
        pass

    def report(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        return delta


@pytest.mark.timeout(120)
def test_an_overlapped_phase_ends_when_its_round_reaches_the_runs_end(run: RunSpec) -> None:
    # the round in the background applied the run's last update after 2 steps: the rest of
    # the phase would never be applied, so it ends there with what it did (as a pause does)
    asked = [0]  # asked after every step

    def ended() -> bool:
        asked[0] += 1
        return asked[0] >= 2

    phase = phase_of(run, manifest(run), run_ended=ended)
    with pytest.raises(PhasePaused) as caught:
        phase.train(5, overlap=_RoundInFlight())
    assert caught.value.partial.steps == 2
    # a blocking phase never asks (its round runs after it), nor does a stopping one
    mine, _ = phase_of(run, manifest(run), run_ended=lambda: True).train(5)
    assert mine.steps == 5


@pytest.mark.timeout(120)
def test_an_async_phase_trains_on_to_the_end_its_speed_planned(run: RunSpec) -> None:
    # DyLU sizes an async phase to end when the others' do; a speed measured low (a 3-step
    # probe's, on a shared machine) plans too few steps, and the phase would end early and
    # its round find nobody due: it trains on until its planned end, at most its steps again
    swarm = dataclasses.replace(SWARM, protocol="async")
    alone = SwarmView("PeerA", 0, "0" * 64, {})  # nobody else: no one to extend for
    phase = phase_of(run, manifest(run), swarm=swarm, view=lambda: alone)
    t0 = time.perf_counter()
    probe, _ = phase.train(2)  # no speed yet: no planned end
    assert probe.steps == 2
    pace = 2 / (time.perf_counter() - t0)  # steps/s, the first steps' warm-up included
    for measured, steps in ((pace / 20, 4), (pace * 100, 2)):
        meter = SpeedMeter()
        meter.update(1, 1 / measured)
        phase.t.trainer.speed = meter
        mine, _ = phase.train(2)
        assert mine.steps == steps, (measured, pace)
        assert sum(mine.shard_samples.values()) == steps * run.batch_size


@pytest.mark.timeout(120)
def test_an_async_phase_publishes_its_end_when_it_ends_before_the_end_it_published(
    run: RunSpec,
) -> None:
    # an end published from a slow stretch stays in the future after the phase is over, and
    # peers ending then saw nobody due and committed alone at the same moment (netlab)
    swarm = dataclasses.replace(SWARM, protocol="async")
    alone = SwarmView("PeerA", 0, "0" * 64, {})
    published: list[float | None] = []
    phase = phase_of(run, manifest(run), swarm=swarm, view=lambda: alone,
                     publish_head=lambda: published.append(phase.activity.eta))  # fmt: skip
    t0 = time.perf_counter()
    phase.train(2)
    pace = 2 / (time.perf_counter() - t0)
    meter = SpeedMeter()
    meter.update(1, 200 / pace)  # planned: 2 steps in 400 real steps' time
    phase.t.trainer.speed = meter
    mine, _ = phase.train(2)
    assert mine.steps == 4  # on to the planned end, at most its steps again: ends long before
    assert len(published) == 2 and published[0] is not None and published[1] is not None
    assert published[1] < published[0] - 1.0 and published[1] <= get_dht_time() + ETA_DRIFT_S
    # only an end that moved by more than the drift is published; a sync phase publishes none
    phase.activity.eta = end = get_dht_time() + 10.0
    phase._publish_end(end + 0.2)
    phase._publish_end(end - 5.0, later=False)
    assert published[2:] == [end - 5.0]
    phase._publish_end(end + 5.0, later=False)  # later, but only an earlier one was asked for
    assert len(published) == 3
    sync = phase_of(run, manifest(run), publish_head=lambda: published.append(None))
    sync.activity.eta = end
    sync._publish_end(end - 5.0)
    assert len(published) == 3


def test_an_async_phase_trains_on_to_meet_the_group_after_the_one_that_formed_without_it(
    run: RunSpec,
) -> None:
    # PeerB's group formed without us (it is at v1, we at v0) and trains its next phase: rather
    # than apply alone, ours trains on to meet it, ending our last catch-up's seconds early
    swarm = dataclasses.replace(SWARM, protocol="async", grace_s=0.5)
    eta = [0.0]

    def seen() -> SwarmView:
        b = PeerHead(peer_id="PeerB", version=1, state_hash="1" * 64, speed=1.0, eta=eta[0])
        return SwarmView("PeerA", 0, "0" * 64, {"PeerB": b})

    phase = phase_of(run, manifest(run), swarm=swarm, view=seen)
    meter = SpeedMeter()
    meter.update(1, 1.0)  # 1 step/s: a phase of H = 5 s, a grace period of 2.5 s
    phase.t.trainer.speed = meter
    phase.counters.catch_up_s = 1.5
    now = get_dht_time()
    eta[0] = now + 6.0  # past the grace period, within a phase after it
    assert phase._extension_end() == pytest.approx(now + 4.5, abs=0.01)
    eta[0] = now + 2.0  # within the grace period: its end, less the catch-up
    assert phase._extension_end() == pytest.approx(now + 0.5, abs=0.01)
    eta[0] = now + 8.0  # more than a phase after it: not waited for
    assert phase._extension_end() is None


MEMBER = Identity.generate()


def certifier(replica: Replica) -> Certifier:
    return Certifier(lambda: None, Guard(MEMBER, "t", SWARM), recent_norms=replica.recent_norms)


def commit_twice(replica: Replica, run: RunSpec, seals: dict[int, dict[str, bytes]]) -> None:
    """Two lone commits of MEMBER, each with its signed header and its seal (in `seals`)."""
    guard, me = Guard(MEMBER, "t", SWARM), MEMBER.peer_id_str
    for value in (0.01, -0.02):
        delta = [torch.full_like(t, value) for t in replica.state.theta]
        v, h = replica.version, replica.published_hash
        offer = guard.offer(delta, key=f"v{v}_{h[:16]}", version=v, state_hash=h, base_version=v,
                            steps=1, shard_samples={0: run.batch_size})  # fmt: skip
        record = replica.commit(delta, [me], {0: run.batch_size}, {me: offer.gather})
        seals[record.base_version] = {me: certifier(replica).seal_bytes(record)}


def two_replicas(run: RunSpec) -> tuple[Replica, Replica]:
    """Two peers' replicas of one run at version 0 (this peer's and PeerB's), snapshotted."""
    signed = manifest(run)
    pair = (Replica(phase_of(run, signed).t.state, UpdateLog(8)),
            Replica(phase_of(run, signed, peer="PeerB").t.state, UpdateLog(8)))  # fmt: skip
    for replica in pair:
        replica.snapshot()
    return pair


@pytest.mark.timeout(120)
def test_a_replica_behind_replays_another_replicas_updates_to_the_same_hash(
    run: RunSpec,
) -> None:
    ahead, behind = two_replicas(run)
    seals: dict[int, dict[str, bytes]] = {}
    commit_twice(ahead, run, seals)
    assert ahead.version == 2 and ahead.published_hash == ahead.state.hash()
    forged: dict[int, bytes] = {}

    class FromAhead:
        def update(self, donor: str, base_version: int) -> bytes:
            data = forged.get(base_version) or ahead.updates.get(base_version)
            assert data is not None
            return data

        def state(self, donor: str) -> StateBlob:
            # two updates cost less than the state: only a failed replay downloads
            raise StateTransferFailed("no state here", kind=TransferFailure.REFUSED)

        state_multi = state

    # a big state (by its blob) makes the replay the cheaper way
    behind.blob = StateBlob(version=0, state_hash=behind.published_hash, data=b"x" * 10**7)
    view = SwarmView("PeerB", 0, behind.published_hash,
                     {"PeerA": PeerHead(peer_id="PeerA", version=2, state_hash=ahead.published_hash)})  # fmt: skip
    choice = view.choose_head()
    assert choice is not None
    check = certifier(behind)
    catch_up = CatchUp(behind, FromAhead(), me="PeerB", keep_updates=8,  # type: ignore[arg-type]
                       verify=lambda r: check.check(r, seals.get(r.base_version, {})))  # fmt: skip
    # A donor's forged update (another average under the member's header and seal) is refused
    # and nothing moves; so is an update whose member's seal is missing.
    real = UpdateRecord.from_bytes(ahead.updates.get(0) or b"")
    fake = dataclasses.replace(real, average=tuple(a * 50 for a in real.average))
    forged[0] = fake.to_bytes()
    assert catch_up.run(choice) is None and behind.version == 0
    forged.clear()
    kept_seals = seals.pop(0)
    assert catch_up.run(choice) is None and behind.version == 0
    seals[0] = kept_seals
    moved = catch_up.run(choice)
    assert moved is not None and moved.method == "replay" and not moved.lost_fork
    assert (
        behind.state.hash() == ahead.state.hash() and behind.published_hash == ahead.published_hash
    )
    kept, served = (UpdateRecord.from_bytes(r.updates.get(1) or b"") for r in (behind, ahead))
    assert (kept.base_hash, kept.result_hash) == (served.base_hash, served.result_hash)  # kept
    assert all(torch.equal(a, b) for a, b in zip(kept.average, served.average, strict=True))
    # a change not published (a replay or download that failed its check) is undone
    published = behind.published_hash
    behind.state.apply([torch.ones_like(t) for t in behind.state.theta], 1, {})
    assert behind.state.hash() != published
    behind.restore()
    assert behind.state.hash() == published and behind.version == 2


@pytest.mark.timeout(120)
def test_a_mixing_peers_download_steps_from_the_version_below_so_it_knows_the_damping(
    run: RunSpec,
) -> None:
    """With `with_step` (an overlapped `mix` peer), a download fetches the head's certified
    update and the state it starts from (the donors' parent), and replays it: the replica
    ends at the head with the donor's `last_damping`. A forged update, a donor without the
    version below, or no `with_step` give the plain download: the head, no damping."""
    ahead, behind = two_replicas(run)
    seals: dict[int, dict[str, bytes]] = {}
    commit_twice(ahead, run, seals)
    assert ahead.blob is not None and ahead.parent is not None
    calls: list[str] = []
    forged: dict[int, bytes] = {}
    keeps_parent = [True]

    class FromAhead:
        def update(self, donor: str, base_version: int) -> bytes:
            calls.append(f"update {base_version}")
            data = forged.get(base_version) or ahead.updates.get(base_version)
            assert data is not None
            return data

        def state(self, donor: str) -> StateBlob:
            calls.append("state")
            assert ahead.blob is not None
            return ahead.blob

        def state_multi(self, donors: list[str], state_hash: str) -> StateBlob:
            calls.append(f"multi {state_hash[:8]}")
            for blob in (ahead.blob, ahead.parent if keeps_parent[0] else None):
                if blob is not None and blob.state_hash == state_hash:
                    return blob
            raise StateTransferFailed("state moved on", kind=TransferFailure.REFUSED)

    check = certifier(behind)

    def catch_up(with_step: bool) -> CatchUp:
        return CatchUp(behind, FromAhead(), me="PeerB", keep_updates=0,  # type: ignore[arg-type]
                       verify=lambda r: check.check(r, seals.get(r.base_version, {})),
                       with_step=with_step)  # fmt: skip

    head = HeadChoice(2, ahead.published_hash, ("PeerA", "PeerC"), lost_fork=False)
    expect = ahead.last_damping()
    assert expect is not None

    def moved(with_step: bool) -> list[torch.Tensor] | None:
        """Back to v0, catch up to the head, and the damping the replica then knows."""
        behind.load(ahead_v0)
        behind.snapshot()
        calls.clear()
        done = catch_up(with_step).run(head)
        assert done is not None and done.method == "download"
        assert (behind.version, behind.published_hash) == (2, ahead.published_hash)
        return behind.last_damping()

    ahead_v0 = behind.blob.data if behind.blob is not None else b""
    parent_hash = ahead.parent.state_hash[:8]
    damping = moved(with_step=True)
    assert calls == ["update 1", f"multi {parent_hash}"]
    assert damping is not None
    assert all(torch.equal(d, e) for d, e in zip(damping, expect, strict=True))
    kept, served = (UpdateRecord.from_bytes(r.updates.get(1) or b"") for r in (behind, ahead))
    assert (kept.base_hash, kept.result_hash) == (served.base_hash, served.result_hash)  # kept
    assert moved(with_step=False) is None and calls == [f"multi {ahead.published_hash[:8]}"]
    # a forged update (another average under the member's seal) is refused before any state
    real = UpdateRecord.from_bytes(ahead.updates.get(1) or b"")
    forged[1] = dataclasses.replace(real, average=tuple(a * 50 for a in real.average)).to_bytes()
    assert moved(with_step=True) is None
    assert calls == ["update 1", "update 1", f"multi {ahead.published_hash[:8]}"]
    forged.clear()
    keeps_parent[0] = False  # donors that no longer keep the version below theirs
    assert moved(with_step=True) is None
    assert calls == ["update 1", f"multi {parent_hash}", f"multi {ahead.published_hash[:8]}"]


def test_the_last_updates_damping_is_its_average_less_the_step_it_moved_theta_by(
    run: RunSpec,
) -> None:
    ahead, behind = two_replicas(run)
    assert ahead.last_damping() is None  # version 0: no update made it
    commit_twice(ahead, run, {})  # v0 -> v1 -> v2, each published
    record = UpdateRecord.from_bytes(ahead.updates.get(1) or b"")  # the update v1 -> v2
    assert ahead.parent is not None and ahead.blob is not None
    behind.load(ahead.parent.data)  # θ at v1, the state that update applied to
    expect = [a - (before - after) for a, before, after in
              zip(record.average, behind.state.theta, ahead.state.theta, strict=True)]  # fmt: skip
    damping = ahead.last_damping()
    assert damping is not None
    assert all(torch.equal(d, e) for d, e in zip(damping, expect, strict=True))
    # the outer step (Nesterov, lr 0.7) did not move θ by the average itself
    assert not all(torch.allclose(d, torch.zeros_like(d)) for d in damping)
    behind.load(ahead.blob.data)  # a download straight to v2: no step seen here
    behind.snapshot()
    assert behind.version == 2 and behind.last_damping() is None


@pytest.mark.timeout(120)
def test_a_fork_at_our_version_heals_by_replay_from_our_parent_state(run: RunSpec) -> None:
    """Two replicas part at version 1 (each applies another lone update): the loser replays
    the winner's certified update from the state below its own, downloads no state, and knows
    its branch lost; a forged update of the winner's is refused and nothing moves. (That one
    key's branch at our version is a candidate for this replay only: test_swarm_view.)"""
    winner, loser = two_replicas(run)
    seals: dict[int, dict[str, bytes]] = {}
    commit_twice(winner, run, seals)  # v0 -> v1 -> v2
    shared = UpdateRecord.from_bytes(winner.updates.get(0) or b"")
    loser.apply_record(shared)
    loser.keep(shared)
    loser.snapshot()
    own = [torch.full_like(t, 0.03) for t in loser.state.theta]
    loser.commit(own, ["PeerB"], {0: run.batch_size}, {})  # its own v2, another branch
    assert loser.version == winner.version == 2 and loser.published_hash != winner.published_hash
    assert loser.parent is not None and loser.parent.version == 1

    class FromWinner:
        forged: bytes | None = None
        states = 0

        def update(self, donor: str, base_version: int) -> bytes:
            return self.forged or winner.updates.get(base_version) or b""

        def state(self, donor: str, *rest: object) -> StateBlob:
            self.states += 1
            raise StateTransferFailed("no state here", kind=TransferFailure.REFUSED)

        state_multi = state

    downloads = FromWinner()
    won = winner.published_hash  # two peers hold it: it wins whatever the hashes' order
    view = SwarmView("PeerB", 2, loser.published_hash,
                     {"PeerA": PeerHead(peer_id="PeerA", version=2, state_hash=won),
                      "PeerC": PeerHead(peer_id="PeerC", version=2, state_hash=won)})  # fmt: skip
    choice = view.choose_head(replay_window=2)
    assert choice is not None and choice.lost_fork and choice.state_hash == won
    check = certifier(loser)
    catch_up = CatchUp(loser, downloads, me="PeerB", keep_updates=8,  # type: ignore[arg-type]
                       verify=lambda r: check.check(r, seals.get(r.base_version, {})))  # fmt: skip
    real = UpdateRecord.from_bytes(winner.updates.get(1) or b"")
    downloads.forged = dataclasses.replace(real, average=tuple(-a for a in real.average)).to_bytes()
    mine = loser.published_hash
    assert catch_up.run(choice) is None and loser.state.hash() == mine
    assert downloads.states > 0  # the forged replay failed; a quorum's state may be downloaded
    downloads.forged, downloads.states = None, 0
    moved = catch_up.run(choice)
    assert moved is not None and moved.method == "replay" and moved.lost_fork
    assert downloads.states == 0
    assert loser.published_hash == winner.published_hash and loser.version == 2


@pytest.mark.timeout(120)
def test_a_branch_that_parted_before_our_parent_still_counts_as_lost(run: RunSpec) -> None:
    """A partition: our side committed two versions of its own, the winners three. Replaying
    from our parent state cannot reach their chain (it parted further back), so the state is
    downloaded, and our branch still counts as lost: our δ goes into the swarm again."""
    winner, loser = two_replicas(run)
    seals: dict[int, dict[str, bytes]] = {}
    commit_twice(winner, run, seals)
    commit_twice(winner, run, seals)  # v4 on the winners' side
    for value in (0.03, 0.05, 0.07):  # v3 on ours, parted at v0
        own = [torch.full_like(t, value) for t in loser.state.theta]
        loser.commit(own, ["PeerB"], {0: run.batch_size}, {})
    assert (loser.version, winner.version) == (3, 4) and loser.parent is not None

    class FromWinner:
        def update(self, donor: str, base_version: int) -> bytes:
            return winner.updates.get(base_version) or b""

        def state(self, donor: str, *rest: object) -> StateBlob:
            assert winner.blob is not None
            return winner.blob

        state_multi = state

    won = winner.published_hash
    view = SwarmView("PeerB", 3, loser.published_hash,
                     {"PeerA": PeerHead(peer_id="PeerA", version=4, state_hash=won),
                      "PeerC": PeerHead(peer_id="PeerC", version=4, state_hash=won)})  # fmt: skip
    choice = view.choose_head(replay_window=2)
    assert choice is not None and choice.endorsed and not choice.lost_fork
    check = certifier(loser)
    catch_up = CatchUp(loser, FromWinner(), me="PeerB", keep_updates=8,  # type: ignore[arg-type]
                       verify=lambda r: check.check(r, seals.get(r.base_version, {})))  # fmt: skip
    moved = catch_up.run(choice)
    assert moved is not None and moved.method == "download" and moved.lost_fork
    assert loser.published_hash == won and moved.from_version == 3


@pytest.mark.timeout(180)
def test_a_peer_checkpoint_restores_state_adam_streams_rounds_and_a_pending_delta(
    run: RunSpec, tmp_path: Path
) -> None:
    signed = manifest(run)
    phase = phase_of(run, signed)
    mine, _ = phase.train(5)
    replica = Replica(phase.t.state, UpdateLog(4))
    replica.commit(mine.delta, ["PeerA"], mine.shard_samples, {})
    pending = Contribution([d * 0.5 for d in mine.delta], 1, {2: 8}, 2)
    path = peer_checkpoint.checkpoint_path(str(tmp_path), "t")
    assert path is not None
    parts = lambda t: peer_checkpoint.PeerParts(t.state, t.trainer, t.streams, signed, "PeerA")  # noqa: E731
    peer_checkpoint.save(path, parts(phase.t), rounds_done=7, pending=pending)
    assert peer_checkpoint.stored_manifest(path, "t") == signed

    fresh = phase_of(run, signed)  # a restart: a new process builds everything anew
    resumed = peer_checkpoint.load(path, parts(fresh.t))
    assert resumed.rounds_done == 7
    assert resumed.pending is not None and resumed.pending.base_version == 1
    assert resumed.pending.shard_samples == {2: 8} and resumed.pending.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(resumed.pending.delta, pending.delta, strict=True))
    assert fresh.t.state.hash() == phase.t.state.hash() and fresh.t.state.version == 1
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.t.trainer.params, phase.t.trainer.params, strict=True)
    )
    assert [s.state_dict() for s in fresh.t.streams] == [s.state_dict() for s in phase.t.streams]
    before = phase.t.trainer.optimizer.state_dict()["state"]
    after = fresh.t.trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(before[k]["exp_avg"], after[k]["exp_avg"]) for k in before)

    # a flipped byte: refused with one clear line, the file left as it is
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        peer_checkpoint.load(path, parts(phase_of(run, signed).t))
    assert path.read_bytes() == bytes(data)
    # another run's checkpoint
    peer_checkpoint.save(path, parts(phase.t), rounds_done=7, pending=None)
    other = manifest(run, name="other")
    with pytest.raises(CheckpointError, match="another run manifest"):
        peer_checkpoint.load(path, peer_checkpoint.PeerParts(
            fresh.t.state, fresh.t.trainer, fresh.t.streams, other, "PeerA"))  # type: ignore[arg-type]  # fmt: skip


def test_a_run_ends_at_the_first_limit_reached() -> None:
    def ended(**limits: float) -> bool:
        spec = PeerSpec(**{k: v for k, v in limits.items() if k in PeerSpec.__dataclass_fields__})
        facts = {"rounds_done": 3, "version": 10, "departed_version": -1, "applied_steps": 500,
                 "elapsed_s": 100.0}  # fmt: skip
        facts.update({k: v for k, v in limits.items() if k in facts})
        return run_ended(spec, **facts)  # type: ignore[arg-type]

    assert not ended()  # no limit: runs until stopped
    assert ended(max_rounds=3) and not ended(max_rounds=4)
    assert ended(until_version=10) and not ended(until_version=11)
    # the others left at the run's end while this peer trained
    assert ended(until_version=11, departed_version=11) and not ended(departed_version=11)
    assert ended(until_steps=500) and not ended(until_steps=501)
    assert ended(max_hours=0.02, elapsed_s=72.0) and not ended(max_hours=0.02, elapsed_s=71.9)


def report(version: int) -> RoundReport:
    return RoundReport(version=version, state_hash="0" * 64, group_size=2, loss=3.5, ppl=30.0,
                       comm_s=0.5, bytes_sent=100, bytes_received=120, steps=10)  # fmt: skip


@pytest.mark.timeout(60)
def test_the_metrics_endpoint_serves_every_metric_in_the_exposition_format() -> None:
    counters = Counters()
    for v in (1, 2):
        counters.add_round(report(v))
    counters.last_loss = 3.5
    gauges = Gauges(version=lambda: 2, speed=lambda: 1.5, paused=lambda: False, bans=lambda: 0,
                    bans_total=lambda: 0)  # fmt: skip
    server = serve_metrics("127.0.0.1", 0, counters, gauges, {"peer": "PeerA", "run": "t"})
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.shutdown()
    sample = re.compile(r'^[a-z_]+\{peer="[^"]+",run="t"\} [-+0-9.eNaInf]+$')
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert lines and all(sample.match(x) for x in lines), text
    values = {x.split("{")[0]: float(x.rsplit(" ", 1)[1]) for x in lines}
    assert values["diloco_peer_version"] == 2 and values["diloco_peer_rounds_total"] == 2
    assert values["diloco_peer_bytes_sent_total"] == 200 and values["diloco_peer_ppl"] == 30.0
    for name in ("diloco_peer_loss", "diloco_peer_group_size", "diloco_peer_bans",
                 "diloco_peer_bans_total", "diloco_peer_inner_steps_per_second"):  # fmt: skip
        assert name in values, name
    assert "diloco_peer_idle_fraction" not in values  # not known before the first step
    assert "diloco_peer_compute_utilization" not in values
    assert "# TYPE diloco_peer_rounds_total counter" in text
    assert serve_metrics("127.0.0.1", -1, counters, gauges, {"peer": "p", "run": "t"}) is None


def test_utilization_is_each_rounds_compute_over_its_wall_time() -> None:
    counters = Counters(started_training=True, t_first_train=100.0)
    counters.compute_s = 8.0  # the first phase, then 2 s in a group
    counters.add_round(report(1), now=110.0)
    assert counters.utilization == pytest.approx(0.8)
    counters.compute_s += 3.0  # 3 s of training in the 5 s up to the next round
    counters.add_round(report(2), now=115.0)
    assert counters.utilization == pytest.approx(0.6)
    assert Counters().utilization is None  # nothing trained, nothing reported


@pytest.mark.timeout(60)
def test_tensorboard_gets_one_scalar_per_metric_per_round(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, counters = TensorBoard(str(tmp_path / "tb")), Counters()
    for v in (1, 2, 3):
        counters.add_round(report(v))
        board.write(report(v), counters)
    board.close()
    TensorBoard(None).write(report(4), counters)  # no folder: nothing, no error
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"diloco/loss", "diloco/group_size", "diloco/comm_s"} <= set(acc.Tags()["scalars"])
    assert [s.step for s in acc.Scalars("diloco/loss")] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_a_download_of_the_next_version_keeps_no_parent_from_another_branch(
    run: RunSpec,
) -> None:
    """A replica at its own v1 that downloads another branch's v2 does not hold that v2's
    parent: its v1 is not it (fork healing would replay from the wrong state). Stepping from
    its snapshot, or back to it by `restore`, keeps the snapshot as the parent."""
    other, mine = two_replicas(run)
    seals: dict[int, dict[str, bytes]] = {}
    commit_twice(other, run, seals)  # other's v0 -> v1 -> v2
    own = [torch.full_like(t, 0.03) for t in mine.state.theta]
    mine.commit(own, ["PeerB"], {0: run.batch_size}, {})  # mine's own v1, another branch
    assert mine.version == 1 and mine.parent is not None and mine.parent.version == 0
    assert other.blob is not None and other.parent is not None
    mine.load(other.blob.data)  # a plain download of other's v2
    mine.snapshot()
    assert mine.version == 2 and mine.published_hash == other.published_hash
    assert mine.parent is None
    # stepping on from the downloaded v2 keeps it as the parent of v3
    mine.commit(own, ["PeerB"], {0: run.batch_size}, {})
    assert mine.parent is not None and mine.parent.state_hash == other.published_hash
    # a failed load undone by restore is no jump
    at_v3 = mine.published_hash
    mine.load(other.blob.data)
    mine.restore()
    mine.commit(own, ["PeerB"], {0: run.batch_size}, {})
    assert mine.version == 4 and mine.parent is not None and mine.parent.state_hash == at_v3
