"""Commit certificates (DESIGN §4, certified history): version v+1 exists only with the proof that
the members who made it signed it.

A member that applies a group's average (or its own δ, alone) signs a `Statement`: run, base
version v, base hash, result hash, the sorted members whose δs are in the average, their count.
That `seal` goes to the DHT (`coordinator_free/seals.py`); the update record it kept for replay
carries the members' signed contribution headers. A peer replaying version v+1 from any donor
verifies the whole (`verify_update`), a pure function of the record, the seals and this run's
rules:

- every member's header verifies under the member's key, is for this run, this base version and
  base hash, within the staleness limit, and the member is allowed (private swarms);
- every member sealed exactly this statement (the result hash included): a donor cannot pass off
  another average for the group's, since the replayed state must hash to the result they signed;
- each header's samples are the sum of its shards and within what one δ can hold, and the
  samples per shard the update adds are the sum of the headers' (no shard counter of 1e15);
- the average is no longer than the members' declared δs allow (root of the sum of their squared
  norms, with slack for compressed all-reduces), and no longer than `history_factor` times the
  median of the updates this peer applied recently: it is screened as a contribution is;
- a lone commit (one member: an async group of one) has one signature, so one key's word: its
  average must be exactly the δ its header digests, which the screens above bound;
- a two-stage update (averaging/hierarchy.py) names its stage-one groups (`GroupPart`), which
  partition its members: each group's delegate sealed the statement, every other member its
  group's stage-one statement (the group and the digest of the group's average). With one
  group, one key sealed the result: the average must be the group's, digest for digest; with
  more, as many delegates' keys vouch for the combination.

Nothing here touches the network or a clock.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from diloco_peer.averaging.contribution import (
    ContributionHeader,
    ContributionRejected,
    Limits,
    claim_lie,
    delta_digest,
)
from diloco_peer.errors import DilocoError
from diloco_peer.identity import Identity, IdentityError, peer_id_from_public_key, verify

FORMAT = "diloco-peer/seal-v1"
STAGE_ONE_FORMAT = "diloco-peer/stage-one-v1"
"""A two-stage member's statement: its group, and the digest of the group's average."""
_SIGNING_CONTEXT = FORMAT.encode() + b"\n"
MAX_SEAL_BYTES = 16 * 1024
"""A seal is a statement (its member list: about 55 bytes a member) plus one RSA signature and
key (about 1 kB); as `coordinator_free.seals.MAX_SEAL_BYTES`."""
MAX_MEMBERS = 256
"""Members one certificate may name (a group is far smaller)."""
NORM_SLACK = 1.25
"""How much longer than its members' declared δs allow an average may be: fp16 and 4-/8-bit
blockwise codes round each value, which can lengthen the decoded vector by a few percent."""
HISTORY_FACTOR = 8.0
"""A replayed average may be at most this many times the median norm of the updates this peer
applied recently (2 x the admission bound of 4: a lone commit's δ is not averaged down)."""
HISTORY_MIN = 3
"""Updates this peer must have applied before the history screen applies (a joiner has none)."""
_HEX = re.compile(r"[0-9a-f]{1,128}\Z")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}\Z")
_STATEMENT_FIELDS = {
    "format",
    "run",
    "base_version",
    "base_hash",
    "result_hash",
    "members",
    "count",
}


class CertificateError(DilocoError):
    """An update's certificate is missing a part, does not verify, or breaks a rule."""


@dataclass(frozen=True)
class Statement:
    """What every member of a commit signs: version `base_version` + 1 is this update.

    In two-stage averaging (averaging/hierarchy.py) a member that is not its group's delegate
    signs a stage-one statement instead (`stage_one`): `members` is its group and `result_hash`
    the digest (`contribution.delta_digest`) of the group's average it holds."""

    run: str
    base_version: int
    base_hash: str
    result_hash: str
    members: tuple[str, ...]
    """Sorted peer ids whose δs are in the average."""
    stage_one: bool = False

    @property
    def count(self) -> int:
        return len(self.members)

    def canonical_bytes(self) -> bytes:
        doc = {
            "format": STAGE_ONE_FORMAT if self.stage_one else FORMAT, "run": self.run, "base_version": self.base_version,
            "base_hash": self.base_hash, "result_hash": self.result_hash,
            "members": list(self.members), "count": self.count,
        }  # fmt: skip
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")


def seal(identity: Identity, statement: Statement) -> bytes:
    """This member's seal of `statement`: the statement, its signature and the signer's public
    key, as JSON bytes."""
    canonical = statement.canonical_bytes()
    signature = identity.sign(_SIGNING_CONTEXT + canonical)
    envelope = {
        "statement": canonical.decode("ascii"),
        "signature": base64.b64encode(signature).decode("ascii"),
        "public_key": base64.b64encode(identity.public_key).decode("ascii"),
    }
    return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode("ascii")


VOID = b"void"
"""What a member stores over its seal when its group gave the version up (`rival_claims`)."""


def _envelope(data: object) -> tuple[bytes, bytes, bytes] | None:
    """(canonical statement, signature, public key) of a seal's bytes, or None."""
    if not isinstance(data, bytes) or len(data) > MAX_SEAL_BYTES:
        return None
    try:
        envelope = json.loads(data)
        if not isinstance(envelope, dict) or set(envelope) != {
            "statement", "signature", "public_key",
        }:  # fmt: skip
            return None
        fields = [envelope[k] for k in ("statement", "signature", "public_key")]
        if not all(isinstance(f, str) for f in fields):
            return None
        return (
            fields[0].encode("ascii"),
            base64.b64decode(fields[1], validate=True),
            base64.b64decode(fields[2], validate=True),
        )
    except (ValueError, UnicodeError, binascii.Error, RecursionError):
        return None


def seal_verifies(data: object, statement: Statement, public_key: bytes) -> bool:
    """Whether `data` is a seal of exactly `statement` signed by `public_key` (any bytes)."""
    opened = _envelope(data)
    if opened is None:
        return False
    canonical, signature, key = opened
    if canonical != statement.canonical_bytes() or key != public_key:
        return False
    return verify(public_key, _SIGNING_CONTEXT + canonical, signature)


def open_seal(data: object, signer: str) -> Statement | None:
    """The statement `signer` (a peer id) sealed in `data`, if its key is that peer's and the
    signature verifies; None for anything else (a void, garbage, another's key)."""
    opened = _envelope(data)
    if opened is None:
        return None
    canonical, signature, key = opened
    try:
        if peer_id_from_public_key(key) != signer:
            return None
        doc = json.loads(canonical)
    except (IdentityError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or set(doc) != _STATEMENT_FIELDS:
        return None
    if doc["format"] not in (FORMAT, STAGE_ONE_FORMAT):
        return None
    members = doc["members"]
    if not isinstance(members, list) or not 1 <= len(members) <= MAX_MEMBERS:
        return None
    if not all(isinstance(m, str) and _PEER_ID.fullmatch(m) for m in members):
        return None
    version = doc["base_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return None
    hashes = (doc["base_hash"], doc["result_hash"])
    if not isinstance(doc["run"], str) or not all(
        isinstance(h, str) and _HEX.fullmatch(h) for h in hashes
    ):
        return None
    statement = Statement(
        doc["run"], version, hashes[0], hashes[1], tuple(members),
        stage_one=doc["format"] == STAGE_ONE_FORMAT,
    )  # fmt: skip
    if statement.canonical_bytes() != canonical or signer not in statement.members:
        return None
    return statement if verify(key, _SIGNING_CONTEXT + canonical, signature) else None


def rival_claims(found: Mapping[str, bytes], mine: Statement) -> list[Statement]:
    """Other groups that committed on the same base as `mine` (issue 15: two groups never form
    under one key): statements other than ours, for this run, base version and base hash,
    backed by two or more keys. A lone key's claim is no group's (one key's word must not make
    a group give its version up); its backers are its signers, and, for a two-stage update of
    one group (a delegate whose combine found no other group commits its group's average
    alone, sealed by itself only), the members that sealed that very group in stage one.
    Without them, a combine that committed after such an update could not see it: both
    committed one version, a fork (netlab, async, 2026-12-03)."""
    finals: dict[Statement, set[str]] = {}
    groups: dict[tuple[str, ...], set[str]] = {}  # a stage-one group: its members that sealed it
    for signer, data in found.items():
        statement = open_seal(data, signer)
        if statement is None or statement == mine:
            continue
        same_base = (statement.run, statement.base_version, statement.base_hash) == (
            mine.run, mine.base_version, mine.base_hash,
        )  # fmt: skip
        if not same_base:
            continue
        if statement.stage_one:  # commits nothing by itself
            if signer in statement.members:
                groups.setdefault(statement.members, set()).add(signer)
            continue
        finals.setdefault(statement, set()).add(signer)
    return [s for s, who in finals.items() if len(who | groups.get(s.members, set())) >= 2]


@dataclass(frozen=True)
class GroupPart:
    """One stage-one group of a two-stage update: its members (sorted) and the digest of the
    group's average, as its members sealed them (`Statement.stage_one`)."""

    members: tuple[str, ...]
    digest: str


def delegate(members: Sequence[str], base_hash: str) -> str:
    """The member that takes a stage-one group's average to the combine: the one whose
    sha256(peer id, base hash) is least, which every member (and every verifier) names alike."""
    return min(members, key=lambda m: hashlib.sha256(f"{m}/{base_hash}".encode()).digest())


def pack_groups(groups: Sequence[GroupPart]) -> str:
    """A two-stage update's groups as one JSON text (an update record's `info["groups"]`)."""
    return json.dumps(
        [{"members": list(g.members), "digest": g.digest} for g in groups],
        sort_keys=True, separators=(",", ":"),
    )  # fmt: skip


def unpack_groups(text: object) -> tuple[GroupPart, ...] | None:
    """The inverse of `pack_groups`; None when there is no text (a one-stage update);
    CertificateError for anything malformed."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise CertificateError("the update's groups are not text")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise CertificateError("the update's groups are not JSON") from None
    if not isinstance(doc, list) or not 1 <= len(doc) <= MAX_MEMBERS:
        raise CertificateError(f"the update must name 1 to {MAX_MEMBERS} groups")
    groups = []
    for g in doc:
        if not isinstance(g, dict) or set(g) != {"members", "digest"}:
            raise CertificateError("a group must have members and a digest")
        members, digest = g["members"], g["digest"]
        if not isinstance(members, list) or not 1 <= len(members) <= MAX_MEMBERS:
            raise CertificateError("a group's members must be a list of peer ids")
        if not all(isinstance(m, str) and _PEER_ID.fullmatch(m) for m in members):
            raise CertificateError("a group's members must be peer ids")
        if members != sorted(set(members)):
            raise CertificateError("a group's members must be sorted and distinct")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise CertificateError("a group's digest is malformed")
        groups.append(GroupPart(tuple(members), digest))
    return tuple(groups)


def _sealed(statement: Statement, groups: Sequence[GroupPart] | None) -> dict[str, Statement]:
    """What each member of `statement` must have sealed: the statement itself (one-stage), or
    in a two-stage update its group's stage-one statement, the delegates the statement; the
    groups must partition the members."""
    if groups is None:
        return {m: statement for m in statement.members}
    named = [m for g in groups for m in g.members]
    if len(named) != len(set(named)) or tuple(sorted(named)) != statement.members:
        raise CertificateError("the update's groups do not partition its members")
    sealed: dict[str, Statement] = {}
    for g in groups:
        first = Statement(
            statement.run, statement.base_version, statement.base_hash, g.digest, g.members,
            stage_one=True,
        )  # fmt: skip
        chosen = delegate(g.members, statement.base_hash)
        sealed.update({m: statement if m == chosen else first for m in g.members})
    return sealed


def pack_headers(headers: Mapping[str, bytes]) -> str:
    """The members' signed headers as one JSON text (an update record's `info["headers"]`)."""
    return json.dumps({p: h.decode("ascii") for p, h in sorted(headers.items())}, sort_keys=True)


def unpack_headers(text: object) -> dict[str, bytes]:
    """The inverse of `pack_headers`; CertificateError for anything else."""
    if not isinstance(text, str):
        raise CertificateError("the update carries no contribution headers")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise CertificateError("the update's headers are not JSON") from None
    if not isinstance(doc, dict) or not 1 <= len(doc) <= MAX_MEMBERS:
        raise CertificateError(f"the update must carry 1 to {MAX_MEMBERS} headers")
    if not all(isinstance(p, str) and isinstance(h, str) for p, h in doc.items()):
        raise CertificateError("the update's headers must map peer ids to text")
    try:
        return {p: h.encode("ascii") for p, h in doc.items()}
    except UnicodeError:
        raise CertificateError("the update's headers are not ASCII") from None


@dataclass(frozen=True)
class Rules:
    """This run's rules for a replayed update, and what this peer has seen."""

    run: str
    staleness_limit: int
    allow: Callable[[str], bool]
    recent_norms: Sequence[float] = ()
    """Norms of the last updates this peer applied (the history screen)."""
    limits: Limits = Limits()
    """What one member's header may claim (`contribution.Limits`)."""


def verify_update(
    *,
    base_version: int,
    base_hash: str,
    result_hash: str,
    count: int,
    shard_samples: Mapping[int, int],
    average: Sequence[Tensor],
    headers: Mapping[str, bytes],
    seals: Mapping[str, bytes],
    rules: Rules,
    groups: Sequence[GroupPart] | None = None,
) -> Statement:
    """The verified statement of one update, or CertificateError saying which rule it breaks.
    `groups`: a two-stage update's stage-one groups (None: one group, every member sealed the
    statement)."""
    members = tuple(sorted(headers))
    if count != len(members):
        raise CertificateError(f"the update counts {count} members but carries {len(members)}")
    if not _HEX.fullmatch(base_hash) or not _HEX.fullmatch(result_hash):
        raise CertificateError("the update's hashes are malformed")
    statement = Statement(rules.run, base_version, base_hash, result_hash, members)
    sealed = _sealed(statement, groups)
    parsed: dict[str, ContributionHeader] = {}
    for member in members:
        try:
            header = ContributionHeader.verify_bytes(headers[member], member)
        except ContributionRejected as e:
            raise CertificateError(f"header of {member[-8:]}: {e}") from None
        if header.run != rules.run:
            raise CertificateError(f"header of {member[-8:]} is for another run")
        if header.version != base_version or header.state_hash != base_hash:
            raise CertificateError(f"header of {member[-8:]} is for another version or state")
        if not 0 <= header.version - header.base_version <= rules.staleness_limit:
            raise CertificateError(f"header of {member[-8:]} is staler than the limit")
        if not rules.allow(member):
            raise CertificateError(f"{member[-8:]} may not contribute to this run")
        lie = claim_lie(header, rules.limits)
        if lie is not None:
            raise CertificateError(f"header of {member[-8:]}: {lie}")
        if not seal_verifies(seals.get(member), sealed[member], header.public_key):
            raise CertificateError(f"no valid seal of {member[-8:]} for this update")
        parsed[member] = header
    totals: dict[int, int] = {}
    for header in parsed.values():
        for shard, samples in header.shards.items():
            totals[shard] = totals.get(shard, 0) + samples
    if {s: n for s, n in totals.items() if n} != {s: n for s, n in shard_samples.items() if n}:
        raise CertificateError("the update's samples per shard are not its headers' sum")
    norm, digest = delta_digest(average)
    if len(members) == 1:
        if digest != parsed[members[0]].digest:
            raise CertificateError("a lone commit's average is not the δ its header names")
    elif groups is not None and len(groups) == 1:
        # one delegate sealed it: its average must be the one its group's members sealed
        if digest != groups[0].digest:
            raise CertificateError("a one-group update's average is not its group's")
    else:
        bound = NORM_SLACK * math.sqrt(sum(h.norm**2 for h in parsed.values()))
        if norm > bound:
            raise CertificateError(f"average norm {norm:.3g} exceeds its members' {bound:.3g}")
    recent = [n for n in rules.recent_norms if n > 0]
    if len(recent) >= HISTORY_MIN:
        limit = HISTORY_FACTOR * statistics.median(recent)
        if norm > limit:
            raise CertificateError(
                f"average norm {norm:.3g} is over {HISTORY_FACTOR:g}x the recent updates' median"
            )
    return statement
