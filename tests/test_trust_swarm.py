"""Hostile and unlisted peers in real swarms (issue 5): `join --chaos`, `--allowlist`, `status`.

The full matrix (5 honest + 1 hostile, every chaos mode, against the honest peers alone) is
bench/chaos_swarm.py; here a smaller swarm runs the attacks each caught by a different layer.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from diloco_peer.coordinator_free.allowlist import Allowlist
from diloco_peer.identity import Identity
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches
from diloco_peer.peer.events import read_log

PY = list(PEER_COMMAND)

NANO = ["--model", "nano", "--inner-steps", "10"]


def _maddr(peers: LocalSwarm, log: Path) -> str:
    start = peers.wait_event(log, "start", 90)
    return next(m for m in start["maddrs"] if "127.0.0.1" in m)


def _wait_all(procs: list, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.time()))


# Slow phase: each layer's rule has unit tests (admission in tests/test_trust.py, the reducers'
# screening in tests/test_robust.py, bans in tests/test_peer_parts.py and test_contribution.py).
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
# one attack per layer; bench/chaos_swarm.py runs all eight
@pytest.mark.parametrize("mode", ["nan", "signflip", "forge"])
def test_a_hostile_peer_is_excluded_banned_and_shown(swarm: LocalSwarm, mode: str) -> None:
    """3 honest peers + 1 hostile: nan is caught by the part reducers, signflip by their
    direction check, forge at admission. Honest states stay finite and on one branch, the
    hostile peer's δ is in no average. nan and signflip are banned (each honest reducer saw the
    bad part on the hostile peer's own stream) and `status` shows it while the run is live; a
    forged header is nothing the hostile key signed (the leader could have made it up), so it
    is excluded in every round but banned by nobody (issue 16, item 3)."""
    founder, flog = swarm.start("h0", *NANO, "--expected-peers", "4", "--until-version", "4")
    addr = ["--swarm", _maddr(swarm, flog)]
    honest = [(founder, flog)] + [
        swarm.start(f"h{i}", *addr, "--until-version", "4") for i in (1, 2)
    ]
    _, hlog = swarm.start("hostile", *addr, "--chaos", mode)
    hostile = swarm.wait_event(hlog, "start", 90)["peer"]
    excluded = swarm.wait_event(flog, "excluded", 200, excluded_peer=hostile)
    out = subprocess.run(
        [*PY, "status", *addr, "--run", "t", "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    banned = mode != "forge"
    assert (hostile in status["banned"]) is banned, status
    assert excluded["banned"] is banned, excluded
    _wait_all([p for p, _ in honest], 200)
    logs = [log for _, log in honest]
    branch = branches(*logs)
    assert branch.one_branch, branch.conflicts
    rounds = [e for log in logs for e in read_log(log) if e["event"] == "round"]
    assert rounds and all(e["ppl"] is not None for e in rounds)
    assert not any(hostile in e["members"] for e in rounds)
    stops = [next(e for e in read_log(log) if e["event"] == "stop") for log in logs]
    assert all(s["finite"] and s["version"] >= 4 for s in stops), stops
    assert all((hostile in s["bans"]) is banned for s in stops), stops
    expected = {"nan": "non-finite", "signflip": "cosine", "forge": "signature"}[mode]
    assert expected in excluded["reason"], excluded


_QUICK_TIMEOUTS = """
[run]
model = "nano"
inner_steps = 10
warmup_steps = 5
num_shards = 8

[swarm]
sync_timeout_s = 10.0
allreduce_timeout_s = 8.0
expected_peers = 4
"""


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_member_that_never_sends_its_parts_stalls_one_round_not_the_swarm(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """Issue 16, item 4 (the real run: four honest peers and one patched never to send its
    parts stayed at one version for 12 minutes). 3 honest peers + 1 `--chaos silent`: the
    honest peers name it after the round it stalls, hold it absent and leave it out of the
    retry, so they reach version 4 on one branch without it, banning nobody."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(_QUICK_TIMEOUTS)
    founder, flog = swarm.start("h0", "--config", str(cfg), "--until-version", "4")
    addr = ["--swarm", _maddr(swarm, flog)]
    honest = [(founder, flog)] + [
        swarm.start(f"h{i}", *addr, "--until-version", "4") for i in (1, 2)
    ]
    _, hlog = swarm.start("hostile", *addr, "--chaos", "silent")
    hostile = swarm.wait_event(hlog, "start", 90)["peer"]
    _wait_all([p for p, _ in honest], 240)
    logs = [log for _, log in honest]
    branch = branches(*logs)
    assert branch.one_branch, branch.conflicts
    events = [e for log in logs for e in read_log(log)]
    named = [e for e in events if e["event"] == "silent"]
    assert named and all(e["silent_peers"] == [hostile] for e in named), named
    rounds = [e for e in events if e["event"] == "round"]
    assert max(e["version"] for e in rounds) >= 4
    assert not any(hostile in e["members"] for e in rounds)
    stops = [e for e in events if e["event"] == "stop"]
    assert all(s["finite"] and s["version"] >= 4 and not s["bans"] for s in stops), stops
    failed = [e for e in events if e["event"] == "round_failed"]
    assert len(failed) <= 3 * len(logs), failed  # not a failed round per try, as before


@pytest.mark.multipeer
@pytest.mark.slow  # about 55 s; the allowlist's rules have unit tests in test_allowlist.py
@pytest.mark.timeout(480)
def test_a_private_swarm_admits_only_listed_keys(swarm: LocalSwarm, tmp_path: Path) -> None:
    """Two listed peers train together; a third key, not on the allowlist, gets no state and
    none of its contributions into an average; a key carrying an allowlist not signed by the
    run owner is refused at start."""
    owner, member, stranger = (Identity.generate() for _ in range(3))
    keys = {}
    for name, identity in (("owner", owner), ("member", member), ("stranger", stranger)):
        keys[name] = tmp_path / f"{name}.key"
        identity.save(keys[name])
    allowlist = tmp_path / "allowlist"
    Allowlist.create(owner, "t", [owner.public_key, member.public_key]).save(allowlist)
    private = ["--allowlist", str(allowlist)]
    # The listed peers train until the stranger has been refused and they reached version 3,
    # then leave (SIGTERM): on a loaded machine the stranger may take long to start, and it
    # must find the swarm live.
    founder, flog = swarm.start(
        "owner", *NANO, "--identity", str(keys["owner"]), *private, "--until-version", "1000"
    )
    addr = ["--swarm", _maddr(swarm, flog)]
    peer, plog = swarm.start(
        "member", *addr, "--identity", str(keys["member"]), *private, "--until-version", "1000"
    )
    _, slog = swarm.start("stranger", *addr, "--identity", str(keys["stranger"]))
    # a key with a list of its own making is refused at start, while the swarm is live
    rogue = Identity.generate()
    keys["rogue"] = tmp_path / "rogue.key"
    rogue.save(keys["rogue"])
    own_list = tmp_path / "own-list"
    Allowlist.create(rogue, "t", [rogue.public_key]).save(own_list)
    out = subprocess.run(
        [*PY, "join", "--run", "t", *addr, "--identity", str(keys["rogue"]), "--quiet",
         "--host", "127.0.0.1", "--allowlist", str(own_list)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "not by the run owner" in out.stderr and "Traceback" not in out.stderr
    deadline = time.time() + 240
    while time.time() < deadline:
        refused = "not allowed" in (tmp_path / "stranger.err").read_text()
        versions = [e["version"] for e in read_log(flog) if e["event"] == "round"]
        if refused and versions and max(versions) >= 3:
            break
        time.sleep(1.0)
    for proc in (founder, peer):
        proc.send_signal(signal.SIGTERM)
    _wait_all([founder, peer], 120)
    branch = branches(flog, plog)
    assert branch.one_branch, branch.conflicts
    rounds = [e for log in (flog, plog) for e in read_log(log) if e["event"] == "round"]
    assert max(e["version"] for e in rounds) >= 3
    assert not any(stranger.peer_id_str in e["members"] for e in rounds)
    # the stranger never held the swarm's state: no catch-up, and it stayed at version 0 or
    # on a branch of its own
    branch = branches(flog, plog)
    assert branch.one_branch, branch.conflicts
    agreed = branch.agreed
    stranger_states = [
        (e["version"], e["state_hash"])
        for e in read_log(slog)
        if e["event"] in ("round", "catch_up")
    ]
    assert not any(e["event"] == "catch_up" for e in read_log(slog))
    assert not any(agreed.get(v) == h for v, h in stranger_states if v > 0)
    assert "not allowed" in (tmp_path / "stranger.err").read_text()


# Slow phase: corruption in tests/test_peer_state.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_a_peer_checkpoint_with_a_flipped_byte_is_refused_and_kept(tmp_path: Path) -> None:
    """A founder trains one round alone and checkpoints; one byte flipped anywhere (tensor
    data or metadata) makes the restart fail with one line and exit 2, the file untouched."""
    ckpt = tmp_path / "ck"
    key = tmp_path / "owner.key"
    Identity.generate().save(key)
    base = [*PY, "join", "--run", "t", "--host", "127.0.0.1", "--quiet", "--threads", "1",
            "--identity", str(key), "--checkpoint-dir", str(ckpt)]  # fmt: skip
    out = subprocess.run(
        [*base, *NANO, "--max-rounds", "1"], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    [path] = ckpt.glob("*.safetensors")
    good = path.read_bytes()
    header_len = int.from_bytes(good[:8], "little")
    for position in (8 + header_len // 2, len(good) - 5):  # in the metadata, in a tensor
        bad = bytearray(good)
        bad[position] ^= 0x01
        path.write_bytes(bytes(bad))
        out = subprocess.run(base, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "corrupt" in out.stderr or "unreadable" in out.stderr, out.stderr
        assert path.read_bytes() == bytes(bad)  # nothing overwritten


_RIVAL = """
import sys, time
from hivemind.dht import DHT
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.manifest import Manifest
from diloco_peer.identity import Identity

rival = Identity.generate()
dht = DHT(start=True, initial_peers=[sys.argv[1]], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
          record_validators=records.record_validators(rival, "t"))
fake = Manifest.create("t", RunSpec(model="nano", seed=666), SwarmSettings(), rival)
assert records.publish_manifest(dht, rival, fake, expiration_s=600, timeout_s=30)
print(rival.peer_id_str, flush=True)
time.sleep(600)
"""


# Slow phase: the choice between owners runs on real DHT nodes in tests/test_manifest_records.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_a_rival_manifest_under_the_run_name_locks_nobody_out(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """Any key may publish a manifest under a run's name (issue 16, item 6): a joiner told the
    founder's address, or given `--owner`, follows the owner's and ignores the rival's."""
    a, log_a = swarm.start("a", "--model", "nano", "--inner-steps", "10")
    start = swarm.wait_event(log_a, "start", 90, proc=a)
    maddr = start["maddrs"][0]
    rival = subprocess.Popen([*PEER_COMMAND[:1], "-c", _RIVAL, maddr], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)  # fmt: skip
    swarm.procs.append(rival)  # stopped with the swarm
    assert rival.stdout is not None and rival.stdout.readline().startswith("Qm")
    b, log_b = swarm.start("b", "--swarm", maddr, "--max-rounds", "1")
    c, log_c = swarm.start("c", "--swarm", maddr, "--owner", start["peer"], "--max-rounds", "1")
    # b and c are in when they hold the owner's state; their rounds are not this test's subject.
    # A joiner that misses the founder's group with the other joiner, while the founder then
    # commits alone, can stay behind for good: the other's departure counts toward the quorum a
    # download needs, so the founder's state, one key's, is only replayed, and the replay window
    # is one version (seen in a CI run: c and a made v7, c left, a went on alone to v13, and b
    # stayed at v6 with "no group formed"; the catch-up liveness gap, its own issue)
    for proc, log in ((b, log_b), (c, log_c)):
        swarm.wait_event(log, "catch_up", 90, proc=proc)
    for log in (log_b, log_c):
        assert (
            next(e for e in read_log(log) if e["event"] == "start")["manifest"] == start["manifest"]
        )
