"""The attacks of issue 16 as chaos modes (peer/chaos.py, peer/hostile.py), each against the rule
that must stop it, without the network. bench/hostile_swarm.py runs them as real processes."""

from __future__ import annotations

import math
import time

import pytest
import torch

from diloco_peer.averaging.certificate import CertificateError
from diloco_peer.averaging.contribution import Limits
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free.manifest import Manifest
from diloco_peer.coordinator_free.records import PeerHead, choose_manifest
from diloco_peer.coordinator_free.swarm_view import SPEED_CAP, HeadBook, SwarmView
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import ConfigError
from diloco_peer.identity import Identity
from diloco_peer.peer import hostile
from diloco_peer.peer.certify import Certifier
from diloco_peer.peer.chaos import Chaos, Steers
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
