"""The virtual-time simulator: every algorithm on a tiny budget, accounting, determinism."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_peer.config import COMPUTE_SCHEDULES, SIM_ALGOS, RunSpec, SimSpec
from diloco_peer.errors import BadInput, ConfigError
from diloco_peer.peer.checkpoint import save_model_checkpoint
from diloco_peer.sim.contributions import mean_pairwise_cosine
from diloco_peer.sim.profiles import VERY, StepClock, step_seconds
from diloco_peer.sim.simulator import Simulator, active_workers

pytestmark = pytest.mark.usefixtures("single_thread")

# Geometric mean of the "very" profile: every device's step time at heterogeneity "none".
GEO = math.prod(VERY) ** (1 / len(VERY))
BUDGET, WORKERS, H = 40, 4, 5  # H is SMALL_RUN.inner_steps


def _spec(run: RunSpec, **kwargs: Any) -> SimSpec:
    run_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in RunSpec.__dataclass_fields__}
    kwargs = {"workers": WORKERS, "total_steps": BUDGET, "threads": 1, **kwargs}
    return SimSpec(run=dataclasses.replace(run, **run_fields), **kwargs)


def _simulate(run: RunSpec, **kwargs: Any) -> dict[str, Any]:
    return Simulator(_spec(run, **kwargs)).run()


def _check_result(result: dict[str, Any], spec: SimSpec) -> None:
    """What every result document must satisfy, whatever the algorithm."""
    assert result["algo"] == spec.algo
    assert result["config"] == spec.to_dict()
    assert math.isfinite(result["initial_ppl"]) and math.isfinite(result["final_ppl"])
    curve = result["curve"]
    assert curve and curve[-1]["ppl"] == result["final_ppl"]
    assert curve[-1]["local_steps"] == result["local_steps"]
    assert curve[-1]["sim_time"] == result["sim_time"]
    assert all(set(p) == {"local_steps", "sim_time", "ppl"} for p in curve)
    assert all(a["local_steps"] < b["local_steps"] for a, b in zip(curve, curve[1:], strict=False))
    assert all(a["sim_time"] <= b["sim_time"] for a, b in zip(curve, curve[1:], strict=False))
    assert all(-1 - 1e-9 <= c <= 1 + 1e-9 for c in result["cosine_similarity"])
    assert all(0 <= x <= 1 for x in result["idle_fraction"])


@pytest.mark.parametrize("algo", SIM_ALGOS)
def test_every_algorithm_learns_on_a_tiny_budget(small_run: RunSpec, algo: str) -> None:
    spec = _spec(small_run, algo=algo, heterogeneity="moderate")
    result = Simulator(spec).run()
    _check_result(result, spec)
    assert result["local_steps"] == BUDGET
    assert result["final_ppl"] < 0.5 * result["initial_ppl"]
    assert result["sim_time"] > 0


@pytest.mark.parametrize("algo", ["sync", "dn-dylu", "async-poly"])
def test_same_spec_gives_the_same_result(small_run: RunSpec, algo: str) -> None:
    kwargs: dict[str, Any] = {"algo": algo, "heterogeneity": "very", "jitter": 0.2}
    assert _simulate(small_run, **kwargs) == _simulate(small_run, **kwargs)


def test_other_seed_gives_another_result(small_run: RunSpec) -> None:
    a = _simulate(small_run, algo="sync")
    b = _simulate(small_run, algo="sync", seed=1)
    assert a["final_ppl"] != b["final_ppl"]


# ----------------------------------------------------------------------------- accounting


def test_single_and_ddp_time_and_updates(small_run: RunSpec) -> None:
    single = _simulate(small_run, algo="single", heterogeneity="very")
    # One device, the fastest of the profile, for the whole budget.
    assert single["sim_time"] == pytest.approx(BUDGET * VERY[0])
    assert single["local_steps"] == BUDGET and single["outer_updates"] == 0
    ddp = _simulate(small_run, algo="ddp", heterogeneity="very")
    # BUDGET / WORKERS updates of a 4x batch, each paced by the slowest device.
    assert ddp["sim_time"] == pytest.approx(BUDGET / WORKERS * VERY[-1])
    assert ddp["idle_fraction"] == pytest.approx([1 - s / VERY[-1] for s in VERY])


def test_sync_rounds_are_paced_by_the_slowest_worker(small_run: RunSpec) -> None:
    rounds = BUDGET // (WORKERS * H)
    none = _simulate(small_run, algo="sync")
    assert none["outer_updates"] == rounds
    assert none["sim_time"] == pytest.approx(rounds * H * GEO)
    assert none["idle_fraction"] == pytest.approx([0.0] * WORKERS, abs=1e-12)
    assert len(none["cosine_similarity"]) == rounds
    very = _simulate(small_run, algo="sync", heterogeneity="very")
    assert very["sim_time"] == pytest.approx(rounds * H * VERY[-1])
    # Fast workers wait for the slowest at every round.
    assert very["idle_fraction"] == pytest.approx([1 - s / VERY[-1] for s in VERY])


def test_sync_leaves_a_remainder_smaller_than_one_step_per_worker(small_run: RunSpec) -> None:
    result = _simulate(small_run, algo="sync", total_steps=BUDGET + 3)
    assert result["local_steps"] == BUDGET


def test_dylu_idles_less_than_sync_on_heterogeneous_devices(small_run: RunSpec) -> None:
    sync = _simulate(small_run, algo="sync", heterogeneity="very")
    # no grace period: at H = 5 DyLU's phases (5, 3, 1, 1 steps) end seconds apart, and a
    # window that groups them is idle time of its own
    dylu = _simulate(small_run, algo="dn-dylu", heterogeneity="very", grace_share=0.0)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert sync["idle_fraction"][0] > 0.5
    assert mean(dylu["idle_fraction"]) < 0.5 * mean(sync["idle_fraction"])
    assert dylu["sim_time"] < sync["sim_time"]
    assert dylu["local_steps"] == sync["local_steps"] == BUDGET


def test_async_staleness_on_identical_devices(small_run: RunSpec) -> None:
    # Four workers finish together; applied one by one, they are 0, 1, 2, 3 versions stale.
    phases = BUDGET // H
    plain = _simulate(small_run, algo="async")
    assert plain["outer_updates"] == phases
    assert (plain["mean_staleness"], plain["max_staleness"]) == (1.5, 3)
    assert plain["sim_time"] == pytest.approx(phases // WORKERS * H * GEO)
    # Delayed Nesterov takes the whole group as one all-reduced contribution: never stale.
    dn = _simulate(small_run, algo="dn")
    assert (dn["outer_updates"], dn["mean_staleness"], dn["max_staleness"]) == (2, 0.0, 0)
    buffered = _simulate(small_run, algo="async-buffer")
    assert buffered["outer_updates"] == phases // WORKERS


def test_polythres_drops_contributions_over_the_threshold(small_run: RunSpec) -> None:
    # Per group of four simultaneous arrivals: stale 0 and 1 are applied, then the next two are
    # 2 versions stale (> 1) and dropped without bumping the version.
    result = _simulate(small_run, algo="async-polythres", staleness_threshold=1)
    groups = BUDGET // (WORKERS * H)
    assert result["dropped_contributions"] == 2 * groups
    assert result["outer_updates"] == 2 * groups
    assert result["max_staleness"] == 2
    kept = _simulate(small_run, algo="async-polythres", staleness_threshold=10)
    assert kept["dropped_contributions"] == 0


def test_async_shares_describe_the_shards(small_run: RunSpec) -> None:
    result = _simulate(small_run, algo="async", num_shards=2, heterogeneity="very")
    assert len(result["shard_share"]) == len(result["data_share"]) == 2
    assert sum(result["shard_share"]) == pytest.approx(1.0)
    assert sum(result["data_share"]) == pytest.approx(1.0)


def test_sync_trains_every_shard_when_there_are_more_shards_than_workers(
    small_run: RunSpec,
) -> None:
    # DiLoCo's placement (worker i on shard i) when the shards match the workers; with the
    # built-in run's 8 shards for 4 workers each phase goes to a shard Eq. 2 picks instead, so
    # that no shard is left out and each shard's schedule runs over its share of the budget.
    one_each = _simulate(small_run, algo="sync", num_shards=WORKERS)
    assert one_each["shard_share"] == [1 / WORKERS] * WORKERS
    more = _simulate(small_run, algo="sync", num_shards=2 * WORKERS)
    assert len(more["shard_share"]) == 2 * WORKERS
    assert min(more["shard_share"]) > 0
    assert max(more["shard_share"]) <= 2 / (2 * WORKERS)


def test_huge_grace_period_turns_dn_into_rounds(small_run: RunSpec) -> None:
    # Everyone arrives inside the window, so each group is the whole swarm: no staleness, and
    # each round lasts as long as the slowest device needs for H steps.
    result = _simulate(small_run, algo="dn", heterogeneity="very", grace_s=1e6)
    rounds = BUDGET // (WORKERS * H)
    assert (result["outer_updates"], result["max_staleness"]) == (rounds, 0)
    assert result["sim_time"] == pytest.approx(rounds * H * VERY[-1])
    no_grace = _simulate(small_run, algo="dn", heterogeneity="very", grace_share=0.0)
    assert no_grace["max_staleness"] > 0
    assert no_grace["sim_time"] < result["sim_time"]


def test_dylu_phases_meet_in_a_grace_period_that_is_a_share_of_the_phase(
    small_run: RunSpec,
) -> None:
    # DyLU sizes the phases to end together, within about one slow step (H = 25: 25, 19, 9 and
    # 4 steps end at 14.5, 14.25, 13.59 and 13.32 virtual s): the default grace (a share of H
    # at the fastest speed, 2.9 s) groups them, no grace leaves each one alone and stale
    kwargs: dict[str, Any] = {"algo": "dn-dylu", "heterogeneity": "very", "inner_steps": 25}
    grouped = _simulate(small_run, total_steps=2 * 57, **kwargs)
    alone = _simulate(small_run, total_steps=2 * 57, grace_share=0.0, **kwargs)
    assert grouped["max_staleness"] == 0 and alone["max_staleness"] > 0
    assert grouped["outer_updates"] < alone["outer_updates"]


def test_sync_drop_prob_counts_dropped_contributions(small_run: RunSpec) -> None:
    budget = 80  # four rounds of four contributions
    dropping = _simulate(small_run, algo="sync", drop_prob=0.5, total_steps=budget)
    rounds = budget // (WORKERS * H)
    assert 0 < dropping["dropped_contributions"] < rounds * WORKERS
    assert dropping["outer_updates"] <= rounds
    assert dropping["local_steps"] == budget
    assert math.isfinite(dropping["final_ppl"])
    reliable = _simulate(small_run, algo="sync", total_steps=budget)
    assert reliable["dropped_contributions"] == 0
    assert reliable["outer_updates"] == rounds
    assert dropping["final_ppl"] != reliable["final_ppl"]


@pytest.mark.parametrize("schedule", COMPUTE_SCHEDULES)
def test_compute_schedules_run(small_run: RunSpec, schedule: str) -> None:
    spec = _spec(small_run, algo="sync", compute_schedule=schedule)
    result = Simulator(spec).run()
    _check_result(result, spec)
    # A tail too short for one step on each active worker is left unused.
    assert BUDGET - WORKERS < result["local_steps"] <= BUDGET
    assert result["final_ppl"] < result["initial_ppl"]


def test_active_workers() -> None:
    assert [active_workers("constant", 4, p) for p in (0, 0.5, 0.99)] == [4, 4, 4]
    assert [active_workers("doubling", 4, p) for p in (0, 0.49, 0.5, 0.99)] == [2, 2, 4, 4]
    assert [active_workers("halving", 4, p) for p in (0, 0.49, 0.5, 0.99)] == [4, 4, 2, 2]
    assert [active_workers("ramp-up", 4, p) for p in (0, 0.25, 0.5, 0.99)] == [1, 2, 3, 4]
    assert [active_workers("ramp-down", 4, p) for p in (0, 0.25, 0.5, 0.99)] == [4, 3, 2, 1]
    assert active_workers("halving", 1, 0.9) == 1


@pytest.mark.parametrize("algo", ["sync", "dn-dylu"])
def test_non_iid_shards_run(small_run: RunSpec, algo: str) -> None:
    spec = _spec(small_run, algo=algo, shards="non-iid", heterogeneity="slight")
    result = Simulator(spec).run()
    _check_result(result, spec)
    assert result["local_steps"] == BUDGET
    assert result["final_ppl"] < result["initial_ppl"]


def test_eval_every_sets_the_curve_points(small_run: RunSpec) -> None:
    single = _simulate(small_run, algo="single", eval_every=10)
    assert [p["local_steps"] for p in single["curve"]] == [10, 20, 30, 40]
    sync = _simulate(small_run, algo="sync", eval_every=10)  # progress comes in rounds of 20
    assert [p["local_steps"] for p in sync["curve"]] == [20, 40]


def test_one_worker_has_no_cosine_similarity(small_run: RunSpec) -> None:
    result = _simulate(small_run, algo="sync", workers=1, total_steps=10)
    assert result["cosine_similarity"] == []
    assert result["local_steps"] == 10 and result["outer_updates"] == 2


def test_init_checkpoint_and_pretraining_set_the_start(small_run: RunSpec, tmp_path: Path) -> None:
    first = Simulator(_spec(small_run, algo="single", total_steps=20))
    result = first.run()
    path = tmp_path / "start.safetensors"
    save_model_checkpoint(path, first.model, first.run_spec)
    resumed = Simulator(_spec(small_run, algo="sync", init=str(path)))
    assert resumed.initial_ppl == pytest.approx(result["final_ppl"], rel=1e-6)
    pretrained = Simulator(_spec(small_run, algo="sync", pretrain_steps=10))
    assert pretrained.initial_ppl < 0.5 * first.initial_ppl


def test_init_from_a_missing_checkpoint_is_bad_input(small_run: RunSpec, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not found"):  # the CLI's exit code 2
        Simulator(_spec(small_run, init=str(tmp_path / "nope.safetensors")))


# ----------------------------------------------------------------------------- profiles


def test_very_profile_is_the_measured_one() -> None:
    assert step_seconds("very", 4) == pytest.approx([0.58, 0.75, 1.51, 3.33], rel=1e-12)


def test_none_profile_is_the_geometric_mean() -> None:
    expected = (0.58 * 0.75 * 1.51 * 3.33) ** 0.25
    assert step_seconds("none", 4) == pytest.approx([expected] * 4, rel=1e-12)


def test_intermediate_profiles_interpolate_geometrically() -> None:
    none, very = step_seconds("none", 4), step_seconds("very", 4)
    moderate, slight = step_seconds("moderate", 4), step_seconds("slight", 4)
    for n, v, m, s in zip(none, very, moderate, slight, strict=True):
        assert m == pytest.approx(math.sqrt(n * v))
        assert s == pytest.approx(n**0.75 * v**0.25)
    # The fastest gets faster and the slowest slower as heterogeneity grows.
    assert very[0] < moderate[0] < slight[0] < none[0]
    assert very[-1] > moderate[-1] > slight[-1] > none[-1]


def test_more_than_four_workers_repeat_the_profile() -> None:
    assert step_seconds("very", 10) == pytest.approx(list(VERY) * 2 + list(VERY[:2]))
    assert step_seconds("very", 1) == pytest.approx([0.58])


def test_bad_profile_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown heterogeneity"):
        step_seconds("extreme", 4)
    with pytest.raises(ConfigError, match="workers"):
        step_seconds("none", 0)


def test_step_clock() -> None:
    assert StepClock(0.5, jitter=0.0, seed=0).duration(7) == 3.5
    a = StepClock(0.5, jitter=0.3, seed=1)
    b = StepClock(0.5, jitter=0.3, seed=1)
    assert [a.duration(3) for _ in range(4)] == [b.duration(3) for _ in range(4)]
    assert StepClock(0.5, 0.3, seed=2).duration(3) != StepClock(0.5, 0.3, seed=1).duration(3)
    # Mean-one noise: a long run takes about steps × seconds_per_step.
    assert StepClock(1.0, jitter=0.3, seed=0).duration(20_000) == pytest.approx(20_000, rel=0.02)


def test_mean_pairwise_cosine() -> None:
    a = [torch.tensor([1.0, 0.0]), torch.tensor([[2.0]])]
    b = [torch.tensor([0.0, 1.0]), torch.tensor([[0.0]])]
    assert mean_pairwise_cosine([a]) is None
    assert mean_pairwise_cosine([a, a]) == pytest.approx(1.0)
    assert mean_pairwise_cosine([a, [-t for t in a]]) == pytest.approx(-1.0)
    assert mean_pairwise_cosine([a, b]) == pytest.approx(0.0)
    # Mean over the three pairs: cos(a,a)=1, cos(a,b)=0 twice.
    assert mean_pairwise_cosine([a, a, b]) == pytest.approx(1 / 3)
