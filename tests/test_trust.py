"""A peer's trust rules without the network (peer/trust.py): chaos modes, admission, bans."""

from __future__ import annotations

import math
import time

import pytest
import torch

from diloco_peer.averaging.contribution import ContributionHeader
from diloco_peer.averaging.group_averager import GroupResult
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.receipts import Proof, Receipt, read_answer, seal_answer
from diloco_peer.config import SwarmSettings
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity
from diloco_peer.peer.chaos import CHAOS_MODES, Chaos
from diloco_peer.peer.trust import Guard

ME, OTHER, THIRD, FOURTH = (Identity.generate() for _ in range(4))
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


def _group(gathered: dict[str, bytes]) -> Group:
    members = tuple(sorted(gathered))
    return Group(
        key=KEY, group_id=b"g", members=members, weights=(1.0,) * len(members),
        gathered=tuple(gathered[m] for m in members), clients=(False,) * len(members),
        digest=b"d", leader=members[0],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "reason", "banned"),
    [
        ("stale", "another round", False),  # signed for another round: a leader may replay it
        ("forge", "signature", False),  # not signed by the accused
        ("wrong-shape", "wrong shape", True),  # signed by it, for this round
    ],
)
def test_hostile_headers_are_refused_at_admission(mode: str, reason: str, banned: bool) -> None:
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
    assert (OTHER.peer_id_str in honest.bans.active(3)) is banned
    why = admission.excluded[OTHER.peer_id_str]
    assert honest.drain_exclusions() == [(OTHER.peer_id_str, why, banned)]
    assert honest.drain_exclusions() == []


def test_a_combines_refused_delegates_are_logged_never_banned() -> None:
    """A delegate whose group material does not verify (screen_combine) signed nothing that
    proves it: excluded and logged as such, no ban (peer/stage_two.py)."""
    honest = Guard(ME, "run1", SwarmSettings())
    why = "a stage-one seal does not verify"
    honest.exclude_unproven({OTHER.peer_id_str: why, ME.peer_id_str: "never ourselves"}, 3)
    assert honest.drain_exclusions() == [(OTHER.peer_id_str, why, False)]
    assert OTHER.peer_id_str not in honest.bans.active(3)


def test_a_leader_listing_a_victim_with_garbage_gets_it_excluded_not_banned() -> None:
    """Issue 16, item 3: a hostile leader lists a peer that never joined, with garbage as its
    header. Every follower keeps it out of the round, and none bans it."""
    honest = Guard(ME, "run1", SwarmSettings())
    mine = offer(honest)
    third = offer(Guard(THIRD, "run1", SwarmSettings()))
    gathered = {ME.peer_id_str: mine.gather, THIRD.peer_id_str: third.gather,
                OTHER.peer_id_str: b"garbage the leader made up"}  # fmt: skip
    admission = honest.admit(mine.round)(_group(gathered))
    assert set(admission.bounds) == {ME.peer_id_str, THIRD.peer_id_str}
    assert OTHER.peer_id_str in admission.excluded
    assert honest.bans.active(3) == {}
    assert admission.weights == {ME.peer_id_str: 1.0, THIRD.peer_id_str: 1.0}


def test_a_signed_huge_norm_bans_and_an_exclusion_by_others_bans_never_renews() -> None:
    """A member whose own signed header declares 100x the others' norm is banned. Later, the
    others' bans in their headers keep it out (excluded by all), but that exclusion does not
    renew this peer's ban: it ends after ban_rounds versions."""
    settings = SwarmSettings()
    honest = Guard(ME, "run1", settings)
    mine = offer(honest)
    others = [offer(Guard(k, "run1", settings)) for k in (THIRD, FOURTH)]
    huge = offer(Guard(OTHER, "run1", settings), d=[t * 100 for t in delta()])
    peers = [ME, THIRD, FOURTH, OTHER]
    gathered = dict(zip((k.peer_id_str for k in peers), [mine.gather, *(o.gather for o in others),
                                                         huge.gather], strict=True))  # fmt: skip
    admission = honest.admit(mine.round)(_group(gathered))
    assert "above 4 x median" in admission.excluded[OTHER.peer_id_str]
    assert honest.bans.active(3)[OTHER.peer_id_str].until_version == 3 + settings.ban_rounds
    # versions later, the others still ban it: their headers say so
    later = 3 + settings.ban_rounds - 1
    voters = [Guard(k, "run1", settings) for k in (THIRD, FOURTH)]
    for voter in voters:
        voter.bans.ban(OTHER.peer_id_str, "norm", version=later)
    mine = offer(honest, version=later)
    votes = [offer(v, version=later) for v in voters]
    sneaky = offer(Guard(OTHER, "run1", settings), version=later)
    gathered = dict(zip((k.peer_id_str for k in peers), [mine.gather, *(v.gather for v in votes),
                                                         sneaky.gather], strict=True))  # fmt: skip
    admission = honest.admit(mine.round)(_group(gathered))
    assert "banned by" in admission.excluded[OTHER.peer_id_str]
    assert honest.bans.active(later)[OTHER.peer_id_str].until_version == 3 + settings.ban_rounds
    assert OTHER.peer_id_str not in honest.bans.active(3 + settings.ban_rounds)


def test_a_weight_in_the_envelope_is_ignored() -> None:
    """Issue 16, item 2: a member that puts 1e6 in its envelope's weight gets the weight its
    signed header gives, like everyone (the admission's weights replace the envelope's)."""
    settings = SwarmSettings(weighting="samples")
    honest = Guard(ME, "run1", settings)
    mine = offer(honest)
    greedy = Guard(OTHER, "run1", settings).offer(
        delta(), key=KEY, version=3, state_hash=HASH, base_version=3, steps=10,
        shard_samples={1: 10**9},
    )  # fmt: skip
    gathered = {ME.peer_id_str: mine.gather, OTHER.peer_id_str: greedy.gather}
    group = _group(gathered)
    group = Group(**{**group.__dict__, "weights": tuple(1e6 if m == OTHER.peer_id_str else 1.0
                                                        for m in group.members)})  # fmt: skip
    admission = honest.admit(mine.round)(group)
    assert admission.weights is not None
    # the low median of (160, 1e9) is 160: capped at SAMPLES_WEIGHT_CAP x 160
    assert admission.weights == {ME.peer_id_str: 160.0, OTHER.peer_id_str: 2 * 160.0}


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
    members: list[str],
    excluded: dict[str, str],
    accusations: dict[str, int],
    witnessed: dict[str, str] | None = None,
) -> GroupResult:
    return GroupResult(
        average=[], members=members, weights={}, gathered={}, group_id=b"g", bytes_sent=0,
        bytes_received=0, matchmaking_s=0.0, allreduce_s=0.0, excluded=excluded,
        accusations=accusations, witnessed=witnessed or {},
    )  # fmt: skip


def test_silent_members_are_named_in_the_next_header() -> None:
    guard = Guard(ME, "run1", SwarmSettings())
    held = guard.name_silent((OTHER.peer_id_str, ME.peer_id_str), now=time.time())
    assert list(held) == [OTHER.peer_id_str]  # never oneself
    header = ContributionHeader.verify_bytes(offer(guard).gather, ME.peer_id_str)
    assert header.silent == (OTHER.peer_id_str,) and header.bans == ()


def test_a_reducer_exclusion_bans_only_what_my_own_reducer_saw() -> None:
    """Another reducer's exclusion is its word (it may be hostile): however many reducers
    claim it, only a part this peer's own reducer excluded bans its sender."""
    guard = Guard(ME, "run1", SwarmSettings())
    members = sorted([ME.peer_id_str, OTHER.peer_id_str, THIRD.peer_id_str, "QmX"])
    guard.settle(_result(members, {OTHER.peer_id_str: "non-finite (parts 0, 1, 2)"},
                         {OTHER.peer_id_str: 3}, witnessed={OTHER.peer_id_str: "non-finite"}),
                 version=5)  # fmt: skip
    guard.settle(_result(members, {THIRD.peer_id_str: "non-finite (parts 0, 1, 2)"},
                         {THIRD.peer_id_str: 3}), version=5)  # fmt: skip
    assert set(guard.bans.active(5)) == {OTHER.peer_id_str}
    assert set(guard.bans.active(5 + SwarmSettings().ban_rounds)) == set()


def test_a_proven_equivocation_bans_the_reducer_once_and_nothing_less_bans_anyone() -> None:
    """Issue 16, item 8: two receipts the reducer signed for one part of one round, with
    different answers, ban it (at the version of this peer's last offer), once per round. A
    proof that does not hold here (another key, one receipt not signed by it) bans nobody."""
    digest = bytes(32)
    honest = Guard(ME, "run1", SwarmSettings())
    mine = offer(honest)
    gathered = {ME.peer_id_str: mine.gather, OTHER.peer_id_str: offer(Guard(OTHER, "run1",
                SwarmSettings())).gather}  # fmt: skip
    admission = honest.admit(mine.round)(_group(gathered))
    assert admission.keys == {ME.peer_id_str: ME.public_key, OTHER.peer_id_str: OTHER.public_key}

    def receipt(answer: bytes, key: Identity = OTHER) -> Receipt:
        return read_answer(seal_answer(answer, digest, 0, key.sign), digest, 0, None)[0]

    first, second = receipt(b"a"), receipt(b"b")
    for bogus in (
        Proof(OTHER.peer_id_str, THIRD.public_key, first, second),  # not its key
        Proof(OTHER.peer_id_str, OTHER.public_key, first, receipt(b"b", THIRD)),  # not signed
        Proof(OTHER.peer_id_str, OTHER.public_key, first, receipt(b"a")),  # the same answer
    ):
        honest.convict(bogus)
    assert honest.bans.active(3) == {}
    proof = Proof(OTHER.peer_id_str, OTHER.public_key, first, second)
    honest.convict(proof)
    honest.convict(Proof(OTHER.peer_id_str, OTHER.public_key, second, first))
    ban = honest.bans.active(3)[OTHER.peer_id_str]
    assert "equivocated" in ban.reason and ban.since_version == 3
    assert honest.bans.total == 1
    assert [(p, banned) for p, _, banned in honest.drain_exclusions()] == [
        (OTHER.peer_id_str, True)
    ]
