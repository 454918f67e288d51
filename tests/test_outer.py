"""Outer optimizers (ALGORITHMS.md §1 and §2.2): golden numbers, equivalences, state, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from diloco_peer.averaging.outer import DelayedNesterov, build_outer_optimizer
from diloco_peer.averaging.outer_base import OuterOptimizer
from diloco_peer.config import OUTER_OPTIMIZERS
from diloco_peer.errors import ConfigError

THETA0 = [1.0, 2.0, -1.0]
DELTAS = [[1.0, -2.0, 0.5], [0.5, 1.0, -1.0], [-1.0, 2.0, 0.0]]
SHAPES = [(4, 3), (5,), (2, 2, 2)]


def _run_golden(opt: OuterOptimizer, steps: int) -> list[list[float]]:
    """Feed DELTAS[:steps] one at a time (count=1); the trajectory of θ after each step."""
    theta = torch.tensor(THETA0)
    out = []
    for delta in DELTAS[:steps]:
        opt.step([theta], [torch.tensor(delta)], 1)
        out.append(theta.tolist())
    return out


# Each expected row was worked out by hand from the formulas in ALGORITHMS.md; the arithmetic
# is in the comments. lr = 0.5 and μ = β = 0.5 keep every intermediate exact in binary.
GOLDEN: list[tuple[str, dict[str, Any], list[list[float]]]] = [
    (
        # θ ← θ − 0.5·Δ
        "sgd",
        {"lr": 0.5, "momentum": 0.5},
        [[0.5, 3.0, -1.25], [0.25, 2.5, -0.75], [0.75, 1.5, -0.75]],
    ),
    (
        # m1 = Δ1 = [1, -2, .5]; m2 = .5·m1 + Δ2 = [1, 0, -.75]; m3 = .5·m2 + Δ3 = [-.5, 2, -.375]
        # θ ← θ − 0.5·m
        "sgdm",
        {"lr": 0.5, "momentum": 0.5},
        [[0.5, 3.0, -1.25], [0.0, 3.0, -0.875], [0.25, 2.0, -0.6875]],
    ),
    (
        # same m as sgdm; θ ← θ − 0.5·(Δ + 0.5·m):
        # step 1: 0.5·(Δ1 + .5·Δ1) = [.75, -1.5, .375]; step 2: 0.5·([.5, 1, -1] + [.5, 0, -.375])
        # = [.5, .5, -.6875]; step 3: 0.5·([-1, 2, 0] + [-.25, 1, -.1875]) = [-.625, 1.5, -.09375]
        "nesterov",
        {"lr": 0.5, "momentum": 0.5},
        [[0.25, 3.5, -1.375], [-0.25, 3.0, -0.6875], [0.375, 1.5, -0.59375]],
    ),
    (
        # lr .1, β = (.5, .75), ε = .1. Step 1: m̂ = Δ1, v̂ = Δ1², θ −= .1·Δ1/(|Δ1| + .1)
        # = [.1/1.1, -.2/2.1, .05/.6] -> [10/11, 44/21, -13/12].
        # Step 2: m = [.5, 0, -.375], v = [.25, 1, .296875]; m̂ = m/.75, v̂ = v/.4375;
        # θ0 −= .1·(2/3)/(√(4/7) + .1) = .0778881; θ2 −= .1·(-.5)/(√(.678571) + .1) = -.0541270
        "adam",
        {"lr": 0.1, "momentum": 0.5, "betas": (0.5, 0.75), "eps": 0.1},
        [[10 / 11, 44 / 21, -13 / 12], [0.8312028, 44 / 21, -1.0292064]],
    ),
    (
        # N = 2, c = .25, β = .5, lr = .5, one contribution per call.
        # t=0: B = g1, no boundary, m = 0: θ −= .5·(g1/2) = [.25, -.5, .125]
        # t=1: boundary: B = g1 + g2 = [1.5, -1, -.5], m = B/2 = [.75, -.5, -.25];
        #      θ −= .5·((1 - .5 + .25)·.5·m + g2/2) = .1875·m + .25·g2 = [.265625, .15625, -.296875]
        # t=2: B = g3, no boundary: θ −= .5·(.25·.5·m + g3/2) = .0625·m + .25·g3
        #      = [-.203125, .46875, -.015625]
        "delayed-nesterov",
        {"lr": 0.5, "momentum": 0.5, "buffer_size": 2, "c": 0.25},
        [[0.75, 2.5, -1.125], [0.484375, 2.34375, -0.828125], [0.6875, 1.875, -0.8125]],
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "expected"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_values(name: str, kwargs: dict[str, Any], expected: list[list[float]]) -> None:
    got = _run_golden(build_outer_optimizer(name, **kwargs), len(expected))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-6, rtol=0)


def _random_params(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _random_deltas(gen: torch.Generator, scale: float = 0.1) -> list[torch.Tensor]:
    return [scale * torch.randn(s, generator=gen) for s in SHAPES]


def _compare_with_torch(
    ours: OuterOptimizer, make_torch: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
) -> None:
    gen = torch.Generator().manual_seed(0)
    p_ours = _random_params(gen)
    p_torch = [p.clone().requires_grad_(True) for p in p_ours]
    ref = make_torch(p_torch)
    for _ in range(5):
        deltas = _random_deltas(gen)
        ours.step(p_ours, deltas, 1)
        for p, d in zip(p_torch, deltas, strict=True):
            p.grad = d.clone()
        ref.step()
    for a, b in zip(p_ours, p_torch, strict=True):
        torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-6)


def test_nesterov_matches_torch_sgd() -> None:
    _compare_with_torch(
        build_outer_optimizer("nesterov", lr=0.7, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, dampening=0),
    )


def test_adam_matches_torch_adam() -> None:
    _compare_with_torch(
        build_outer_optimizer("adam", lr=0.7, momentum=0.123, betas=(0.9, 0.95), eps=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.7, betas=(0.9, 0.95), eps=0.1),
    )


@pytest.mark.parametrize("name", ["sgd", "sgdm", "nesterov", "adam"])
def test_sum_and_count_is_one_step_on_the_average(name: str) -> None:
    """A group of 3 reaches these optimizers as one step on the mean of the 3 contributions."""
    gen = torch.Generator().manual_seed(1)
    p_sum = _random_params(gen)
    p_avg = [p.clone() for p in p_sum]
    opt_sum, opt_avg = build_outer_optimizer(name), build_outer_optimizer(name)
    for _ in range(3):
        contributions = [_random_deltas(gen) for _ in range(3)]
        total = [sum(parts) for parts in zip(*contributions, strict=True)]
        opt_sum.step(p_sum, total, 3)
        opt_avg.step(p_avg, [t / 3 for t in total], 1)
    for a, b in zip(p_sum, p_avg, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [2, 4])
def test_delayed_nesterov_synchronous_groups_equal_nesterov(k: int) -> None:
    """§2.2: with c = 0 and N = k, a group of k contributions is one Nesterov step."""
    gen = torch.Generator().manual_seed(k)
    p_dn = _random_params(gen)
    p_nest = [p.clone() for p in p_dn]
    dn = build_outer_optimizer("delayed-nesterov", lr=0.7, momentum=0.9, buffer_size=k, c=0.0)
    nest = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    for _ in range(12):
        contributions = [_random_deltas(gen) for _ in range(k)]
        total = [sum(parts) for parts in zip(*contributions, strict=True)]
        dn.step(p_dn, total, k)
        nest.step(p_nest, total, k)
    for a, b in zip(p_dn, p_nest, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # The equivalence is not vacuous: θ moved well beyond the tolerance.
    assert not torch.allclose(p_dn[0], _random_params(torch.Generator().manual_seed(k))[0])


@pytest.mark.parametrize(("n", "k", "c"), [(2, 2, 0.0), (3, 2, 0.25), (4, 5, 0.1), (1, 3, 1.0)])
def test_delayed_nesterov_group_equals_separate_contributions(n: int, k: int, c: float) -> None:
    """One call with count=k equals k calls with count=1 carrying the same average."""
    gen = torch.Generator().manual_seed(7)
    p_group = _random_params(gen)
    p_split = [p.clone() for p in p_group]
    make = lambda: build_outer_optimizer(  # noqa: E731
        "delayed-nesterov", lr=0.5, momentum=0.9, buffer_size=n, c=c
    )
    group, split = make(), make()
    for _ in range(5):  # k and n differ, so groups straddle buffer boundaries
        g = _random_deltas(gen)
        group.step(p_group, [k * x for x in g], k)
        for _ in range(k):
            split.step(p_split, g, 1)
    assert isinstance(group, DelayedNesterov) and isinstance(split, DelayedNesterov)
    assert group.contributions == split.contributions == 5 * k
    # Equal up to fp32 rounding: a run of j frozen-momentum steps is applied as one j-fold step.
    for a, b in zip(p_group, p_split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _algorithm3_reference(
    theta: list[float], contributions: list[list[float]], lr: float, beta: float, n: int, c: float
) -> list[float]:
    """Algorithm 3 of arXiv 2401.09135 written out literally, one contribution at a time."""
    m = [0.0] * len(theta)
    buf = [0.0] * len(theta)
    for t, g in enumerate(contributions):
        buf = [b + x for b, x in zip(buf, g, strict=True)]
        if (t + 1) % n == 0:
            m = [beta * mi + b / n for mi, b in zip(m, buf, strict=True)]
            theta = [
                th - lr * ((1 - c * n + c) * beta * mi + x / n)
                for th, mi, x in zip(theta, m, g, strict=True)
            ]
            buf = [0.0] * len(theta)
        else:
            theta = [
                th - lr * (c * beta * mi + x / n) for th, mi, x in zip(theta, m, g, strict=True)
            ]
    return theta


def test_delayed_nesterov_matches_literal_algorithm3() -> None:
    """Calls of varying count (a group of k = k contributions equal to its mean) vs the paper."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=gen)
    opt = build_outer_optimizer("delayed-nesterov", lr=0.6, momentum=0.8, buffer_size=3, c=0.2)
    ours = theta.clone()
    stream: list[list[float]] = []
    for count in [1, 2, 5, 1, 1, 3, 4, 2, 1, 6]:
        total = torch.randn(6, generator=gen)
        opt.step([ours], [total], count)
        stream.extend([(total / count).tolist()] * count)
    expected = _algorithm3_reference(theta.tolist(), stream, lr=0.6, beta=0.8, n=3, c=0.2)
    torch.testing.assert_close(ours, torch.tensor(expected), atol=1e-5, rtol=0)


CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("sgd", {}),
    ("sgdm", {}),
    ("nesterov", {}),
    ("adam", {"betas": (0.8, 0.99), "eps": 0.1}),
    ("delayed-nesterov", {"buffer_size": 3, "c": 0.2}),
]


def _serialize(state: dict[str, Any]) -> dict[str, Any]:
    """Through JSON and safetensors, as a checkpoint or a state download would carry it."""
    meta = json.loads(json.dumps({k: v for k, v in state.items() if k != "tensors"}))
    tensors = safetensors_load(safetensors_save(state["tensors"])) if state["tensors"] else {}
    return {**meta, "tensors": tensors}


@pytest.mark.parametrize(("name", "kwargs"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_state_round_trip_continues_identically(name: str, kwargs: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(11)
    params = _random_params(gen)
    stream = [(_random_deltas(gen), count) for count in [1, 2, 1, 3, 1, 2, 2]]

    straight = build_outer_optimizer(name, **kwargs)
    p_straight = [p.clone() for p in params]
    for deltas, count in stream:
        straight.step(p_straight, deltas, count)

    first = build_outer_optimizer(name, **kwargs)
    p_resumed = [p.clone() for p in params]
    for deltas, count in stream[:4]:
        first.step(p_resumed, deltas, count)
    state = _serialize(first.state_dict())
    resumed = build_outer_optimizer(name, **kwargs)
    resumed.load_state_dict(state)
    for t in state["tensors"].values():  # the loaded state must not alias the dict
        t.fill_(1e6)
    for deltas, count in stream[4:]:
        resumed.step(p_resumed, deltas, count)

    for a, b in zip(p_resumed, p_straight, strict=True):
        assert torch.equal(a, b)
    assert resumed.state_dict()["counters"] == straight.state_dict()["counters"]


def test_state_dict_layout() -> None:
    opt = build_outer_optimizer("delayed-nesterov", lr=0.7, momentum=0.9, buffer_size=2)
    assert opt.state_dict()["tensors"] == {}
    # A group of 3 whose contributions average to ones.
    opt.step([torch.zeros(2), torch.zeros(3, 1)], [torch.full((2,), 3.0), torch.ones(3, 1)], 3)
    state = opt.state_dict()
    assert state["name"] == "delayed-nesterov"
    assert state["hparams"] == {"lr": 0.7, "momentum": 0.9, "buffer_size": 2, "c": 0.0}
    assert state["counters"] == {"step": 1, "t": 3}
    assert sorted(state["tensors"]) == ["buf.0", "buf.1", "m.0", "m.1"]
    assert all(t.dtype == torch.float32 for t in state["tensors"].values())
    # t = 3 with N = 2: one boundary crossed, then one contribution sits in the buffer.
    assert torch.equal(state["tensors"]["buf.0"], torch.ones(2))


@pytest.mark.parametrize(("name", "kwargs"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_step_never_writes_the_pseudo_gradients(name: str, kwargs: dict[str, Any]) -> None:
    sums = [torch.full((3,), 6.0), torch.full((2, 2), -3.0)]
    build_outer_optimizer(name, **kwargs).step([torch.zeros(3), torch.zeros(2, 2)], sums, 3)
    assert torch.equal(sums[0], torch.full((3,), 6.0))
    assert torch.equal(sums[1], torch.full((2, 2), -3.0))


def test_non_fp32_params_are_stepped_in_fp32() -> None:
    p = torch.tensor([1.0, 2.0], dtype=torch.float64)
    build_outer_optimizer("sgd", lr=0.5).step([p], [torch.tensor([1.0, 1.0])], 2)
    assert p.dtype == torch.float64
    assert p.tolist() == [0.75, 1.75]


def test_params_requiring_grad_are_updated_in_place() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    before = p.data_ptr()
    build_outer_optimizer("nesterov").step([p], [torch.ones(3)], 1)
    assert p.data_ptr() == before
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 0.7 * 1.9))


def test_names_match_config() -> None:
    from diloco_peer.config import OUTER_OPTIMIZERS as CONFIG_NAMES

    assert OUTER_OPTIMIZERS == CONFIG_NAMES == tuple(n for n, _ in CONFIGS)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("lookahead", {}),
        ("nesterov", {"betas": (0.9, 0.99)}),
        ("adam", {"buffer_size": 2}),
        ("sgd", {"eps": 0.1}),
        ("delayed-nesterov", {"buffer_size": 2, "c": 0.6}),
        ("delayed-nesterov", {"buffer_size": 2, "c": -0.1}),
        ("delayed-nesterov", {"buffer_size": 0}),
        ("delayed-nesterov", {"buffer_size": 2.0}),
        ("nesterov", {"lr": 0.0}),
        ("nesterov", {"momentum": 1.0}),
        ("adam", {"eps": 0.0}),
        ("adam", {"betas": (0.9,)}),
        ("adam", {"betas": (0.9, 1.5)}),
    ],
)
def test_bad_configuration_raises(name: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        build_outer_optimizer(name, **kwargs)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match="delayed-nesterov"):
        build_outer_optimizer("lookahead")


@pytest.mark.parametrize(
    ("params", "sums", "count"),
    [
        ([], [], 1),
        ([torch.zeros(3)], [torch.zeros(3), torch.zeros(2)], 1),
        ([torch.zeros(3)], [torch.zeros(4)], 1),
        ([torch.zeros(3)], [torch.zeros(3)], 0),
        ([torch.zeros(3)], [torch.zeros(3)], 1.0),
        ([torch.zeros(3, dtype=torch.int64)], [torch.zeros(3)], 1),
    ],
)
def test_bad_step_raises_and_changes_nothing(
    params: list[torch.Tensor], sums: list[torch.Tensor], count: Any
) -> None:
    opt = build_outer_optimizer("nesterov")
    with pytest.raises(ConfigError):
        opt.step(params, sums, count)
    assert opt.state_dict()["counters"]["step"] == 0


def test_step_with_other_shapes_than_state_raises() -> None:
    opt = build_outer_optimizer("sgdm")
    opt.step([torch.zeros(3)], [torch.ones(3)], 1)
    with pytest.raises(ConfigError):
        opt.step([torch.zeros(4)], [torch.ones(4)], 1)


def test_load_state_dict_rejects_mismatches() -> None:
    opt = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    opt.step([torch.zeros(3)], [torch.ones(3)], 1)
    good = opt.state_dict()

    bad_cases: list[dict[str, Any]] = [
        {**good, "name": "sgdm"},
        {**good, "hparams": {"lr": 0.7, "momentum": 0.8}},
        {**good, "counters": {"step": -1}},
        {**good, "counters": {}},
        {**good, "tensors": {"m.0": torch.zeros(4)}},  # shape differs from current state
        {**good, "tensors": {"m.1": torch.zeros(3)}},  # index gap
        {**good, "tensors": {"v.0": torch.zeros(3)}},  # not a nesterov buffer
        {**good, "tensors": {"m.00": torch.zeros(3)}},  # not a canonical index
        {**good, "tensors": {"m.0": torch.zeros(3, dtype=torch.int64)}},
        {**good, "tensors": {}},  # step 1 without momentum
    ]
    for bad in bad_cases:
        with pytest.raises(ConfigError):
            opt.load_state_dict(bad)
    fresh = build_outer_optimizer("adam")
    with pytest.raises(ConfigError):
        fresh.load_state_dict({**fresh.state_dict(), "tensors": {"m.0": torch.zeros(3)}})
    # A failed load leaves the optimizer as it was.
    assert opt.state_dict()["counters"] == {"step": 1}
    assert torch.equal(opt.state_dict()["tensors"]["m.0"], torch.ones(3))


def test_loaded_state_with_wrong_shape_fails_on_first_step() -> None:
    source = build_outer_optimizer("sgdm")
    source.step([torch.zeros(3)], [torch.ones(3)], 1)
    target = build_outer_optimizer("sgdm")
    target.load_state_dict(source.state_dict())
    with pytest.raises(ConfigError):
        target.step([torch.zeros(5)], [torch.ones(5)], 1)
