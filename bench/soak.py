"""Soak (issue 15): N peers train for --minutes; does any peer's memory grow?

Starts real `diloco-peer join` processes on 127.0.0.1 (diloco_peer/local_swarm.py): a founder
(--model, -H, sync, --expected-peers N) and N - 1 joiners, each with its own checkpoint folder,
and lets them train until --minutes have passed. Every --sample-s it samples each peer's
resident memory three ways:

- `rss_mb`: the peer's main process, from /proc (psutil), the number the bound is on;
- `tree_rss_mb`: the main process and every process it started (its DHT process, p2pd);
- `status_rss_mb`: what `diloco-peer status --json` shows for the peer (its DHT head's RSS),
  so the soak is what an operator watching `status` sees.

Warm-up ends at the first sample at which every peer has committed --warmup-versions versions
and --warmup-s seconds have passed (at most a quarter of the run). Growth is the median of
the last 3 samples over the median of the first 3 after warm-up, minus one; a peer passes when
its main process grew by at most --bound-pct. The run passes when every peer passes and
stayed up to the end.

    python bench/soak.py                        # 3 peers, nano, 60 minutes
    python bench/soak.py --minutes 4 --sample-s 15
    python bench/soak.py --markdown docs/results.md

Peers import the package of this checkout (PYTHONPATH is set to it). Every process started is
stopped on the way out, also on Ctrl-C, SIGTERM or a failure. One JSON document on stdout (and
in --json FILE); exit 0 if the run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import psutil

from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches, kill_session, spawn
from diloco_peer.peer.events import read_log

REPO = Path(__file__).resolve().parents[1]
SECTION_BEGIN = "<!-- begin: bench/soak.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/soak.py -->"
NOTES_MARKER = "<!-- soak notes: kept when the bench rewrites this section -->"
STATUS_TIMEOUT_S = 60.0
JOIN_ARGS = ("--host", "127.0.0.1", "--quiet", "--threads", "1")
STOP_GRACE_S = 60.0
"""After SIGTERM, how long the peers get to checkpoint and leave before each session is killed."""
WINDOW = 3
"""Samples whose median is the RSS after warm-up (the first ones) and at the end (the last)."""


class Soak:
    """One soak run; what it saw so far stays readable if it is interrupted."""

    def __init__(self, a: argparse.Namespace, folder: Path) -> None:
        self.a, self.folder = a, folder
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [self.env.get("PYTHONPATH")])]
        )
        self.names = [f"peer{i}" for i in range(a.peers)]
        self.logs = {name: folder / f"{name}.jsonl" for name in self.names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ids: dict[str, str] = {}
        self.samples: list[dict[str, Any]] = []
        self.warmup_s = min(a.warmup_s, a.minutes * 60 / 4)
        self.warm_t: float | None = None
        self.stopped_early: str | None = None
        self.started: dict[int, float] = {}
        """pid -> create time of every process of every peer seen (the leftover check)."""
        self.t0 = time.monotonic()

    def run(self) -> None:
        a, folder = self.a, self.folder
        peers = LocalSwarm(folder, run="soak", join_args=JOIN_ARGS, stop_grace_s=STOP_GRACE_S)
        with peers as swarm:
            ckpt = lambda name: ("--checkpoint-dir", str(folder / f"{name}-ckpt"))  # noqa: E731
            founder, first = swarm.start(
                self.names[0], "--model", a.model, "-H", str(a.inner_steps),
                "--expected-peers", str(a.peers), *ckpt(self.names[0]), env=self.env,
            )  # fmt: skip
            self.procs[self.names[0]] = founder
            address = swarm.address(first, 180, proc=founder, ip="127.0.0.1")
            for name in self.names[1:]:
                self.procs[name] = swarm.start(name, "--swarm", address, *ckpt(name),
                                               env=self.env)[0]  # fmt: skip
            end = self.t0 + a.minutes * 60
            while True:
                t_sample = time.monotonic()
                dead = [n for n, p in self.procs.items() if p.poll() is not None]
                if dead:
                    code = self.procs[dead[0]].returncode
                    self.stopped_early = f"{', '.join(dead)} exited (code {code})"
                    return
                self.sample(address)
                if t_sample >= end:
                    return
                elapsed = time.monotonic() - t_sample
                time.sleep(max(0.0, min(a.sample_s - elapsed, end - time.monotonic())))
        # leaving the block stopped every peer: SIGTERM, then each whole session SIGKILLed

    def sample(self, address: str) -> None:
        for name, log in self.logs.items():
            if name not in self.ids:
                start = next((e for e in read_log(log) if e.get("event") == "start"), None)
                if start is not None:
                    self.ids[name] = start["peer"]
        progress = {n: committed(log) for n, log in self.logs.items()}
        shown = status_rss(address, "soak", self.env, self.folder)
        sample: dict[str, Any] = {
            "t": round(time.monotonic() - self.t0, 1), "loadavg": os.getloadavg()[0],
            "version": max(v for _, v in progress.values()),
            "rounds": {n: r for n, (r, _) in progress.items()},
            "rss_mb": {}, "tree_rss_mb": {},
            "status_rss_mb": {n: shown[i] for n, i in self.ids.items() if i in shown},
        }  # fmt: skip
        for name, proc in self.procs.items():
            main, tree = self.rss_mb(proc.pid)
            sample["rss_mb"][name], sample["tree_rss_mb"][name] = main, tree
        self.samples.append(sample)
        warm = sample["t"] >= self.warmup_s and all(
            v >= self.a.warmup_versions for _, v in progress.values()
        )
        if self.warm_t is None and warm:
            self.warm_t = sample["t"]
        rss = " ".join(f"{n}={x:.0f}MB" for n, x in sample["rss_mb"].items() if x is not None)
        print(f"[soak] t={sample['t']:.0f}s v{sample['version']} {rss}"
              f"{' (warm)' if self.warm_t is not None else ''}", file=sys.stderr, flush=True)  # fmt: skip

    def rss_mb(self, pid: int) -> tuple[float | None, float | None]:
        """(main process, main process and all its descendants) resident MB; None once gone."""
        try:
            main = psutil.Process(pid)
            rss, tree = main.memory_info().rss, 0
            self.started[pid] = main.create_time()
            for child in main.children(recursive=True):
                try:
                    tree += child.memory_info().rss
                    self.started[child.pid] = child.create_time()
                except psutil.Error:
                    pass  # exited meanwhile
        except psutil.Error:
            return None, None
        return rss / 1e6, (rss + tree) / 1e6

    def leftovers(self, wait_s: float = 10.0) -> list[int]:
        """Processes of the peers still running `wait_s` after the soak stopped them (must be
        none; a SIGKILLed process may take a moment to go, a zombie counts as gone)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = []
            for pid, created in self.started.items():
                try:
                    proc = psutil.Process(pid)
                    if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(pid)
                except psutil.Error:
                    pass
            if not alive or time.monotonic() >= deadline:
                return sorted(alive)
            time.sleep(0.5)

    def report(self) -> dict[str, Any]:
        after = [s for s in self.samples if self.warm_t is not None and s["t"] >= self.warm_t]
        peers = []
        for name in self.names:
            rounds, version = committed(self.logs[name]) if self.logs[name].exists() else (0, 0)
            row: dict[str, Any] = {"name": name, "peer_id": self.ids.get(name),
                                   "rounds": rounds, "final_version": version}  # fmt: skip
            for key in ("rss_mb", "tree_rss_mb", "status_rss_mb"):
                row[key] = growth([s[key].get(name) for s in after])
            g = row["rss_mb"]["growth_pct"]
            row["passed"] = g is not None and g <= self.a.bound_pct
            proc = self.procs.get(name)
            row["exit_code"] = proc.returncode if proc is not None else None
            peers.append(row)
        logs = [log for log in self.logs.values() if log.exists()]
        return {
            "wall_s": round(time.monotonic() - self.t0, 1), "stopped_early": self.stopped_early,
            "warmup": {"versions": self.a.warmup_versions, "min_s": self.warmup_s,
                       "ended_at_s": self.warm_t},
            "final_version": max((r["final_version"] for r in peers), default=None),
            "one_branch": branches(*logs).one_branch,
            "status_showed_every_peer": bool(self.samples)
            and all(n in self.samples[-1]["status_rss_mb"] for n in self.names),
            "peers": peers,
            "passed": self.stopped_early is None and all(r["passed"] for r in peers),
            "samples": self.samples,
        }  # fmt: skip


def status_rss(swarm: str, run: str, env: dict[str, str], folder: Path) -> dict[str, float]:
    """peer id -> rss_mb as `diloco-peer status --json` shows it ({} if status failed). Run in a
    session of its own, killed whole afterwards: its DHT process must not outlive it."""
    argv = [*PEER_COMMAND, "status", "--swarm", swarm, "--run", run, "--json"]
    proc = spawn(argv, stdout=subprocess.PIPE, stderr=folder / "status.err", env=env)
    try:
        out, _ = proc.communicate(timeout=STATUS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {}
    finally:
        kill_session(proc)
    try:
        doc = json.loads(out)
    except json.JSONDecodeError:
        return {}
    return {p["peer_id"]: p["rss_mb"] for p in doc.get("peers", []) if p.get("rss_mb") is not None}


def committed(log: Path) -> tuple[int, int]:
    """(rounds this peer applied, the highest version it held) from its event log."""
    rounds, version = 0, 0
    for e in read_log(log):
        if e.get("event") == "round":
            rounds += 1
        if e.get("event") in ("round", "catch_up", "start", "resume"):
            version = max(version, int(e.get("version") or 0))
    return rounds, version


def growth(samples: list[float | None]) -> dict[str, float | None]:
    """Median of the first WINDOW samples, of the last WINDOW, the peak, and the growth %."""
    xs = [x for x in samples if x is not None]
    if len(xs) < 2 * WINDOW:
        return {"warm": None, "end": None, "peak": max(xs, default=None), "growth_pct": None}
    warm, end = statistics.median(xs[:WINDOW]), statistics.median(xs[-WINDOW:])
    return {"warm": round(warm, 1), "end": round(end, 1), "peak": round(max(xs), 1),
            "growth_pct": round(100.0 * (end / warm - 1.0), 2)}  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    a = doc["args"]
    lines = [
        "## Soak: memory over a long run (bench/soak.py, issue 15)",
        "",
        f"`{doc['command']}`: {a['peers']} peers ({a['model']}, H = {a['inner_steps']}, sync) "
        f"on 127.0.0.1 for {doc['wall_s'] / 60:.1f} minutes, RSS sampled every {a['sample_s']} "
        f"s; warm-up ended at {doc['warmup']['ended_at_s']} s (every peer at version >= "
        f"{a['warmup_versions']}, at least {doc['warmup']['min_s']:.0f} s). Swarm version "
        f"{doc['final_version']}, one branch: {doc['one_branch']}. Growth: median of the last "
        f"{WINDOW} samples over the median of the first {WINDOW} after warm-up; bound "
        f"{a['bound_pct']}% on the main process. **{'PASS' if doc['passed'] else 'FAIL'}**"
        + (f" (stopped early: {doc['stopped_early']})" if doc["stopped_early"] else "") + ".",
        "",
        "| peer | rounds | RSS after warm-up (MB) | RSS at the end | peak | growth | "
        "with DHT + p2pd (warm → end) | `status` RSS (warm → end) | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["peers"]:
        m, t, s = r["rss_mb"], r["tree_rss_mb"], r["status_rss_mb"]
        lines.append(
            f"| {r['name']} | {r['rounds']} | {m['warm']} | {m['end']} | {m['peak']} | "
            f"{m['growth_pct']}% | {t['warm']} → {t['end']} ({t['growth_pct']}%) | "
            f"{s['warm']} → {s['end']} ({s['growth_pct']}%) | {'yes' if r['passed'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    _common.exit_on_sigterm()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--model", default="nano", help="model preset (default: the smallest)")
    p.add_argument("-H", "--inner-steps", type=int, default=20, help="H: short rounds, many")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--warmup-versions", type=int, default=3)
    p.add_argument("--warmup-s", type=float, default=300.0, help="capped at a quarter of the run")
    p.add_argument("--bound-pct", type=float, default=5.0, help="allowed RSS growth, percent")
    p.add_argument("--folder", type=Path, help="keep the peers' logs here (default: temporary)")
    p.add_argument("--json", type=Path, help="also write the result document here")
    p.add_argument("--markdown", type=Path, help="write this bench's section of this page")
    a = p.parse_args()
    if a.peers < 2 or a.minutes <= 0 or a.sample_s <= 0 or a.inner_steps < 1:
        p.error("--peers must be >= 2; --minutes, --sample-s and -H positive")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # leave the swarm's `with` block: it stops every peer

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (`cmd &`)
    doc: dict[str, Any] = {"command": shlex.join(["python", *sys.argv])}
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        folder = a.folder or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        soak = Soak(a, folder)
        try:
            soak.run()
        except KeyboardInterrupt:
            soak.stopped_early = "interrupted"
        except Exception as e:  # a peer that never started, ...: report what was seen
            soak.stopped_early = f"{type(e).__name__}: {e}"
        doc |= soak.report()
        doc["leftover_processes"] = soak.leftovers()
    doc["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    doc["machine"] = {"cpus": os.cpu_count()}
    print(json.dumps(doc, sort_keys=True))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if a.markdown and "peers" in doc:
        _common.write_section(a.markdown, markdown(doc), SECTION_BEGIN, SECTION_END, NOTES_MARKER)
    return 0 if doc.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
