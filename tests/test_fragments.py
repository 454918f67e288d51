"""Streaming DiLoCo's fragments in the simulator (ALGORITHMS §1.2): how the model and a round
are cut, that one fragment is the unfragmented run bit for bit, and what several change."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from diloco_peer.averaging.fragments import fragment_of
from diloco_peer.config import RunSpec, SimSpec
from diloco_peer.errors import ConfigError
from diloco_peer.peer.model import build_model
from diloco_peer.sim.fragments import FragmentedSync, check_fragments, sub_phases
from diloco_peer.sim.simulator import Simulator

pytestmark = pytest.mark.usefixtures("single_thread")


def _spec(run: RunSpec, **kwargs: Any) -> SimSpec:
    base = {"workers": 2, "total_steps": 30, "heterogeneity": "slight", "comm_s": 0.5, "threads": 1}
    return SimSpec(run=run, algo="sync", **(base | kwargs))


def test_blocks_are_dealt_out_strided_with_the_ends_at_the_ends() -> None:
    names = [n for n, _ in build_model("nano", 64, 0).named_parameters()]
    assert names[0] == "embed.weight" and names[-1] == "norm.weight"
    for count in (1, 2, 3):
        frag = fragment_of(names, count)
        assert frag[0] == 0 and frag[-1] == count - 1
        for name, f in zip(names[1:-1], frag[1:-1], strict=True):
            assert f == int(name.split(".")[1]) % count
        assert set(frag) == set(range(count))
    with pytest.raises(ConfigError, match="3 transformer blocks"):
        fragment_of(names, 4)


def test_a_round_is_cut_into_near_equal_sub_phases() -> None:
    assert sub_phases(50, 3) == [17, 16, 17]
    assert sub_phases(50, 1) == [50]
    assert sub_phases(2, 3) == [1, 0, 1]
    for steps in range(1, 40):
        for count in (1, 2, 3, 5):
            assert sum(sub_phases(steps, count)) == steps


@pytest.mark.parametrize(
    "overlap",
    [
        {},
        {"overlap": "local"},
        {"overlap": "local", "overlap_fold": "mix", "overlap_keep": 0.5, "overlap_from": "group"},
    ],  # fmt: skip
    ids=["blocking", "rebase", "mix-group"],
)
def test_one_fragment_is_the_unfragmented_run_bit_for_bit(
    small_run: RunSpec, overlap: dict[str, Any]
) -> None:
    plain = Simulator(_spec(small_run, **overlap))
    plain_extra = plain._run_sync()
    cut = Simulator(_spec(small_run, **overlap))
    cut_extra = FragmentedSync(cut).run()
    for a, b in zip(plain.theta, cut.theta, strict=True):
        assert torch.equal(a, b)
    assert cut.now == plain.now
    assert cut_extra["idle_fraction"] == plain_extra["idle_fraction"]
    assert cut_extra["outer_updates"] == plain_extra["outer_updates"]


def test_three_fragments_sync_each_part_every_round_and_flush_at_the_end(
    small_run: RunSpec,
) -> None:
    run = dataclasses.replace(small_run, inner_steps=6)
    sim = Simulator(_spec(run, total_steps=24, fragments=3))
    start = [t.clone() for t in sim.theta]
    result = sim.run()
    # 2 rounds of 6 steps per worker, 3 syncs each, then the 2 fragments not synced last
    assert result["outer_updates"] == 2 * 3 + 2
    assert result["fragments"]["count"] == 3
    assert sum(result["fragments"]["share"]) == pytest.approx(1.0)
    assert max(result["fragments"]["share"]) < 0.5  # an all-reduce carries under half the model
    assert all(not torch.equal(a, b) for a, b in zip(start, sim.theta, strict=True))
    # the final ppl is the flushed θ_global's, at the run's last virtual time
    assert result["final_ppl"] == sim.eval_ppl()
    assert result["curve"][-1] == {"local_steps": 24, "sim_time": sim.now, "ppl": sim.eval_ppl()}
    assert [p["local_steps"] for p in result["curve"]] == sorted(
        {p["local_steps"] for p in result["curve"]}
    )
    # blocking: every fragment's all-reduce is waited for, one after another: 2 rounds' worth,
    # the last sync's, and the 2 last syncs' shares of comm_s (0.5)
    share = result["fragments"]["share"]
    busy = max(w_busy for w_busy in [sim.now * (1 - i) for i in result["idle_fraction"]])
    assert sim.now == pytest.approx(busy + 0.5 * (2 + share[0] + share[1]))


def test_overlapped_fragments_train_through_their_all_reduces(small_run: RunSpec) -> None:
    run = dataclasses.replace(small_run, inner_steps=6)
    blocking = Simulator(_spec(run, total_steps=24, fragments=3, comm_s=2.0)).run()
    overlapped = Simulator(
        _spec(run, total_steps=24, fragments=3, comm_s=2.0, overlap="local")
    ).run()
    assert overlapped["sim_time"] < blocking["sim_time"]
    assert max(overlapped["idle_fraction"]) < min(blocking["idle_fraction"])
    assert overlapped["final_ppl"] < overlapped["initial_ppl"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"algo": "dn"},
        {"overlap": "eager"},
        {"overlap": "local", "overlap_fold": "pull"},
        {"drop_prob": 0.1},
        {"fragments": 0},
        {"fragments": 6},  # more than H
    ],  # fmt: skip
)
def test_fragments_outside_what_is_modelled_are_refused(
    small_run: RunSpec, kwargs: dict[str, Any]
) -> None:
    spec = SimSpec(run=small_run, **({"fragments": 2} | kwargs))
    with pytest.raises(ConfigError):
        check_fragments(spec, [n for n, _ in build_model("nano", 64, 0).named_parameters()])
