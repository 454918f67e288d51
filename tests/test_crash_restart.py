"""A crashed peer leaves nothing behind and comes back (DESIGN §3, lifeline.py).

The crash is a SIGKILL of the peer's main process alone, as the out-of-memory killer or a crash
in native code does it: the kernel does not kill the process's children.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import FAST_RUN

from diloco_peer import procfs
from diloco_peer.errors import LocalPeerFailed
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import LocalSwarm, branches, kill_main
from diloco_peer.peer.events import read_log

RUN = FAST_RUN + "checkpoint_every = 1\n"
"""FAST_RUN, checkpointing after every round."""


def _until(check, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


def _daemon_of(sid: int) -> tuple[str, ...]:
    argv = [procfs.cmdline(pid) for pid in procfs.session_members(sid)]
    daemons = [a for a in argv if procfs.is_daemon(a)]
    assert daemons, f"no libp2p daemon in the peer's session: {argv}"
    return daemons[0]


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_peer_killed_alone_leaves_no_process_socket_or_key_behind(swarm: LocalSwarm) -> None:
    peer, log = swarm.start("a", "--model", "nano")
    swarm.wait_event(log, "start", 90, proc=peer)
    members = procfs.session_members(peer.pid)
    daemon = _daemon_of(peer.pid)
    sockets = procfs.daemon_sockets(daemon)
    key_folder = Path(procfs.daemon_option(daemon, "id") or "").parent
    assert len(members) >= 4, members  # main, DHT process, daemon, lifeline
    assert sockets[0].exists() and key_folder.name.startswith("diloco-peer-")

    kill_main(peer)
    killed = time.monotonic()
    assert _until(lambda: not procfs.session_members(peer.pid), 5.0), [
        procfs.cmdline(pid) for pid in procfs.session_members(peer.pid)
    ]
    assert time.monotonic() - killed < 5.0
    assert not any(s.exists() for s in sockets)
    assert not key_folder.exists()  # the private key's copy for the daemon is gone too


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_a_restart_ends_what_its_killed_incarnation_left_and_rejoins(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN)
    a, log_a = swarm.start("a", "--config", str(cfg))
    maddr = swarm.wait_event(log_a, "start", 90, proc=a)["maddrs"][0]
    key, ckpt = tmp_path / "b.key", tmp_path / "b-ckpt"
    key.write_bytes(Identity.generate().to_bytes())
    b_args = ["--swarm", maddr, "--identity", str(key), "--checkpoint-dir", str(ckpt)]
    b, log_b = swarm.start("b", *b_args)
    swarm.wait_event(log_b, "round", 120, proc=b, count=2)

    # The key is live: a second peer with it is refused, and b's processes are left alone.
    dup, _ = swarm.start("dup", "--swarm", maddr, "--identity", str(key))
    assert dup.wait(timeout=90) == 2
    err = (tmp_path / "dup.err").read_text().strip().splitlines()
    assert "already taken" in err[-1] and not any("Traceback" in line for line in err), err
    assert b.poll() is None and procfs.is_daemon(_daemon_of(b.pid))

    # The worst crash: the lifeline is gone first, then the main process. The DHT process and
    # the daemon stay, holding the key, until the restart ends them.
    lifeline = [
        p for p in procfs.session_members(b.pid) if "lifeline" in " ".join(procfs.cmdline(p))
    ]
    assert len(lifeline) == 1
    os.kill(lifeline[0], signal.SIGKILL)
    kill_main(b)
    time.sleep(1.0)
    left = procfs.session_members(b.pid)
    assert len(left) == 2, [procfs.cmdline(p) for p in left]  # DHT process and daemon

    restarted = time.monotonic()
    b2, log_b2 = swarm.start("b2", *b_args)
    start = swarm.wait_event(log_b2, "start", 90, proc=b2)
    # the 30 s target is measured by bench/churn.py, not in a timed test on a shared machine:
    # here a bound that only a restart stuck on the old incarnation's key would miss
    assert time.monotonic() - restarted < 90, "the restart took over 90 s to rejoin"
    assert "ended 2 process(es)" in (tmp_path / "b2.err").read_text()
    assert not procfs.session_members(b.pid)
    assert start["peer"] == next(e for e in read_log(log_b) if e["event"] == "start")["peer"]
    resume = next(e for e in read_log(log_b2) if e["event"] == "resume")
    assert resume["version"] >= 1 and resume["rounds_done"] >= 1
    # it trains again: a round together with a, at the swarm's version or later
    target = max(e["version"] for e in read_log(log_a) if e["event"] == "round")
    done = swarm.wait_event(log_b2, "round", 90, proc=b2)
    assert done["version"] >= target and done["group_size"] == 2, done


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_second_process_with_a_live_key_that_the_start_checks_missed_leaves(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """hivemind's lookup at start can miss a live holder of the key (CI saw the duplicate run
    on once). `--fault unchecked-key=1` starts without any check, as that miss does: the heads
    then tell the two processes apart (key_watch.py), the later one leaves with exit 2 and
    publishes no departure, and the earlier one trains on."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN)
    a, log_a = swarm.start("a", "--config", str(cfg))
    maddr = swarm.wait_event(log_a, "start", 90, proc=a)["maddrs"][0]
    key = tmp_path / "b.key"
    key.write_bytes(Identity.generate().to_bytes())
    b, log_b = swarm.start("b", "--swarm", maddr, "--identity", str(key))
    swarm.wait_event(log_b, "round", 120, proc=b)

    # With the key live in b, hivemind's reachability ping at the node's start may reach b or
    # time out and refuse the node (exit 2, one line: CI saw it once); that is a clean leave too,
    # but not the watch this test is for, so such a start is tried again.
    for attempt in range(1, 4):
        name = f"dup{attempt}"
        dup, log_dup = swarm.start(name, "--swarm", maddr, "--identity", str(key),
                                   "--fault", "unchecked-key=1")  # fmt: skip
        started = time.monotonic()
        try:
            swarm.wait_event(log_dup, "start", 90, proc=dup)  # it did start: no check stopped it
            break
        except LocalPeerFailed:
            err = (tmp_path / f"{name}.err").read_text().strip().splitlines()
            assert dup.returncode == 2 and "network node" in err[-1], err
            assert not any("Traceback" in line for line in err), err
    else:
        pytest.fail("the duplicate's node was refused at start three times")
    assert dup.wait(timeout=180) == 2
    left_after_s = time.monotonic() - started
    err = (tmp_path / f"{name}.err").read_text().strip().splitlines()
    assert "already taken" in err[-1] and not any("Traceback" in line for line in err), err
    # (b may or may not have seen two of dup's heads before dup left: it need not notice)
    assert b.poll() is None and a.poll() is None

    # b trains on with a, on one branch
    rounds_before = sum(1 for e in read_log(log_b) if e["event"] == "round")
    done = swarm.wait_event(log_b, "round", 120, proc=b, count=rounds_before + 1)
    assert done["group_size"] == 2, done
    assert branches(log_a, log_b).one_branch, "a and b disagree on a state"
    print(f"the duplicate left {left_after_s:.0f} s after it started")
