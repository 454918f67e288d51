"""The swarm's signed DHT records: per-peer heads and the run manifest (DESIGN §3 step 1, §4).

Keys live under the run name (`SchemaValidator(prefix=run)`):

- `{run}_heads`: a dictionary with one entry per peer. Its subkey is the writer's
  `[owner:<ssh-rsa key>]` marker, so hivemind's `RSASignatureValidator` only accepts entries
  signed by that key: nobody can overwrite another peer's head. A reader also checks that the
  head's `peer_id` is the hash of that key, so nobody can publish a head in another's name.
- `{run}_manifest`: the owner-signed `SignedManifest` bytes, one entry per publisher (subkey as
  above). Any peer may republish the manifest to keep it alive after the owner leaves, and nobody
  can erase or replace another publisher's copy; readers verify every copy.

Every node of the swarm needs these validators (`record_validators`): a node without an
`RSASignatureValidator` cannot parse signed values and its `get()` never resolves. Every DHT call
here therefore waits on a future with a timeout and raises `SwarmTimeout` instead of hanging.
The schemas are module-level classes because the DHT runs in a forked process that unpickles
its validators.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from diloco_peer.coordinator_free.manifest import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    SignedManifest,
    check_run_name,
)
from diloco_peer.errors import ConfigError, RecordError, SwarmTimeout
from diloco_peer.identity import (
    Identity,
    IdentityError,
    peer_id_from_public_key,
    public_key_from_openssh,
)

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{1,128}\Z"  # base58, no 0 O I l
_HEX64_PATTERN = r"^[0-9a-f]{64}\Z"
_MAX_VERSION = 2**63 - 1  # msgpack carries 64-bit integers
MAX_BANS = 64
"""Bans a head lists (the most recent); more would only make the record large."""
MAX_PLAN_SHARDS = 256
"""Shards a head's phase plan lists (a peer publishes its largest); in-flight counting is a
hint, and a bound keeps the record small."""
MAX_BAN_REASON = 200


# ------------------------------------------------------------------ schemas (checked by the DHT)
# Strict types throughout: SchemaValidator rejects any record pydantic would have to convert,
# and that check cannot tell 3 from 3.0 unless the types are strict.


class HeadRecord(pydantic.BaseModel):
    """Wire form of a `PeerHead`."""

    peer_id: pydantic.constr(strict=True, regex=_PEER_ID_PATTERN)  # type: ignore[valid-type]
    version: pydantic.conint(strict=True, ge=0, le=_MAX_VERSION)  # type: ignore[valid-type]
    state_hash: pydantic.constr(strict=True, regex=_HEX64_PATTERN)  # type: ignore[valid-type]
    speed: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)  # type: ignore[valid-type]
    samples_per_s: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)  # type: ignore[valid-type]
    loss: pydantic.confloat(strict=True, allow_inf_nan=False) | None  # type: ignore[valid-type]
    updated: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)  # type: ignore[valid-type]
    in_group: pydantic.StrictBool
    rss_mb: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    cpu_percent: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    gpu_mem_mb: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    eta: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    utilization: pydantic.confloat(strict=True, ge=0.0, le=1.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    since: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False) | None = None  # type: ignore[valid-type]
    plan: (
        dict[
            pydantic.constr(strict=True, regex=r"^(0|[1-9][0-9]{0,6})$"),  # type: ignore[valid-type]
            pydantic.conint(strict=True, ge=1, le=1 << 40),  # type: ignore[valid-type]
        ]
        | None
    ) = None
    bans: (
        dict[
            pydantic.constr(strict=True, regex=_PEER_ID_PATTERN),  # type: ignore[valid-type]
            pydantic.constr(strict=True, max_length=MAX_BAN_REASON),  # type: ignore[valid-type]
        ]
        | None
    ) = None
    client: pydantic.StrictBool = False

    class Config:
        extra = pydantic.Extra.forbid


class SwarmRecords(pydantic.BaseModel):
    """All keys of one run, as `SchemaValidator(SwarmRecords, prefix=run)` sees them."""

    heads: dict[BytesWithPublicKey, HeadRecord]
    manifest: dict[
        BytesWithPublicKey,
        pydantic.conbytes(strict=True, max_length=MAX_MANIFEST_BYTES),  # type: ignore[valid-type]
    ]

    class Config:
        # SchemaValidator sets `Config.extra` on the schema it is given; without a Config of our
        # own that would be pydantic's global BaseConfig, changing every other v1 model.
        extra = pydantic.Extra.forbid


# ------------------------------------------------------------------ the head a peer publishes


@dataclass(frozen=True, kw_only=True)
class PeerHead:
    """What a live peer tells the swarm about itself (DESIGN §3 step 1)."""

    peer_id: str
    """Base58 peer id; must be the hash of the key that signs the record."""
    version: int
    """Version of the replicated state the peer holds."""
    state_hash: str
    """Hex SHA-256 of that state."""
    speed: float = 0.0
    """Inner steps per second (feeds DyLU)."""
    samples_per_s: float = 0.0
    loss: float | None = None
    """Last training loss; None before the first step."""
    updated: float = field(default_factory=get_dht_time)
    """DHT time (Unix seconds) of publication."""
    in_group: bool = False
    """True while the peer is in a round's group (matchmaking or all-reduce)."""
    rss_mb: float | None = None
    """The peer process's resident memory, MB (resource use shown by `status`)."""
    cpu_percent: float | None = None
    """CPU use of the peer process since its previous head, percent of one core."""
    gpu_mem_mb: float | None = None
    """GPU memory the peer's tensors hold, MB; None without a GPU."""
    eta: float | None = None
    """DHT time at which the peer expects its current local phase to end; None when it is not
    training. Async groups wait only for peers expected within the grace period."""
    plan: dict[str, int] | None = None
    """Samples the current phase will train per shard (shard number as text), with `eta`; the
    shard filler counts them as in flight."""
    bans: dict[str, str] | None = None
    """Peers this peer currently bans (DESIGN §4), with the reason; `status` shows them."""
    client: bool = False
    """The peer dials out only (`join --client-mode`): nobody can download state from it."""
    utilization: float | None = None
    """Share of the wall time of the peer's last round that it trained (compute over wall
    seconds, `Counters.utilization`); None before its first applied round."""
    since: float | None = None
    """DHT time at which the publishing process started (its incarnation): two processes that
    sign heads with one key tell each other apart by it (key_watch.py)."""

    def __post_init__(self) -> None:
        # Accept ints for float fields (speed=0), as the wire schema will not.
        for name in (
            "speed",
            "samples_per_s",
            "loss",
            "updated",
            "rss_mb",
            "cpu_percent",
            "gpu_mem_mb",
            "eta",
            "utilization",
            "since",
        ):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                try:
                    object.__setattr__(self, name, float(value))
                except OverflowError:
                    raise RecordError(f"invalid peer head: {name} is out of range") from None
        if self.bans is not None and len(self.bans) > MAX_BANS:
            raise RecordError(f"invalid peer head: more than {MAX_BANS} bans")
        if self.plan is not None and len(self.plan) > MAX_PLAN_SHARDS:
            raise RecordError(f"invalid peer head: a plan of more than {MAX_PLAN_SHARDS} shards")
        try:
            HeadRecord.parse_obj(dataclasses.asdict(self))
        except pydantic.ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise RecordError(f"invalid peer head: {problems}") from None

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, value: Any) -> PeerHead:
        """Parse a record value from the DHT; RecordError if it is not a valid head."""
        if not isinstance(value, dict):
            raise RecordError("a peer head record must be a dictionary")
        try:
            parsed = HeadRecord.parse_obj(value)
        except pydantic.ValidationError as e:
            raise RecordError(f"invalid peer head: {e.errors()[0]['msg']}") from None
        if parsed.dict() != value:  # pydantic converted something: not the strict wire form
            raise RecordError("invalid peer head: fields of the wrong type")
        return cls(**parsed.dict())


# ------------------------------------------------------------------ keys and validators


def heads_key(run: str) -> str:
    return f"{check_run_name(run)}_heads"


def manifest_key(run: str) -> str:
    return f"{check_run_name(run)}_manifest"


def owner_subkey(identity: Identity) -> bytes:
    """The `[owner:<ssh-rsa key>]` subkey under which only `identity` can write.

    Equal to `RSASignatureValidator(identity.hivemind_private_key()).local_public_key`.
    """
    ssh_key = identity.hivemind_private_key().get_public_key().to_bytes()
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", ssh_key)


def subkey_peer_id(subkey: Any) -> str | None:
    """The peer id of the key named by an `[owner:...]` subkey, or None if it names none."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_RE.fullmatch(subkey)
    if match is None:
        return None
    try:
        return peer_id_from_public_key(public_key_from_openssh(match.group(1)))
    except IdentityError:
        return None


class _QuietSignatureValidator(RSASignatureValidator):
    """hivemind's signature validator, answering False where the original raises on hostile
    bytes (`[owner:<garbage>]` raises ValueError): a refusal, not a logged traceback."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except Exception as e:  # any malformed record is simply not valid
            logger.debug("refusing a malformed signed record: %r", e)
            return False


class _QuietSchemaValidator(SchemaValidator):
    """hivemind's schema validator, answering False where the original raises on hostile bytes
    (an unhashable msgpack subkey raises TypeError)."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except Exception as e:
            logger.debug("refusing a malformed record: %r", e)
            return False


class AllowlistValidator(RecordValidatorBase):
    """Private swarms: this node stores and accepts the run's heads only from the keys of the
    allowlist (DESIGN §4). Manifest copies stay open: each is verified against the owner's
    signature anyway, and a joiner must read the manifest to learn that its allowlist is not
    the owner's. Other keys stay unaffected.

    Module-level and made of plain data, because the DHT's forked process unpickles it.
    """

    def __init__(self, run: str, peer_ids: frozenset[str]) -> None:
        self._guarded = {DHTID.generate(source=heads_key(run)).to_bytes()}
        self._peer_ids = frozenset(peer_ids)

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._guarded:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # any garbage: not a writer we know
            return False
        return subkey_peer_id(subkey) in self._peer_ids

    @property
    def priority(self) -> int:
        return 5  # after the signature validator has checked and stripped the signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def record_validators(
    identity: Identity, run: str, allowed: frozenset[str] | None = None
) -> list[RecordValidatorBase]:
    """Validators for `DHT(record_validators=...)`: sign as `identity`, check this run's schemas
    and, in a private swarm, that the writer is on the allowlist (`allowed` peer ids).

    Keys outside this run's schema stay allowed: other components keep their own DHT keys.
    """
    check_run_name(run)
    validators: list[RecordValidatorBase] = [
        _QuietSignatureValidator(identity.hivemind_private_key()),
        _QuietSchemaValidator(SwarmRecords, prefix=run, allow_extra_keys=True),
    ]
    if allowed is not None:
        validators.append(AllowlistValidator(run, allowed))
    return validators


def check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value}")


def wait_dht(future: Any, timeout_s: float, what: str) -> Any:
    """The result of a hivemind MPFuture, or SwarmTimeout after `timeout_s` seconds."""
    check_seconds("timeout_s", timeout_s)
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise SwarmTimeout(f"{what} did not finish within {timeout_s:g} s") from None


# ------------------------------------------------------------------ heads


def publish_head(
    dht: DHT, identity: Identity, run: str, head: PeerHead, *, expiration_s: float, timeout_s: float
) -> bool:
    """Store this peer's head for `expiration_s` seconds; True if at least one node took it."""
    if head.peer_id != identity.peer_id_str:
        raise RecordError(f"head of {head.peer_id} cannot be published as {identity.peer_id_str}")
    check_seconds("expiration_s", expiration_s)
    future = dht.store(
        heads_key(run),
        head.to_record(),
        get_dht_time() + expiration_s,
        subkey=owner_subkey(identity),
        return_future=True,
    )
    return bool(wait_dht(future, timeout_s, f"publishing the head of run {run}"))


def read_heads(
    dht: DHT, run: str, *, timeout_s: float, allow: Callable[[str], bool] | None = None
) -> dict[str, PeerHead]:
    """Live peers' heads by peer id; entries not bound to their signer's key are dropped, and
    so are those of peers `allow` refuses (a private swarm's allowlist)."""
    found = wait_dht(
        dht.get(heads_key(run), latest=True, return_future=True),
        timeout_s,
        f"reading the heads of run {run}",
    )
    if found is None or not isinstance(found.value, dict):
        return {}
    heads: dict[str, PeerHead] = {}
    for subkey, entry in found.value.items():
        signer = subkey_peer_id(subkey)
        try:
            head = PeerHead.from_record(entry.value)
        except RecordError as e:
            logger.debug("dropping a head of run %s: %s", run, e)
            continue
        if signer is None or head.peer_id != signer:
            logger.debug("dropping a head of %s signed by %s", head.peer_id, signer)
            continue
        if allow is not None and not allow(signer):
            logger.debug("dropping the head of %s: not on the allowlist", signer)
            continue
        # A key could sign several subkey spellings; its newest head wins.
        current = heads.get(head.peer_id)
        if current is None or (head.updated, head.version) > (current.updated, current.version):
            heads[head.peer_id] = head
    return heads


# ------------------------------------------------------------------ manifest


def publish_manifest(
    dht: DHT, identity: Identity, signed: SignedManifest, *, expiration_s: float, timeout_s: float
) -> bool:
    """Store (or refresh) a copy of the run manifest under this publisher's own subkey."""
    run = signed.manifest.run_name
    check_seconds("expiration_s", expiration_s)
    future = dht.store(
        manifest_key(run),
        signed.to_bytes(),
        get_dht_time() + expiration_s,
        subkey=owner_subkey(identity),
        return_future=True,
    )
    return bool(wait_dht(future, timeout_s, f"publishing the manifest of run {run}"))


def fetch_manifest(
    dht: DHT,
    run: str,
    *,
    timeout_s: float,
    owner: str | None = None,
    prefer: Sequence[str] = (),
) -> SignedManifest:
    """The run's manifest from the swarm, verified; ManifestError if none valid is found.

    Anyone may publish a manifest under a run's name, so the owner decides (`choose_manifest`):
    `owner` (a base58 peer id) pins it and every other owner's copies are ignored; without a pin,
    one owner is taken as is, and among several the first of `prefer` (the peers this one was
    told to dial) that owns one. Among one owner's manifests the newest wins.
    """
    found = wait_dht(
        dht.get(manifest_key(run), latest=True, return_future=True),
        timeout_s,
        f"fetching the manifest of run {run}",
    )
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    valid: list[SignedManifest] = []
    rejected: list[str] = []
    for entry in entries.values():
        try:
            valid.append(SignedManifest.from_bytes(entry.value, expected_run=run))
        except ManifestError as e:
            rejected.append(str(e))
    return choose_manifest(run, valid, rejected, owner=owner, prefer=prefer)


def choose_manifest(
    run: str,
    valid: Sequence[SignedManifest],
    rejected: Sequence[str] = (),
    *,
    owner: str | None = None,
    prefer: Sequence[str] = (),
) -> SignedManifest:
    """The manifest to follow among verified copies (see `fetch_manifest`)."""
    if owner is None:
        owners = {m.owner_peer_id for m in valid}
        owner = next((p for p in prefer if p in owners), None)
        if owner is None and len(owners) > 1:
            raise ManifestError(
                f"run {run} has manifests from {len(owners)} different owners "
                f"({', '.join(sorted(owners))}); pass --owner with the run owner's peer id"
            )
    mine = [m for m in valid if owner is None or m.owner_peer_id == owner]
    if not mine:
        message = f"no manifest for run {run} found in the swarm"
        if owner is not None:
            message = f"no manifest for run {run} signed by {owner} found in the swarm"
        if rejected:
            message += f" ({len(rejected)} invalid cop{'y' if len(rejected) == 1 else 'ies'} ignored: {rejected[0]})"
        raise ManifestError(message)
    return max(mine, key=lambda m: (m.manifest.created, m.digest))
