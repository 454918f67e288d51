"""The swarm runs the engine's math: real peers against `simulate`, and recorded async updates
replayed through the engine's Delayed Nesterov."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm, branches
from diloco_peer.peer.events import read_log

PY = list(PEER_COMMAND)

EQUIV_RUN = """
[run]
model = "nano"
inner_steps = 10
warmup_steps = 5
num_shards = 2
schedule_steps = 30
max_tokens = 400000

[swarm]
expected_peers = 2
sync_timeout_s = 60.0
allreduce_timeout_s = 30.0
"""


def _nano_param_names() -> list[str]:
    from diloco_peer.peer.model import build_model

    model = build_model("nano", 256, 0, max_seq_len=128)
    return [name for name, _ in model.named_parameters()]


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_two_peer_swarm_equals_simulator(swarm: LocalSwarm, tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(EQUIV_RUN)
    ckpt_a, ckpt_b = tmp_path / "a", tmp_path / "b"
    a, log_a = swarm.start(
        "a", "--config", str(cfg), "--shard", "0", "--max-rounds", "3",
        "--checkpoint-dir", str(ckpt_a),
    )  # fmt: skip
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start(
        "b", "--swarm", maddr, "--shard", "1", "--max-rounds", "3",
        "--checkpoint-dir", str(ckpt_b),
    )  # fmt: skip
    sim_out = tmp_path / "sim.safetensors"
    sim = subprocess.run(
        [*PY, "simulate", "--algo", "sync", "--workers", "2", "--total-steps", "60",
         "--inner-steps", "10", "--warmup-steps", "5", "--num-shards", "2",
         "--schedule-steps", "30", "--max-tokens", "400000", "--model", "nano",
         "--threads", "1", "--save", str(sim_out), "--json"],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-2000:]
    assert a.wait(timeout=150) == 0 and b.wait(timeout=60) == 0
    rounds = [e for e in read_log(log_a) if e["event"] == "round"]
    assert [e["group_size"] for e in rounds] == [2, 2, 2], rounds
    expected = load_file(sim_out)
    for ckpt in (ckpt_a, ckpt_b):
        got = load_file(ckpt / "t.peer.safetensors")
        for i, name in enumerate(_nano_param_names()):
            theta, ref = got[f"global.theta.{i}"], expected[name]
            rel = (theta - ref).norm() / ref.norm()
            assert rel < 1e-5, (name, float(rel))


ASYNC_RUN = """
[run]
model = "nano"
inner_steps = 12
warmup_steps = 5
num_shards = 4
outer_optimizer = "delayed-nesterov"
outer_lr = 1.0
max_tokens = 400000

[swarm]
protocol = "async"
expected_peers = 3
grace_s = 2.0
allreduce_timeout_s = 20.0
eval_every = 0
keep_updates = 16
"""


# Slow phase: the outer step is tests/test_outer.py; the sync twin stays in the default suite.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_async_swarm_updates_are_the_engines_delayed_nesterov(
    swarm: LocalSwarm,
    tmp_path: Path,
) -> None:
    from diloco_peer.averaging.outer import build_outer_optimizer
    from diloco_peer.averaging.state import ReplicatedState
    from diloco_peer.coordinator_free.update_log import UpdateRecord
    from diloco_peer.peer.model import build_model

    cfg = tmp_path / "run.toml"
    cfg.write_text(ASYNC_RUN)
    rec = tmp_path / "updates"
    until = ["--until-version", "12"]
    a, log_a = swarm.start("a", "--config", str(cfg), *until, "--record-updates", str(rec))
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until, "--throttle", "2")
    c, log_c = swarm.start("c", "--swarm", maddr, *until, "--throttle", "4")
    for p in (a, b, c):
        assert p.wait(timeout=240) == 0
    logs = [read_log(x) for x in (log_a, log_b, log_c)]
    branch = branches(log_a, log_b, log_c)
    assert branch.one_branch, branch.conflicts
    rounds = [e for events in logs for e in events if e["event"] == "round"]
    # DyLU: the throttled peers planned fewer steps than H once their speed was known.
    steps_c = [e["steps"] for e in logs[2] if e["event"] == "round"]
    assert steps_c and min(steps_c) < 12, steps_c
    assert all("staleness" in e for e in rounds)

    # Replay what peer a applied (its own groups and the updates it replayed), from the
    # manifest's initial state, through the engine's Delayed Nesterov. Where a applied no update
    # but downloaded the state (joining, or healing a fork), the replay restarts from that state.
    files = sorted(rec.glob("update-*.safetensors"))
    records = [UpdateRecord.from_bytes(f.read_bytes()) for f in files]
    assert len(records) >= 10 and records[0].base_version == 0
    start_a = next(e for e in logs[0] if e["event"] == "start")
    init = build_model("nano", 256, 0, max_seq_len=128)
    outer = build_outer_optimizer("delayed-nesterov", lr=1.0, momentum=0.9, buffer_size=3, c=0.0)
    state = ReplicatedState([p.detach() for p in init.parameters()], outer, 4, start_a["manifest"])
    assert state.hash() == start_a["state_hash"]
    restarts = 0
    for r in records:
        if state.hash() != r.base_hash:
            snapshot = rec / f"state-{r.base_version:08d}.safetensors"
            data = snapshot.read_bytes()
            state.load(st_load(data), _metadata(data))
            assert state.hash() == r.base_hash
            restarts += 1
        with torch.no_grad():
            outer.step(state.theta, [t * r.count for t in r.average], r.count)
        for shard, n in r.shard_samples.items():
            state.shard_samples[shard] += n
        state.version += 1
        assert state.hash() == r.result_hash, r.base_version
    assert restarts <= 2, restarts
    stop_a = next(e for e in logs[0] if e["event"] == "stop")
    # At the end nobody waits for a last phase that will not be contributed (its peer clears
    # its phase's end from its head): every peer stops within a few grace periods of the last
    # commit, not after the settle limit (60 s).
    last_commit = max(e["time"] for e in rounds)
    stops = [next(e for e in events if e["event"] == "stop")["time"] for events in logs]
    assert max(stops) - last_commit < 20.0, [t - last_commit for t in stops]
    if records[-1].base_version + 1 == stop_a["version"]:
        assert state.hash() == stop_a["state_hash"]


def _metadata(data: bytes) -> dict[str, str]:
    import json
    import struct

    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])["__metadata__"]


# Slow phase: bit-identical codecs in tests/test_group_averager.py and tests/test_compression.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_int8_swarm_agrees_and_sends_a_quarter_of_the_bytes(
    swarm: LocalSwarm,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        EQUIV_RUN.replace("[swarm]", 'compression = "int8"\n\n[swarm]').replace(
            "num_shards = 2", "num_shards = 4"
        )
    )
    a, log_a = swarm.start("a", "--config", str(cfg), "--max-rounds", "2")
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, "--max-rounds", "2")
    assert a.wait(timeout=150) == 0 and b.wait(timeout=60) == 0
    ra = {e["version"]: e for e in read_log(log_a) if e["event"] == "round"}
    rb = {e["version"]: e for e in read_log(log_b) if e["event"] == "round"}
    assert set(ra) == set(rb) == {1, 2}
    numel = sum(p.numel() for p in _nano_params())
    fp32_pair = 2 * 4 * numel * (2 - 1) / 2  # butterfly traffic of a pair in fp32
    for v in (1, 2):
        assert ra[v]["state_hash"] == rb[v]["state_hash"] and ra[v]["group_size"] == 2
        for e in (ra[v], rb[v]):
            assert 0 < e["bytes_sent"] < fp32_pair / 3.5, (e["bytes_sent"], fp32_pair)
            assert 0 < e["bytes_received"] < fp32_pair / 3.5


def _nano_params() -> list[torch.Tensor]:
    from diloco_peer.peer.model import build_model

    return list(build_model("nano", 256, 0, max_seq_len=128).parameters())


STALE_RUN = """
[run]
model = "nano"
inner_steps = 12
warmup_steps = 5
outer_optimizer = "delayed-nesterov"

[swarm]
protocol = "async"
expected_peers = 2
grace_s = 0.5
staleness_limit = 0
eval_every = 0
"""


# Slow phase: the drop rule in tests/test_round.py.
@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(200)
def test_async_drops_contributions_older_than_the_staleness_limit(
    swarm: LocalSwarm,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(STALE_RUN)
    until = ["--until-version", "6"]
    a, log_a = swarm.start("a", "--config", str(cfg), *until)
    maddr = swarm.wait_event(log_a, "start", 90)["maddrs"][0]
    b, log_b = swarm.start("b", "--swarm", maddr, *until, "--throttle", "8")
    assert a.wait(timeout=150) == 0 and b.wait(timeout=90) == 0
    dropped = [e for e in read_log(log_b) if e["event"] == "dropped"]
    assert dropped, "the 8x slower peer never fell behind"
    assert all(e["staleness"] >= 1 and e["limit"] == 0 for e in dropped)
    assert [e["dropped_total"] for e in dropped] == list(range(1, len(dropped) + 1))
    # Every applied contribution was fresh (staleness 0), and the peers agree.
    rounds = [e for log in (log_a, log_b) for e in read_log(log) if e["event"] == "round"]
    assert all(e["staleness"] == 0 for e in rounds)
    branch = branches(log_a, log_b)
    assert branch.one_branch, branch.conflicts
