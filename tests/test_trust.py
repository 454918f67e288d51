"""A peer's trust rules without the network (peer/trust.py): chaos modes, admission, bans."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_peer.averaging.contribution import ContributionHeader
from diloco_peer.averaging.group_averager import GroupResult
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.config import SwarmSettings
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity
from diloco_peer.peer.chaos import CHAOS_MODES, Chaos
from diloco_peer.peer.trust import Guard

ME, OTHER, THIRD = (Identity.generate() for _ in range(3))
HASH = "ab" * 32
KEY = "v3_" + HASH[:16]


def delta() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=g), torch.randn(2, generator=g)]


def offer(guard: Guard, version: int = 3, d: list[torch.Tensor] | None = None):  # noqa: ANN201
    return guard.offer(
        d or delta(), key=KEY, version=version, state_hash=HASH, base_version=version,
        steps=10, shard_samples={1: 160},
    )  # fmt: skip


def test_chaos_modes_parse_and_bad_ones_are_config_errors() -> None:
    assert Chaos.parse("scale=50") == Chaos("scale", 50.0)
    assert Chaos.parse("scale") == Chaos("scale", 1000.0)
    assert {Chaos.parse(m).mode for m in CHAOS_MODES} == set(CHAOS_MODES)
    for bad in ("bogus", "nan=3", "scale=x", "scale=inf"):
        with pytest.raises(ConfigError):
            Chaos.parse(bad)


def test_an_honest_offer_is_admitted_by_another_member() -> None:
    mine = offer(Guard(ME, "run1", SwarmSettings()))
    header = ContributionHeader.verify_bytes(mine.gather, ME.peer_id_str)
    assert header.norm == pytest.approx(math.sqrt(sum(float(t.square().sum()) for t in delta())))
    assert header.shards == {1: 160} and header.key == KEY
    assert torch.equal(mine.delta[0], delta()[0])


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("stale", "another round"), ("forge", "signature"), ("wrong-shape", "wrong shape")],
)
def test_hostile_headers_are_refused_at_admission(mode: str, reason: str) -> None:
    hostile = offer(Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse(mode)))
    honest = Guard(ME, "run1", SwarmSettings())
    mine = offer(honest)
    group = Group(
        key=KEY, group_id=b"g", members=tuple(sorted([ME.peer_id_str, OTHER.peer_id_str])),
        weights=(1.0, 1.0), gathered=(), clients=(False, False), digest=b"d",
        leader=ME.peer_id_str,
    )  # fmt: skip
    gathered = {ME.peer_id_str: mine.gather, OTHER.peer_id_str: hostile.gather}
    group = Group(**{**group.__dict__, "gathered": tuple(gathered[m] for m in group.members)})
    admission = honest.admit(mine.round)(group)
    assert list(admission.bounds) == [ME.peer_id_str]
    assert reason in admission.excluded[OTHER.peer_id_str]
    assert OTHER.peer_id_str in honest.bans.active(3)
    assert honest.drain_exclusions() == [(OTHER.peer_id_str, admission.excluded[OTHER.peer_id_str])]
    assert honest.drain_exclusions() == []


def test_value_attacks_change_what_is_sent() -> None:
    scaled = offer(Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse("scale=10")))
    assert torch.allclose(scaled.delta[0], delta()[0] * 10)
    header = ContributionHeader.verify_bytes(scaled.gather, OTHER.peer_id_str)
    honest_norm = math.sqrt(sum(float(t.square().sum()) for t in delta()))
    assert header.norm == pytest.approx(10 * honest_norm, rel=1e-5)  # declares what it sends
    flipped = offer(Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse("signflip")))
    assert torch.equal(flipped.delta[1], -delta()[1])
    noise = offer(Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse("random")))
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in noise.delta))
    assert norm == pytest.approx(honest_norm, rel=1e-4)
    nan = Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse("nan"))
    assert torch.isnan(nan.tamper(torch.ones(3))).all()
    assert Guard(ME, "run1", SwarmSettings()).tamper(torch.ones(3)).tolist() == [1.0] * 3


def test_replay_resends_the_previous_header_and_delta() -> None:
    guard = Guard(OTHER, "run1", SwarmSettings(), chaos=Chaos.parse("replay"))
    first = offer(guard, version=3)
    second = offer(guard, version=4, d=[t * 2 for t in delta()])
    assert second.gather == first.gather and torch.equal(second.delta[0], first.delta[0])


def _result(
    members: list[str], excluded: dict[str, str], accusations: dict[str, int]
) -> GroupResult:
    return GroupResult(
        average=[], members=members, weights={}, gathered={}, group_id=b"g", bytes_sent=0,
        bytes_received=0, matchmaking_s=0.0, allreduce_s=0.0, excluded=excluded,
        accusations=accusations,
    )  # fmt: skip


def test_a_reducer_exclusion_bans_only_with_a_majority_of_reducers() -> None:
    guard = Guard(ME, "run1", SwarmSettings())
    members = sorted([ME.peer_id_str, OTHER.peer_id_str, THIRD.peer_id_str, "QmX"])
    guard.settle(_result(members, {OTHER.peer_id_str: "non-finite (parts 0, 1, 2)"},
                         {OTHER.peer_id_str: 3}), version=5)  # fmt: skip
    guard.settle(_result(members, {THIRD.peer_id_str: "non-finite (parts 1, 2)"},
                         {THIRD.peer_id_str: 2}), version=5)  # fmt: skip
    assert set(guard.bans.active(5)) == {OTHER.peer_id_str}
    assert set(guard.bans.active(5 + SwarmSettings().ban_rounds)) == set()
