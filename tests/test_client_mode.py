"""A peer that can only dial out (issue 6, item 4), on an emulated network (diloco_peer.netlab).

Three hosts on a bridge: a founder, a peer, and a volunteer behind a "router" that drops every
connection attempt towards it. The volunteer joins with `--client-mode`, or without it and
finds out itself (a swarm peer's dial-back fails, reachability.py). Either way it must
contribute to the rounds' averages (at least two of the three; under load sync matchmaking may
leave a peer out of one) and end on the others' state hashes, while nobody can open a
connection to it. Needs root (network namespaces), as CI has.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diloco_peer.local_swarm import LocalSwarm
from diloco_peer.netlab import NetLab
from diloco_peer.peer.events import read_log

PORT = 31337


def _dial(host_argv: list[str], ip: str, port: int) -> subprocess.CompletedProcess[str]:
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=3).close()"
    return subprocess.run(
        [*host_argv, sys.executable, "-c", probe], capture_output=True, text=True, timeout=20
    )


@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.slow  # 25-30 s each; the default suite is near its 15 minutes
@pytest.mark.parametrize("mode", ["flag", "auto"])
def test_a_dial_out_only_peer_contributes_to_the_rounds(tmp_path: Path, mode: str) -> None:
    join_args = ["--quiet", "--threads", "1", "--until-version", "3"]
    with NetLab() as lab, LocalSwarm(tmp_path, run="t", join_args=join_args) as peers:
        founder_host = lab.add_host(up_mbit=100, down_mbit=100)
        peer_host = lab.add_host(up_mbit=100, down_mbit=100)
        nat_host = lab.add_host(up_mbit=100, down_mbit=100, inbound=False)
        _, log_f = peers.start(
            "founder", "--model", "nano", "--inner-steps", "10", "--expected-peers", "3",
            "--host", founder_host.ip, "--port", str(PORT), wrap=founder_host.argv([]),
        )  # fmt: skip
        maddr = peers.wait_event(log_f, "start", 120)["maddrs"][0]
        _, log_p = peers.start(
            "peer", "--swarm", maddr, "--host", peer_host.ip, wrap=peer_host.argv([])
        )
        _, log_c = peers.start(
            "client", "--swarm", maddr, "--host", nat_host.ip, "--port", str(PORT),
            *(["--client-mode"] if mode == "flag" else []), wrap=nat_host.argv([]),
        )  # fmt: skip
        err_c = tmp_path / "client.err"
        client_id = peers.wait_event(log_c, "start", 120)["peer"]

        # the volunteer's port is open inside its host, yet nobody outside can reach it
        inside = _dial(nat_host.argv([]), nat_host.ip, PORT)
        assert inside.returncode == 0, inside.stderr[-500:]
        outside = _dial(peer_host.argv([]), nat_host.ip, PORT)
        assert outside.returncode != 0 and "timed out" in outside.stderr, outside.stderr[-500:]
        assert _dial(nat_host.argv([]), founder_host.ip, PORT).returncode == 0  # dials out

        for proc in peers.procs:
            assert proc.wait(timeout=240) == 0, err_c.read_text()[-3000:]

    rounds = {name: [e for e in read_log(log) if e["event"] == "round"]
              for name, log in (("founder", log_f), ("peer", log_p), ("client", log_c))}  # fmt: skip
    # the client downloaded the state (from peers it dialed) or trained from version 0 with
    # them; either way it then took part in rounds whose average holds its δ
    assert rounds["client"], rounds
    short = client_id[-6:]
    with_client = [e for e in rounds["founder"] + rounds["peer"] if short in str(e["members"])]
    assert len(with_client) >= 2, rounds["founder"]
    # it reduced no part: it sent only its own parts, the reducers also sent averages back
    sent = {name: max(e["bytes_sent"] for e in events) for name, events in rounds.items()}
    assert sent["client"] < 0.8 * min(sent["founder"], sent["peer"]), sent
    # and every peer holds the same state at every version it reached
    agreed: dict[int, str] = {}
    for events in rounds.values():
        for e in events:
            assert agreed.setdefault(e["version"], e["state_hash"]) == e["state_hash"], e
    assert max(e["version"] for e in rounds["client"]) == 3
    # the dial-back probe: the peer that can be dialed was, the volunteer was not
    probes = {name: [e for e in read_log(log) if e["event"] == "reachability"]
              for name, log in (("peer", log_p), ("client", log_c))}  # fmt: skip
    assert [e["status"] for e in probes["peer"]] == ["public"], probes
    if mode == "auto":
        assert [e["status"] for e in probes["client"]] == ["private"], probes
    else:
        assert probes["client"] == [], probes  # told, so it did not ask
