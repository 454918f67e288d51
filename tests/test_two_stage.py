"""Two-stage averaging in real peer processes on 127.0.0.1 (issue 19): a swarm larger than one
group keeps one replicated state, every version holding every group's δs; a peer killed in a
round costs only its own group's contribution."""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import pytest

from diloco_peer.local_swarm import LocalSwarm, branches
from diloco_peer.peer.events import read_log

RUN = """
[run]
model = "nano"
inner_steps = 10
warmup_steps = 5
num_shards = 8

[swarm]
protocol = "{protocol}"
group_size = 3
expected_peers = 6
sync_timeout_s = 10.0
allreduce_timeout_s = 8.0
"""


def start_six(swarm: LocalSwarm, tmp_path: Path, protocol: str, until: int,
              faults: dict[int, list[str]] | None = None) -> list[tuple[object, Path]]:  # fmt: skip
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(protocol=protocol))
    first, log = swarm.start("p0", "--config", str(cfg), "--until-version", str(until))
    maddr = swarm.address(log, 120, proc=first)
    peers = [(first, log)]
    for i in range(1, 6):
        extra = (faults or {}).get(i, [])
        peers.append(swarm.start(f"p{i}", "--swarm", maddr, "--until-version", str(until), *extra))
    return peers


def rounds(log: Path) -> dict[int, dict[str, object]]:
    return {e["version"]: e for e in read_log(log) if e["event"] == "round"}


@pytest.mark.multipeer
@pytest.mark.slow  # about 75 s: the two-stage rules have unit tests in the default suite
@pytest.mark.timeout(420)
def test_six_peers_in_groups_of_three_make_one_version_from_both_groups(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """Before two-stage averaging, 8 peers with group_size 4 forked at each of versions 1 to
    3 and then took turns as two chains (issue 19). Now both groups of each round combine."""
    peers = start_six(swarm, tmp_path, "sync", until=4)
    for proc, _ in peers:
        assert proc.wait(timeout=360) == 0  # type: ignore[attr-defined]
    logs = [log for _, log in peers]
    branch = branches(*logs)
    assert branch.one_branch, branch.conflicts
    assert max(branch.agreed) >= 4
    per_peer = [rounds(log) for log in logs]
    sizes = collections.Counter(e["group_size"] for r in per_peer for e in r.values())
    # a version holds both groups' δs: most round events name all six members
    assert sizes[6] >= 0.6 * sum(sizes.values()), sizes
    # every peer's δ went into (nearly) every version; what was not applied was kept
    for r in per_peer:
        assert len([v for v in r if v >= 1]) >= 3, sorted(r)
    failed = [e for log in logs for e in read_log(log) if e["event"] == "dropped"]
    assert not failed, failed
    # a six-member version's events time its stages: a delegate's combine, the others' wait
    whole = [e for r in per_peer for e in r.values() if e["group_size"] == 6]
    combined = [e for e in whole if "combine_s" in e]
    waited = [e for e in whole if "replay_wait_s" in e]
    assert combined and waited and len(combined) + len(waited) == len(whole), whole
    assert all(e["combine_s"] > 0 and e["settle_s"] >= 0 for e in combined)


@pytest.mark.slow
@pytest.mark.multipeer
@pytest.mark.timeout(480)
def test_a_peer_killed_in_a_round_costs_only_its_groups_contribution(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """Peer p5 SIGKILLs itself (the main process alone, as the OOM killer would) right after it
    joins its third group: its group's all-reduce fails, the other group's average still
    makes the version, and the swarm goes on with one state."""
    peers = start_six(swarm, tmp_path, "sync", until=7, faults={5: ["--fault", "kill-in-group=3"]})
    for i, (proc, _) in enumerate(peers):
        code = proc.wait(timeout=420)  # type: ignore[attr-defined]
        assert code == (-signal.SIGKILL if i == 5 else 0), (i, code)
    logs = [log for _, log in peers]
    branch = branches(*logs)
    assert branch.one_branch, branch.conflicts
    assert max(branch.agreed) >= 7
    survivors = [rounds(log) for log in logs[:5]]
    died_at = max(rounds(logs[5]))  # its last applied version; it died in the next round
    # the version after its death: made by a group without it (never all six)
    sizes = {e["group_size"] for r in survivors for v, e in r.items() if v == died_at + 1}
    assert sizes and max(sizes) <= 5, sizes
    # the kill cost its own group's round at most: later versions again hold all survivors
    late = [e["group_size"] for r in survivors for v, e in r.items() if v >= died_at + 3]
    assert late and max(late) == 5, late
