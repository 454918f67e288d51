"""`doctor`: can this machine take part in a swarm? Each check measures one thing and, when it
does not pass, says how to fix it (DESIGN §6).

`run_doctor` checks the port, then measures with one throwaway DHT node that joins the swarm as
`join` would (doctor_probe.py); `verdicts` turns the measurements (a plain dict, also the JSON
output) into the report's checks (doctor_checks.py), without a network, so that every verdict
and fix can be tested.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multiaddr import Multiaddr

from diloco_peer.coordinator_free.manifest import check_run_name
from diloco_peer.errors import ConfigError
from diloco_peer.peer.doctor_checks import (
    RUN_FIX,
    Check,
    clock_check,
    manifest_checks,
    port_check,
    reachability_check,
    relay_check,
)
from diloco_peer.peer.doctor_probe import probe_swarm


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
    """What `doctor` prints: the checks in report order, and what they were judged on."""

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
    """The multiaddr a flag's text names; ConfigError (exit 2) naming the flag if malformed."""
    try:
        return Multiaddr(text)
    except Exception:  # multiaddr raises several kinds for malformed text
        example = "/ip4/1.2.3.4/tcp/31337/p2p/PEER_ID"
        raise ConfigError(f"bad {flag} address {text!r}; expected one like {example}") from None


# ------------------------------------------------------------------ the report


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


def run_doctor(spec: DoctorSpec, progress: Callable[[str], None] = lambda _: None) -> Report:
    """All checks against the swarm; all network waits together take about `spec.timeout_s`."""
    deadline = time.monotonic() + spec.timeout_s

    def left(cap_s: float) -> float:
        return max(0.5, min(cap_s, deadline - time.monotonic()))

    port = port_check(spec.host, spec.port)
    m: dict[str, Any] = {"run": spec.run, "port": spec.port}
    probe_swarm(
        m, swarm=spec.swarm, run=spec.run, host=spec.host,
        listen_port=spec.port if port.status == "PASS" else 0, announce=spec.announce,
        left=left, progress=progress,
    )  # fmt: skip
    return Report(checks=verdicts(m, port, spec), measured=m)
