"""Seals in the DHT: where the members of a commit put their signatures over it (certificate.py),
for anyone replaying that version to verify (DESIGN §4, certified history).

One key per version, `{run}_seals_{base_version}`, outside the run's schema; each entry sits under
its signer's `[owner:<ssh-rsa key>]` subkey, so hivemind's signature validator binds it to its
writer and nobody can erase or replace another member's seal. Entries expire after a while: a
replay reaches only a few versions back (update_log.replay_horizon).
"""

from __future__ import annotations

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from diloco_peer.coordinator_free.manifest import check_run_name
from diloco_peer.coordinator_free.records import (
    check_seconds,
    owner_subkey,
    subkey_peer_id,
    wait_dht,
)
from diloco_peer.identity import Identity

SEAL_EXPIRATION_S = 900.0
"""How long a seal stays in the DHT: replays reach a few versions, minutes apart."""
MAX_SEAL_BYTES = 16 * 1024
"""A seal is a statement and one signature; larger values are not read (as
`averaging.certificate.MAX_SEAL_BYTES`: a two-stage statement names every member of the
version, about 55 bytes each)."""


def seals_key(run: str, base_version: int) -> str:
    """Where the members of the commit on top of `base_version` put their seals (certificate.py);
    outside the schema (one key per version), each entry under its signer's `[owner:...]`
    subkey, so hivemind's signature validator binds it to its writer."""
    return f"{check_run_name(run)}_seals_{int(base_version)}"


def publish_seal(
    dht: DHT,
    identity: Identity,
    run: str,
    base_version: int,
    data: bytes,
    *,
    expiration_s: float,
    timeout_s: float,
) -> bool:
    """Store this peer's seal of the commit on top of `base_version`; True if a node took it."""
    check_seconds("expiration_s", expiration_s)
    future = dht.store(
        seals_key(run, base_version),
        data,
        get_dht_time() + expiration_s,
        subkey=owner_subkey(identity),
        return_future=True,
    )
    return bool(wait_dht(future, timeout_s, f"publishing a seal of version {base_version + 1}"))


def read_seals(dht: DHT, run: str, base_version: int, *, timeout_s: float) -> dict[str, bytes]:
    """The seals stored for the commit on top of `base_version`, by signer (the peer id of the
    key that signed the DHT entry); entries of no key, or too large, are dropped. Each is still
    only bytes: certificate.verify_update checks them."""
    found = wait_dht(
        dht.get(seals_key(run, base_version), latest=True, return_future=True),
        timeout_s,
        f"reading the seals of version {base_version + 1}",
    )
    if found is None or not isinstance(found.value, dict):
        return {}
    seals: dict[str, bytes] = {}
    for subkey, entry in found.value.items():
        signer = subkey_peer_id(subkey)
        value = getattr(entry, "value", None)
        if signer is None or not isinstance(value, bytes) or len(value) > MAX_SEAL_BYTES:
            continue
        seals[signer] = value
    return seals
