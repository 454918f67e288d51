"""An emulated wide-area network on one machine, for tests and benchmarks (needs root).

    with NetLab() as lab:
        a = lab.add_host(up_mbit=100, down_mbit=100)            # a home link, both ways
        b = lab.add_host(up_mbit=50, down_mbit=1000)            # slow upload, fast download
        c = lab.add_host(up_mbit=100, down_mbit=100, inbound=False)   # behind a NAT router
        proc = subprocess.Popen(c.argv(["python", "-m", "diloco_peer", "join", ...]))
        ...
        sent, received = a.tx_bytes(), a.rx_bytes()             # bytes on a's wire
        dropped = lab.drops(a)                                  # packets its shaping dropped
        a = lab.reshape(a, up_mbit=1000, down_mbit=1000)        # new rates, same processes
        lab.partition([a, b])                                   # a and b reach only each other
        lab.heal()                                              # one network again

Each host is a network namespace with one interface, `eth0`, holding a private address of the
lab's subnet (10.213.0.0/24, first host .1), plus its own loopback. Every `eth0` is one end of a
veth pair whose other end is a port of one bridge, which lives in a namespace of its own (the
"hub"). So hosts reach each other, and nothing else: the lab has no route out, and this machine's
own namespaces never see its traffic.

Link rates are token-bucket filters (`tc qdisc ... tbf`): the host's upload shapes its `eth0`
egress, its download the egress of its bridge port. A rate of None leaves that direction at veth
speed. `lab.reshape(host, up_mbit=, down_mbit=)` changes a host's rates while its processes run
(`tc qdisc replace`), so one set of processes can be measured at several rates.

`lab.partition(side, ...)` splits the network as a cut cable between two sites would: each side
named gets a bridge of its own in the hub (its hosts' ports move there), hosts named in no side
stay on the first bridge. A host then reaches only the hosts of its side; packets to the others
vanish without an error, so open TCP connections across the cut stall (and retransmit) rather
than close, as in a real split. `lab.heal()` moves every port back to the first bridge: the
stalled connections deliver again once TCP retransmits (what was sent during the cut arrives
late). `lab.heal(reset_connections=True)` first destroys the connections across the cut, at
both ends, as a long outage or a router losing its state would. Link shaping lives on the
hosts' own devices and ports, so it is untouched by either.

`inbound=False` emulates a router that refuses unsolicited connections: TCP segments with SYN and
without ACK headed for the host are dropped at its bridge port (a `u32` filter steering them to a
zero-length fifo; this kernel has no drop action), so the host can dial out and use what it
dialed, but nobody can dial it; a dial to it times out, as it would through a NAT. (hivemind
speaks TCP only here, so UDP is left alone.)

Namespaces are named `<prefix>-hub` and `<prefix>-h<i>`; the prefix defaults to one per process,
so two labs never collide. `close()` (or leaving the `with`) deletes every namespace, which kills
nothing: stop the processes you started in them first. `remove_stale()` deletes what a killed run
left behind; a new lab also deletes the labs of default prefix whose process is gone and in
which nothing runs (`remove_orphans()`: a run killed before its `close()`, as pytest stopped by
SIGTERM skips its fixtures' teardown).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"
"""The lab's /24: hosts get .1, .2, ... (the subnet is private and never routed out)."""
_MAX_HOSTS = 250
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,7}")
_DEFAULT_LAB = re.compile(r"dp(\d+)-(hub|h\d+)")
"""A namespace of a lab of default prefix: `dp<pid % 100000>-...`."""
_CMD_TIMEOUT_S = 20.0


class NetLabError(RuntimeError):
    """The lab could not be built: not root, no `ip`/`tc`, or the kernel refused a step."""


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetLabError(f"`{' '.join(argv)}` failed: {e}") from None
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        raise NetLabError(f"`{' '.join(argv)}` failed: {reason}")


def _rate(mbit: float | None, what: str) -> float | None:
    if mbit is None:
        return None
    if isinstance(mbit, bool) or not isinstance(mbit, (int, float)) or not 0.1 <= mbit <= 100_000:
        raise ValueError(f"{what} must be None or a rate in Mbit/s in [0.1, 100000], got {mbit!r}")
    return float(mbit)


def _tbf(mbit: float) -> list[str]:
    """A token bucket for `mbit`: the burst holds at least 4 ms of traffic (a kernel tick at
    HZ=250), so the bucket never caps the rate below what it says; 50 ms of queue."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]


def _tbf_drops(prefix: list[str], dev: str) -> int:
    """Packets dropped by the tbf qdiscs of `dev` (`tc -s qdisc`; the SYN filter's is not one)."""
    try:
        done = subprocess.run(
            [*prefix, "tc", "-s", "qdisc", "show", "dev", dev],
            capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        raise NetLabError(f"`tc -s qdisc show dev {dev}` failed: {e}") from None
    total, in_tbf = 0, False
    for line in done.stdout.splitlines():
        if line.startswith("qdisc "):
            in_tbf = line.split()[1] == "tbf"
        elif in_tbf and (found := re.search(r"\(dropped (\d+),", line)):
            total += int(found.group(1))
    return total


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, its address and its link."""

    netns: str
    ip: str
    up_mbit: float | None
    down_mbit: float | None
    inbound: bool

    def argv(self, command: list[str]) -> list[str]:
        """`command`, run inside this host (for subprocess.Popen and friends)."""
        return ["ip", "netns", "exec", self.netns, *command]

    def _counter(self, name: str) -> int:
        done = subprocess.run(
            self.argv(["cat", f"/sys/class/net/eth0/statistics/{name}"]),
            capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=True,
        )  # fmt: skip
        return int(done.stdout)

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (IP packets with their headers, since creation)."""
        return self._counter("tx_bytes")

    def rx_bytes(self) -> int:
        """Bytes this host has received on its link."""
        return self._counter("rx_bytes")


class NetLab:
    """Namespaces joined by a bridge; see the module docstring."""

    def __init__(self, prefix: str | None = None) -> None:
        prefix = prefix if prefix is not None else f"dp{os.getpid() % 100_000}"
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must match {_PREFIX.pattern}, got {prefix!r}")
        if os.geteuid() != 0:
            raise NetLabError("an emulated network needs root (ip netns, tc)")
        for tool in ("ip", "tc", "ss"):
            if shutil.which(tool) is None:
                raise NetLabError(f"`{tool}` is not installed (Debian: iproute2)")
        self.prefix = prefix
        self.hub = f"{prefix}-hub"
        self.hosts: list[Host] = []
        self.sides = 0
        """Bridges beyond the first (`partition`): 0 while the network is whole."""
        self._side_of: dict[str, int] = {}
        """Bridge port -> the side (bridge number) it is on; ports not listed are on br0."""
        self.remove_stale(prefix)
        self.remove_orphans()
        try:
            _run("ip", "netns", "add", self.hub)
            _run("ip", "-n", self.hub, "link", "set", "lo", "up")
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        except NetLabError:
            self.close()
            raise

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(
        self, *, up_mbit: float | None = None, down_mbit: float | None = None, inbound: bool = True
    ) -> Host:
        """A new host on the bridge, with the given upload and download rates (Mbit/s)."""
        up, down = _rate(up_mbit, "up_mbit"), _rate(down_mbit, "down_mbit")
        index = len(self.hosts) + 1
        if index > _MAX_HOSTS:
            raise NetLabError(f"a lab holds at most {_MAX_HOSTS} hosts")
        host = Host(f"{self.prefix}-h{index}", f"{SUBNET}.{index}", up, down, bool(inbound))
        port = f"v{index}"
        _run("ip", "netns", "add", host.netns)
        self.hosts.append(host)
        _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        _run(
            "ip", "link", "add", "eth0", "netns", host.netns,
            "type", "veth", "peer", "name", port, "netns", self.hub,
        )  # fmt: skip
        _run("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", port, "up")
        if up is not None:
            _run("ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", "root",
                 *_tbf(up))  # fmt: skip
        self._shape_port(port, down, host.inbound)
        return host

    def reshape(
        self, host: Host, *, up_mbit: float | None = None, down_mbit: float | None = None
    ) -> Host:
        """Change `host`'s link rates in place (None: unshaped), without touching its processes
        or their connections; returns the host as it now is (also in `hosts`, replacing it).
        Packets queued at the old rate leave at the new one."""
        up, down = _rate(up_mbit, "up_mbit"), _rate(down_mbit, "down_mbit")
        index = next((i for i, h in enumerate(self.hosts) if h.netns == host.netns), None)
        if index is None:
            raise NetLabError(f"{host.netns} is not a host of this lab")
        old = self.hosts[index]
        tc = ["ip", "netns", "exec", old.netns, "tc", "qdisc"]
        if up is not None:
            _run(*tc, "replace", "dev", "eth0", "root", *_tbf(up))
        elif old.up_mbit is not None:
            _run(*tc, "del", "dev", "eth0", "root")
        port = f"v{index + 1}"
        tc = ["ip", "netns", "exec", self.hub, "tc", "qdisc"]
        where = ["root"] if old.inbound else ["parent", "1:10", "handle", "10:"]
        if down is not None:
            _run(*tc, "replace", "dev", port, *where, *_tbf(down))
        elif old.down_mbit is not None:
            _run(*tc, "del", "dev", port, *where)
        new = Host(old.netns, old.ip, up, down, old.inbound)
        self.hosts[index] = new
        return new

    def drops(self, host: Host) -> tuple[int, int]:
        """Packets the shaping of `host`'s link has dropped, (upload, download): its token
        buckets' queues overflowed (TCP then retransmits and backs off). Counted since that
        direction was last shaped from unshaped (`reshape` to a new rate keeps the count), so
        diff two readings."""
        index = next((i for i, h in enumerate(self.hosts) if h.netns == host.netns), None)
        if index is None:
            raise NetLabError(f"{host.netns} is not a host of this lab")
        return (
            _tbf_drops(["ip", "netns", "exec", host.netns], "eth0"),
            _tbf_drops(["ip", "netns", "exec", self.hub], f"v{index + 1}"),
        )

    def partition(self, *sides: Sequence[Host]) -> None:
        """Cut the network: each of `sides` reaches only itself; hosts in no side stay together
        on the first bridge. Replaces an earlier partition (heal first, then cut anew)."""
        ports = [[self._port(host) for host in side] for side in sides if side]
        flat = [port for side in ports for port in side]
        if len(set(flat)) != len(flat):
            raise ValueError("a host may be on one side of a partition only")
        self.heal()
        for number, side in enumerate(ports, start=1):
            bridge = f"br{number}"
            _run("ip", "-n", self.hub, "link", "add", bridge, "type", "bridge")
            self.sides = number
            _run("ip", "-n", self.hub, "link", "set", bridge, "up")
            for port in side:
                _run("ip", "-n", self.hub, "link", "set", port, "master", bridge)
                self._side_of[port] = number

    def heal(self, *, reset_connections: bool = False) -> None:
        """Join every side of a partition again (a no-op while the network is whole).

        `reset_connections`: first destroy, at both ends, every TCP connection between hosts
        of different sides (`ss -K`), as a long outage or a router that lost its state does:
        nothing sent during the cut arrives afterwards, and processes must dial anew."""
        if self.sides == 0:
            return
        if reset_connections:
            for index, host in enumerate(self.hosts):
                side = self._side_of.get(f"v{index + 1}", 0)
                for other_index, other in enumerate(self.hosts):
                    if self._side_of.get(f"v{other_index + 1}", 0) != side:
                        _run(*host.argv(["ss", "-K", "dst", other.ip]))
        self._side_of = {}
        for index in range(len(self.hosts)):
            _run("ip", "-n", self.hub, "link", "set", f"v{index + 1}", "master", "br0")
        for number in range(self.sides, 0, -1):
            _run("ip", "-n", self.hub, "link", "del", f"br{number}")
            self.sides = number - 1

    def _port(self, host: Host) -> str:
        """The name of `host`'s bridge port in the hub."""
        index = next((i for i, h in enumerate(self.hosts) if h.netns == host.netns), None)
        if index is None:
            raise NetLabError(f"{host.netns} is not a host of this lab")
        return f"v{index + 1}"

    def _shape_port(self, port: str, down: float | None, inbound: bool) -> None:
        tc = ["ip", "netns", "exec", self.hub, "tc"]
        if inbound:
            if down is not None:
                _run(*tc, "qdisc", "add", "dev", port, "root", *_tbf(down))
            return
        # htb as a classifier only: class 1:10 (everything, at most `down`), class 1:20 (dialing
        # SYNs: a fifo of length 0 drops them). Offset 33 = 20-byte IPv4 header + TCP flags byte.
        _run(*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "10")
        _run(*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:10",
             "htb", "rate", "100gbit", "quantum", "60000")  # fmt: skip
        _run(*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:20",
             "htb", "rate", "1mbit", "quantum", "1514")  # fmt: skip
        if down is not None:
            _run(*tc, "qdisc", "add", "dev", port, "parent", "1:10", "handle", "10:", *_tbf(down))
        _run(*tc, "qdisc", "add", "dev", port, "parent", "1:20", "handle", "20:",
             "pfifo", "limit", "0")  # fmt: skip
        _run(*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12",
             "at", "33", "flowid", "1:20")  # fmt: skip

    def close(self) -> None:
        """Delete every namespace of this lab (idempotent). Stop its processes first."""
        self.remove_stale(self.prefix)
        self.hosts = []
        self.sides = 0
        self._side_of = {}

    @staticmethod
    def remove_orphans() -> list[str]:
        """Delete the namespaces of default-prefix labs (`dp<pid>-*`) whose process is gone (no
        live pid has that remainder) and in which no process runs; returns their names."""
        names = Path("/run/netns")
        if not names.is_dir():
            return []
        alive = {int(p.name) % 100_000 for p in Path("/proc").iterdir() if p.name.isdigit()}
        removed = []
        for path in sorted(names.iterdir()):
            match = _DEFAULT_LAB.fullmatch(path.name)
            if match is None or int(match.group(1)) in alive:
                continue
            pids = subprocess.run(["ip", "netns", "pids", path.name], capture_output=True,
                                  text=True, timeout=_CMD_TIMEOUT_S)  # fmt: skip
            if pids.returncode != 0 or pids.stdout.strip():
                continue  # something still runs there (or we cannot tell): leave it
            subprocess.run(
                ["ip", "netns", "del", path.name], capture_output=True, timeout=_CMD_TIMEOUT_S
            )
            removed.append(path.name)
        return removed

    @staticmethod
    def remove_stale(prefix: str) -> None:
        """Delete the namespaces named `<prefix>-*` (a previous lab of this prefix, killed)."""
        names = Path("/run/netns")
        if not names.is_dir():
            return
        for path in sorted(names.iterdir()):
            if path.name.startswith(f"{prefix}-"):
                subprocess.run(
                    ["ip", "netns", "del", path.name], capture_output=True, timeout=_CMD_TIMEOUT_S
                )
