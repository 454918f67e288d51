"""Shared fixtures: a tiny run, its dataset and one torch thread for the engine tests; a local
swarm of real peer processes for the multi-peer tests."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_peer.config import RunSpec
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm
from diloco_peer.peer.data import TokenDataset, build_dataset

# Everything the engine tests train: the nano model on short sequences of a small corpus slice.
SMALL_RUN = RunSpec(
    model="nano",
    max_tokens=200_000,
    seq_len=32,
    batch_size=4,
    val_sequences=8,
    inner_steps=5,
    warmup_steps=5,
)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: fast on a shared two-core box and bit-reproducible on CPU.

    The simulator calls torch.set_num_threads itself, so the previous count is restored after
    the test rather than leaking into the next one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_run() -> RunSpec:
    return SMALL_RUN


@pytest.fixture(scope="session")
def small_dataset() -> TokenDataset:
    r = SMALL_RUN
    return build_dataset(r.data, r.tokenizer, r.seq_len, r.val_sequences, r.max_tokens, r.seed)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    """Peers of run `t` on 127.0.0.1 (quiet, one thread each), their logs in the test's folder;
    every one is killed with its whole session when the test ends, whatever the outcome."""
    with LocalSwarm(tmp_path, run="t") as peers:
        yield peers


@dataclass(frozen=True)
class DemoRun:
    """One `diloco-peer demo --json` of real peer processes, with every peer's event log."""

    summary: dict[str, Any]
    log: Path


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """A 3-peer demo (nano, 3 versions), run once for the tests that check it and plot it."""
    log = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    out = subprocess.run(
        [*PEER_COMMAND, "demo", "--peers", "3", "--rounds", "3", "--model", "nano",
         "--inner-steps", "20", "--json", "--timeout-s", "200", "--log-json", str(log)],
        capture_output=True, text=True, timeout=230, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return DemoRun(json.loads(out.stdout), log)
