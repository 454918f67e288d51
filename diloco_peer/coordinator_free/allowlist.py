"""Private swarms: the run owner's signed list of the public keys that may take part (DESIGN §4).

The owner (the key that signs the run manifest) signs a list of libp2p public keys for one run;
peers of a private swarm accept contributions, state requests and group members only from the
peer ids of those keys. The owner's own key is always allowed, listed or not: the owner signs
the manifest and the list, so refusing it would protect nothing.

File form, at most `MAX_ALLOWLIST_BYTES`: one canonical JSON object (sorted keys, no spaces,
ASCII) and a newline,

    {"format":"diloco-peer/allowlist-v1","owner_public_key":"<base64>",
     "public_keys":["<base64>",...],"run":"<run name>","signature":"<base64>"}

where the keys are libp2p `PublicKey` protobufs in their canonical encoding
(`identity.normalize_public_key`), sorted and without duplicates, and `signature` is the owner's
RSA-PSS signature (identity.py) of `b"diloco-peer/allowlist\\0"` + the canonical JSON of the
other four fields. A reader accepts only that canonical form, so a list has exactly one encoding
and any edit is refused as such, not reinterpreted.
"""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_peer.coordinator_free.manifest import (
    canonical_json,
    check_run_name,
    strict_b64decode,
    strict_json_loads,
)
from diloco_peer.errors import ConfigError, IdentityError, ManifestError
from diloco_peer.identity import (
    Identity,
    normalize_public_key,
    peer_id_from_public_key,
    verify,
    write_file,
)

FORMAT = "diloco-peer/allowlist-v1"
"""The `format` tag of an allowlist; another tag is refused."""
MAX_ALLOWLIST_BYTES = 1 << 20
"""About 2,500 RSA-2048 keys; a larger file is refused before it is parsed."""

# Prefixed to the signed bytes, so that an allowlist signature can never be replayed as the
# signature of a manifest, a DHT record or a header made with the same key.
_SIGNING_CONTEXT = b"diloco-peer/allowlist\x00"
_FIELDS = frozenset({"format", "owner_public_key", "public_keys", "run", "signature"})


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _body(run: str, owner_public_key: bytes, public_keys: tuple[bytes, ...]) -> dict[str, Any]:
    """What the owner signs: every field but the signature."""
    return {
        "format": FORMAT,
        "owner_public_key": _b64(owner_public_key),
        "public_keys": [_b64(k) for k in public_keys],
        "run": run,
    }


def _decode(text: Any, what: str) -> bytes:
    return strict_b64decode(text, what, doc="allowlist", error=ConfigError)


@dataclass(frozen=True, kw_only=True)
class Allowlist:
    """The public keys the run owner allows into a run, with the owner's signature.

    Built only by `create` or `from_bytes`/`load`; construction checks every field and the
    signature, so an instance is a valid, verified list. Immutable.
    """

    run: str
    """The run it is for (RUN_NAME_PATTERN, as in the manifest)."""
    owner_public_key: bytes
    """The signer's libp2p `PublicKey` protobuf: must be the manifest owner's (`from_bytes`
    checks it when given the owner's key)."""
    public_keys: tuple[bytes, ...]
    """Allowed keys, canonical libp2p `PublicKey` protobufs, sorted, without duplicates."""
    signature: bytes
    """The owner's signature of the other fields (module docstring)."""
    _peer_ids: frozenset[str] = field(init=False, repr=False, compare=False)
    _bytes: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.run, str):
            raise ConfigError("allowlist run must be a string")
        try:
            check_run_name(self.run)
        except ManifestError as e:
            raise ConfigError(f"allowlist {e}") from None
        if not isinstance(self.owner_public_key, bytes):
            raise ConfigError("allowlist owner_public_key must be bytes")
        try:
            owner = peer_id_from_public_key(self.owner_public_key)
        except IdentityError as e:
            raise ConfigError(f"allowlist owner key: {e}") from None
        if not isinstance(self.public_keys, tuple) or not all(
            isinstance(k, bytes) for k in self.public_keys
        ):
            raise ConfigError("allowlist public_keys must be a tuple of bytes")
        if not isinstance(self.signature, bytes):
            raise ConfigError("allowlist signature must be bytes")
        body = _body(self.run, self.owner_public_key, self.public_keys)
        data = canonical_json({**body, "signature": _b64(self.signature)})
        if len(data) + 1 > MAX_ALLOWLIST_BYTES:
            raise ConfigError(
                f"allowlist takes {len(data) + 1} bytes, more than the {MAX_ALLOWLIST_BYTES} "
                f"allowed ({len(self.public_keys)} keys)"
            )
        # Verify before parsing the listed keys: unsigned content is never interpreted.
        signed = _SIGNING_CONTEXT + canonical_json(body)
        if not verify(self.owner_public_key, signed, self.signature):
            raise ConfigError(f"allowlist signature does not verify with its owner's key ({owner})")
        ids = {owner}
        for i, key in enumerate(self.public_keys):
            try:
                if normalize_public_key(key) != key:
                    raise IdentityError("not in the canonical encoding")
                ids.add(peer_id_from_public_key(key))
            except IdentityError as e:
                raise ConfigError(f"allowlist public key {i + 1}: {e}") from None
        if list(self.public_keys) != sorted(set(self.public_keys)):
            raise ConfigError("allowlist public keys must be sorted and without duplicates")
        object.__setattr__(self, "_peer_ids", frozenset(ids))
        object.__setattr__(self, "_bytes", data + b"\n")

    @classmethod
    def create(cls, owner: Identity, run: str, public_keys: Iterable[bytes]) -> Allowlist:
        """A list of `public_keys` (any libp2p encoding; deduplicated and sorted) for `run`,
        signed by `owner`. ConfigError names the first key that is not a usable RSA key."""
        keys: set[bytes] = set()
        for i, key in enumerate(public_keys):
            try:
                keys.add(normalize_public_key(key))
            except IdentityError as e:
                raise ConfigError(f"public key {i + 1}: {e}") from None
        ordered = tuple(sorted(keys))
        try:
            check_run_name(run)
        except ManifestError as e:
            raise ConfigError(str(e)) from None
        body = canonical_json(_body(run, owner.public_key, ordered))
        return cls(
            run=run,
            owner_public_key=owner.public_key,
            public_keys=ordered,
            signature=owner.sign(_SIGNING_CONTEXT + body),
        )

    def to_bytes(self) -> bytes:
        """The file form: canonical JSON and a newline (module docstring)."""
        return self._bytes

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        run: str | None = None,
        owner_public_key: bytes | None = None,
    ) -> Allowlist:
        """Parse and verify an allowlist; with `run` / `owner_public_key` (the manifest's run
        name and owner key), also check that it is that run's and signed by that owner.

        Raises ConfigError with one clear reason for anything wrong, whatever the bytes.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"an allowlist is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_ALLOWLIST_BYTES:
            raise ConfigError(
                f"allowlist is {len(data)} bytes, more than the {MAX_ALLOWLIST_BYTES} allowed"
            )
        try:
            doc = strict_json_loads(data)
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
            raise ConfigError("allowlist is not valid JSON") from None
        if not isinstance(doc, dict) or set(doc) != _FIELDS:
            raise ConfigError(
                f"allowlist must be a JSON object with fields {', '.join(sorted(_FIELDS))}"
            )
        if doc["format"] != FORMAT:
            tag = doc["format"] if isinstance(doc["format"], str) else type(doc["format"]).__name__
            raise ConfigError(
                f"not a diloco-peer allowlist (format {tag[:64]!r}, {FORMAT} expected)"
            )
        if not isinstance(doc["public_keys"], list):
            raise ConfigError("allowlist public_keys must be a list of base64 strings")
        allowlist = cls(
            run=doc["run"],
            owner_public_key=_decode(doc["owner_public_key"], "owner_public_key"),
            public_keys=tuple(_decode(k, "public key") for k in doc["public_keys"]),
            signature=_decode(doc["signature"], "signature"),
        )
        if data.strip() != allowlist.to_bytes().strip():
            raise ConfigError(
                "allowlist is not in canonical form (edited?); recreate it with `diloco-peer allow`"
            )
        if owner_public_key is not None:
            expected = peer_id_from_public_key(owner_public_key)
            if allowlist.owner_peer_id != expected:
                raise ConfigError(
                    f"allowlist is signed by {allowlist.owner_peer_id}, not by the run owner "
                    f"{expected}"
                )
        if run is not None and allowlist.run != run:
            raise ConfigError(f"allowlist is for run {allowlist.run!r}, not {run!r}")
        return allowlist

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        run: str | None = None,
        owner_public_key: bytes | None = None,
    ) -> Allowlist:
        """`from_bytes` of a file; ConfigError naming the file if it is missing, unreadable or
        not a valid allowlist (for `run`, signed by `owner_public_key`)."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise ConfigError(f"allowlist {path} is not a regular file")
                data = f.read(MAX_ALLOWLIST_BYTES + 1)
        except FileNotFoundError:
            raise ConfigError(
                f"allowlist {path} does not exist; the run owner creates it with `diloco-peer allow`"
            ) from None
        except IsADirectoryError:
            raise ConfigError(f"allowlist {path} is not a regular file") from None
        except OSError as e:
            raise ConfigError(f"cannot read allowlist {path}: {e.strerror or e}") from None
        try:
            return cls.from_bytes(data, run=run, owner_public_key=owner_public_key)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def save(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write `to_bytes()` atomically (mode 0644: an allowlist is public); an existing file
        is replaced only with `overwrite`."""
        write_file(path, self.to_bytes(), overwrite=overwrite, private=False, error=ConfigError)

    @property
    def owner_peer_id(self) -> str:
        """The base58 peer id of the owner's key."""
        return peer_id_from_public_key(self.owner_public_key)

    @property
    def peer_ids(self) -> frozenset[str]:
        """Base58 peer ids of every allowed key, the owner's included."""
        return self._peer_ids

    def allows(self, peer_id: str) -> bool:
        """Whether the peer with this base58 id may take part (the owner always may)."""
        return peer_id in self._peer_ids


__all__ = ["FORMAT", "MAX_ALLOWLIST_BYTES", "Allowlist"]
