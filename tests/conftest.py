"""Shared fixtures: a tiny run, its dataset and one torch thread for the engine tests; a local
swarm of real peer processes for the multi-peer tests."""

from __future__ import annotations

import compileall
import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

import diloco_peer
from diloco_peer.config import RunSpec
from diloco_peer.local_swarm import PEER_COMMAND, LocalSwarm
from diloco_peer.peer.data import TokenDataset, build_dataset

if TYPE_CHECKING:
    from diloco_peer.p2p.service import P2PService


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package once before the suite starts its hundreds of peer and CLI processes.

    Where PYTHONDONTWRITEBYTECODE is set (as on the machines we test on) no process writes
    bytecode, so each would compile every module it imports again: about 0.5 s of a 3.5 s start
    here. Where the folder is read-only the processes compile as before.
    """
    del config
    compileall.compile_dir(Path(diloco_peer.__file__).parent, quiet=2)


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


FAST_RUN = """
[run]
model = "nano"
inner_steps = 10
warmup_steps = 5
num_shards = 8

[swarm]
sync_timeout_s = 6.0
allreduce_timeout_s = 6.0
"""
"""A run.toml for multi-peer tests: nano, H = 10, short timeouts (sync)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran a local swarm shows the last lines of each peer's stderr: CI keeps
    only the printed output, not the test's folder."""
    del call
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    peers = getattr(item, "funcargs", {}).get("swarm")
    if report.when != "call" or not report.failed or not isinstance(peers, LocalSwarm):
        return
    tails = []
    for err in sorted(peers.folder.glob("*.err")):
        lines = err.read_text(errors="replace").splitlines()[-4:]
        tails.append(f"--- {err.name}\n" + "\n".join(line[:300] for line in lines))
    if tails:
        report.sections.append(("peers' stderr (last lines)", "\n".join(tails)))


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


@contextlib.contextmanager
def loopback_services(count: int = 2) -> Iterator[list[P2PService]]:
    """`count` real DHT nodes on 127.0.0.1, the later ones bootstrapped from the first, each
    with a ready P2P service; all shut down on the way out, whatever happens."""
    from hivemind.dht import DHT

    from diloco_peer.p2p.service import P2PService

    dhts: list[DHT] = []
    services: list[P2PService] = []
    try:
        for _ in range(count):
            maddrs = [str(m) for m in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs))
            services.append(P2PService(dhts[-1]))
            services[-1].start()
            services[-1].wait_until_ready(30)
        yield services
    finally:
        for service in services:
            service.shutdown()
        for dht in dhts:
            dht.shutdown()
