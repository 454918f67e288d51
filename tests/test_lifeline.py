"""The lifeline and /proc reading (lifeline.py, procfs.py), with real processes and sockets.

The same mechanism with a real peer (hivemind's DHT process and daemon) is in
tests/test_crash_restart.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from diloco_peer import procfs

_FAKE_PEER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from diloco_peer.lifeline import Lifeline

    line = Lifeline.start()
    helper = subprocess.Popen(["sleep", "600"], process_group=0)  # like the DHT process
    line.watch_group(helper.pid)
    line.watch_path(Path(sys.argv[1]))
    print(helper.pid, line._proc.pid, flush=True)
    time.sleep(600)
    """
)


def _until(check, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())


def _fake_peer(tmp_path: Path) -> tuple[subprocess.Popen[str], int, int, Path]:
    folder = tmp_path / "peer-tmp"
    folder.mkdir()
    (folder / "identity.key").write_bytes(b"secret")
    peer = subprocess.Popen(
        [sys.executable, "-c", _FAKE_PEER, str(folder)], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert peer.stdout is not None
    helper, watcher = (int(x) for x in peer.stdout.readline().split())
    return peer, helper, watcher, folder


def test_a_sigkilled_process_takes_its_watched_group_and_folder_with_it(tmp_path: Path) -> None:
    peer, helper, watcher, folder = _fake_peer(tmp_path)
    try:
        assert procfs.running(helper) and procfs.running(watcher)
        peer.kill()  # SIGKILL: the kernel leaves `helper` running; the lifeline does not
        peer.wait(timeout=10)
        assert _until(lambda: procfs.running(helper) is None, 5.0)
        assert _until(lambda: procfs.running(watcher) is None, 5.0)
        assert not folder.exists()  # removed before the watcher exits
    finally:
        for pid in (helper, watcher):
            if procfs.running(pid):
                os.kill(pid, signal.SIGKILL)


def test_killing_the_peers_process_group_still_ends_its_watched_group(tmp_path: Path) -> None:
    peer, helper, watcher, folder = _fake_peer(tmp_path)
    try:
        os.killpg(peer.pid, signal.SIGKILL)  # the peer's own process group, as `kill -9 -PGID`
        peer.wait(timeout=10)
        assert _until(lambda: procfs.running(helper) is None, 5.0)
        assert _until(lambda: not folder.exists(), 5.0)
    finally:
        for pid in (helper, watcher):
            if procfs.running(pid):
                os.kill(pid, signal.SIGKILL)


def test_only_unbound_old_hivemind_sockets_are_stale() -> None:
    tag = uuid.uuid4().hex[:8]
    live_path, dead_path, young_path = (
        procfs.SOCKET_DIR / f"hivemind-test{tag}-{role}.sock" for role in ("live", "dead", "young")
    )
    live, dead, young = (socket.socket(socket.AF_UNIX) for _ in range(3))
    try:
        live.bind(str(live_path))
        live.listen()
        dead.bind(str(dead_path))
        young.bind(str(young_path))
        dead.close()  # what a killed process leaves: the file, no socket
        young.close()
        old = time.time() - procfs.SOCKET_MIN_AGE_S - 5
        for path in (live_path, dead_path):
            os.utime(path, (old, old))
        stale = procfs.stale_sockets()
        assert dead_path in stale
        assert live_path not in stale and young_path not in stale
        assert procfs.remove([dead_path, dead_path]) == 1 and not dead_path.exists()
    finally:
        live.close()
        procfs.remove([live_path, dead_path, young_path])


def test_daemon_command_lines_are_read_for_their_key_and_sockets() -> None:
    argv = ("/x/p2pd", "-b=1", "-listen=/unix/tmp/hivemind-p2pd-AbC.sock", "-id=/k/identity.key")
    assert procfs.is_daemon(argv) and not procfs.is_daemon(("python", "-m", "p2pd"))
    assert procfs.daemon_option(argv, "id") == "/k/identity.key"
    assert procfs.daemon_option(argv, "nope") is None
    assert procfs.daemon_sockets(argv) == [
        Path("/tmp/hivemind-p2pd-AbC.sock"),
        Path("/tmp/hivemind-p2pclient-AbC.sock"),
    ]
    assert procfs.daemon_sockets(("/x/p2pd", "-listen=/ip4/1.2.3.4/tcp/5")) == []


def test_stat_reads_this_process_and_none_for_a_missing_one() -> None:
    me = procfs.stat(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.pgid == os.getpgrp()
    assert me.sid == os.getsid(0) and me.state in "RS"
    assert procfs.stat(2**22 + 7) is None and procfs.cmdline(2**22 + 7) == ()


def test_folders_of_ended_peers_are_swept_and_others_kept(tmp_path: Path) -> None:
    from diloco_peer.lifeline import OWNER_FILE, Lifeline, sweep_folders

    mine, dead, unmarked = (tmp_path / f"diloco-peer-{n}" for n in ("mine", "dead", "unmarked"))
    for folder in (mine, dead, unmarked):
        folder.mkdir()
    Lifeline.own_folder(mine)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (dead / OWNER_FILE).write_text(f"{gone.pid} 1\n")
    assert sweep_folders(tmp_path) == 1
    assert mine.exists() and unmarked.exists() and not dead.exists()
