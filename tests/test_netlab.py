"""NetLab (diloco_peer/netlab.py): shaped links between network namespaces. Needs root (ip netns,
tc); about 15 seconds."""

from __future__ import annotations

import subprocess
import sys

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
