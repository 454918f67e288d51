"""`doctor`'s checks: each turns measurements (plain values, also the JSON output) into one
line of the report, PASS, WARN, FAIL or SKIP, and names a fix for every WARN and FAIL (DESIGN
§6). No network here, so that every verdict and fix can be tested.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from diloco_peer.config import MODEL_PRESETS
from diloco_peer.coordinator_free.manifest import PROTOCOL_VERSION
from diloco_peer.peer.sources import BUILTIN_SOURCES, is_hub_name

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
CLOCK_FAIL_S = float(MAX_DHT_TIME_DISCREPANCY_SECONDS)
"""hivemind refuses a peer whose clock is further off than this (`DHTProtocol.call_ping`)."""
CLOCK_WARN_S = 1.0
CLOCK_FIX = (
    "sync your clock: `sudo timedatectl set-ntp true` (Linux), or turn on automatic date and "
    "time (macOS, Windows)"
)
UPGRADE_FIX = "upgrade diloco-peer: `pip install -U diloco-peer`"
HUB_FIX = "make sure this machine can reach huggingface.co (or has the dataset in its cache)"
RUN_FIX = "pass the run name the swarm was started with (--run NAME)"


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


# ------------------------------------------------------------------ estimates


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


# ------------------------------------------------------------------ checks


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
    if m.get("hang_ups") == 0:
        return Check(name, "SKIP", "no time was left to wait for a dial-back (raise --timeout-s)")
    if m.get("dialed_back_s") is None:
        detail = (f"no swarm peer dialed this node within {m.get('dial_wait_s', 0):.0f} s after "
                  f"it hung up ({m.get('hang_ups', 1)} time(s); a live peer's heartbeat would "
                  "have)")  # fmt: skip
        return Check(name, "WARN", detail, port_fix(port))
    own, swarm = m.get("own_addrs", []), m.get("peer_addrs", [])
    if any(map(is_public, swarm)) and not any(map(is_public, own)):
        shown = ", ".join(sorted({a.split("/p2p/")[0] for a in own})[:3]) or "none"
        detail = (f"a peer dialed it, but it advertises only private addresses ({shown}) while "
                  "the swarm has public ones: peers elsewhere cannot dial it")  # fmt: skip
        return Check(name, "WARN", detail, port_fix(port))
    again = " the second time" if m.get("hang_ups", 1) > 1 else ""
    return Check(name, "PASS", f"a swarm peer dialed this node afresh {m['dialed_back_s']:.1f} s "
                 f"after it hung up{again}")  # fmt: skip


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
        known = source in BUILTIN_SOURCES
        return ("PASS", f"{what} {source} is built in", None) if known else (
            "FAIL", f"{what} {source} is unknown to this build", UPGRADE_FIX)  # fmt: skip
    if what == "tokenizer" and (source == "bytes" or source.startswith("bpe:")):
        return "PASS", f"{what} {source} needs no file", None
    path = Path(source).expanduser()
    if path.exists():
        return "PASS", f"{what} {source} exists here", None
    if source.startswith("hf:") or (what == "data" and is_hub_name(source)):
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
