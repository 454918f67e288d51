"""The swarm runs the engine's math: real peers against `simulate`, and recorded async updates
replayed through the engine's Delayed Nesterov."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_swarm import PY, Swarm, _events, swarm  # noqa: F401  (fixture)

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
def test_two_peer_swarm_equals_simulator(swarm: Swarm, tmp_path: Path) -> None:  # noqa: F811
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
    rounds = [e for e in _events(log_a) if e["event"] == "round"]
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


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_async_swarm_updates_are_the_engines_delayed_nesterov(
    swarm: Swarm,  # noqa: F811
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
    logs = [_events(x) for x in (log_a, log_b, log_c)]
    by_version: dict[int, set[str]] = {}
    for events in logs:
        for e in events:
            if e["event"] in ("round", "catch_up"):
                by_version.setdefault(e["version"], set()).add(e["state_hash"])
    assert all(len(h) == 1 for h in by_version.values()), by_version
    rounds = [e for events in logs for e in events if e["event"] == "round"]
    # DyLU: the throttled peers planned fewer steps than H once their speed was known.
    steps_c = [e["steps"] for e in logs[2] if e["event"] == "round"]
    assert steps_c and min(steps_c) < 12, steps_c
    assert all("staleness" in e for e in rounds)

    # Replay what peer a applied (its own groups and the updates it caught up on), from the
    # manifest's initial state, through the engine's Delayed Nesterov.
    files = sorted(rec.glob("update-*.safetensors"))
    records = [UpdateRecord.from_bytes(f.read_bytes()) for f in files]
    stop_a = next(e for e in logs[0] if e["event"] == "stop")
    chain = [r.base_version for r in records]
    assert chain == list(range(chain[0], chain[0] + len(chain))) and chain[0] == 0, chain
    start_a = next(e for e in logs[0] if e["event"] == "start")
    init = build_model("nano", 256, 0, max_seq_len=128)
    outer = build_outer_optimizer("delayed-nesterov", lr=1.0, momentum=0.9, buffer_size=3, c=0.0)
    state = ReplicatedState([p.detach() for p in init.parameters()], outer, 4, start_a["manifest"])
    assert state.hash() == start_a["state_hash"]
    for r in records:
        assert state.hash() == r.base_hash
        with torch.no_grad():
            theta_sum = [t * r.count for t in r.average]
            outer.step(state.theta, theta_sum, r.count)
        for shard, n in r.shard_samples.items():
            state.shard_samples[shard] += n
        state.version += 1
        assert state.hash() == r.result_hash, r.base_version
    if records[-1].base_version + 1 == stop_a["version"]:
        assert state.hash() == stop_a["state_hash"]
