"""Do honest overlapped peers pass each other's screens? (issue 18, the swarm's `mix` fold)

Real `diloco-peer join` peers on 127.0.0.1 (nano, H = 10, sync, the cosine screen on as by
default), overlapped with --fold, --keep and --start-from: a, b and c start together; c's main
process alone is SIGKILLed after its second applied round (its children are left behind, as
after the OOM killer); d joins late (it downloads the state); all run until --until-version.
Per run: whether the survivors ended on one state at the last version, every `excluded` event
(who excluded whom, at which version, why), every peer's catch-ups (download or replay: a peer
whose download ended with the head's update replayed on the version below, "download-step",
knows the common `mix` term for its first δ; one that downloaded the head alone does not,
docs/algorithms.md §1.1), the rounds and how many of them were overlapped.

    python bench/overlap_screens.py --runs 4 --fold mix --keep 0.5 --start-from group \\
        --json bench/results/overlap_screens_mix_group.json

Prints progress on stderr and one JSON document on stdout. Each run's peers are killed by
process group on the way out (LocalSwarm), whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

from diloco_peer.local_swarm import LocalSwarm, branches
from diloco_peer.peer.events import read_log

RUN = """[run]
model = "nano"
inner_steps = 10
warmup_steps = 5
num_shards = 8

[swarm]
sync_timeout_s = 6.0
allreduce_timeout_s = 6.0
overlap = true
"""
"""The multi-peer tests' run (tests/conftest.py FAST_RUN), overlapped."""

_T0 = time.time()


def say(message: str) -> None:
    print(f"[overlap_screens {time.time() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def one_run(a: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config = folder / "run.toml"
    config.write_text(
        RUN + f'overlap_fold = "{a.fold}"\noverlap_keep = {a.keep}\n'
        f'overlap_from = "{a.start_from}"\n', encoding="utf-8",
    )  # fmt: skip
    until = ["--until-version", str(a.until_version)]
    t0 = time.time()
    with LocalSwarm(folder, run="screens") as swarm:
        first, log_a = swarm.start("a", "--config", str(config), *until)
        maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
        b, log_b = swarm.start("b", "--swarm", maddr, *until)
        c, log_c = swarm.start("c", "--swarm", maddr, *until)
        swarm.wait_event(log_c, "round", 150, count=2)
        os.kill(c.pid, signal.SIGKILL)  # the main process alone
        d, log_d = swarm.start("d", "--swarm", maddr, *until)
        codes = []
        for proc in (first, b, d):
            try:
                codes.append(proc.wait(timeout=a.timeout_s))
            except Exception:  # noqa: BLE001 - a hang is a result here; LocalSwarm kills it
                codes.append(None)
    logs = {"a": log_a, "b": log_b, "c": log_c, "d": log_d}
    events = {name: read_log(log) if log.exists() else [] for name, log in logs.items()}
    names = {e["peer"]: name for name, evs in events.items() for e in evs
             if e["event"] == "start" and e.get("peer")}  # fmt: skip
    branch = branches(log_a, log_b, log_d)
    rounds = [e for name in "abd" for e in events[name] if e["event"] == "round"]
    return {
        "codes": codes,
        "one_branch": branch.one_branch,
        "last_agreed": max(branch.agreed) if branch.agreed else None,
        "rounds": len(rounds),
        "overlapped": sum(1 for e in rounds if e.get("overlapped")),
        "excluded": [
            {
                "by": name,
                "version": e["version"],
                "peer": names.get(e["excluded_peer"], "?"),
                "reason": e["reason"],
                "banned": e.get("banned"),
            }
            for name in "abd"
            for e in events[name]
            if e["event"] == "excluded"
        ],  # fmt: skip
        "catch_ups": {
            name: [
                [e["version"], e.get("method") + ("-step" if e.get("stepped") else "")]
                for e in evs
                if e["event"] == "catch_up"
            ]  # fmt: skip
            for name, evs in events.items()
        },  # fmt: skip
        "wall_s": round(time.time() - t0, 1),
    }


def main() -> int:
    _common.exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--fold", choices=("rebase", "mix", "pull"), default="mix")
    p.add_argument("--keep", type=float, default=0.5)
    p.add_argument("--start-from", choices=("phase", "group"), default="group")
    p.add_argument("--until-version", type=int, default=12)
    p.add_argument("--timeout-s", type=float, default=250.0, help="per survivor, after d joins")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--logs", type=Path, default=None, help="keep each run's peers' logs here")
    a = p.parse_args()
    if a.logs is not None and a.logs.exists() and any(a.logs.iterdir()):
        p.error(f"--logs {a.logs} is not empty; name a new folder")
    runs = []
    with tempfile.TemporaryDirectory(prefix="overlap-screens-") as tmp:
        for i in range(a.runs):
            folder = (a.logs or Path(tmp)) / f"run{i}"
            folder.mkdir(parents=True)
            runs.append(one_run(a, folder))
            r = runs[-1]
            say(f"run {i + 1}/{a.runs}: one state {r['one_branch']} at v{r['last_agreed']}, "
                f"{len(r['excluded'])} exclusion events, {r['overlapped']}/{r['rounds']} rounds "
                f"overlapped, {r['wall_s']} s")  # fmt: skip
    doc = {
        "command": "python bench/overlap_screens.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "summary": {
            "runs": len(runs),
            "one_state": sum(1 for r in runs if r["one_branch"]),
            "runs_with_an_exclusion": sum(1 for r in runs if r["excluded"]),
            "crashed_or_hung": sum(1 for r in runs if any(c != 0 for c in r["codes"])),
        },
        "runs": runs,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n", encoding="utf-8")
    return 1 if doc["summary"]["crashed_or_hung"] else 0


if __name__ == "__main__":
    sys.exit(main())
