"""DyLU (ALGORITHMS.md §2.3, Eq. 6), the speed meter, and the shard sampler (§2.5, Eq. 2)."""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from diloco_peer.coordinator_free.dylu import SpeedMeter, dylu_phase_s, dylu_steps
from diloco_peer.coordinator_free.sampler import ShardSampler, fill_shards, shard_probabilities
from diloco_peer.errors import ConfigError

# Seconds per inner step of the four devices at heterogeneity level "very" (ALGORITHMS §2.8).
VERY_SECONDS_PER_STEP = (0.58, 0.75, 1.51, 3.33)

# ----------------------------------------------------------------------------- DyLU


def test_dylu_very_heterogeneous_profile() -> None:
    # v(w)/max v = 0.58/s: 0.58/0.75 = 0.7733 -> 38.67; 0.58/1.51 = 0.3841 -> 19.21;
    # 0.58/3.33 = 0.1742 -> 8.71; floored: 50, 38, 19, 8.
    speeds = {f"w{i}": 1 / s for i, s in enumerate(VERY_SECONDS_PER_STEP)}
    assert dylu_steps(speeds, 50) == {"w0": 50, "w1": 38, "w2": 19, "w3": 8}


def test_dylu_fastest_gets_h_and_order_does_not_matter() -> None:
    assert dylu_steps({3: 2.0, 1: 4.0, 2: 1.0}, 10) == {3: 5, 1: 10, 2: 2}


def test_dylu_at_least_one_step() -> None:
    assert dylu_steps({"fast": 100.0, "slow": 1.0}, 50) == {"fast": 50, "slow": 1}
    assert dylu_steps({"only": 0.01}, 1) == {"only": 1}


def test_dylu_floor_is_not_fooled_by_rounding() -> None:
    # 0.3 / 0.4 * 4 evaluates to 2.9999999999999996 in floating point; the exact value is 3.
    assert dylu_steps({"a": 0.4, "b": 0.3}, 4) == {"a": 4, "b": 3}


def test_dylu_empty() -> None:
    assert dylu_steps({}, 50) == {}


@pytest.mark.parametrize(
    ("speeds", "h"),
    [
        ({"a": 1.0, "b": 0.0}, 50),
        ({"a": -1.0}, 50),
        ({"a": math.inf}, 50),
        ({"a": math.nan}, 50),
        ({"a": True}, 50),
        ({"a": 1.0}, 0),
        ({"a": 1.0}, 2.5),
        ({"a": 1.0}, True),
    ],
)
def test_dylu_rejects_bad_input(speeds: dict[str, float], h: int) -> None:
    with pytest.raises(ConfigError):
        dylu_steps(speeds, h)


# ----------------------------------------------------------------------------- SpeedMeter


def test_speed_meter_exponential_average() -> None:
    meter = SpeedMeter(alpha=0.3)
    assert meter.steps_per_s is None
    meter.update(10, 2.0)  # the first measurement sets the estimate
    assert meter.steps_per_s == pytest.approx(5.0)
    meter.update(20, 2.0)  # 0.3 * 10 + 0.7 * 5
    assert meter.steps_per_s == pytest.approx(6.5)
    meter.update(5, 0.0)  # no elapsed time: ignored
    meter.update(5, -1.0)
    meter.update(0, 3.0)  # no steps: no rate
    assert meter.steps_per_s == pytest.approx(6.5)
    meter.update(2, 1.0)  # 0.3 * 2 + 0.7 * 6.5
    assert meter.steps_per_s == pytest.approx(5.15)


def test_speed_meter_ignores_until_first_usable_call() -> None:
    meter = SpeedMeter()
    meter.update(3, 0.0)
    assert meter.steps_per_s is None
    meter.update(3, 1.5)
    assert meter.steps_per_s == pytest.approx(2.0)


def test_speed_meter_alpha_one_keeps_latest() -> None:
    meter = SpeedMeter(alpha=1.0)
    meter.update(10, 1.0)
    meter.update(3, 1.0)
    assert meter.steps_per_s == pytest.approx(3.0)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan])
def test_speed_meter_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ConfigError):
        SpeedMeter(alpha=alpha)


@pytest.mark.parametrize(("steps", "seconds"), [(-1, 1.0), (1.5, 1.0), (1, math.nan)])
def test_speed_meter_rejects_bad_update(steps: int, seconds: float) -> None:
    with pytest.raises(ConfigError):
        SpeedMeter().update(steps, seconds)


# ----------------------------------------------------------------------------- Eq. 2


@pytest.mark.parametrize(
    ("sizes", "counts", "expected"),
    [
        # Nothing trained yet: fallback p ∝ |D|.
        ([5, 5, 5, 5], [0, 0, 0, 0], [0.25, 0.25, 0.25, 0.25]),
        ([1, 2, 3, 4], [0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4]),
        # Equal shards, n = [10, 0, 0, 30] of 40: terms .25-.25, .25, .25, .25-.75 < 0.
        ([1, 1, 1, 1], [10, 0, 0, 30], [0.0, 0.5, 0.5, 0.0]),
        # Equal shards, n = [0, 1, 2, 5] of 8: terms .25, .125, 0, <0 -> [2/3, 1/3, 0, 0].
        ([1, 1, 1, 1], [0, 1, 2, 5], [2 / 3, 1 / 3, 0.0, 0.0]),
        # Shares .1 .2 .3 .4 vs trained .4 .2 0 .4: only shard 2 is behind.
        ([1, 2, 3, 4], [4, 2, 0, 4], [0.0, 0.0, 1.0, 0.0]),
        # Exactly on target, every term is 0: fallback p ∝ |D|.
        ([1, 2, 3, 4], [10, 20, 30, 40], [0.1, 0.2, 0.3, 0.4]),
        ([7, 7, 7], [3, 3, 3], [1 / 3, 1 / 3, 1 / 3]),
    ],
)
def test_shard_probabilities(sizes: list[int], counts: list[int], expected: list[float]) -> None:
    assert shard_probabilities(sizes, counts) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("sizes", "counts"),
    [
        ([], []),
        ([0, 1], [0, 0]),
        ([-1, 1], [0, 0]),
        ([1.5, 1], [0, 0]),
        ([1, 1], [0]),
        ([1, 1], [-1, 0]),
        ([1, 1], [0.5, 0]),
    ],
)
def test_shard_probabilities_rejects_bad_input(sizes: list[int], counts: list[int]) -> None:
    with pytest.raises(ConfigError):
        shard_probabilities(sizes, counts)


def test_fill_shards_fills_the_furthest_behind_first() -> None:
    rng = random.Random(0)
    # 8 equal shards, three already ahead: the phase goes only to the five behind, evenly.
    assert fill_shards([10] * 8, [3200, 1600, 1600, 0, 0, 0, 0, 0], 50, 16, rng) == [
        0, 0, 0, 10, 10, 10, 10, 10
    ]  # fmt: skip
    # Balanced counts: the phase is spread over every shard, within one step.
    plan = fill_shards([10] * 8, [160] * 8, 50, 16, rng)
    assert sum(plan) == 50 and max(plan) - min(plan) == 1
    # Unequal shards get steps in proportion to their size.
    assert fill_shards([3, 1], [0, 0], 40, 1, rng) == [30, 10]
    assert fill_shards([1, 1], [0, 0], 0, 16, rng) == [0, 0]


def test_fill_shards_keeps_a_long_run_within_one_step_of_every_share() -> None:
    # Phases of DyLU sizes (50, 38, 19, 8 steps, ALGORITHMS 2.8 "very") one after another, on
    # shards of unequal size: after every phase each shard is within one step of its share.
    sizes, batch, rng = [700, 500, 500, 300, 300, 300, 200, 100], 16, random.Random(3)
    counts = [0] * len(sizes)
    for phase in [50, 38, 19, 8] * 25:
        plan = fill_shards(sizes, counts, phase, batch, rng)
        counts = [c + n * batch for c, n in zip(counts, plan, strict=True)]
        total = sum(counts)
        for d, c in zip(sizes, counts, strict=True):
            assert abs(c - total * d / sum(sizes)) <= batch
    assert sum(counts) == 2875 * batch


def test_concurrent_planners_share_one_fill_instead_of_each_correcting_in_full() -> None:
    # A sync round: 4 peers plan H = 50 steps each from the same counts, none seeing the
    # others. Each correcting the whole shortfall overshoots it 4-fold, round after round;
    # each taking its quarter of the round's fill keeps every shard near its share.
    sizes, batch = [10] * 8, 16

    def worst(others: int) -> float:  # the largest relative deviation after rounds 3 to 10
        counts, out = [0] * 8, 0.0
        for r in range(10):
            plans = [fill_shards(sizes, counts, 50, batch, random.Random(f"{p}/{r}"), others)
                     for p in range(4)]  # fmt: skip
            counts = [c + batch * sum(p[i] for p in plans) for i, c in enumerate(counts)]
            if r >= 2:
                out = max(out, *(abs(c / (sum(counts) / 8) - 1) for c in counts))
        return out

    assert worst(others=150) <= 0.03
    assert worst(others=0) > 0.2


def test_fill_shards_breaks_ties_by_the_generator() -> None:
    plans = {tuple(fill_shards([1] * 8, [0] * 8, 3, 16, random.Random(s))) for s in range(20)}
    assert len(plans) > 1 and all(sum(p) == 3 and max(p) == 1 for p in plans)


@pytest.mark.parametrize(
    "args",
    [([1, 1], [0, 0], -1, 16), ([1, 1], [0, 0], 2, 0), ([1, 1], [0], 2, 16), ([], [], 2, 16)],
)
def test_fill_shards_rejects_bad_input(args: tuple[list[int], list[int], int, int]) -> None:
    with pytest.raises(ConfigError):
        fill_shards(*args, random.Random(0))
    with pytest.raises(ConfigError, match="others"):
        fill_shards([1, 1], [0, 0], 2, 16, random.Random(0), others=-1)


def test_sampler_never_picks_shards_ahead_of_their_share() -> None:
    sampler = ShardSampler([1, 1, 1, 1], seed=0)
    drawn = Counter(sampler.sample([0, 1, 2, 5]) for _ in range(3000))
    assert set(drawn) == {0, 1}
    assert drawn[0] / 3000 == pytest.approx(2 / 3, abs=0.03)


def test_sampler_is_deterministic_and_state_round_trips() -> None:
    counts = [3, 0, 1, 0]
    a, b = ShardSampler([2, 2, 1, 1], seed=42), ShardSampler([2, 2, 1, 1], seed=42)
    assert [a.sample(counts) for _ in range(50)] == [b.sample(counts) for _ in range(50)]

    state = json.loads(json.dumps(a.state_dict()))
    resumed = ShardSampler([2, 2, 1, 1], seed=0)
    resumed.load_state_dict(state)
    assert resumed.seed == 42
    assert [resumed.sample(counts) for _ in range(50)] == [a.sample(counts) for _ in range(50)]
    assert (
        ShardSampler([2, 2, 1, 1], seed=43).state_dict()
        != ShardSampler([2, 2, 1, 1], seed=42).state_dict()
    )


def test_sampler_rejects_bad_state() -> None:
    sampler = ShardSampler([1, 2], seed=1)
    state = sampler.state_dict()
    for bad in [
        {**state, "sizes": [2, 1]},
        {**state, "rng": [3, [1, 2, 3], None]},
        {**state, "rng": "nonsense"},
        {**state, "seed": "1"},
        {"sizes": [1, 2]},
    ]:
        with pytest.raises(ConfigError):
            sampler.load_state_dict(bad)
    with pytest.raises(ConfigError):
        ShardSampler([1, 2], seed=1.5)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- statistics


def _simulate(
    pick: Callable[[int, list[int]], int], n_shards: int, phases: int = 2000, batch: int = 8
) -> list[int]:
    """Event-driven run of the 4 "very" devices under DyLU (H = 50); samples trained per shard.

    Each worker picks its shard when its phase starts, from the counts at that moment, and the
    phase's `steps · batch` samples are credited to that shard when the phase completes (the
    counts nᵢ of Eq. 2 are samples *already* trained). The next event is always the earliest
    finisher, ties broken by worker index, so the run is deterministic.
    """
    steps = dylu_steps({w: 1 / s for w, s in enumerate(VERY_SECONDS_PER_STEP)}, 50)
    counts = [0] * n_shards
    running: list[tuple[float, int, int]] = []  # (finish time, worker, shard)
    for w, seconds in enumerate(VERY_SECONDS_PER_STEP):
        heapq.heappush(running, (steps[w] * seconds, w, pick(w, counts)))
    for _ in range(phases):
        now, w, shard = heapq.heappop(running)
        counts[shard] += steps[w] * batch
        seconds = VERY_SECONDS_PER_STEP[w]
        heapq.heappush(running, (now + steps[w] * seconds, w, pick(w, counts)))
    return counts


def _max_relative_deviation(sizes: Sequence[int], counts: Sequence[int]) -> float:
    """max over shards of |trained share − data share| / data share."""
    total_size, total_count = sum(sizes), sum(counts)
    return max(
        abs(n / total_count - d / total_size) / (d / total_size)
        for d, n in zip(sizes, counts, strict=True)
    )


@pytest.mark.parametrize("sizes", [[1000] * 4, [1000, 2000, 3000, 4000]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_balances_heterogeneous_workers(sizes: list[int], seed: int) -> None:
    sampler = ShardSampler(sizes, seed=seed)
    counts = _simulate(lambda worker, counts: sampler.sample(counts), len(sizes))
    assert _max_relative_deviation(sizes, counts) < 0.05


@pytest.mark.parametrize("sizes", [[1000] * 4, [1000, 2000, 3000, 4000]])
def test_static_assignment_is_unbalanced(sizes: list[int]) -> None:
    """The contrast: worker i always on shard i trains shards in proportion to device speed."""
    counts = _simulate(lambda worker, counts: worker, len(sizes))
    assert _max_relative_deviation(sizes, counts) > 0.20


def test_a_dylu_phase_is_h_steps_at_the_fastest_speed() -> None:
    speeds = {f"w{i}": 1 / s for i, s in enumerate(VERY_SECONDS_PER_STEP)}
    assert dylu_phase_s(speeds, 50) == pytest.approx(50 * 0.58)
    assert dylu_phase_s({}, 50) is None
