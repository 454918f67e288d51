"""`diloco-peer demo` stopped by SIGTERM (a service manager, `timeout`, a shell's kill) stops
every peer it started, as Ctrl+C does; it used to end alone and leave its peers training. Killed
by SIGKILL (the OOM killer), it cannot stop them itself: its local swarm's lifeline does, and
each peer's own lifeline then ends the peer's DHT process and daemon."""

from __future__ import annotations

import signal
import subprocess
import time

from diloco_peer import procfs
from diloco_peer.lifeline import signal_all, wait_gone
from diloco_peer.local_swarm import PEER_COMMAND, kill_session

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 90.0  # the demo gives its peers 20 s to leave, then kills what is left


def _peers_of(demo_pid: int) -> list[int]:
    """The `join` processes the demo started (its children)."""
    return [
        pid
        for pid in procfs.pids()
        if (s := procfs.running(pid)) is not None
        and s.ppid == demo_pid
        and "join" in procfs.cmdline(pid)
    ]


def _wait(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    return condition()


def _kill_sessions(pids: list[int]) -> None:
    """SIGKILL each peer's session (a peer leads its own, with its DHT process and daemon)."""
    for pid in pids:
        signal_all(procfs.session_members(pid), signal.SIGKILL)


def _start_demo() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*PEER_COMMAND, "demo", "--peers", "2", "--rounds", "1000", "--model", "nano",
         "-H", "5", "--timeout-s", "600", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def test_sigterm_stops_the_demo_and_every_peer_it_started() -> None:
    demo = _start_demo()
    peers: list[int] = []
    try:
        assert _wait(lambda: len(_peers_of(demo.pid)) == 2, START_TIMEOUT_S), "peers never started"
        peers = _peers_of(demo.pid)
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=STOP_TIMEOUT_S)
        assert wait_gone(peers, 10.0), f"peers left running after the demo stopped: {peers}"
    finally:
        if demo.poll() is None:
            kill_session(demo)
        _kill_sessions(peers)


def test_a_demo_killed_alone_by_sigkill_leaves_no_process_of_its_peers() -> None:
    demo = _start_demo()
    peers: list[int] = []
    helpers: list[int] = []
    try:
        assert _wait(lambda: len(_peers_of(demo.pid)) == 2, START_TIMEOUT_S), "peers never started"
        peers = _peers_of(demo.pid)
        # each peer's DHT process and daemon: up once the peer's session holds them
        assert _wait(lambda: all(len(procfs.session_members(p)) >= 3 for p in peers), 60.0)
        helpers = [m for p in peers for m in procfs.session_members(p) if m != p]
        demo.kill()  # the main process alone, as the OOM killer does
        demo.wait(timeout=10)
        assert wait_gone(peers, 30.0), f"peers left running after the demo died: {peers}"
        assert wait_gone(helpers, 30.0), f"peer processes left behind: {helpers}"
    finally:
        kill_session(demo)
        _kill_sessions(peers)
