"""The local-swarm launcher (diloco_peer/local_swarm.py) and the event-log reader
(diloco_peer/peer/events.py), with stand-in processes instead of peers where they suffice."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco_peer.errors import LocalPeerFailed
from diloco_peer.local_swarm import (
    LocalSwarm,
    branches,
    kill_main,
    kill_session,
    spawn,
    stop_sessions,
    wait_for_event,
)
from diloco_peer.peer.events import EventLog, parse_events, read_events, read_log


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _until(condition: Callable[[], object], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def _with_child(folder: Path, trap: str = "") -> tuple[subprocess.Popen[bytes], int]:
    """A shell in a session of its own with a `sleep` child; the child's pid."""
    folder.mkdir(exist_ok=True)
    pid_file = folder / "child.pid"
    script = f"{trap} sleep 600 & echo $! > {pid_file}; wait"
    proc = spawn(["sh", "-c", script], stderr=folder / "sh.err")
    assert _until(lambda: pid_file.exists() and pid_file.read_text().strip())
    return proc, int(pid_file.read_text())


# ----------------------------------------------------------------------------- reading logs


def test_read_events_returns_complete_lines_and_where_to_go_on(tmp_path: Path) -> None:
    log = tmp_path / "peer.jsonl"
    assert read_events(log) == ([], 0)  # not written yet
    first = json.dumps({"event": "start", "version": 0})
    log.write_text(first + "\n" + '{"event": "rou')
    events, offset = read_events(log)
    assert events == [{"event": "start", "version": 0}] and offset == len(first) + 1
    with open(log, "a") as f:  # the torn line completes, a broken one follows
        f.write('nd", "version": 1}\nnot json\n[1, 2]\n\n')
    events, end = read_events(log, offset)
    assert events == [{"event": "round", "version": 1}]
    assert end == log.stat().st_size and read_events(log, end) == ([], end)
    assert [e["event"] for e in read_log(log)] == ["start", "round"]


def test_parse_events_counts_what_it_skips() -> None:
    text = '{"event": "a"}\n\n  \nnot json\n[1]\n' + "[" * 100_000 + "\n" + '{"event": "b"}'
    events, skipped = parse_events(text)
    assert [e["event"] for e in events] == ["a", "b"] and skipped == 3


def test_the_reader_reads_what_the_writer_writes(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "p.jsonl"), peer="Qm1")
    log.emit("round", version=1, loss=float("nan"), note="é")
    log.close()
    (event,) = read_log(tmp_path / "p.jsonl")
    assert event["peer"] == "Qm1" and event["loss"] is None and event["note"] == "é"


def test_branches_allow_a_healed_fork_and_report_an_unhealed_one(tmp_path: Path) -> None:
    def log(name: str, *events: dict[str, object]) -> Path:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        return path

    a = log("a", {"event": "round", "version": 1, "state_hash": "x"},
            {"event": "round", "version": 2, "state_hash": "y"})  # fmt: skip
    # b's version 1 was abandoned by the fork-healing catch-up that followed it
    b = log("b", {"event": "round", "version": 1, "state_hash": "other"},
            {"event": "catch_up", "fork": True, "from_version": 1, "version": 2,
             "state_hash": "y"})  # fmt: skip
    healed = branches(a, b)
    assert healed.one_branch and healed.agreed == {1: "x", 2: "y"}
    c = log("c", {"event": "round", "version": 2, "state_hash": "z"})
    forked = branches(a, b, c)
    assert not forked.one_branch and forked.conflicts == ((c, 2),)


# ----------------------------------------------------------------------------- processes


def test_kill_session_kills_what_the_process_forked(tmp_path: Path) -> None:
    proc, child = _with_child(tmp_path)
    kill_session(proc)
    assert proc.returncode == -signal.SIGKILL
    assert _until(lambda: not _alive(child))
    kill_session(proc)  # again: nothing left, nothing raised


def test_kill_main_leaves_the_rest_of_the_session(tmp_path: Path) -> None:
    proc, child = _with_child(tmp_path)
    try:
        kill_main(proc)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert _alive(child)  # a peer's DHT process must notice this by itself
    finally:
        kill_session(proc)
    assert _until(lambda: not _alive(child))


def test_stop_sessions_terminates_then_kills(tmp_path: Path) -> None:
    polite, _ = _with_child(tmp_path / "a")
    stubborn, child = _with_child(tmp_path / "b", trap="trap '' TERM;")
    started = time.monotonic()
    stop_sessions([polite, stubborn], grace_s=1.0)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert _until(lambda: not _alive(child))


def test_wait_for_event_times_out_or_reports_an_exited_peer(tmp_path: Path) -> None:
    log = tmp_path / "p.jsonl"
    log.write_text(json.dumps({"event": "round", "version": 1}) + "\n")
    assert wait_for_event(log, "round", 1, version=1)["version"] == 1
    with pytest.raises(TimeoutError):
        wait_for_event(log, "round", 0.3, version=2)
    done = subprocess.Popen(["true"])
    done.wait()
    with pytest.raises(LocalPeerFailed, match="exited with code 0"):
        wait_for_event(log, "stop", 30, proc=done)


def test_a_peer_refusing_its_flags_is_reported_with_its_stderr_kept(tmp_path: Path) -> None:
    with LocalSwarm(tmp_path, run="t") as swarm:
        proc, log = swarm.start("a", "--batch-size", "lots")
        with pytest.raises(LocalPeerFailed):
            swarm.address(log, 120, proc=proc)
    assert proc.returncode == 2
    assert "--batch-size" in (tmp_path / "a.err").read_text()
