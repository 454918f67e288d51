"""Commit certificates (averaging/certificate.py): every rule a replayed update must pass, each
shown to refuse what breaks it; seals in a real DHT (coordinator_free/seals.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_peer.averaging.certificate import (
    VOID,
    CertificateError,
    Rules,
    Statement,
    open_seal,
    pack_headers,
    rival_claims,
    seal,
    seal_verifies,
    unpack_headers,
    verify_update,
)
from diloco_peer.averaging.contribution import ContributionHeader, delta_digest, new_nonce
from diloco_peer.identity import Identity

RUN, V, BASE, RESULT = "run1", 7, "a" * 64, "b" * 64
KEYS = [Identity.generate() for _ in range(3)]
HOSTILE = Identity.generate()


def delta(seed: int, scale: float = 0.01) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g) * scale, torch.randn(2, 3, generator=g) * scale]


def header(identity: Identity, d: list[torch.Tensor], **changes: Any) -> bytes:
    norm, digest = delta_digest(d)
    fields: dict[str, Any] = dict(
        run=RUN, peer=identity.peer_id_str, public_key=identity.public_key, key=f"v{V}_aaaa",
        version=V, state_hash=BASE, base_version=V, steps=10, samples=40, shards={1: 40},
        numel=12, shapes="c" * 64, norm=norm, digest=digest, nonce=new_nonce(),
    )  # fmt: skip
    fields.update(changes)
    return ContributionHeader(**fields).sign(identity)


def mean(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(parts).mean(0) for parts in zip(*deltas, strict=True)]


def group(keys: list[Identity] = KEYS, **changes: Any) -> dict[str, Any]:
    """A valid certificate of a group of `keys`: the verify_update arguments."""
    deltas = [delta(i) for i in range(len(keys))]
    headers = {k.peer_id_str: header(k, d) for k, d in zip(keys, deltas, strict=True)}
    members = tuple(sorted(headers))
    statement = Statement(RUN, V, BASE, RESULT, members)
    args: dict[str, Any] = dict(
        base_version=V, base_hash=BASE, result_hash=RESULT, count=len(keys),
        shard_samples={1: 40 * len(keys)}, average=mean(deltas), headers=headers,
        seals={k.peer_id_str: seal(k, statement) for k in keys},
        rules=Rules(run=RUN, staleness_limit=2, allow=lambda peer: True),
    )  # fmt: skip
    args.update(changes)
    return args


def test_a_valid_group_certificate_verifies() -> None:
    statement = verify_update(**group())
    assert statement.count == 3 and statement.result_hash == RESULT


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda a: {"count": 2}, "counts 2 members"),
        (lambda a: {"result_hash": "c" * 64}, "no valid seal"),  # they sealed another result
        (lambda a: {"base_hash": "d" * 64}, "another version or state"),
        (lambda a: {"base_version": V + 1}, "another version or state"),
        (lambda a: {"shard_samples": {1: 10**15}}, "samples per shard"),
        (lambda a: {"average": [t * 10 for t in a["average"]]}, "exceeds its members"),
        (lambda a: {"seals": dict(list(a["seals"].items())[1:])}, "no valid seal"),
        (lambda a: {"rules": dataclasses.replace(a["rules"], run="other")}, "another run"),
        (lambda a: {"rules": dataclasses.replace(a["rules"], allow=lambda p: False)}, "may not"),
        (
            lambda a: {"rules": dataclasses.replace(a["rules"], recent_norms=[1e-6] * 5)},
            "recent updates' median",
        ),
    ],
)
def test_each_rule_refuses_what_breaks_it(change: Any, reason: str) -> None:
    args = group()
    with pytest.raises(CertificateError, match=reason):
        verify_update(**{**args, **change(args)})


def test_a_seal_by_another_key_or_of_another_statement_is_refused() -> None:
    args = group()
    a, b = KEYS[0].peer_id_str, KEYS[1].peer_id_str
    swapped = {**args["seals"], a: args["seals"][b]}  # b's seal filed under a
    with pytest.raises(CertificateError, match="no valid seal"):
        verify_update(**{**args, "seals": swapped})
    other = Statement(RUN, V, BASE, RESULT, (a,))
    with pytest.raises(CertificateError, match="no valid seal"):
        verify_update(**{**args, "seals": {**args["seals"], a: seal(KEYS[0], other)}})


def test_a_header_signed_by_someone_else_or_stale_is_refused() -> None:
    args = group()
    a = KEYS[0].peer_id_str
    forged = {**args["headers"], a: header(HOSTILE, delta(0))}  # the hostile key's header
    with pytest.raises(CertificateError, match="header of"):
        verify_update(**{**args, "headers": forged})
    stale = {**args["headers"], a: header(KEYS[0], delta(0), base_version=V - 3)}
    with pytest.raises(CertificateError, match="staler"):
        verify_update(**{**args, "headers": stale})


def test_a_lone_commit_must_apply_exactly_the_delta_its_header_names() -> None:
    """One signature is one key's word: the average must be its signed δ, which the norm
    screens bound (issue 16: θ moved from 0.013 to -66.5 by a made-up update)."""
    mine = delta(5)
    args = group([HOSTILE], average=mine)
    args["headers"] = {HOSTILE.peer_id_str: header(HOSTILE, mine)}
    statement = Statement(RUN, V, BASE, RESULT, (HOSTILE.peer_id_str,))
    args["seals"] = {HOSTILE.peer_id_str: seal(HOSTILE, statement)}
    args["shard_samples"] = {1: 40}
    assert verify_update(**args).count == 1
    with pytest.raises(CertificateError, match="lone commit"):
        verify_update(**{**args, "average": [t + 1e-3 for t in mine]})
    # a huge lone δ, honestly declared, is stopped by the history screen
    huge = [t * 1e4 for t in mine]
    args["headers"] = {HOSTILE.peer_id_str: header(HOSTILE, huge)}
    recent = [math.sqrt(sum(float(t.square().sum()) for t in delta(i))) for i in range(5)]
    rules = dataclasses.replace(args["rules"], recent_norms=recent)
    with pytest.raises(CertificateError, match="median"):
        verify_update(**{**args, "average": huge, "rules": rules})


def test_a_lone_commit_longer_than_its_steps_allow_is_refused_without_history() -> None:
    """The hostile bench's hijack-lone=1000: a lone δ x 1000 under a truthful header, replayed
    at version 1 where no history screens it; the run's limits do (`Limits.max_norm`)."""
    from diloco_peer.averaging.contribution import Limits

    huge = [t * 1000 for t in delta(5, scale=0.001)]
    args = group([HOSTILE], average=huge, shard_samples={1: 40})
    args["headers"] = {HOSTILE.peer_id_str: header(HOSTILE, huge)}
    statement = Statement(RUN, V, BASE, RESULT, (HOSTILE.peer_id_str,))
    args["seals"] = {HOSTILE.peer_id_str: seal(HOSTILE, statement)}
    assert verify_update(**args).count == 1  # no limits: nothing refuses it
    limits = Limits(max_samples=10**6, max_steps=1000, inner_lr=1e-3)  # 10 steps: <= 0.14
    rules = dataclasses.replace(args["rules"], limits=limits)
    with pytest.raises(CertificateError, match="steps can move"):
        verify_update(**{**args, "rules": rules})
    honest = delta(5, scale=0.001)
    args["headers"] = {HOSTILE.peer_id_str: header(HOSTILE, honest)}
    assert verify_update(**{**args, "average": honest, "rules": rules}).count == 1


def test_headers_round_trip_and_garbage_is_refused() -> None:
    headers = group()["headers"]
    assert unpack_headers(pack_headers(headers)) == headers
    for bad in (None, "", "[]", "{}", '{"a": 1}', "not json", "{" * 10000):
        with pytest.raises(CertificateError):
            unpack_headers(bad)


def test_another_groups_claim_on_our_base_is_a_rival_one_keys_is_not() -> None:
    """Issue 15, one version one group: the seals under a base version tell a group whether
    another group committed on the same base. Only a claim two or more of its members sealed
    counts; voids, garbage, seals filed under another signer and other bases do not."""
    a, b, c = KEYS
    ours = Statement(RUN, V, BASE, RESULT, tuple(sorted((a.peer_id_str, b.peer_id_str))))
    theirs = Statement(RUN, V, BASE, "e" * 64, tuple(sorted((c.peer_id_str, HOSTILE.peer_id_str))))
    lone = Statement(RUN, V, BASE, "d" * 64, (HOSTILE.peer_id_str,))
    found = {a.peer_id_str: seal(a, ours), b.peer_id_str: seal(b, ours)}
    assert rival_claims(found, ours) == []  # our own group
    found[HOSTILE.peer_id_str] = seal(HOSTILE, lone)
    assert rival_claims(found, ours) == []  # one key's word is no group's
    found[c.peer_id_str] = seal(c, theirs)
    found[HOSTILE.peer_id_str] = seal(HOSTILE, theirs)
    assert rival_claims(found, ours) == [theirs]
    # a void, or a seal filed under a signer that did not make it, is nobody's claim
    assert rival_claims({**found, c.peer_id_str: VOID}, ours) == []
    assert rival_claims({**found, c.peer_id_str: seal(a, theirs)}, ours) == []
    # a claim on another base (another branch of a fork) is no rival
    other_base = Statement(RUN, V, "9" * 64, "e" * 64, theirs.members)
    moved = {c.peer_id_str: seal(c, other_base), HOSTILE.peer_id_str: seal(HOSTILE, other_base)}
    assert rival_claims(moved, ours) == []
    assert open_seal(seal(c, theirs), c.peer_id_str) == theirs
    assert open_seal(seal(c, theirs), a.peer_id_str) is None


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.text(max_size=600).map(str.encode)))
def test_any_bytes_as_a_seal_are_only_refused(data: bytes) -> None:
    statement = Statement(RUN, V, BASE, RESULT, (KEYS[0].peer_id_str,))
    assert seal_verifies(data, statement, KEYS[0].public_key) is False
    assert open_seal(data, KEYS[0].peer_id_str) is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_any_text_as_headers_is_parsed_or_refused(text: str) -> None:
    try:
        unpack_headers(text)
    except CertificateError:
        pass


def test_seals_round_trip_through_a_real_dht() -> None:
    """Each member's seal under its own key; a reader gets them by signer."""
    from hivemind.dht import DHT

    from diloco_peer.coordinator_free import records, seals

    a, b = KEYS[0], KEYS[1]
    first = DHT(start=True, record_validators=records.record_validators(a, RUN),
                host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # fmt: skip
    second = DHT(start=True, record_validators=records.record_validators(b, RUN),
                 initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # fmt: skip
    try:
        statement = Statement(RUN, V, BASE, RESULT, (a.peer_id_str, b.peer_id_str))
        for dht, key in ((first, a), (second, b)):
            assert seals.publish_seal(dht, key, RUN, V, seal(key, statement),
                                      expiration_s=60, timeout_s=20)  # fmt: skip
        found = seals.read_seals(first, RUN, V, timeout_s=20)
        assert set(found) == {a.peer_id_str, b.peer_id_str}
        assert all(seal_verifies(found[k.peer_id_str], statement, k.public_key) for k in (a, b))
        assert seals.read_seals(second, RUN, V + 1, timeout_s=20) == {}
        # a group that gave its version up withdraws its seal: the void replaces it
        assert seals.publish_seal(first, a, RUN, V, VOID, expiration_s=60, timeout_s=20)
        found = seals.read_seals(second, RUN, V, timeout_s=20)
        assert found[a.peer_id_str] == VOID and rival_claims(found, statement) == []
    finally:
        second.shutdown()
        first.shutdown()


def test_of_two_groups_on_one_base_the_later_sees_the_earlier_and_gives_way() -> None:
    """The rule as peers run it (peer/certify.py `Certifier`), over a real DHT: group A's
    members seal and find no rival (they commit); group B's members seal after and find A's
    claim (they give the version up, void their seals); a retry on the same base later sees A's
    claim only, never B's withdrawn one."""
    from hivemind.dht import DHT

    from diloco_peer.config import SwarmSettings
    from diloco_peer.coordinator_free import records
    from diloco_peer.coordinator_free.update_log import UpdateRecord
    from diloco_peer.peer.certify import Certifier
    from diloco_peer.peer.trust import Guard

    a1, a2, b1, b2 = KEYS[0], KEYS[1], KEYS[2], HOSTILE
    first = DHT(start=True, record_validators=records.record_validators(a1, RUN),
                host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # fmt: skip
    nodes = [first] + [
        DHT(start=True, record_validators=records.record_validators(k, RUN),
            initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for k in (a2, b1, b2)
    ]  # fmt: skip
    try:
        certifiers = {
            k.peer_id_str: Certifier(lambda n=n: n, Guard(k, RUN, SwarmSettings()),
                                     recent_norms=lambda: [])
            for k, n in zip((a1, a2, b1, b2), nodes, strict=True)
        }  # fmt: skip

        def record(members: tuple[Identity, ...], result: str) -> UpdateRecord:
            headers = {k.peer_id_str: b"{}" for k in members}
            return UpdateRecord(base_version=V, base_hash=BASE, result_hash=result, count=2,
                                shard_samples={}, average=(torch.zeros(3),),
                                info={"headers": pack_headers(headers)})  # fmt: skip

        made_by_a, made_by_b = record((a1, a2), "1" * 64), record((b1, b2), "2" * 64)
        for k in (a1, a2):
            certifiers[k.peer_id_str].seal(made_by_a)
        assert all(certifiers[k.peer_id_str].rivals(made_by_a) == [] for k in (a1, a2))
        for k in (b1, b2):
            certifiers[k.peer_id_str].seal(made_by_b)
        for k in (b1, b2):
            (rival,) = certifiers[k.peer_id_str].rivals(made_by_b)
            assert rival.result_hash == "1" * 64
            certifiers[k.peer_id_str].void(made_by_b)
        retry = record((b1, b2), "3" * 64)
        for k in (b1, b2):
            certifiers[k.peer_id_str].seal(retry)
        assert [r.result_hash for r in certifiers[b1.peer_id_str].rivals(retry)] == ["1" * 64]
    finally:
        for node in reversed(nodes):
            node.shutdown()
