"""Real swarm at heterogeneity "very": synchronous DiLoCo vs DyLU + Delayed Nesterov (issue 4).

Each repeat runs `diloco-peer demo` twice, sync then async, with the same model, H and total
local steps: four real peer processes on 127.0.0.1, the slow ones throttled (1.0, 1.29, 2.60,
5.74× slower), training until the replicated state holds --total-steps applied local steps.
Sync waits every round for the slowest peer; async lets slow peers do fewer steps (DyLU) and
form groups within a grace period.

Per protocol it reports wall-clock (the longest peer's active time, from its first training
step to its stop, which leaves out process start-up; and the demo's own wall time), final
held-out perplexity, applied steps, each peer's idle fraction, and each shard's share of the
trained samples against its share of the data. The acceptance checks of issue 4 compare async
against sync measured in the same run; failing checks are reported, and the exit status is 0.
It is 1 only if a run failed: crashed or timed out, printed no JSON, or ended with peers whose
state hashes disagree. Such a run is listed with its reason and left out of the medians
(unless no run of that protocol succeeded: then its medians are given, marked invalid).

Defaults (nano, H = 50, 1000 steps: five sync rounds) keep one sync+async pair at about 8
minutes on an idle 2-core machine, 12 under load.

Prints a table to stderr and one JSON line to stdout; --json also writes the document to a
file, --markdown writes (or replaces) this bench's own section of the results page.

    python bench/async_swarm.py --markdown docs/results.md
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
import time
from pathlib import Path
from typing import Any

import _common

from diloco_peer.peer.events import read_log

PROTOCOLS = ("sync", "async")
SECTION_BEGIN = "<!-- begin: bench/async_swarm.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/async_swarm.py -->"
NOTES_MARKER = "<!-- async_swarm notes: kept when the bench rewrites this section -->"

# Issue 4's acceptance thresholds.
PPL_RATIO_MAX = 1.03
WALL_REDUCTION_MIN = 0.20
ASYNC_IDLE_MAX = 0.10
SHARD_DEV_MAX = 0.05


class RunFailed(Exception):
    """A demo run that gave no usable result: crashed, timed out or printed no JSON."""


def run_demo(protocol: str, a: argparse.Namespace) -> dict[str, Any]:
    """One `diloco-peer demo` run; its JSON document.

    The demo enforces --timeout-s itself (it stops every peer, whose processes live in their own
    sessions). The bench's own limit is a backstop: SIGINT lets the demo's cleanup run, SIGKILL
    follows if it does not exit."""
    cmd = [
        sys.executable, "-m", "diloco_peer", "demo", "--peers", str(a.peers),
        "--protocol", protocol, "--heterogeneity", a.heterogeneity, "--model", a.model,
        "-H", str(a.inner_steps), "--total-steps", str(a.total_steps),
        "--timeout-s", str(a.timeout_s), "--json",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=a.timeout_s + 120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise RunFailed(f"no exit within {a.timeout_s + 120:.0f} s; interrupted") from None
    if proc.returncode != 0:
        tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
        raise RunFailed(f"exit code {proc.returncode}: {tail}")
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        raise RunFailed(f"no JSON on stdout (got {out.strip()[:200]!r})") from None


def round_digest(logs: str | None, names: list[str]) -> dict[str, Any]:
    """Per-round evidence from each peer's JSONL events: steps, staleness, group size, comm_s,
    and the wait of each round (`wait_s` in the events is cumulative, so differences)."""
    digest: dict[str, Any] = {}
    for name in names:
        path = Path(logs or "") / f"{name}.jsonl"
        if not logs or not path.exists():
            continue
        rounds: list[dict[str, Any]] = []
        catch_ups: list[dict[str, Any]] = []
        other: dict[str, int] = {}
        last_wait = 0.0
        for ev in read_log(path):
            kind = ev.get("event")
            if kind == "round":
                wait = float(ev.get("wait_s") or 0.0)
                rounds.append({
                    "version": ev.get("version"), "steps": ev.get("steps"),
                    "staleness": ev.get("staleness"), "group_size": ev.get("group_size"),
                    "comm_s": round(float(ev.get("comm_s") or 0.0), 3),
                    "wait_s": round(wait - last_wait, 3),
                })  # fmt: skip
                last_wait = wait
            elif kind == "catch_up":
                catch_ups.append({
                    "method": ev.get("method"), "seconds": round(float(ev.get("seconds") or 0.0), 3),
                    "from_version": ev.get("from_version"), "version": ev.get("version"),
                })  # fmt: skip
            elif kind in ("round_failed", "dropped"):
                other[kind] = other.get(kind, 0) + 1
        group_sizes = [r["group_size"] or 0 for r in rounds]
        digest[name] = {
            "rounds": rounds,
            "catch_ups": catch_ups,
            "failed_rounds": other.get("round_failed", 0),
            "dropped": other.get("dropped", 0),
            "mean_steps": statistics.fmean([r["steps"] or 0 for r in rounds]) if rounds else None,
            "mean_group_size": statistics.fmean(group_sizes) if rounds else None,
            "max_staleness": max((r["staleness"] or 0 for r in rounds), default=None),
            "comm_s_total": round(sum(r["comm_s"] for r in rounds), 3),
            "catch_up_s_total": round(sum(c["seconds"] for c in catch_ups), 3),
        }
    return digest


def metrics(doc: dict[str, Any]) -> dict[str, Any]:
    """What the checks need from one demo document."""
    peers = [
        {k: p.get(k) for k in ("name", "throttle", "local_steps", "rounds", "active_s",
                               "compute_s", "idle_fraction", "exit_code")}
        for p in doc["peers"]
    ]  # fmt: skip
    samples = doc.get("shard_samples") or []
    data = doc.get("data_share") or []
    total = sum(samples)
    shards = []
    for i, (n, d) in enumerate(zip(samples, data, strict=True)):
        share = n / total if total else 0.0
        shards.append({
            "shard": i, "samples": n, "trained_share": share, "data_share": d,
            "abs_dev_pp": 100.0 * (share - d), "rel_dev": (share - d) / d if d else None,
        })  # fmt: skip
    idle = [p["idle_fraction"] for p in peers if p["idle_fraction"] is not None]
    return {
        "wall_s": doc.get("wall_s"),
        "active_max_s": max((p["active_s"] or 0.0 for p in peers), default=None),
        "ppl_before": doc.get("ppl_before"),
        "ppl_after": doc.get("ppl_after"),
        "applied_steps": doc.get("applied_steps"),
        "final_version": doc.get("final_version"),
        "hashes_agree": doc.get("hashes_agree"),
        "peers": peers,
        "idle_max": max(idle) if len(idle) == len(peers) else None,
        "shards": shards,
        "shard_abs_dev_pp_max": max((abs(s["abs_dev_pp"]) for s in shards), default=None),
        "shard_rel_dev_max": max(
            (abs(s["rel_dev"]) for s in shards if s["rel_dev"] is not None), default=None
        ),
    }


def _median(values: list[Any]) -> float | None:
    xs = [float(x) for x in values if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians over the successful runs of one protocol (the values themselves for one run).

    If no run succeeded but some finished with disagreeing states, their medians are given
    with `valid` False, so that the numbers are still seen, marked as such."""
    ms = [r["metrics"] for r in runs if r["ok"]]
    valid = bool(ms)
    if not ms:
        ms = [r["metrics"] for r in runs if r.get("metrics")]
    if not ms:
        return None
    out: dict[str, Any] = {"runs": len(ms), "valid": valid}
    for key in ("wall_s", "active_max_s", "ppl_before", "ppl_after", "applied_steps",
                "final_version", "idle_max", "shard_abs_dev_pp_max", "shard_rel_dev_max"):  # fmt: skip
        out[key] = _median([m[key] for m in ms])
    out["peers"] = [
        {"name": p["name"], "throttle": p["throttle"],
         **{k: _median([m["peers"][i][k] for m in ms])
            for k in ("local_steps", "rounds", "active_s", "compute_s", "idle_fraction")}}
        for i, p in enumerate(ms[0]["peers"])
    ]  # fmt: skip
    out["shards"] = [
        {"shard": s["shard"], "data_share": s["data_share"],
         **{k: _median([m["shards"][i][k] for m in ms])
            for k in ("samples", "trained_share", "abs_dev_pp", "rel_dev")}}
        for i, s in enumerate(ms[0]["shards"])
    ]  # fmt: skip
    return out


def checks(sync: dict[str, Any] | None, asyn: dict[str, Any] | None) -> dict[str, Any]:
    """Issue 4's acceptance checks on the per-protocol medians; `passed` is None where a check
    is only a report, or could not be evaluated because a protocol has no successful run."""
    if sync is None or asyn is None:
        missing = "sync" if sync is None else "async"
        return {"all": {"passed": None, "detail": f"not evaluated: no successful {missing} run"}}
    out: dict[str, Any] = {}
    invalid = [name for name, x in (("sync", sync), ("async", asyn)) if not x["valid"]]
    if invalid:
        out["caveat"] = {
            "passed": None,
            "detail": f"no {' or '.join(invalid)} run ended with agreeing states; the checks "
            "below use such runs and are not valid evidence",
        }
    ratio = asyn["ppl_after"] / sync["ppl_after"]
    out["1 ppl"] = {
        "passed": ratio <= PPL_RATIO_MAX, "async_ppl": asyn["ppl_after"],
        "sync_ppl": sync["ppl_after"], "ratio": ratio,
        "detail": f"async ppl {asyn['ppl_after']:.3f} vs sync {sync['ppl_after']:.3f}: "
                  f"ratio {ratio:.3f} (need <= {PPL_RATIO_MAX})",
    }  # fmt: skip
    reduction = 1.0 - asyn["active_max_s"] / sync["active_max_s"]
    demo_reduction = 1.0 - asyn["wall_s"] / sync["wall_s"]
    out["2 wall-clock"] = {
        "passed": reduction >= WALL_REDUCTION_MIN, "async_s": asyn["active_max_s"],
        "sync_s": sync["active_max_s"], "reduction": reduction,
        "demo_wall_reduction": demo_reduction,
        "detail": f"max active_s async {asyn['active_max_s']:.1f} s vs sync "
                  f"{sync['active_max_s']:.1f} s: reduction {100 * reduction:.1f}% (need >= "
                  f"{100 * WALL_REDUCTION_MIN:.0f}%); demo wall_s {asyn['wall_s']:.1f} vs "
                  f"{sync['wall_s']:.1f} s: reduction {100 * demo_reduction:.1f}%",
    }  # fmt: skip
    idle = {p["name"]: p["idle_fraction"] for p in asyn["peers"]}
    out["3 async idle"] = {
        "passed": asyn["idle_max"] is not None and asyn["idle_max"] <= ASYNC_IDLE_MAX,
        "idle_fraction": idle, "max": asyn["idle_max"],
        "detail": "async idle " + ", ".join(f"{k} {_pct(v)}" for k, v in idle.items())
                  + f"; max {_pct(asyn['idle_max'])} (need <= {_pct(ASYNC_IDLE_MAX)})",
    }  # fmt: skip
    slowest = max(p["throttle"] for p in sync["peers"])
    fast = {p["name"]: p["idle_fraction"] for p in sync["peers"] if p["throttle"] < slowest}
    out["4 sync fast-peer idle"] = {
        "passed": None, "idle_fraction": fast,
        "detail": "reported (expected high): sync idle of the faster peers "
                  + ", ".join(f"{k} {_pct(v)}" for k, v in fast.items()),
    }  # fmt: skip
    rel, pp = asyn["shard_rel_dev_max"], asyn["shard_abs_dev_pp_max"]
    rel_ok = rel is not None and rel <= SHARD_DEV_MAX
    abs_ok = pp is not None and pp <= 100 * SHARD_DEV_MAX
    if rel_ok:
        how = f"passes relative: max relative deviation {_pct(rel)} (<= {_pct(SHARD_DEV_MAX)})"
    else:
        how = (f"fails relative: max relative deviation {_pct(rel)} (> {_pct(SHARD_DEV_MAX)}); "
               f"absolute: max {pp:.2f} percentage points "
               f"({'within' if abs_ok else 'beyond'} {100 * SHARD_DEV_MAX:.0f} pp)")  # fmt: skip
    out["5 async shard share"] = {
        "passed": rel_ok, "checked": "relative", "rel_dev_max": rel, "abs_dev_pp_max": pp,
        "abs_within_5pp": abs_ok, "detail": how,
    }  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _f(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "report"}[passed]


def _digest_rows(digest: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, d in digest.items():
        n = len(d["rounds"])
        wait = statistics.fmean([r["wait_s"] for r in d["rounds"]]) if n else None
        rows.append((name, " | ".join([
            str(n), _f(d["mean_steps"]), _f(d["mean_group_size"], 2), str(d["max_staleness"]),
            _f(wait, 2), _f(d["comm_s_total"]),
            f"{len(d['catch_ups'])} ({d['catch_up_s_total']:.1f})",
            str(d["failed_rounds"] + d["dropped"]),
        ])))  # fmt: skip
    return rows


def report(doc: dict[str, Any]) -> str:
    """The readable table for stderr."""
    lines = []
    for r in doc["runs"]:
        state = "ok" if r["ok"] else f"FAILED: {r['error']}"
        lines.append(
            f"repeat {r['repeat']} {r['protocol']:5s} {state} ({r['bench_s']:.0f} s, load "
            f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f})"
        )
    for protocol in PROTOCOLS:
        s = doc["summary"][protocol]
        lines.append("")
        if s is None:
            lines.append(f"== {protocol}: no successful run")
            continue
        if not s["valid"]:
            lines.append(f"== {protocol}: NO RUN ENDED WITH AGREEING STATES; medians of those")
        lines.append(
            f"== {protocol} (median of {s['runs']}): max active {_f(s['active_max_s'])} s, "
            f"demo wall {_f(s['wall_s'])} s, ppl {_f(s['ppl_before'], 2)} -> "
            f"{_f(s['ppl_after'], 3)}, applied steps {_f(s['applied_steps'], 0)}, "
            f"version {_f(s['final_version'], 0)}"
        )
        lines.append(
            f"{'peer':6s} {'throttle':>8s} {'steps':>6s} {'rounds':>6s} {'active_s':>8s} "
            f"{'compute_s':>9s} {'idle':>6s}"
        )
        for p in s["peers"]:
            lines.append(
                f"{p['name']:6s} {p['throttle']:8.2f} {_f(p['local_steps'], 0):>6s} "
                f"{_f(p['rounds'], 0):>6s} {_f(p['active_s']):>8s} {_f(p['compute_s']):>9s} "
                f"{_pct(p['idle_fraction']):>6s}"
            )
        shares = ", ".join(
            f"{100 * x['trained_share']:.1f}/{100 * x['data_share']:.1f}" for x in s["shards"]
        )
        lines.append(f"shard share trained/data (%): {shares}")
        lines.append(
            f"max shard deviation: {_f(s['shard_abs_dev_pp_max'], 2)} pp, "
            f"{_pct(s['shard_rel_dev_max'])} relative"
        )
        first = next(
            r for r in doc["runs"] if r["protocol"] == protocol and r.get("metrics")
            and (r["ok"] or not s["valid"])
        )  # fmt: skip
        lines.append(
            f"per-round digest (repeat {first['repeat']}): rounds | mean steps | mean group | "
            "max staleness | mean wait s/round | comm s | catch-ups (s) | failed+dropped"
        )
        lines += [f"  {name}: {row}" for name, row in _digest_rows(first["rounds"])]
    lines += ["", "== acceptance checks"]
    for name, c in doc["checks"].items():
        lines.append(f"[{_verdict(c['passed'])}] {name}: {c['detail']}")
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """The generated part of this bench's section of the results page."""
    a = doc["args"]
    lines = [
        "## Real swarm: sync vs async (issue 4)",
        "",
        f"Produced by `{doc['command']}` in {doc['bench_wall_s']:.0f} s of wall time: "
        f"{a['repeats']} repeat(s), each a `diloco-peer demo` run with `--protocol sync` then "
        f"`--protocol async` (`--peers {a['peers']} --heterogeneity {a['heterogeneity']} "
        f"--model {a['model']} -H {a['inner_steps']} --total-steps {a['total_steps']}`). "
        "Numbers are medians over the successful runs.",
        "",
        f"Machine: {doc['machine']['cpus']} CPU cores, all {a['peers']} peers on this one "
        "machine, talking over loopback (127.0.0.1). Heterogeneity is emulated by throttling: "
        "after each inner step a slow peer sleeps (throttle − 1) × the step's time, so it runs "
        "its throttle factor slower. The peers share the cores, so a peer's unthrottled step "
        "time also depends on how many others compute at the same moment, and on whatever else runs "
        "on the machine (see the load averages under the runs).",
        "",
    ]
    lines += ["Runs (1-minute load average of the machine before → after each):", ""]
    for r in doc["runs"]:
        state = "ok" if r["ok"] else f"**failed**: {r['error']}"
        lines.append(
            f"- repeat {r['repeat']} {r['protocol']}: {state}; {r['bench_s']:.0f} s; load "
            f"{r['loadavg_before'][0]:.1f} → {r['loadavg_after'][0]:.1f}"
        )
    lines += ["", "Failed runs are left out of the medians (unless no run of that protocol "
              "succeeded; then the medians say so).", ""]  # fmt: skip
    for protocol, title in (("sync", "Sync DiLoCo (barrier)"),
                            ("async", "Async: DyLU + grace-period groups + Delayed Nesterov")):  # fmt: skip
        s = doc["summary"][protocol]
        lines += [f"### {title}", ""]
        if s is None:
            lines += ["No run produced a result.", ""]
            continue
        if not s["valid"]:
            lines += ["**No run ended with agreeing states**; the numbers below are the medians "
                      "of runs whose peers finished on different states.", ""]  # fmt: skip
        lines += [
            f"Wall-clock {s['active_max_s']:.1f} s (longest peer's active time; the demo's "
            f"wall time incl. start-up {s['wall_s']:.1f} s), held-out ppl "
            f"{s['ppl_before']:.2f} → **{s['ppl_after']:.3f}**, {s['applied_steps']:.0f} applied "
            f"local steps, {s['final_version']:.0f} outer updates.",
            "",
            "| peer | throttle | local steps | rounds | active s | compute s | idle fraction |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in s["peers"]:
            lines.append(
                f"| {p['name']} | {p['throttle']:.2f}× | {_f(p['local_steps'], 0)} "
                f"| {_f(p['rounds'], 0)} | {_f(p['active_s'])} | {_f(p['compute_s'])} "
                f"| {_pct(p['idle_fraction'])} |"
            )
        lines += [
            "",
            "| shard | samples trained | trained share | data share | deviation (pp) | relative |",
            "|---|---|---|---|---|---|",
        ]
        for x in s["shards"]:
            lines.append(
                f"| {x['shard']} | {_f(x['samples'], 0)} | {100 * x['trained_share']:.2f}% "
                f"| {100 * x['data_share']:.2f}% | {x['abs_dev_pp']:+.2f} | {_pct(x['rel_dev'])} |"
            )
        lines.append("")
        first = next(
            r for r in doc["runs"] if r["protocol"] == protocol and r.get("metrics")
            and (r["ok"] or not s["valid"])
        )  # fmt: skip
        lines += [
            f"Per-round digest from the peers' event logs (repeat {first['repeat']}): mean "
            "steps and group size per round, largest staleness, mean wait per round (`wait_s` "
            "differences), total `comm_s` (training end to commit), catch-ups.",
            "",
            "| peer | rounds | mean steps | mean group | max staleness | mean wait s/round "
            "| comm s | catch-ups (s) | failed rounds |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {name} | {row} |" for name, row in _digest_rows(first["rounds"])]
        lines.append("")
    lines += ["### Acceptance checks", ""]
    lines += [f"- {name}: **{_verdict(c['passed'])}**: {c['detail']}"
              for name, c in doc["checks"].items()]  # fmt: skip
    lines += [
        "",
        "What was measured: wall-clock is the longest peer's `active_s` (first training step to "
        "stop; it leaves out process start-up, DHT bootstrap and the wait for all peers to "
        "join); idle fraction is a peer's `wait_s` (matchmaking, all-reduce, catch-up) over its "
        "`active_s`, so evaluation and checkpointing count as neither compute nor idle; "
        "perplexity is on the held-out split of the built-in corpus after the last outer "
        "update; shard shares come from the replicated per-shard sample counters of the final "
        "state (all data shares are equal here), relative deviation = (trained share − data "
        "share) / data share. Both protocols stop at the first outer update that brings the "
        "state to at least the target of local steps, so async may overshoot it a little.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, generated: str) -> None:
    """This bench's section of the results page (see `_common.write_section`)."""
    _common.write_section(path, generated, SECTION_BEGIN, SECTION_END, NOTES_MARKER)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="nano", help="model preset of the built-in run")
    p.add_argument("-H", "--inner-steps", type=int, default=50, help="H, the fastest peer's steps")
    p.add_argument("--total-steps", type=int, default=1000,
                   help="applied local steps to train to, both protocols")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="sync+async pairs; medians if > 1")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--heterogeneity", default="very")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per demo run")
    p.add_argument("--json", type=Path, help="also write the result document here")
    p.add_argument("--markdown", type=Path, help="write this bench's section of this page")
    a = p.parse_args()
    if a.repeats < 1 or a.inner_steps < 1 or a.total_steps < 1 or a.peers < 2:
        p.error("--repeats, -H and --total-steps must be >= 1, --peers >= 2")

    t0 = time.time()
    runs: list[dict[str, Any]] = []
    for repeat in range(a.repeats):
        for protocol in PROTOCOLS:  # alternate, so slow drift of the machine hits both alike
            print(f"[bench] repeat {repeat} {protocol} ...", file=sys.stderr, flush=True)
            row: dict[str, Any] = {"repeat": repeat, "protocol": protocol, "ok": False,
                                   "loadavg_before": os.getloadavg()}  # fmt: skip
            t_run = time.time()
            try:
                demo = run_demo(protocol, a)
            except RunFailed as e:
                row |= {"error": str(e), "bench_s": time.time() - t_run,
                        "loadavg_after": os.getloadavg()}  # fmt: skip
                runs.append(row)
                print(f"[bench]   failed: {e}", file=sys.stderr, flush=True)
                continue
            m = metrics(demo)
            names = [x["name"] for x in demo["peers"]]
            bad_exit = [x["name"] for x in demo["peers"] if x.get("exit_code") != 0]
            error = None
            if not demo.get("hashes_agree"):
                error = f"state hashes disagree at version {demo.get('final_version')}"
            elif bad_exit:
                error = f"peers exited non-zero: {', '.join(bad_exit)}"
            row |= {
                "ok": error is None, "error": error, "bench_s": time.time() - t_run,
                "loadavg_after": os.getloadavg(),
                "logs": demo.get("logs"), "metrics": m,
                "rounds": round_digest(demo.get("logs"), names),
            }  # fmt: skip
            runs.append(row)
            print(f"[bench]   {'ok' if error is None else 'FAILED: ' + error} in "
                  f"{row['bench_s']:.0f} s: active {_f(m['active_max_s'])} s, ppl "
                  f"{_f(m['ppl_after'], 3)}, idle max {_pct(m['idle_max'])}",
                  file=sys.stderr, flush=True)  # fmt: skip

    summary = {proto: summarize([r for r in runs if r["protocol"] == proto]) for proto in PROTOCOLS}
    doc: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "bench_wall_s": round(time.time() - t0, 1),
        "machine": {"cpus": _cpus(), "network": "loopback (127.0.0.1)"},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "runs": runs,
        "summary": summary,
        "checks": checks(summary["sync"], summary["async"]),
    }
    print(report(doc), file=sys.stderr, flush=True)
    print(json.dumps(doc, sort_keys=True))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if a.markdown:
        write_section(a.markdown, render(doc))
    return 0 if all(r["ok"] for r in runs) else 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
