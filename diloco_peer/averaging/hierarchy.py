"""Two-stage averaging (issue 19, DESIGN §3): several groups at one version, one update.

    if two_stage(headers, group_size):            # some member's round waits for more peers
        chosen = delegate(group, base_hash)       # certificate.delegate: the same on every member
        material = pack_material(headers, stage_one_seals, digest)  # the delegate's gather
        combined = averager.average(combine_key(key), group_average, gather=material,
                                    target_size=combine_target(headers, group_size),
                                    admit=combine_admission(...), ...)

1. Stage one is the round as it always was: peers at base (v, h) form groups of at most
   `group_size` under the key `v{v}_{h16}` and all-reduce their δ. Each member's signed header
   says how many peers its round waits for (`expected`); when no admitted member's exceeds the
   group size, the group commits v+1 alone, as before.
2. Otherwise each member that is not the group's delegate seals a stage-one statement (its
   group, the digest of the group's average) and waits; the delegate takes the group's average
   to a combine group under `combine_key` with its group's material as its gathered bytes: the
   members' signed headers and stage-one seals. The delegates all-reduce the group averages,
   each weighted by its group's total weight, and commit v+1: their seals, the members' headers
   and seals, and the groups (`certificate.GroupPart`) are its certificate. The other members
   replay it (one update each, as a peer catching up does), and find their δ in it or not.
3. A combine that nobody else joins in time commits the delegate's group alone (its average,
   bit for bit, which its members sealed). A group whose delegate dies, whose combine fails, or
   that another combine's commit beats (the seal rule, peer/round.py) costs only its members'
   δs at that version: they keep them for the next round, as a failed group's members do.

Admission to the combine (`screen_combine`, the same on every honest delegate): each delegate's
material must be its group's: every header signed by its member, for this run, version, state
and round key, within the staleness limit and the run's limits, on the allowlist; every member
other than the delegate sealed the stage-one statement of exactly this group and digest; the
sender is the group's delegate. A member claimed by two groups (it sealed two stage-one
statements, or a delegate lists a member of another group) puts both groups out. A group's
weight is the sum of its members' weights (`contribution.group_weights`), never a number the
delegate chooses; its average is bounded by its members' declared norms.

Pure: no network, no clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from diloco_peer.averaging.certificate import (
    NORM_SLACK,
    GroupPart,
    Statement,
    delegate,
    seal_verifies,
)
from diloco_peer.averaging.contribution import (
    ContributionHeader,
    ContributionRejected,
    Round,
    claim_lie,
    group_weights,
)

MAX_MATERIAL_BYTES = 64 * 1024
"""A delegate's gathered bytes (GroupAverager's gather limit): about 2.3 kB a member."""
_HEX64_LEN = 64


def two_stage(headers: Mapping[str, ContributionHeader], group_size: int) -> bool:
    """Whether a stage-one group goes on to a combine: some admitted member's round waits for
    more peers than one group holds. A member that inflates its count only costs the group the
    combine's wait (a combine nobody joins commits the group's average alone)."""
    return any(h.expected > group_size for h in headers.values())


def combine_target(headers: Mapping[str, ContributionHeader], group_size: int) -> int:
    """How many groups a combine waits for: the most any member expects, in full groups."""
    most = max((h.expected for h in headers.values()), default=0)
    return max(2, math.ceil(most / max(group_size, 1)))


LATE_SLACK_S = 3.0
"""What a late group's delegate needs besides its all-reduce to join a combine: its members'
seals, the combine's matchmaking."""


def combine_window(window_s: float, allreduce_s: float, allreduce_timeout_s: float) -> float:
    """How long a delegate's combine waits for the other groups (it closes at once when all
    it expects are in, `combine_target`): the window of its group's search, then time for one
    more group's all-reduce (twice ours, and LATE_SLACK_S; at most the all-reduce timeout).
    The last group to form may have waited its whole window for a peer that never came (a
    restarted peer out of phase, a straggler) before it all-reduced without it; with the
    window alone its delegate came seconds late, committed its group alone, found the others'
    seals and kept its δs, every round (netlab, async, after kills: docs/results.md). The
    protocol simulator's combine waits for groups still searching instead
    (swarm_sim/hierarchy.py `Combiner`)."""
    return window_s + min(allreduce_timeout_s, 2 * allreduce_s + LATE_SLACK_S)


def combine_key(key: str) -> str:
    """The combine's round key for stage-one groups under `key`."""
    return f"{key}_c"


def stage_one_statement(
    run: str, version: int, base_hash: str, members: tuple[str, ...], digest: str
) -> Statement:
    """What a member that is not its group's delegate seals: its group, and the digest of the
    group's average (certificate.py: the update's groups)."""
    return Statement(run, version, base_hash, digest, tuple(sorted(members)), stage_one=True)


def pack_material(headers: Mapping[str, bytes], seals: Mapping[str, bytes], digest: str) -> bytes:
    """A delegate's gathered bytes for the combine: its group's signed headers, the stage-one
    seals of its members other than itself, and the digest of the group's average."""
    doc = {
        "headers": {p: h.decode("ascii") for p, h in sorted(headers.items())},
        "seals": {p: s.decode("ascii") for p, s in sorted(seals.items())},
        "digest": digest,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True)
class GroupMaterial:
    """One admitted delegate's group, as its material shows it."""

    part: GroupPart
    headers: dict[str, ContributionHeader]
    raw_headers: dict[str, bytes]
    """The members' signed headers as gathered (the update's certificate carries them)."""
    weight: float
    bound: float
    """The longest the group's average can be: its longest member δ, with the codecs' slack."""


@dataclass(frozen=True)
class CombineScreening:
    """`screen_combine`'s outcome, by delegate: the admitted groups and the refused delegates
    with the reason."""

    accepted: dict[str, GroupMaterial]
    excluded: dict[str, str]


def _open(raw: bytes) -> tuple[dict[str, bytes], dict[str, bytes], str]:
    """(headers, seals, digest) of a delegate's material; ContributionRejected if malformed."""
    if not isinstance(raw, bytes) or len(raw) > MAX_MATERIAL_BYTES:
        raise ContributionRejected("group material missing or too large")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or set(doc) != {"headers", "seals", "digest"}:
            raise ContributionRejected("not a group's material")
        headers, seals, digest = doc["headers"], doc["seals"], doc["digest"]
        if not isinstance(headers, dict) or not isinstance(seals, dict):
            raise ContributionRejected("not a group's material")
        if not isinstance(digest, str) or len(digest) != _HEX64_LEN:
            raise ContributionRejected("the group's digest is malformed")
        texts = [*headers.items(), *seals.items()]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in texts):
            raise ContributionRejected("not a group's material")
        return (
            {p: h.encode("ascii") for p, h in headers.items()},
            {p: s.encode("ascii") for p, s in seals.items()},
            digest,
        )
    except (ValueError, UnicodeError, RecursionError):
        raise ContributionRejected("the group's material is not JSON") from None


def check_material(
    sender: str, raw: bytes, rnd: Round, allow: Callable[[str], bool]
) -> GroupMaterial:
    """`sender`'s group as its material shows it; ContributionRejected saying what is wrong."""
    raw_headers, seals, digest = _open(raw)
    if len(raw_headers) < 2:
        raise ContributionRejected("a stage-one group has at least two members")
    headers: dict[str, ContributionHeader] = {}
    for member, data in raw_headers.items():
        header = ContributionHeader.verify_bytes(data, member)
        if header.run != rnd.run or header.key != rnd.key:
            raise ContributionRejected(f"header of {member[-8:]} is for another round")
        if header.version != rnd.version or header.state_hash != rnd.state_hash:
            raise ContributionRejected(f"header of {member[-8:]} is for another state")
        if header.numel != rnd.numel or header.shapes != rnd.shapes:
            raise ContributionRejected(f"header of {member[-8:]} has another δ layout")
        if not 0 <= header.version - header.base_version <= rnd.staleness_limit:
            raise ContributionRejected(f"header of {member[-8:]} is staler than the limit")
        if not allow(member):
            raise ContributionRejected(f"{member[-8:]} may not contribute to this run")
        lie = claim_lie(header, rnd.limits)
        if lie is not None:
            raise ContributionRejected(f"header of {member[-8:]}: {lie}")
        headers[member] = header
    members = tuple(sorted(headers))
    if delegate(members, rnd.state_hash) != sender:
        raise ContributionRejected("the sender is not its group's delegate")
    first = stage_one_statement(rnd.run, rnd.version, rnd.state_hash, members, digest)
    for member in members:
        if member != sender and not seal_verifies(
            seals.get(member), first, headers[member].public_key
        ):
            raise ContributionRejected(f"no stage-one seal of {member[-8:]} for this group")
    weights = group_weights(headers, rnd.weighting)
    bound = NORM_SLACK * max(h.norm for h in headers.values())
    return GroupMaterial(
        GroupPart(members, digest), headers, dict(raw_headers), sum(weights.values()), bound
    )


def screen_combine(
    gathered: Mapping[str, bytes], rnd: Round, allow: Callable[[str], bool]
) -> CombineScreening:
    """Which delegates' groups enter the combine of stage-one round `rnd` (its key is the
    stage-one key); the same on every honest delegate (see the module docstring)."""
    accepted: dict[str, GroupMaterial] = {}
    excluded: dict[str, str] = {}
    for sender, raw in sorted(gathered.items()):
        try:
            accepted[sender] = check_material(sender, raw, rnd, allow)
        except ContributionRejected as e:
            excluded[sender] = str(e)
    claims: dict[str, list[str]] = {}
    for sender, material in accepted.items():
        for member in material.part.members:
            claims.setdefault(member, []).append(sender)
    for member, senders in sorted(claims.items()):
        if len(senders) > 1:
            for sender in senders:
                if sender in accepted:
                    del accepted[sender]
                    excluded[sender] = f"its group shares {member[-8:]} with another group"
    return CombineScreening(accepted, excluded)
