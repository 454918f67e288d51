"""Signed contribution headers, the group screening they allow, and the weights they fix
(DESIGN.md §4).

Every member of a group gathers one `ContributionHeader` at matchmaking: who it is (its public
key, so anyone can check the signature and that the key hashes to the member's libp2p peer id),
which round the δ is for (round key, version, state hash, base version), what it claims (steps,
samples per shard, number of values, a digest of the tensor shapes, the δ's L2 norm and sha256),
the peers it currently bans and those it waited for in vain (marks.py). Hivemind's leader hands
every member the same gathered bytes, so `screen_group` — a pure function of those bytes, the
round and this build's settings — makes the same decision on every honest member, and they
all-reduce over the same accepted members with the same weights (`group_weights`: from the
signed headers, never from a number a member picks apart from them). The one input that is
local is replay memory (`NonceMemory`): a member that has seen a header's nonce before refuses
it even where the round fields alone would not (async staleness window). Members that disagree
on it get different group digests, so that round fails rather than forks.

Bans need evidence the accused signed (`Screening.banned`): its own header for this very round
breaking a rule. The leader alone says who is in a group and what each member sent, so a header
that does not verify, or one signed for another round, may be the leader's work: it excludes,
and never bans. Bans and silence marks travel in headers; a member banned, or named silent, by
more than half of the other valid members of a group is excluded by all of them, and such an
exclusion never renews anyone's ban.

What the header cannot prove is checked where the values are: each part reducer checks the
member's part against the declared norm (a part cannot be longer than the whole δ), its
finiteness and, in groups of three or more, its direction (averaging/robust.py).

Not defended (docs/security.md): lies about steps or samples within plausible bounds (a weight
is at most SAMPLES_WEIGHT_CAP x the median), and a δ that is harmful yet within the norm and
direction bounds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from diloco_peer.averaging.marks import MAX_BANS_IN_HEADER
from diloco_peer.config import RunSpec, SwarmSettings, Weighting
from diloco_peer.errors import DilocoError, IdentityError
from diloco_peer.identity import Identity, peer_id_from_public_key, verify

FORMAT = "diloco-peer/contribution-v3"  # v2: the `silent` list; v3: `expected`
_SIGNING_CONTEXT = FORMAT.encode() + b"\n"
MAX_HEADER_BYTES = 16 * 1024
_MAX_SHARDS = 4096
_MAX_INT = 2**63 - 1
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{1,128}\Z")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
_KEY = re.compile(r"^[A-Za-z0-9_]{1,64}\Z")
_FIELDS = {
    "format", "run", "peer", "public_key", "key", "version", "state_hash", "base_version",
    "steps", "samples", "shards", "numel", "shapes", "norm", "digest", "nonce", "bans", "silent",
    "time", "expected",
}  # fmt: skip
MAX_EXPECTED = 1_000_000
"""The most peers a header may say its round waits for."""


class ContributionRejected(DilocoError):
    """A member's contribution header is malformed, unsigned, forged or not for this round."""


def shapes_digest(shapes: Iterable[Sequence[int]]) -> str:
    """sha256 (hex) of the tensor shapes, in order: equal iff the δs have the same layout."""
    return hashlib.sha256(json.dumps([list(s) for s in shapes]).encode()).hexdigest()


def delta_digest(tensors: Sequence[Tensor]) -> tuple[float, str]:
    """(L2 norm, sha256 hex of the fp32 bytes, in order) of a δ, as its header declares them."""
    h = hashlib.sha256()
    squares = 0.0
    for t in tensors:
        flat = t.detach().to("cpu", torch.float32).contiguous().view(-1)
        squares += float(flat.double().square().sum())
        h.update(flat.numpy().tobytes())
    return math.sqrt(squares), h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class ContributionHeader:
    """What a member claims about its δ for one round; `sign` turns it into gathered bytes."""

    run: str
    peer: str
    public_key: bytes
    key: str
    """The round key the δ is offered to (`v{version}_{hash16}`)."""
    version: int
    """The version the group's average is applied to."""
    state_hash: str
    base_version: int
    """The version the δ was trained from; version - base_version is its staleness."""
    steps: int
    samples: int
    shards: dict[int, int]
    numel: int
    shapes: str
    """`shapes_digest` of the δ's tensors."""
    norm: float
    digest: str
    nonce: str
    bans: tuple[str, ...] = ()
    silent: tuple[str, ...] = ()
    """Members this peer waited for in vain in a recent round (`Silence`): they sent no part."""
    time: float = field(default_factory=time.time)
    expected: int = 0
    """How many peers (this one included) its round waits for at this version: more than the
    group size in any admitted member's header makes the group's average go to a combine
    (two-stage averaging, averaging/hierarchy.py); 0 says nothing."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "run": self.run, "peer": self.peer,
            "public_key": base64.b64encode(self.public_key).decode("ascii"), "key": self.key,
            "version": self.version, "state_hash": self.state_hash,
            "base_version": self.base_version, "steps": self.steps, "samples": self.samples,
            "shards": {str(k): v for k, v in sorted(self.shards.items())}, "numel": self.numel,
            "shapes": self.shapes, "norm": self.norm, "digest": self.digest,
            "nonce": self.nonce, "bans": list(self.bans), "silent": list(self.silent),
            "time": self.time, "expected": self.expected,
        }  # fmt: skip

    def canonical_bytes(self) -> bytes:
        try:
            text = json.dumps(
                self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False
            )
        except ValueError:
            raise ContributionRejected("header values must be finite numbers") from None
        return text.encode("ascii")

    def sign(self, identity: Identity) -> bytes:
        """The gathered bytes: canonical header and the peer's signature of it."""
        canonical = self.canonical_bytes()
        signature = identity.sign(_SIGNING_CONTEXT + canonical)
        envelope = {
            "header": canonical.decode("ascii"),
            "signature": base64.b64encode(signature).decode("ascii"),
        }
        return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def verify_bytes(cls, data: bytes, member: str) -> ContributionHeader:
        """Parse and verify a member's gathered bytes; ContributionRejected on anything wrong.

        The signature must verify with the header's public key, and that key must hash to
        `member`, the peer id libp2p authenticated at matchmaking: nobody signs for another.
        """
        if not isinstance(data, bytes) or len(data) > MAX_HEADER_BYTES:
            raise ContributionRejected("header missing or too large")
        try:
            envelope = json.loads(data, parse_constant=_no_constant)
            if not isinstance(envelope, dict) or set(envelope) != {"header", "signature"}:
                raise ContributionRejected("not a signed contribution header")
            canonical, signature = envelope["header"], envelope["signature"]
            if not isinstance(canonical, str) or not isinstance(signature, str):
                raise ContributionRejected("not a signed contribution header")
            canonical_bytes = canonical.encode("ascii")
            doc = json.loads(canonical_bytes, parse_constant=_no_constant)
            signature_bytes = base64.b64decode(signature, validate=True)
        except (ValueError, UnicodeError, binascii.Error, RecursionError):
            raise ContributionRejected("header is not valid JSON or base64") from None
        header = cls._from_dict(doc)
        if header.canonical_bytes() != canonical_bytes:
            raise ContributionRejected("header is not in canonical form")
        if header.peer != member:
            raise ContributionRejected(f"header names peer {header.peer[-8:]}, not the sender")
        try:
            key_owner = peer_id_from_public_key(header.public_key)
        except IdentityError:
            raise ContributionRejected("header public key is not a valid key") from None
        if key_owner != member:
            raise ContributionRejected("header public key does not belong to the sender")
        if not verify(header.public_key, _SIGNING_CONTEXT + canonical_bytes, signature_bytes):
            raise ContributionRejected("header signature does not verify (forged or altered)")
        return header

    @classmethod
    def _from_dict(cls, doc: Any) -> ContributionHeader:
        if not isinstance(doc, dict) or set(doc) != _FIELDS or doc["format"] != FORMAT:
            raise ContributionRejected("header fields or format differ from this build's")
        ints = ("version", "base_version", "steps", "samples", "numel")
        for name in ints:
            if not _is_int(doc[name]) or not 0 <= doc[name] <= _MAX_INT:
                raise ContributionRejected(f"header {name} must be a non-negative integer")
        if not _is_int(doc["expected"]) or not 0 <= doc["expected"] <= MAX_EXPECTED:
            raise ContributionRejected(f"header expected must be an integer in 0..{MAX_EXPECTED}")
        for name in ("norm", "time"):
            value = doc[name]
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise ContributionRejected(f"header {name} must be a finite number")
        if doc["norm"] < 0:
            raise ContributionRejected("header norm must be >= 0")
        texts = {"run": _KEY, "peer": _PEER_ID, "key": _KEY, "state_hash": _HEX64,
                 "shapes": _HEX64, "digest": _HEX64, "nonce": _HEX32}  # fmt: skip
        for name, pattern in texts.items():
            if not isinstance(doc[name], str) or not pattern.fullmatch(doc[name]):
                raise ContributionRejected(f"header {name} is malformed")
        shards = doc["shards"]
        if not isinstance(shards, dict) or len(shards) > _MAX_SHARDS:
            raise ContributionRejected("header shards must be an object of shard counts")
        parsed: dict[int, int] = {}
        for k, v in shards.items():
            if not k.isdigit() or len(k) > 9 or not _is_int(v) or not 0 <= v <= _MAX_INT:
                raise ContributionRejected("header shards must map shard numbers to counts")
            parsed[int(k)] = v
        for name in ("bans", "silent"):
            ids = doc[name]
            if not isinstance(ids, list) or len(ids) > MAX_BANS_IN_HEADER:
                raise ContributionRejected(f"header {name} must be a short list of peer ids")
            if not all(isinstance(b, str) and _PEER_ID.fullmatch(b) for b in ids):
                raise ContributionRejected(f"header {name} must be peer ids")
        if not isinstance(doc["public_key"], str):
            raise ContributionRejected("header public_key must be base64")
        try:
            public_key = base64.b64decode(doc["public_key"], validate=True)
        except (binascii.Error, ValueError):
            raise ContributionRejected("header public_key must be base64") from None
        return cls(
            run=doc["run"], peer=doc["peer"], public_key=public_key, key=doc["key"],
            version=doc["version"], state_hash=doc["state_hash"],
            base_version=doc["base_version"], steps=doc["steps"], samples=doc["samples"],
            shards=parsed, numel=doc["numel"], shapes=doc["shapes"], norm=float(doc["norm"]),
            digest=doc["digest"], nonce=doc["nonce"], bans=tuple(doc["bans"]),
            silent=tuple(doc["silent"]), time=float(doc["time"]), expected=doc["expected"],
        )  # fmt: skip


def new_nonce() -> str:
    return os.urandom(16).hex()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SAMPLES_WEIGHT_CAP = 2.0
"""With `weighting = "samples"`, a member's averaging weight is the samples its signed header
declares, at most this many times the low median of the admitted members' (and at least 1). A claim
of 1e9 samples then counts as twice the median, not as the whole average: in a group of k it
moves the average by at most 2/(k+1) of its δ. Twice, not more: DyLU gives honest peers phases
that end together, so their samples differ by their speeds (SPEED_CAP reads those as at most 4x
the median), and a peer twice as fast as the median losing some weight costs less than a liar
gaining it."""


SAMPLES_BOUND_PHASES = 4
"""`Limits`: phases of H steps one δ may hold per version of staleness (DyLU gives the fastest
peer H steps; a kept δ is merged with later ones until the staleness limit drops it)."""
ADAM_STEP_MAX = 4.0
"""`Limits.max_norm`: the most one AdamW step moves one value, in units of the learning rate
(the bias-corrected |m / sqrt(v)| stays below (1 - b1) / sqrt(1 - b2) = 3.2 for the defaults,
plus weight decay's lr x wd x |theta|)."""


@dataclass(frozen=True)
class Limits:
    """What one honest δ can hold, from the run's hyper-parameters (DESIGN §4: a claim past
    these is a signed lie). Zeros: no bound (tests)."""

    max_samples: int = 0
    max_steps: int = 0
    inner_lr: float = 0.0
    carried_steps: int = 0
    """Fragments (§1.2): a δ also holds its fragment's progress of the sub-phases since its last
    sync (at most H steps, declared by earlier rounds), which its norm bound counts."""

    @classmethod
    def of(cls, run: RunSpec, swarm: SwarmSettings) -> Limits:
        phases = SAMPLES_BOUND_PHASES * (swarm.staleness_limit + 1)
        steps = run.inner_steps * phases
        return cls(steps * run.batch_size, steps, run.inner_lr,
                   run.inner_steps if swarm.fragments > 1 else 0)  # fmt: skip

    def max_norm(self, steps: int, numel: int) -> float:
        """The longest δ `steps` (+ `carried_steps`) AdamW steps make over `numel` values: no
        history needed, so it holds from version 1 (issue 16: a lone δ x 1000, honestly
        declared, was replayed by every honest peer at version 1)."""
        if not self.inner_lr:
            return math.inf
        return ADAM_STEP_MAX * self.inner_lr * (steps + self.carried_steps) * math.sqrt(numel)


def claim_lie(header: ContributionHeader, limits: Limits) -> str | None:
    """Why `header`'s claims cannot be true, or None: its samples must be the sum of its shards,
    and its samples, steps and δ norm within what one δ can hold (`Limits`)."""
    if sum(header.shards.values()) != header.samples:
        return f"samples {header.samples} are not the sum of its shards"
    if limits.max_samples and header.samples > limits.max_samples:
        return f"{header.samples} samples, more than one δ can hold ({limits.max_samples})"
    if limits.max_steps and header.steps > limits.max_steps:
        return f"{header.steps} steps, more than one δ can hold ({limits.max_steps})"
    bound = limits.max_norm(max(header.steps, 1), header.numel)
    if header.norm > bound:
        return f"norm {header.norm:.4g}, more than {header.steps} steps can move ({bound:.4g})"
    return None


@dataclass(frozen=True, kw_only=True)
class Round:
    """What every member of a group knows about the round, independent of the gathered bytes."""

    run: str
    key: str
    version: int
    state_hash: str
    numel: int
    shapes: str
    staleness_limit: int
    norm_factor: float
    """A declared norm above norm_factor x the group's median norm is excluded (3+ members)."""
    weighting: Weighting = "uniform"
    """How the admitted members' averaging weights follow from their headers (`group_weights`)."""
    limits: Limits = Limits()
    """What one δ can hold (`Limits`); the default bounds nothing (tests)."""


@dataclass(frozen=True)
class Screening:
    """The outcome of `screen_group`, by peer id: accepted headers, excluded members with the
    reason, which of those exclusions rest on evidence the member signed (`banned`), and the
    accepted members' averaging weights."""

    accepted: dict[str, ContributionHeader]
    excluded: dict[str, str]
    banned: frozenset[str] = frozenset()
    """Members of `excluded` whose own signed header for this very round breaks a rule (base
    version, shape, norm bound): evidence the accused signed, so a reason to ban. Every other
    exclusion only excludes: a header that does not verify, one for another round or seen
    before (a leader can list a member that never joined with bytes it made up, or replay one
    the member signed for another group), a key off the allowlist, or the others' word (their
    bans, their silence marks)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Each accepted member's averaging weight (`group_weights`)."""


def group_weights(
    headers: Mapping[str, ContributionHeader], weighting: Weighting
) -> dict[str, float]:
    """Each member's averaging weight, from the signed headers alone, the same on every member.

    uniform: 1. samples: the declared samples, capped at SAMPLES_WEIGHT_CAP x the (low) median
    of the group's declared samples, and at least 1 (a weight must be positive). Never a free number a
    member chooses apart from what it signs (issue 16: an envelope weight of 1e6 steered the
    average to the cosine 1.000 with one member's δ).
    """
    if weighting == "uniform" or not headers:
        return {p: 1.0 for p in headers}
    # the low median: in a group of two, the median of both would let a liar set its own cap
    cap = SAMPLES_WEIGHT_CAP * statistics.median_low(h.samples for h in headers.values())
    return {p: max(1.0, min(float(h.samples), float(cap))) for p, h in headers.items()}


STEPS_NORM_CAP = 2.0
"""`norm_outliers`: a member's declared steps count toward its norm allowance up to this many
times the group's low median steps. Under DyLU honest phases differ in length by the peers'
speeds, and an honest δ's norm grows with its steps (faster than linearly while the learning rate
warms up): on 2026-12-05 a fast peer's first δ (about 50 steps, norm 3.5) was 4.6 x the median
of a group whose others had 18 and 7 steps, and was excluded and banned for 10 versions; its
work piled up in its ledger and came back 568 steps long at staleness 8 (docs/results.md).
Twice, as SAMPLES_WEIGHT_CAP: a liar that claims more steps than it made is admitted with at
most norm_factor x 2 x the median norm, where the rule without steps admitted norm_factor x."""


def norm_outliers(headers: Mapping[str, ContributionHeader], factor: float) -> dict[str, str]:
    """The members whose declared δ norm is too long for the group, with the reason: above
    `factor` x the group's median norm, and also above `factor` x the median norm per step
    (each member's steps capped at STEPS_NORM_CAP x the group's low median steps). A δ within
    either bound is admitted: a short δ is never excluded for being short, and a long one whose
    length its steps explain is not excluded for its length."""
    median = statistics.median(h.norm for h in headers.values())
    cap = STEPS_NORM_CAP * statistics.median_low(max(1, h.steps) for h in headers.values())
    per_step = {p: h.norm / min(max(1, h.steps), cap) for p, h in headers.items()}
    median_step = statistics.median(per_step.values())
    return {
        p: f"norm {h.norm:.4g} above {factor:g} x median {median:.4g}, and per step "
        f"{per_step[p]:.4g} above {factor:g} x median {median_step:.4g}"
        for p, h in headers.items()
        if h.norm > factor * median and per_step[p] > factor * median_step
    }


def screen_group(
    gathered: dict[str, bytes],
    rnd: Round,
    *,
    allow: Callable[[str], bool] = lambda peer: True,
    seen: Callable[[str, str], bool] = lambda peer, nonce: False,
) -> Screening:
    """Decide which members' δs may enter the round; the same on every honest member.

    `gathered` maps each member (authenticated peer id) to its gathered bytes; `allow` is the
    private swarm's allowlist; `seen(peer, nonce)` is this member's replay memory. The checks, in
    order: signed header of that member, for this run and round, with a plausible base version
    and this δ layout; on the allowlist; nonce not replayed; not banned, nor named silent, by
    more than half of the other valid members; declared norm within norm_factor x the median of
    the group's, as it is or per step (`norm_outliers`). Only a rule broken by the member's own
    signed header for this round bans (`Screening.banned`).
    """
    accepted: dict[str, ContributionHeader] = {}
    excluded: dict[str, str] = {}
    banned: set[str] = set()
    nonces: set[str] = set()
    for member in sorted(gathered):
        try:
            header = ContributionHeader.verify_bytes(gathered[member], member)
        except ContributionRejected as e:
            excluded[member] = str(e)  # the leader may have made these bytes up
            continue
        reason = _other_round(header, rnd)  # possibly a header it signed for another group
        if reason is None and not allow(member):
            reason = "not on the swarm's allowlist"
        elif reason is None and (header.nonce in nonces or seen(member, header.nonce)):
            reason = "replayed header (nonce seen before)"
        elif reason is None:
            reason = _broken_rule(header, rnd)
            if reason is not None:
                banned.add(member)  # it signed this for this very round
        if reason is None:
            accepted[member] = header
            nonces.add(header.nonce)
        else:
            excluded[member] = reason
    # the others' word: votes only from members that passed the checks above, never from
    # oneself; it excludes, and never bans (so a ban is never renewed by its own echo)
    for member in list(accepted):
        voters = [h for p, h in accepted.items() if p != member]
        bans = sum(member in h.bans for h in voters)
        silent = sum(member in h.silent for h in voters)
        if voters and bans * 2 > len(voters):
            excluded[member] = f"banned by {bans} of {len(voters)} members"
        elif voters and silent * 2 > len(voters):
            excluded[member] = f"named silent by {silent} of {len(voters)} members"
    for member in excluded:
        accepted.pop(member, None)
    if len(accepted) >= 3:
        for member, reason in norm_outliers(accepted, rnd.norm_factor).items():
            excluded[member] = reason
            banned.add(member)
            del accepted[member]
    weights = group_weights(accepted, rnd.weighting)
    return Screening(accepted, excluded, frozenset(banned), weights)


def _other_round(header: ContributionHeader, rnd: Round) -> str | None:
    if header.run != rnd.run or header.key != rnd.key or header.version != rnd.version:
        return f"header for another round ({header.key}, v{header.version})"
    if header.state_hash != rnd.state_hash:
        return "header for another state"
    return None


def _broken_rule(header: ContributionHeader, rnd: Round) -> str | None:
    """What an honest peer never signs for this round (its round drops a stale δ first)."""
    if header.base_version > rnd.version:
        return f"base version {header.base_version} ahead of the round's {rnd.version}"
    if rnd.version - header.base_version > rnd.staleness_limit:
        return f"stale: base version {header.base_version}, limit {rnd.staleness_limit}"
    if header.numel != rnd.numel or header.shapes != rnd.shapes:
        return f"wrong shape ({header.numel} values)"
    return claim_lie(header, rnd.limits)


class NonceMemory:
    """The nonces of the headers this peer has screened, most recent `capacity` (replays)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._capacity = capacity

    def seen(self, peer: str, nonce: str) -> bool:
        return (peer, nonce) in self._seen

    def remember(self, headers: dict[str, ContributionHeader]) -> None:
        for peer, header in headers.items():
            self._seen[(peer, header.nonce)] = None
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
