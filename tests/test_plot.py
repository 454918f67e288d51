"""`diloco-peer plot`: curves from --log-json event logs and simulate --json documents."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import DemoRun
from matplotlib.image import imread

from diloco_peer import plot
from diloco_peer.cli.main import main
from diloco_peer.plot import Run, build_figure, load_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PEER_A = "QmPeerAlphaAlphaAlphaAlphaAlphaAlphaAlpha0AAAAAAA"
PEER_B = "QmPeerBravoBravoBravoBravoBravoBravoBravo0BBBBBBB"
T0 = 1_700_000_000.0


def ev(kind: str, t: float, peer: str, version: int, **fields: Any) -> dict[str, Any]:
    """One event as `EventLog.emit` writes it (DESIGN §6 fields first)."""
    base = {"event": kind, "time": T0 + t, "peer": peer, "version": version,
            "state_hash": f"h{version}", "group_size": 0, "loss": None}  # fmt: skip
    return {**base, **fields}


def rnd(t: float, peer: str, version: int, ppl: float | None, steps: int = 10) -> dict[str, Any]:
    return ev("round", t, peer, version, group_size=2, loss=4.0, ppl=ppl, comm_s=0.5 + version,
              steps=steps, bytes_sent=100, bytes_received=100, staleness=0, compute_s=1.0,
              wait_s=0.1)  # fmt: skip


def swarm_events(manifest: str = "m1", t_offset: float = 0.0) -> list[dict[str, Any]]:
    """Two peers, three rounds of 10 local steps each, ppl evaluated at versions 1 and 3."""
    o = t_offset
    return [
        ev("start", o + 0, PEER_A, 0, ppl=200.0, manifest=manifest),
        ev("start", o + 2, PEER_B, 0, ppl=200.0, manifest=manifest),
        rnd(o + 10, PEER_A, 1, 60.0),
        rnd(o + 10.5, PEER_B, 1, 60.0),
        ev("catch_up", o + 11, PEER_B, 1, method="replay"),
        rnd(o + 20, PEER_A, 2, None),
        rnd(o + 20.2, PEER_B, 2, None),
        rnd(o + 30, PEER_A, 3, 25.0),
        rnd(o + 30.1, PEER_B, 3, 25.0),
        ev("stop", o + 31, PEER_A, 3, ppl=25.0, applied_steps=60),
        ev("stop", o + 31.5, PEER_B, 3, ppl=25.0, applied_steps=60),
    ]


def write_log(path: Path, events: list[dict[str, Any]], extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(e, sort_keys=True) for e in events]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n", encoding="utf-8")
    return path


def write_sim(path: Path) -> Path:
    doc = {
        "algo": "sync",
        "initial_ppl": 200.0,
        "final_ppl": 20.0,
        "local_steps": 60,
        "curve": [
            {"local_steps": 20, "sim_time": 12.0, "ppl": 90.0},
            {"local_steps": 40, "sim_time": 24.0, "ppl": 40.0},
            {"local_steps": 60, "sim_time": 36.0, "ppl": 20.0},
        ],
    }
    path.write_text(json.dumps(doc, sort_keys=True) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def swarm_log(tmp_path: Path) -> Path:
    # A torn last line (a peer killed mid-write) and a stray non-JSON line: skipped, not fatal.
    return write_log(
        tmp_path / "swarm.jsonl", swarm_events(), extra_lines=("not json", '{"event": "rou')
    )


@pytest.fixture
def sim_doc(tmp_path: Path) -> Path:
    return write_sim(tmp_path / "sim.json")


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """Run the command in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    height, width = imread(path).shape[:2]
    # The figure's size in inches at its dpi: a readable four-panel figure.
    assert (width, height) == tuple(round(s * plot.DPI) for s in plot.FIGSIZE_IN)


def curve_of(runs: list[Run], suffix: str) -> plot.Curve:
    (curve,) = [c for r in runs for c in r.curves if c.label.endswith(suffix)]
    return curve


# ----------------------------------------------------------------------------- success


def test_plot_writes_one_png_of_a_swarm_log_and_a_simulator_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, swarm_log: Path, sim_doc: Path
) -> None:
    out = tmp_path / "curves.png"
    rc, stdout, stderr = cli(capsys, "plot", swarm_log, sim_doc, "--out", out, "--title", "t")
    assert rc == 0, stderr
    assert stdout.startswith(f"wrote {out}")
    # The skipped lines are reported, in one note for the file.
    assert stderr.splitlines() == [f"diloco-peer: note: {swarm_log}: skipped 2 unparsable or "
                                   "malformed line(s)"]  # fmt: skip
    assert_png(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_every_panel_has_axis_labels_and_a_legend(swarm_log: Path, sim_doc: Path) -> None:
    runs, _ = load_runs([swarm_log, sim_doc])
    fig = build_figure(runs, title="swarm vs simulator")
    assert len(fig.axes) == 4
    for ax in fig.axes:
        assert ax.get_title()
        assert ax.get_xlabel() and ax.get_ylabel()
        assert ax.get_legend() is not None
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == [f"swarm.jsonl {PEER_A[-8:]}", f"swarm.jsonl {PEER_B[-8:]}", "sim.json sync"]
    # Only the time panel says that the simulator's seconds are virtual.
    time_labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert time_labels[-1] == "sim.json sync (virtual time)"
    assert "virtual" in fig.axes[1].get_xlabel()
    assert fig.get_suptitle() == "swarm vs simulator"


def test_simulator_only_figure_keeps_labels_on_the_empty_swarm_panels(sim_doc: Path) -> None:
    runs, _ = load_runs([sim_doc])
    fig = build_figure(runs)
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel()
    assert fig.axes[1].get_xlabel() == "virtual seconds (simulator)"
    assert fig.axes[2].get_legend() is None and fig.axes[3].get_legend() is None
    assert runs[0].virtual
    (curve,) = runs[0].curves
    assert curve.ppl_by_steps == ((0.0, 200.0), (20.0, 90.0), (40.0, 40.0), (60.0, 20.0))
    assert curve.ppl_by_time == ((0.0, 200.0), (12.0, 90.0), (24.0, 40.0), (36.0, 20.0))


def test_steps_are_summed_over_all_peers_and_null_ppl_is_left_out(swarm_log: Path) -> None:
    (run,), notes = load_runs([swarm_log])
    assert not run.virtual and len(run.curves) == 2 and len(notes) == 1
    a = curve_of([run], PEER_A[-8:])
    # Both members of a group log its version and share its total: 2 x 10 steps a version.
    # Version 2 has no ppl (not evaluated that round); the stop event repeats version 3's.
    assert a.ppl_by_steps == ((0.0, 200.0), (20.0, 60.0), (60.0, 25.0), (60.0, 25.0))
    assert a.ppl_by_time == ((0.0, 200.0), (10.0, 60.0), (30.0, 25.0), (31.0, 25.0))
    b = curve_of([run], PEER_B[-8:])
    assert b.ppl_by_time[0] == (2.0, 200.0)  # seconds since the run's first event, not its own
    assert a.group_size_by_version == ((1.0, 2.0), (2.0, 2.0), (3.0, 2.0))
    assert a.comm_s_by_version == ((1.0, 1.5), (2.0, 2.5), (3.0, 3.5))


def test_logs_of_one_swarm_written_on_two_machines_pool_their_steps(tmp_path: Path) -> None:
    events = swarm_events()
    a = write_log(tmp_path / "a.jsonl", [e for e in events if e["peer"] == PEER_A])
    b = write_log(tmp_path / "b.jsonl", [e for e in events if e["peer"] == PEER_B])
    combined = write_log(tmp_path / "demo.jsonl", events)
    (pooled,), _ = load_runs([a, b])
    (alone,), _ = load_runs([combined])
    # The same run whether split across files or not; a peer's own log given next to the
    # demo's combined one is not counted twice.
    (with_duplicate,), _ = load_runs([combined, a])
    for run in (pooled, with_duplicate):
        assert [c.ppl_by_steps for c in run.curves] == [c.ppl_by_steps for c in alone.curves]
    assert [c.label for c in pooled.curves] == [f"a.jsonl {PEER_A[-8:]}", f"b.jsonl {PEER_B[-8:]}"]


def test_a_log_appended_to_by_two_runs_is_split_into_two(tmp_path: Path) -> None:
    log = write_log(tmp_path / "demo.jsonl", swarm_events("m1") + swarm_events("m2", 100.0))
    first, second = load_runs([log])[0]
    assert [c.label for c in second.curves] == [
        f"demo.jsonl#2 {PEER_A[-8:]}",
        f"demo.jsonl#2 {PEER_B[-8:]}",
    ]
    # Each run counts its own steps and its own time from zero.
    for run in (first, second):
        assert run.curves[0].ppl_by_steps[-1][0] == 60.0
        assert run.curves[0].ppl_by_time[0] == (0.0, 200.0)


def test_overwrite_replaces_an_existing_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, swarm_log: Path
) -> None:
    out = tmp_path / "curves.png"
    out.write_bytes(b"old")
    rc, _, stderr = cli(capsys, "plot", swarm_log, "--out", out, "--overwrite")
    assert rc == 0, stderr
    assert_png(out)


# ----------------------------------------------------------------------------- bad input


def assert_one_error_line(rc: int, stdout: str, stderr: str, *fragments: str) -> None:
    lines = stderr.splitlines()
    assert rc == 2, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("diloco-peer: error: "), lines[0]
    assert "Traceback" not in stderr and stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


BAD_LOGS = {
    "empty": ("", "empty file"),
    "blank": ("\n  \n", "empty file"),
    "garbage": ("not json\n{\n[1, 2]\n", "no usable events (3 of 3 lines unparsable)"),
    "no drawn events": (
        json.dumps({"event": "catch_up", "time": T0, "peer": PEER_A, "version": 1}) + "\n",
        "no usable events (no start/round/stop)",
    ),
    "demo summary": (
        json.dumps({"peers": [], "applied_steps": 40}),
        "pass the demo's --log-json file",
    ),
    "simulator without points": (json.dumps({"algo": "sync", "curve": []}), "usable curve point"),
    "deeply nested": ("[" * 100_000 + "\n", "no usable events"),
}


@pytest.mark.parametrize("name", list(BAD_LOGS))
def test_unusable_logs_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    content, fragment = BAD_LOGS[name]
    log = tmp_path / "bad.jsonl"
    log.write_text(content, encoding="utf-8")
    out = tmp_path / "curves.png"
    assert_one_error_line(*cli(capsys, "plot", log, "--out", out), str(log), fragment)
    assert not out.exists()


def test_bad_paths_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, swarm_log: Path
) -> None:
    existing = tmp_path / "exists.png"
    existing.write_bytes(b"keep")
    cases = [
        (["plot", tmp_path / "missing.jsonl", "--out", tmp_path / "c.png"], "no such file"),
        (["plot", tmp_path, "--out", tmp_path / "c.png"], "is a folder"),
        (["plot", swarm_log, "--out", existing], "pass --overwrite"),
        (["plot", swarm_log, "--out", tmp_path / "no" / "c.png"], "does not exist"),
        (["plot", swarm_log, "--out", tmp_path / "c.pdf"], ".png"),
        (["plot", swarm_log, "--out", swarm_log, "--overwrite"], "input log"),
        (["plot", swarm_log], "--out"),
        (["plot", "--out", tmp_path / "c.png"], "LOG"),
    ]
    for args, fragment in cases:
        assert_one_error_line(*cli(capsys, *args), fragment)
    assert existing.read_bytes() == b"keep"
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "c.pdf").exists()


def test_a_failed_write_is_one_line_and_leaves_nothing_behind(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    swarm_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(src: object, dst: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(plot.os, "replace", refuse)
    out = tmp_path / "curves.png"
    assert_one_error_line(*cli(capsys, "plot", swarm_log, "--out", out), "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swarm.jsonl"]


def test_the_installed_command_keeps_the_error_contract(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_peer", "plot", str(tmp_path / "missing.jsonl"),
         "--out", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "no such file")


# ----------------------------------------------------------------------------- real swarm


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_plot_of_a_real_demo_log(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, demo_run: DemoRun
) -> None:
    log, out, summary = demo_run.log, tmp_path / "demo.png", demo_run.summary
    rc, _, stderr = cli(capsys, "plot", log, "--out", out)
    assert rc == 0, stderr
    assert_png(out)
    (run,), notes = load_runs([log])
    assert notes == [] and len(run.curves) == len(summary["peers"]) == 3
    rounds = {p["peer_id"][-8:]: p["rounds"] for p in summary["peers"]}
    for curve in run.curves:
        # The x axis ends at the steps the swarm's state holds, as its own counters say.
        assert curve.ppl_by_steps[-1][0] == summary["applied_steps"]
        assert len(curve.group_size_by_version) == rounds[curve.label[-8:]]
        assert curve.ppl_by_time[0][1] == pytest.approx(summary["ppl_before"])
