"""The attacks of issue 16 as chaos modes (peer/chaos.py, peer/hostile.py), each against the rule
that must stop it, without the network. bench/hostile_swarm.py runs them as real processes."""

from __future__ import annotations

import math
import time

import pytest
import torch

from diloco_peer.averaging.certificate import CertificateError
from diloco_peer.averaging.contribution import (
    ContributionHeader,
    Limits,
    Round,
    new_nonce,
    screen_group,
    shapes_digest,
)
from diloco_peer.averaging.matchmaking import Group, pack_gather, unpack_gather
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.robust import Aggregation
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.averaging.wire import answer_part, unpack_answer
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free.manifest import Manifest
from diloco_peer.coordinator_free.records import PeerHead, choose_manifest
from diloco_peer.coordinator_free.swarm_view import SPEED_CAP, HeadBook, SwarmView
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity
from diloco_peer.peer import hostile
from diloco_peer.peer.certify import Certifier
from diloco_peer.peer.chaos import Behaviour, Chaos, Steers
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.trust import Guard

ME, ATTACKER, OTHER = (Identity.generate() for _ in range(3))
SHAPES = [(8, 8), (8,)]


def replica() -> Replica:
    theta = [torch.full(s, 0.5) for s in SHAPES]
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    r = Replica(ReplicatedState(theta, outer, num_shards=8, manifest_digest="m" * 64),
                UpdateLog(16))  # fmt: skip
    r.snapshot()
    return r


def delta(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 0.01 for s in SHAPES]


def head(peer: Identity, version: int, state_hash: str, **kw: object) -> PeerHead:
    return PeerHead(peer_id=peer.peer_id_str, version=version, state_hash=state_hash, **kw)  # type: ignore[arg-type]


def test_the_new_modes_parse() -> None:
    assert Chaos.parse("hijack-lone") == Chaos("hijack-lone", None)
    assert Chaos.parse("hijack-lone=1000") == Chaos("hijack-lone", 1000.0)
    for mode in ("hijack", "steer", "poison-heads", "rival-manifest", "flood"):
        assert Chaos.parse(mode).behaviour().weight() == (1e6 if mode == "steer" else 1.0)
        with pytest.raises(ConfigError):
            Chaos.parse(f"{mode}=3")
    with pytest.raises(ConfigError):
        Chaos.parse("hijack-lone=nan")


def test_an_honest_behaviour_changes_nothing() -> None:
    guard, r = Guard(ME, "run1", SwarmSettings()), replica()
    before = r.published_hash
    guard.committed(r, lambda record: None, delta(), {0: 8}, 1)
    assert guard.envelope_weight() == 1.0 and r.published_hash == before


def test_a_hijacked_state_is_one_keys_word_and_never_followed() -> None:
    """`hijack`: θ = 0 at version + 50, served and advertised; honest peers do not move to it,
    whatever their replay window (a single holder, far beyond it)."""
    r = replica()
    r.commit(delta(), ["A"], {0: 8}, {})
    honest_hash = r.published_hash
    Chaos.parse("hijack").behaviour().committed(
        hostile.Committed(ATTACKER, "run1", r, lambda record: None, delta(), {0: 8}, 1)
    )
    assert r.version == 51 and r.blob is not None and r.blob.version == 51
    assert all(bool((t == 0).all()) for t in r.state.theta)
    heads = {
        ATTACKER.peer_id_str: head(ATTACKER, 51, r.published_hash),
        OTHER.peer_id_str: head(OTHER, 1, honest_hash),
    }
    assert SwarmView(ME.peer_id_str, 1, honest_hash, heads).choose_head(replay_window=2) is None


def _lone(factor: float | None) -> tuple[UpdateRecord, dict[str, bytes], Certifier]:
    guard = Guard(ATTACKER, "run1", SwarmSettings(), limits=Limits(max_samples=10**6))
    certifier = Certifier(lambda: None, guard, recent_norms=lambda: [])
    seals: dict[str, bytes] = {}

    def seal(record: UpdateRecord) -> None:
        seals[ATTACKER.peer_id_str] = certifier.seal_bytes(record)

    r = replica()
    r.commit(delta(1), ["A"], {0: 8}, {})
    behaviour = Chaos.parse("hijack-lone" if factor is None else f"hijack-lone={factor}")
    behaviour.behaviour().committed(
        hostile.Committed(ATTACKER, "run1", r, seal, delta(), {5: 160}, 10)
    )
    record = r.updates.get(1)
    assert record is not None and r.version == 2
    return UpdateRecord.from_bytes(record), seals, certifier


def test_a_lone_update_claiming_1e15_samples_fails_its_certificate() -> None:
    record, seals, certifier = _lone(None)
    assert record.shard_samples == {5: hostile.LIE_SAMPLES}
    with pytest.raises(CertificateError, match="samples"):
        certifier.check(record, seals)


def test_a_lone_update_of_1000_deltas_fails_the_history_screen() -> None:
    """`hijack-lone=1000` declares the truth, samples included: only the history screen stands
    in its way (certificate.HISTORY_MIN updates applied first; before that, nothing does:
    docs/results.md, bench/hostile_swarm.py)."""
    record, seals, _ = _lone(1000.0)
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in record.average))
    guard = Guard(ME, "run1", SwarmSettings(), limits=Limits(max_samples=10**6))
    screened = Certifier(lambda: None, guard, recent_norms=lambda: [norm / 1000] * 3)
    with pytest.raises(CertificateError, match="recent updates"):
        screened.check(record, seals)


def test_a_steerer_sends_a_plausible_delta_and_its_envelope_weight_is_ignored() -> None:
    """`steer`: 0.3 δ + noise at 2.5 |δ| (within 4 x the median norm) and weight 1e6 in its
    envelope; the admission gives it the weight its signed header gives everyone (1)."""
    d = delta()
    sent = Steers().sent(d)
    norm = math.sqrt(sum(float(t.square().sum()) for t in d))
    sent_norm = math.sqrt(sum(float(t.square().sum()) for t in sent))
    assert 2.2 * norm < sent_norm < 2.9 * norm
    from diloco_peer.averaging.matchmaking import Group

    version, state_hash = 3, "ab" * 32
    key = f"v{version}_{state_hash[:16]}"
    guards = {ME.peer_id_str: Guard(ME, "run1", SwarmSettings()),
              ATTACKER.peer_id_str: Guard(ATTACKER, "run1", SwarmSettings(),
                                          chaos=Chaos.parse("steer"))}  # fmt: skip
    offers = {
        p: g.offer(d, key=key, version=version, state_hash=state_hash, base_version=version,
                   steps=10, shard_samples={1: 160})
        for p, g in guards.items()
    }  # fmt: skip
    members = tuple(sorted(offers))
    group = Group(
        key=key, group_id=b"g", members=members,
        weights=tuple(guards[m].envelope_weight() for m in members),
        gathered=tuple(offers[m].gather for m in members), clients=(False, False), digest=b"d",
        leader=members[0],
    )  # fmt: skip
    assert max(group.weights) == 1e6
    admission = guards[ME.peer_id_str].admit(offers[ME.peer_id_str].round)(group)
    assert admission.weights == {ME.peer_id_str: 1.0, ATTACKER.peer_id_str: 1.0}


def test_poisoned_heads_are_bounded_by_the_head_book() -> None:
    """`poison-heads`: a date of 1e12 is ignored, a speed of 1e300 is read as SPEED_CAP x the
    median."""
    now = time.time()
    book = HeadBook(ME.peer_id_str)
    honest = head(OTHER, 1, "cd" * 32, speed=2.0, updated=now)
    true = head(ATTACKER, 1, "cd" * 32, speed=2.0, updated=now)
    book.merge({OTHER.peer_id_str: honest}, now)
    book.merge({ATTACKER.peer_id_str: hostile.poisoned(true, 0)}, now)
    book.merge({ATTACKER.peer_id_str: hostile.poisoned(true, 1)}, now + 1)
    assert book.seen[ATTACKER.peer_id_str].updated == now  # the 1e12 head was ignored
    view = SwarmView(ME.peer_id_str, 1, "cd" * 32, book.live(now + 2))
    assert view.speeds(2.0)[ATTACKER.peer_id_str] == SPEED_CAP * 2.0


def test_a_rival_manifest_is_ignored_by_a_joiner_with_the_owner_pinned() -> None:
    run, swarm = RunSpec(model="nano"), SwarmSettings()
    owners = Manifest.create("run1", run, swarm, ME)
    rival = hostile.rival_manifest(owners, ATTACKER)
    assert rival.owner_peer_id == ATTACKER.peer_id_str
    assert rival.manifest.created >= owners.manifest.created
    assert rival.manifest.swarm.min_cosine == -1.0
    chosen = choose_manifest("run1", [rival, owners], owner=ME.peer_id_str)
    assert chosen.digest == owners.digest
    # without the pin, the peer it was told to dial decides: the rival's if it dialled the rival
    assert choose_manifest("run1", [rival, owners], prefer=[ATTACKER.peer_id_str]) is rival


def test_an_equivocating_peer_says_so_to_its_averager_and_an_honest_one_does_not() -> None:
    """`--chaos equivocate` reaches GroupAverager's `equivocate` fault through the guard (the
    real-process proof: tests/test_group_averager.py; the swarm: bench/hostile_swarm.py)."""
    hostile = Guard(ATTACKER, "run1", SwarmSettings(), chaos=Chaos.parse("equivocate"))
    honest = Guard(ME, "run1", SwarmSettings())
    assert hostile.equivocates("v0_x") and not honest.equivocates("v0_x")


def _signed_group(version: int, members: list[Identity]) -> tuple[Group, Round]:
    """A group whose members signed honest headers for `version` (the envelopes hivemind's
    leader hands out), and that round."""
    state_hash = f"{version:02x}" * 32
    shapes = shapes_digest(SHAPES)
    rnd = Round(run="run1", key=f"v{version}_{state_hash[:16]}", version=version,
                state_hash=state_hash, numel=72, shapes=shapes, staleness_limit=2, norm_factor=4.0)  # fmt: skip
    ids = sorted(members, key=lambda k: k.peer_id_str)
    gathered = tuple(
        ContributionHeader(
            run="run1", peer=k.peer_id_str, public_key=k.public_key, key=rnd.key,
            version=version, state_hash=state_hash, base_version=version, steps=10, samples=80,
            shards={0: 80}, numel=72, shapes=shapes, norm=1.0, digest="00" * 32,
            nonce=new_nonce(),
        ).sign(k)
        for k in ids
    )  # fmt: skip
    group = Group(key=rnd.key, group_id=b"g", members=tuple(k.peer_id_str for k in ids),
                  weights=(1.0,) * len(ids), gathered=gathered, clients=(False,) * len(ids),
                  digest=b"d" * 32, leader=ids[0].peer_id_str)  # fmt: skip
    return group, rnd


def test_a_framed_peer_is_excluded_and_never_banned() -> None:
    """`--chaos frame` (issue 16, attack 3): a leader lists a peer that never joined, with the
    envelope that peer signed for an earlier group (or made-up bytes when it has none), or
    replaces a follower's envelope; its own header names the victim banned and silent. The
    honest members' screening keeps the victim out of the round and bans nobody."""
    victim, honest = OTHER, [ME, Identity.generate()]
    framer = Chaos.parse("frame").behaviour()
    frame = framer.framer()
    assert frame is not None and 0 < frame.lead_share < 1
    earlier, _ = _signed_group(4, [ATTACKER, victim, *honest])
    frame.seen(earlier, ATTACKER.peer_id_str)
    now, rnd = _signed_group(5, [ATTACKER, *honest])
    followers = {m: pack_gather(1.0, g) for m, g in zip(now.members, now.gathered, strict=True)}
    del followers[ATTACKER.peer_id_str]  # the leader is no follower of its own
    picked = frame.pick(followers)
    assert picked is not None and picked[0] == victim.peer_id_str  # it never joined
    assert frame.framed == frame.victim == victim.peer_id_str
    _, _, replayed = unpack_gather(picked[1])
    own = ContributionHeader.verify_bytes(
        dict(zip(now.members, now.gathered, strict=True))[ATTACKER.peer_id_str],
        ATTACKER.peer_id_str,
    )
    gathered = dict(zip(now.members, now.gathered, strict=True))
    gathered[ATTACKER.peer_id_str] = framer.header(own, []).sign(ATTACKER)  # names the victim
    gathered[victim.peer_id_str] = replayed
    screening = screen_group(gathered, rnd)
    assert set(screening.excluded) == {victim.peer_id_str}
    assert "another round" in screening.excluded[victim.peer_id_str]
    assert screening.banned == frozenset()
    # later, every peer it knows joins: in turn it lists a made-up peer id (a ghost), then
    # replaces a follower's envelope (made-up bytes when the one it knows is the one sent)
    frame.seen(now, ATTACKER.peer_id_str)
    assert frame.framed is None
    later, rnd6 = _signed_group(6, [ATTACKER, victim, *honest])
    real = dict(zip(later.members, later.gathered, strict=True))
    followers = {m: pack_gather(1.0, g) for m, g in real.items() if m != ATTACKER.peer_id_str}
    ghost = frame.pick(followers)
    replaced = frame.pick(followers)
    assert ghost is not None and ghost[0] not in real
    assert replaced is not None and replaced[0] in followers
    assert replaced[1] != followers[replaced[0]]
    for peer, envelope in (ghost, replaced):
        envelopes = {**real, peer: unpack_gather(envelope)[2]}
        screening = screen_group(envelopes, rnd6)
        assert set(screening.excluded) == {peer} and screening.banned == frozenset()
    # an honest behaviour frames nobody
    assert Chaos.parse("steer").behaviour().framer() is None


@pytest.mark.parametrize("method", ["mean", "trimmed-mean", "centered-clip"])
def test_a_biased_reducer_answers_a_fixed_direction_that_members_accept(method: str) -> None:
    """`--chaos bias` (issue 16, attack 8; not defended, docs/security.md): the reducer's answer
    is a fixed direction as long as the members' norm check allows, the same in every round;
    members accept it (what bench/hostile_swarm.py then measures in a swarm)."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(100, generator=gen) * 0.01 for _ in range(4)]
    bounds = [float(p.norm()) * 3 for p in parts]  # each member's whole δ is longer than its part
    aggregation = Aggregation(method=method)  # type: ignore[arg-type]
    answers = []
    for scale in (1.0, 2.0):
        received = [p * scale for p in parts]
        honest, _ = answer_part(received, [1.0] * 4, bounds, aggregation, "none", 100)
        biased, _ = answer_part(received, [1.0] * 4, bounds, aggregation, "none", 100, bias=True)
        _, mean = unpack_answer(honest, bounds, aggregation, "none", members=4, numel=100)
        _, steered = unpack_answer(biased, bounds, aggregation, "none", members=4, numel=100)
        assert float(steered.norm()) > 2 * float(mean.norm())  # and yet within the bound
        answers.append(steered)
    assert torch.equal(answers[0], answers[1])  # the same direction whatever came in
    assert Chaos.parse("bias").behaviour().biases() and not Behaviour().biases()
