"""The signed run manifest: what every peer of a swarm must agree on before training (DESIGN §4).

A manifest names the run, the protocol version, the shared `RunSpec` and the swarm's round
settings, and carries the owner's public key. The owner signs its canonical JSON bytes; a joiner
refuses a manifest that does not verify, is for another run, or speaks another protocol version.
The SHA-256 of the canonical bytes (`SignedManifest.digest`) enters the replicated state hash
(DESIGN §3), so peers with different manifests can never agree on a state.

Wire form, at most `MAX_MANIFEST_BYTES`:
`{"manifest": "<canonical JSON as a string>", "signature": "<base64>"}`, where the canonical JSON
is `json.dumps(..., sort_keys=True, separators=(",", ":"))` with the public key in base64.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from diloco_peer.config import RunSpec, SwarmSettings, is_finite
from diloco_peer.errors import BadInput, ConfigError, ManifestError
from diloco_peer.identity import Identity, IdentityError, peer_id_from_public_key, verify

tomllib: ModuleType | None
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library
    tomllib = None

PROTOCOL_VERSION = 4
"""Bumped whenever peers of different builds could no longer train together (2: heads carry
`utilization`, which a build of 1 refuses as an unknown field; 3: contribution headers carry
`expected`, two-stage averaging; 4: heads carry `since`, with fragments a version moves one
fragment)."""
MAX_MANIFEST_BYTES = 64 * 1024
RUN_NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"

_RUN_NAME_RE = re.compile(RUN_NAME_PATTERN)
# Prefixed to the canonical bytes before signing, so that a manifest signature can never be
# replayed as a signature of some other message made with the same key (DHT records, headers).
_SIGNING_CONTEXT = b"diloco-peer/manifest\x00"
_MANIFEST_FIELDS = frozenset(
    {"created", "owner_public_key", "protocol_version", "run", "run_name", "swarm"}
)


def check_run_name(name: object) -> str:
    """The run name, or ManifestError. It prefixes DHT keys, so its alphabet is restricted."""
    if not isinstance(name, str) or not _RUN_NAME_RE.fullmatch(name):
        raise ManifestError(f"run name {name!r} must be 1 to 64 characters from A-Z a-z 0-9 _ . -")
    return name


FRAGMENT_OPTIMIZERS = ("sgd", "sgdm", "nesterov")
"""Outer optimizers a fragment can step alone: their state is per parameter, no counter."""


def check_fragments(run: RunSpec, swarm: SwarmSettings) -> None:
    """ConfigError unless the swarm's fragments fit the run: an outer optimizer whose
    state is per parameter (Adam's bias correction and Delayed Nesterov's buffer count steps
    of the whole model), and a phase of at least one step (H / fragments)."""
    if swarm.fragments == 1:
        return
    if run.outer_optimizer not in FRAGMENT_OPTIMIZERS:
        allowed = ", ".join(FRAGMENT_OPTIMIZERS)
        raise ConfigError(f"swarm fragments {swarm.fragments} needs the outer optimizer "
                          f"{allowed}, not {run.outer_optimizer}")  # fmt: skip
    if swarm.fragments > run.inner_steps:
        raise ConfigError(f"swarm fragments {swarm.fragments} is more than H "
                          f"(inner_steps {run.inner_steps})")  # fmt: skip


def load_run_config(path: str | Path) -> tuple[RunSpec, SwarmSettings]:
    """Read a TOML run config with optional tables `[run]` (RunSpec) and `[swarm]`."""
    path = Path(path)
    if tomllib is None:
        raise ConfigError(f"{path}: reading a TOML run config needs Python 3.11 or newer")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"run config {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read run config {path}: {e}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"run", "swarm"})
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; expected [run] and [swarm]"
        )
    try:
        run = RunSpec.from_dict(doc.get("run", {}))
        swarm = SwarmSettings.from_dict(doc.get("swarm", {}))
        check_fragments(run, swarm)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return run, swarm


def dump_run_config(run: RunSpec, swarm: SwarmSettings) -> str:
    """The TOML text `load_run_config` reads back as (run, swarm)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))  # a TOML basic string: JSON escapes are valid TOML escapes

    # TOML has no null: an unset field (None, e.g. `overlap_fold`) is left out, as read back
    lines = ["[run]"]
    lines += [f"{k} = {value(v)}" for k, v in run.to_dict().items() if v is not None]
    lines += ["", "[swarm]"]
    lines += [f"{k} = {value(v)}" for k, v in swarm.to_dict().items() if v is not None]
    return "\n".join(lines) + "\n"


def strict_json_loads(data: bytes | str) -> Any:
    """json.loads that refuses NaN/Infinity, which are not JSON and break equality."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    return json.loads(data, parse_constant=no_constants)


def canonical_json(doc: Any) -> bytes:
    """The one byte string a document is signed as: sorted keys, no spaces, ASCII, finite
    numbers only (ManifestError otherwise); the allowlist signs the same way."""
    try:
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ManifestError("manifest values must be finite numbers") from None
    return text.encode("ascii")  # ensure_ascii (the default) escapes everything else


def strict_b64decode(
    text: Any, what: str, *, doc: str = "manifest", error: type[BadInput] = ManifestError
) -> bytes:
    """Strict base64 of a field `what` of a signed document `doc` (the allowlist shares it)."""
    if not isinstance(text, str):
        raise error(f"{doc} {what} must be a base64 string")
    try:
        decoded = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise error(f"{doc} {what} is not valid base64") from None
    # One spelling per value: b64decode ignores the unused low bits of the last character
    # ("QQ==" and "QR==" both decode to b"A"), which would let a changed byte still verify.
    if base64.b64encode(decoded).decode("ascii") != text:
        raise error(f"{doc} {what} is not canonical base64")
    return decoded


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The content the run owner signs."""

    run_name: str
    """Names the run; prefixes its DHT keys. Pattern RUN_NAME_PATTERN."""
    protocol_version: int = PROTOCOL_VERSION
    run: RunSpec
    swarm: SwarmSettings
    owner_public_key: bytes
    """The owner's libp2p `PublicKey` protobuf (see identity.py)."""
    created: float
    """Unix time of creation; tells an owner's re-issued manifest from the older one."""

    def __post_init__(self) -> None:
        check_run_name(self.run_name)
        if isinstance(self.protocol_version, bool) or not isinstance(self.protocol_version, int):
            raise ManifestError("manifest protocol_version must be an integer")
        if not isinstance(self.run, RunSpec) or not isinstance(self.swarm, SwarmSettings):
            raise ManifestError("manifest run and swarm must be RunSpec and SwarmSettings")
        if isinstance(self.created, bool) or not isinstance(self.created, (int, float)):
            raise ManifestError("manifest created must be a number")
        if not (is_finite(self.created) and self.created >= 0):
            raise ManifestError(f"manifest created must be a finite time, got {self.created}")
        if self.swarm.mixes and self.run.prune_fraction > 0:
            # the reducers' screen takes the term a mix group shares out of each part; pruned
            # parts lack it where they were pruned, and a flipped δ then passed the screen
            raise ManifestError("swarm overlap_fold 'mix' (the overlapped default) needs run "
                                "prune_fraction 0: the cosine screen cannot take the shared term "
                                "out of pruned δs; set overlap_fold = \"rebase\" to prune")  # fmt: skip
        try:
            check_fragments(self.run, self.swarm)
        except ConfigError as e:
            raise ManifestError(f"manifest: {e}") from None
        try:
            peer_id_from_public_key(self.owner_public_key)
        except IdentityError as e:
            raise ManifestError(f"manifest owner_public_key: {e}") from None

    @classmethod
    def create(
        cls, run_name: str, run: RunSpec, swarm: SwarmSettings, owner: Identity
    ) -> SignedManifest:
        """A new manifest of this build's protocol version, signed by `owner`."""
        manifest = cls(
            run_name=run_name,
            run=run,
            swarm=swarm,
            owner_public_key=owner.public_key,
            created=time.time(),
        )
        return manifest.sign(owner)

    def sign(self, owner: Identity) -> SignedManifest:
        if owner.public_key != self.owner_public_key:
            raise ManifestError("a manifest must be signed by the owner it names")
        canonical = self.canonical_bytes()
        return SignedManifest(
            manifest=self, canonical=canonical, signature=owner.sign(_SIGNING_CONTEXT + canonical)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "owner_public_key": base64.b64encode(self.owner_public_key).decode("ascii"),
            "protocol_version": self.protocol_version,
            "run": self.run.to_dict(),
            "run_name": self.run_name,
            "swarm": self.swarm.to_dict(),
        }

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Rebuild from `to_dict()` output; anything else raises ManifestError."""
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        missing = sorted(_MANIFEST_FIELDS - set(data))
        unknown = sorted(set(data) - _MANIFEST_FIELDS)
        if missing or unknown:
            raise ManifestError(
                f"manifest fields differ: missing {missing or 'none'}, unknown {unknown or 'none'}"
            )
        try:
            run = RunSpec.from_dict(data["run"])
            swarm = SwarmSettings.from_dict(data["swarm"])
        except ConfigError as e:
            raise ManifestError(f"manifest config: {e}") from None
        return cls(
            run_name=data["run_name"],
            protocol_version=data["protocol_version"],
            run=run,
            swarm=swarm,
            owner_public_key=strict_b64decode(data["owner_public_key"], "owner_public_key"),
            created=data["created"],
        )


@dataclass(frozen=True, kw_only=True)
class SignedManifest:
    """A manifest with its canonical bytes and the owner's signature of them.

    Built only by `Manifest.sign`/`Manifest.create` or `from_bytes`; construction re-checks
    that the bytes are the manifest's and that the signature verifies, so an instance is valid.
    """

    manifest: Manifest
    canonical: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if self.manifest.canonical_bytes() != self.canonical:
            raise ManifestError("manifest is not in canonical form")
        if not verify(
            self.manifest.owner_public_key, _SIGNING_CONTEXT + self.canonical, self.signature
        ):
            raise ManifestError("manifest signature does not verify with the owner's key")

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the canonical bytes: the manifest's part of the state hash."""
        return hashlib.sha256(self.canonical).hexdigest()

    @property
    def owner_peer_id(self) -> str:
        """The base58 peer id of the owner's key."""
        return peer_id_from_public_key(self.manifest.owner_public_key)

    def to_bytes(self) -> bytes:
        envelope = {
            "manifest": self.canonical.decode("ascii"),
            "signature": base64.b64encode(self.signature).decode("ascii"),
        }
        data = canonical_json(envelope)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
            )
        return data

    @classmethod
    def from_bytes(cls, data: bytes, expected_run: str | None = None) -> SignedManifest:
        """Parse and check a manifest from the network or a file; ManifestError on any defect.

        Checks, in order: size, envelope shape, protocol version (so a newer build's manifest
        is named as such even if its shape changed), owner signature, fields, run name.
        """
        if not isinstance(data, (bytes, bytearray)):
            raise ManifestError(f"manifest must be bytes, got {type(data).__name__}")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
            )
        try:
            envelope = strict_json_loads(bytes(data))
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
            raise ManifestError("manifest is not valid JSON") from None
        if (
            not isinstance(envelope, dict)
            or set(envelope) != {"manifest", "signature"}
            or not isinstance(envelope["manifest"], str)
        ):
            raise ManifestError(
                'manifest must be a JSON object {"manifest": str, "signature": str}'
            )
        signature = strict_b64decode(envelope["signature"], "signature")
        try:
            canonical = envelope["manifest"].encode("ascii")
            body = strict_json_loads(canonical)
        except (ValueError, RecursionError):
            raise ManifestError("manifest body is not valid canonical JSON") from None
        if not isinstance(body, dict):
            raise ManifestError("manifest body must be a JSON object")

        version = body.get("protocol_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ManifestError("manifest has no valid protocol_version")
        if version != PROTOCOL_VERSION:
            raise ManifestError(
                f"manifest of protocol version {version}, this build speaks {PROTOCOL_VERSION}"
            )
        owner_key = strict_b64decode(body.get("owner_public_key"), "owner_public_key")
        # Verify before interpreting anything else: unsigned content is never trusted.
        if not verify(owner_key, _SIGNING_CONTEXT + canonical, signature):
            raise ManifestError("manifest signature does not verify with the owner's key")

        signed = cls(manifest=Manifest.from_dict(body), canonical=canonical, signature=signature)
        if expected_run is not None and signed.manifest.run_name != expected_run:
            raise ManifestError(
                f"manifest is for run {signed.manifest.run_name!r}, expected {expected_run!r}"
            )
        return signed
