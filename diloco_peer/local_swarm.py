"""Real peers on this machine: `python -m diloco_peer join` processes, started, watched, stopped.

`demo`, the multi-peer tests and the swarm benches (bench/chaos_swarm.py, bench/wan.py) launch
peers through this module. Each peer runs in a session of its own, which holds its forked DHT
process and libp2p daemon (a process group of their own) and its lifeline (lifeline.py): stopping
a peer SIGTERMs its main process, which stops the rest, and then SIGKILLs whatever is left in the
session, so that nothing outlives it. `kill_main` kills the main process alone, as a crash or the
OOM killer does, for tests of DESIGN §3's rule that a peer's processes die together. The peers
of a `LocalSwarm` die with the process that started them, too, however it dies (a demo killed by
the OOM killer): a lifeline of its own SIGTERMs each peer's process group, then SIGKILLs what is
left, and each peer's own lifeline then ends its DHT process and daemon.
What a peer does is read from its `--log-json` events (DESIGN §6, peer/events.py).

    with LocalSwarm(folder, run="t") as swarm:  # every session is killed on the way out
        founder, log = swarm.start("a", "--model", "nano")
        b, log_b = swarm.start("b", "--swarm", swarm.address(log, 90, proc=founder))
        swarm.wait_event(log_b, "round", 120, version=2)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from diloco_peer import procfs
from diloco_peer.errors import LocalPeerFailed
from diloco_peer.lifeline import Lifeline
from diloco_peer.peer.events import read_log

logger = logging.getLogger(__name__)

PEER_COMMAND = (sys.executable, "-m", "diloco_peer")
"""How a peer is started: this interpreter, so that the peer imports this very package."""
LOOPBACK_ARGS = ("--host", "127.0.0.1", "--quiet", "--threads", "1")
"""`join` flags of a quiet one-thread peer on 127.0.0.1 (the tests' peers)."""
POLL_S = 0.2
"""How often a wait re-reads a peer's event log."""
KILL_WAIT_S = 10.0
"""How long a SIGKILLed process may take to be reaped before a warning is logged."""


def spawn(
    argv: Sequence[str],
    *,
    stderr: Path | None = None,
    stdout: Any = subprocess.DEVNULL,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start `argv` in a session of its own (see the module docstring), its stderr appended to
    the file `stderr` (None: this process's stderr). `popen` goes to subprocess.Popen."""
    if stderr is None:
        return subprocess.Popen(argv, stdout=stdout, start_new_session=True, **popen)
    with open(stderr, "ab") as err:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=stdout, stderr=err, start_new_session=True, **popen)


def kill_session(proc: subprocess.Popen[Any], wait_s: float = KILL_WAIT_S) -> None:
    """SIGKILL every process in the session of `proc` (what it forked dies too, in whatever
    process group: a peer's DHT process leads one of its own), then reap it."""
    for pid in [proc.pid, *procfs.session_members(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not die within %g s of SIGKILL", proc.pid, wait_s)


def stop_sessions(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM the sessions of the running `procs` (a peer checkpoints and leaves), give them
    `grace_s` together to exit, then SIGKILL whatever is left of every session, exited or not
    (a peer that died by SIGKILL leaves its DHT process and daemon behind in its session)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        try:
            proc.send_signal(signal.SIGTERM)  # the peer stops its own DHT process and daemon
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        kill_session(proc)


def kill_main(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the main process alone, as a crash or the OOM killer does; the rest of its
    session (DHT process, libp2p daemon) must then exit by itself (DESIGN §3)."""
    proc.kill()  # a no-op once the process is reaped: never a reused pid


def wait_for_event(
    log: Path,
    event: str,
    timeout_s: float,
    *,
    proc: subprocess.Popen[Any] | None = None,
    count: int = 1,
    **match: object,
) -> dict[str, Any]:
    """The `count`-th `event` in the event log `log` whose fields equal `match`, once written.

    Raises TimeoutError after `timeout_s`, and LocalPeerFailed if `proc` (the peer writing the
    log) exits without having written it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        # Whether it had exited before this read: an event written just before exiting counts.
        exited = proc is not None and proc.poll() is not None
        found = [
            ev
            for ev in read_log(log)
            if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items())
        ]
        if len(found) >= count:
            return found[count - 1]
        if exited and proc is not None:
            raise LocalPeerFailed(
                f"{log.stem} exited with code {proc.returncode} before its {event} event"
            )
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {event} {match} in {log} within {timeout_s}s")
        time.sleep(POLL_S)


def address(
    log: Path, timeout_s: float, *, proc: subprocess.Popen[Any] | None = None, ip: str = ""
) -> str:
    """The first multiaddr in the `start` event of the peer writing `log` (with `ip`, the first
    on that IP address): what others pass to `join --swarm`. Waits as `wait_for_event`."""
    start = wait_for_event(log, "start", timeout_s, proc=proc)
    found = [m for m in start.get("maddrs") or [] if not ip or f"/{ip}/" in m]
    if not found:
        where = f" on {ip}" if ip else ""
        raise LocalPeerFailed(f"{log.stem} started without an address{where}")
    return found[0]


class LocalSwarm:
    """Peers started in `folder`, each writing NAME.jsonl (events) and NAME.err (stderr) there.

    `close()` (and leaving a `with` block) stops every one: SIGTERM first when `stop_grace_s`
    is positive, then SIGKILL to each whole session.
    """

    def __init__(
        self,
        folder: Path,
        *,
        run: str,
        join_args: Sequence[str] = LOOPBACK_ARGS,
        cwd: Path | None = None,
        stop_grace_s: float = 0.0,
    ) -> None:
        self.folder = folder
        self.run = run
        self.join_args = tuple(join_args)
        """`join` flags every peer gets, after `--run RUN` and before its own."""
        self.cwd = cwd
        self.stop_grace_s = stop_grace_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._line: Lifeline | None = None
        """Ends the peers if this process dies without `close()` (started with the first)."""

    def start(
        self,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start peer `name`: `join --run RUN <join_args> --log-json NAME.jsonl <args>`, run
        through `wrap` if given (a netlab host's `ip netns exec NS`). `env` is the peer's whole
        environment (None: this process's). Returns the process and its event log."""
        log = self.folder / f"{name}.jsonl"
        argv = [*wrap, *PEER_COMMAND, "join", "--run", self.run, *self.join_args,
                "--log-json", str(log), *args]  # fmt: skip
        if self._line is None:
            self._line = Lifeline.start()
        proc = spawn(argv, stderr=self.folder / f"{name}.err", env=env, cwd=self.cwd)
        self.procs.append(proc)
        self._line.watch_group(proc.pid)  # a session of its own: it leads its process group
        return proc, log

    def wait_event(
        self,
        log: Path,
        event: str,
        timeout_s: float,
        *,
        proc: subprocess.Popen[Any] | None = None,
        count: int = 1,
        **match: object,
    ) -> dict[str, Any]:
        """`wait_for_event` on one of this swarm's logs."""
        return wait_for_event(log, event, timeout_s, proc=proc, count=count, **match)

    def address(
        self,
        log: Path,
        timeout_s: float,
        *,
        proc: subprocess.Popen[Any] | None = None,
        ip: str = "",
    ) -> str:
        """`address` of one of this swarm's peers."""
        return address(log, timeout_s, proc=proc, ip=ip)

    def running(self) -> bool:
        """Whether any peer of this swarm is still running."""
        return any(p.poll() is None for p in self.procs)

    def close(self) -> None:
        """Stop every peer (see the class docstring); safe to call again."""
        stop_sessions(self.procs, self.stop_grace_s)
        if self._line is not None:
            self._line.close()
            self._line = None

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class Branches:
    """The states peers' event logs record, checked against DESIGN §3's one-branch invariant."""

    agreed: dict[int, str]
    """The state hash per version, as the first log holding that version recorded it."""
    conflicts: tuple[tuple[Path, int], ...]
    """(log, version) of every kept state that differs from the agreed hash at its version."""

    @property
    def one_branch(self) -> bool:
        return not self.conflicts


def branches(*logs: Path) -> Branches:
    """DESIGN §3's invariant: peers at version v hold equal state hashes, or the fork is healed
    within one round. A fork-healing catch-up (`fork: true`, from version f) abandons the
    peer's states at versions f-1 and f held before it; every state not abandoned must agree
    with every other peer's at its version, and every disagreement must have been abandoned."""
    kept: list[tuple[Path, int, str]] = []
    for log in logs:
        states: list[list[Any]] = []  # [version, hash, abandoned]
        for e in read_log(log):
            if e["event"] not in ("round", "catch_up"):
                continue
            if e["event"] == "catch_up" and e.get("fork"):
                for st in states:
                    if e["from_version"] - 1 <= st[0] <= e["from_version"]:
                        st[2] = True
            states.append([e["version"], e["state_hash"], False])
        kept += [(log, v, h) for v, h, abandoned in states if not abandoned]
    agreed: dict[int, str] = {}
    conflicts: list[tuple[Path, int]] = []
    for log, version, state_hash in kept:
        if agreed.setdefault(version, state_hash) != state_hash:
            conflicts.append((log, version))
    return Branches(agreed, tuple(conflicts))
