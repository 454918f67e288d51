"""Does the protocol simulator predict a real swarm? (issue 19: `simulate-swarm` checked against
real processes.)

For each group size in --group-sizes: N real `join` processes on 127.0.0.1 (nano, --protocol,
H = --inner-steps, one torch thread each) run for --minutes; their event logs give versions per
minute (between the first and the last version's first commit), the mean group size, the rounds
whose group gave its version up to another group, forks (a version committed under two state
hashes), and each peer's measured speed. The simulator then runs the same swarm: N peers, the
same protocol, H and group size, every device at the measured median seconds per step, θ at the
run's size, links as fast as loopback, and a fixed cost per round (`round_overhead_s`) taken
from the first group size's real run (the calibration): its mean round time minus its phase and
the wait for the slowest peer. The other group sizes are predictions.

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
from _common import publish  # noqa: E402

from diloco_peer.config import default_run  # noqa: E402
from diloco_peer.coordinator_free.manifest import dump_run_config  # noqa: E402
from diloco_peer.local_swarm import LocalSwarm  # noqa: E402
from diloco_peer.peer.events import read_log  # noqa: E402
from diloco_peer.swarm_sim import SwarmSimSpec, simulate_swarm  # noqa: E402

BEGIN = "<!-- begin: bench/swarm_sim_check.py -->"
END = "<!-- end: bench/swarm_sim_check.py -->"
NOTES = "<!-- swarm_sim_check notes: kept when the bench rewrites this section -->"


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


def digest(logs: list[list[dict[str, Any]]], wall: float) -> dict[str, Any]:
    first: dict[int, float] = {}
    hashes: dict[int, set[str]] = {}
    sizes, speeds, rivals, failed, catch_ups, dropped = [], [], 0, 0, [], 0
    for log in logs:
        for ev in log:
            if ev.get("event") == "round":
                v = int(ev["version"])
                first[v] = min(first.get(v, ev["time"]), ev["time"])
                hashes.setdefault(v, set()).add(ev["state_hash"])
                sizes.append(ev["group_size"])
                if ev.get("speed"):
                    speeds.append(float(ev["speed"]))
            elif ev.get("event") == "catch_up":
                catch_ups.append(float(ev.get("seconds") or 0.0))
            elif ev.get("event") == "dropped":
                dropped += 1
            elif ev.get("event") == "round_failed":
                failed += 1
                rivals += "committed this version first" in str(ev.get("reason"))
    versions = sorted(first)
    span = first[versions[-1]] - first[versions[0]] if len(versions) > 1 else 0.0
    return {
        "wall_s": wall, "versions": len(versions),
        "versions_per_min": (len(versions) - 1) / span * 60 if span > 0 else None,
        "round_s": span / (len(versions) - 1) if span > 0 else None,
        "mean_group_size": statistics.fmean(sizes) if sizes else None,
        "rival_rounds": rivals, "failed_rounds": failed, "dropped": dropped,
        # δs applied over δs applied or kept (a kept δ goes into a later round, merged)
        "applied_fraction": len(sizes) / (len(sizes) + failed) if sizes else None,
        "forks": sum(len(h) > 1 for h in hashes.values()),
        "median_speed": statistics.median(speeds) if speeds else None,
        "catch_ups": len(catch_ups),
        "median_catch_up_s": statistics.median(catch_ups) if catch_ups else None,
    }  # fmt: skip


def model_mb() -> float:
    from diloco_peer.peer.data import build_dataset
    from diloco_peer.peer.model import build_model

    run, _ = default_run("nano", "sync")
    data = build_dataset(run.data, run.tokenizer, run.seq_len, 8, 200_000, run.seed)
    model = build_model("nano", data.vocab_size, 0, max_seq_len=run.seq_len)
    return 4 * sum(p.numel() for p in model.parameters()) / 1e6


def predict(a: argparse.Namespace, group_size: int, real: dict[str, Any], overhead: float,
            mb: float, step_s: float, catch_up_s: float) -> dict[str, Any]:  # fmt: skip
    spec = SwarmSimSpec(
        peers=a.peers, protocol=a.protocol, group_size=group_size, inner_steps=a.inner_steps,
        step_s=step_s, heterogeneity="none", model_mb=mb, bandwidth_mbit=10_000.0,
        latency_s=0.001, round_overhead_s=overhead, hours=real["wall_s"] / 3600,
        outer_buffers=2 if a.protocol == "async" else 1, dht_delay_s=a.dht_delay_s,
        catch_up_s=catch_up_s,
        # the swarm combines groups in two stages once it is larger than one group
        hierarchy="two-stage" if group_size < a.peers else "none",
    )  # fmt: skip
    doc = simulate_swarm(spec)
    rounds = doc["versions"]
    return {
        "versions_per_min": doc["versions_per_hour_steady"] / 60,
        "mean_group_size": doc["group_size"]["mean"],
        "rival_groups": doc["groups"]["gave_up_to_a_rival"], "forks": doc["forks"],
        "rival_rounds": doc["kept"].get("rival", 0),
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
        f"round cost of {doc['overhead_s']:.1f} s calibrated on the first group size's run, "
        f"a catch-up's fixed cost of {doc['catch_up_s']:.1f} s (the real runs' median), "
        f"DHT delay {doc['dht_delay_s']} s, phase jitter 0.05. Versions per minute between the "
        "first and the last version's commit, in both.",
        "",
        "| group size | real versions/min | × first row | simulated | ratio | real mean group "
        "| simulated | δs applied: real | simulated "
        "| rounds given up to a rival group: real | simulated | real forks | simulated forks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = doc["rows"][0]["real"]["versions_per_min"]
    for row in doc["rows"]:
        r, s = row["real"], row["sim"]
        ratio = s["versions_per_min"] / r["versions_per_min"] if r["versions_per_min"] else None
        own = r["versions_per_min"] / base if base and r["versions_per_min"] else None
        applied = r.get("applied_fraction")
        lines.append(
            f"| {row['group_size']}{' (calibration)' if row['calibration'] else ''} "
            f"| {r['versions_per_min']:.2f} | {'—' if own is None else f'{own:.2f}'} "
            f"| {s['versions_per_min']:.2f} "
            f"| {'—' if ratio is None else f'{ratio:.2f}'} | {r['mean_group_size']:.2f} "
            f"| {s['mean_group_size']:.2f} | {'—' if applied is None else f'{applied:.3f}'} "
            f"| {s['applied_fraction']:.3f} | {r['rival_rounds']} | {s['rival_rounds']} "
            f"| {r['forks']} | {s['forks']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
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
    a = p.parse_args()
    sizes = [int(g) for g in a.group_sizes.split(",")]
    reals = {}
    if a.real_from:
        kept = json.loads(a.real_from.read_text())
        reals = {row["group_size"]: row["real"] for row in kept["rows"]}
    for g in sizes:
        if g in reals:
            continue
        with tempfile.TemporaryDirectory(prefix="swarm-sim-check-") as folder:
            reals[g] = real_run(a, g, Path(folder))
        print(f"[bench] real, group size {g}: {json.dumps(reals[g])}", file=sys.stderr, flush=True)
    cal = reals[sizes[0]]
    step_s = 1 / cal["median_speed"]
    overhead = max(0.0, cal["round_s"] - a.inner_steps * step_s)
    measured = [r["median_catch_up_s"] for r in reals.values() if r.get("median_catch_up_s")]
    catch_up_s = statistics.median(measured) if measured else 1.0
    mb = model_mb()
    rows = [{"group_size": g, "calibration": g == sizes[0], "real": reals[g],
             "sim": predict(a, g, reals[g], overhead, mb, 1 / reals[g]["median_speed"],
                            catch_up_s)}
            for g in sizes]  # fmt: skip
    doc = {"command": "python bench/swarm_sim_check.py " + " ".join(sys.argv[1:]),
           "peers": a.peers, "protocol": a.protocol, "inner_steps": a.inner_steps,
           "minutes": a.minutes, "step_s": step_s, "overhead_s": overhead, "model_mb": mb,
           "dht_delay_s": a.dht_delay_s, "catch_up_s": catch_up_s,
           "rows": rows}  # fmt: skip
    publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)


if __name__ == "__main__":
    main()
