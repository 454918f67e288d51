"""Swarms larger than one group, in the protocol simulator (`diloco-peer simulate-swarm`, issue
19): today's protocol (one group per version) against the two-stage combination, from 16 to
1,000+ peers, with churn.

Per run: versions per hour, the share of finished phases that reach an applied update (applied
on the final head's chain / every phase whose fate is decided: applied, dropped as stale, lost
with a crashed peer), forks, groups that gave their version up to a rival group, failed groups,
bytes per peer per version (received, sent in all-reduces; × θ in fp32), the wait of a round
(phase end to round end) and compute utilization. Runs are independent processes (`--jobs`).

    python bench/swarm_scale.py --markdown docs/results.md
    python bench/swarm_scale.py --peers 1000 --protocols sync --settings two-stage:16 --hours 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import publish, write_section  # noqa: E402

from diloco_peer.swarm_sim.engine import simulate_swarm  # noqa: E402
from diloco_peer.swarm_sim.spec import SwarmSimSpec  # noqa: E402

BEGIN = "<!-- begin: bench/swarm_scale.py -->"
END = "<!-- end: bench/swarm_scale.py -->"
NOTES = "<!-- swarm_scale notes: kept when the bench rewrites this section -->"


def one(kw: dict[str, Any]) -> dict[str, Any]:
    t0 = time.time()
    doc = simulate_swarm(SwarmSimSpec(**kw))
    doc["wall_s"] = time.time() - t0
    print(f"[bench] {kw}: {doc['versions']} versions, applied {doc['applied_fraction']:.3f} "
          f"({doc['wall_s']:.0f}s)", file=sys.stderr, flush=True)  # fmt: skip
    return doc


def _f(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render(doc: dict[str, Any]) -> str:
    lines = [
        "## Beyond one group: the protocol simulator at scale (bench/swarm_scale.py)",
        "",
        f"`{doc['command']}`: {doc['hours']} virtual h per run, churn {doc['churn']} of the "
        "peers crashing per hour (as many joining), `simulate-swarm`'s defaults otherwise "
        "(H 50 at 1 s per step for the fastest device, slight heterogeneity, 80 MB θ, int8, "
        "100 Mbit links, DHT delay 1 s). *applied*: finished phases whose δ is in the final head's "
        "chain, over those applied, dropped as stale or lost with a crashed peer. *rival*: "
        "groups that gave their version up to another group's claim or to a state live peers "
        "moved to past their base (a lone commit others followed). Bytes per peer per version "
        "in θ's fp32 size.",
        "",
        "| peers | protocol | hierarchy | group | seed | versions/h | applied | dropped | lost "
        "| forks | rival | failed | recv × θ | sent × θ | wait s (mean / p90) | utilization "
        "| wall s |",
        "|" + "---|" * 17,
    ]
    for r in doc["runs"]:
        c, ph = r["config"], r["phases"]
        b, w = r["bytes_per_peer_version"], r["wait_s"]
        lines.append(
            f"| {c['peers']} | {c['protocol']} | {c['hierarchy']} | {c['group_size']} "
            f"| {c['seed']} | {r['versions_per_hour']:.1f} | {_f(r['applied_fraction'], 3)} "
            f"| {ph['dropped_stale']} | {ph['lost']} | {r['forks']} "
            f"| {r['groups']['gave_up_to_a_rival'] + r['groups'].get('gave_up_moved_past', 0)} "
            f"| {r['groups']['failed']} "
            f"| {_f(b['received_models'])} | {_f(b['sent_models'])} "
            f"| {_f(w['mean'], 1)} / {_f(w['p90'], 1)} | {_f(r['utilization'], 3)} "
            f"| {r['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", default="16,100,1000")
    p.add_argument("--protocols", default="sync,async")
    p.add_argument(
        "--settings", default="none:64,none:16,two-stage:16", help="HIERARCHY:GROUP_SIZE, ..."
    )
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--churn", type=float, default=0.3, help="share of peers crashing per hour")
    p.add_argument("--seeds", default="0")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the document here too")
    p.add_argument("--markdown", type=Path, help="write the section into this page")
    p.add_argument("--from-json", type=Path, help="run nothing: write --markdown from this")
    a = p.parse_args()
    if a.from_json:
        if a.markdown:
            write_section(
                a.markdown, render(json.loads(a.from_json.read_text())), BEGIN, END, NOTES
            )
        return
    runs = []
    for seed in map(int, a.seeds.split(",")):
        for n in map(int, a.peers.split(",")):
            for protocol in a.protocols.split(","):
                for setting in a.settings.split(","):
                    hierarchy, _, g = setting.partition(":")
                    if int(g) >= n and hierarchy != "none":
                        continue  # one group holds everyone: the same run as `none`
                    runs.append(dict(peers=n, protocol=protocol, hierarchy=hierarchy,
                                     group_size=int(g), hours=a.hours, churn_per_hour=a.churn,
                                     seed=seed))  # fmt: skip
    t0 = time.time()
    with ProcessPoolExecutor(a.jobs) as pool:
        docs = list(pool.map(one, runs))
    doc = {
        "command": "python bench/swarm_scale.py " + " ".join(sys.argv[1:]),
        "hours": a.hours, "churn": a.churn, "runs": docs, "wall_s": time.time() - t0,
    }  # fmt: skip
    publish(doc, a.json, a.markdown, render(doc), BEGIN, END, NOTES)


if __name__ == "__main__":
    main()
