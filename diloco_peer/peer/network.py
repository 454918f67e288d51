"""A peer's network parts (DESIGN §2): its DHT node and P2P service, the manifest it agrees on,
the dial-back probe, and the servers it runs (averager, state server, dial-back server).

    node = open_node(spec, key_path, validators, port=spec.port, client_mode=probing)
    signed = agree_on_manifest(node.dht, identity, spec.run_name, founding, stored)
    verdict, port = probe_reachability(node, spec.swarm, prefix)   # a joiner that was not told
    node = node.reopen(...)                                          # ... reachable: a full peer
    net = Network.serve(node, prefix, ...)                           # averager + servers, ready
    ...
    net.shutdown()                                                   # servers, service, DHT
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht import DHT
from hivemind.dht.validation import RecordValidatorBase
from multiaddr import Multiaddr

from diloco_peer.averaging.group_averager import GroupAverager
from diloco_peer.averaging.robust import Aggregation
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free import reachability, records
from diloco_peer.coordinator_free.allowlist import Allowlist
from diloco_peer.coordinator_free.manifest import Manifest, SignedManifest
from diloco_peer.coordinator_free.notes import NoteBox
from diloco_peer.coordinator_free.reachability import DialBackServer
from diloco_peer.coordinator_free.state_transfer import StateBlob, StateServer
from diloco_peer.errors import BadInput, ManifestError, P2PServiceStopped
from diloco_peer.identity import Identity
from diloco_peer.lifeline import Lifeline, end_orphans, live_holders
from diloco_peer.p2p.dht import PeerDHT
from diloco_peer.p2p.service import P2PService
from diloco_peer.peer.catch_up import SwarmDownloads
from diloco_peer.peer.faults import FaultPlan
from diloco_peer.peer.heads import DHT_TIMEOUT_S, MANIFEST_EXPIRATION_S
from diloco_peer.peer.replica import Replica
from diloco_peer.peer.trust import Guard
from diloco_peer.peer_spec import PeerSpec

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
"""Each part's setup (the service's replica, the averager's and servers' handlers)."""
REACHABILITY_TIMEOUT_S = 10.0
"""A joiner's dial-back probe (reachability.py): at most this long before it trains."""
BOOTSTRAP_TRIES = 4
"""Starts of the node while none of the `--swarm` peers answers: a peer busy with a round (or a
machine under load) may not answer a newcomer's first dial in time, so that alone is no reason
to give up; a wrong address fails after the last try."""
BOOTSTRAP_BACKOFF_S = 2.0
"""The wait before the second try; it doubles before each later one."""


def start_lifeline(identity: Identity, tmp: Path, checked: bool = True) -> tuple[Lifeline, Path]:
    """The watcher that ends this peer's DHT process and daemon with it and removes `tmp`
    (lifeline.py), once what a dead previous run with this key left behind is ended; and the
    key file for the daemon, in `tmp`. BadInput if a running peer on this machine holds the key
    (`checked`; a test leaves the check out to play a lookup that missed: key_watch.py)."""
    key = identity.to_bytes()
    holders = live_holders(key) if checked else []
    if holders:
        raise BadInput(f"this peer's key ({identity.peer_id_str}) is already taken by a running "
                       f"peer on this machine (process {holders[0]}); stop it or use another "
                       "--identity")  # fmt: skip
    line = Lifeline.start()
    line.watch_path(tmp)
    line.own_folder(tmp)
    ended = end_orphans(key)
    if ended:
        log.warning("[%s] ended %d process(es) that a killed earlier run with this key left "
                    "running", identity.peer_id_str[-6:], ended)  # fmt: skip
    key_path = tmp / "identity.key"
    key_path.write_bytes(key)
    key_path.chmod(0o600)
    return line, key_path


def load_allowlist(path: str | None, run_name: str, peer_id: str) -> Allowlist | None:
    """`--allowlist`, checked for this run and this peer (its owner is checked against the
    manifest's once that is known: `allowed_by`)."""
    if not path:
        return None
    allowlist = Allowlist.load(path, run=run_name)
    if not allowlist.allows(peer_id):
        raise BadInput(f"this peer's key ({peer_id}) is not on the allowlist")
    return allowlist


def allowed_by(allowlist: Allowlist | None, owner_peer_id: str) -> Callable[[str], bool]:
    """The allowlist's membership test (everyone is allowed without one); BadInput unless the
    run owner signed it."""
    if allowlist is None:
        return lambda peer: True
    if allowlist.owner_peer_id != owner_peer_id:
        raise BadInput(
            f"--allowlist is signed by {allowlist.owner_peer_id}, not by the run owner "
            f"{owner_peer_id}"
        )
    return allowlist.allows


def initial_peer_ids(swarm: Sequence[str]) -> list[str]:
    """The peer ids (base58) in `join --swarm` multiaddrs, each once (checked by the DHT at
    start: every multiaddr there names its peer)."""
    ids = []
    for maddr in swarm:
        with contextlib.suppress(Exception):  # a multiaddr without /p2p/
            ids.append(Multiaddr(maddr).value_for_protocol("p2p"))
    return list(dict.fromkeys(ids))


def run_prefix(run_name: str) -> str:
    """Names the run's streams and group keys (hivemind allows no '.' or '-' in them)."""
    return "dp_" + hashlib.sha256(run_name.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Node:
    """This peer's DHT node (and libp2p daemon) with the process's P2P service on it."""

    dht: DHT
    service: P2PService
    client_mode: bool
    """Dial out only: `--client-mode`, or a joiner no swarm peer could dial (or not yet probed)."""

    def shutdown(self) -> None:
        self.service.shutdown()
        self.dht.shutdown()


def open_node(
    spec: PeerSpec,
    key_path: Path,
    validators: list[RecordValidatorBase],
    *,
    port: int,
    client_mode: bool,
    identity_checked: bool = True,
    lifeline: Lifeline | None = None,
) -> Node:
    """Start the DHT node on `spec.host:port` and a ready P2P service on it; BadInput if the
    node cannot start (a bad address, a busy port, a key already in use). With a `lifeline`, the
    DHT process and its daemon end when this process does, however it dies."""

    def start() -> DHT:
        return PeerDHT(
            lifeline=lifeline,
            start=True,
            identity_path=str(key_path),
            host_maddrs=[f"/ip4/{spec.host}/tcp/{port}"],
            announce_maddrs=list(spec.announce) or None,
            initial_peers=list(spec.swarm),
            record_validators=validators,
            startup_timeout=30,
            client_mode=client_mode,
            # a restart after the reachability probe reuses the key of the node it replaces
            check_if_identity_free=identity_checked,
        )

    dht = start_dht(start)
    service = P2PService(dht)
    service.start()
    service.wait_until_ready(timeout_s=READY_TIMEOUT_S)
    return Node(dht, service, client_mode)


# hivemind's words when the --swarm peer pinged this node back at its announced address and got
# no answer (a NAT or firewall, an address others cannot reach, or this key live in another process
# that took the call), and what a user can do about each
DIAL_BACK_REFUSED = "can't access this node"
DIAL_BACK_HINT = (
    "the --swarm peer could not dial this node back; let inbound TCP in on --port or give --announce "
    "an address others reach, join with --client-mode to dial out only, or stop the other process "
    "that runs this key"
)


def start_dht(start: Callable[[], DHT], sleep: Callable[[float], None] = time.sleep) -> DHT:
    """`start()`, tried again (`BOOTSTRAP_TRIES` in all, with a growing wait) while it fails
    because none of the `--swarm` peers answered; BadInput when it fails for another reason
    (a bad address, a busy port, a key already in use) or the last try fails too."""
    attempt = 1
    while True:
        try:
            return start()
        except Exception as e:  # hivemind reports bad addresses and busy ports this way
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if DIAL_BACK_REFUSED in reason:
                raise BadInput(f"cannot start the peer's network node: {DIAL_BACK_HINT}") from None
            if "bootstrap" not in reason.lower():
                raise BadInput(f"cannot start the peer's network node: {reason}") from None
            if attempt >= BOOTSTRAP_TRIES:
                raise BadInput(f"no peer of --swarm answered ({BOOTSTRAP_TRIES} tries): "
                               f"{reason}") from None  # fmt: skip
            wait_s = BOOTSTRAP_BACKOFF_S * 2 ** (attempt - 1)
            # INFO: bad input must stay one line on stderr if the last try fails too
            log.info("no peer of --swarm answered (try %d of %d); again in %.0f s: %s",
                     attempt, BOOTSTRAP_TRIES, wait_s, reason)  # fmt: skip
            sleep(wait_s)
            attempt += 1


def agree_on_manifest(
    dht: DHT,
    identity: Identity,
    run_name: str,
    founding: tuple[RunSpec, SwarmSettings] | None,
    stored: SignedManifest | None,
    *,
    owner: str | None = None,
    allowlist_owner: str | None = None,
    swarm: Sequence[str] = (),
) -> SignedManifest:
    """The founder publishes the run's manifest (a restarted founder keeps the one its
    checkpoint holds); a joiner fetches and verifies the run owner's. The owner is `owner`
    (`--owner`, else the allowlist's signer), else the one in this peer's checkpoint, else the
    one among the peers of the `swarm` addresses (`records.choose_manifest`)."""
    if founding is None:
        pinned = owner or allowlist_owner or (stored.owner_peer_id if stored else None)
        try:
            return records.fetch_manifest(dht, run_name, timeout_s=DHT_TIMEOUT_S, owner=pinned,
                                          prefer=initial_peer_ids(swarm))  # fmt: skip
        except ManifestError as e:
            if owner is None and allowlist_owner is not None:
                raise ManifestError(f"--allowlist is signed by {allowlist_owner}, not by the run "
                                    f"owner, it seems: {e}") from None  # fmt: skip
            raise
    run, swarm = founding
    signed = stored or Manifest.create(run_name, run, swarm, identity)
    records.publish_manifest(
        dht, identity, signed, expiration_s=MANIFEST_EXPIRATION_S, timeout_s=DHT_TIMEOUT_S
    )
    return signed


def probe_reachability(
    node: Node, swarm: Sequence[str], prefix: str
) -> tuple[reachability.Verdict, int]:
    """Ask a swarm peer to dial this (client-mode) node on its port (reachability.py); the
    verdict and the port asked about."""
    port = 0
    for maddr in node.dht.get_visible_maddrs():
        with contextlib.suppress(Exception):  # an address without a TCP port
            port = int(maddr.value_for_protocol("tcp"))
            break
    servers = initial_peer_ids(swarm)
    verdict = reachability.Verdict("unknown", "no port or no swarm peer to ask")
    if port and servers:
        try:
            verdict = reachability.probe(
                node.service, prefix, servers, port=port, timeout_s=REACHABILITY_TIMEOUT_S
            )
        except (TimeoutError, P2PServiceStopped) as e:
            verdict = reachability.Verdict("unknown", f"the probe failed: {e!r}")
    return verdict, port


def become_reachable(
    node: Node,
    spec: PeerSpec,
    prefix: str,
    key_path: Path,
    validators: list[RecordValidatorBase],
    report: Callable[[reachability.Verdict, int], None],
    lifeline: Lifeline | None = None,
) -> Node:
    """A joiner started in client mode asks a swarm peer to dial it. If one did, or none
    answered, it starts over as a full peer on the same port (the node returned); if none
    could, it stays a client rather than stall every group that would count on reaching it."""
    verdict, port = probe_reachability(node, spec.swarm, prefix)
    report(verdict, port)
    me = node.service.peer_id[-6:]
    if verdict.status == "private":
        log.warning(
            "[%s] no swarm peer can dial this machine (%s): taking part in client mode "
            "(dial out only; see `diloco-peer doctor`, or forward a port and pass --announce)",
            me, verdict.detail,
        )  # fmt: skip
        return node
    log.info("[%s] reachability: %s (%s)", me, verdict.status, verdict.detail)
    node.shutdown()
    return open_node(spec, key_path, validators, port=port, client_mode=False,
                     identity_checked=False, lifeline=lifeline)  # fmt: skip


@dataclass(frozen=True)
class Network:
    """The running network parts of one peer; `shutdown` stops them in order."""

    node: Node
    prefix: str
    averager: GroupAverager
    server: StateServer
    dialback: DialBackServer | None
    notes: NoteBox | None
    """Round notes from other peers (none in client mode: nobody can open a stream to us)."""

    @property
    def dht(self) -> DHT:
        return self.node.dht

    @property
    def client_mode(self) -> bool:
        return self.node.client_mode

    def downloads(self, replica: Replica) -> SwarmDownloads:
        """Downloads from this run's donors, bounded by the sizes of `replica`'s model."""
        return SwarmDownloads(
            self.node.service, self.server.run, max_state_bytes=replica.max_blob_bytes(),
            max_update_bytes=replica.max_record_bytes(),
        )  # fmt: skip

    @classmethod
    def serve(
        cls,
        node: Node,
        prefix: str,
        *,
        run: RunSpec,
        swarm: SwarmSettings,
        guard: Guard,
        faults: FaultPlan,
        blob: Callable[[], StateBlob | None],
        parent: Callable[[], StateBlob | None],
        updates: Callable[[int], bytes | None],
        allow: Callable[[str], bool],
        version: Callable[[], int],
    ) -> Network:
        """Start the averager and the servers on `node` and wait until they serve."""
        averager = GroupAverager(
            node.service, prefix, compression=run.compression,
            prune_fraction=run.prune_fraction,
            aggregation=Aggregation(method=swarm.aggregation, min_cosine=(
                None if swarm.min_cosine <= -1 else swarm.min_cosine)),
            on_group=faults.group_hook(), tamper=guard.tamper, client_mode=node.client_mode,
            withhold_parts=guard.withholds, allow=allow, sign=guard.identity.sign,
            on_proof=guard.convict, equivocate=guard.equivocates, bias=guard.biases,
            frame=guard.frame,
        )  # fmt: skip
        server = StateServer(
            node.service, prefix, blob, updates=updates, earlier=parent, allow=allow
        )
        # joiners ask a peer that accepts connections whether they can be dialed
        dialback = None if node.client_mode else DialBackServer(node.service, prefix)
        notes = None if node.client_mode else NoteBox(node.service, prefix, allow, version)
        parts = [p for p in (averager, server, dialback, notes) if p is not None]
        for part in parts:
            part.start()
        for part in parts:
            part.wait_until_ready(timeout_s=READY_TIMEOUT_S)
        guard.behaviour.serve(node.service, prefix)  # a hostile peer's flood (chaos.py)
        return cls(node, prefix, averager, server, dialback, notes)

    def shutdown(self) -> None:
        """Servers first (best effort: we are leaving anyway), then the service and the DHT."""
        for part in (self.notes, self.dialback, self.server, self.averager):
            if part is not None:
                try:
                    part.shutdown()
                except Exception as e:
                    log.debug("shutdown: %s", e)
        self.node.shutdown()
