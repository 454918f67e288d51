"""Asynchronous DiLoCo (DN + DyLU) against synchronous DiLoCo over a grid of seeds and settings,
each method at the run's defaults with no per-cell tuning (issue: async that wins untuned).

The grid: seeds × start {scratch, pretrained (shared single-worker AdamW steps first)} × H ×
heterogeneity, nano model, 4 workers, the same budget of local steps for every method. Per cell:
dn-dylu's final ppl over sync's, and the virtual time each needs to reach sync's final ppl. Naive
async and data parallel are reference rows (on the first `--reference-seeds` seeds).

Variants (`--variant "NAME=ALGO FLAGS..."`) add a method with extra `simulate` flags: the
ablations. Every run goes through the `diloco-peer simulate` CLI with one torch thread, `--jobs`
at a time, and is kept as one JSON file under `--out` (by default in the repository: the full
grid takes about 5 hours on 2 cores, so it is run over several sittings). A run kept for the
same flags and simulator code (SIM_CODE and the default settings) is not run again;
`--cached-only` runs nothing else and summarizes what is kept; `--adopt CODE` carries the runs
kept at an older code over when one run per code path, run again, proves the change left them
as they were. Prints one JSON document; with --markdown, writes its section of the results
page.

    python bench/async_robustness.py --markdown docs/results.md
    python bench/async_robustness.py --out /tmp/ar --seeds 7 --starts scratch --H 50 \\
        --het very --methods sync --variant "lr1=dn-dylu --outer-lr 1.0"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import publish  # noqa: E402
from paper_tables import run_simulate, time_to_reach  # noqa: E402

BEGIN = "<!-- begin: bench/async_robustness.py -->"
END = "<!-- end: bench/async_robustness.py -->"
NOTES = "<!-- async_robustness notes: kept when the bench rewrites this section -->"
REFERENCE = ("async", "ddp")
KEPT = Path(__file__).resolve().parent / "results" / "async_robustness"


@dataclass(frozen=True)
class Cell:
    seed: int
    start: str  # "scratch" or "pre<steps>"
    h: int
    het: str

    @property
    def name(self) -> str:
        return f"{self.start}/H{self.h}/{self.het}/s{self.seed}"

    @property
    def setting(self) -> str:
        return f"{self.start}/H{self.h}/{self.het}"


def run_args(cell: Cell, algo: str, extra: list[str], base: argparse.Namespace) -> list[str]:
    args = [
        "--algo", algo, "--model", base.model, "--workers", str(base.workers),
        "--total-steps", str(base.total_steps), "-H", str(cell.h),
        "--heterogeneity", cell.het, "--seed", str(cell.seed),
    ]  # fmt: skip
    if cell.start != "scratch":
        args += ["--pretrain-steps", cell.start.removeprefix("pre")]
    return args + extra


SIM_CODE = ("diloco_peer/sim", "diloco_peer/averaging/outer.py", "diloco_peer/averaging/outer_base.py",
            "diloco_peer/peer/inner.py", "diloco_peer/peer/model.py", "diloco_peer/peer/data.py",
            "diloco_peer/coordinator_free/dylu.py", "diloco_peer/coordinator_free/sampler.py",
            "diloco_peer/cli/sim_cmd.py")  # fmt: skip
"""What a simulated run's result depends on besides its flags (its defaults included)."""


def code_digest() -> str:
    """A digest of SIM_CODE and the simulator's default settings (SimSpec's, and the built-in
    run's, which `simulate`'s flags default to): a kept result counts only for the code that
    produced it."""
    from diloco_peer.config import SimSpec, default_run

    root, h = Path(__file__).resolve().parent.parent, hashlib.sha256()
    h.update(json.dumps(SimSpec().to_dict(), sort_keys=True).encode())
    run, swarm = default_run()
    h.update(json.dumps([run.to_dict(), swarm.to_dict()], sort_keys=True).encode())
    for name in SIM_CODE:
        path = root / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def kept_path(args: list[str], out: Path, code: str | None = None) -> Path:
    """Where the result of a run with these flags at simulator code `code` (now's by default)
    is kept."""
    key = hashlib.sha256(" ".join([code or CODE, *args]).encode()).hexdigest()[:16]
    return out / f"{key}.json"


def simulate(args: list[str], out: Path, cached_only: bool = False) -> dict[str, Any] | None:
    """One `simulate` run, or its kept result when `out` holds it already (same flags, same
    simulator code); with `cached_only`, None instead of a run."""
    path = kept_path(args, out)
    if path.exists():
        return json.loads(path.read_text())
    if cached_only:
        return None
    t0 = time.time()
    result = run_simulate(args)
    doc = {"args": args, "code": CODE, "config": result["config"], "wall_s": time.time() - t0,
           "final_ppl": result["final_ppl"], "sim_time": result["sim_time"],
           "outer_updates": result["outer_updates"],
           "curve": result["curve"], "mean_staleness": result.get("mean_staleness"),
           "idle_fraction": result.get("idle_fraction")}  # fmt: skip
    path.write_text(json.dumps(doc))
    print(f"[bench] {' '.join(args)}: ppl {result['final_ppl']:.3f} ({doc['wall_s']:.0f}s)",
          file=sys.stderr, flush=True)  # fmt: skip
    return doc


CODE = code_digest()

SAME_RESULT = ("final_ppl", "sim_time", "outer_updates", "curve")
"""What must be equal, bit for bit, for a run at new code to be the run kept at old code."""


PATH_FLAGS = ("--algo", "--overlap", "--overlap-fold")
"""Flags whose value picks another code path of the simulator (the others only set numbers)."""


def code_path(args: list[str]) -> tuple[str, ...]:
    """The simulator's code path a run takes, as far as its flags tell: the values of
    PATH_FLAGS and the names of the other flags given (a pretraining, an all-reduce time)."""
    flags = [a for a in args if a.startswith("-") and not a.lstrip("-").replace(".", "").isdigit()]
    values = [args[args.index(f) + 1] for f in PATH_FLAGS if f in args]
    return (*values, *sorted(set(flags) - set(PATH_FLAGS)))


def adopt(jobs: list[list[str]], out: Path, old: str, parallel: int) -> list[str]:
    """Carry the runs kept at simulator code `old` over to the code of now, when a change left
    the simulated runs as they were (a new option that is off by default, a comment). Proof,
    not trust: the first kept run of each algorithm is run again at the new code, and only if
    every one of them equals its kept result bit for bit (SAME_RESULT) are the others carried
    over, each marked `adopted_from` with the runs that proved it. One proof per code path
    (`code_path`). Returns the runs proved; raises SystemExit naming the first that differs
    (nothing carried over). The proof holds on the machine the kept runs were made on: another
    CPU's kernels round differently (seen: 5.2526 against 5.2597 for the same run and code), so
    elsewhere it fails and the runs are made again."""
    todo = [a for a in jobs if not kept_path(a, out).exists() and kept_path(a, out, old).exists()]
    proofs: dict[tuple[str, ...], list[str]] = {}
    for args in todo:
        proofs.setdefault(code_path(args), args)
    with ThreadPoolExecutor(parallel) as pool:
        reruns = list(pool.map(lambda args: simulate(args, out), proofs.values()))
    for args, now in zip(proofs.values(), reruns, strict=True):
        was = json.loads(kept_path(args, out, old).read_text())
        if now is None or any(now[k] != was[k] for k in SAME_RESULT):
            raise SystemExit(f"--adopt {old}: {' '.join(args)} differs at code {CODE}; "
                             "the kept runs are not carried over")  # fmt: skip
    proved = [" ".join(a) for a in proofs.values()]
    for args in todo:
        path = kept_path(args, out)
        if not path.exists():
            doc = json.loads(kept_path(args, out, old).read_text())
            path.write_text(json.dumps(dict(doc, code=CODE, adopted_from=old, proved_by=proved)))
    print(f"[bench] adopted {len(todo)} runs from code {old}, proved by {len(proved)} re-runs",
          file=sys.stderr)  # fmt: skip
    return proved


RUN_ON_MARGIN = 1.05
"""How far past sync's virtual end time a run on goes (`run_on_args`)."""


def run_on_args(args: list[str], total_steps: int, factor: float) -> list[str]:
    """The same run with its step budget scaled by `factor` (sync's virtual end time over its
    own, and RUN_ON_MARGIN more), evaluated as often as the budget run (every total/20 steps,
    as `simulate` spaces it) so that the two curves share their points. A run's phases do not
    depend on the budget but for the last, truncated ones, so the run on repeats the budget
    run's curve and then goes on (`same_prefix` checks it)."""
    i = args.index("--total-steps")
    steps = int(total_steps * factor * RUN_ON_MARGIN) + 1
    return [
        *args[: i + 1],
        str(steps),
        *args[i + 2 :],
        "--eval-every",
        str(max(1, total_steps // 20)),
    ]


def same_prefix(budget: dict[str, Any], run_on: dict[str, Any]) -> bool:
    """Whether the run on's curve repeats the budget run's, point for point, bit for bit, up to
    the budget run's last point (whose phases the budget truncated)."""
    points = budget["curve"][:-1]
    return bool(points) and run_on["curve"][: len(points)] == points


def run_on_jobs(results: dict[tuple[str, str], dict[str, Any]],
                args_of: dict[tuple[str, str], list[str]], total_steps: int,
                ) -> dict[tuple[str, str], list[str]]:  # fmt: skip
    """The runs on to make: a method's run in a cell that ended before sync's did, without
    reaching sync's final ppl (its budget of local steps was spent sooner). Run on until sync's
    virtual end time, it shows whether it reaches that ppl sooner than sync, which the
    issue's "sooner in virtual time" asks; the final ppl stays the budget run's."""
    todo = {}
    for (cell, name), args in args_of.items():
        sync, r = results.get((cell, "sync")), results.get((cell, name))
        if name == "sync" or sync is None or r is None or not 0 < r["sim_time"] < sync["sim_time"]:
            continue
        if time_to_reach(r["curve"], sync["final_ppl"]) is None:
            todo[(cell, name)] = run_on_args(args, total_steps, sync["sim_time"] / r["sim_time"])
    return todo


SAME_AT_EVERY_LEVEL = ("sync", "ddp")
"""Methods whose run is the same at every heterogeneity but for its clock."""


def same_run_other_clock(
    run: dict[str, Any], level: str, other: str, workers: int
) -> dict[str, Any]:
    """Sync DiLoCo (or data parallel) at heterogeneity `other`, from its run at `level`: its
    rounds (steps) compute the same θ at every level, each waiting for the slowest worker; only
    the clock differs, and with no jitter each round lasts H (1) × the slowest worker's step
    time. So the run is the same with its virtual times scaled by the ratio of the slowest step
    times; this saves a quarter of the grid."""
    from diloco_peer.sim.profiles import step_seconds

    k = max(step_seconds(other, workers)) / max(step_seconds(level, workers))
    curve = [dict(p, sim_time=p["sim_time"] * k) for p in run["curve"]]
    return dict(run, sim_time=run["sim_time"] * k, curve=curve, derived_from=level)


def parse_variants(raw: list[str]) -> dict[str, tuple[str, list[str]]]:
    """`--variant "NAME=ALGO FLAG VALUE ..."` → {NAME: (ALGO, [FLAG, VALUE, ...])}."""
    variants = {}
    for text in raw:
        words = shlex.split(text)
        name, _, algo = words[0].partition("=") if words else ("", "", "")
        if not name or not algo:
            raise SystemExit(f"--variant wants 'NAME=ALGO [FLAGS...]', got {text!r}")
        variants[name] = (algo, words[1:])
    return variants


def summarize(cells: list[Cell], results: dict[tuple[str, str], dict[str, Any]],
              methods: list[str], run_on: dict[tuple[str, str], dict[str, Any]],
              ) -> dict[str, Any]:  # fmt: skip
    """Per cell and method: final ppl, its ratio to sync's, and the virtual time to reach
    sync's final ppl within the budget and, where a run on was made, run on to sync's end time;
    per method the median and the worst ratio, and whether it reaches sync's ppl sooner in
    every cell (either way)."""
    rows, ratios = [], {m: [] for m in methods if m != "sync"}
    for cell in cells:
        sync = results.get((cell.name, "sync"))
        if sync is None:
            continue
        target = sync["final_ppl"]
        row: dict[str, Any] = {"cell": cell.name, "setting": cell.setting, "seed": cell.seed,
                               "sync_ppl": target,
                               "sync_reach_s": time_to_reach(sync["curve"], target)}  # fmt: skip
        for m in methods:
            r = results.get((cell.name, m))
            if m == "sync" or r is None:
                continue
            ratio = r["final_ppl"] / target
            ratios[m].append(ratio)
            row[m] = {"ppl": r["final_ppl"], "ratio": ratio, "sim_time": r["sim_time"],
                      "reach_s": time_to_reach(r["curve"], target),
                      "outer_updates": r["outer_updates"]}  # fmt: skip
            row[m]["reach_run_on_s"] = row[m]["reach_s"]
            more = run_on.get((cell.name, m))
            if more is not None:
                row[m]["run_on"] = {"args": more["args"], "sim_time": more["sim_time"],
                                    "same_prefix": same_prefix(r, more)}  # fmt: skip
                if row[m]["run_on"]["same_prefix"]:
                    row[m]["reach_run_on_s"] = time_to_reach(more["curve"], target)
        rows.append(row)
    per_method = {
        m: {
            "cells": len(v),
            "median_ratio": statistics.median(v),
            "worst_ratio": max(v),
            "best_ratio": min(v),
            **{
                key: all(
                    row[m][reach] is not None and row[m][reach] < row["sync_reach_s"]
                    for row in rows
                    if m in row
                )
                for key, reach in (
                    ("sooner_everywhere", "reach_s"),
                    ("sooner_everywhere_run_on", "reach_run_on_s"),
                )
            },  # fmt: skip
        }  # fmt: skip
        for m, v in ratios.items()
        if v
    }
    return {"rows": rows, "methods": per_method, "settings": per_setting(rows, list(ratios))}


def per_setting(rows: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per setting, over its seeds: how far sync's own final ppl spreads from seed to seed (the
    noise floor a cell's ratio sits in), and each method's median and worst ratio to sync."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["setting"], []).append(row)
    out = []
    for setting, mine in sorted(by.items()):
        sync = [r["sync_ppl"] for r in mine]
        entry: dict[str, Any] = {"setting": setting, "seeds": len(mine), "sync_ppl_min": min(sync),
                                 "sync_ppl_max": max(sync), "sync_spread": max(sync) / min(sync)}  # fmt: skip
        for m in methods:
            ratios = [r[m]["ratio"] for r in mine if m in r]
            if ratios:
                entry[m] = {"cells": len(ratios), "median_ratio": statistics.median(ratios),
                            "worst_ratio": max(ratios),
                            "above_sync": sum(x > 1 for x in ratios)}  # fmt: skip
        out.append(entry)
    return out


def _f(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    return f"{x:.2e}" if abs(x) >= 1e4 else f"{x:.{digits}f}"  # a diverged run: 7.68e+08


def _reach(cell: dict[str, Any]) -> str:
    """A method's reach in one cell: within the budget, and run on where it was."""
    text = _f(cell["reach_s"], 0)
    if "run_on" in cell:
        more = _f(cell["reach_run_on_s"], 0) if cell["run_on"]["same_prefix"] else "differs"
        text += f" (run on: {more})"
    return text


def render(doc: dict[str, Any]) -> str:
    methods = [m for m in doc["methods_run"] if m != "sync"]
    head = "| cell | sync ppl | " + " | ".join(f"{m} ppl (× sync)" for m in methods)
    head += " | " + " | ".join(f"{m} reach s" for m in methods) + " | sync reach s |"
    lines = [
        "## Async against sync, untuned, over a grid (bench/async_robustness.py)",
        "",
        f"`{doc['command']}`: nano, {doc['workers']} workers, {doc['total_steps']} local steps "
        "per run, every method at `simulate`'s defaults. *reach s*: virtual seconds until the "
        "held-out ppl is at or below sync's final ppl (— never within the budget; *run on*: "
        "the same run with its budget raised to last past sync's virtual end time, where its "
        "budget ran out sooner without reaching that ppl). "
        f"Cells with a sync run: {len(doc['summary']['rows'])} of {doc['cells_planned']}.",
        "",
        head,
        "|" + "---|" * (2 + 2 * len(methods) + 1),
    ]
    for row in sorted(doc["summary"]["rows"], key=lambda r: (r["setting"], r["seed"])):
        cols = [row["cell"], _f(row["sync_ppl"])]
        cols += [f"{_f(row[m]['ppl'])} ({_f(row[m]['ratio'], 4)})" if m in row else "—"
                 for m in methods]  # fmt: skip
        cols += [_reach(row[m]) if m in row else "—" for m in methods]
        cols.append(_f(row["sync_reach_s"], 0))
        lines.append("| " + " | ".join(cols) + " |")
    lines += ["", "| method | cells | median × sync | worst × sync | best × sync | reaches sync's "
              "ppl sooner in every cell, within the budget | the same, run on |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    yes = {True: "yes", False: "no"}
    for m, s in doc["summary"]["methods"].items():
        lines.append(f"| {m} | {s['cells']} | {_f(s['median_ratio'], 4)} | {_f(s['worst_ratio'], 4)} "
                     f"| {_f(s['best_ratio'], 4)} | {yes[s['sooner_everywhere']]} "
                     f"| {yes[s['sooner_everywhere_run_on']]} |")  # fmt: skip
    return "\n".join(lines + render_settings(doc, methods)) + "\n"


def render_settings(doc: dict[str, Any], methods: list[str]) -> list[str]:
    """The per-setting table: each method over the seeds, beside sync's own seed spread."""
    shown = [m for m in methods if m not in REFERENCE]  # reference rows: one seed per setting
    lines = ["", "Per setting, over its seeds (*sync spread*: sync's highest final ppl over its "
             "lowest, from seed to seed; *above*: cells ending above sync's ppl):", "",
             "| setting | seeds | sync ppl (spread) | "
             + " | ".join(f"{m} median × sync | worst | above" for m in shown) + " |",
             "|" + "---|" * (3 + 3 * len(shown))]  # fmt: skip
    for s in doc["summary"]["settings"]:
        cols = [s["setting"], str(s["seeds"]),
                f"{_f(s['sync_ppl_min'])}–{_f(s['sync_ppl_max'])} ({_f(s['sync_spread'], 3)})"]  # fmt: skip
        for m in shown:
            e = s.get(m)
            cols += ([_f(e["median_ratio"], 4), _f(e["worst_ratio"], 4), str(e["above_sync"])]
                     if e else ["—"] * 3)  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=KEPT, help="folder of kept run results")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--starts", default="scratch,pre300", help="scratch and/or preN")
    p.add_argument("--H", default="25,50,100", help="inner steps of the fastest worker")
    p.add_argument("--het", default="slight,very", help="heterogeneity levels")
    p.add_argument("--methods", default="sync,dn-dylu", help="algorithms at their defaults")
    p.add_argument(
        "--reference-seeds",
        type=int,
        default=1,
        help="run naive async and ddp on this many of the seeds (0: none)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'NAME=ALGO FLAGS'",
        help="a method with extra simulate flags, quoted as one argument",
    )
    p.add_argument("--model", default="nano")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--total-steps", type=int, default=2400)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="run nothing: summarize the kept runs (a grid stopped half way)",
    )
    p.add_argument(
        "--adopt",
        metavar="CODE",
        help="carry over the runs kept at this older simulator code, if re-running one per "
        "algorithm at the new code gives the same result bit for bit",
    )
    p.add_argument("--json", type=Path, help="write the document here too")
    p.add_argument("--markdown", type=Path, help="write the section into this page")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    # seed by seed: a grid stopped half way has every setting on its first seeds
    cells = [Cell(seed, start, int(h), het)
             for seed in seeds for start in a.starts.split(",") for h in a.H.split(",")
             for het in a.het.split(",")]  # fmt: skip
    methods = {m: (m, []) for m in a.methods.split(",")}
    methods.update(parse_variants(a.variant))
    jobs: list[tuple[Cell, str, list[str]]] = []
    hets = a.het.split(",")
    for seed in seeds:  # a seed's methods in every setting, then its reference rows
        mine = [cell for cell in cells if cell.seed == seed]
        runs = [(cell, name, algo, extra) for cell in mine
                for name, (algo, extra) in methods.items()]  # fmt: skip
        if seed in seeds[: a.reference_seeds]:
            runs += [(cell, m, m, []) for m in REFERENCE for cell in mine]
        jobs += [(cell, name, run_args(cell, algo, extra, a)) for cell, name, algo, extra in runs
                 if name not in SAME_AT_EVERY_LEVEL or cell.het == hets[0]]  # fmt: skip
    t0 = time.time()
    if a.adopt:
        adopt([args for _, _, args in jobs], a.out, a.adopt, a.jobs)
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(pool.map(lambda job: simulate(job[2], a.out, a.cached_only), jobs))
    results = {(cell.name, name): r for (cell, name, _), r in zip(jobs, done, strict=True) if r}
    for cell in cells:  # the runs other levels are derived from (same_run_other_clock)
        for name in SAME_AT_EVERY_LEVEL:
            base = results.get((replace(cell, het=hets[0]).name, name))
            if cell.het != hets[0] and base:
                results[(cell.name, name)] = same_run_other_clock(
                    base, hets[0], cell.het, a.workers
                )
    args_of = {(cell.name, name): args for cell, name, args in jobs if name in methods}
    more = run_on_jobs(results, args_of, a.total_steps)
    with ThreadPoolExecutor(a.jobs) as pool:
        ran_on = list(pool.map(lambda args: simulate(args, a.out, a.cached_only), more.values()))
    run_on = {key: r for key, r in zip(more, ran_on, strict=True) if r}
    names = [*methods, *(REFERENCE if a.reference_seeds else ())]
    doc = {
        "command": "python bench/async_robustness.py " + " ".join(sys.argv[1:]), "code": CODE,
        "workers": a.workers, "total_steps": a.total_steps, "methods_run": names,
        "variants": {n: [algo, *extra] for n, (algo, extra) in methods.items()},
        "summary": summarize(cells, results, names, run_on), "wall_s": time.time() - t0,
        "cells_planned": len(cells),
    }  # fmt: skip
    publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)


if __name__ == "__main__":
    main()
