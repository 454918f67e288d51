"""Two-stage averaging's rules (averaging/hierarchy.py) and certificates (certificate.py): which
groups a combine admits, with what weight, and what a replayed two-stage update must carry."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from diloco_peer.averaging.certificate import (
    CertificateError,
    GroupPart,
    Rules,
    Statement,
    delegate,
    open_seal,
    pack_groups,
    rival_claims,
    seal,
    unpack_groups,
    verify_update,
)
from diloco_peer.averaging.contribution import (
    ContributionHeader,
    Round,
    delta_digest,
    new_nonce,
)
from diloco_peer.averaging.hierarchy import (
    check_material,
    combine_key,
    combine_target,
    pack_material,
    screen_combine,
    stage_one_statement,
    two_stage,
)
from diloco_peer.identity import Identity

RUN, V, BASE, RESULT = "run1", 7, "a" * 64, "b" * 64
KEY = f"v{V}_{BASE[:16]}"
KEYS = [Identity.generate() for _ in range(6)]
SHAPES = "c" * 64


def delta(seed: int, scale: float = 0.01) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g) * scale, torch.randn(2, 3, generator=g) * scale]


def header(identity: Identity, d: list[torch.Tensor], **changes: Any) -> bytes:
    norm, digest = delta_digest(d)
    fields: dict[str, Any] = dict(
        run=RUN, peer=identity.peer_id_str, public_key=identity.public_key, key=KEY,
        version=V, state_hash=BASE, base_version=V, steps=10, samples=40, shards={1: 40},
        numel=12, shapes=SHAPES, norm=norm, digest=digest, nonce=new_nonce(), expected=6,
    )  # fmt: skip
    fields.update(changes)
    return ContributionHeader(**fields).sign(identity)


def mean(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(parts).mean(0) for parts in zip(*deltas, strict=True)]


RULES = Round(
    run=RUN, key=KEY, version=V, state_hash=BASE, numel=12, shapes=SHAPES, staleness_limit=2,
    norm_factor=4.0,
)  # fmt: skip


class Stage:
    """A stage-one group of `keys`: its headers, average, digest, delegate and the stage-one
    seals of its other members."""

    def __init__(self, keys: list[Identity], seed: int) -> None:
        self.keys = {k.peer_id_str: k for k in keys}
        self.deltas = {p: delta(seed + i) for i, p in enumerate(sorted(self.keys))}
        self.headers = {p: header(self.keys[p], d) for p, d in self.deltas.items()}
        self.members = tuple(sorted(self.keys))
        self.average = mean(list(self.deltas.values()))
        self.digest = delta_digest(self.average)[1]
        self.delegate = delegate(self.members, BASE)
        first = stage_one_statement(RUN, V, BASE, self.members, self.digest)
        self.seals = {p: seal(k, first) for p, k in self.keys.items() if p != self.delegate}

    def material(self, **changes: Any) -> bytes:
        args: dict[str, Any] = {"headers": self.headers, "seals": self.seals,
                                "digest": self.digest}  # fmt: skip
        args.update(changes)
        return pack_material(args["headers"], args["seals"], args["digest"])


@pytest.fixture(scope="module")
def stages() -> tuple[Stage, Stage]:
    return Stage(KEYS[:3], 0), Stage(KEYS[3:], 10)


def test_a_group_goes_to_a_combine_when_any_member_expects_more_than_it_holds() -> None:
    def h(expected: int) -> ContributionHeader:
        return ContributionHeader.verify_bytes(
            header(KEYS[0], delta(0), expected=expected), KEYS[0].peer_id_str
        )

    assert not two_stage({"a": h(4), "b": h(0)}, group_size=4)
    assert two_stage({"a": h(4), "b": h(5)}, group_size=4)
    assert combine_target({"a": h(9)}, group_size=4) == 3
    assert combine_target({"a": h(5)}, group_size=4) == 2
    assert combine_key(KEY) == KEY + "_c"


def test_every_member_and_verifier_names_the_same_delegate() -> None:
    members = tuple(k.peer_id_str for k in KEYS[:4])
    chosen = delegate(members, BASE)
    assert chosen in members
    assert delegate(tuple(reversed(members)), BASE) == chosen
    # another base names, in general, another member: the role moves around
    assert len({delegate(members, f"{i:064x}") for i in range(40)}) > 1


def test_two_groups_are_admitted_with_their_members_weights(stages: tuple[Stage, Stage]) -> None:
    a, b = stages
    gathered = {a.delegate: a.material(), b.delegate: b.material()}
    screening = screen_combine(gathered, RULES, allow=lambda p: True)
    assert screening.excluded == {}
    assert set(screening.accepted) == {a.delegate, b.delegate}
    assert screening.accepted[a.delegate].weight == 3.0  # uniform: one per member
    assert screening.accepted[b.delegate].part == GroupPart(b.members, b.digest)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda s: {"raw": b"not json"}, "not JSON"),
        (lambda s: {"raw": b"x" * 70_000}, "too large"),
        (lambda s: {"seals": {}}, "stage-one seal"),
        (lambda s: {"digest": "d" * 64}, "stage-one seal"),  # they sealed another average
        (lambda s: {"sender": next(p for p in s.members if p != s.delegate)}, "delegate"),
        (
            lambda s: {
                "headers": {
                    **s.headers,
                    s.delegate: header(s.keys[s.delegate], delta(99), key="v7_other"),
                }
            },
            "another round",
        ),  # fmt: skip
        (
            lambda s: {
                "headers": {
                    **s.headers,
                    s.delegate: header(s.keys[s.delegate], delta(99), base_version=1),
                }
            },
            "staler",
        ),  # fmt: skip
        (lambda s: {"headers": {s.delegate: s.headers[s.delegate]}, "seals": {}}, "two members"),
    ],
)
def test_a_delegates_material_that_breaks_a_rule_is_refused(
    stages: tuple[Stage, Stage], change: Any, reason: str
) -> None:
    s = stages[0]
    changed = change(s)
    sender = changed.pop("sender", s.delegate)
    raw = changed.pop("raw", None) or s.material(**changed)
    screening = screen_combine({sender: raw}, RULES, allow=lambda p: True)
    assert sender in screening.excluded and reason in screening.excluded[sender], screening


def test_a_member_claimed_by_two_groups_puts_both_out(stages: tuple[Stage, Stage]) -> None:
    """A hostile delegate that lists an honest member of another group (its signed header is
    no secret to the group that saw it) has no stage-one seal of that member for its group;
    a member that sealed two groups' statements (equivocation) takes both groups out."""
    a, b = stages
    stolen = next(p for p in b.members if p != b.delegate)
    forged = a.material(headers={**a.headers, stolen: b.headers[stolen]})
    screening = screen_combine({a.delegate: forged, b.delegate: b.material()}, RULES, lambda p: 1)
    assert list(screening.accepted) == [b.delegate]
    members = tuple(sorted((*a.members, stolen)))
    # the keys are random: the stolen member may hash below a's delegate and be the extended
    # group's delegate, and then a's delegate is refused as the wrong sender first
    stays = delegate(members, BASE) == a.delegate
    why = "stage-one seal" if stays else "not its group's delegate"
    assert why in screening.excluded[a.delegate], screening
    # the member seals a's extended group too: now both groups claim it
    keys = {**a.keys, stolen: b.keys[stolen]}
    sender = delegate(members, BASE)
    first = stage_one_statement(RUN, V, BASE, members, a.digest)
    equivocated = pack_material(
        {**a.headers, stolen: b.headers[stolen]},
        {p: seal(keys[p], first) for p in members if p != sender},
        a.digest,
    )
    screening = screen_combine({sender: equivocated, b.delegate: b.material()}, RULES,
                               lambda p: True)  # fmt: skip
    assert screening.accepted == {}
    assert all("shares" in why for why in screening.excluded.values()), screening


def test_the_allowlist_holds_in_the_combine(stages: tuple[Stage, Stage]) -> None:
    a, _ = stages
    outsider = a.members[0]
    with pytest.raises(Exception, match="may not contribute"):
        check_material(a.delegate, a.material(), RULES, allow=lambda p: p != outsider)


def two_stage_update(stages: tuple[Stage, Stage], **changes: Any) -> dict[str, Any]:
    """A valid certificate of the combination of both groups: verify_update's arguments."""
    a, b = stages
    headers = {**a.headers, **b.headers}
    members = tuple(sorted(headers))
    final = Statement(RUN, V, BASE, RESULT, members)
    seals = {**a.seals, **b.seals}
    seals[a.delegate] = seal(a.keys[a.delegate], final)
    seals[b.delegate] = seal(b.keys[b.delegate], final)
    args: dict[str, Any] = dict(
        base_version=V, base_hash=BASE, result_hash=RESULT, count=len(members),
        shard_samples={1: 40 * len(members)}, average=mean([a.average, b.average]),
        headers=headers, seals=seals, rules=Rules(run=RUN, staleness_limit=2, allow=lambda p: True),
        groups=(GroupPart(a.members, a.digest), GroupPart(b.members, b.digest)),
    )  # fmt: skip
    args.update(changes)
    return args


def test_a_two_stage_update_verifies_with_its_delegates_and_members_seals(
    stages: tuple[Stage, Stage],
) -> None:
    statement = verify_update(**two_stage_update(stages))
    assert statement.count == 6
    args = two_stage_update(stages)
    a, b = stages
    # a member's stage-one seal missing, or the delegate's final one, fails it
    member = next(iter(a.seals))
    with pytest.raises(CertificateError, match="no valid seal"):
        verify_update(**{**args, "seals": {k: v for k, v in args["seals"].items() if k != member}})
    # the final statement sealed by a non-delegate instead of its stage-one one
    final = Statement(RUN, V, BASE, RESULT, tuple(sorted(args["headers"])))
    with pytest.raises(CertificateError, match="no valid seal"):
        verify_update(**{**args, "seals": {**args["seals"], member: seal(a.keys[member], final)}})
    # groups that do not partition the members
    with pytest.raises(CertificateError, match="partition"):
        verify_update(**{**args, "groups": (args["groups"][0],)})
    with pytest.raises(CertificateError, match="partition"):
        verify_update(**{**args, "groups": (*args["groups"], args["groups"][0])})
    # without its groups, the members' stage-one seals are not seals of the update
    with pytest.raises(CertificateError, match="no valid seal"):
        verify_update(**{**args, "groups": None})


def test_a_one_group_update_must_be_its_groups_average_bit_for_bit(
    stages: tuple[Stage, Stage],
) -> None:
    """A combine nobody else joined: one delegate's seal, so its average must be the one its
    group's members sealed the digest of (one key's word never moves the state)."""
    a, _ = stages
    final = Statement(RUN, V, BASE, RESULT, a.members)
    seals = {**a.seals, a.delegate: seal(a.keys[a.delegate], final)}
    args: dict[str, Any] = dict(
        base_version=V, base_hash=BASE, result_hash=RESULT, count=3, shard_samples={1: 120},
        average=a.average, headers=a.headers, seals=seals,
        rules=Rules(run=RUN, staleness_limit=2, allow=lambda p: True),
        groups=(GroupPart(a.members, a.digest),),
    )  # fmt: skip
    assert verify_update(**args).count == 3
    with pytest.raises(CertificateError, match="not its group's"):
        verify_update(**{**args, "average": [t * 1.01 for t in a.average]})


def test_stage_one_seals_are_no_rival_claims(stages: tuple[Stage, Stage]) -> None:
    a, _ = stages
    ours = Statement(RUN, V, BASE, RESULT, a.members)
    first = stage_one_statement(RUN, V, BASE, a.members, a.digest)
    found = {p: seal(a.keys[p], first) for p in a.members}
    assert rival_claims(found, ours) == []
    opened = open_seal(found[a.members[0]], a.members[0])
    assert opened is not None and opened.stage_one and opened.result_hash == a.digest


def test_a_one_group_two_stage_commit_is_a_claim_backed_by_its_members_stage_one_seals(
    stages: tuple[Stage, Stage],
) -> None:
    """A delegate that committed its group alone seals the update by itself; the members'
    stage-one seals of that same group make it a group's claim, so that a combine committing
    on the same base later gives the version up instead of forking it."""
    a, b = stages
    boss = delegate(a.members, BASE)
    alone = Statement(RUN, V, BASE, RESULT, a.members)
    first = stage_one_statement(RUN, V, BASE, a.members, a.digest)
    found = {p: seal(a.keys[p], first) for p in a.members if p != boss}
    found[boss] = seal(a.keys[boss], alone)
    combined = Statement(RUN, V, BASE, "f" * 64, tuple(sorted(a.members + b.members)))
    assert rival_claims(found, combined) == [alone]
    # the delegate's seal alone, or beside stage-one seals of another group, is one key's word
    assert rival_claims({boss: found[boss]}, combined) == []
    other = stage_one_statement(RUN, V, BASE, b.members, b.digest)
    lone = {boss: found[boss], **{p: seal(b.keys[p], other) for p in b.members}}
    assert rival_claims(lone, combined) == []
    # a stage-one seal of that group on another base backs nothing
    elsewhere = stage_one_statement(RUN, V, "e" * 64, a.members, a.digest)
    shifted = {boss: found[boss], **{p: seal(a.keys[p], elsewhere) for p in a.members if p != boss}}
    assert rival_claims(shifted, combined) == []
    # and our own one-group commit is never our rival
    assert rival_claims(found, alone) == []


def test_groups_round_trip_and_garbage_is_refused(stages: tuple[Stage, Stage]) -> None:
    a, b = stages
    groups = (GroupPart(a.members, a.digest), GroupPart(b.members, b.digest))
    assert unpack_groups(pack_groups(groups)) == groups
    assert unpack_groups(None) is None
    unsorted = json.dumps([{"members": list(reversed(a.members)), "digest": a.digest}])
    for bad in (5, "", "[]", "{}", "not json", '[{"members": []}]', unsorted,
                json.dumps([{"members": ["x!"], "digest": a.digest}])):  # fmt: skip
        with pytest.raises(CertificateError):
            unpack_groups(bad)
