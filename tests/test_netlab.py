"""NetLab (diloco_peer/netlab.py): shaped links between network namespaces. Needs root (ip netns,
tc); about 15 seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_peer.netlab import Host, NetLab, NetLabError

# One TCP stream between a listener and a dialer; the receiving end prints the seconds from the
# stream's first byte to its end, and its length. argv: listen|dial, address, nbytes, send|receive.
_PEER = """
import socket, sys, time
role, address, nbytes, direction = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if role == "listen":
    s = socket.create_server((address, 5201)); print("ready", flush=True); c, _ = s.accept()
else:
    c = socket.create_connection((address, 5201), timeout=20)
c.settimeout(20)
if direction == "send":
    c.sendall(bytes(nbytes)); c.close(); sys.exit()
n = len(c.recv(1 << 16)); t0 = time.perf_counter()
while chunk := c.recv(1 << 16): n += len(chunk)
print(time.perf_counter() - t0, n, flush=True)
"""


def transfer_mbit(src: Host, dst: Host, nbytes: int, *, dst_dials: bool = False) -> float:
    """The rate of one TCP stream of `nbytes` from src to dst, in Mbit/s. dst listens and src
    dials, unless `dst_dials`."""
    listener, dialer = (src, dst) if dst_dials else (dst, src)

    def argv(host: Host, role: str) -> list[str]:
        direction = "receive" if host is dst else "send"
        return host.argv([sys.executable, "-c", _PEER, role, listener.ip, str(nbytes), direction])

    server = subprocess.Popen(argv(listener, "listen"), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = subprocess.run(
            argv(dialer, "dial"), capture_output=True, text=True, check=True, timeout=30
        )
        served = server.communicate(timeout=30)[0]
    finally:
        server.kill()
        server.wait(timeout=10)
    seconds, received = (client.stdout if dst_dials else served).split()
    assert int(received) == nbytes
    return nbytes * 8 / 1e6 / float(seconds)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rates_follow_the_shaping_and_reshape_changes_them() -> None:
    with NetLab(prefix="dptest") as lab:
        a = lab.add_host(up_mbit=20, down_mbit=1000)
        b = lab.add_host(up_mbit=1000, down_mbit=1000, inbound=False)  # dials out only
        sent_before = a.tx_bytes()
        slow = transfer_mbit(a, b, 2_500_000, dst_dials=True)  # a's upload is the bottleneck
        assert 14 <= slow <= 22, slow
        assert a.tx_bytes() - sent_before >= 2_500_000  # payload plus headers
        assert b.rx_bytes() >= 2_500_000
        up_drops, down_drops = lab.drops(a)
        assert up_drops >= 0 and down_drops == 0  # a's download carried only ACKs
        a = lab.reshape(a, up_mbit=80, down_mbit=None)
        assert (a.up_mbit, a.down_mbit) == (80, None) and lab.hosts[0] == a
        fast = transfer_mbit(a, b, 10_000_000, dst_dials=True)
        assert 56 <= fast <= 88, fast
        b = lab.reshape(b, up_mbit=None, down_mbit=30)  # the no-inbound port's download limits
        assert (b.up_mbit, b.down_mbit, b.inbound) == (None, 30, False)
        limited = transfer_mbit(a, b, 4_000_000, dst_dials=True)
        assert 20 <= limited <= 33, limited
        a = lab.reshape(a, up_mbit=None)  # no shaping left on a's link
        b = lab.reshape(b, down_mbit=None)
        assert transfer_mbit(a, b, 10_000_000, dst_dials=True) > 100
        names = [h.netns for h in lab.hosts]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)  # close() removed them


@pytest.mark.timeout(60)
def test_reshape_refuses_a_foreign_host_and_bad_rates() -> None:
    with NetLab(prefix="dptest") as lab:
        a = lab.add_host()
        with pytest.raises(ValueError):
            lab.reshape(a, up_mbit=-1)
        stranger = Host("dpnone-h1", "10.213.0.9", None, None, True)
        with pytest.raises(NetLabError, match="not a host of this lab"):
            lab.reshape(stranger, up_mbit=10)
        with pytest.raises(NetLabError, match="not a host of this lab"):
            lab.drops(stranger)
        assert lab.drops(a) == (0, 0)  # no shaping, nothing dropped


# An echo server (argv: address), and a client that holds one connection to it across a cut:
# on each stdin line (seconds to wait) it sends a byte and says whether it came back in time,
# or whether the connection is gone.
_ECHO = """
import socket, sys, threading
s = socket.create_server((sys.argv[1], 5202)); print("ready", flush=True)
def serve(c):
    while data := c.recv(1024): c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
_HOLDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5202), timeout=5)
for line in sys.stdin:
    wait_s = float(line)
    c.settimeout(wait_s)
    try:
        c.sendall(b"x")
        print("echoed" if c.recv(1) == b"x" else "closed", flush=True)
    except TimeoutError:
        print("stalled", flush=True)
    except OSError:
        print("reset", flush=True)
        break
"""


def _dials(src: Host, dst: Host) -> bool:
    """Whether `src` can open a TCP connection to the echo server on `dst` within 2 s."""
    probe = f"import socket; socket.create_connection(({dst.ip!r}, 5202), timeout=2).close()"
    done = subprocess.run(src.argv([sys.executable, "-c", probe]), capture_output=True, timeout=20)
    return done.returncode == 0


@pytest.mark.timeout(90)
def test_a_partition_cuts_the_sides_apart_and_heal_joins_them() -> None:
    with NetLab(prefix="dptest") as lab:
        a, b, c = (lab.add_host(up_mbit=100) for _ in range(3))
        servers = [subprocess.Popen(h.argv([sys.executable, "-c", _ECHO, h.ip]),
                                    stdout=subprocess.PIPE, text=True) for h in (a, c)]  # fmt: skip
        holder = None
        try:
            for server in servers:
                assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            holder = subprocess.Popen(
                a.argv([sys.executable, "-c", _HOLDER, c.ip]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert holder.stdin is not None and holder.stdout is not None

            def hold(wait_s: float) -> str:
                holder.stdin.write(f"{wait_s}\n")
                holder.stdin.flush()
                return holder.stdout.readline().strip()

            assert hold(5) == "echoed"
            lab.partition([a, b])  # c alone on the other side
            assert lab.sides == 1
            assert _dials(b, a) and not _dials(b, c) and not _dials(c, a)
            assert hold(2) == "stalled"  # the open connection delivers nothing, and stays open
            with pytest.raises(ValueError, match="one side"):
                lab.partition([a], [a, c])
            lab.heal()
            assert lab.sides == 0
            assert hold(20) == "echoed"  # the stalled byte and ours arrive once TCP retransmits
            assert _dials(b, c) and _dials(c, a)
            lab.heal()  # whole already: nothing to do
            lab.partition([c])
            lab.heal(reset_connections=True)  # a long outage: connections across it are gone
            assert hold(5) == "reset"
            assert _dials(a, c)
        finally:
            for proc in [*servers, *([holder] if holder else [])]:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_new_lab_deletes_the_orphaned_labs_of_dead_processes_only() -> None:
    # a run killed before its close() (pytest stopped by SIGTERM skips fixture teardown) leaves
    # its namespaces; the next lab deletes those of a default prefix whose process is gone and
    # in which nothing runs, and leaves the others
    alive = {int(p.name) % 100_000 for p in Path("/proc").iterdir() if p.name.isdigit()}
    dead = [n for n in range(99_999, 50_000, -1) if n not in alive][:2]
    orphan = [f"dp{dead[0]}-hub", f"dp{dead[0]}-h1"]
    busy, named = f"dp{dead[1]}-h1", "dpkeep-h1"  # something runs in it; not a default prefix
    for name in (*orphan, busy, named):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=20)
    sleeper = subprocess.Popen(["ip", "netns", "exec", busy, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", busy], capture_output=True,
                                 text=True).stdout.strip():  # fmt: skip
            assert time.monotonic() < deadline, "the sleeper never entered its namespace"
            time.sleep(0.1)
        with NetLab(prefix="dptest"):
            left = {p.name for p in Path("/run/netns").iterdir()}
        assert not left & set(orphan)
        assert {busy, named} <= left
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        for name in (*orphan, busy, named):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
