"""Signed contribution headers and the group screening built on them (averaging/contribution.py),
and the marks they carry (averaging/marks.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_peer.averaging.contribution import (
    SAMPLES_BOUND_PHASES,
    SAMPLES_WEIGHT_CAP,
    STEPS_NORM_CAP,
    ContributionHeader,
    ContributionRejected,
    Limits,
    NonceMemory,
    Round,
    delta_digest,
    group_weights,
    new_nonce,
    norm_outliers,
    screen_group,
    shapes_digest,
)
from diloco_peer.averaging.marks import BanList, Silence
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.identity import Identity

KEYS = [Identity.generate() for _ in range(5)]
HASH = "ab" * 32
SHAPES = shapes_digest([(4, 3), (2,)])
ROUND = Round(
    run="run1", key="v5_" + HASH[:16], version=5, state_hash=HASH, numel=14, shapes=SHAPES,
    staleness_limit=2, norm_factor=4.0,
)  # fmt: skip


def header(identity: Identity, **changes: object) -> ContributionHeader:
    base = ContributionHeader(
        run="run1", peer=identity.peer_id_str, public_key=identity.public_key, key=ROUND.key,
        version=5, state_hash=HASH, base_version=5, steps=50, samples=400, shards={0: 400},
        numel=14, shapes=SHAPES, norm=1.0, digest="00" * 32, nonce=new_nonce(),
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def gathered(*headers: ContributionHeader, signers: list[Identity] | None = None) -> dict:
    signers = signers or [next(k for k in KEYS if k.peer_id_str == h.peer) for h in headers]
    return {h.peer: h.sign(s) for h, s in zip(headers, signers, strict=True)}


def test_a_signed_header_round_trips_and_binds_the_sender() -> None:
    h = header(KEYS[0], bans=(KEYS[1].peer_id_str,))
    data = h.sign(KEYS[0])
    assert ContributionHeader.verify_bytes(data, KEYS[0].peer_id_str) == h
    with pytest.raises(ContributionRejected, match="not the sender"):
        ContributionHeader.verify_bytes(data, KEYS[1].peer_id_str)


def test_a_header_signed_by_another_key_or_altered_is_rejected() -> None:
    h = header(KEYS[0])
    with pytest.raises(ContributionRejected, match="signature"):
        ContributionHeader.verify_bytes(h.sign(KEYS[1]), KEYS[0].peer_id_str)
    envelope = json.loads(h.sign(KEYS[0]))
    envelope["header"] = envelope["header"].replace('"steps":50', '"steps":5000')
    with pytest.raises(ContributionRejected, match="signature"):
        ContributionHeader.verify_bytes(json.dumps(envelope).encode(), KEYS[0].peer_id_str)


def test_delta_digest_is_the_norm_and_sha256_of_the_values() -> None:
    norm, digest = delta_digest([torch.tensor([3.0, 0.0]), torch.tensor([4.0])])
    assert norm == pytest.approx(5.0)
    assert digest != delta_digest([torch.tensor([3.0, 0.0]), torch.tensor([4.5])])[1]


def test_honest_members_are_all_admitted() -> None:
    headers = [header(k, norm=1.0 + i / 10) for i, k in enumerate(KEYS[:4])]
    screening = screen_group(gathered(*headers), ROUND)
    assert sorted(screening.accepted) == sorted(h.peer for h in headers)
    assert screening.excluded == {}


@pytest.mark.parametrize(
    ("changes", "reason", "banned"),
    [
        # signed for another round: possibly a replay by the leader, so no ban
        ({"version": 4}, "another round", False),
        ({"key": "v4_" + HASH[:16]}, "another round", False),
        ({"state_hash": "cd" * 32}, "another state", False),
        ({"run": "run2"}, "another round", False),
        # signed for this very round and breaking a rule: evidence the member signed
        ({"base_version": 2}, "stale", True),
        ({"base_version": 6}, "ahead", True),
        ({"numel": 15}, "wrong shape", True),
        ({"shapes": "00" * 32}, "wrong shape", True),
        ({"norm": 100.0}, "above 4 x median", True),
    ],
)
def test_a_contribution_outside_the_round_is_excluded(
    changes: dict, reason: str, banned: bool
) -> None:
    honest = [header(k) for k in KEYS[:3]]
    bad = header(KEYS[3], **changes)
    screening = screen_group(gathered(*honest, bad), ROUND)
    assert list(screening.excluded) == [bad.peer]
    assert reason in screening.excluded[bad.peer]
    assert sorted(screening.accepted) == sorted(h.peer for h in honest)
    assert screening.banned == ({bad.peer} if banned else set())


def test_a_long_delta_that_its_steps_explain_is_admitted() -> None:
    """Seen in a real async swarm (heterogeneity very, warm-up 50): DyLU gave the fast peer about
    50 steps and the others 18 and 7, and its δ, 4.6 x the group's median norm, was excluded and
    banned for 10 versions. Per step it is within the bound, so it is admitted; the short δ is
    never excluded for being short."""
    fast = header(KEYS[0], steps=50, norm=3.514)
    mid = header(KEYS[1], steps=18, norm=0.7667)
    slow = header(KEYS[2], steps=7, norm=0.186)
    screening = screen_group(gathered(fast, mid, slow), ROUND)
    assert screening.excluded == {} and screening.banned == frozenset()
    assert norm_outliers({"a": fast, "b": mid, "c": slow}, 4.0) == {}


def test_claiming_more_steps_buys_a_liar_at_most_the_steps_cap() -> None:
    """A liar's claimed steps count only up to STEPS_NORM_CAP x the group's low median: its
    allowance is norm_factor x STEPS_NORM_CAP x the median per step, however many it claims."""
    honest = [header(k, steps=50, norm=1.0) for k in KEYS[:3]]
    bound = 4.0 * STEPS_NORM_CAP  # x the median norm, for a liar claiming the most steps
    for steps in (101, 1000, 10**6):
        inside = header(KEYS[3], steps=steps, norm=0.99 * bound)
        assert screen_group(gathered(*honest, inside), ROUND).excluded == {}
        outside = header(KEYS[3], steps=steps, norm=1.01 * bound)
        screening = screen_group(gathered(*honest, outside), ROUND)
        assert list(screening.excluded) == [outside.peer]
        assert "above 4 x median" in screening.excluded[outside.peer]
        assert screening.banned == {outside.peer}
    # a δ of the others' steps gets no more room than it always had
    equal = header(KEYS[3], steps=50, norm=4.01)
    assert list(screen_group(gathered(*honest, equal), ROUND).excluded) == [equal.peer]


def test_forged_and_garbage_headers_are_excluded_and_never_banned() -> None:
    """Issue 16, item 3: the leader alone says what each member sent. A victim listed with
    garbage, or with a header it did not sign, is kept out of the round but not banned: the
    leader could have made those bytes up."""
    honest = [header(k) for k in KEYS[:3]]
    data = gathered(*honest)
    data[KEYS[3].peer_id_str] = header(KEYS[3]).sign(KEYS[4])  # signed with someone else's key
    data[KEYS[4].peer_id_str] = b"\x00garbage"
    screening = screen_group(data, ROUND)
    assert set(screening.excluded) == {KEYS[3].peer_id_str, KEYS[4].peer_id_str}
    assert "signature" in screening.excluded[KEYS[3].peer_id_str]
    assert screening.banned == frozenset()


def test_allowlist_and_replay_memory_exclude() -> None:
    honest = [header(k) for k in KEYS[:3]]
    stranger, replayer = header(KEYS[3]), header(KEYS[4])
    memory = NonceMemory()
    memory.remember({replayer.peer: replayer})
    screening = screen_group(
        gathered(*honest, stranger, replayer), ROUND,
        allow=lambda p: p != stranger.peer, seen=memory.seen,
    )  # fmt: skip
    assert "allowlist" in screening.excluded[stranger.peer]
    assert "replayed" in screening.excluded[replayer.peer]


def test_a_peer_banned_by_most_others_is_excluded_by_everyone() -> None:
    target = KEYS[4].peer_id_str
    headers = [header(k, bans=(target,)) for k in KEYS[:3]] + [header(KEYS[3]), header(KEYS[4])]
    screening = screen_group(gathered(*headers), ROUND)
    assert list(screening.excluded) == [target]  # 3 of 4 others ban it
    assert screening.banned == frozenset()  # their word: it excludes, never renews a ban
    # one hostile voter cannot ban an honest peer
    headers = [header(k) for k in KEYS[:4]] + [header(KEYS[4], bans=(KEYS[0].peer_id_str,))]
    assert screen_group(gathered(*headers), ROUND).excluded == {}


def test_a_peer_named_silent_by_most_others_is_left_out_of_the_retry() -> None:
    """Issue 16, item 4: the members that waited in vain for a member's parts name it in their
    next headers; named by more than half of the others, it is excluded (not banned)."""
    target = KEYS[4].peer_id_str
    headers = [header(k, silent=(target,)) for k in KEYS[:3]] + [header(KEYS[3]), header(KEYS[4])]
    screening = screen_group(gathered(*headers), ROUND)
    assert list(screening.excluded) == [target]
    assert "named silent by 3 of 4" in screening.excluded[target]
    assert screening.banned == frozenset()
    headers = [header(k) for k in KEYS[:3]] + [header(KEYS[3], silent=(target,)), header(KEYS[4])]
    assert screen_group(gathered(*headers), ROUND).excluded == {}  # one voice is not enough


def test_weights_come_from_the_signed_headers_and_samples_are_capped() -> None:
    """Issue 16, item 2: a weight is no free number. uniform: 1 each; samples: the declared
    samples, at most SAMPLES_WEIGHT_CAP x the group's median."""
    honest = [header(k, samples=400) for k in KEYS[:3]]
    greedy = header(KEYS[3], samples=10**12, shards={0: 10**12})  # within a bound of 0 (none)
    data = gathered(*honest, greedy)
    uniform = screen_group(data, ROUND)
    assert uniform.weights == {h.peer: 1.0 for h in [*honest, greedy]}
    by_samples = screen_group(data, dataclasses.replace(ROUND, weighting="samples"))
    assert by_samples.weights[greedy.peer] == SAMPLES_WEIGHT_CAP * 400
    assert all(by_samples.weights[h.peer] == 400.0 for h in honest)
    weights = group_weights({"a": header(KEYS[0], samples=0)}, "samples")
    assert weights == {"a": 1.0}  # positive, always
    mixed = {f"p{i}": header(KEYS[0], samples=n) for i, n in enumerate([100, 300, 500])}
    assert group_weights(mixed, "samples") == {"p0": 100.0, "p1": 300.0, "p2": 500.0}


def test_samples_must_add_up_and_fit_what_one_delta_can_hold() -> None:
    """Shard counters of 1e15 (issue 16): a header's samples are the sum of its shards and at
    most `Limits.max_samples` (batch x H x phases x staleness); either lie is signed: a ban."""
    bound = Limits.of(
        RunSpec(batch_size=8, inner_steps=50), SwarmSettings(staleness_limit=2)
    ).max_samples
    assert bound == 8 * 50 * SAMPLES_BOUND_PHASES * 3
    rnd = dataclasses.replace(ROUND, limits=Limits(max_samples=bound))
    honest = [header(k) for k in KEYS[:2]]
    padded = header(KEYS[2], samples=400, shards={0: 10**15})
    huge = header(KEYS[3], samples=10**15, shards={0: 10**15})
    screening = screen_group(gathered(*honest, padded, huge), rnd)
    assert set(screening.accepted) == {h.peer for h in honest}
    assert "sum of its shards" in screening.excluded[padded.peer]
    assert "more than one δ can hold" in screening.excluded[huge.peer]
    assert {padded.peer, huge.peer} <= set(screening.banned)


def test_a_norm_beyond_what_its_steps_can_move_is_a_signed_lie() -> None:
    """No history needed (issue 16: a lone δ x 1000, honestly declared, passed at version 1):
    AdamW moves a value at most ADAM_STEP_MAX x lr per step, so a δ of `steps` steps over
    `numel` values is at most ADAM_STEP_MAX x lr x steps x sqrt(numel) long."""
    limits = Limits.of(RunSpec(inner_lr=1e-3, inner_steps=50), SwarmSettings(staleness_limit=2))
    bound = limits.max_norm(50, 14)
    assert bound == pytest.approx(4.0 * 1e-3 * 50 * 14**0.5)
    rnd = dataclasses.replace(ROUND, limits=limits)
    honest = [header(k, norm=0.1 * bound) for k in KEYS[:2]]
    long = header(KEYS[2], norm=1.01 * bound)
    busy = header(KEYS[3], steps=limits.max_steps + 1, norm=0.1 * bound)
    screening = screen_group(gathered(*honest, long, busy), rnd)
    assert set(screening.accepted) == {h.peer for h in honest}
    assert "steps can move" in screening.excluded[long.peer]
    assert "more than one δ can hold" in screening.excluded[busy.peer]
    assert {long.peer, busy.peer} <= set(screening.banned)


def test_silence_marks_hold_then_expire_and_repeats_hold_longer() -> None:
    silence = Silence(hold_s=10.0, max_hold_s=40.0)
    assert silence.name(["QmA"], now=100.0) == {"QmA": 110.0}
    assert silence.for_header(105.0) == ("QmA",) and silence.for_header(110.0) == ()
    assert silence.name(["QmA"], now=115.0) == {"QmA": 135.0}  # again soon after: twice
    assert silence.name(["QmA"], now=140.0) == {"QmA": 180.0}
    assert silence.name(["QmA"], now=190.0) == {"QmA": 230.0}  # capped at max_hold_s
    assert silence.name(["QmA"], now=1000.0) == {"QmA": 1010.0}  # long forgiven: one hold


def test_bans_expire_and_headers_carry_the_most_recent() -> None:
    bans = BanList(ban_rounds=3)
    bans.ban("Qm1", "nan", version=5)
    assert "Qm1" in bans.active(7) and bans.active(8) == {}
    for v in range(100):
        bans.ban(f"Qm{v + 100}", "x", version=10 + v // 50)
    assert len(bans.for_header(11)) == 64
    assert bans.total == 101


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_are_a_clean_rejection(data: bytes) -> None:
    with pytest.raises(ContributionRejected):
        ContributionHeader.verify_bytes(data, KEYS[0].peer_id_str)


_SIGNED = header(KEYS[0]).sign(KEYS[0])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(_SIGNED) - 1), st.integers(1, 255))
def test_any_flipped_byte_of_a_signed_header_is_rejected(index: int, flip: int) -> None:
    data = bytearray(_SIGNED)
    data[index] ^= flip
    with pytest.raises(ContributionRejected):
        ContributionHeader.verify_bytes(bytes(data), KEYS[0].peer_id_str)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(header(KEYS[0]).to_dict())), _JSON)
def test_any_field_replaced_by_arbitrary_json_is_rejected_or_valid(
    name: str, value: object
) -> None:
    doc = header(KEYS[0]).to_dict()
    doc[name] = value
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    envelope = {"header": canonical.decode(), "signature": ""}
    with pytest.raises(ContributionRejected):  # unsigned, so never accepted
        ContributionHeader.verify_bytes(json.dumps(envelope).encode(), KEYS[0].peer_id_str)
