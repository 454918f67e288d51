"""Who of a committed group takes part in its all-reduce, and what the caller gets back.

`plan_round` applies the caller's admission (its screening of the members' signed headers) to a
committed group (commit.py) and derives the round's digest from who is left, the same on every
admitted member; `group_result` turns the part exchange's result into the caller's
`GroupResult`. Both pure: no I/O.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.member import AllReduceResult
from diloco_peer.averaging.receipts import reducer_keys
from diloco_peer.errors import AllReduceFailed, NoGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupResult:
    """One successful round: the fields up to `group_id` are identical on every member; the
    traffic and timings that follow are this peer's own."""

    average: list[Tensor]
    """Σ_j w_j δ_j / Σ_j w_j, same shapes as the input, fp32 on CPU, bit-identical on members."""
    members: list[str]
    """Sorted base58 peer ids."""
    weights: dict[str, float]
    """Each member's weight in the average: the admission's (`Admission.weights`, derived from
    the signed headers), or without an admission the one its envelope carried."""
    gathered: dict[str, bytes]
    """Each member's `gather` bytes (for signed contribution headers)."""
    group_id: bytes
    """hivemind's group id, chosen at random by the group's leader."""
    bytes_sent: int
    """Bytes this peer wrote to the round's part streams, measured: every frame as sent (8-byte
    length prefix + payload), i.e. its parts and part headers to the other reducers and, as a
    reducer, the averaged part back to each member: about 2·b·n·(k−1)/k for n floats in a group
    of k, b the bytes per value of the codec (4 for fp32, 2 for fp16, ~1.03 for int8, ~0.53 for
    int4: `compression.encoded_size`), plus ~100 B of framing per stream. Matchmaking (hivemind
    RPC, DHT) is not counted. Differs slightly between members (part sizes differ by one float)."""
    bytes_received: int
    """Bytes this peer read from the same streams, counted the same way: the other members' parts
    for the part it reduces, and the averages of its parts from their reducers. Over a group, the
    sum of `bytes_received` equals the sum of `bytes_sent` (every frame sent is read once) when
    every member succeeded. Matchmaking is not counted."""
    matchmaking_s: float
    """Seconds from the call to the group being committed (hivemind's matchmaking, then the
    commit step: commit.py)."""
    allreduce_s: float
    """Seconds from the group being committed to this peer holding the average."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Members whose δ was kept out, with the reason: by the admission check before the
    all-reduce (then they are not in `members`), or by a part reducer (then they are in
    `members` but not in `contributors`). Identical on every member."""
    accusations: dict[str, int] = field(default_factory=dict)
    """For members a part reducer excluded: how many of the `len(members)` reducers did."""
    witnessed: dict[str, str] = field(default_factory=dict)
    """Members this peer's own reducer excluded, with the reason: what it saw itself on their
    authenticated streams (this peer's own; the rest above is the same on every member)."""

    @property
    def contributors(self) -> list[str]:
        """The members whose δ is in the average (in every part of it)."""
        return [m for m in self.members if m not in self.excluded]

    def timings(self) -> dict[str, float]:
        """This peer's stages of the round in seconds, for its round event."""
        return {"matchmaking_s": self.matchmaking_s, "allreduce_s": self.allreduce_s}


@dataclass(frozen=True)
class Admission:
    """Which members of a formed group take part in its all-reduce (the caller's screening of
    their signed headers, `contribution.screen_group`); the same on every honest member."""

    bounds: dict[str, float | None]
    """Admitted members and each one's declared δ norm, which bounds the norm of its parts."""
    excluded: dict[str, str]
    """Members kept out, with the reason."""
    weights: dict[str, float] | None = None
    """Each admitted member's averaging weight (`contribution.group_weights`), the same on every
    honest member; the weights in the members' matchmaking envelopes are then ignored (a free
    number there steered the average: issue 16). None: the envelopes' (tests without headers)."""
    keys: dict[str, bytes] | None = None
    """Each admitted member's public key, from its signed header: every reducer's answers must
    carry its signed receipt, and members compare them (receipts.py, echo.py). None: receipts
    are neither checked nor compared (tests without headers)."""
    reference: Tensor | None = None
    """A flat vector every honest part shares by construction, which this peer's reducer takes
    out of every part before its direction screen (robust.screen_parts); local to this peer."""


@dataclass(frozen=True)
class RoundPlan:
    """Who of a formed group takes part in its all-reduce, the same on every admitted member:
    the admitted members (sorted), those of them that reduce a part (not in client mode), their
    declared δ norms and weights, who the admission kept out and why, the round's digest, and
    (peer id, public key) of each reducer, in part order, when receipts are checked."""

    members: tuple[str, ...]
    reducers: tuple[str, ...]
    bounds: list[float | None]
    weights: list[float]
    excluded: dict[str, str]
    digest: bytes
    keys: tuple[tuple[str, bytes], ...] | None = None
    reference: Tensor | None = None
    """`Admission.reference`: not part of the digest (each reducer screens by its own)."""


def plan_round(
    me: str, group: Group, admit: Callable[[Group], Admission] | None, tag: str
) -> RoundPlan:
    """Who of a committed group takes part, and the round's digest. NoGroup if nobody else
    does, or fewer than two admitted members accept connections (`sole_reducer`);
    AllReduceFailed if I am kept out, or a reducer's key is missing (the caller then refuses
    parts under this key: `PartExchange.close_key`)."""
    admission = (
        admit(group) if admit is not None else Admission({m: None for m in group.members}, {})
    )
    members = tuple(m for m in group.members if m in admission.bounds)
    excluded = dict(admission.excluded)
    if excluded:
        logger.warning("%s kept out of the round: %s", tag, describe(excluded))
    if me not in members:
        reason = excluded.get(me, "not admitted")
        raise AllReduceFailed(f"{tag} my contribution was not admitted: {reason}")
    if len(members) == 1:
        # Everyone else was kept out: no group. (Applying my δ alone here could fork the
        # state while the honest peers averaged in a group of their own.)
        raise NoGroup(f"{tag} every other member was kept out: {describe(excluded)}")
    clients = {m for m, client in zip(group.members, group.clients, strict=True) if client}
    reducers = tuple(m for m in members if m not in clients)
    if sole_reducer(reducers):
        raise NoGroup(
            f"{tag} {len(reducers)} of {len(members)} admitted members accept connections: "
            "a group needs two reducers (one alone could fork its answers unseen)"
        )
    if admission.weights is None:
        envelope = dict(zip(group.members, group.weights, strict=True))
        weights = [envelope[m] for m in members]
    else:
        weights = [float(admission.weights.get(m, math.nan)) for m in members]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise AllReduceFailed(f"{tag} an admitted weight is not finite and positive: {weights}")
    # every admitted member derives the same digest from the same admission
    plan = "|".join(members) + "#" + "|".join(reducers) + "#" + "|".join(map(repr, weights))
    return RoundPlan(
        members=members,
        reducers=reducers,
        bounds=[admission.bounds[m] for m in members],
        weights=weights,
        excluded=excluded,
        digest=hashlib.sha256(group.digest + plan.encode()).digest(),
        keys=reducer_keys(reducers, admission.keys),
        reference=admission.reference,
    )


def sole_reducer(reducers: tuple[str, ...]) -> bool:
    """A group whose reducers are fewer than two keys must not form (issue 16, item 8): with
    one, every other member is a client that compares its receipts with nobody but that
    reducer, which can then answer each with other bytes unseen (receipts.py, step 3). That
    includes a group of two whose one member is in client mode, and a group of clients only."""
    return len(set(reducers)) < 2


def group_result(
    group: Group,
    plan: RoundPlan,
    reduced: AllReduceResult,
    shapes: list[tuple[int, ...]],
    matchmaking_s: float,
    allreduce_s: float,
) -> GroupResult:
    """The round's result as the caller sees it: the average in the caller's shapes, and the
    admitted members' weights and gathered bytes."""
    sizes = [math.prod(shape) for shape in shapes]
    parts = reduced.average.split(sizes)
    members = plan.members
    return GroupResult(
        average=[part.view(shape) for part, shape in zip(parts, shapes, strict=True)],
        members=list(members),
        weights=dict(zip(members, plan.weights, strict=True)),
        gathered={m: g for m, g in zip(group.members, group.gathered, strict=True) if m in members},
        group_id=group.group_id,
        bytes_sent=reduced.bytes_sent,
        bytes_received=reduced.bytes_received,
        matchmaking_s=matchmaking_s,
        allreduce_s=allreduce_s,
        excluded={**plan.excluded, **reduced.excluded},
        accusations=reduced.accusations,
        witnessed=reduced.witnessed,
    )


def describe(excluded: dict[str, str]) -> str:
    return "; ".join(f"{peer[-6:]}: {reason}" for peer, reason in sorted(excluded.items()))
