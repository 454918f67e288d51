"""What Linux's /proc says about this machine's processes, for a peer's clean-up (DESIGN §3).

A peer's helpers (hivemind's DHT process and each libp2p daemon, `p2pd`) must not outlive it.
These functions answer the questions that clean-up asks, and nothing else:

    stat(pid)                       # parent, process group, session, start time (or None)
    cmdline(pid)                    # its argv (or ())
    daemons_with_identity(key)      # p2pd processes started with this key (any key file path)
    listening_unix_paths()          # every bound unix socket path, in every network namespace
    stale_sockets()                 # /tmp/hivemind-*.sock files that nothing listens on

Everything here reads /proc and the files it names; a process that ends while it is read is
simply absent. On a system without /proc every answer is empty, so clean-up does nothing there.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SOCKET_DIR = Path("/tmp")
"""hivemind names its daemon's and clients' sockets `/tmp/hivemind-<role>-<token>.sock`."""
SOCKET_GLOB = "hivemind-*.sock"
SOCKET_MIN_AGE_S = 10.0
"""A socket file younger than this is never swept: its owner may still be setting it up."""
_KEY_FILE_MAX_BYTES = 1 << 16


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat that clean-up needs."""

    pid: int
    state: str
    """R, S, D, ... or Z: a zombie has ended and only waits to be reaped by its parent."""
    ppid: int
    pgid: int
    sid: int
    start: int
    """Start time in clock ticks since boot: with the pid, names one process for good."""


def stat(pid: int) -> Stat | None:
    """The process `pid`, or None if there is none (or no /proc)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name (field 2) is in parentheses and may hold spaces or parentheses itself
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return Stat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def cmdline(pid: int) -> tuple[str, ...]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ()
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def exe(pid: int) -> str | None:
    """The program `pid` runs (None if unknown)."""
    try:
        return os.readlink(PROC / str(pid) / "exe")
    except OSError:
        return None


def pids() -> list[int]:
    try:
        return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def running(pid: int) -> Stat | None:
    """The process `pid` unless it has ended (a zombie has)."""
    s = stat(pid)
    return s if s is not None and s.state != "Z" else None


def session_members(sid: int) -> list[int]:
    """Every running process of session `sid` (its leader may have exited already)."""
    return [pid for pid in pids() if (s := running(pid)) is not None and s.sid == sid]


def is_daemon(argv: tuple[str, ...]) -> bool:
    """A libp2p daemon started by hivemind (its binary is named p2pd)."""
    return bool(argv) and Path(argv[0]).name == "p2pd"


def daemon_option(argv: tuple[str, ...], name: str) -> str | None:
    """The value of `-name=value` in a p2pd command line (hivemind writes them that way)."""
    prefix = f"-{name}="
    return next((a[len(prefix) :] for a in argv if a.startswith(prefix)), None)


def daemons_with_identity(key: bytes) -> list[int]:
    """The p2pd processes whose key file (`-id=`) holds `key`, wherever that file is."""
    found = []
    for pid in pids():
        argv = cmdline(pid)
        if not is_daemon(argv):
            continue
        path = daemon_option(argv, "id")
        if path is None:
            continue
        with contextlib.suppress(OSError):
            # a relative -id is relative to the daemon's working directory
            full = PROC / str(pid) / "cwd" / path if not path.startswith("/") else Path(path)
            with open(full, "rb") as f:
                if f.read(_KEY_FILE_MAX_BYTES + 1) == key:
                    found.append(pid)
    return found


def daemon_sockets(argv: tuple[str, ...]) -> list[Path]:
    """The socket files a p2pd and its first client use: hivemind names both after one token."""
    listen = daemon_option(argv, "listen")
    if listen is None or not listen.startswith("/unix/"):
        return []
    daemon = Path(listen[len("/unix") :])
    token = daemon.name.removeprefix("hivemind-p2pd-")
    if token == daemon.name:
        return [daemon]
    return [daemon, daemon.with_name(f"hivemind-p2pclient-{token}")]


def _namespaces() -> Iterator[int]:
    """One readable process per network namespace (sockets are listed per namespace)."""
    seen: set[str] = set()
    for pid in pids():
        try:
            ns = os.readlink(PROC / str(pid) / "ns" / "net")
        except OSError:
            continue
        if ns not in seen:
            seen.add(ns)
            yield pid


def listening_unix_paths() -> set[str] | None:
    """The paths of every bound unix socket on this machine, every network namespace included;
    None when some namespace could not be read (then nothing can be called stale)."""
    paths: set[str] = set()
    for pid in _namespaces():
        try:
            lines = (PROC / str(pid) / "net" / "unix").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # the process ended while it was read
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/"):
                paths.add(fields[7])
    return paths


def stale_sockets(now: float | None = None) -> list[Path]:
    """hivemind socket files in /tmp that are this user's, older than SOCKET_MIN_AGE_S, and
    bound by no socket anywhere on this machine: left by a process that was killed."""
    live = listening_unix_paths()
    if live is None:
        return []
    now = time.time() if now is None else now
    stale = []
    for path in SOCKET_DIR.glob(SOCKET_GLOB):
        try:
            info = path.lstat()
        except OSError:
            continue
        if info.st_uid == os.getuid() and now - info.st_mtime >= SOCKET_MIN_AGE_S:
            if str(path) not in live:
                stale.append(path)
    return stale


def remove(paths: list[Path]) -> int:
    """Unlink each path that still exists; how many were removed."""
    removed = 0
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed
