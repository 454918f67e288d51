"""Real peer processes on 127.0.0.1: the demo, joins, restarts, and bad input to `join`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import FAST_RUN, DemoRun

from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches
from diloco_peer.peer.events import read_log

PY = list(PEER_COMMAND)
NANO = ["--model", "nano", "--inner-steps", "10"]


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_demo_three_peers_agree_and_improve(demo_run: DemoRun) -> None:
    doc = demo_run.summary
    assert doc["hashes_agree"], doc
    assert all(p["final_version"] == doc["final_version"] for p in doc["peers"])
    assert doc["final_version"] >= 3
    assert doc["ppl_after"] < doc["ppl_before"]


# Slow phase: a late joiner's download runs in the default suite in tests/test_overlap_round.py
# (overlapped, beside a killed peer); the transfer's checks in tests/test_state_transfer.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", ["sync", "async"])
def test_late_joiner_downloads_verified_state_then_agrees(swarm: LocalSwarm, protocol: str) -> None:
    a, log_a = swarm.start("a", *NANO, "--protocol", protocol, "--expected-peers", "1",
                           "--max-rounds", "15")  # fmt: skip
    start = swarm.wait_event(log_a, "start", 90)
    swarm.wait_event(log_a, "round", 90, version=2)  # a alone: Lookahead rounds
    b, log_b = swarm.start("b", "--swarm", start["maddrs"][0], "--max-rounds", "3")
    caught = swarm.wait_event(log_b, "catch_up", 120)
    assert caught["version"] >= 2
    assert b.wait(timeout=150) == 0
    assert a.wait(timeout=150) == 0
    rounds_a = {e["version"]: e["state_hash"] for e in read_log(log_a) if e["event"] == "round"}
    rounds_b = {e["version"]: e["state_hash"] for e in read_log(log_b) if e["event"] == "round"}
    shared = set(rounds_a) & set(rounds_b)
    assert shared, (rounds_a, rounds_b)
    assert all(rounds_a[v] == rounds_b[v] for v in shared)
    assert any(e["group_size"] == 2 for e in read_log(log_b) if e["event"] == "round")


# Slow phase: the resume rule is tests/test_peer_state.py (peer checkpoint round trip).
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_restart_from_checkpoint_does_not_redo_rounds(swarm: LocalSwarm, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    a, log_a = swarm.start("a", *NANO, "--checkpoint-dir", str(ckpt), "--max-rounds", "2")
    assert a.wait(timeout=150) == 0
    first = [e for e in read_log(log_a) if e["event"] == "round"]
    assert [e["version"] for e in first] == [1, 2]
    # Same run, same checkpoint: it resumes at version 2 and continues to 4 (max-rounds counts
    # rounds done in total, so two more).
    a2, log_a2 = swarm.start("a2", *NANO, "--checkpoint-dir", str(ckpt), "--max-rounds", "4")
    assert a2.wait(timeout=150) == 0
    resumed = swarm.wait_event(log_a2, "resume", 5)
    assert resumed["version"] == 2 and resumed["state_hash"] == first[-1]["state_hash"]
    assert [e["version"] for e in read_log(log_a2) if e["event"] == "round"] == [3, 4]


def _join_fails(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PY, "join", "--run", "t", "--host", "127.0.0.1", "--quiet", "--threads", "1", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_bad_join_input_is_one_line_and_exit_2(tmp_path: Path, swarm: LocalSwarm) -> None:
    cases = [
        ["--swarm", "not-a-multiaddr"],
        ["--swarm", "/ip4/127.0.0.1/tcp/9/p2p/QmXjYsP9S8HxT5ZhGBXgoT2xpCs8cgaR4cvxcYXEqqv3Md"],
        ["--checkpoint-dir", str(tmp_path / "file" / "sub")],
        ["--client-mode"],  # founding: the founder must accept connections
        ["--owner", "not/a/peer/id"],
        [
            "--client-mode",
            "--announce",
            "/ip4/127.0.0.1/tcp/4000",
            "--swarm",
            "/ip4/127.0.0.1/tcp/9/p2p/QmXjYsP9S8HxT5ZhGBXgoT2xpCs8cgaR4cvxcYXEqqv3Md",
        ],
    ]
    (tmp_path / "file").write_text("a file where a folder should be")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases.append(["--port", str(busy.getsockname()[1])])
        # all at once: each case is a process of its own, and most of its time is imports
        with ThreadPoolExecutor(len(cases)) as pool:
            outs = list(pool.map(
                lambda args: _join_fails(tmp_path, *NANO if "--swarm" not in args else (), *args),
                cases,
            ))  # fmt: skip
    for args, out in zip(cases, outs, strict=True):
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (args, out.stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("diloco-peer: error:"), (args, lines)


@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_unknown_run_and_corrupt_checkpoint_exit_2(tmp_path: Path, swarm: LocalSwarm) -> None:
    a, log_a = swarm.start("a", *NANO, "--max-rounds", "50")
    start = swarm.wait_event(log_a, "start", 90)
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    bad = ckpt / "t.peer.safetensors"
    bad.write_bytes(b"\x00" * 64)
    # both at once: the unknown run waits out the manifest lookup, the other fails at once
    with ThreadPoolExecutor(2) as pool:
        unknown = pool.submit(
            subprocess.run,
            [*PY, "join", "--run", "other", "--host", "127.0.0.1", "--quiet",
             "--swarm", start["maddrs"][0]],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        corrupt = pool.submit(
            _join_fails, tmp_path, "--swarm", start["maddrs"][0], "--checkpoint-dir", str(ckpt)
        )
        out, spoiled = unknown.result(), corrupt.result()
    assert out.returncode == 2, out.stderr[-1500:]
    assert "no manifest" in out.stderr.lower() or "manifest" in out.stderr
    assert spoiled.returncode == 2, spoiled.stderr[-1500:]
    assert len(spoiled.stderr.strip().splitlines()) == 1
    assert bad.read_bytes() == b"\x00" * 64  # nothing overwritten


@pytest.mark.multipeer
@pytest.mark.slow  # about 40 s: two peers, one round
@pytest.mark.timeout(240)
def test_a_joiner_started_before_its_swarm_answers_tries_again_and_joins(
    tmp_path: Path, swarm: LocalSwarm
) -> None:
    # The founder's address is known before it runs (its key and port): the joiner's first
    # start finds nobody there (exit 2 before network.start_dht); the founder comes up while
    # the joiner waits to try again, and the joiner trains with it.
    from diloco_peer.identity import Identity

    owner = Identity.generate()
    key = tmp_path / "owner.key"
    owner.save(key)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{owner.peer_id_str}"
    joiner, jlog = swarm.start("joiner", "--swarm", address, "--max-rounds", "1", "--verbose")
    deadline = time.time() + 120
    err = tmp_path / "joiner.err"
    while "no peer of --swarm answered (try 1 of" not in err.read_text(errors="replace"):
        assert joiner.poll() is None and time.time() < deadline, err.read_text()[-2000:]
        time.sleep(0.2)
    founder, flog = swarm.start("founder", *NANO, "--port", str(port), "--identity", str(key),
                                "--expected-peers", "2", "--max-rounds", "1")  # fmt: skip
    assert joiner.wait(timeout=180) == 0, err.read_text()[-2000:]
    assert founder.wait(timeout=60) == 0
    rounds = [e for e in read_log(jlog) if e["event"] == "round"]
    assert rounds and rounds[0]["group_size"] == 2, rounds
    assert owner.peer_id_str in rounds[0]["members"], rounds


ASYNC_FAST_RUN = FAST_RUN.replace("[swarm]", 'outer_optimizer = "delayed-nesterov"\n\n[swarm]') + (
    'protocol = "async"\ngrace_s = 2.0\nexpected_peers = 4\n'
)


# Slow phase: absent peers in tests/test_swarm_view.py, failed groups in tests/test_round.py and tests/test_group_averager.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["sync", "async", "sync-overlap", "async-overlap"])
def test_killed_peers_cost_survivors_at_most_a_timed_out_round(
    swarm: LocalSwarm, tmp_path: Path, protocol: str
) -> None:
    cfg = tmp_path / "run.toml"
    overlap = "overlap = true\n" if protocol.endswith("-overlap") else ""
    protocol = protocol.removesuffix("-overlap")
    cfg.write_text((FAST_RUN if protocol == "sync" else ASYNC_FAST_RUN) + overlap)
    until = ["--until-version", "14"]
    a, log_a = swarm.start("a", "--config", str(cfg), *until)
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until)
    c, log_c = swarm.start("c", "--swarm", maddr, *until)
    # d kills itself (SIGKILL) right after joining its second group: during an all-reduce.
    d, log_d = swarm.start("d", "--swarm", maddr, *until, "--fault", "kill-in-group=2")
    # c is killed by us while it trains, after its second applied round (async: not always
    # the next version, c may have caught up to it instead).
    swarm.wait_event(log_c, "round", 150)
    swarm.wait_event(log_c, "round", 60, count=2)
    time.sleep(0.3)
    os.killpg(c.pid, signal.SIGKILL)
    assert a.wait(timeout=200) == 0
    assert b.wait(timeout=60) == 0
    assert d.wait(timeout=60) == -signal.SIGKILL
    ra = {e["version"]: e for e in read_log(log_a) if e["event"] == "round"}
    rb = {e["version"]: e for e in read_log(log_b) if e["event"] == "round"}
    # d took part before dying: its exit code says it was killed joining its second group, and
    # its first group's round ended before that: applied, or (async) given up because another
    # group committed that version first (CI, once: "the swarm moved past our base to v1")
    assert any(e["event"] in ("round", "round_failed") for e in read_log(log_d))
    branch = branches(log_a, log_b)
    assert branch.one_branch, branch.conflicts
    hashes = branch.agreed
    assert max(hashes) >= 14
    if protocol == "sync":
        assert max(ra) == 14 and max(rb) == 14
        # Nobody waited past the sync timeout plus the all-reduce timeout (plus slack).
        waits = [e["comm_s"] for e in [*ra.values(), *rb.values()]]
        assert max(waits) < 6.0 + 6.0 + 4.0, waits
        # The dead peers stopped being waited for: the last rounds are pairs.
        assert ra[14]["group_size"] == 2 and rb[14]["group_size"] == 2
    else:
        # Async never waits for the dead: a group closes after the grace period (2 s), an
        # all-reduce with a dead member fails within its timeout (6 s).
        waits = [e["comm_s"] for e in [*ra.values(), *rb.values()]]
        assert max(waits) < 2.0 + 6.0 + 4.0, waits
        late = [e for e in [*ra.values(), *rb.values()] if e["version"] > max(hashes) - 4]
        assert late and all(e["group_size"] <= 2 for e in late), late


# Slow phase: signals in tests/test_peer_parts.py, status in tests/test_swarm_view.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_sigterm_saves_a_checkpoint_and_status_lists_peers(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    a, log_a = swarm.start("a", *NANO, "--checkpoint-dir", str(ckpt))
    start = swarm.wait_event(log_a, "start", 90)
    swarm.wait_event(log_a, "round", 90, version=1)
    out = subprocess.run(
        [*PY, "status", "--swarm", start["maddrs"][0], "--run", "t", "--json"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-1500:]
    doc = json.loads(out.stdout)
    assert [p["peer_id"] for p in doc["peers"]] == [start["peer"]]
    assert doc["head_version"] >= 1 and doc["forks"] == {}
    assert doc["peers"][0]["rss_mb"] > 10 and doc["peers"][0]["cpu_percent"] >= 0
    assert 0 < doc["peers"][0]["utilization"] <= 1  # after its first applied round
    os.killpg(a.pid, signal.SIGTERM)
    assert a.wait(timeout=60) == 0
    stop = swarm.wait_event(log_a, "stop", 5)
    assert (ckpt / "t.peer.safetensors").is_file()
    assert stop["version"] >= 1


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_manifest_of_another_protocol_version_is_refused(tmp_path: Path) -> None:
    import time as _time

    from hivemind.dht import DHT

    from diloco_peer.config import RunSpec, SwarmSettings
    from diloco_peer.coordinator_free.manifest import PROTOCOL_VERSION, Manifest
    from diloco_peer.coordinator_free.records import publish_manifest, record_validators
    from diloco_peer.identity import Identity

    owner = Identity.generate()
    key = tmp_path / "owner.key"
    owner.save(key)
    future = Manifest(
        run_name="t", protocol_version=PROTOCOL_VERSION + 1, run=RunSpec(model="nano"),
        swarm=SwarmSettings(), owner_public_key=owner.public_key, created=_time.time(),
    ).sign(owner)  # fmt: skip
    dht = DHT(
        start=True, identity_path=str(key), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=record_validators(owner, "t"),
    )  # fmt: skip
    try:
        assert publish_manifest(dht, owner, future, expiration_s=120, timeout_s=10)
        out = _join_fails(tmp_path, "--swarm", str(dht.get_visible_maddrs()[0]))
    finally:
        dht.shutdown()
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-1500:]
    assert len(lines) == 1 and "protocol version" in lines[0], lines


class _Forwarder:
    """A TCP port forward, as a home router's: connections to `listen` reach `target`."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        import threading

        self.target = target
        self.connections = 0
        self.server = socket.create_server(listen)
        self.server.settimeout(0.5)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.target, timeout=5)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(None)
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.server.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_announced_address_is_what_others_dial(swarm: LocalSwarm) -> None:
    # a listens on 127.0.0.2 but is reachable only through a port forward on 127.0.0.3 (its
    # "public" address); it announces that one, and b joins through it.
    port, public = _free_port("127.0.0.2"), _free_port("127.0.0.3")
    forward = _Forwarder(("127.0.0.3", public), ("127.0.0.2", port))
    try:
        announce = f"/ip4/127.0.0.3/tcp/{public}"
        a, log_a = swarm.start(
            "a", *NANO, "--host", "127.0.0.2", "--port", str(port), "--announce", announce,
            "--max-rounds", "2", "--expected-peers", "2",
        )  # fmt: skip
        start = swarm.wait_event(log_a, "start", 90)
        assert start["maddrs"] and all(m.startswith(announce + "/p2p/") for m in start["maddrs"])
        b, log_b = swarm.start("b", "--swarm", start["maddrs"][0], "--max-rounds", "2")
        assert b.wait(timeout=150) == 0 and a.wait(timeout=60) == 0
        assert forward.connections >= 1
        rounds_b = [e for e in read_log(log_b) if e["event"] == "round"]
        assert rounds_b and rounds_b[0]["group_size"] == 2, rounds_b
    finally:
        forward.close()


# Slow phase: the fork vote in tests/test_swarm_view.py, re-contribution in tests/test_peer_parts.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
@pytest.mark.parametrize("overlap", [[], ["--overlap"]], ids=["blocking", "overlapped"])
def test_fork_is_healed_and_the_losers_delta_contributed_again(
    swarm: LocalSwarm, overlap: list[str]
) -> None:
    # Both peers apply their first δ alone at version 0 (a test hook hides the other one), so
    # version 1 exists twice. The branch that wins (the longer one, or the larger hash at equal
    # length) is downloaded by the other peer, which puts its lost δ into its next group.
    alone = ["--fault", "alone-rounds=1"]
    until = ["--until-version", "4"]
    # a waits for b before its first round (the hook hides b only once a has trained): alone,
    # a reached version 4 in about 5 s, before b had finished its reachability probe, and
    # there was no fork to heal.
    a, log_a = swarm.start("a", *NANO, "--expected-peers", "2", *until, *alone, *overlap)
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until, *alone)
    assert a.wait(timeout=150) == 0 and b.wait(timeout=60) == 0
    events = {"a": read_log(log_a), "b": read_log(log_b)}
    first = {k: next(e for e in ev if e["event"] == "round") for k, ev in events.items()}
    assert first["a"]["version"] == first["b"]["version"] == 1
    assert first["a"]["state_hash"] != first["b"]["state_hash"]  # the fork
    heals = {
        k: [e for e in ev if e["event"] == "catch_up" and e["fork"]] for k, ev in events.items()
    }
    assert sorted(len(h) for h in heals.values()) == [0, 1], heals
    loser = "a" if heals["a"] else "b"
    winner = "b" if loser == "a" else "a"
    heal = heals[loser][0]
    assert heal["recontributed"] and heal["from_version"] == 1
    won = {e["version"]: e["state_hash"] for e in events[winner] if e["event"] == "round"}
    assert won[heal["version"]] == heal["state_hash"]
    # From then on one branch: equal hashes at every version, groups of two.
    later = {k: {e["version"]: e for e in ev if e["event"] == "round" and e["version"] > heal["version"]}
             for k, ev in events.items()}  # fmt: skip
    shared = set(later["a"]) & set(later["b"])
    assert shared and all(
        later["a"][v]["state_hash"] == later["b"][v]["state_hash"] for v in shared
    )
    assert all(later["a"][v]["group_size"] == 2 for v in shared)
    # The loser's lost δ (10 steps) is contributed again exactly once, merged into one of its
    # next contributions (the next one, or the one after if it healed after training again).
    steps = [e["steps"] for _, e in sorted(later[loser].items())]
    assert sorted(steps)[-1] == 20 and sum(steps) == 10 * len(steps) + 10, steps
    assert 20 in steps[:2], steps


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


# Slow phase: the endpoint and its metrics in tests/test_peer_state.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_metrics_endpoint_answers_while_training(swarm: LocalSwarm) -> None:
    import re

    port = _free_port("127.0.0.1")
    a, log_a = swarm.start("a", *NANO, "--max-rounds", "4", "--metrics-port", str(port))
    swarm.wait_event(log_a, "round", 90, version=2)
    text = _scrape(port)
    sample = re.compile(r'^[a-z_]+\{peer="[^"]+",run="t"\} [-+0-9.eNaInf]+$')
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert lines and all(sample.match(x) for x in lines), text
    values = {x.split("{")[0]: float(x.rsplit(" ", 1)[1]) for x in lines}
    assert values["diloco_peer_version"] >= 2 and values["diloco_peer_rounds_total"] >= 2
    for name in ("diloco_peer_loss", "diloco_peer_ppl", "diloco_peer_idle_fraction",
                 "diloco_peer_bytes_sent_total", "diloco_peer_group_size", "diloco_peer_bans",
                 "diloco_peer_bans_total"):  # fmt: skip
        assert name in values, name
    assert values["diloco_peer_bans"] == 0  # nobody to ban here (tests/test_trust_swarm.py)
    assert 0 < values["diloco_peer_compute_utilization"] <= 1
    # alone, a peer trains nearly all the time: each round event says how much
    assert all(0 < e["utilization"] <= 1 for e in read_log(log_a) if e["event"] == "round")
    assert "# TYPE diloco_peer_rounds_total counter" in text
    assert a.wait(timeout=120) == 0


# Slow phase: departures in tests/test_swarm_view.py, the partial δ in tests/test_peer_state.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_paused_peer_is_not_waited_for_and_catches_up_after_resume(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(FAST_RUN)  # sync, 6 s group timeout
    a, log_a = swarm.start("a", "--config", str(cfg), "--until-version", "16")
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, "--until-version", "16")
    first = swarm.wait_event(log_b, "round", 90)
    os.kill(b.pid, signal.SIGUSR1)
    paused = swarm.wait_event(log_b, "pause", 30)
    # a goes on alone: its version passes b's by 3 while b is paused.
    swarm.wait_event(log_a, "round", 90, version=paused["version"] + 3)
    os.kill(b.pid, signal.SIGUSR2)
    resumed = swarm.wait_event(log_b, "unpause", 30)
    assert a.wait(timeout=120) == 0 and b.wait(timeout=60) == 0
    caught = [
        e for e in read_log(log_b) if e["event"] == "catch_up" and e["time"] > resumed["time"]
    ]
    assert caught and caught[0]["version"] >= paused["version"] + 3
    rounds_a = [e for e in read_log(log_a) if e["event"] == "round"]
    # Nobody waited on the paused peer longer than the group timeout plus the all-reduce's.
    assert max(e["comm_s"] for e in rounds_a) < 6.0 + 6.0 + 4.0
    during = [e for e in rounds_a if paused["time"] < e["time"] < resumed["time"]]
    assert during and all(e["group_size"] == 1 for e in during[1:])
    # Resumed, b trains with a again and they agree.
    rounds_b = {e["version"]: e for e in read_log(log_b) if e["event"] == "round"}
    after = [v for v in rounds_b if v > caught[0]["version"]]
    assert after and all(rounds_b[v]["group_size"] == 2 for v in after)
    hashes_a = {e["version"]: e["state_hash"] for e in rounds_a}
    assert all(hashes_a[v] == rounds_b[v]["state_hash"] for v in after)
    assert first["group_size"] == 2


# Slow phase: run_ended and TensorBoard in tests/test_peer_state.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_max_hours_stops_the_peer_and_tensorboard_gets_scalars(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    # 0.004 h = 14.4 s: the peer stops on its own, long before 1000 rounds.
    launched = time.time()
    a, log_a = swarm.start(
        "a", *NANO, "--max-rounds", "1000", "--max-hours", "0.004", "--tensorboard", str(tb),
        "--batch-size", "auto",
    )  # fmt: skip
    assert a.wait(timeout=150) == 0
    stop = swarm.wait_event(log_a, "stop", 1)
    assert 14.4 <= stop["time"] - launched < 14.4 + 30
    rounds = [e for e in read_log(log_a) if e["event"] == "round"]
    assert 1 <= len(rounds) < 1000
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"diloco/loss", "diloco/group_size", "diloco/comm_s"} <= set(acc.Tags()["scalars"])
    steps = [s.step for s in acc.Scalars("diloco/loss")]
    assert steps == [e["version"] for e in rounds]


# Slow phase: the pending δ in the checkpoint in tests/test_peer_state.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_a_pending_delta_survives_a_restart(swarm: LocalSwarm, tmp_path: Path) -> None:
    # Paused mid-phase, the peer keeps its partial δ; stopped, it saves it in its checkpoint;
    # restarted, it contributes it with its next phase.
    ckpt = tmp_path / "ckpt"
    a, log_a = swarm.start("a", *NANO, "--checkpoint-dir", str(ckpt), "--throttle", "4")
    swarm.wait_event(log_a, "round", 90, version=1)
    os.kill(a.pid, signal.SIGUSR1)
    paused = swarm.wait_event(log_a, "pause", 30)
    os.killpg(a.pid, signal.SIGTERM)
    assert a.wait(timeout=60) == 0
    a2, log_a2 = swarm.start("a2", *NANO, "--checkpoint-dir", str(ckpt), "--max-rounds", "3")
    assert a2.wait(timeout=120) == 0
    resumed = swarm.wait_event(log_a2, "resume", 1)
    assert resumed["pending_steps"] == paused["pending_steps"]
    first = next(e for e in read_log(log_a2) if e["event"] == "round")
    assert first["steps"] == 10 + paused["pending_steps"]
