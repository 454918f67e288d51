"""Overlapped rounds on an emulated WAN (issue 18): blocking against overlapped, sync and async.

Needs root. Four (--peers) `diloco-peer join` peers, one per host of a
`diloco_peer.netlab.NetLab`, every link shaped to --mbit both ways (`tc ... tbf`), the --model
preset on byte tokens, int8 δs, H = --inner-steps, each peer on one CPU thread, until the
replicated state holds --total-steps applied local steps. Per repeat, per protocol, a blocking
run and an overlapped one (`swarm.overlap`, ALGORITHMS §1.1), on the same lab and seed.

Per run: each peer's compute utilization in steady state (compute seconds over wall seconds
from its first applied round to its last, from the round events: start-up and the run's end,
with fragments the flush's rounds, left out) and over its whole run (its stop event: compute_s / active_s); the round's span
(`comm_s`, from the phase's end to the update in hand) against a phase (steps / speed), which
says whether the links put the all-reduce in the issue's band (0.3x to 1x a phase); the final
held-out ppl (the founder's stop event), the applied steps, whether every peer ended on one
state, and the wall-clock from the founder's first training step to the first evaluation at or
below the target perplexity (--target-ppl; by default the worst final ppl of that protocol's
runs, which every run reaches).

Checks (issue 18): overlapped steady-state utilization >= 0.95 in every run (the lowest peer's);
final ppl overlapped <= 1.02 x blocking (medians over the repeats); one state in every run.
Failed checks are reported; the exit status is 1 only if a run crashed or timed out.

    python bench/overlap.py --repeats 3 --json bench/results/overlap_netlab.json \\
        --markdown docs/results.md

Without `--fold`, `--keep`, `--start-from`, the swarm's default rule (`mix`, κ 0.5, from the
group: `SwarmSettings.fold`); `--fold rebase` runs the older one (κ 1, from the phase).

Prints progress on stderr and one JSON document on stdout. Every process is killed by process
group and every namespace deleted on the way out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common

from diloco_peer.config import default_run
from diloco_peer.coordinator_free.manifest import dump_run_config
from diloco_peer.local_swarm import LocalSwarm
from diloco_peer.netlab import Host, NetLab
from diloco_peer.peer.events import read_log

REPO = Path(__file__).resolve().parent.parent
PEERS = 4
"""The issue's swarm (--peers sets another)."""
BEGIN = "<!-- begin: bench/overlap.py (rewritten by the bench) -->"
END = "<!-- end: bench/overlap.py -->"
NOTES = "<!-- overlap notes: kept when the bench rewrites this section -->"
UTILIZATION_MIN = 0.95
PPL_RATIO_MAX = 1.02
_T0 = time.time()


def say(message: str) -> None:
    print(f"[overlap {time.time() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def steady_utilization(rounds: list[dict[str, Any]]) -> float | None:
    """Compute seconds over wall seconds between a peer's first and last applied round."""
    if len(rounds) < 3:
        return None
    first, last = rounds[0], rounds[-1]
    wall = last["time"] - first["time"]
    return (last["compute_s"] - first["compute_s"]) / wall if wall > 0 else None


def mode_of(mode: str) -> tuple[bool, int]:
    """(overlapped, fragments) of a --modes entry: `blocking`, `overlapped`, or either with
    `+fN` (swarm.fragments N, ALGORITHMS §1.2; sync only)."""
    base, _, fragments = mode.partition("+f")
    if base not in ("blocking", "overlapped") or (fragments and not fragments.isdigit()):
        raise ValueError(f"unknown mode {mode!r}: blocking or overlapped, maybe with +fN")
    return base == "overlapped", int(fragments or 1)


def one_run(a: argparse.Namespace, hosts: list[Host], protocol: str, mode: str,
            folder: Path, name: str) -> dict[str, Any]:  # fmt: skip
    overlap, fragments = mode_of(mode)
    run_spec, settings = default_run(a.model, protocol)
    run_spec = dataclasses.replace(run_spec, inner_steps=a.inner_steps, compression="int8")
    settings = dataclasses.replace(settings, expected_peers=a.peers, overlap=overlap,
                                   fragments=fragments)  # fmt: skip
    if overlap:  # the rule (ALGORITHMS §1.1): the swarm's defaults unless asked otherwise
        settings = dataclasses.replace(
            settings, overlap_fold=a.fold or settings.overlap_fold,
            overlap_keep=settings.overlap_keep if a.keep is None else a.keep,
            overlap_from=a.start_from or settings.overlap_from,
        )  # fmt: skip
    folder.mkdir(parents=True)
    config = folder / "run.toml"
    config.write_text(dump_run_config(run_spec, settings), encoding="utf-8")
    join_args = ["--quiet", "--threads", "1", "--until-steps", str(a.total_steps)]
    t0 = time.time()
    with LocalSwarm(folder, run=name, join_args=join_args, cwd=REPO) as swarm:
        founder, log0 = swarm.start("peer0", "--host", hosts[0].ip, "--config", str(config),
                                    wrap=hosts[0].argv([]))  # fmt: skip
        maddr = swarm.address(log0, 180, proc=founder, ip=hosts[0].ip)
        for i, host in enumerate(hosts[1:], start=1):
            swarm.start(f"peer{i}", "--host", host.ip, "--swarm", maddr, wrap=host.argv([]))
        deadline = time.time() + a.timeout_s
        while time.time() < deadline and swarm.running():
            time.sleep(1.0)
        codes = [p.poll() for p in swarm.procs]
    peers, curve = [], []
    for i in range(a.peers):
        events = read_log(folder / f"peer{i}.jsonl")
        rounds = [e for e in events if e["event"] == "round"]
        stop = next((e for e in events if e["event"] == "stop"), {})
        # with fragments, the run's last P - 1 versions are the flush's rounds of no steps
        # (docs/algorithms.md §1.3, 6): the steady state ends before them
        end = (stop.get("version") or 0) - (fragments - 1)
        trained = [e for e in rounds if e["version"] <= end] if fragments > 1 else rounds
        spans = [e["comm_s"] / (e["steps"] / e["speed"]) for e in rounds
                 if e.get("speed") and e.get("steps")]  # fmt: skip
        curve += [(e["time"], e["ppl"]) for e in rounds if e.get("ppl") is not None]
        active = stop.get("active_s") or 0.0
        peers.append({
            "exit_code": codes[i], "rounds": len(rounds),
            "steps": sum(e.get("steps", 0) for e in rounds),
            "steady_utilization": steady_utilization(trained),
            "run_utilization": stop.get("compute_s", 0.0) / active if active else None,
            "round_over_phase": median(spans),
            "overlapped_rounds": sum(1 for e in rounds if e.get("overlapped")),
            "round_bytes_max": max((e["bytes_sent"] for e in rounds), default=None),
            "round_bytes_median": median([e["bytes_sent"] for e in rounds]),
            "final_hash": stop.get("state_hash"), "final_version": stop.get("version"),
            "ppl": stop.get("ppl"), "applied_steps": stop.get("applied_steps"),
            "first_train": stop.get("time", t0) - active if active else None,
        })  # fmt: skip
    starts = [p["first_train"] for p in peers if p["first_train"]]
    ok = all(c == 0 for c in codes)
    return {
        "protocol": protocol, "mode": mode, "ok": ok,
        "round_bytes_max": median([p["round_bytes_max"] for p in peers]),
        "wall_s": round(time.time() - t0, 1), "one_state": len({p["final_hash"] for p in peers}) == 1,
        "ppl": peers[0]["ppl"], "applied_steps": peers[0]["applied_steps"],
        "utilization_min": None if any(p["steady_utilization"] is None for p in peers)
        else min(p["steady_utilization"] for p in peers),
        "utilization_median": median([p["steady_utilization"] for p in peers]),
        "run_utilization_median": median([p["run_utilization"] for p in peers]),
        "round_over_phase": median([p["round_over_phase"] for p in peers]),
        "t_train0": min(starts) if starts else t0, "curve": sorted(curve), "peers": peers,
        "logs": str(folder),
    }  # fmt: skip


def time_to(run: dict[str, Any], target: float) -> float | None:
    return next((t - run["t_train0"] for t, ppl in run["curve"] if ppl <= target), None)


def summarize(runs: list[dict[str, Any]], target_ppl: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for protocol in sorted({r["protocol"] for r in runs}):
        mine = [r for r in runs if r["protocol"] == protocol and r["ok"]]
        target = target_ppl or max((r["ppl"] for r in mine if r["ppl"]), default=None)
        rows = {}
        for mode in dict.fromkeys(r["mode"] for r in runs if r["protocol"] == protocol):
            m = [r for r in mine if r["mode"] == mode]
            for r in m:
                r["reach_s"] = time_to(r, target) if target else None
            failed = sum(1 for r in runs if (r["protocol"], r["mode"]) == (protocol, mode)
                         and not r["ok"])  # fmt: skip
            rows[mode] = {
                "runs": len(m), "failed": failed,
                "ppl": [r["ppl"] for r in m], "ppl_median": median([r["ppl"] for r in m]),
                "utilization_min": [r["utilization_min"] for r in m],
                "utilization_median": median([r["utilization_median"] for r in m]),
                "run_utilization_median": median([r["run_utilization_median"] for r in m]),
                "round_over_phase": median([r["round_over_phase"] for r in m]),
                "reach_s": [r["reach_s"] for r in m], "wall_s": [r["wall_s"] for r in m],
                "one_state": all(r["one_state"] for r in m),
                "round_bytes_max": median([r["round_bytes_max"] for r in m]),
            }  # fmt: skip
        for mode, row in rows.items():  # each mode's final ppl against its whole model's
            whole = rows.get(mode.partition("+f")[0], {}).get("ppl_median")
            row["ppl_vs_whole"] = row["ppl_median"] / whole if row["ppl_median"] and whole else None
        if "blocking" not in rows or "overlapped" not in rows:
            out[protocol] = {"target_ppl": target, **rows}
            continue
        b, o = rows["blocking"], rows["overlapped"]
        ratio = o["ppl_median"] / b["ppl_median"] if o["ppl_median"] and b["ppl_median"] else None
        out[protocol] = {
            "target_ppl": target, **rows, "ppl_ratio": ratio,
            "checks": {
                "utilization": bool(o["utilization_min"]) and None not in o["utilization_min"]
                and min(o["utilization_min"]) >= UTILIZATION_MIN,
                "ppl": ratio is not None and ratio <= PPL_RATIO_MAX,
                "one_state": b["one_state"] and o["one_state"],
                "all_finished": not (b["failed"] or o["failed"]),
            },
        }  # fmt: skip
    return out


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(doc: dict[str, Any]) -> str:
    a = doc["args"]
    lines = [
        "## Overlapped rounds on netlab (bench/overlap.py)", "",
        f"`{doc['command']}`: {a.get('peers', PEERS)} peers, one per netlab host, links "
        f"{a['mbit']:g} Mbit both ways, `{a['model']}` preset on byte tokens "
        f"({doc['params']:,} parameters), int8, "
        f"H = {a['inner_steps']}, until {a['total_steps']} applied steps, one CPU thread per "
        f"peer on {doc['cpus']} cores; {a['repeats']} repeat(s), {doc['wall_s']:.0f} s in all. "
        "*util*: compute s over wall s between a peer's first and last applied round (the "
        "lowest peer per run; the median peer in brackets); *whole run*: compute_s / active_s of "
        "the stop events; *round/phase*: a round's span (phase end to update in hand) over a "
        "phase; *reach*: s from the first training step to the first evaluation at or below the "
        "target ppl.", "",
        "| protocol | mode | final ppl (each run) | util, lowest peer (each run) | util median / whole run "
        "| round/phase | reach s (each run) | wall s (each run) | one state "
        "| round MB sent, most |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for protocol, s in doc["summary"].items():
        for mode in [m for m in s if isinstance(s[m], dict) and "runs" in s[m]]:
            r = s[mode]
            most = r.get("round_bytes_max")
            lines.append(
                f"| {protocol} | {mode} | {', '.join(_f(p) for p in r['ppl'])}"
                f"{'; did not finish: ' + str(r['failed']) if r.get('failed') else ''} | "
                f"{', '.join(_f(u) for u in r['utilization_min'])} | "
                f"{_f(r['utilization_median'])} / {_f(r['run_utilization_median'])} | "
                f"{_f(r['round_over_phase'], 2)} | {', '.join(_f(t, 0) for t in r['reach_s'])} | "
                f"{', '.join(_f(t, 0) for t in r['wall_s'])} | {r['one_state']} | "
                f"{_f(None if most is None else most / 1e6, 2)} |"
            )
    lines.append("")
    for protocol, s in doc["summary"].items():
        fragmented = [(m, r["ppl_vs_whole"]) for m, r in s.items() if "+f" in m]
        if fragmented:
            lines.append(f"- {protocol}: final ppl against the whole model's (medians): "
                         + ", ".join(f"{m} {_f(v, 4)}" for m, v in fragmented) + ".")  # fmt: skip
        if "checks" not in s:
            continue
        c = s["checks"]
        lines.append(
            f"- {protocol}: target ppl {_f(s['target_ppl'])}; overlapped/blocking final ppl "
            f"(medians) {_f(s['ppl_ratio'], 4)} (need <= {PPL_RATIO_MAX}): "
            f"{'pass' if c['ppl'] else 'FAIL'}; overlapped utilization >= {UTILIZATION_MIN} in "
            f"every run: {'pass' if c['utilization'] else 'FAIL'}; one state: "
            f"{'pass' if c['one_state'] else 'FAIL'}; every run finished: "
            f"{'pass' if c['all_finished'] else 'FAIL'}."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    _common.exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="20m")
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--total-steps", type=int, default=1600)
    p.add_argument("--mbit", type=float, default=10.0)
    p.add_argument("--peers", type=int, default=PEERS, help="peers, one per netlab host")
    p.add_argument("--protocols", default="sync,async")
    p.add_argument("--modes", default="blocking,overlapped",
                   help="blocking, overlapped, or either with +fN: N fragments (sync)")  # fmt: skip
    p.add_argument(
        "--fold",
        choices=("rebase", "mix", "pull"),
        default=None,
        help="overlapped runs' fold (swarm.overlap_fold; the default's if not given)",
    )
    p.add_argument("--keep", type=float, default=None, help="the fold's share κ (overlap_keep)")
    p.add_argument(
        "--start-from",
        choices=("phase", "group"),
        default=None,
        help="when an overlapped phase starts (swarm.overlap_from)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-ppl", type=float, default=None)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    a = p.parse_args()
    for mode in a.modes.split(","):  # bad input fails before the lab is built
        try:
            mode_of(mode)
        except ValueError as e:
            p.error(str(e))
    from diloco_peer.peer.model import build_model, count_parameters

    folder = Path(time.strftime("/tmp/overlap-bench-%Y%m%d-%H%M%S"))
    runs: list[dict[str, Any]] = []
    with NetLab() as lab:
        hosts = [lab.add_host(up_mbit=a.mbit, down_mbit=a.mbit) for _ in range(a.peers)]
        for rep in range(a.repeats):
            for protocol in a.protocols.split(","):
                for mode in a.modes.split(","):
                    short = mode.replace("overlapped", "ov").replace("blocking", "bl")
                    name = f"{protocol}-{short.replace('+', '')}-{rep}"
                    say(f"{name}: starting")
                    run = one_run(a, hosts, protocol, mode, folder / name, name.replace("-", ""))
                    run["repeat"] = rep
                    runs.append(run)
                    say(f"{name}: ok={run['ok']} ppl {_f(run['ppl'])} util min "
                        f"{_f(run['utilization_min'])} round/phase {_f(run['round_over_phase'], 2)} "
                        f"wall {run['wall_s']:.0f} s")  # fmt: skip
    import os

    doc = {
        "command": "python bench/overlap.py " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "params": count_parameters(build_model(a.model, 256, seed=0)), "cpus": os.cpu_count(),
        "wall_s": time.time() - _T0, "summary": summarize(runs, a.target_ppl), "runs": runs,
    }  # fmt: skip
    _common.publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
