"""Partitions heal (issue 15, item 3), on an emulated network (diloco_peer.netlab; needs root).

Three bare DHT nodes, one cut off for a while: hivemind's routing tables forget the other side,
and `rejoin.Rejoiner` brings it back once the network is whole (about 20 s).

Four peers (nano, sync), each on a host of its own, train together; then the network is cut
2|2 for 30 s and joined again. Each side goes on alone (groups of two, a fork), and no round
waits longer than the sync timeout plus the all-reduce timeout. Once the network is whole, the
DHT must be whole again (hivemind's routing tables forget the other side; rejoin.Rejoiner
pings it back), the swarm must be on one state within two versions of the heal, and every δ of the
losing side must reach that state exactly once: its peers' last δ (applied on the losing
branch) goes into a later group again, and nothing else twice.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from diloco_peer.config import default_run
from diloco_peer.coordinator_free.manifest import dump_run_config
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, kill_session, spawn
from diloco_peer.netlab import Host, NetLab
from diloco_peer.peer.events import read_log

H = 20
SYNC_TIMEOUT_S = 10.0
ALLREDUCE_TIMEOUT_S = 20.0
SPLIT_S = 30.0
HEAL_TIMEOUT_S = 150.0
"""How long after the heal the test waits for the swarm to be on one state (a bound, not the
expectation: two versions take about 10-25 s on two shared cores)."""


# A DHT node with a Rejoiner (argv: its address, its key file, the initial peers' multiaddrs).
# It starts as soon as an initial peer answers (all nodes start at once: each takes seconds to
# import). It stores its own subkey under one key and reads the key back every half second,
# as heads do, and says after each read how many subkeys it saw and how many nodes its routing
# table holds.
_NODE = """
import json, sys, time
from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from diloco_peer.coordinator_free.rejoin import Rejoiner, routed_peers
deadline = time.time() + 60
while True:
    try:  # wait_timeout: unanswered for 1 s counts as failed (hivemind: 3 s), to keep it short
        dht = DHT(start=True, host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/{PORT}"],
                  identity_path=sys.argv[2], initial_peers=sys.argv[3:], startup_timeout=30,
                  wait_timeout=1)
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(0.5)
me = dht.peer_id.to_base58()
rejoiner = Rejoiner(lambda: dht, me, initial=[a.rsplit("/", 1)[1] for a in sys.argv[3:]],
                    heads=dict, on_rejoined=lambda peers: None, period_s=0.5)
rejoiner.start()
while True:
    try:
        dht.store("k", me, get_dht_time() + 30, subkey=me, return_future=True).result(timeout=4)
        found = dht.get("k", latest=True, return_future=True).result(timeout=4)
        seen = len(found.value) if found is not None else 0
    except Exception:
        seen = -1
    table = len(routed_peers(dht, timeout_s=4))
    print(json.dumps({"t": time.time(), "seen": seen, "table": table}), flush=True)
    time.sleep(0.5)
""".replace("{PORT}", "31340")


class Node:
    """A `_NODE` process on a netlab host, and its last report."""

    def __init__(self, host: Host, initial: list[str], folder: Path) -> None:
        identity = Identity.generate()
        key = folder / f"{host.netns}.key"
        key.write_bytes(identity.to_bytes())
        self.maddr = f"/ip4/{host.ip}/tcp/31340/p2p/{identity.peer_id_str}"
        argv = host.argv([sys.executable, "-c", _NODE, host.ip, str(key), *initial])
        self.err = folder / f"{host.netns}.err"
        self.proc = spawn(argv, stderr=self.err, stdout=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL)  # fmt: skip
        self.last: dict[str, Any] = {}
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def wait(self, timeout_s: float, **want: int) -> float:
        """Seconds until a report says `want` (e.g. table=2); AssertionError after timeout_s."""
        t0 = time.time()
        while time.time() < t0 + timeout_s:
            try:
                report = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            assert report is not None, self.err.read_text()[-2000:]
            self.last = report
            if all(report[k] == v for k, v in want.items()):
                return time.time() - t0
        raise AssertionError(f"not {want} within {timeout_s} s: {self.last}")


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_dht_nodes_cut_off_from_each_other_are_one_dht_again_after_the_heal(
    tmp_path: Path,
) -> None:
    nodes: list[Node] = []
    with NetLab() as lab:
        try:
            hosts = [lab.add_host() for _ in range(3)]
            nodes.append(Node(hosts[0], [], tmp_path))
            nodes += [Node(h, [nodes[0].maddr], tmp_path) for h in hosts[1:]]
            for node in nodes:
                node.wait(60, seen=3, table=2)
            lab.partition(hosts[:1])  # the first node alone
            t_cut = time.time()
            nodes[0].wait(30, table=0)  # hivemind forgot the others...
            for node in nodes[1:]:
                node.wait(30, table=1)  # ... and they forgot it
            t_heal = time.time()
            # connections lost too (a long outage): nothing sent during the cut arrives late to
            # remind a node of the others (hivemind adds a node that calls it to its table)
            lab.heal(reset_connections=True)
            for node in nodes:
                node.wait(30, seen=3, table=2)
            print(json.dumps({"forgot_s": round(t_heal - t_cut, 1),
                              "healed_s": round(time.time() - t_heal, 1)}))  # fmt: skip
        finally:
            for node in nodes:
                kill_session(node.proc)


def events_of(log: Path, *kinds: str) -> list[dict[str, Any]]:
    return [e for e in read_log(log) if e["event"] in kinds]


def held_states(log: Path, after: float) -> list[tuple[float, int, str]]:
    """(time, version, state hash) of the states a peer held from `after` on: the one it held
    then (stamped `after`), and each it moved to since, by a commit or a catch-up."""
    moves = [
        (e["time"], e["version"], e["state_hash"]) for e in events_of(log, "round", "catch_up")
    ]
    before = [m for m in moves if m[0] <= after]
    start = [(after, *before[-1][1:])] if before else []
    return start + [m for m in moves if m[0] > after]


def one_state_from(logs: list[Path], after: float) -> tuple[int, float] | None:
    """The first version V that every peer came to hold with one hash h from `after` on (a
    commit or a catch-up), such that from the moment the last of them got there no two peers
    held different hashes at any version; with that moment."""
    held = [held_states(log, after) for log in logs]
    for v, h in sorted({(s[1], s[2]) for states in held for s in states}):
        if not all(any(s[1:] == (v, h) for s in states) for states in held):
            continue
        t_v = max(min(s[0] for s in states if s[1:] == (v, h)) for states in held)
        later: dict[int, set[str]] = {}
        for states in held:
            for t, u, hash_ in states:
                if t >= t_v:
                    later.setdefault(u, set()).add(hash_)
        if all(len(hashes) == 1 for hashes in later.values()):
            return v, t_v
    return None


def grouped_all_after(logs: list[Path], t: float) -> bool:
    """Every peer committed a round in a group of all of them after `t`."""
    return all(
        any(e["time"] > t and e["group_size"] == len(logs) for e in events_of(log, "round"))
        for log in logs
    )


def statuses(hosts: list[Host], maddrs: list[str], folder: Path) -> list[dict[str, Any]]:
    """`diloco-peer status --json` on each host at once, each reading the swarm through the
    peer of its host."""
    procs = [
        spawn(
            host.argv([*PEER_COMMAND, "status", "--swarm", maddr, "--run", "t", "--json"]),
            stderr=folder / f"status{i}.err",
            stdout=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for i, (host, maddr) in enumerate(zip(hosts, maddrs, strict=True))
    ]
    docs = []
    try:
        for i, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, (folder / f"status{i}.err").read_text()[-2000:]
            docs.append(json.loads(out))
    finally:
        for proc in procs:
            kill_session(proc)
    return docs


def contributed_steps_add_up(log: Path) -> tuple[int, int]:
    """(steps in this peer's committed rounds, steps it trained plus those it contributed
    again), over its events up to its last round: each phase trains H steps and goes into one
    round (a failed round's δ into a later one), a δ of a lost branch once more, a dropped δ
    nowhere."""
    events = events_of(log, "round", "round_failed", "catch_up", "dropped")
    last = max(i for i, e in enumerate(events) if e["event"] == "round")
    events = events[: last + 1]
    applied = sum(e["steps"] for e in events if e["event"] == "round")
    own = {e["version"]: e["steps"] for e in events if e["event"] == "round"}
    trained = H * sum(e["event"] in ("round", "round_failed") for e in events)
    again = sum(own[e["from_version"]] for e in events if e["event"] == "catch_up"
                and e["recontributed"])  # fmt: skip
    dropped = sum(e["steps"] for e in events if e["event"] == "dropped")
    return applied, trained + again - dropped


@pytest.mark.multipeer
@pytest.mark.slow  # about 3 minutes each: startup, 30 s apart, the heal
@pytest.mark.timeout(600)
@pytest.mark.parametrize("reset", [False, True], ids=["connections-stall", "connections-lost"])
def test_a_swarm_split_in_two_for_30_s_heals_into_one_state(tmp_path: Path, reset: bool) -> None:
    run, swarm = default_run("nano", "sync")
    run = dataclasses.replace(run, inner_steps=H, warmup_steps=5)
    swarm = dataclasses.replace(
        swarm, expected_peers=4, sync_timeout_s=SYNC_TIMEOUT_S,
        allreduce_timeout_s=ALLREDUCE_TIMEOUT_S, eval_every=0, checkpoint_every=0,
    )  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(dump_run_config(run, swarm), encoding="utf-8")
    join_args = ["--quiet", "--threads", "1"]
    with (
        NetLab() as lab,
        LocalSwarm(tmp_path, run="t", join_args=join_args, stop_grace_s=10) as peers,
    ):
        hosts = [lab.add_host(up_mbit=100, down_mbit=100) for _ in range(4)]
        _, first = peers.start("p0", "--host", hosts[0].ip, "--config", str(config),
                               wrap=hosts[0].argv([]))  # fmt: skip
        founder = peers.address(first, 180, ip=hosts[0].ip)
        logs = [first] + [
            peers.start(f"p{i}", "--host", h.ip, "--swarm", founder, wrap=h.argv([]))[1]
            for i, h in enumerate(hosts[1:], start=1)
        ]
        maddrs = [peers.address(log, 180, ip=h.ip) for log, h in zip(logs, hosts, strict=True)]
        for log in logs:
            peers.wait_event(log, "round", 300, version=2)

        lab.partition(hosts[:2])
        t_split = time.time()
        time.sleep(SPLIT_S)
        lab.heal(reset_connections=reset)
        t_heal = time.time()

        deadline = t_heal + HEAL_TIMEOUT_S
        one = None
        while time.time() < deadline and peers.running():
            time.sleep(2.0)
            one = one_state_from(logs, t_heal)
            if one is not None and grouped_all_after(logs, one[1]):
                break
        assert one is not None and grouped_all_after(logs, one[1]), "not one swarm again"
        # the DHT is one again: through any peer, a newcomer reads all four fresh heads
        docs = statuses(hosts, maddrs, tmp_path)

    rounds = [events_of(log, "round") for log in logs]
    during = [[e for e in r if t_split < e["time"] <= t_heal] for r in rounds]
    failed = [e for log in logs for e in events_of(log, "round_failed")
              if t_split < e["time"] <= t_heal]  # fmt: skip
    v_heal = max(e["version"] for r in rounds for e in r if e["time"] <= t_heal)
    attempts = [
        sum(t_heal < e["time"] <= one[1] for e in events_of(log, "round", "round_failed"))
        for log in logs
    ]
    report = {
        "versions_in_split": [[e["version"] for e in d] for d in during],
        "longest_round_wait_s": max([e["comm_s"] for d in during for e in d]
                                    + [e["seconds"] for e in failed]),  # fmt: skip
        "version_at_heal": v_heal, "one_state_at": one[0], "one_state_s": round(one[1] - t_heal, 1),
        "rounds_to_one_state": attempts,
        "dht_rejoin_s": sorted(round(e["time"] - t_heal, 1) for log in logs
                               for e in events_of(log, "dht_rejoin") if e["time"] > t_heal),
    }  # fmt: skip
    print(json.dumps(report))  # -s shows the figures

    # during the split both sides kept committing, in groups of their own side, and no round
    # waited longer than the sync timeout plus the all-reduce timeout
    assert all(during), report
    assert all(e["group_size"] == 2 for d in during for e in d[1:]), report
    assert report["longest_round_wait_s"] <= SYNC_TIMEOUT_S + ALLREDUCE_TIMEOUT_S, report
    sides = [{e["state_hash"] for e in during[0] + during[1]},
             {e["state_hash"] for e in during[2] + during[3]}]  # fmt: skip
    assert not sides[0] & sides[1]  # two branches

    # one state within two versions of the heal (each peer's first round after the heal may
    # have been under way on its branch), then groups of all four
    assert one[0] <= v_heal + 2 and max(attempts) <= 2, report
    # the DHT healed: reads through any peer see all four heads, fresh, at one state. With the
    # connections lost, only the Rejoiner's pings could bring the other side back; with them
    # stalled, requests sent during the cut arrive late and may do it first (hivemind adds a
    # node that calls it), so there it is not always needed.
    assert report["dht_rejoin_s"] or not reset, report
    for doc in docs:
        assert len(doc["peers"]) == 4 and not doc["forks"], doc
        assert all(p["last_seen_s"] < 30 and p["version"] >= one[0] for p in doc["peers"]), doc

    # one side lost: each of its peers contributed its last δ again, once; the winners none
    again = [[e for e in events_of(log, "catch_up") if e["recontributed"]] for log in logs]
    losers = [i for i, a in enumerate(again) if a]
    assert losers in ([0, 1], [2, 3]), again
    assert all(len(again[i]) == 1 and again[i][0]["fork"] for i in losers), again
    # and every δ reached the state exactly once (none lost, none twice)
    for log in logs:
        applied, expected = contributed_steps_add_up(log)
        assert applied == expected, (log.name, applied, expected)
