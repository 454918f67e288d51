"""Overlapped rounds in the simulator (issue: communication behind computation): what training
through the all-reduce and folding the outer update in one phase late (ALGORITHMS §1.1) costs
in quality, and what it saves in virtual time, against blocking rounds on the same seeds.

Per seed and algorithm (sync DiLoCo, DN + DyLU): a blocking run and an overlapped run, both with
an all-reduce of `--comm-share` × a phase (H steps of the fastest worker) in virtual seconds,
nano model, 4 workers, everything else at `simulate`'s defaults. Reported: final ppl, overlap's
ratio to blocking, the virtual time each needs to reach the blocking run's final ppl, and the
workers' mean compute utilization. Runs are kept as JSON under bench/results/async_robustness
(the same store and code digest as bench/async_robustness.py), so a stopped run resumes.

    python bench/overlap_sim.py --seeds 0,1,2,3,4 --markdown docs/results.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import publish  # noqa: E402
from async_robustness import CODE, KEPT, adopt, parse_variants, simulate  # noqa: E402
from paper_tables import time_to_reach  # noqa: E402

BEGIN = "<!-- begin: bench/overlap_sim.py -->"
END = "<!-- end: bench/overlap_sim.py -->"
NOTES = "<!-- overlap_sim notes: kept when the bench rewrites this section -->"


def comm_seconds(het: str, workers: int, h: int, share: float) -> float:
    """`share` of a phase: H steps at the fastest worker's step time of the profile."""
    from diloco_peer.sim.profiles import step_seconds

    return round(share * h * min(step_seconds(het, workers)), 3)


def run_args(a: argparse.Namespace, algo: str, seed: int, overlap: str,
             extra: list[str] | None = None) -> list[str]:  # fmt: skip
    comm = comm_seconds(a.het, a.workers, a.H, a.comm_share)
    args = ["--algo", algo, "--model", a.model, "--workers", str(a.workers),
            "--total-steps", str(a.total_steps), "-H", str(a.H), "--heterogeneity", a.het,
            "--seed", str(seed), "--comm-s", str(comm)]  # fmt: skip
    return args + (["--overlap", overlap] if overlap != "none" else []) + (extra or [])


def utilization(run: dict[str, Any]) -> float:
    """The workers' mean compute seconds over the run's virtual seconds."""
    idle = run.get("idle_fraction") or [0.0]
    return 1 - sum(idle) / len(idle)


def summarize(a: argparse.Namespace, rules: list[str],
              results: dict[tuple[str, int, str], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Per algorithm, seed and overlap rule: the overlapped run against the blocking one."""
    rows, per_rule = [], {}
    for algo in a.algos:
        for rule in rules:
            ratios = []
            for seed in a.seeds:
                block, over = results.get((algo, seed, "none")), results.get((algo, seed, rule))
                if not block or not over:
                    continue
                target = block["final_ppl"]
                ratios.append(over["final_ppl"] / target)
                rows.append({
                    "algo": algo, "rule": rule, "seed": seed, "blocking_ppl": target,
                    "overlap_ppl": over["final_ppl"], "ratio": ratios[-1],
                    "blocking_s": block["sim_time"], "overlap_s": over["sim_time"],
                    "blocking_reach_s": time_to_reach(block["curve"], target),
                    "overlap_reach_s": time_to_reach(over["curve"], target),
                    "blocking_util": utilization(block), "overlap_util": utilization(over),
                })  # fmt: skip
            if ratios:
                per_rule[f"{algo}/{rule}"] = {"seeds": len(ratios),
                                              "median_ratio": statistics.median(ratios),
                                              "worst_ratio": max(ratios)}  # fmt: skip
    return {"rows": rows, "rules": per_rule}


def _f(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render(doc: dict[str, Any]) -> str:
    lines = [
        "## Overlapped rounds in the simulator (bench/overlap_sim.py)",
        "",
        f"`{doc['command']}`: nano, {doc['workers']} workers, {doc['total_steps']} local steps, "
        f"H {doc['H']}, heterogeneity {doc['het']}, an all-reduce of {doc['comm_s']} virtual s "
        f"({doc['comm_share']} × the fastest worker's phase) in both runs. *reach s*: virtual "
        "seconds until the held-out ppl is at or below the blocking run's final ppl (— never). "
        "*util*: the workers' mean compute seconds over virtual seconds. *rule*: the overlap rule "
        "and its extra `simulate` flags: "
        + "; ".join(f"{name} = `--overlap {' '.join(v)}`" for name, v in doc["variants"].items())
        + ".",
        "",
        "| algo | rule | seed | blocking ppl | overlapped ppl (× blocking) | blocking s "
        "| overlapped s | reach s blocking / overlapped | util blocking / overlapped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["summary"]["rows"]:
        lines.append(
            f"| {r['algo']} | {r['rule']} | {r['seed']} | {_f(r['blocking_ppl'])} | {_f(r['overlap_ppl'])} "
            f"({_f(r['ratio'], 4)}) | {_f(r['blocking_s'], 0)} | {_f(r['overlap_s'], 0)} | "
            f"{_f(r['blocking_reach_s'], 0)} / {_f(r['overlap_reach_s'], 0)} | "
            f"{_f(r['blocking_util'], 2)} / {_f(r['overlap_util'], 2)} |"
        )
    lines += ["", "| algo/rule | seeds | median overlapped × blocking | worst |",
              "|---|---|---|---|"]  # fmt: skip
    for name, s in doc["summary"]["rules"].items():
        lines.append(f"| {name} | {s['seeds']} | {_f(s['median_ratio'], 4)} "
                     f"| {_f(s['worst_ratio'], 4)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=KEPT, help="folder of kept run results")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--algos", default="sync,dn-dylu")
    p.add_argument("--rules", default="eager", help="overlap rules to run besides blocking")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME=RULE FLAGS'",
                   help="an overlapped run with extra simulate flags (an ablation), quoted as "
                   "one argument: 'lr05=local --outer-lr 0.5'")  # fmt: skip
    p.add_argument("--H", type=int, default=50, help="inner steps of the fastest worker")
    p.add_argument("--het", default="slight", help="heterogeneity level")
    p.add_argument("--comm-share", type=float, default=0.5,
                   help="an all-reduce's virtual time, as a share of the fastest phase")  # fmt: skip
    p.add_argument("--model", default="nano")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--total-steps", type=int, default=2400)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--cached-only", action="store_true", help="run nothing: summarize kept runs")
    p.add_argument("--adopt", metavar="CODE", help="carry over the runs kept at this older "
                   "simulator code, as bench/async_robustness.py --adopt does")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the document here too")
    p.add_argument("--markdown", type=Path, help="write the section into this page")
    a = p.parse_args()
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.algos = a.algos.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    # seed-major: a run stopped half way has both algorithms on its first seeds
    variants = {"none": ("none", [])} | {r: (r, []) for r in a.rules.split(",") if r}
    variants |= parse_variants(a.variant)
    rules = list(variants)
    jobs = [(algo, seed, rule) for seed in a.seeds for algo in a.algos for rule in rules]
    t0 = time.time()
    if a.adopt:
        adopt([run_args(a, j[0], j[1], *variants[j[2]]) for j in jobs], a.out, a.adopt, a.jobs)
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(pool.map(
            lambda j: simulate(run_args(a, j[0], j[1], *variants[j[2]]), a.out, a.cached_only),
            jobs,
        ))  # fmt: skip
    results = {job: r for job, r in zip(jobs, done, strict=True) if r}
    doc = {
        "command": "python bench/overlap_sim.py " + shlex.join(sys.argv[1:]), "code": CODE,
        "workers": a.workers, "total_steps": a.total_steps, "H": a.H, "het": a.het,
        "comm_share": a.comm_share, "comm_s": comm_seconds(a.het, a.workers, a.H, a.comm_share),
        "variants": {n: [rule, *extra] for n, (rule, extra) in variants.items() if n != "none"},
        "summary": summarize(a, rules[1:], results), "wall_s": time.time() - t0,
    }  # fmt: skip
    publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)


if __name__ == "__main__":
    main()
