"""The swarm on an emulated wide-area network: all-reduce, joins, a swarm, compression (issue 6).

Needs root: every peer runs in a network namespace of `diloco_peer.netlab.NetLab`, on a veth link
shaped by `tc ... tbf` (no netem here: rate limits and their queues, no added latency or loss).
Four sections, each on a lab of its own (`--only` picks some):

- **allreduce**: 4 peers (bench/_wan_worker.py), each with our `GroupAverager` (fp32 on the wire)
  and hivemind's plain `DecentralizedAverager` on the same DHT and p2p daemon, over the same
  tensor (S bytes, one fp32 vector per peer, seeded). Per link rate (every host shaped to it in
  both directions, `NetLab.reshape`; "unshaped" is veth speed, where only the CPUs limit), both
  averagers run `--repeats` rounds, interleaved. The group's all-reduce time is the longest
  member's: ours from its group being formed to holding the average (`GroupResult.allreduce_s`),
  hivemind's around `_aggregate_with_group` (the same span: load balancing, the butterfly
  all-reduce, the in-place update). Effective throughput: in a butterfly all-reduce of S bytes in
  a group of n, each peer sends and receives 2(n-1)/n x S, so throughput = 2(n-1)/n x S / time;
  reported as a fraction of the link rate. Also per round: whole steps (matchmaking included),
  wire bytes, packets the token buckets dropped, the machine's CPU use and the peers' CPU
  seconds; for ours, its phases (parts in, reduce, answers back) and, in the JSON, when each
  part arrived and each answer came back on every member (one monotonic clock for all hosts).
- **join**: 3 donors (upload `--donor-mbit`) and a joiner (download `--joiner-down-mbit`) download
  a state blob of each `--join-mb` size: from 1 donor and from 3 (`download_state_multi`), and
  whole from 1 (`download_state`). Then the same with the joiner's download at the donors' rate
  (3 donors cannot beat 1 there: the joiner's link is the bottleneck), and a 3-donor download of
  the largest state during which one donor's whole process group is SIGKILLed once a third of
  the bytes are in. Every download is verified: sha256 of the bytes received equals the donors'
  advertised hash, and they load as safetensors.
- **swarm**: 4 `diloco-peer join` processes (nano, sync, H = `--inner-steps`, until
  `--versions`) on links of `--swarm-mbit`, once per `--swarm-compressions`. Each host's wire
  counters (IP bytes, both directions, everything: DHT, heads, state download, all-reduce) over
  the inner steps its peer did, against data-parallel training's all-reduce of fp32 gradients
  every step (ring: 2(n-1)/n x 4 x params bytes sent per step per peer); plus the all-reduce
  bytes the peers log.
- **quality**: `diloco-peer simulate --algo sync --workers 4 --model nano` with the same budget
  (`--sim-steps` local steps) for each compression: final held-out ppl and its ratio to none,
  and the bytes per value on the wire (`compression.encoded_size`).

    python bench/wan.py --markdown docs/results.md   # everything: ~11 min on 2 idle cores
    python bench/wan.py --only allreduce,join --quick

One JSON document on stdout (and in --json FILE), progress on stderr; --markdown rewrites this
bench's section of the results page, keeping the notes under its notes marker. Exit 1 if a
section crashed; a section whose peer stopped answering keeps the rounds before and says so, and
the peers' logs are then kept (their folder is in the JSON). Every process started is killed by
process group and every namespace deleted on the way out, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _common

from diloco_peer.errors import LocalPeerFailed
from diloco_peer.local_swarm import LocalSwarm, kill_session, spawn
from diloco_peer.netlab import Host, NetLab
from diloco_peer.peer.events import read_log

SECTIONS = ("allreduce", "join", "swarm", "quality")
COMPRESSIONS = ("none", "fp16", "int8", "int4")
REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().with_name("_wan_worker.py")
PY = sys.executable
SECTION_BEGIN = "<!-- begin: bench/wan.py (rewritten by the bench) -->"
SECTION_END = "<!-- end: bench/wan.py -->"
NOTES_MARKER = "<!-- wan notes: kept when the bench rewrites this section -->"
GROUP = 4

# Issue 6's acceptance thresholds.
THROUGHPUT_MIN = 0.7
"""All-reduce effective throughput at 100 Mbit, as a fraction of the link rate (median)."""
THROUGHPUT_RATE = 100.0
HIVEMIND_ALLREDUCE_TIMEOUT_S = 120.0
"""hivemind's `allreduce_timeout` (its default is none: a stalled round waits forever)."""
JOIN_SPEEDUP_MIN = 2.0
"""3 donors against 1, on shaped links."""

_T0 = time.time()


def say(message: str) -> None:
    print(f"[wan {time.time() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


class WorkerDied(RuntimeError):
    """A worker exited, or did not answer in time."""


class Procs:
    """Every process the bench starts, each in a session (process group) of its own
    (local_swarm.spawn), so that killing the session also kills what it forked (hivemind's DHT
    process, the p2p daemon)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def popen(self, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` from the repository, its stderr (and by default its stdout) to `log`."""
        proc = spawn(argv, stderr=log, cwd=REPO, **kwargs)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        while self.procs:
            kill_session(self.procs.pop())


class Worker:
    """A bench/_wan_worker.py process in one host, and a thread that reads its `@@` lines."""

    def __init__(self, procs: Procs, host: Host, log: Path, name: str, index: int) -> None:
        self.host, self.name, self.log, self.index = host, name, log, index
        self.proc = procs.popen(
            host.argv([PY, str(WORKER)]), log=log, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.peer = ""
        self.maddr = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101  (Popen with stdout=PIPE)
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))
        self.messages.put(None)

    def send(self, command: dict[str, Any]) -> None:
        try:
            assert self.proc.stdin is not None  # noqa: S101
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(f"{self.name}: {e}; {self.tail()}") from None

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            message = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerDied(f"{self.name}: no answer within {timeout_s:.0f} s") from None
        if message is None:
            self.messages.put(None)
            raise WorkerDied(f"{self.name} exited: {self.tail()}")
        return message

    def answer(self, timeout_s: float) -> dict[str, Any]:
        """The next answer that is not a progress line."""
        deadline = time.time() + timeout_s
        while True:
            message = self.recv(max(0.1, deadline - time.time()))
            if message.get("op") != "progress":
                return message

    def join(self, initial_peers: list[str], timeout_s: float, **fields: Any) -> None:
        self.send({"op": "join", "ip": self.host.ip, "initial_peers": initial_peers, **fields})
        self.take_ready(self.answer(timeout_s))

    def take_ready(self, ready: dict[str, Any]) -> None:
        if ready.get("op") != "ready":
            raise WorkerDied(f"{self.name}: expected ready, got {ready}")
        self.peer = ready["peer"]
        self.maddr = next(m for m in ready["maddrs"] if f"/{self.host.ip}/" in m)

    def tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])[-600:]


def ask_all(workers: list[Worker], command: dict[str, Any], timeout_s: float) -> list[dict]:
    """Send `command` to every worker at once; their answers, in order."""
    for w in workers:
        w.send(command)
    deadline = time.time() + timeout_s
    return [w.answer(max(1.0, deadline - time.time())) for w in workers]


@contextmanager
def lab_with(procs: Procs) -> Iterator[NetLab]:
    """A NetLab whose processes are all killed before its namespaces go."""
    lab = NetLab()
    try:
        yield lab
    finally:
        procs.kill_all()
        lab.close()


def start_workers(
    procs: Procs,
    hosts: list[Host],
    folder: Path,
    names: list[str],
    join: Callable[[int], dict],
    *,
    last_knows_all: bool = False,
) -> list[Worker]:
    """A worker per host, all started at once (imports overlap); the first founds the DHT, the
    others join it. With `last_knows_all`, the last one joins after the others, given all their
    addresses (its daemon then knows each of them, as a requester of their streams must)."""
    workers = [
        Worker(procs, h, folder / f"{n}.log", n, i)
        for i, (h, n) in enumerate(zip(hosts, names, strict=True))
    ]
    workers[0].join([], 180, **join(0))
    rest = workers[1:-1] if last_knows_all else workers[1:]
    for w in rest:
        w.send(
            {"op": "join", "ip": w.host.ip, "initial_peers": [workers[0].maddr], **join(w.index)}
        )
    for w in rest:
        w.take_ready(w.answer(180))
    if last_knows_all:
        workers[-1].join([w.maddr for w in workers[:-1]], 180, **join(len(workers) - 1))
    return workers


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat), for the busy fraction of a
    span: the whole machine's, whoever used it."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(before: tuple[int, int]) -> float | None:
    busy, total = cpu_times()
    return (busy - before[0]) / (total - before[1]) if total > before[1] else None


def group_cpu_s(pgids: set[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of these process groups:
    a worker, its DHT process, its p2p daemon, hivemind's averager process."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[2]) in pgids:  # fields: state, ppid, pgrp, ..., utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def mbit_label(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit"


# ---------------------------------------------------------------------- all-reduce


def section_allreduce(args: argparse.Namespace, procs: Procs, folder: Path) -> dict[str, Any]:
    numel = int(args.allreduce_mb * 1e6 / 4)
    size = numel * 4
    per_peer = 2 * (GROUP - 1) / GROUP * size  # bytes each peer sends (and receives)
    rates: list[float | None] = [None if r == 0 else r for r in args.rates]
    rounds: list[dict[str, Any]] = []
    aborted = None
    with lab_with(procs) as lab:
        hosts = [lab.add_host() for _ in range(GROUP)]
        say(f"allreduce: {GROUP} peers, {size / 1e6:.1f} MB each; starting workers")
        join = {"role": "allreduce", "numel": numel, "seeds": [1000 + i for i in range(GROUP)],
                "target_size": GROUP, "hivemind_matchmaking_s": args.hivemind_matchmaking_s,
                "allreduce_timeout_s": HIVEMIND_ALLREDUCE_TIMEOUT_S}  # fmt: skip
        workers = start_workers(
            procs, hosts, folder, [f"ar{i}" for i in range(GROUP)],
            lambda i: {**join, "rank": i},
        )  # fmt: skip
        counter = iter(range(10**6))
        pgids = {w.proc.pid for w in workers}  # each worker leads its own process group

        def one_round(kind: str, rate: float | None, repeat: int) -> dict[str, Any]:
            ideal_s = per_peer * 8 / (rate * 1e6) if rate else 1.0
            allreduce_timeout_s = max(60.0, 10 * ideal_s)
            if kind == "hivemind":  # fixed when its averager was built
                allreduce_timeout_s = HIVEMIND_ALLREDUCE_TIMEOUT_S
            if kind == "ours":
                command = {"op": "ours", "key": f"r{next(counter)}", "target_size": GROUP,
                           "matchmaking_timeout_s": args.matchmaking_s,
                           "allreduce_timeout_s": allreduce_timeout_s}  # fmt: skip
            else:
                command = {"op": "hivemind", "timeout_s": args.matchmaking_s}
            before = [(h.tx_bytes(), h.rx_bytes()) for h in hosts]
            drops = sum(sum(lab.drops(h)) for h in hosts)
            cpu, ours_cpu = cpu_times(), group_cpu_s(pgids)
            answers = ask_all(workers, command, args.matchmaking_s + allreduce_timeout_s + 60)
            busy, used_cpu_s = cpu_busy(cpu), group_cpu_s(pgids) - ours_cpu
            after = [(h.tx_bytes(), h.rx_bytes()) for h in hosts]
            traffic = list(zip(after, before, strict=True))
            ok = [a for a in answers if a.get("ok") and a.get("members") == GROUP]
            row: dict[str, Any] = {
                "kind": kind, "rate_mbit": rate, "repeat": repeat, "ok": len(ok) == GROUP,
                "cpu_busy": busy, "cpu_s": used_cpu_s,
                "tbf_drops": sum(sum(lab.drops(h)) for h in hosts) - drops,
                "errors": [a.get("error") for a in answers if not a.get("ok")],
                "wire_tx_per_peer": statistics.mean(a[0] - b[0] for a, b in traffic),
                "wire_rx_per_peer": statistics.mean(a[1] - b[1] for a, b in traffic),
            }  # fmt: skip
            if row["ok"]:
                allreduce = [a["allreduce_s"] for a in ok]
                row.update(
                    allreduce_s=max(allreduce),
                    allreduce_s_members=allreduce,
                    step_s=max(a["step_s"] for a in ok),
                    max_error=max(a["max_error"] for a in ok),
                    throughput_mbit=per_peer * 8 / max(allreduce) / 1e6,
                )
                row["fraction_of_link"] = row["throughput_mbit"] / rate if rate else None
                if kind == "ours":
                    row["same_bits"] = len({a["sha256"] for a in ok}) == 1
                    row["logged_sent_per_peer"] = statistics.mean(a["bytes_sent"] for a in ok)
                    row["matchmaking_s"] = max(a["matchmaking_s"] for a in ok)
                    for phase in ("parts_in_s", "reduce_s", "answers_s"):
                        if all(phase in a for a in ok):  # the slowest member's, per phase
                            row[phase] = max(a[phase] for a in ok)
                    row["members"] = [
                        {k: a[k] for k in ("allreduce_s", "parts_in_s", "reduce_s", "answers_s",
                                           "arrived_s", "answered_s", "started_at") if k in a}
                        for a in ok
                    ]  # fmt: skip
            frac = row.get("fraction_of_link")
            if "parts_in_s" in row:
                say(f"  phases (slowest member): parts in {row['parts_in_s']:.2f} s, reduce "
                    f"{row['reduce_s']:.2f} s, answers {row['answers_s']:.2f} s")  # fmt: skip
            say(
                f"allreduce {kind:8s} {mbit_label(rate):9s} #{repeat}: "
                + (
                    f"{row['allreduce_s']:.2f} s ({row['throughput_mbit']:.0f} Mbit/s"
                    + (f", {frac:.2f} of the link" if frac else "")
                    + f"), step {row['step_s']:.2f} s, max error {row['max_error']:.1e}, "
                    f"CPU busy {busy or 0:.0%}, the peers' processes used {used_cpu_s:.1f} CPU s, "
                    f"{row['tbf_drops']} packets dropped by the shaping"
                    if row["ok"]
                    else f"FAILED {row['errors']}"
                )
            )
            return row

        # a first round of each, unmeasured: connections between every pair, code paths warm
        for kind in ("ours", "hivemind"):
            one_round(kind, None, -1)
        try:
            for rate in rates:
                for i, host in enumerate(hosts):
                    hosts[i] = lab.reshape(host, up_mbit=rate, down_mbit=rate)
                time.sleep(1.0)
                for repeat in range(args.repeats):  # interleaved, so drift hits both alike
                    order = ("ours", "hivemind") if repeat % 2 == 0 else ("hivemind", "ours")
                    for kind in order:
                        rounds.append(one_round(kind, rate, repeat))
        except WorkerDied as e:  # a round that never ended: the rest cannot run, keep what ran
            aborted = f"{type(e).__name__}: {e}"[:1000]
            say(f"allreduce aborted: {aborted}")

    summary = []
    for rate in rates:
        row: dict[str, Any] = {"rate_mbit": rate}
        for kind in ("ours", "hivemind"):
            runs = [r for r in rounds if r["kind"] == kind and r["rate_mbit"] == rate]
            good = [r for r in runs if r["ok"]]
            row[kind] = {
                "rounds": len(runs),
                "failed": len(runs) - len(good),
                "allreduce_s": median([r["allreduce_s"] for r in good]),
                "throughput_mbit": median([r["throughput_mbit"] for r in good]),
                "fraction_of_link": median([r["fraction_of_link"] for r in good]) if rate else None,
                "fraction_range": [
                    min(r["fraction_of_link"] for r in good),
                    max(r["fraction_of_link"] for r in good),
                ]
                if rate and good
                else None,
                "step_s": median([r["step_s"] for r in good]),
                "wire_tx_per_peer": median([r["wire_tx_per_peer"] for r in good]),
                "cpu_busy": median([r["cpu_busy"] for r in good if r["cpu_busy"] is not None]),
                "cpu_s": median([r["cpu_s"] for r in good]),
                "tbf_drops": median([r["tbf_drops"] for r in good]),
                "max_error": max((r["max_error"] for r in good), default=None),
            }
            if kind == "ours":
                row[kind]["same_bits"] = all(r.get("same_bits") for r in good) and bool(good)
                row[kind]["logged_sent_per_peer"] = median(
                    [r["logged_sent_per_peer"] for r in good]
                )
                for phase in ("parts_in_s", "reduce_s", "answers_s"):
                    row[kind][phase] = median([r[phase] for r in good if phase in r])
        summary.append(row)
    at = next((r for r in summary if r["rate_mbit"] == THROUGHPUT_RATE), None)
    checks = {}
    if at is not None and at["ours"]["fraction_of_link"] is not None:
        ours, theirs = at["ours"]["fraction_of_link"], at["hivemind"]["fraction_of_link"]
        checks["throughput_at_100"] = {
            "ours": ours, "hivemind": theirs, "threshold": THROUGHPUT_MIN,
            "passes": ours >= THROUGHPUT_MIN,
        }  # fmt: skip
        checks["not_below_hivemind"] = {
            "ours": ours, "hivemind": theirs,
            "passes": theirs is None or ours >= theirs,
        }  # fmt: skip
    return {
        "tensor_bytes": size, "bytes_per_peer_ideal": per_peer, "group": GROUP,
        "summary": summary, "rounds": rounds, "checks": checks, "aborted": aborted,
    }  # fmt: skip


# ---------------------------------------------------------------------- join


def section_join(args: argparse.Namespace, procs: Procs, folder: Path) -> dict[str, Any]:
    up, down = args.donor_mbit, args.joiner_down_mbit
    rows: list[dict[str, Any]] = []
    aborted = None
    with lab_with(procs) as lab:
        hosts = [lab.add_host(up_mbit=up, down_mbit=up) for _ in range(3)]
        hosts.append(lab.add_host(up_mbit=up, down_mbit=down))
        say(f"join: 3 donors (up {up:g} Mbit) and a joiner (down {down:g} Mbit); starting")
        workers = start_workers(
            procs, hosts, folder, ["donor0", "donor1", "donor2", "joiner"],
            lambda i: {"role": "joiner" if i == 3 else "donor"}, last_knows_all=True,
        )  # fmt: skip
        donors, joiner = workers[:3], workers[3]
        ids = [d.peer for d in donors]

        def serve(size_mb: float) -> tuple[str, int]:
            answers = ask_all(donors, {"op": "serve", "numel": int(size_mb * 1e6 / 4), "seed": 7},
                              120)  # fmt: skip
            hashes = {a.get("state_hash") for a in answers}
            if len(hashes) != 1 or not all(a.get("ok") for a in answers):
                raise WorkerDied(f"donors serve different states: {answers}")
            return answers[0]["state_hash"], answers[0]["bytes"]

        def download(
            label: str, size: int, state_hash: str, method: str, donors_used: list[str],
            joiner_down: float, repeat: int, kill: Worker | None = None,
        ) -> dict[str, Any]:  # fmt: skip
            bottleneck = min(joiner_down, up * len(donors_used))
            ideal_s = size * 8 / (bottleneck * 1e6)
            timeout_s = max(60.0, 10 * size * 8 / (up * 1e6))
            command = {"op": "download", "donors": donors_used, "state_hash": state_hash,
                       "method": method, "timeout_s": timeout_s}  # fmt: skip
            if kill is not None:
                command["progress_at"] = 1 / 3
            cpu = cpu_times()
            rx_before = hosts[3].rx_bytes()
            tx_before = [h.tx_bytes() for h in hosts[:3]]
            joiner.send(command)
            killed_at = None
            deadline = time.time() + timeout_s + 30
            while True:
                message = joiner.recv(max(1.0, deadline - time.time()))
                if message.get("op") == "progress" and kill is not None:
                    kill_session(kill.proc)
                    killed_at = {"seconds": message["seconds"],
                                 "fraction": message["received"] / message["total"]}  # fmt: skip
                    say(f"join: killed {kill.name} at {killed_at['seconds']:.2f} s "
                        f"({killed_at['fraction']:.0%} of the bytes in)")  # fmt: skip
                    continue
                break
            busy = cpu_busy(cpu)
            rx = hosts[3].rx_bytes() - rx_before
            tx = sum(h.tx_bytes() - b for h, b in zip(hosts[:3], tx_before, strict=True))
            row = {
                "case": label, "bytes": size, "method": method, "donors": len(donors_used),
                "joiner_down_mbit": joiner_down, "donor_up_mbit": up, "repeat": repeat,
                "ok": bool(message.get("ok")), "verified": bool(message.get("verified")),
                "seconds": message.get("seconds"), "error": message.get("error"),
                "one_link_s": size * 8 / (up * 1e6), "ideal_s": ideal_s, "killed": killed_at,
                "joiner_wire_rx": rx, "donors_wire_tx": tx, "cpu_busy": busy,
            }  # fmt: skip
            if row["ok"]:
                row["vs_one_link"] = row["seconds"] / row["one_link_s"]
                row["vs_ideal"] = row["seconds"] / ideal_s
            say(
                f"join {label:28s} {size / 1e6:6.1f} MB #{repeat}: "
                + (
                    f"{row['seconds']:.2f} s = {row['vs_one_link']:.2f} x size/link, "
                    f"{row['vs_ideal']:.2f} x ideal, verified {row['verified']}, "
                    f"joiner received {rx / size:.2f} x size on the wire"
                    if row["ok"]
                    else f"FAILED {row['error']}"
                )
            )
            return row

        cases = [("1 donor", "multi", ids[:1]), ("3 donors", "multi", ids),
                 ("1 donor, whole (download_state)", "single", ids[:1])]  # fmt: skip
        try:
            for size_mb in args.join_mb:
                state_hash, size = serve(size_mb)
                for repeat in range(args.repeats):
                    for label, method, used in cases:
                        rows.append(download(label, size, state_hash, method, used, down, repeat))
            # the joiner's download at the donors' rate: it is the bottleneck
            hosts[3] = lab.reshape(hosts[3], up_mbit=up, down_mbit=up)
            for size_mb in args.join_mb:
                state_hash, size = serve(size_mb)
                for repeat in range(args.repeats):
                    for label, method, used in cases[:2]:
                        rows.append(download(f"{label}, symmetric joiner", size, state_hash,
                                             method, used, up, repeat))  # fmt: skip
            hosts[3] = lab.reshape(hosts[3], up_mbit=up, down_mbit=down)
            state_hash, size = serve(max(args.join_mb))
            rows.append(download("3 donors, one killed at 1/3", size, state_hash, "multi", ids,
                                 down, 0, kill=donors[2]))  # fmt: skip
        except WorkerDied as e:  # keep what ran
            aborted = f"{type(e).__name__}: {e}"[:1000]
            say(f"join aborted: {aborted}")

    summary = []
    for key in dict.fromkeys((r["case"], r["bytes"]) for r in rows):
        runs = [r for r in rows if (r["case"], r["bytes"]) == key]
        good = [r for r in runs if r["ok"] and r["verified"]]
        summary.append({
            "case": key[0], "bytes": key[1], "runs": len(runs), "verified": len(good),
            "donors": runs[0]["donors"], "joiner_down_mbit": runs[0]["joiner_down_mbit"],
            "seconds": median([r["seconds"] for r in good]),
            "vs_one_link": median([r["vs_one_link"] for r in good]),
            "vs_ideal": median([r["vs_ideal"] for r in good]),
            "joiner_wire_rx_vs_size": median([r["joiner_wire_rx"] / r["bytes"] for r in runs]),
            "killed": runs[0]["killed"],
        })  # fmt: skip
    speedups = []
    for size in sorted({r["bytes"] for r in summary}):
        one = next((r for r in summary if r["case"] == "1 donor" and r["bytes"] == size), None)
        three = next((r for r in summary if r["case"] == "3 donors" and r["bytes"] == size), None)
        if one and three and one["seconds"] and three["seconds"]:
            speedups.append({"bytes": size, "speedup": one["seconds"] / three["seconds"]})
    killed = next((r for r in rows if r["killed"] is not None or "killed" in r["case"]), None)
    checks = {
        "three_donors_2x": {
            "speedups": speedups, "threshold": JOIN_SPEEDUP_MIN,
            "passes": bool(speedups) and all(s["speedup"] >= JOIN_SPEEDUP_MIN for s in speedups),
        },
        "donor_killed_still_verified": {
            "passes": bool(killed and killed["ok"] and killed["verified"]
                           and killed["killed"] is not None),
        },
    }  # fmt: skip
    return {"summary": summary, "rows": rows, "checks": checks, "aborted": aborted}


# ---------------------------------------------------------------------- swarm


def nano_parameters() -> int:
    from diloco_peer.peer.model import build_model, count_parameters

    return count_parameters(build_model("nano", 256, seed=0))  # byte tokens: vocab 256


def section_swarm(args: argparse.Namespace, procs: Procs, folder: Path) -> dict[str, Any]:
    params = nano_parameters()
    dp_per_step = 2 * (GROUP - 1) / GROUP * 4 * params
    runs = []
    with lab_with(procs) as lab:
        hosts = [lab.add_host(up_mbit=args.swarm_mbit, down_mbit=args.swarm_mbit)
                 for _ in range(GROUP)]  # fmt: skip
        for compression in args.swarm_compressions:
            sub = folder / f"swarm-{compression}"
            sub.mkdir()
            run = swarm_run(args, hosts, compression, sub)
            for name in ("wire_tx_per_step", "wire_rx_per_step", "allreduce_sent_per_step"):
                run[name.replace("per_step", "vs_dp")] = (
                    run[name] / dp_per_step if run[name] is not None else None
                )
            say(
                f"swarm {compression}: finished {run['finished']} in {run['wall_s']:.0f} s; per "
                f"inner step and peer: wire tx {(run['wire_tx_per_step'] or 0) / 1e3:.1f} kB "
                f"({run['wire_tx_vs_dp'] or 0:.3f} of DP), all-reduce sent "
                f"{(run['allreduce_sent_per_step'] or 0) / 1e3:.1f} kB"
            )
            runs.append(run)
    return {"params": params, "inner_steps": args.inner_steps, "versions": args.versions,
            "link_mbit": args.swarm_mbit, "dp_per_step": dp_per_step, "runs": runs}  # fmt: skip


def swarm_run(
    args: argparse.Namespace, hosts: list[Host], compression: str, folder: Path
) -> dict[str, Any]:
    """One swarm of `diloco-peer join` peers, one per host, until --versions; per-peer counts."""
    import dataclasses

    from diloco_peer.config import default_run
    from diloco_peer.coordinator_free.manifest import dump_run_config

    run_spec, settings = default_run("nano", "sync")
    run_spec = dataclasses.replace(run_spec, inner_steps=args.inner_steps, compression=compression)
    settings = dataclasses.replace(settings, expected_peers=len(hosts))
    config = folder / "run.toml"
    config.write_text(dump_run_config(run_spec, settings), encoding="utf-8")
    logs = [folder / f"peer{i}.jsonl" for i in range(len(hosts))]
    before = [(h.tx_bytes(), h.rx_bytes()) for h in hosts]
    say(f"swarm {compression}: {len(hosts)} peers, nano, H={args.inner_steps}, "
        f"until version {args.versions}, {args.swarm_mbit:g} Mbit links")  # fmt: skip
    t0 = time.time()
    join_args = ["--quiet", "--threads", "1", "--until-version", str(args.versions)]
    with LocalSwarm(folder, run=f"wan{compression}", join_args=join_args, cwd=REPO) as swarm:
        founder, _ = swarm.start(
            "peer0", "--host", hosts[0].ip, "--config", str(config), wrap=hosts[0].argv([])
        )
        try:
            maddr = swarm.address(logs[0], 180, proc=founder, ip=hosts[0].ip)
        except LocalPeerFailed as e:
            raise WorkerDied(f"the founder exited with {founder.returncode}") from e
        except TimeoutError as e:
            raise WorkerDied("the founder did not start within 180 s") from e
        for i, host in enumerate(hosts[1:], start=1):
            swarm.start(f"peer{i}", "--host", host.ip, "--swarm", maddr, wrap=host.argv([]))
        deadline = time.time() + args.swarm_timeout_s
        while time.time() < deadline and swarm.running():
            time.sleep(1.0)
        finished = all(p.poll() == 0 for p in swarm.procs)
    wall_s = time.time() - t0
    after = [(h.tx_bytes(), h.rx_bytes()) for h in hosts]
    per_peer = []
    for i, log in enumerate(logs):
        events = read_log(log)
        rounds = [e for e in events if e["event"] == "round"]
        stop = next((e for e in events if e["event"] == "stop"), None)
        steps = sum(e.get("steps", 0) for e in rounds)
        tx, rx = after[i][0] - before[i][0], after[i][1] - before[i][1]
        sent = sum(e.get("bytes_sent", 0) for e in rounds)
        per_peer.append({
            "steps": steps, "rounds": len(rounds), "wire_tx": tx, "wire_rx": rx,
            "allreduce_sent": sent,
            "allreduce_received": sum(e.get("bytes_received", 0) for e in rounds),
            "state_download_bytes": sum(e.get("bytes") or 0 for e in events
                                        if e["event"] == "catch_up"),
            "wire_tx_per_step": tx / steps if steps else None,
            "wire_rx_per_step": rx / steps if steps else None,
            "allreduce_sent_per_step": sent / steps if steps else None,
            "final_version": stop["version"] if stop else None,
            "final_hash": stop["state_hash"] if stop else None,
            "ppl": stop.get("ppl") if stop else None,
        })  # fmt: skip
    ok = [p for p in per_peer if p["steps"]]
    return {
        "compression": compression, "finished": finished, "wall_s": round(wall_s, 1),
        "one_state": len({p["final_hash"] for p in per_peer}) == 1,
        "peers": per_peer,
        "wire_tx_per_step": median([p["wire_tx_per_step"] for p in ok]),
        "wire_rx_per_step": median([p["wire_rx_per_step"] for p in ok]),
        "allreduce_sent_per_step": median([p["allreduce_sent_per_step"] for p in ok]),
    }  # fmt: skip


# ---------------------------------------------------------------------- quality


def section_quality(args: argparse.Namespace, procs: Procs, folder: Path) -> dict[str, Any]:
    from diloco_peer.averaging.compression import encoded_size

    rows = []
    for compression in COMPRESSIONS:
        argv = [PY, "-m", "diloco_peer", "simulate", "--algo", "sync", "--workers", str(GROUP),
                "--model", "nano", "--total-steps", str(args.sim_steps),
                "--compression", compression, "--json"]  # fmt: skip
        t0 = time.time()
        proc = procs.popen(argv, log=folder / f"sim-{compression}.err", stdout=subprocess.PIPE)
        try:
            out, _ = proc.communicate(timeout=args.sim_timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            out = b""
        seconds = time.time() - t0
        try:
            doc = json.loads(out)
        except json.JSONDecodeError:
            doc = {}
        n = 1 << 20
        rows.append({
            "compression": compression, "final_ppl": doc.get("final_ppl"),
            "initial_ppl": doc.get("initial_ppl"), "seconds": round(seconds, 1),
            "bytes_per_value": encoded_size(n, compression) / n,
        })  # fmt: skip
        say(f"quality {compression}: final ppl {doc.get('final_ppl')} ({seconds:.0f} s)")
    base = rows[0]["final_ppl"]
    for row in rows:
        row["ppl_ratio"] = row["final_ppl"] / base if base and row["final_ppl"] else None
    return {"total_steps": args.sim_steps, "workers": GROUP, "rows": rows}


# ---------------------------------------------------------------------- report


def _f(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _pass(check: dict[str, Any] | None) -> str:
    if not check:
        return "not measured"
    return "**pass**" if check.get("passes") else "**FAIL**"


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "## On an emulated WAN (bench/wan.py, issue 6)",
        "",
        f"`{doc['command']}` ({doc['wall_s'] / 60:.1f} min). Peers in network namespaces on veth "
        "links shaped by `tc tbf` (rate limits only: no netem, so no added latency or loss); "
        f"Mbit = 10^6 bit/s, MB = 10^6 bytes. {doc['machine']}.",
        "",
    ]
    ar, jn, sw, qu = (doc.get(s) for s in SECTIONS)
    # --- the one table
    lines += ["| measure | ours | baseline in the same run | ours vs baseline | acceptance |",
              "|---|---|---|---|---|"]  # fmt: skip
    if ar and "error" not in ar:
        checks = ar["checks"]
        for row in ar["summary"]:
            o, h = row["ours"], row["hivemind"]
            rate = row["rate_mbit"]
            crit = ""
            if rate == THROUGHPUT_RATE:
                crit = (f"≥ {THROUGHPUT_MIN} x link: {_pass(checks.get('throughput_at_100'))}; "
                        f"≥ hivemind: {_pass(checks.get('not_below_hivemind'))}")  # fmt: skip
            if rate:
                ours = f"{_f(o['fraction_of_link'])} x link ({_f(o['allreduce_s'])} s)"
                theirs = f"hivemind {_f(h['fraction_of_link'])} x link ({_f(h['allreduce_s'])} s)"
            else:
                ours = f"{_f(o['throughput_mbit'], '.0f')} Mbit/s ({_f(o['allreduce_s'])} s)"
                theirs = (
                    f"hivemind {_f(h['throughput_mbit'], '.0f')} Mbit/s ({_f(h['allreduce_s'])} s)"
                )
            ratio = (o["throughput_mbit"] / h["throughput_mbit"]
                     if o["throughput_mbit"] and h["throughput_mbit"] else None)  # fmt: skip
            lines.append(
                f"| all-reduce effective throughput, {mbit_label(rate)} "
                f"({ar['tensor_bytes'] / 1e6:.0f} MB, n = {ar['group']}, median of "
                f"{o['rounds'] - o['failed']}) | {ours} | {theirs} | {_f(ratio)} | {crit} |"
            )
    if jn and "error" not in jn:
        by = {(r["case"], r["bytes"]): r for r in jn["summary"]}
        for size in sorted({r["bytes"] for r in jn["summary"] if r["case"] == "3 donors"}):
            one, three = by.get(("1 donor", size)), by.get(("3 donors", size))
            if not (one and three):
                continue
            speed = next((s["speedup"] for s in jn["checks"]["three_donors_2x"]["speedups"]
                          if s["bytes"] == size), None)  # fmt: skip
            verdict = _pass({"passes": (speed or 0) >= JOIN_SPEEDUP_MIN})
            lines.append(
                f"| join, {size / 1e6:.0f} MB, 3 donors vs 1 (time / (size / donor upload)) | "
                f"{_f(three['seconds'])} s ({_f(three['vs_one_link'])} x) | 1 donor "
                f"{_f(one['seconds'])} s ({_f(one['vs_one_link'])} x) | {_f(speed)} x faster | "
                f"≥ {JOIN_SPEEDUP_MIN:g}x: {verdict} |"
            )
        k = next((r for r in jn["summary"] if "killed" in r["case"]), None)
        if k:
            three = by.get(("3 donors", k["bytes"]))
            base = three["seconds"] if three else None
            slower = k["seconds"] / base if base and k["seconds"] else None
            lines.append(
                f"| join, {k['bytes'] / 1e6:.0f} MB, 3 donors, one SIGKILLed at "
                f"{_f((k['killed'] or {}).get('fraction'), '.0%')} of the bytes | "
                f"{_f(k['seconds'])} s, verified {k['verified'] == k['runs'] and k['runs'] > 0} | "
                f"3 donors {_f(base)} s | {_f(slower)} x "
                f"| completes verified: {_pass(jn['checks']['donor_killed_still_verified'])} |"
            )
    if sw and "error" not in sw:
        for run in sw["runs"]:
            lines.append(
                f"| bytes on the wire per inner step per peer, swarm, {run['compression']} "
                f"(tx; all-reduce logged) | {_f((run['wire_tx_per_step'] or 0) / 1e3, '.1f')} kB "
                f"({_f((run['allreduce_sent_per_step'] or 0) / 1e3, '.1f')} kB) | data-parallel "
                f"{sw['dp_per_step'] / 1e3:.0f} kB | {_f(run['wire_tx_vs_dp'], '.3f')} "
                f"({_f(run['allreduce_sent_vs_dp'], '.3f')}) | |"
            )
    if qu and "error" not in qu:
        for row in qu["rows"]:
            lines.append(
                f"| quality of {row['compression']} ({row['bytes_per_value']:.3f} B/value), "
                f"simulate sync, {qu['total_steps']} steps | ppl {_f(row['final_ppl'], '.3f')} | "
                f"none: ppl {_f(qu['rows'][0]['final_ppl'], '.3f')} | "
                f"{_f(row['ppl_ratio'], '.4f')} | |"
            )
    lines.append("")
    lines += _details(doc)
    return "\n".join(lines)


def _details(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    ar, jn, sw = doc.get("allreduce"), doc.get("join"), doc.get("swarm")
    for name in SECTIONS:
        if doc.get(name) and "error" in doc[name]:
            lines += [f"**Section {name} crashed:** `{doc[name]['error']}`", ""]
        if doc.get(name) and doc[name].get("aborted"):
            lines += [f"**Section {name} stopped early** (the results above are those of the "
                      f"rounds before): `{doc[name]['aborted']}`", ""]  # fmt: skip
    if ar and "error" not in ar:
        lines += [
            "### All-reduce",
            "",
            f"4 peers, one fp32 vector of {ar['tensor_bytes'] / 1e6:.0f} MB each, every host "
            "shaped to the rate in both directions. Effective throughput = 2(n-1)/n x S / "
            "all-reduce time (each peer sends and receives 2(n-1)/n x S in a butterfly "
            "all-reduce), the time being the slowest member's. Ours: from the group being formed "
            "to holding the average; hivemind: `_aggregate_with_group` (load balancing, the "
            "all-reduce, the in-place update). Step: the whole call, matchmaking included "
            f"(hivemind's `min_matchmaking_time` {doc['args']['hivemind_matchmaking_s']:g} s). "
            "Wire: IP bytes sent per peer per round (tbf counts them too), against "
            f"2(n-1)/n x S = {ar['bytes_per_peer_ideal'] / 1e6:.1f} MB.",
            "",
            "| link | ours: all-reduce s | x link (range) | parts in / reduce / answers s | step s "
            "| wire MB sent | drops | CPU busy, peers' CPU s | hivemind: all-reduce s "
            "| x link (range) | step s | wire MB sent | drops | CPU busy, peers' CPU s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in ar["summary"]:
            o, h = row["ours"], row["hivemind"]
            cells = []
            for x in (o, h):
                spread = x.get("fraction_range")
                within = f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else ""
                cells += [_f(x["allreduce_s"]), _f(x["fraction_of_link"]) + within]
                if x is o:
                    cells.append(" / ".join(_f(o.get(k)) for k in
                                            ("parts_in_s", "reduce_s", "answers_s")))  # fmt: skip
                cpu = f"{_f(x.get('cpu_busy'), '.0%')}, {_f(x.get('cpu_s'), '.1f')}"
                cells += [_f(x["step_s"]), _f((x["wire_tx_per_peer"] or 0) / 1e6, ".1f"),
                          _f(x.get("tbf_drops"), ".0f"), cpu]  # fmt: skip
            lines.append(f"| {mbit_label(row['rate_mbit'])} | " + " | ".join(cells) + " |")
        errors = {
            k: max((r[k]["max_error"] or 0) for r in ar["summary"]) for k in ("ours", "hivemind")
        }
        lines += [
            "",
            "Phases of ours (each the slowest member's, so they need not add up): every "
            "member's part of mine in, my reduction, every part's average back. Drops: packets the "
            "token buckets dropped per round, all links (`NetLab.drops`). CPU busy: the "
            "whole machine's (both cores, whoever used them) during the rounds; peers' CPU s: "
            "the CPU seconds all processes of the 4 peers used per round (worker, DHT process, "
            "p2p daemon, hivemind's averager process). Largest error against the exact "
            f"mean: ours {errors['ours']:.1e}, hivemind {errors['hivemind']:.1e}.",
        ]
        ours_ok = [r for r in ar["rounds"] if r["kind"] == "ours" and r["ok"]]
        bits = f"{sum(bool(r.get('same_bits')) for r in ours_ok)} of {len(ours_ok)}"
        failed = [r for r in ar["rounds"] if not r["ok"]]
        lines += ["", f"Rounds of ours whose average was bit-identical on every member: {bits}. "
                  f"Failed rounds: {len(failed)}"
                  + (" (" + "; ".join(f"{r['kind']} {mbit_label(r['rate_mbit'])}: "
                                     f"{(r['errors'] or ['?'])[0]}" for r in failed)[:600] + ")"
                     if failed else "") + ".", ""]  # fmt: skip
    if jn and "error" not in jn:
        lines += [
            "### Join (state download)",
            "",
            f"Donors upload at {doc['args']['donor_mbit']:g} Mbit; the joiner downloads at "
            f'{doc["args"]["joiner_down_mbit"]:g} Mbit ("symmetric": at the donors\' rate). '
            "x link = time / (size / one donor's upload); x ideal = time / (size / min(joiner "
            "download, donors x upload)). Median of the repeats; verified = sha256 of the bytes "
            "received equals the donors' advertised hash and they load as safetensors.",
            "",
            "| case | MB | joiner down | runs verified | seconds | x link | x ideal "
            "| joiner's wire rx / size |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in jn["summary"]:
            lines.append(
                f"| {r['case']} | {r['bytes'] / 1e6:.1f} | {r['joiner_down_mbit']:g} Mbit | "
                f"{r['verified']}/{r['runs']} | {_f(r['seconds'])} | {_f(r['vs_one_link'])} | "
                f"{_f(r['vs_ideal'])} | {_f(r['joiner_wire_rx_vs_size'])} |"
            )
        lines += [
            "",
            "With 3 donors a joiner can download up to 3 x a donor's upload, but only if its "
            "own download is that fast: volunteers' uploads are the usual bottleneck, and a "
            "joiner whose download is no faster than one donor's upload (the symmetric rows) "
            "gains nothing from more donors.",
            "",
        ]
    if sw and "error" not in sw:
        lines += [
            "### Swarm: bytes on the wire",
            "",
            f"4 `diloco-peer join` peers, nano ({sw['params']:,} parameters), sync, "
            f"H = {sw['inner_steps']}, until version {sw['versions']}, {sw['link_mbit']:g} Mbit "
            "links. Per peer and inner step: the host's wire counters (everything: DHT, heads, "
            "manifest, state download, all-reduce) and the all-reduce bytes the peer logged; "
            "data-parallel equivalent: a ring all-reduce of fp32 gradients every step, "
            f"2(n-1)/n x 4 x params = {sw['dp_per_step'] / 1e3:.0f} kB sent per step per peer.",
            "",
            "| compression | finished | one state | wall s | inner steps (per peer) "
            "| wire tx / step | wire rx / step | all-reduce sent / step | tx vs DP "
            "| all-reduce vs DP | state downloads (B) | final ppl |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in sw["runs"]:
            peers = run["peers"]
            lines.append(
                f"| {run['compression']} | {run['finished']} | {run['one_state']} | "
                f"{run['wall_s']:.0f} | {', '.join(str(p['steps']) for p in peers)} | "
                f"{_f((run['wire_tx_per_step'] or 0) / 1e3, '.1f')} kB | "
                f"{_f((run['wire_rx_per_step'] or 0) / 1e3, '.1f')} kB | "
                f"{_f((run['allreduce_sent_per_step'] or 0) / 1e3, '.1f')} kB | "
                f"{_f(run['wire_tx_vs_dp'], '.3f')} | {_f(run['allreduce_sent_vs_dp'], '.3f')} | "
                f"{', '.join(str(p['state_download_bytes']) for p in peers)} | "
                f"{_f(median([p['ppl'] for p in peers if p['ppl'] is not None]), '.3f')} |"
            )
        lines.append("")
    qu = doc.get("quality")
    if qu and "error" not in qu:
        lines += [
            "### Compression quality",
            "",
            f"`diloco-peer simulate --algo sync --workers {qu['workers']} --model nano "
            f"--total-steps {qu['total_steps']} --compression C --json` (the same budget and "
            "seed for every C; deterministic): final held-out ppl, and the bytes per value "
            "each codec puts on the wire (`compression.encoded_size` of 2^20 values). Seconds "
            "per simulation: "
            + ", ".join(f"{r['compression']} {r['seconds']:.0f}" for r in qu["rows"])
            + ".",
            "",
        ]
    return lines


def write_section(path: Path, generated: str) -> None:
    """This bench's section of the results page (see `_common.write_section`)."""
    _common.write_section(path, generated, SECTION_BEGIN, SECTION_END, NOTES_MARKER)


# ---------------------------------------------------------------------- main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    p.add_argument("--rates", type=_floats, default=None,
                   help="all-reduce link rates in Mbit, comma-separated; 0 = unshaped "
                        "(default 0,50,100,1000)")  # fmt: skip
    p.add_argument("--allreduce-mb", type=float, default=None, help="default 25 (quick: 10)")
    p.add_argument("--matchmaking-s", type=float, default=20.0)
    p.add_argument("--hivemind-matchmaking-s", type=float, default=5.0)
    p.add_argument("--join-mb", type=_floats, default=None, help="default 25,100 (quick: 10,40)")
    p.add_argument("--donor-mbit", type=float, default=100.0)
    p.add_argument("--joiner-down-mbit", type=float, default=1000.0)
    p.add_argument("--swarm-mbit", type=float, default=100.0)
    p.add_argument("--swarm-compressions", default="none,int8")
    p.add_argument("-H", "--inner-steps", type=int, default=20)
    p.add_argument("--versions", type=int, default=None, help="default 5 (quick: 3)")
    p.add_argument("--swarm-timeout-s", type=float, default=600.0)
    p.add_argument("--sim-steps", type=int, default=None, help="default 800 (quick: 400)")
    p.add_argument("--sim-timeout-s", type=float, default=900.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    quick = args.quick
    args.rates = args.rates if args.rates is not None else [0.0, 50.0, 100.0, 1000.0]
    args.allreduce_mb = args.allreduce_mb or (10.0 if quick else 25.0)
    args.join_mb = args.join_mb or ([10.0, 40.0] if quick else [25.0, 100.0])
    args.versions = args.versions or (3 if quick else 5)
    args.sim_steps = args.sim_steps or (400 if quick else 800)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    args.swarm_compressions = [c.strip() for c in args.swarm_compressions.split(",") if c]
    bad = [s for s in args.only if s not in SECTIONS]
    bad += [c for c in args.swarm_compressions if c not in COMPRESSIONS]
    if bad or args.repeats < 1:
        p.error(f"unknown section or compression {bad}, or --repeats < 1")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    doc: dict[str, Any] = {
        "command": "python bench/wan.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPU cores, load average before "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
    }
    procs = Procs()
    runners = {"allreduce": section_allreduce, "join": section_join, "swarm": section_swarm,
               "quality": section_quality}  # fmt: skip
    crashed = False
    workdir = Path(tempfile.mkdtemp(prefix="wan-bench-"))
    try:
        for name in args.only:
            folder = workdir / name
            folder.mkdir()
            try:
                doc[name] = runners[name](args, procs, folder)
            except (WorkerDied, OSError, RuntimeError, subprocess.SubprocessError) as e:
                crashed = True
                say(f"section {name} crashed: {e!r}")
                doc[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            finally:
                procs.kill_all()
    finally:
        procs.kill_all()
        NetLab.remove_stale(f"dp{os.getpid() % 100_000}")
    troubled = crashed or any((doc.get(n) or {}).get("aborted") for n in args.only)
    if troubled:  # the workers' and peers' logs, to find out why
        doc["logs"] = str(workdir)
        say(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["wall_s"] = round(time.time() - _T0, 1)
    doc["passes"] = {
        f"{name}.{check}": value.get("passes")
        for name in ("allreduce", "join")
        for check, value in (doc.get(name) or {}).get("checks", {}).items()
    }
    print(json.dumps(doc, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        write_section(args.markdown, markdown(doc))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
