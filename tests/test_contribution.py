"""Signed contribution headers and the group screening built on them (averaging/contribution.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_peer.averaging.contribution import (
    BanList,
    ContributionHeader,
    ContributionRejected,
    NonceMemory,
    Round,
    delta_digest,
    new_nonce,
    screen_group,
    shapes_digest,
)
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
    ("changes", "reason"),
    [
        ({"version": 4}, "another round"),
        ({"key": "v4_" + HASH[:16]}, "another round"),
        ({"state_hash": "cd" * 32}, "another state"),
        ({"base_version": 2}, "stale"),
        ({"base_version": 6}, "ahead"),
        ({"numel": 15}, "wrong shape"),
        ({"shapes": "00" * 32}, "wrong shape"),
        ({"run": "run2"}, "another round"),
        ({"norm": 100.0}, "above 4 x median"),
    ],
)
def test_a_contribution_outside_the_round_is_excluded(changes: dict, reason: str) -> None:
    honest = [header(k) for k in KEYS[:3]]
    bad = header(KEYS[3], **changes)
    screening = screen_group(gathered(*honest, bad), ROUND)
    assert list(screening.excluded) == [bad.peer]
    assert reason in screening.excluded[bad.peer]
    assert sorted(screening.accepted) == sorted(h.peer for h in honest)


def test_forged_and_garbage_headers_are_excluded() -> None:
    honest = [header(k) for k in KEYS[:3]]
    data = gathered(*honest)
    data[KEYS[3].peer_id_str] = header(KEYS[3]).sign(KEYS[4])  # signed with someone else's key
    data[KEYS[4].peer_id_str] = b"\x00garbage"
    screening = screen_group(data, ROUND)
    assert set(screening.excluded) == {KEYS[3].peer_id_str, KEYS[4].peer_id_str}
    assert "signature" in screening.excluded[KEYS[3].peer_id_str]


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
    # one hostile voter cannot ban an honest peer
    headers = [header(k) for k in KEYS[:4]] + [header(KEYS[4], bans=(KEYS[0].peer_id_str,))]
    assert screen_group(gathered(*headers), ROUND).excluded == {}


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
