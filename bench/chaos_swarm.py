"""5 honest peers + 1 hostile peer, once per chaos mode, against the 5 honest peers alone (issue 5).

Every run starts real `diloco-peer join` processes on 127.0.0.1: a founder and four more honest
peers (nano, H steps per round, sync, until --versions), plus, except in the baseline run, one
peer started with `--chaos MODE`. Each run reports, over the honest peers:

- whether any honest state ever held NaN/Inf (`finite` in each stop event, ppl in every round);
- whether their state hashes agree at every version (forks healed within one round allowed, as
  in diloco_peer/local_swarm.py's `branches`);
- the final held-out ppl (median over the honest peers) and its ratio to the baseline's. The
  honest peers have the same keys in every run and each trains one pinned shard (`--shard I`,
  canonical order), so a run whose every average is of the 5 honest δs alone reproduces the
  baseline's model bit for bit: `same_model` says the final ppl is the baseline's to the last
  digit (the state hashes differ anyway: they cover the manifest, whose expected peer count
  differs);
- whether the hostile peer was excluded (the honest peers' `excluded` events, with reasons),
  whether any of its contributions reached an average (its id in a round's members), and
  whether `diloco-peer status` showed it as banned while the run was live.

    python bench/chaos_swarm.py --markdown docs/results.md

One JSON document on stdout (and in --json FILE); exit 1 if a run failed to finish.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches
from diloco_peer.peer.events import read_log

MODES = ("nan", "scale=1000", "signflip", "random", "stale", "forge", "replay", "wrong-shape")
HONEST = 5
PY = list(PEER_COMMAND)
SECTION_BEGIN = "<!-- begin: bench/chaos_swarm.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/chaos_swarm.py -->"
PPL_TOLERANCE = 0.02


def run_once(
    mode: str | None, args: argparse.Namespace, folder: Path, keys: list[Path]
) -> dict[str, Any]:
    """One run; `keys` are the honest peers' key files (the same in every run)."""
    folder.mkdir(parents=True)
    expected = HONEST + (1 if mode else 0)
    join_args = ["--host", "127.0.0.1", "--quiet", "--threads", "1",
                 "--until-version", str(args.versions)]  # fmt: skip
    t0 = time.time()
    status_doc: dict[str, Any] = {}
    with LocalSwarm(folder, run="chaos", join_args=join_args) as peers:
        pinned = [["--identity", str(keys[i]), "--shard", str(i)] for i in range(HONEST)]
        founder_proc, founder = peers.start(
            "honest0", "--model", "nano", "--inner-steps", str(args.inner_steps),
            "--expected-peers", str(expected), *pinned[0],
        )  # fmt: skip
        swarm = ["--swarm", peers.address(founder, 120, proc=founder_proc, ip="127.0.0.1")]
        logs = [founder] + [
            peers.start(f"honest{i}", *swarm, *pinned[i])[1] for i in range(1, HONEST)
        ]
        hostile = peers.start("hostile", *swarm, "--chaos", mode)[1] if mode else None
        honest = peers.procs[:HONEST]
        deadline = time.time() + args.timeout_s
        while time.time() < deadline and any(p.poll() is None for p in honest):
            excluded = any(e["event"] == "excluded" for log in logs for e in read_log(log))
            if hostile and excluded and not status_doc:
                out = subprocess.run(
                    [*PY, "status", *swarm, "--run", "chaos", "--json"],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                if out.returncode == 0 and out.stdout.strip():
                    status_doc = json.loads(out.stdout)
            time.sleep(1.0)
        finished = all(p.poll() is not None for p in honest)
    wall_s = time.time() - t0
    hostile_id = None
    if hostile is not None:
        hostile_id = next((e["peer"] for e in read_log(hostile) if e["event"] == "start"), None)
    stops = [next((e for e in read_log(log) if e["event"] == "stop"), None) for log in logs]
    rounds = [e for log in logs for e in read_log(log) if e["event"] == "round"]
    reasons = sorted({
        e["reason"] for log in logs for e in read_log(log)
        if e["event"] == "excluded" and e.get("excluded_peer") == hostile_id
    })  # fmt: skip
    ppls = [s["ppl"] for s in stops if s and s.get("ppl") is not None]
    final_hashes = sorted({s["state_hash"] for s in stops if s})
    banned = status_doc.get("banned", {}) if status_doc else {}
    return {
        "mode": mode or "baseline (5 honest)",
        "finished": finished and all(stops),
        "wall_s": round(wall_s, 1),
        "final_versions": [s["version"] if s else None for s in stops],
        "honest_finite": all(s and s.get("finite") for s in stops)
        and all(r.get("ppl") is not None for r in rounds),
        "one_branch": branches(*logs).one_branch,
        "final_ppl": statistics.median(ppls) if ppls else None,
        "final_hashes": final_hashes,
        "hostile_excluded": bool(reasons),
        "exclusion_reasons": reasons,
        "hostile_in_an_average": any(hostile_id in r.get("members", []) for r in rounds)
        if hostile_id
        else None,
        "status_banned_by": len(banned.get(hostile_id, {}).get("by", [])) if hostile_id else None,
    }


def markdown(doc: dict[str, Any]) -> str:
    base = doc["baseline_ppl"]
    lines = [
        SECTION_BEGIN,
        "## Hostile peers (bench/chaos_swarm.py)",
        "",
        f"`{doc['command']}`: {HONEST} honest peers (nano, H = {doc['inner_steps']}, sync, "
        f"{doc['versions']} versions) plus one `--chaos` peer, against the {HONEST} honest "
        f"peers alone. Baseline final ppl {base:.3f}."
        if base
        else "",
        "",
        "| mode | finished | honest states finite | one branch | final ppl | vs baseline "
        "| baseline's model, bit for bit | excluded (reasons) | in an average | `status`: banned by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        ratio = r["final_ppl"] / base if base and r["final_ppl"] else None
        lines.append(
            f"| {r['mode']} | {r['finished']} | {r['honest_finite']} | {r['one_branch']} | "
            f"{r['final_ppl']:.3f} | {'' if ratio is None else f'{ratio:.4f}'} | "
            f"{r.get('same_model', '-')} | "
            f"{'; '.join(r['exclusion_reasons']) or '-'} | {r['hostile_in_an_average']} | "
            f"{r['status_banned_by']} |"
            if r["final_ppl"] is not None
            else f"| {r['mode']} | {r['finished']} | - | - | - | - | - | - | - | - |"
        )
    lines += ["", SECTION_END]
    return "\n".join(lines) + "\n"


def _write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if SECTION_BEGIN in text and SECTION_END in text:
        head, rest = text.split(SECTION_BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    _common.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    runs = []
    from diloco_peer.identity import Identity

    with tempfile.TemporaryDirectory(prefix="chaos-bench-") as tmp:
        keys = [Path(tmp) / f"honest{i}.key" for i in range(HONEST)]
        for key in keys:
            Identity.generate().save(key)
        for i, mode in enumerate([None, *args.modes]):
            r = run_once(mode, args, Path(tmp) / f"run{i}", keys)
            print(json.dumps(r), file=sys.stderr, flush=True)
            runs.append(r)
    base = runs[0]["final_ppl"]
    for r in runs[1:]:
        r["same_model"] = r["final_ppl"] is not None and r["final_ppl"] == base
        r["ppl_ratio"] = r["final_ppl"] / base if base and r["final_ppl"] else None
        r["passes"] = bool(
            r["finished"] and r["honest_finite"] and r["one_branch"] and r["hostile_excluded"]
            and not r["hostile_in_an_average"] and r["ppl_ratio"] is not None
            and abs(r["ppl_ratio"] - 1) <= PPL_TOLERANCE
        )  # fmt: skip
    doc = {
        "command": "python bench/chaos_swarm.py " + " ".join(sys.argv[1:]),
        "versions": args.versions, "inner_steps": args.inner_steps, "baseline_ppl": base,
        "runs": runs,
    }  # fmt: skip
    print(json.dumps(doc, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        _write_section(args.markdown, markdown(doc))
    return 0 if all(r["finished"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
