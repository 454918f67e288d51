"""Churn: peers crash at seeded random moments and come back; half the swarm is cut off once.

Needs root: every peer runs on a host of its own (`diloco_peer.netlab.NetLab`, one network
namespace each). A founder and N-1 peers (nano, --protocol, H = --inner-steps, a checkpoint
every --checkpoint-every versions, a fixed key and checkpoint folder each; --fragments P:
Streaming DiLoCo's fragments, whose flush adds P − 1 versions at the end) train until --versions.
Meanwhile --crashes crashes hit the peers other than the founder (the founder's address is
everyone's way in), one at a time, each when the swarm's version reaches its turn plus a seeded
delay, in three ways:

- `random`: SIGKILL at that moment, alternately of the main process alone (what a crash in
  native code or the out-of-memory killer does: the children live on) and of its whole process
  group (`kill -9 -PGID`);
- `in-group`: the victim's next incarnation is started with `--fault kill-in-group=1`, so it
  SIGKILLs its own main process right after its first group forms (during an all-reduce);
- `download`: the victim's next incarnation is killed (main process alone) 0.2-1.5 s after it
  starts, while it catches up (replays or downloads the state it missed).

Each victim is started again 2-10 s later (seeded) with the same key and checkpoint folder.
Once, half the swarm is cut off from the other half for --partition-s (`NetLab.partition`).

Reported (JSON on stdout and in --json; a table in --markdown):
- versions committed; restarts that rejoined (a `start` event) and seconds from restart to
  `start` and to the first round or catch-up;
- orphans: processes of a killed incarnation still running 5 s after its main process died,
  and any p2pd or peer process left when the bench ends (need 0);
- hangs: a running peer that wrote no event for --hang-s, or one that did not stop by the end;
- the longest gap between two consecutive versions' first commits, against the bound sync
  timeout + all-reduce timeout + one phase (the phase: the median compute time of a round);
- forks (a version with two state hashes) and the rounds each took to heal; whether the last
  incarnations' final hashes agree.

    python bench/churn.py --json churn.json --markdown docs/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common
from _common import write_section

from diloco_peer import procfs
from diloco_peer.config import default_run
from diloco_peer.coordinator_free.manifest import dump_run_config
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import LocalSwarm, kill_main
from diloco_peer.netlab import Host, NetLab
from diloco_peer.peer.events import read_log

PORT = 4100
SECTION_BEGIN = "<!-- begin: bench/churn.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/churn.py -->"
NOTES = "<!-- notes: kept by the bench -->"
ORPHAN_CHECK_S = 5.0


def say(message: str) -> None:
    print(f"[churn {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Incarnation:
    """One run of a peer's process."""

    peer: int
    name: str
    proc: Any
    log: Path
    started: float
    fault: str = ""
    kill_at: float | None = None
    """`download`: when to kill it, once its start event is seen."""
    crash: dict[str, Any] | None = None


@dataclasses.dataclass
class Churn:
    args: argparse.Namespace
    swarm: LocalSwarm
    hosts: list[Host]
    keys: list[Path]
    maddrs: list[str]
    config: Path
    folder: Path
    rng: random.Random
    lab: NetLab
    live: dict[int, Incarnation] = dataclasses.field(default_factory=dict)
    all: list[Incarnation] = dataclasses.field(default_factory=list)
    restarts: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    crashes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    orphan_checks: list[tuple[float, int, dict[str, Any]]] = dataclasses.field(default_factory=list)
    partition: dict[str, Any] = dataclasses.field(default_factory=dict)
    hangs: list[str] = dataclasses.field(default_factory=list)
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Incarnations that exited by themselves (not a planned crash): each is started again."""

    def start(self, peer: int, fault: str = "") -> Incarnation:
        n = sum(1 for inc in self.all if inc.peer == peer)
        name = f"peer{peer}" + (f"-{n}" if n else "")
        common = ["--host", self.hosts[peer].ip, "--port", str(PORT), "--identity",
                  str(self.keys[peer]), "--checkpoint-dir", str(self.folder / f"ckpt{peer}")]  # fmt: skip
        if peer == 0:
            extra = ["--config", str(self.config)]
        else:
            others = [m for i, m in enumerate(self.maddrs) if i != peer and i in self.live]
            extra = [a for m in others for a in ("--swarm", m)]
        if fault == "in-group":
            extra += ["--fault", "kill-in-group=1"]  # it SIGKILLs itself in its first group
        proc, log = self.swarm.start(name, *common, *extra, wrap=self.hosts[peer].argv([]))
        inc = Incarnation(peer, name, proc, log, time.time(), fault)
        self.live[peer] = inc
        self.all.append(inc)
        return inc

    def version(self) -> int:
        """The highest version any peer has committed."""
        return max((e["version"] for inc in self.all for e in read_log(inc.log)
                    if e["event"] == "round"), default=0)  # fmt: skip

    def crash(self, inc: Incarnation, how: str, trigger: str) -> None:
        now = time.time()
        if how == "main":
            kill_main(inc.proc)
        else:
            os.killpg(inc.proc.pid, signal.SIGKILL)
        self.record_crash(inc, how, trigger, now)

    def record_crash(self, inc: Incarnation, how: str, trigger: str, at: float) -> None:
        events = read_log(inc.log)
        crash = {"peer": inc.peer, "incarnation": inc.name, "how": how, "trigger": trigger,
                 "at": at, "version": self.version(),
                 "last_event": events[-1]["event"] if events else None}  # fmt: skip
        inc.crash = crash
        self.crashes.append(crash)
        del self.live[inc.peer]
        self.orphan_checks.append((at + ORPHAN_CHECK_S, inc.proc.pid, crash))
        delay = self.rng.uniform(2.0, 10.0)
        self.restarts.append((at + delay, inc.peer, ""))
        say(f"crash {len(self.crashes)}: {inc.name} ({how}, {trigger}) at v{crash['version']}; "
            f"restart in {delay:.1f} s")  # fmt: skip

    def check_orphans(self, now: float) -> None:
        """5 s after a crash: what of the killed incarnation's session still runs."""
        for item in [c for c in self.orphan_checks if c[0] <= now]:
            self.orphan_checks.remove(item)
            left = procfs.session_members(item[1])
            item[2]["orphans_after_5s"] = [" ".join(procfs.cmdline(p))[:80] for p in left]

    def check_hangs(self, now: float) -> None:
        for inc in self.live.values():
            try:
                last = max(inc.started, inc.log.stat().st_mtime)
            except OSError:
                last = inc.started
            if now - last > self.args.hang_s and inc.name not in self.hangs:
                self.hangs.append(inc.name)
                say(f"{inc.name} wrote no event for {now - last:.0f} s: a hang")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--crashes", type=int, default=20)
    p.add_argument("--versions", type=int, default=34)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", default="sync", choices=("sync", "async"),
                   help="async: Delayed Nesterov with DyLU (the gap bound stays the sync one)")  # fmt: skip
    p.add_argument("--group-size", type=int, default=0,
                   help="the swarm's group_size (0: the default); below --peers, versions are "
                   "averaged in two stages")  # fmt: skip
    p.add_argument("--mbit", type=float, default=100.0, help="every host's link, both ways")
    p.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="swarm.fragments (sync: Streaming DiLoCo's parts, one a version)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="versions between a peer's checkpoints (a crash loses what came after)",
    )
    p.add_argument("--partition-s", type=float, default=30.0, help="0: no partition")
    p.add_argument("--partition-at", type=int, default=0, help="version (0: a third of the way)")
    p.add_argument("--hang-s", type=float, default=180.0)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--folder", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    return p.parse_args()


def write_config(args: argparse.Namespace, folder: Path) -> tuple[Path, Any]:
    run, swarm = default_run("nano", args.protocol)
    run = dataclasses.replace(run, inner_steps=args.inner_steps)
    swarm = dataclasses.replace(swarm, expected_peers=args.peers, fragments=args.fragments,
                                checkpoint_every=args.checkpoint_every)  # fmt: skip
    if args.group_size:
        swarm = dataclasses.replace(swarm, group_size=args.group_size)
    path = folder / "run.toml"
    path.write_text(dump_run_config(run, swarm), encoding="utf-8")
    return path, swarm


def plan(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    """The crashes, in order. A `random` crash happens when the swarm reaches its version (spread
    over versions 3 .. versions-5) plus a seeded delay; an `in-group` or `download` crash hits
    the next incarnation of the previous random crash's victim. In blocks of five: random
    (main), random (group) then in-group (main), random (main or group, alternately by block)
    then download (group): half of them kill the main process alone, half the whole group."""
    shapes = []
    for k in range(args.crashes):
        block, slot = divmod(k, 5)
        shapes.append([("random", "main"), ("random", "group"), ("in-group", "main"),
                       ("random", "group" if block % 2 == 0 else "main"),
                       ("download", "group")][slot])  # fmt: skip
    randoms = sum(1 for t, _ in shapes if t == "random")
    first, last = 3, max(4, args.versions - 6)
    out, r = [], 0
    for trigger, how in shapes:
        crash: dict[str, Any] = {"trigger": trigger, "how": how}
        if trigger == "random":
            crash["version"] = first + (last - first) * r // max(1, randoms)
            crash["delay_s"] = rng.uniform(0.0, 5.0)
            r += 1
        out.append(crash)
    return out


def take(schedule: list[dict[str, Any]], trigger: str) -> dict[str, Any]:
    """Remove and return the first planned crash of this trigger (a fallback if none is left)."""
    for i, crash in enumerate(schedule):
        if crash["trigger"] == trigger:
            return schedule.pop(i)
    return {"trigger": trigger, "how": "main"}


def _rounds(inc: Incarnation) -> list[dict[str, Any]]:
    return [e for e in read_log(inc.log) if e["event"] == "round"]


def drive(churn: Churn, schedule: list[dict[str, Any]], part_at: int) -> bool:
    """Run the crashes, the restarts and the partition until the founder stops; whether it
    stopped by itself (it reached --versions)."""
    args = churn.args
    deadline = time.time() + args.timeout_s
    due: float | None = None
    part_end: float | None = None
    quiet_until = 0.0
    while time.time() < deadline:
        now = time.time()
        founder = churn.live[0]
        if founder.proc.poll() is not None:
            return founder.proc.returncode == 0
        version = churn.version()
        late = version >= args.versions - 3  # no more crashes or restarts: the run ends
        # the partition: once, half | half, then healed
        if args.partition_s and not churn.partition and version >= part_at:
            half = len(churn.hosts) // 2
            churn.lab.partition(churn.hosts[:half], churn.hosts[half:])
            churn.partition = {"at": now, "version": version,
                               "sides": [list(range(half)), list(range(half, len(churn.hosts)))]}  # fmt: skip
            part_end = now + args.partition_s
            say(f"partition at v{version}: peers {churn.partition['sides']}")
        if part_end is not None and now >= part_end:
            churn.lab.heal()
            churn.partition.update(healed=now, version_at_heal=version)
            part_end, quiet_until = None, now + 20.0
            say(f"healed at v{version}")
        # restarts whose time has come
        for item in [r for r in churn.restarts if r[0] <= now]:
            churn.restarts.remove(item)
            if not late:
                inc = churn.start(item[1], item[2])
                if item[2] == "download":
                    inc.kill_at = -1.0  # armed once its start event is seen
        # incarnations killed while they catch up, or dead by their own fault
        for inc in list(churn.live.values()):
            if inc.peer == 0:
                continue
            if inc.kill_at is not None and inc.proc.poll() is None:
                if inc.kill_at < 0 and any(e["event"] == "start" for e in read_log(inc.log)):
                    inc.kill_at = now + churn.rng.uniform(0.2, 1.5)
                elif 0 <= inc.kill_at <= now:
                    inc.kill_at = None
                    churn.crash(inc, take(schedule, "download")["how"], "download")
            elif inc.proc.poll() is not None:
                if inc.fault == "in-group" and inc.proc.returncode == -signal.SIGKILL:
                    churn.record_crash(inc, take(schedule, "in-group")["how"], "in-group", now)
                else:
                    say(f"{inc.name} exited with {inc.proc.returncode}")
                    del churn.live[inc.peer]
                    if inc.proc.returncode != 0:  # failed by itself: counted, started again
                        churn.failures.append({"incarnation": inc.name,
                                               "code": inc.proc.returncode})  # fmt: skip
                        churn.restarts.append((now + 5.0, inc.peer, inc.fault))
        # the next random crash
        crash = next((c for c in schedule if c["trigger"] == "random"), None)
        if crash is not None and not late and part_end is None and now >= quiet_until:
            if version >= crash["version"]:
                due = due or now + crash["delay_s"]
                victims = [inc for inc in churn.live.values() if inc.peer != 0 and not inc.fault
                           and inc.kill_at is None and inc.proc.poll() is None and _rounds(inc)]  # fmt: skip
                if now >= due and victims:
                    at = schedule.index(crash)
                    schedule.pop(at)
                    due = None
                    victim = churn.rng.choice(victims)
                    churn.crash(victim, crash["how"], "random")
                    follow = schedule[at]["trigger"] if at < len(schedule) else "random"
                    if follow != "random":  # its next incarnation crashes in its own way
                        at, peer, _ = churn.restarts[-1]
                        churn.restarts[-1] = (at, peer, follow)
        churn.check_orphans(now)
        churn.check_hangs(now)
        time.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- the report


def restarts_of(churn: Churn) -> list[dict[str, Any]]:
    out = []
    for inc in churn.all:
        if inc.name == f"peer{inc.peer}":
            continue  # a first start, not a restart
        events = read_log(inc.log)
        start = next((e["time"] for e in events if e["event"] == "start"), None)
        active = next((e["time"] for e in events if e["event"] in ("round", "catch_up")), None)
        out.append({
            "incarnation": inc.name, "fault": inc.fault, "rejoined": start is not None,
            "start_s": round(start - inc.started, 1) if start else None,
            "active_s": round(active - inc.started, 1) if active else None,
            "crashed": inc.crash is not None,
        })  # fmt: skip
    return out


def forks_of(logs: list[Path]) -> list[dict[str, Any]]:
    """Each version committed with two or more state hashes, and the versions until one hash
    held again (a later fork of its own does not count against this one's heal)."""
    hashes: dict[int, set[str]] = {}
    for log in logs:
        for e in read_log(log):
            if e["event"] == "round":
                hashes.setdefault(e["version"], set()).add(e["state_hash"])
    forks = []
    for version in sorted(v for v, h in hashes.items() if len(h) > 1):
        later = [v for v in sorted(hashes) if v > version]
        healed = next((v for v in later if len(hashes[v]) == 1), None)
        forks.append({"version": version, "hashes": len(hashes[version]),
                      "rounds_to_heal": healed - version if healed else None})  # fmt: skip
    return forks


def gaps_of(logs: list[Path]) -> tuple[float, float, list[float]]:
    """(longest gap between consecutive versions' first commits, median compute s of a round,
    gaps)."""
    first: dict[int, float] = {}
    compute = []
    for log in logs:
        spent = 0.0  # a round's compute_s counts from the incarnation's start: take differences
        for e in read_log(log):
            if e["event"] == "round":
                first[e["version"]] = min(first.get(e["version"], e["time"]), e["time"])
                compute.append((e.get("compute_s") or 0.0) - spent)
                spent = e.get("compute_s") or 0.0
    times = [first[v] for v in sorted(first)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps, default=0.0), statistics.median(compute) if compute else 0.0, gaps


def report(churn: Churn, finished: bool, settings: Any, wall_s: float, left: list[str]) -> dict:
    logs = [inc.log for inc in churn.all]
    restarts = restarts_of(churn)
    longest, phase_s, gaps = gaps_of(logs)
    bound = settings.sync_timeout_s + settings.allreduce_timeout_s + phase_s
    last = {}
    for inc in churn.all:
        stop = next((e for e in read_log(inc.log) if e["event"] == "stop"), None)
        if stop is not None:
            last[inc.peer] = (stop["version"], stop["state_hash"])
    forks = forks_of(logs)
    events = [e for log in logs for e in read_log(log)]
    members: dict[int, int] = {}  # version -> the δs it holds (its largest round event's group)
    for e in events:
        if e["event"] == "round":
            members[e["version"]] = max(members.get(e["version"], 0), e["group_size"])
    applied = sum(e["event"] == "round" for e in events)
    kept = sum(e["event"] == "round_failed" for e in events)
    orphans = sum(len(c.get("orphans_after_5s") or []) for c in churn.crashes)
    heal = churn.partition
    if heal.get("healed"):
        after = sorted({e["version"] for log in logs for e in read_log(log)
                        if e["event"] == "round" and e["time"] > heal["healed"]})  # fmt: skip
        heal["versions_after_heal"] = len(after)
    return {
        "peers": churn.args.peers, "seed": churn.args.seed, "inner_steps": churn.args.inner_steps,
        "protocol": churn.args.protocol,
        "finished": finished, "wall_s": round(wall_s, 1),
        "versions_committed": churn.version(),
        "crashes": len(churn.crashes),
        "crashes_by": {k: sum(1 for c in churn.crashes if f"{c['how']}/{c['trigger']}" == k)
                       for k in sorted({f"{c['how']}/{c['trigger']}" for c in churn.crashes})},
        "restarts": len(restarts), "rejoined": sum(r["rejoined"] for r in restarts),
        "rejoin_s": sorted(r["start_s"] for r in restarts if r["start_s"] is not None),
        "active_s": sorted(r["active_s"] for r in restarts if r["active_s"] is not None),
        "orphans_after_5s": orphans, "left_at_end": left, "failed_by_themselves": churn.failures,
        "hangs": churn.hangs,
        "longest_gap_s": round(longest, 1), "gap_bound_s": round(bound, 1),
        # between the first and the last version's first commit
        "versions_per_min": round(60 * len(gaps) / sum(gaps), 3) if sum(gaps) > 0 else None,
        # the δs the versions after the first hold, per minute of the same span: a version one
        # peer committed alone counts 1, one of every peer counts them all
        "deltas_per_min": round(60 * sum(n for v, n in members.items() if v > min(members))
                                / sum(gaps), 2) if sum(gaps) > 0 else None,  # fmt: skip
        "phase_compute_s": round(phase_s, 1),
        "forks": forks,
        "group_size": churn.args.group_size or settings.group_size,
        "members_per_version": {str(v): n for v, n in sorted(members.items())},
        "rounds_applied": applied, "rounds_kept": kept,
        "dropped": sum(e["event"] == "dropped" for e in events),
        # lone commits beside live peers, and why (`Round._alone`): where async forks start
        "alone": sorted((e["version"], e["reason"]) for e in events if e["event"] == "alone"),
        "kept_why": dict(Counter(e["reason"] for e in events if e["event"] == "round_failed")),
        "final": {str(p): v for p, v in sorted(last.items())},
        "final_hashes_agree": len({h for _, h in last.values()}) == 1 and len(last) > 0,
        "partition": heal,
        "crash_log": churn.crashes,
        "restart_log": restarts,
    }  # fmt: skip


def leftovers(churn: Churn) -> list[str]:
    """Processes of any incarnation, or daemons holding any of the bench's keys, still running."""
    pids = {p for inc in churn.all for p in procfs.session_members(inc.proc.pid)}
    for key in churn.keys:
        pids.update(procfs.daemons_with_identity(key.read_bytes()))
    return [" ".join(procfs.cmdline(p))[:80] for p in sorted(pids)]


def markdown(doc: dict[str, Any]) -> str:
    r = doc["rejoin_s"]
    a = doc["active_s"]
    heal = doc["partition"]
    rows = [
        ("versions committed; per minute; δs per minute", f"{doc['versions_committed']}; {doc.get('versions_per_min')}; {doc.get('deltas_per_min')}"),
        ("crashes (how/trigger)", f"{doc['crashes']}: " + ", ".join(f"{k} {v}" for k, v in doc["crashes_by"].items())),
        ("restarts that rejoined", f"{doc['rejoined']}/{doc['restarts']}"),
        ("seconds from restart to rejoined (start event): median / worst",
         f"{statistics.median(r):.1f} / {max(r):.1f}" if r else "-"),
        ("seconds from restart to first round or catch-up: median / worst",
         f"{statistics.median(a):.1f} / {max(a):.1f}" if a else "-"),
        ("orphaned processes 5 s after a crash; left at the end", f"{doc['orphans_after_5s']}; {len(doc['left_at_end'])}"),
        ("hangs; incarnations that exited by themselves", f"{len(doc['hangs'])}; {len(doc['failed_by_themselves'])}"),
        ("longest gap between commits (bound: sync + all-reduce timeout + one phase)",
         f"{doc['longest_gap_s']} s ({doc['gap_bound_s']} s)"),
        ("forks; most rounds to heal", f"{len(doc['forks'])}; "
         + str(max((f["rounds_to_heal"] or 99 for f in doc["forks"]), default=0))),
        ("partition", f"{heal.get('sides')} at v{heal.get('version')}, healed at v{heal.get('version_at_heal')}" if heal else "none"),
        ("final hashes agree", doc["final_hashes_agree"]),
    ]  # fmt: skip
    head = (f"Churn (`bench/churn.py`, seed {doc['seed']}): {doc['peers']} peers on netlab, nano, "
            f"{doc.get('protocol', 'sync')}, H = {doc['inner_steps']}, group size "
            f"{doc.get('group_size')}; {doc['wall_s']:.0f} s wall.\n\n")  # fmt: skip
    return head + "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def main() -> int:
    _common.exit_on_sigterm()
    args = parse()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="churn-"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    config, settings = write_config(args, folder)
    idents = [Identity.generate() for _ in range(args.peers)]
    keys = []
    for i, ident in enumerate(idents):
        keys.append(folder / f"peer{i}.key")
        keys[-1].write_bytes(ident.to_bytes())
        keys[-1].chmod(0o600)
    schedule = plan(args, rng)
    part_at = args.partition_at or max(3, args.versions // 3)
    t0 = time.time()
    join_args = ["--quiet", "--threads", "1", "--until-version", str(args.versions)]
    with NetLab() as lab, LocalSwarm(folder, run="churn", join_args=join_args) as swarm:
        hosts = [lab.add_host(up_mbit=args.mbit, down_mbit=args.mbit) for _ in range(args.peers)]
        maddrs = [f"/ip4/{h.ip}/tcp/{PORT}/p2p/{ident.peer_id_str}"
                  for h, ident in zip(hosts, idents, strict=True)]  # fmt: skip
        churn = Churn(args, swarm, hosts, keys, maddrs, config, folder, rng, lab)
        founder = churn.start(0)
        swarm.address(founder.log, 180, proc=founder.proc)
        for i in range(1, args.peers):
            churn.start(i)
        say(f"{args.peers} peers started; {len(schedule)} crashes planned; folder {folder}")
        finished = drive(churn, schedule, part_at)
        deadline = time.time() + 120
        while time.time() < deadline and any(i.proc.poll() is None for i in churn.live.values()):
            time.sleep(1.0)
        churn.hangs += [i.name for i in churn.live.values() if i.proc.poll() is None]
    time.sleep(ORPHAN_CHECK_S)
    doc = report(churn, finished, settings, time.time() - t0, leftovers(churn))
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    if args.markdown:
        write_section(args.markdown, markdown(doc), SECTION_BEGIN, SECTION_END, NOTES)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
