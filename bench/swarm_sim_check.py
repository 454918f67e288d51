"""Does the protocol simulator predict a real swarm? (issue 19: `simulate-swarm` checked against
real processes.)

For each group size in --group-sizes: N real `join` processes on 127.0.0.1 (nano, --protocol,
H = --inner-steps, one torch thread each) run for --minutes; their event logs give versions per
minute (between the first and the last version's first commit), the mean group size, the rounds
whose group gave its version up to another group, forks (a version committed under two state
hashes), and each peer's measured speed. The simulator then runs the same swarm: N peers, the
same protocol, H and group size, every device at the measured median seconds per step, θ at the
run's size, links as fast as loopback, and three fixed costs from the first group size's real
run (the calibration): per group all-reduce, which each stage of a two-stage round pays
(`round_overhead_s`: its round events' median `matchmaking_s` plus median `allreduce_s`); per
applied version and peer (`apply_s`: the rest of a peer's median cycle from one applied version
to the next besides the phase: reading heads, signing, sealing, evaluation); and before a two-stage update's other members can replay
it (`commit_s`: its median time from an update in hand to the head showing it). The other sizes
are predictions.

    python bench/swarm_sim_check.py --peers 8 --group-sizes 8,4 --minutes 4 \\
        --markdown docs/results.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from _common import publish  # noqa: E402

from diloco_peer.config import default_run  # noqa: E402
from diloco_peer.coordinator_free.manifest import dump_run_config  # noqa: E402
from diloco_peer.local_swarm import LocalSwarm  # noqa: E402
from diloco_peer.peer.events import read_log  # noqa: E402
from diloco_peer.swarm_sim.engine import simulate_swarm  # noqa: E402
from diloco_peer.swarm_sim.spec import SwarmSimSpec  # noqa: E402

BEGIN = "<!-- begin: bench/swarm_sim_check.py -->"
END = "<!-- end: bench/swarm_sim_check.py -->"
NOTES = "<!-- swarm_sim_check notes: kept when the bench rewrites this section -->"
STAGES = ("matchmaking_s", "allreduce_s", "seals_s", "combine_matchmaking_s",
          "combine_allreduce_s", "combine_s", "replay_wait_s", "commit_s", "settle_s")  # fmt: skip
"""The round event's stage timings (peer/round.py `Round.applied`)."""


def real_run(a: argparse.Namespace, group_size: int, folder: Path) -> dict[str, Any]:
    """N peers for a.minutes; what their logs say."""
    import dataclasses

    run, swarm = default_run("nano", a.protocol)
    run = dataclasses.replace(run, inner_steps=a.inner_steps, warmup_steps=5)
    swarm = dataclasses.replace(swarm, group_size=group_size, expected_peers=a.peers)
    config = folder / "run.toml"
    config.write_text(dump_run_config(run, swarm), encoding="utf-8")
    t0 = time.time()
    with LocalSwarm(folder, run="scale", stop_grace_s=20.0) as ls:
        founder, flog = ls.start("p00", "--config", str(config))
        maddr = ls.address(flog, 120, proc=founder)
        for i in range(1, a.peers):
            ls.start(f"p{i:02d}", "--swarm", maddr)
        time.sleep(a.minutes * 60)
    wall = time.time() - t0
    return digest([read_log(folder / f"p{i:02d}.jsonl") for i in range(a.peers)], wall)


def kept_run(folder: Path, group_size: int, peers: int) -> dict[str, Any]:
    """The digest of a real run whose logs --keep left in `folder`/g<size>-*."""
    found = sorted(folder.glob(f"g{group_size}-*"))
    if len(found) != 1:
        raise SystemExit(f"{folder}: expected one g{group_size}-* folder, found {len(found)}")
    logs = [read_log(found[0] / f"p{i:02d}.jsonl") for i in range(peers)]
    times = [ev["time"] for log in logs for ev in log]
    return digest(logs, max(times) - min(times) if times else 0.0)


def digest(logs: list[list[dict[str, Any]]], wall: float) -> dict[str, Any]:
    first: dict[int, float] = {}
    hashes: dict[int, set[str]] = {}
    sizes, speeds, rivals, failed, catch_ups, dropped = [], [], 0, 0, [], 0
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    reasons: dict[str, int] = {}
    held: dict[int, int] = {}  # version -> the δs it holds (its largest round event's group)
    cycles: list[float] = []  # a peer's seconds from one applied version to its next
    for log in logs:
        last = None
        for ev in log:
            if ev.get("event") == "round":
                v = int(ev["version"])
                first[v] = min(first.get(v, ev["time"]), ev["time"])
                held[v] = max(held.get(v, 0), int(ev["group_size"]))
                if last is not None:
                    cycles.append(ev["time"] - last)
                last = ev["time"]
                hashes.setdefault(v, set()).add(ev["state_hash"])
                sizes.append(ev["group_size"])
                for name, seen in stages.items():
                    if isinstance(ev.get(name), (int, float)):
                        seen.append(float(ev[name]))
                if ev.get("speed"):
                    speeds.append(float(ev["speed"]))
            elif ev.get("event") == "catch_up":
                catch_ups.append(float(ev.get("seconds") or 0.0))
            elif ev.get("event") == "dropped":
                dropped += 1
            elif ev.get("event") == "round_failed":
                failed += 1
                reason = str(ev.get("reason"))  # a rival's claim, or heads past our base
                rivals += "committed this version first" in reason or "moved past" in reason
                why = str(ev.get("reason"))[:60]
                reasons[why] = reasons.get(why, 0) + 1
    versions = sorted(first)
    span = first[versions[-1]] - first[versions[0]] if len(versions) > 1 else 0.0
    return {
        "wall_s": wall, "versions": len(versions),
        "versions_per_min": (len(versions) - 1) / span * 60 if span > 0 else None,
        # δs applied per minute: a version of one peer's δ counts 1, one of all 16 counts 16
        "deltas_per_min": sum(held[v] for v in versions[1:]) / span * 60 if span > 0 else None,
        "median_cycle_s": statistics.median(cycles) if cycles else None,
        "round_s": span / (len(versions) - 1) if span > 0 else None,
        "mean_group_size": statistics.fmean(sizes) if sizes else None,
        "rival_rounds": rivals, "failed_rounds": failed, "kept_because": reasons,
        "dropped": dropped,
        # δs applied over δs applied or kept (a kept δ goes into a later round, merged)
        "applied_fraction": len(sizes) / (len(sizes) + failed) if sizes else None,
        "forks": sum(len(h) > 1 for h in hashes.values()),
        "median_speed": statistics.median(speeds) if speeds else None,
        "catch_ups": len(catch_ups),
        "median_catch_up_s": statistics.median(catch_ups) if catch_ups else None,
        # each stage's median over the round events that have it (delegates: combine_s;
        # the other members of a two-stage group: replay_wait_s)
        "stages": {name: statistics.median(seen) if seen else None
                   for name, seen in stages.items()},
    }  # fmt: skip


def model_mb() -> float:
    from diloco_peer.peer.data import build_dataset
    from diloco_peer.peer.model import build_model

    run, _ = default_run("nano", "sync")
    data = build_dataset(run.data, run.tokenizer, run.seq_len, 8, 200_000, run.seed)
    model = build_model("nano", data.vocab_size, 0, max_seq_len=run.seq_len)
    return 4 * sum(p.numel() for p in model.parameters()) / 1e6


def predict(a: argparse.Namespace, group_size: int, real: dict[str, Any], overhead: float,
            apply_s: float, commit_s: float, mb: float, step_s: float,
            catch_up_s: float) -> dict[str, Any]:  # fmt: skip
    spec = SwarmSimSpec(
        peers=a.peers, protocol=a.protocol, group_size=group_size, inner_steps=a.inner_steps,
        step_s=step_s, heterogeneity="none", model_mb=mb, bandwidth_mbit=10_000.0,
        latency_s=0.001, round_overhead_s=overhead, apply_s=apply_s, commit_s=commit_s, hours=real["wall_s"] / 3600,
        outer_buffers=2 if a.protocol == "async" else 1, dht_delay_s=a.dht_delay_s,
        catch_up_s=catch_up_s,
        # the swarm combines groups in two stages once it is larger than one group
        hierarchy="two-stage" if group_size < a.peers else "none",
    )  # fmt: skip
    doc = simulate_swarm(spec)
    rounds = doc["versions"]
    return {
        "versions_per_min": doc["versions_per_hour_steady"] / 60,
        "deltas_per_min": doc["versions_per_hour_steady"] / 60 * doc["group_size"]["mean"],
        "mean_group_size": doc["group_size"]["mean"],
        "rival_groups": doc["groups"]["gave_up_to_a_rival"], "forks": doc["forks"],
        "rival_rounds": doc["kept"].get("rival", 0) + doc["kept"].get("moved past", 0),
        "applied_fraction": doc["applied_fraction"], "versions": rounds,
    }  # fmt: skip


def render(doc: dict[str, Any]) -> str:
    lines = [
        "## The protocol simulator against a real swarm (bench/swarm_sim_check.py)",
        "",
        f"`{doc['command']}`: {doc['peers']} real peers on 127.0.0.1 (nano, {doc['protocol']}, "
        f"H {doc['inner_steps']}, one thread each, {doc['minutes']} min per group size), then "
        "`simulate-swarm` with each run's measured median step time (the device: "
        f"{doc['step_s']:.3f} s in the calibration run), a "
        f"cost of {doc['overhead_s']:.1f} s per group all-reduce (each stage pays it), "
        f"{doc.get('apply_s', 0.0):.1f} s per applied version and "
        f"{doc.get('commit_s', 0.0):.1f} s before a two-stage update can be replayed, "
        "calibrated on the first group size's run, "
        f"a catch-up's fixed cost of {doc['catch_up_s']:.1f} s (the real runs' median), "
        f"DHT delay {doc['dht_delay_s']} s, phase jitter 0.05. Versions and δs applied per minute "
        "between the first and the last version's commit, in both (a version one peer "
        "committed alone counts one δ); a real peer's median cycle from one applied version to "
        "the next.",
        "",
        "| group size | real versions/min | simulated | ratio | real δs applied/min "
        "| × first row | simulated | ratio | real cycle (s) | real mean group | simulated "
        "| δs applied: real | simulated | rounds given up to a rival: real | simulated "
        "| real forks | simulated forks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = doc["rows"][0]["real"].get("deltas_per_min")

    def num(x: float | None, digits: int = 2) -> str:
        return "—" if x is None else f"{x:.{digits}f}"

    def over(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    for row in doc["rows"]:
        r, s = row["real"], row["sim"]
        rd, sd = r.get("deltas_per_min"), s.get("deltas_per_min")
        lines.append(
            f"| {row['group_size']}{' (calibration)' if row['calibration'] else ''} "
            f"| {num(r['versions_per_min'])} | {num(s['versions_per_min'])} "
            f"| {num(over(s['versions_per_min'], r['versions_per_min']))} "
            f"| {num(rd, 1)} | {num(over(rd, base))} | {num(sd, 1)} | {num(over(sd, rd))} "
            f"| {num(r.get('median_cycle_s'), 1)} | {num(r['mean_group_size'])} "
            f"| {num(s['mean_group_size'])} | {num(r.get('applied_fraction'), 3)} "
            f"| {s['applied_fraction']:.3f} | {r['rival_rounds']} | {s['rival_rounds']} "
            f"| {r['forks']} | {s['forks']} |"
        )
    lines += [
        "",
        "Each stage's median in the real runs' round events (s): forming the group, its "
        "all-reduce; a delegate's reading of its members' stage-one seals, the combine's "
        "matchmaking and all-reduce, and all of its stage two; the other members' wait for the "
        "combined update; the applied update's sealing up to the head that shows it, and "
        "with the evaluation.",
        "",
        "| group size | " + " | ".join(STAGES) + " |",
        "|---|" + "---|" * len(STAGES),
    ]
    for row in doc["rows"]:
        got = row["real"].get("stages") or {}
        cells = ["—" if got.get(n) is None else f"{got[n]:.1f}" for n in STAGES]
        lines.append(f"| {row['group_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    _common.exit_on_sigterm()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--protocol", default="sync", choices=("sync", "async"))
    p.add_argument("--group-sizes", default="8,4", help="the first one calibrates")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--dht-delay-s", type=float, default=0.1, help="the simulator's, loopback")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--real-from", type=Path, help="take the real runs from this document")
    p.add_argument("--keep", type=Path, help="keep the real runs' logs in this folder")
    p.add_argument("--from-logs", type=Path, help="digest the real runs --keep left here")
    a = p.parse_args()
    sizes = [int(g) for g in a.group_sizes.split(",")]
    reals = {}
    if a.real_from:
        kept = json.loads(a.real_from.read_text())
        reals = {row["group_size"]: row["real"] for row in kept["rows"]}
    for g in sizes:
        if g in reals:
            continue
        if a.from_logs:  # the logs a run with --keep left
            reals[g] = kept_run(a.from_logs, g, a.peers)
            continue
        if a.keep:
            reals[g] = real_run(a, g, Path(tempfile.mkdtemp(prefix=f"g{g}-", dir=a.keep)))
        else:
            with tempfile.TemporaryDirectory(prefix="swarm-sim-check-") as folder:
                reals[g] = real_run(a, g, Path(folder))
        print(f"[bench] real, group size {g}: {json.dumps(reals[g])}", file=sys.stderr, flush=True)
    cal = reals[sizes[0]]
    step_s = 1 / cal["median_speed"]
    # a version's cost besides the phase: the group's (matchmaking, all-reduce: paid by each
    # stage) and the applied update's (sealing, evaluation: paid once, whatever the stages)
    stages = cal.get("stages") or {}
    # a peer's cycle from one applied version to the next (a version one peer committed alone
    # shortens the time between versions, not the cycle)
    cycle = cal.get("median_cycle_s") or cal["round_s"]
    if stages.get("matchmaking_s") is not None and stages.get("allreduce_s") is not None:
        overhead = stages["matchmaking_s"] + stages["allreduce_s"]
    else:  # a run from before the round events timed their stages: all of it per group
        overhead = max(0.0, cycle - a.inner_steps * step_s)
    apply_s = max(0.0, cycle - a.inner_steps * step_s - overhead)
    commit_s = stages.get("commit_s") or 0.0
    measured = [r["median_catch_up_s"] for r in reals.values() if r.get("median_catch_up_s")]
    catch_up_s = statistics.median(measured) if measured else 1.0
    mb = model_mb()
    rows = [{"group_size": g, "calibration": g == sizes[0], "real": reals[g],
             "sim": predict(a, g, reals[g], overhead, apply_s, commit_s, mb,
                            1 / reals[g]["median_speed"], catch_up_s)}
            for g in sizes]  # fmt: skip
    doc = {"command": "python bench/swarm_sim_check.py " + " ".join(sys.argv[1:]),
           "peers": a.peers, "protocol": a.protocol, "inner_steps": a.inner_steps,
           "minutes": a.minutes, "step_s": step_s, "overhead_s": overhead, "apply_s": apply_s, "commit_s": commit_s, "model_mb": mb,
           "dht_delay_s": a.dht_delay_s, "catch_up_s": catch_up_s,
           "rows": rows}  # fmt: skip
    publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)


if __name__ == "__main__":
    main()
