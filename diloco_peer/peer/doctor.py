"""`doctor`: can this machine take part in a swarm? Each check measures one thing and, when it
does not pass, says how to fix it (DESIGN §6).

`run_doctor` measures with one throwaway DHT node that joins the swarm as `join` would: server
mode, on `--host`/`--port`, with the run's record validators (without them a node cannot read
signed records). It publishes nothing; when it leaves, the swarm sees a peer that left.
`verdicts` turns the measurements (a plain dict, also the JSON output) into checks, without a
network, so that every verdict and fix can be tested.

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
import dataclasses
import errno
import functools
import ipaddress
import json
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hivemind.dht import DHT, DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS
from multiaddr import Multiaddr

from diloco_peer.config import MODEL_PRESETS
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.manifest import PROTOCOL_VERSION, check_run_name
from diloco_peer.errors import ConfigError, ManifestError, SwarmTimeout
from diloco_peer.identity import Identity

# Private in data.py; reused so that `doctor` reads a data source the way training does.
from diloco_peer.peer.data import _BUILTIN_SOURCES, _HUB_NAME, _SUFFIXES
from diloco_peer.peer.swarm_peer import HEAD_TTL_S

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
CLOCK_FAIL_S = float(MAX_DHT_TIME_DISCREPANCY_SECONDS)
"""hivemind refuses a peer whose clock is further off than this (`DHTProtocol.call_ping`)."""
CLOCK_WARN_S = 1.0
HEARTBEAT_S = HEAD_TTL_S / 4
"""How often a live peer republishes its head (`SwarmPeer._heartbeat`)."""
CLOCK_FIX = (
    "sync your clock: `sudo timedatectl set-ntp true` (Linux), or turn on automatic date and "
    "time (macOS, Windows)"
)
UPGRADE_FIX = "upgrade diloco-peer: `pip install -U diloco-peer`"
HUB_FIX = "make sure this machine can reach huggingface.co (or has the dataset in its cache)"
RUN_FIX = "pass the run name the swarm was started with (--run NAME)"
_GO_TIMESTAMP = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")  # in the libp2p daemon's errors


@dataclass(frozen=True)
class Check:
    """One line of the report; `fix` is set for every WARN and FAIL."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    def line(self) -> str:
        return f"{self.status:<4}  {self.name}: {self.detail}" + (
            f"  -> fix: {self.fix}" if self.fix else ""
        )


@dataclass(frozen=True, kw_only=True)
class DoctorSpec:
    """What `diloco-peer doctor` checks; bad values raise ConfigError (exit 2)."""

    swarm: tuple[str, ...]
    """Multiaddrs of swarm peers, each ending in /p2p/PEER_ID."""
    run: str = "default"
    host: str = "0.0.0.0"
    """Interface this machine would listen on (as `join --host`)."""
    port: int = 0
    """TCP port it would listen on; 0 = any free one."""
    announce: tuple[str, ...] = ()
    """Addresses others should dial (as `join --announce`)."""
    timeout_s: float = 45.0
    """Budget of all network waits together."""

    def __post_init__(self) -> None:
        if not self.swarm:
            raise ConfigError("give at least one --swarm address")
        for text in self.swarm:
            if "p2p" not in [p.name for p in parse_maddr(text, "--swarm").protocols()]:
                raise ConfigError(f"--swarm address {text!r} lacks its /p2p/PEER_ID part")
        for text in self.announce:
            if "/tcp/0/" in str(parse_maddr(text, "--announce")) + "/":
                raise ConfigError(f"--announce address {text!r} needs an explicit port")
        check_run_name(self.run)
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ConfigError(f"--host must be an IP address, got {self.host!r}") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError(f"--timeout-s must be a number of seconds > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class Report:
    checks: list[Check]
    measured: dict[str, Any]
    """Every number the checks were judged on (also the `--json` output's `measured`)."""

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == "FAIL" for c in self.checks) else 0

    def to_dict(self) -> dict[str, Any]:
        checks = [dataclasses.asdict(c) for c in self.checks]
        return {"ok": self.exit_code == 0, "checks": checks, "measured": self.measured}


def parse_maddr(text: str, flag: str) -> Multiaddr:
    try:
        return Multiaddr(text)
    except Exception:  # multiaddr raises several kinds for malformed text
        example = "/ip4/1.2.3.4/tcp/31337/p2p/PEER_ID"
        raise ConfigError(f"bad {flag} address {text!r}; expected one like {example}") from None


# ------------------------------------------------------------------ estimates and verdicts


def ping_offset(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset, error): a peer's clock minus ours, from pings `(sent, their_time, received)`.

    As in NTP: the peer stamped its time between our send and receive, so the offset is its
    time minus the midpoint, within half the round trip; the shortest round trip bounds it best.
    """
    sent, theirs, received = min(samples, key=lambda s: s[2] - s[0])
    return theirs - (sent + received) / 2, (received - sent) / 2


def heads_offset(updated: Iterable[float], now: float, slack_s: float) -> tuple[float, float]:
    """Interval (low, high) holding the swarm's clock offset (their clock minus ours), from the
    heads' `updated` times read at our time `now`; `slack_s` is a heartbeat plus the read time.

    `updated` is the peer's clock when it published: before we read it and, for a peer that
    heartbeats, at most `slack_s` before. So each peer's offset lies in
    [updated - now, updated - now + slack_s]. Taking the median over peers gives the median
    peer's interval, which a minority of paused peers or of peers with bad clocks cannot move.
    """
    low = statistics.median(u - now for u in updated)
    return low, low + slack_s


def clock_check(ping: Sequence[float] | None, heads: Sequence[float] | None) -> Check:
    """By ping when a peer answered (precise to half a round trip), else by the heads' interval
    (precise to a heartbeat). As in hivemind's own check, only a proven offset counts: |offset|
    minus the error, or the interval's distance from zero."""
    parts, off_by = [], 0.0
    if heads is not None:
        low, high = heads
        off_by = low if low > 0 else (-high if high < 0 else 0.0)
        parts.append(f"heads' times put it at {low:+.1f}..{high:+.1f} s")
    if ping is not None:
        offset, error = ping
        off_by = max(0.0, abs(offset) - error)
        side = "ahead of" if offset > 0 else "behind"
        parts.insert(0, f"swarm clock {abs(offset):.2f} s {side} ours (±{error:.2f} s, ping)")
    if not parts:
        return Check("clock offset", "SKIP", "no peer answered a ping or published a head")
    detail = "; ".join(parts)
    if off_by > CLOCK_FAIL_S:
        detail += f": beyond hivemind's {CLOCK_FAIL_S:g} s tolerance"
        return Check("clock offset", "FAIL", detail, CLOCK_FIX)
    return Check("clock offset", "WARN" if off_by > CLOCK_WARN_S else "PASS", detail,
                 CLOCK_FIX if off_by > CLOCK_WARN_S else None)  # fmt: skip


def is_public(maddr: str) -> bool:
    """Whether a host on the internet could dial this address: a global IP, or a DNS name."""
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2]).is_global
        except ValueError:
            return False
    return len(parts) > 1 and parts[1].startswith("dns")


def port_fix(port: int) -> str:
    p = str(port) if port else "P"
    choose = "" if port else " (choose P, pass --port P)"
    return (
        f"open TCP port {p}{choose} on your router (forward it to this machine) and pass "
        f"--announce /ip4/PUBLIC_IP/tcp/{p}; otherwise join with --client-mode (dial out "
        "only: it trains and contributes, but reduces no part and serves no state)"
    )


def reachability_check(m: Mapping[str, Any], port: int) -> Check:
    """From `validated` (peer -> hivemind's validated ping answer), `dialed_back_s` (seconds
    until a peer dialed us afresh after we hung up, None if none did within `dial_wait_s`),
    and the addresses this node and the swarm advertise."""
    name, validated = "reachable from outside", m.get("validated") or {}
    if not validated:
        return Check(name, "SKIP", "no swarm peer answered a ping")
    if not all(validated.values()):
        detail = f"{sum(not v for v in validated.values())} of {len(validated)} peer(s) could "
        return Check(name, "WARN", detail + "not reach this node back (validated ping)",
                     port_fix(port))  # fmt: skip
    if m.get("dialed_back_s") is None:
        detail = (f"no swarm peer dialed this node within {m.get('dial_wait_s', 0):.0f} s after "
                  "it hung up (a live peer's heartbeat would have)")  # fmt: skip
        return Check(name, "WARN", detail, port_fix(port))
    own, swarm = m.get("own_addrs", []), m.get("peer_addrs", [])
    if any(map(is_public, swarm)) and not any(map(is_public, own)):
        shown = ", ".join(sorted({a.split("/p2p/")[0] for a in own})[:3]) or "none"
        detail = (f"a peer dialed it, but it advertises only private addresses ({shown}) while "
                  "the swarm has public ones: peers elsewhere cannot dial it")  # fmt: skip
        return Check(name, "WARN", detail, port_fix(port))
    return Check(name, "PASS", f"a swarm peer dialed this node afresh {m['dialed_back_s']:.1f} s "
                 "after it hung up")  # fmt: skip


def port_check(host: str, port: int) -> Check:
    """Whether `port` can be bound on `host` now (SO_REUSEADDR: a socket in TIME_WAIT from a
    previous run does not count as taken, a listener does)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            fix = "pass --host 0.0.0.0 or an address of this machine (`ip addr` lists them)"
            if e.errno == errno.EADDRINUSE:
                fix = (f"stop what listens there (`ss -ltnp 'sport = :{port}'` shows it), or "
                       "pass another --port to doctor and join")  # fmt: skip
            elif e.errno == errno.EACCES:
                fix = "use a port of 1024 or above"
            return Check("port", "FAIL", f"cannot listen on {host} port {port}: {e.strerror}", fix)
        got = s.getsockname()[1]
    return Check("port", "PASS", f"port {port} is free on {host}" if port else
                 f"a free port is available on {host} (got {got})")  # fmt: skip


def relay_check(addrs: Iterable[str], reachable: bool) -> Check:
    """Relays matter to a peer that cannot be dialed; circuit addresses are how they show."""
    circuits = sorted({a for a in addrs if "/p2p-circuit" in a})
    if circuits:
        return Check("relays", "PASS", f"{len(circuits)} relay address(es), e.g. {circuits[0]}")
    detail = "no swarm peer advertises a relay (/p2p-circuit) address"
    if reachable:
        return Check("relays", "PASS", detail + "; this machine needs none")
    return Check("relays", "WARN", detail + ": a peer behind NAT has no relay to be reached "
                 "through", "forward a port (see `reachable from outside`)")  # fmt: skip


def _source(source: str, what: str) -> tuple[Status, str, str | None]:
    """(status, detail, fix) of a data source or tokenizer, read as data.py reads it."""
    if source.startswith("builtin:"):
        known = source in _BUILTIN_SOURCES
        return ("PASS", f"{what} {source} is built in", None) if known else (
            "FAIL", f"{what} {source} is unknown to this build", UPGRADE_FIX)  # fmt: skip
    if what == "tokenizer" and (source == "bytes" or source.startswith("bpe:")):
        return "PASS", f"{what} {source} needs no file", None
    path = Path(source).expanduser()
    if path.exists():
        return "PASS", f"{what} {source} exists here", None
    if source.startswith("hf:") or (
        what == "data" and _HUB_NAME.match(source) and path.suffix.lower() not in _SUFFIXES
    ):
        return "WARN", f"{what} {source} needs network access to the datasets hub", HUB_FIX
    fix = f"put the run's {what} at {source} (the manifest names one path for every peer)"
    return "FAIL", f"{what} path {source} does not exist on this machine", fix


def manifest_checks(manifest: Mapping[str, Any]) -> list[Check]:
    """Whether this build can train the manifest's run: signature, protocol version, model
    preset, data source. `manifest` holds `error` (why fetching failed), and the fields of the
    verified manifest or, failing that, of an unverified copy (to name why it was refused)."""
    note = "" if manifest.get("verified") else " (unverified copy)"
    if manifest.get("error"):
        fix = RUN_FIX
        if manifest.get("copies"):
            fix = "see the checks below; if none fails, ask the run owner to restart the founder"
        checks = [Check("manifest", "FAIL", manifest["error"], fix)]
    else:
        owner, digest = manifest["owner"][-8:], manifest["digest"][:12]
        checks = [Check("manifest", "PASS", f"signed by the owner ...{owner}, digest {digest}")]
    version, model = manifest.get("protocol_version"), manifest.get("model")
    if version == PROTOCOL_VERSION:
        checks.append(Check("protocol", "PASS", f"protocol v{version}{note}"))
    elif isinstance(version, int) and not isinstance(version, bool):
        gap = f"the swarm runs protocol v{version}, this build speaks v{PROTOCOL_VERSION}"
        fix = f"{UPGRADE_FIX}: {gap}" if version > PROTOCOL_VERSION else (
            f"install the older diloco-peer release the swarm runs: {gap}")  # fmt: skip
        checks.append(Check("protocol", "FAIL", gap + note, fix))
    if model in MODEL_PRESETS:
        checks.append(Check("model", "PASS", f"preset {model}{note}"))
    elif isinstance(model, str):
        known = ", ".join(MODEL_PRESETS)
        detail = f"preset {model!r} is unknown to this build (it knows {known}){note}"
        checks.append(Check("model", "FAIL", detail, UPGRADE_FIX))
    sources = [(manifest.get(w), w) for w in ("data", "tokenizer")]
    found = [_source(source, w) for source, w in sources if isinstance(source, str)]
    if found:
        status = max((f[0] for f in found), key=("PASS", "WARN", "FAIL").index)
        fix = "; ".join(f[2] for f in found if f[2] and f[0] == status) or None
        checks.append(Check("data source", status, "; ".join(f[1] for f in found) + note, fix))
    return checks


def peek_manifest(raw: Any) -> dict[str, Any]:
    """The fields of a manifest copy this build refused, unverified: only to name why (a newer
    protocol, an unknown preset), never trusted for anything else."""
    try:
        body = json.loads(json.loads(raw)["manifest"])
        run = body.get("run") if isinstance(body.get("run"), dict) else {}
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError):
        return {}
    fields = {k: run.get(k) for k in ("model", "data", "tokenizer")}
    return {"protocol_version": body.get("protocol_version"), **fields}


def verdicts(m: Mapping[str, Any], port: Check, spec: DoctorSpec) -> list[Check]:
    """The report's checks, in the order of the brief, from the measurements."""
    if m.get("connect_error"):
        fix = ("copy the address from the `swarm address` line a running peer prints; its host "
               "and TCP port must be reachable from here (firewall, VPN, typo)")  # fmt: skip
        skip = [Check(n, "SKIP", "skipped: the swarm is not reachable")
                for n in ("reachable from outside", "clock offset", "relays", "manifest")]  # fmt: skip
        swarm = Check("swarm reachable", "FAIL", f"cannot reach the swarm: {m['connect_error']}",
                      fix)  # fmt: skip
        return [swarm, *skip[:2], port, *skip[2:]]
    swarm = Check("swarm reachable", "PASS", f"connected in {m['connect_s']:.1f} s; "
                  f"{m['live_peers']} live peer(s) in run {spec.run!r}")  # fmt: skip
    if not m["live_peers"]:
        swarm = Check("swarm reachable", "WARN", f"connected in {m['connect_s']:.1f} s, but no "
                      f"peer of run {spec.run!r} publishes a head", RUN_FIX)  # fmt: skip
    reach = reachability_check(m, spec.port)
    if port.status != "PASS":
        reach = Check(reach.name, "SKIP", f"skipped: port {spec.port} is not available")
    return [
        swarm,
        reach,
        clock_check(m.get("clock_offset_s"), m.get("heads_offset_s")),
        port,
        relay_check(m.get("peer_addrs", []), reach.status == "PASS"),
        *manifest_checks(m["manifest"]),
    ]


# ------------------------------------------------------------------ measuring


def run_doctor(spec: DoctorSpec, progress: Callable[[str], None] = lambda _: None) -> Report:
    """All checks against the swarm; all network waits together take about `spec.timeout_s`."""
    deadline = time.monotonic() + spec.timeout_s

    def left(cap_s: float) -> float:
        return max(0.5, min(cap_s, deadline - time.monotonic()))

    port = port_check(spec.host, spec.port)
    m: dict[str, Any] = {"run": spec.run, "port": spec.port}
    ident = Identity.generate()
    listen = spec.port if port.status == "PASS" else 0
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "id.key"
        key.write_bytes(ident.to_bytes())
        progress(f"connecting to the swarm (up to {left(30):.0f} s)")
        started = time.monotonic()
        dht = DHT(
            initial_peers=list(spec.swarm), start=False, identity_path=str(key),
            host_maddrs=[f"/{'ip6' if ':' in spec.host else 'ip4'}/{spec.host}/tcp/{listen}"],
            announce_maddrs=list(spec.announce) or None, check_if_identity_free=False,
            record_validators=records.record_validators(ident, spec.run), strict=False,
            node_id=DHTID.generate(source=records.heads_key(spec.run)), startup_timeout=left(30),
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
                _measure(dht, spec, m, left, progress)
        finally:
            progress("shutting down")
            _stop(dht)
    return Report(checks=verdicts(m, port, spec), measured=m)


def _measure(
    dht: DHT, spec: DoctorSpec, m: dict[str, Any], left: Callable[[float], float],
    progress: Callable[[str], None],
) -> None:  # fmt: skip
    progress("reading the peers' heads")
    read_started = time.time()
    try:
        heads = records.read_heads(dht, spec.run, timeout_s=left(10))
    except SwarmTimeout:
        heads = {}
    now, m["live_peers"] = time.time(), len(heads)
    if heads:
        slack = HEARTBEAT_S + (now - read_started)
        m["heads_offset_s"] = heads_offset((h.updated for h in heads.values()), now, slack)
    progress("fetching the run manifest")
    m["manifest"] = _fetch_manifest(dht, spec.run, left)

    progress("pinging swarm peers (clock, dial-back)")
    offsets, m["validated"] = [], {}
    for peer in dict.fromkeys(Multiaddr(a).value_for_protocol("p2p") for a in spec.swarm):
        samples = [s[:3] for s in (_ping_in(dht, peer, False, left) for _ in range(3)) if s]
        if samples:
            offsets.append(ping_offset(samples))
        answer = _ping_in(dht, peer, True, left)
        if answer is not None:
            m["validated"][peer] = answer[3]
    if offsets:
        m["clock_offset_s"] = sorted(offsets)[len(offsets) // 2]  # the median peer's
    own, peers = _call(dht, _addrs, left(5)) or ([], [])
    m["own_addrs"], m["peer_addrs"] = own, sorted({*spec.swarm, *peers})
    if m["validated"]:
        m["dial_wait_s"] = left(HEARTBEAT_S + 5)
        progress(f"hanging up; waiting up to {m['dial_wait_s']:.0f} s for a peer to dial back")
        m["dialed_back_s"] = _call(dht, functools.partial(_dialed_back, wait_s=m["dial_wait_s"]),
                                   m["dial_wait_s"] + 5)  # fmt: skip


def _fetch_manifest(dht: DHT, run: str, left: Callable[[float], float]) -> dict[str, Any]:
    try:
        signed = records.fetch_manifest(dht, run, timeout_s=left(10))
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
