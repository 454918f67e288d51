"""What `diloco-peer status` shows: the live peers of a run as their heads say, with the forks
and bans among them, read by a throwaway client-mode DHT node. The rules (liveness, forks, bans)
are the swarm view's (swarm_view.py), the same code the peers run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hivemind.dht import DHT

from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.manifest import SignedManifest, check_run_name
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HeadBook, bans, forks
from diloco_peer.errors import BadInput
from diloco_peer.identity import Identity

READ_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 30.0


class SwarmReader:
    """A client-mode DHT node for reading one run's records (`status`, `dashboard`), under a
    throwaway key or `identity` (a private swarm's allowlisted key); BadInput if the swarm
    cannot be reached. With `allowed` (a private swarm's allowlist, peer ids) the node checks
    records as the swarm's peers do, and the heads of other keys are dropped."""

    def __init__(
        self,
        swarm: Sequence[str],
        run: str,
        *,
        identity: Identity | None = None,
        allowed: frozenset[str] | None = None,
    ) -> None:
        self.run, self.allowed = check_run_name(run), allowed
        ident = identity or Identity.generate()
        with tempfile.TemporaryDirectory() as tmp:
            key = Path(tmp) / "id.key"
            key.write_bytes(ident.to_bytes())
            try:
                self.dht = DHT(
                    start=True, identity_path=str(key), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=list(swarm), client_mode=True,
                    record_validators=records.record_validators(ident, run, allowed),
                    startup_timeout=STARTUP_TIMEOUT_S,
                )  # fmt: skip
            except Exception as e:
                last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                raise BadInput(f"cannot reach the swarm: {last}") from None

    def heads(self, timeout_s: float = READ_TIMEOUT_S) -> dict[str, PeerHead]:
        """The run's heads as published now (SwarmTimeout if the DHT does not answer)."""
        allow = None if self.allowed is None else self.allowed.__contains__
        return records.read_heads(self.dht, self.run, timeout_s=timeout_s, allow=allow)

    def manifest(
        self, owner: str | None = None, timeout_s: float = READ_TIMEOUT_S
    ) -> SignedManifest:
        """The run's verified manifest; ManifestError (bad input) if the swarm has none."""
        return records.fetch_manifest(self.dht, self.run, timeout_s=timeout_s, owner=owner)

    def close(self) -> None:
        self.dht.shutdown()


def read_heads(swarm: Sequence[str], run: str) -> dict[str, PeerHead]:
    """The heads of `run` as published in the swarm reached through `swarm` (multiaddrs), read
    by a client-mode node with a throwaway key; BadInput if the swarm cannot be reached."""
    reader = SwarmReader(swarm, run)
    try:
        return reader.heads()
    finally:
        reader.close()


def status_document(run: str, heads: Mapping[str, PeerHead], now: float) -> dict[str, Any]:
    """The JSON document of `status --json`: the live peers (newest version first), the head
    version, forks (versions with more than one state hash) and bans (who bans whom, why)."""
    book = HeadBook(me="")
    book.merge(heads, now)
    live = book.live(now)  # peers that left (or went silent past the TTL) are not listed
    banned = {
        peer: {"by": list(b.by), "reasons": list(b.reasons)}
        for peer, b in bans(live.values()).items()
    }
    peers = [
        {"peer_id": h.peer_id, "version": h.version, "state_hash": h.state_hash,
         "speed": h.speed, "loss": h.loss, "last_seen_s": now - h.updated, "in_group": h.in_group,
         "rss_mb": h.rss_mb, "cpu_percent": h.cpu_percent, "gpu_mem_mb": h.gpu_mem_mb,
         "utilization": h.utilization, "client": h.client, "banned_by": len(banned.get(h.peer_id, {}).get("by", []))}
        for h in sorted(live.values(), key=lambda h: (-h.version, h.peer_id))
    ]  # fmt: skip
    return {
        "run": run,
        "head_version": max((h.version for h in live.values()), default=None),
        "peers": peers,
        "forks": {str(v): hashes for v, hashes in forks(live.values()).items()},
        "banned": banned,
    }
