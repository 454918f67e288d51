"""A peer's lifeline: nothing it started outlives it, however it dies (DESIGN §3).

A peer's DHT runs in a forked process, and that process starts the libp2p daemon (`p2pd`). When
the peer's main process is killed (SIGKILL, the out-of-memory killer, a crash in native code)
its children are not: they would keep running and keep holding the peer's identity, so a
restart with the same key is refused as "already taken". So each peer starts a watcher:

    line = Lifeline.start()             # a small process that outlives nothing but the peer
    line.watch_group(dht.pid)           # that process group ends when the peer does
    line.watch_path(tmp_folder)         # that file or folder goes too
    ...
    line.close()                        # a clean exit: the watcher cleans up and exits

The watcher holds the read end of a pipe whose only write end is the peer's: it reads EOF the
moment the peer is gone, by any death, and then ends each watched process group (SIGTERM, then
SIGKILL after `GRACE_S`), removes their daemons' socket files and the watched paths, and sweeps
hivemind socket files that nothing listens on any more. Forked children close the write end
(`os.register_at_fork`), exec'd ones never get it (the descriptor is close-on-exec). The DHT
process is the leader of a process group of its own (`p2p/dht.PeerDHT`), which its daemons join.

`end_orphans(key)` is the other half, for a restart: it ends daemons (and their DHT process)
that a previous incarnation with this key left behind, and leaves alone those whose peer lives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from diloco_peer import procfs

log = logging.getLogger(__name__)

GRACE_S = 2.0
"""How long a watched process group has to exit after SIGTERM before it gets SIGKILL."""
EXIT_WAIT_S = 5.0
"""How long `close()` and `end_orphans` wait for what they ended to be gone."""
OWNER_FILE = ".owner"
"""In a peer's temporary folder: the pid and start time of the process it belongs to."""
FOLDER_GLOB = "diloco-peer-*"
_MAX_LINE = 4096
_POLL_S = 0.05


class Lifeline:
    """The peer's end of the watcher (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], fd: int) -> None:
        self._proc = proc
        self._fd = fd
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _drop_in_child(ref))

    @classmethod
    def start(cls) -> Lifeline:
        """Start the watcher of this process (a process group of its own, so that the group
        that kills a peer does not kill its watcher too)."""
        read, write = os.pipe()  # both close-on-exec; the watcher gets `read` as its stdin
        package_root = str(Path(__file__).resolve().parent.parent)
        code = f"import sys; sys.path.insert(0, {package_root!r}); from diloco_peer.lifeline import main; main()"
        try:
            # a group of its own (Python 3.10 has no process_group: a session of its own)
            own: dict[str, object] = (
                {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
            )
            proc = subprocess.Popen(
                [sys.executable, "-c", code], stdin=read, stdout=subprocess.DEVNULL,
                close_fds=True, **own,  # type: ignore[arg-type]
            )  # fmt: skip
        finally:
            os.close(read)
        return cls(proc, write)

    def watch_group(self, pgid: int) -> None:
        """End process group `pgid` (led by process `pgid`) when this process ends."""
        leader = procfs.stat(pgid)
        self._send(f"group {pgid} {leader.start if leader else 0}")

    def watch_path(self, path: Path) -> None:
        """Remove this file or folder when this process ends."""
        self._send(f"path {path.resolve()}")

    @staticmethod
    def own_folder(folder: Path) -> None:
        """Mark `folder` as this process's: a later watcher removes it if this one could not
        (`sweep_folders`)."""
        me = procfs.stat(os.getpid())
        (folder / OWNER_FILE).write_text(f"{os.getpid()} {me.start if me else 0}\n")

    def close(self) -> None:
        """A clean exit: the watcher ends what is still watched and exits; idempotent."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        try:
            self._proc.wait(timeout=EXIT_WAIT_S + 2 * GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("the lifeline process %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()

    def _send(self, line: str) -> None:
        data = (line + "\n").encode()
        if self._fd < 0 or len(data) > _MAX_LINE:
            raise ValueError(f"cannot hand the lifeline {line!r}")
        try:
            os.write(self._fd, data)  # one write under PIPE_BUF: never interleaved
        except OSError as e:
            log.warning("the lifeline is gone (%s): this peer's helpers may outlive it", e)


def _drop_in_child(ref: weakref.ref[Lifeline]) -> None:
    """In a forked child: close the inherited write end, or the watcher would wait for it."""
    line = ref()
    if line is not None and line._fd >= 0:
        with contextlib.suppress(OSError):
            os.close(line._fd)
        line._fd = -1


# ----- the watcher process


def main() -> None:
    """The watcher: read what to watch until EOF (the peer is gone), then clean up."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the peer's death, or a plain kill, ends it
    # quiet: its stderr is the peer's, whose last line (an error, a summary) must stay last
    logging.basicConfig(level=logging.WARNING, format="lifeline: %(message)s")
    procfs.remove(procfs.stale_sockets())
    sweep_folders(Path(tempfile.gettempdir()))
    groups: dict[int, int] = {}
    paths: list[Path] = []
    stdin = sys.stdin.buffer
    while line := stdin.readline(_MAX_LINE):
        match line.decode(errors="replace").split(maxsplit=1):
            case ["group", rest]:
                with contextlib.suppress(ValueError):
                    pgid, start = (int(x) for x in rest.split())
                    groups[pgid] = start
            case ["path", rest]:
                paths.append(Path(rest.strip()))
    end_groups(groups)
    for path in paths:
        remove_path(path)
    procfs.remove(procfs.stale_sockets())


def group_members(pgid: int) -> list[int]:
    return [pid for pid in procfs.pids() if (s := procfs.running(pid)) and s.pgid == pgid]


def end_groups(groups: dict[int, int]) -> int:
    """SIGTERM each process group, SIGKILL what is left after GRACE_S, remove their daemons'
    sockets; how many processes there were. A group whose leader is another process than the
    one watched (its pid was reused) is left alone."""
    members: list[int] = []
    for pgid, start in groups.items():
        if pgid <= 1 or pgid == os.getpgrp():
            continue
        leader = procfs.stat(pgid)
        if leader is not None and start and leader.start != start:
            continue  # not the group that was watched
        members += group_members(pgid)
    if not members:
        return 0
    sockets = [p for pid in members for p in procfs.daemon_sockets(procfs.cmdline(pid))]
    signal_all(members, signal.SIGTERM)
    if not wait_gone(members, GRACE_S):
        signal_all(members, signal.SIGKILL)
        wait_gone(members, EXIT_WAIT_S)
    procfs.remove(sockets)
    return len(members)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    """Wait until none of `pids` runs (a zombie counts as gone); whether that happened."""
    deadline = time.monotonic() + timeout_s
    starts = {pid: s.start for pid in pids if (s := procfs.running(pid)) is not None}
    while True:
        alive = [
            pid
            for pid, start in starts.items()
            if (s := procfs.running(pid)) is not None and s.start == start
        ]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def sweep_folders(parent: Path) -> int:
    """Remove the peers' temporary folders in `parent` whose owner process has ended; how many."""
    removed = 0
    for folder in parent.glob(FOLDER_GLOB):
        try:
            pid, start = (int(x) for x in (folder / OWNER_FILE).read_text().split())
        except (OSError, ValueError):
            continue  # not marked (or not a peer's): left alone
        owner = procfs.running(pid)
        if owner is None or owner.start != start:
            remove_path(folder)
            removed += 1
    return removed


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# ----- a restart


def end_orphans(key: bytes) -> int:
    """End the libp2p daemons holding `key` whose peer is dead (a previous incarnation killed
    before it could clean up), with their DHT process; how many processes were ended. A daemon
    whose peer still runs is left alone: that key is in use, which the caller reports."""
    doomed: list[int] = []
    for pid, dht, alive in _key_daemons(key):
        if alive:
            continue
        doomed.append(pid)
        if dht is not None and dht.pid > 1 and procfs.exe(dht.pid) == procfs.exe(os.getpid()):
            doomed.append(dht.pid)  # the orphaned DHT process itself (a python, like us)
    if not doomed:
        return 0
    sockets = [p for pid in doomed for p in procfs.daemon_sockets(procfs.cmdline(pid))]
    signal_all(doomed, signal.SIGKILL)
    wait_gone(doomed, EXIT_WAIT_S)
    procfs.remove(sockets)
    return len(doomed)


def live_holders(key: bytes) -> list[int]:
    """The running peers on this machine whose libp2p daemon holds `key` (their main process
    ids): a second peer with that key must not start. This does not rest on the swarm: hivemind's
    own check (a libp2p lookup of the peer id through the --swarm peers) can miss a live holder
    on a loaded machine, and two daemons with one key break both peers' connections."""
    holders = {dht.ppid for _, dht, alive in _key_daemons(key) if alive and dht is not None}
    return sorted(holders)


def _key_daemons(key: bytes) -> Iterator[tuple[int, procfs.Stat | None, bool]]:
    """Each running libp2p daemon holding `key`: its pid, its parent (the peer's DHT process,
    None once gone) and whether the peer that DHT process was forked from still runs."""
    for pid in procfs.daemons_with_identity(key):
        daemon = procfs.stat(pid)
        if daemon is None:
            continue
        dht = procfs.stat(daemon.ppid)
        yield pid, dht, dht is not None and _peer_alive(dht)


def _peer_alive(dht: procfs.Stat) -> bool:
    """A DHT process is forked from its peer, so the two share one command line: its parent
    runs the same one only while the peer lives (an orphan's parent is init or a reaper)."""
    argv = procfs.cmdline(dht.pid)
    return dht.ppid > 1 and bool(argv) and procfs.cmdline(dht.ppid) == argv
