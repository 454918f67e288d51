"""Overlapped rounds in the simulator (ALGORITHMS §1.1): the fold, the eager start, the virtual
clock, and that nothing changes when there is nothing to overlap."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.config import RunSpec, SimSpec
from diloco_peer.errors import ConfigError
from diloco_peer.peer.inner import InnerTrainer, Schedule
from diloco_peer.peer.model import build_model
from diloco_peer.sim.profiles import VERY, StepClock
from diloco_peer.sim.simulator import Simulator
from diloco_peer.sim.worker import (
    Fold,
    LastGroup,
    Worker,
    eager_start,
    overlapped_phase,
    proxy_start,
    steps_before,
)

pytestmark = pytest.mark.usefixtures("single_thread")

GEO = math.prod(VERY) ** (1 / len(VERY))
BUDGET, WORKERS, H = 40, 4, 5  # H is SMALL_RUN.inner_steps


def _simulate(run: RunSpec, **kwargs: Any) -> dict[str, Any]:
    run_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in RunSpec.__dataclass_fields__}
    kwargs = {"workers": WORKERS, "total_steps": BUDGET, "threads": 1, **kwargs}
    return Simulator(SimSpec(run=dataclasses.replace(run, **run_fields), **kwargs)).run()


def _without_config(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "config"}


# ----------------------------------------------------------------------------- pure parts


def test_steps_before_the_fold() -> None:
    clock = StepClock(2.0, 0.0, seed=0)
    assert steps_before(clock, 10.0, 10.0, 50) == 0  # the update is there when it starts
    assert steps_before(clock, 10.0, 5.0, 50) == 0
    assert steps_before(clock, 10.0, 14.0, 50) == 2  # exactly two steps
    assert steps_before(clock, 10.0, 14.5, 50) == 3  # the step under way finishes first
    assert steps_before(clock, 0.0, 1e6, 50) == 50  # arrives after the phase: at its end


def test_preview_leaves_the_optimizer_and_params_alone() -> None:
    opt = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    theta = [torch.ones(3)]
    opt.step(theta, [torch.full((3,), 0.1)], 1)  # momentum is not zero any more
    before = (opt.state_dict(), [t.clone() for t in theta])
    seen = opt.preview(theta, [torch.full((3,), 0.2)], 1)
    after = opt.state_dict()
    assert torch.equal(theta[0], before[1][0])
    assert torch.equal(after["tensors"]["m.0"], before[0]["tensors"]["m.0"])
    assert after["counters"] == before[0]["counters"]
    opt.step(theta, [torch.full((3,), 0.2)], 1)
    assert torch.equal(seen[0], theta[0])  # what the step then does


def test_rebase_keeps_the_progress_since_the_base(small_run: RunSpec) -> None:
    trainer = InnerTrainer(build_model(small_run.model, 64, 0, max_seq_len=16), small_run)
    base = trainer.snapshot()
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.5)  # progress since the base
    new_global = [t + 2.0 for t in base]
    trainer.rebase(new_global, base)
    for p, g in zip(trainer.params, new_global, strict=True):
        assert torch.allclose(p, g + 0.5)


@pytest.mark.parametrize("keep", [0.0, 0.25])
def test_a_partial_rebase_keeps_that_share_of_the_progress(small_run: RunSpec, keep: float) -> None:
    trainer = InnerTrainer(build_model(small_run.model, 64, 0, max_seq_len=16), small_run)
    base = trainer.snapshot()
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.5)
    new_global = [t + 2.0 for t in base]
    Fold("rebase", keep).apply(trainer, new_global, base)
    for p, g in zip(trainer.params, new_global, strict=True):
        assert torch.allclose(p, g + 0.5 * keep)


def test_the_mix_fold_moves_the_local_params_towards_the_global_ones(small_run: RunSpec) -> None:
    # Streaming DiLoCo's merge: θ_global + keep·(θ_local − θ_global), whatever the phase's base.
    trainer = InnerTrainer(build_model(small_run.model, 64, 0, max_seq_len=16), small_run)
    local = trainer.snapshot()
    new_global = [t + 2.0 for t in local]
    Fold("mix", 0.25).apply(trainer, new_global, [t - 9.0 for t in local])
    for p, lo, g in zip(trainer.params, local, new_global, strict=True):
        assert torch.allclose(p, g + 0.25 * (lo - g))


def test_the_shared_mix_term_is_the_last_outer_steps_damping(small_run: RunSpec) -> None:
    # `--overlap-term shared`, the swarm's `mix`: the fold takes κ·(θ − base) out of the δ, and
    # every δ applied gains κ·(Δ − (θ_{v−1} − θ_v)) of the last outer step (none before one).
    trainer = InnerTrainer(build_model(small_run.model, 64, 0, max_seq_len=16), small_run)
    local = trainer.snapshot()
    theta = [t + 2.0 for t in local]
    correction = Fold("mix", 0.5, shared=True).apply(trainer, theta, [t - 1.0 for t in local])
    assert correction is not None
    assert all(torch.allclose(c, torch.full_like(c, -1.5)) for c in correction)  # κ(b − θ)
    spec = SimSpec(run=small_run, overlap="local", overlap_fold="mix", overlap_keep=0.5,
                   overlap_term="shared")  # fmt: skip
    sim = SimpleNamespace(spec=spec, run_spec=small_run, damping=None,
                          theta=[torch.zeros(3)])  # fmt: skip
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    deltas = [[torch.full((3,), 1.0)], [torch.full((3,), 3.0)]]
    assert Simulator.with_term(sim, deltas) is deltas  # type: ignore[arg-type]
    Simulator.group_step(sim, outer, deltas)  # type: ignore[arg-type]
    # Δ 2.0; θ moved by 0.7·(2 + 0.9·2) = 2.66: damping 2 − 2.66
    assert sim.damping is not None and torch.allclose(sim.damping[0], torch.full((3,), -0.66))
    sent = Simulator.with_term(sim, deltas)  # type: ignore[arg-type]
    assert torch.allclose(sent[1][0], torch.full((3,), 3.0 - 0.33))
    with pytest.raises(ConfigError, match="overlap-term shared needs"):
        SimSpec(run=small_run, overlap="local", overlap_fold="rebase", overlap_term="shared")


def test_a_fold_after_zero_steps_is_the_blocking_phase(small_run: RunSpec) -> None:
    def phase(fold_after: int, start_from: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = build_model(small_run.model, 64, 0, max_seq_len=16)
        trainer = InnerTrainer(model, small_run)
        theta = [t + 0.01 for t in trainer.snapshot()]
        gen = torch.Generator().manual_seed(1)
        batches = lambda: [torch.randint(0, 64, (2, 17), generator=gen)]  # noqa: E731
        schedule = Schedule.for_run(small_run, 100)
        return overlapped_phase(trainer, theta, 3, fold_after, batches, schedule, 0,
                                start_from).delta  # fmt: skip

    blocking = phase(0, None)
    assert all(torch.equal(a, b) for a, b in zip(blocking, phase(0, [torch.zeros(1)]), strict=True))
    folded = phase(2, None)  # two steps from its own θ, then the fold
    assert not all(torch.equal(a, b) for a, b in zip(blocking, folded, strict=True))


def test_the_proxy_start_mixes_ones_fresh_delta_with_the_others_last_mean() -> None:
    opt = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    theta = [torch.zeros(2)]
    opt.step(theta, [torch.tensor([0.3, 0.0])], 1)  # momentum is not zero any more
    last = LastGroup()
    fresh = [torch.tensor([1.0, 2.0])]
    # No group yet: the eager start (own δ for all n).
    assert torch.equal(proxy_start(opt, theta, 0, fresh, 4, last)[0],
                       eager_start(opt, theta, fresh, 4)[0])  # fmt: skip
    workers = [Worker(i, None, None) for i in range(3)]  # type: ignore[arg-type]
    last.record(workers, [[torch.tensor([3.0, 0.0])], [torch.tensor([5.0, 0.0])],
                          [torch.tensor([7.0, 3.0])]])  # fmt: skip
    assert torch.equal(last.others_mean(0)[0], torch.tensor([6.0, 1.5]))  # type: ignore[index]
    assert torch.equal(last.others_mean(9)[0], torch.tensor([5.0, 1.0]))  # type: ignore[index]
    # Worker 0 of 4: its own fresh δ once, the others' last mean three times.
    expect = opt.preview(theta, [fresh[0] + 3 * torch.tensor([6.0, 1.5])], 4)
    assert torch.equal(proxy_start(opt, theta, 0, fresh, 4, last)[0], expect[0])
    # A lone last group of worker 0 itself: nobody else's δ to go by, so the eager start.
    last.record(workers[:1], [[torch.tensor([3.0, 0.0])]])
    assert last.others_mean(0) is None
    assert torch.equal(proxy_start(opt, theta, 0, fresh, 4, last)[0],
                       eager_start(opt, theta, fresh, 4)[0])  # fmt: skip


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("algo", ["sync", "dn-dylu"])
@pytest.mark.parametrize("rule", ["eager", "local", "proxy"])
def test_nothing_to_overlap_gives_the_blocking_run(
    small_run: RunSpec, algo: str, rule: str
) -> None:
    # Equal devices and an instant all-reduce: every update is there when the next phase starts.
    blocking = _simulate(small_run, algo=algo)
    overlapped = _simulate(small_run, algo=algo, overlap=rule)
    assert _without_config(overlapped) == _without_config(blocking)


def test_blocking_sync_rounds_wait_for_the_all_reduce(small_run: RunSpec) -> None:
    rounds = BUDGET // (WORKERS * H)
    result = _simulate(small_run, algo="sync", comm_s=7.0)
    assert result["sim_time"] == pytest.approx(rounds * (H * GEO + 7.0))
    busy = rounds * H * GEO / result["sim_time"]
    assert result["idle_fraction"] == pytest.approx([1 - busy] * WORKERS)


@pytest.mark.parametrize("algo", ["sync", "dn-dylu"])
@pytest.mark.parametrize("rule", ["eager", "local", "proxy"])
def test_overlap_trains_through_the_all_reduce(small_run: RunSpec, algo: str, rule: str) -> None:
    comm = 0.5 * H * GEO  # half a phase
    blocking = _simulate(small_run, algo=algo, comm_s=comm)
    overlapped = _simulate(small_run, algo=algo, comm_s=comm, overlap=rule)
    assert overlapped["local_steps"] == blocking["local_steps"] == BUDGET
    assert overlapped["outer_updates"] == blocking["outer_updates"]
    # Only the last all-reduce is waited for: every other one is hidden behind a phase.
    updates = blocking["outer_updates"]
    assert blocking["sim_time"] == pytest.approx(updates * (H * GEO + comm))
    assert overlapped["sim_time"] == pytest.approx(updates * H * GEO + comm)
    assert max(overlapped["idle_fraction"]) < min(blocking["idle_fraction"])
    # The phases really started before their update was known: another model.
    assert overlapped["final_ppl"] != blocking["final_ppl"]
    assert math.isfinite(overlapped["final_ppl"])
    assert overlapped["final_ppl"] < 0.5 * overlapped["initial_ppl"]


def test_the_fold_rules_give_other_runs_on_the_same_clock(small_run: RunSpec) -> None:
    kwargs: dict[str, Any] = {"algo": "sync", "comm_s": 0.5 * H * GEO, "overlap": "local"}
    rebase = _simulate(small_run, overlap_fold="rebase", overlap_keep=1.0, **kwargs)
    half = _simulate(small_run, overlap_fold="rebase", overlap_keep=0.5, **kwargs)
    mix = _simulate(small_run, overlap_fold="mix", overlap_keep=0.5, **kwargs)
    # the default fold is the swarm's: `mix`, κ 0.5, from the group (on equal devices a group
    # is complete when its phases end, so the start changes nothing here)
    assert _without_config(_simulate(small_run, **kwargs)) == _without_config(mix)
    pull = _simulate(small_run, overlap_fold="pull", overlap_keep=0.5, **kwargs)
    assert rebase["sim_time"] == half["sim_time"] == mix["sim_time"] == pull["sim_time"]
    ppls = {rebase["final_ppl"], half["final_ppl"], mix["final_ppl"], pull["final_ppl"]}
    assert len(ppls) == 4 and all(math.isfinite(p) for p in ppls)


def test_the_three_rules_start_from_different_places(small_run: RunSpec) -> None:
    # Three rounds: the proxy start needs a group before the one it follows (else it is eager's).
    kwargs: dict[str, Any] = {"algo": "sync", "comm_s": 0.5 * H * GEO, "total_steps": 3 * 4 * H}
    eager = _simulate(small_run, overlap="eager", **kwargs)
    local = _simulate(small_run, overlap="local", **kwargs)
    proxy = _simulate(small_run, overlap="proxy", **kwargs)
    assert eager["sim_time"] == local["sim_time"] == proxy["sim_time"]
    assert len({eager["final_ppl"], local["final_ppl"], proxy["final_ppl"]}) == 3


@pytest.mark.parametrize("algo", ["sync", "dn-dylu"])
def test_a_phase_started_at_the_group_overlaps_only_the_all_reduce(
    small_run: RunSpec, algo: str
) -> None:
    kwargs: dict[str, Any] = {"algo": algo, "comm_s": 0.5 * H * GEO, "overlap_fold": "rebase",
                              "overlap_keep": 1.0}  # fmt: skip
    # Equal devices: every phase of a group ends at once, so both starts are the same.
    phase = _simulate(small_run, overlap="local", overlap_from="phase", **kwargs)
    group = _simulate(small_run, overlap="local", overlap_from="group", **kwargs)
    assert _without_config(group) == _without_config(phase)
    # Unequal ones: a fast worker waits for the group's slowest member before it starts, not
    # after its phase, and trains fewer steps from a stale start: another model.
    kwargs["heterogeneity"] = "slight"
    blocking = _simulate(small_run, **kwargs)
    phase = _simulate(small_run, overlap="local", overlap_from="phase", **kwargs)
    group = _simulate(small_run, overlap="local", overlap_from="group", **kwargs)
    assert blocking["sim_time"] > group["sim_time"] >= phase["sim_time"]
    assert sum(blocking["idle_fraction"]) > sum(group["idle_fraction"])
    assert len({blocking["final_ppl"], phase["final_ppl"], group["final_ppl"]}) == 3
    if algo == "sync":  # the slowest worker runs its phases back to back either way
        assert group["sim_time"] == pytest.approx(phase["sim_time"])
        assert group["idle_fraction"] == pytest.approx(phase["idle_fraction"])


def test_overlap_settings_are_checked(small_run: RunSpec) -> None:
    with pytest.raises(ConfigError, match="overlap rule"):
        SimSpec(run=small_run, overlap="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="overlap start"):
        SimSpec(run=small_run, overlap_from="never")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fold rule"):
        SimSpec(run=small_run, overlap_fold="average")  # type: ignore[arg-type]
    for keep in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match="overlap_keep"):
            SimSpec(run=small_run, overlap_keep=keep)
    with pytest.raises(ConfigError, match="--overlap needs"):
        SimSpec(run=small_run, algo="async", overlap="eager")
    with pytest.raises(ConfigError, match="not modelled"):
        SimSpec(run=small_run, algo="sync", overlap="eager", drop_prob=0.5)
    with pytest.raises(ConfigError, match="comm_s"):
        SimSpec(run=small_run, comm_s=-1.0)
    with pytest.raises(ConfigError, match="comm_s"):
        SimSpec(run=small_run, comm_s=math.inf)
