"""5 honest peers + 1 attacker, once per attack of issue 16, against the honest peers alone.

Every run starts real `diloco-peer join` processes on 127.0.0.1: a founder and four more honest
peers (nano, H steps per round, sync, until --versions; the joiners pass the founder's id as
`--owner`), plus one peer with the attacker's key on shard 5, started with `--chaos MODE`
(peer/chaos.py; what it does: peer/hostile.py). Two baselines are measured in the same call:
the 5 honest peers alone, and the 5 plus the attacker's key running the honest binary. The
honest peers have the same keys and pinned shards in every run, so an attack that changed
nothing the honest peers computed leaves their final model bit for bit the baseline's (equal
held-out ppl to the last digit): the 5-peer baseline where the attacker's δ was kept out of
every average, the 6-peer one where it took part honestly (heads, manifests, floods).

Per run, over the honest peers:

- `finished`, final versions, final ppl (median) and whether it is a baseline's, bit for bit;
- `one_branch` (local_swarm.branches) and whether their final state hashes agree;
- `honest_banned` / `honest_excluded`: honest peers any honest peer banned / excluded;
- `adopted_forged`: honest peers that ever held a state the attacker forged (the hashes its
  stderr names: "chaos: forged state vN HASH");
- `crashed`: honest peers that exited with an error (an uncaught exception);
- `rounds_failed` (the most `round_failed` events of one honest peer) and `versions_short`
  (--versions minus the lowest final version): rounds lost;
- where it was caught: the honest peers' `excluded` reasons for the attacker, and the lines of
  their stderr that refuse something from it (a replay, a state download);
- `framed` / `framed_banned` (`--chaos frame`): whom the attacker, as a leader, listed in its
  groups ("chaos: framed PEER" in its stderr), and how many of them any honest peer banned.

    python bench/hostile_swarm.py --versions 4 --markdown docs/results.md
    python bench/hostile_swarm.py --modes hijack,steer --versions 4

One JSON document on stdout (and in --json FILE); exit 1 if a run failed to finish.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from _common import write_section

from diloco_peer.identity import Identity
from diloco_peer.local_swarm import LocalSwarm, branches
from diloco_peer.peer.events import read_log

HONEST = 5
ATTACKER_SHARD = 5
STAYS = ("--until-version", "1000000")
"""For an attacker that must keep serving its forgery after the honest peers' last version."""
ATTACKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hijack": ("hijack", STAYS),
    "hijack-leave": ("hijack", ()),
    "hijack-lone": ("hijack-lone", ()),
    "hijack-lone=1000": ("hijack-lone=1000", ()),
    "steer": ("steer", ()),
    "silent": ("silent", ()),
    "equivocate": ("equivocate", ()),
    "poison-heads": ("poison-heads", ()),
    "rival-manifest": ("rival-manifest", ()),
    "flood": ("flood", ()),
    "frame": ("frame", ()),
    "bias": ("bias", ()),
}
"""Label -> (`--chaos` value, extra flags of the attacker)."""
SECTION_BEGIN = "<!-- begin: bench/hostile_swarm.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/hostile_swarm.py -->"
NOTES_MARKER = "<!-- notes: kept by the bench -->"
_FORGED = re.compile(r"chaos: forged state v(\d+) ([0-9a-f]{64})")
_FRAMED = re.compile(r"chaos: framed (\S+) \(([^;]+); listed with ([^)]*)\)")


def _events(logs: list[Path], kind: str) -> list[dict[str, Any]]:
    return [e for log in logs for e in read_log(log) if e["event"] == kind]


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _peer_id(log: Path) -> str | None:
    return next((e["peer"] for e in read_log(log) if e["event"] == "start"), None)


def run_once(
    label: str, args: argparse.Namespace, folder: Path, keys: list[Path], attacker_key: Path
) -> dict[str, Any]:
    """One run: `label` is "baseline-5", "baseline-6" (the attacker's key, honest binary) or
    a key of ATTACKS."""
    folder.mkdir(parents=True)
    chaos, extra = ATTACKS.get(label, ("", ()))
    sixth = label != "baseline-5"
    join_args = ["--host", "127.0.0.1", "--quiet", "--threads", "1",
                 "--until-version", str(args.versions)]  # fmt: skip
    attacker_args = ["--identity", str(attacker_key), "--shard", str(ATTACKER_SHARD)]
    if chaos:
        attacker_args += ["--chaos", chaos, *extra]
    t0 = time.time()
    with LocalSwarm(folder, run="hostile", join_args=join_args) as peers:
        pinned = [["--identity", str(keys[i]), "--shard", str(i)] for i in range(HONEST)]
        founder_proc, founder = peers.start(
            "honest0", "--model", "nano", "--inner-steps", str(args.inner_steps),
            "--expected-peers", str(HONEST + sixth), *pinned[0],
        )  # fmt: skip
        address = peers.address(founder, 120, proc=founder_proc, ip="127.0.0.1")
        owner = ["--owner", str(_peer_id(founder))]
        swarm = ["--swarm", address]
        attacker = None
        if sixth and chaos == "rival-manifest":  # its manifest is in the DHT before they join
            attacker_proc, attacker = peers.start("attacker", *swarm, *attacker_args)
            swarm = ["--swarm", peers.address(attacker, 120, proc=attacker_proc,
                                              ip="127.0.0.1"), *swarm]  # fmt: skip
        joiners = [peers.start(f"honest{i}", *swarm, *owner, *pinned[i]) for i in range(1, HONEST)]
        logs = [founder] + [log for _, log in joiners]
        honest = [founder_proc] + [proc for proc, _ in joiners]
        if sixth and attacker is None:
            attacker = peers.start("attacker", *swarm, *owner, *attacker_args)[1]
        deadline = time.time() + args.timeout_s
        while time.time() < deadline and any(p.poll() is None for p in honest):
            time.sleep(1.0)
        finished = all(p.poll() is not None for p in honest)
        exit_codes = [p.returncode for p in honest]  # before close() kills what is left
    return measure(label, folder, logs, attacker, finished=finished, wall_s=time.time() - t0,
                   versions=args.versions, exit_codes=exit_codes)  # fmt: skip


def measure(
    label: str,
    folder: Path,
    logs: list[Path],
    attacker: Path | None,
    *,
    finished: bool,
    wall_s: float,
    versions: int,
    exit_codes: list[int | None],
) -> dict[str, Any]:
    """What one run's logs say (see the module docstring)."""
    ids = [_peer_id(log) for log in logs]
    attacker_id = _peer_id(attacker) if attacker is not None else None
    stops = [next((e for e in read_log(log) if e["event"] == "stop"), None) for log in logs]
    starts = [next((e for e in read_log(log) if e["event"] == "start"), None) for log in logs]
    excluded = _events(logs, "excluded")
    attacker_err = _text(attacker.with_suffix(".err")) if attacker is not None else ""
    forged = {m[2] for m in _FORGED.finditer(attacker_err)}
    framed = [(m[1], m[2], m[3]) for m in _FRAMED.finditer(attacker_err)]
    held = {
        (log, e.get("state_hash"))
        for log in logs
        for e in read_log(log)
        if e["event"] in ("round", "catch_up", "stop")
    }
    refusals: list[str] = []
    if attacker_id is not None:
        tag = attacker_id[-6:]
        for log in logs:
            text = _text(log.with_suffix(".err"))
            refusals += [line.split(": ", 1)[-1][:160] for line in text.splitlines()
                         if tag in line and ("replay from" in line or "state from" in line)]  # fmt: skip
    failed = [sum(1 for e in read_log(log) if e["event"] == "round_failed") for log in logs]
    ppls = [s["ppl"] for s in stops if s and s.get("ppl") is not None]
    finals = [s["version"] if s else None for s in stops]
    return {
        "mode": label,
        "finished": finished and all(stops),
        "wall_s": round(wall_s, 1),
        "final_versions": finals,
        "final_ppl": statistics.median(ppls) if ppls else None,
        "hashes_agree": len({s["state_hash"] for s in stops if s}) == 1,
        "one_branch": branches(*logs).one_branch,
        "honest_finite": all(s and s.get("finite") for s in stops),
        "manifests": len({s["manifest"] for s in starts if s}),
        "honest_banned": len(
            {e["excluded_peer"] for e in excluded if e.get("banned") and e["excluded_peer"] in ids}
        ),
        "honest_excluded": len({e["excluded_peer"] for e in excluded if e["excluded_peer"] in ids}),
        "attacker_excluded": sorted(
            {e["reason"][:120] for e in excluded if e["excluded_peer"] == attacker_id}
        ),
        "attacker_in_an_average": any(
            attacker_id in r.get("members", []) for r in _events(logs, "round")
        )
        if attacker_id
        else None,
        "refusals": sorted(set(refusals))[:6],
        "forged_states": sorted(forged),
        "framed": [f"{peer[-6:]} ({how}, {what})" for peer, how, what in framed],
        "framed_banned": len(
            {e["excluded_peer"] for e in excluded if e.get("banned")}
            & {peer for peer, _, _ in framed}
        ),
        "adopted_forged": len({log for log, h in held if h in forged}),
        "crashed": sum(1 for code in exit_codes if code not in (0, None)),
        "rounds_failed": max(failed) if failed else None,
        "versions_short": versions - min((v for v in finals if v is not None), default=0),
    }


def markdown(doc: dict[str, Any]) -> str:
    b5, b6 = doc["baseline_ppl"], doc["baseline6_ppl"]
    lines = [
        "## Attacks of issue 16 (bench/hostile_swarm.py)",
        "",
        f"`{doc['command']}` ({doc['wall_s']:.0f} s in all): {HONEST} honest peers (nano, "
        f"H = {doc['inner_steps']}, sync, {doc['versions']} versions) plus one attacker (its "
        f"own key, shard {ATTACKER_SHARD}) started with `--chaos MODE`, against two baselines "
        f"measured in the same call: the {HONEST} honest peers alone (final ppl {b5}) and with "
        f"the attacker's key running the honest binary (final ppl {b6}). Bit for bit: the "
        "honest peers' final ppl equals a baseline's to the last digit.",
        "",
        "| attack | finished | final versions | final ppl | vs 5-peer baseline | bit for bit "
        "| hashes agree | honest crashed | honest banned | honest excluded | honest that held a forged state "
        "| rounds failed (most of one peer) | versions short | attacker excluded (reasons) "
        "| refusals in honest logs | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        ppl = r["final_ppl"]
        ratio = f"{ppl / b5:.4g}" if ppl and b5 else "-"
        same = [
            name for name, b in (("5-peer", b5), ("6-peer", b6)) if ppl is not None and ppl == b
        ]
        lines.append(
            f"| {r['mode']} | {r['finished']} | {r['final_versions']} | "
            f"{'-' if ppl is None else f'{ppl:.6g}'} | {ratio} | {', '.join(same) or 'no'} | "
            f"{r['hashes_agree']} | {r['crashed']} | {r['honest_banned']} | {r['honest_excluded']} | "
            f"{r['adopted_forged'] if r['forged_states'] else '-'} | {r['rounds_failed']} | "
            f"{r['versions_short']} | {'; '.join(r['attacker_excluded']) or '-'} | "
            f"{'; '.join(r['refusals']) or '-'} | {r['wall_s']} |"
        )
    for r in doc["runs"]:
        if r.get("framed"):
            lines += ["", f"{r['mode']}: the attacker framed {len(r['framed'])} times: "
                      f"{'; '.join(r['framed'])}; framed peers banned by an honest peer: "
                      f"{r['framed_banned']}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    _common.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(ATTACKS),
                        help=f"comma-separated, of: {', '.join(ATTACKS)}")  # fmt: skip
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--no-baselines", action="store_true", help="attacks only (no ratios)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="write the runs' logs here (a new folder)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in ATTACKS]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(ATTACKS)}")
    labels = ([] if args.no_baselines else ["baseline-5", "baseline-6"]) + modes
    runs = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        keys = [Path(tmp) / f"honest{i}.key" for i in range(HONEST)]
        for key in [*keys, Path(tmp) / "attacker.key"]:
            Identity.generate().save(key)
        for i, label in enumerate(labels):
            r = run_once(label, args, Path(tmp) / f"run{i}", keys, Path(tmp) / "attacker.key")
            print(json.dumps(r), file=sys.stderr, flush=True)
            runs.append(r)
    base = {r["mode"]: r["final_ppl"] for r in runs if r["mode"].startswith("baseline")}
    doc = {
        "command": "python bench/hostile_swarm.py " + " ".join(sys.argv[1:]),
        "versions": args.versions, "inner_steps": args.inner_steps,
        "baseline_ppl": base.get("baseline-5"), "baseline6_ppl": base.get("baseline-6"),
        "wall_s": round(time.time() - t0, 1), "runs": runs,
    }  # fmt: skip
    print(json.dumps(doc, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        write_section(args.markdown, markdown(doc), SECTION_BEGIN, SECTION_END, NOTES_MARKER)
    return 0 if all(r["finished"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
