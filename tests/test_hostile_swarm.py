"""A hijacker in a real swarm (issue 16): `join --chaos hijack` against 3 honest peers.

The whole matrix (5 honest peers, every attack, two baselines) is bench/hostile_swarm.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from diloco_peer.local_swarm import LocalSwarm, branches
from diloco_peer.peer.events import read_log

NANO = ["--model", "nano", "--inner-steps", "10"]


def _maddr(peers: LocalSwarm, log: Path) -> str:
    start = peers.wait_event(log, "start", 90)
    return next(m for m in start["maddrs"] if "127.0.0.1" in m)


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_no_honest_peer_adopts_a_hijackers_forged_state(swarm: LocalSwarm) -> None:
    """After its first commit the hijacker sets θ = 0, claims version + 50, and keeps its head
    and state server on that forged state for the whole run. The 3 honest peers never hold it
    (one key's word is never downloaded whole), reach version 4 on one branch, and ban nobody."""
    founder, flog = swarm.start("h0", *NANO, "--expected-peers", "4", "--until-version", "4")
    addr = ["--swarm", _maddr(swarm, flog)]
    honest = [(founder, flog)] + [
        swarm.start(f"h{i}", *addr, "--until-version", "4") for i in (1, 2)
    ]
    hijacker, hlog = swarm.start(
        "hijacker", *addr, "--chaos", "hijack", "--until-version", "1000000"
    )
    deadline = time.time() + 240
    for proc, _ in honest:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    assert hijacker.poll() is None, "the hijacker must serve its forgery until the end"
    forged = re.findall(
        r"chaos: forged state v(\d+) ([0-9a-f]{64})", (swarm.folder / "hijacker.err").read_text()
    )
    assert forged and int(forged[0][0]) >= 51, forged
    forged_hashes = {h for _, h in forged}
    logs = [log for _, log in honest]
    events = [e for log in logs for e in read_log(log)]
    assert not [e for e in events if e.get("state_hash") in forged_hashes]
    assert not [e for e in events if e["event"] == "catch_up" and e["version"] > 4]
    assert not [e for e in events if e["event"] == "excluded" and e.get("banned")]
    assert branches(*logs).one_branch
    stops = [next(e for e in read_log(log) if e["event"] == "stop") for log in logs]
    assert all(s["finite"] and s["version"] == 4 for s in stops), stops
