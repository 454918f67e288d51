"""`doctor`'s measurements: one throwaway DHT node joins the swarm as `join` would (server
mode, on `--host`/`--port`, with the run's record validators: without them a node cannot read
signed records), reads the heads and the manifest, pings peers and waits to be dialed back. It
publishes nothing; when it leaves, the swarm sees a peer that left.

Reachability. hivemind's own test is the validated ping: a server-mode node sends
`rpc_ping(validate=True)` and the receiver pings it back before answering `available`. libp2p
sends that ping back over the connection we opened, so it passes behind any NAT (measured: it
passes while the node announces a dead address). The real test comes next: the node hangs up on
every peer and waits for one to dial it afresh. Its DHT id is that of the run's heads key, so
it is the nearest node to that key and every live peer's next heartbeat (HEARTBEAT_S) stores
its head there; the node itself dials nobody after hanging up, so any connection is a peer's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hivemind.dht import DHT, DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from multiaddr import Multiaddr

from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.swarm_view import HEAD_TTL_S
from diloco_peer.errors import ManifestError, SwarmTimeout
from diloco_peer.identity import Identity
from diloco_peer.peer.doctor_checks import heads_offset, peek_manifest, ping_offset

HEARTBEAT_S = HEAD_TTL_S / 4
"""How often a live peer republishes its head (`SwarmPeer._heartbeat`)."""
HANG_UPS = 2
"""Hang-ups the dial-back test may take, each followed by a wait of a heartbeat and 5 s. A peer
whose request to this node was under way when it hung up drops the node from its routing table
(hivemind's `DHTProtocol.update_routing_table` on a request without an answer) and would not
dial it again on its own: a ping from this node before the next hang-up puts it back."""
_GO_TIMESTAMP = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")  # in the libp2p daemon's errors


def probe_swarm(
    m: dict[str, Any], *, swarm: Sequence[str], run: str, host: str, listen_port: int,
    announce: Sequence[str], left: Callable[[float], float], progress: Callable[[str], None],
) -> None:  # fmt: skip
    """Join `swarm` with a throwaway node listening on `host`:`listen_port` and record what it
    measures in `m`: `connect_s` or `connect_error`, then (connected) the heads, the manifest,
    pings and the dial-back. `left(cap_s)` is the time left for one wait, at most `cap_s`."""
    ident = Identity.generate()
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "id.key"
        key.write_bytes(ident.to_bytes())
        progress(f"connecting to the swarm (up to {left(30):.0f} s)")
        started = time.monotonic()
        dht = DHT(
            initial_peers=list(swarm), start=False, identity_path=str(key),
            host_maddrs=[f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{listen_port}"],
            announce_maddrs=list(announce) or None, check_if_identity_free=False,
            record_validators=records.record_validators(ident, run), strict=False,
            node_id=DHTID.generate(source=records.heads_key(run)), startup_timeout=left(30),
        )  # fmt: skip
        try:
            try:
                dht.run_in_background(await_ready=True, timeout=left(30))
                m["connect_s"] = time.monotonic() - started
            except concurrent.futures.TimeoutError:
                m["connect_error"] = f"no answer within {time.monotonic() - started:.0f} s"
            except Exception as e:  # hivemind reports unreachable peers and daemon failures so
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                m["connect_error"] = _GO_TIMESTAMP.sub("", reason)
            if "connect_s" in m:
                _measure(dht, swarm, run, m, left, progress)
        finally:
            progress("shutting down")
            _stop(dht)


def _measure(
    dht: DHT, swarm: Sequence[str], run: str, m: dict[str, Any],
    left: Callable[[float], float], progress: Callable[[str], None],
) -> None:  # fmt: skip
    progress("reading the peers' heads")
    read_started = time.time()
    try:
        heads = records.read_heads(dht, run, timeout_s=left(10))
    except SwarmTimeout:
        heads = {}
    now, m["live_peers"] = time.time(), len(heads)
    if heads:
        slack = HEARTBEAT_S + (now - read_started)
        m["heads_offset_s"] = heads_offset((h.updated for h in heads.values()), now, slack)
    progress("fetching the run manifest")
    m["manifest"] = _fetch_manifest(dht, run, left, swarm)

    progress("pinging swarm peers (clock, dial-back)")
    offsets, m["validated"] = [], {}
    for peer in dict.fromkeys(Multiaddr(a).value_for_protocol("p2p") for a in swarm):
        samples = [s[:3] for s in (_ping_in(dht, peer, False, left) for _ in range(3)) if s]
        if samples:
            offsets.append(ping_offset(samples))
        answer = _ping_in(dht, peer, True, left)
        if answer is not None:
            m["validated"][peer] = answer[3]
    if offsets:
        m["clock_offset_s"] = sorted(offsets)[len(offsets) // 2]  # the median peer's
    own, peers = _call(dht, _addrs, left(5)) or ([], [])
    m["own_addrs"], m["peer_addrs"] = own, sorted({*swarm, *peers})
    if m["validated"]:
        _dial_back(dht, m, list(m["validated"]), left, progress)


def _dial_back(
    dht: DHT, m: dict[str, Any], peers: Sequence[str], left: Callable[[float], float],
    progress: Callable[[str], None],
) -> None:  # fmt: skip
    """Hang up and wait for a peer to dial this node afresh (`dialed_back_s`, None if none did;
    `dial_wait_s` in all), at most HANG_UPS times: a peer stores its head (and so dials us)
    every HEARTBEAT_S, and before a second hang-up a ping puts us back in the routing table of
    a peer that dropped us at the first (HANG_UPS)."""
    m["dial_wait_s"], m["dialed_back_s"], m["hang_ups"] = 0.0, None, 0
    for _ in range(HANG_UPS):
        wait_s = left(HEARTBEAT_S + 5)
        if wait_s <= 1:
            return
        if m["hang_ups"]:
            for peer in peers:
                _ping_in(dht, peer, False, left)
        m["hang_ups"] += 1
        progress(f"hanging up; waiting up to {wait_s:.0f} s for a peer to dial back")
        m["dialed_back_s"] = _call(dht, functools.partial(_dialed_back, wait_s=wait_s),
                                   wait_s + 5)  # fmt: skip
        m["dial_wait_s"] += wait_s
        if m["dialed_back_s"] is not None:
            return


def _fetch_manifest(
    dht: DHT, run: str, left: Callable[[float], float], swarm: Sequence[str]
) -> dict[str, Any]:
    try:
        peers = [Multiaddr(a).value_for_protocol("p2p") for a in swarm]
        signed = records.fetch_manifest(dht, run, timeout_s=left(10), prefer=peers)
    except SwarmTimeout as e:
        return {"error": str(e), "copies": 0}
    except ManifestError as e:
        copies = _call(dht, functools.partial(_raw_manifests, run=run), left(10)) or []
        peeked = peek_manifest(copies[0]) if copies else {}
        return {"error": str(e), "copies": len(copies), **peeked}
    run_spec, manifest = signed.manifest.run, signed.manifest
    return {"verified": True, "owner": signed.owner_peer_id, "digest": signed.digest,
            "protocol_version": manifest.protocol_version, "model": run_spec.model,
            "data": run_spec.data, "tokenizer": run_spec.tokenizer}  # fmt: skip


# These run in the DHT's process (`DHT.run_coroutine`), so they must be module-level.


async def _ping(
    _dht: DHT, node: DHTNode, peer: str, validate: bool, timeout_s: float
) -> tuple[float, float, float, bool] | None:
    """(sent, their_time, received, available) of one rpc_ping, None without an answer."""
    request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=validate)
    sent = time.time()
    try:
        stub = node.protocol.get_stub(PeerID.from_base58(peer))
        response = await stub.rpc_ping(request, timeout=timeout_s)
    except Exception:  # no answer, for whatever reason, is the measurement
        return None
    return sent, response.dht_time, time.time(), response.available


async def _addrs(_dht: DHT, node: DHTNode) -> tuple[list[str], list[str]]:
    """(this node's visible addresses, those of the peers it is connected to)."""
    own = [str(a) for a in await node.p2p.get_visible_maddrs(latest=True)]
    return own, [str(a) for info in await node.p2p.list_peers() for a in info.addrs]


async def _dialed_back(_dht: DHT, node: DHTNode, wait_s: float) -> float | None:
    """Hang up on every peer, then the seconds until one connects again (None: no one did in
    `wait_s`). Nothing here dials out, so a new connection was opened by a peer."""
    for info in await node.p2p.list_peers():
        await node.p2p._client.disconnect(info.peer_id)  # hivemind's P2P has no public hang-up
    started = time.monotonic()
    while time.monotonic() - started < wait_s:
        await asyncio.sleep(0.25)
        if await node.p2p.list_peers():
            return time.monotonic() - started
    return None


async def _raw_manifests(_dht: DHT, node: DHTNode, run: str) -> list[bytes]:
    found = await node.get(records.manifest_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [e.value for e in found.value.values() if isinstance(e.value, bytes)]


def _ping_in(dht: DHT, peer: str, validate: bool, left: Callable[[float], float]) -> Any:
    # A validated ping waits for the peer's own ping back (hivemind's wait_timeout, 3 s).
    timeout_s = left(8.0 if validate else 3.0)
    coro = functools.partial(_ping, peer=peer, validate=validate, timeout_s=timeout_s)
    return _call(dht, coro, timeout_s + 1)


def _call(dht: DHT, coro: Any, timeout_s: float) -> Any:
    """Run `coro` in the DHT process; None if it failed or did not finish in `timeout_s`."""
    future = dht.run_coroutine(coro, return_future=True)
    try:
        return future.result(timeout=timeout_s)
    except Exception:  # a timeout or an error in the DHT process: nothing measured
        future.cancel()
        return None


def _stop(dht: DHT) -> None:
    """Shut the node down, the hard way if it does not stop (say, it never finished starting)."""
    try:
        dht.shutdown()
    finally:
        if dht.is_alive():
            dht.terminate()
            dht.join(5)
