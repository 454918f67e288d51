"""State and update downloads between real peers on 127.0.0.1, plus unit tests of their
argument checks.

The donor is this same file run as a script (`python tests/test_state_transfer.py OUT_DIR`, see
`donor_main`), in its own process group with its DHT process and p2p daemon: one P2PService
shared by a GroupAverager and four StateServers ("full" serves a ~40 MB safetensors blob and an
update log of 3 real outer steps, "empty" has no state yet and no update log, "private" refuses
everyone, "junk" serves a malformed update). The requester is this pytest process: a DHT, one
P2PService. The donor is SIGKILLed (process group) in `finally`, whatever the outcome.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from safetensors.torch import save

from diloco_peer.averaging.group_averager import GroupAverager
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.coordinator_free.state_transfer import (
    CHUNK_BYTES,
    StateBlob,
    StateServer,
    StateTransferFailed,
    download_state,
    download_update,
)
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.p2p_service import P2PService

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
SLACK_S = 3.0
FULL_NUMEL = 10_000_000  # fp32: 40 MB of tensor data
FULL_VERSION = 7
UPDATES = 3
"""The donor's update log on run "full": versions 0 -> 1 -> 2 -> 3 of `initial_state()`."""
MODEL_SHAPES = [(256, 64), (64,), (3, 5, 7)]


def make_blob(version: int, numel: int, seed: int) -> StateBlob:
    """A state-like blob: safetensors bytes of one seeded tensor, hashed with sha256."""
    generator = torch.Generator().manual_seed(seed)
    data = save({"theta": torch.randn(numel, generator=generator)}, {"version": str(version)})
    return StateBlob(version=version, state_hash=hashlib.sha256(data).hexdigest(), data=data)


def initial_state() -> ReplicatedState:
    """Version 0 of a small replicated state, the same in every process."""
    generator = torch.Generator().manual_seed(11)
    theta = [torch.randn(s, generator=generator) for s in MODEL_SHAPES]
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    return ReplicatedState(theta, outer, num_shards=4, manifest_digest="m" * 64)


def record_updates(count: int) -> tuple[UpdateLog, str]:
    """Apply `count` seeded group averages to `initial_state()`, logging each; the log and the
    final state hash (what a head peer would advertise)."""
    state, log = initial_state(), UpdateLog(capacity=16)
    generator = torch.Generator().manual_seed(12)
    for round_ in range(count):
        average = tuple(torch.randn(s, generator=generator) * 1e-2 for s in MODEL_SHAPES)
        count_, shards = 2 + round_, {round_ % 4: 100 + round_}
        base_version, base_hash = state.version, state.hash()
        state.apply(list(average), count_, shards)
        log.append(
            UpdateRecord(
                base_version=base_version,
                base_hash=base_hash,
                result_hash=state.hash(),
                count=count_,
                shard_samples=shards,
                average=average,
                info={"members": "donor", "round": str(round_)},
            )
        )
    return log, state.hash()


def share_pair() -> tuple[list[torch.Tensor], float]:
    """What both peers contribute in the shared-service round (the same on both: mean = itself)."""
    return [torch.full((1000,), 2.0), torch.arange(6.0).reshape(2, 3)], 1.0


# --------------------------------------------------------------------------- the donor process


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def donor_main(out_dir: Path) -> None:
    """The donor: stdin JSON commands, one `@@ {json}` answer each (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    blob = make_blob(FULL_VERSION, FULL_NUMEL, seed=0)
    path = out_dir / "full.safetensors"
    path.write_bytes(blob.data)
    log, head_hash = record_updates(UPDATES)
    update_paths = []
    for version in range(UPDATES):
        data = log.get(version)  # the served bytes (safetensors metadata order varies by process)
        assert data is not None
        update_paths.append(str(out_dir / f"update.{version}.safetensors"))
        Path(update_paths[-1]).write_bytes(data)
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    service = P2PService(dht)
    components: list[GroupAverager | StateServer] = []
    try:
        service.start()
        service.wait_until_ready(timeout_s=30)
        averager = GroupAverager(service, "avg")
        averager.start()
        averager.wait_until_ready(timeout_s=30)
        components.append(averager)
        for server in (
            StateServer(service, "full", lambda: blob, updates=log.get),
            StateServer(service, "empty", lambda: None),
            StateServer(
                service, "private", lambda: blob, allow=lambda peer_id: False, updates=log.get
            ),
            StateServer(service, "junk", lambda: None, updates=lambda version: b"junk"),
        ):
            server.start()
            components.append(server)
        emit(
            {
                "op": "ready",
                "peer": service.peer_id,
                "maddrs": [str(m) for m in dht.get_visible_maddrs()],
                "path": str(path),
                "update_paths": update_paths,
                "head_hash": head_hash,
            }
        )
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "average_then_download":
                tensors, weight = share_pair()
                result = averager.average(
                    cmd["key"],
                    tensors,
                    weight=weight,
                    gather=b"donor",
                    target_size=2,
                    matchmaking_timeout_s=10.0,
                    allreduce_timeout_s=10.0,
                )
                got = download_state(service, cmd["run"], cmd["peer"], timeout_s=10.0)
                emit(
                    {
                        "op": cmd["op"],
                        "members": result.members,
                        "average_ok": all(
                            torch.equal(a, t) for a, t in zip(result.average, tensors, strict=True)
                        ),
                        "version": got.version,
                        "sha256": hashlib.sha256(got.data).hexdigest(),
                    }
                )
    finally:
        for component in reversed(components):
            component.shutdown()
        service.shutdown()
        dht.shutdown()


class Donor:
    """The donor process; its `@@` stdout lines are parsed by a reader thread into a queue."""

    def __init__(self, out_dir: Path) -> None:
        self.log_path = out_dir / "donor.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in close())
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(out_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,  # its own process group: killpg reaches DHT and p2pd too
            text=True,
            env={**os.environ, "PYTHONPATH": pythonpath},  # this checkout, whatever is installed
        )
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        if self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))

    def send(self, command: dict[str, Any]) -> None:
        if self.proc.stdin is None:
            raise RuntimeError("donor has no stdin")
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"donor sent nothing within {timeout_s} s (exit code {self.proc.poll()}); "
                f"log tail:\n{self.log_tail()}"
            ) from None

    def signal_group(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        """Ask to quit, then SIGKILL the whole process group whatever happened."""
        try:
            self.signal_group(signal.SIGCONT)  # in case a test stopped it
            if self.proc.poll() is None:
                self.send({"op": "quit"})
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # DHT process and p2pd may outlive the donor
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._log.close()


@dataclass
class Pair:
    donor: Donor
    donor_id: str
    donor_path: Path
    service: P2PService
    """The requester's (this process's) service."""
    update_paths: list[Path]
    """The donor's served update records, by base version, as files."""
    head_hash: str
    """The donor's state hash after its updates."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    donor: Donor | None = None
    dht: DHT | None = None
    service: P2PService | None = None
    try:
        donor = Donor(tmp_path_factory.mktemp("donor"))
        ready = donor.receive(READY_TIMEOUT_S)
        if ready.get("op") != "ready":
            raise RuntimeError(f"donor did not start: {ready}")
        dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=ready["maddrs"])
        service = P2PService(dht)
        service.start()
        service.wait_until_ready(timeout_s=30)
        yield Pair(
            donor,
            ready["peer"],
            Path(ready["path"]),
            service,
            [Path(p) for p in ready["update_paths"]],
            ready["head_hash"],
        )
    finally:
        if service is not None:
            service.shutdown()
        if dht is not None:
            dht.shutdown()
        if donor is not None:
            donor.close()


# --------------------------------------------------------------------------- multi-peer tests


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_download_of_40_mb_gives_identical_bytes(pair: Pair) -> None:
    seen: list[tuple[int, int]] = []
    started = time.perf_counter()
    blob = download_state(
        pair.service,
        "full",
        pair.donor_id,
        timeout_s=30.0,
        on_progress=lambda received, total: seen.append((received, total)),
    )
    elapsed_s = time.perf_counter() - started
    expected = pair.donor_path.read_bytes()
    assert len(expected) > 40_000_000
    assert blob.data == expected
    assert blob.version == FULL_VERSION
    assert blob.state_hash == hashlib.sha256(expected).hexdigest()  # the donor's claim, checked
    assert seen[-1] == (len(expected), len(expected))
    assert len(seen) == -(-len(expected) // CHUNK_BYTES)  # one callback per 1 MiB chunk
    logger.info("40 MB state: %.2f s, %.1f MB/s", elapsed_s, len(expected) / 1e6 / elapsed_s)


@pytest.mark.multipeer
@pytest.mark.timeout(30)
def test_donor_without_state_or_refusing_fails_cleanly(pair: Pair) -> None:
    for run, reason in (
        ("empty", "no state yet"),
        ("private", "not allowed"),
        ("nosuchrun", None),  # no handler of that name on the donor: its daemon refuses
    ):
        started = time.perf_counter()
        with pytest.raises(StateTransferFailed, match=reason):
            download_state(pair.service, run, pair.donor_id, timeout_s=10.0)
        assert time.perf_counter() - started < 10.0


@pytest.mark.multipeer
@pytest.mark.timeout(30)
def test_state_larger_than_max_bytes_is_refused_before_download(pair: Pair) -> None:
    received: list[int] = []
    with pytest.raises(StateTransferFailed, match="exceeds max_bytes"):
        download_state(
            pair.service,
            "full",
            pair.donor_id,
            timeout_s=10.0,
            max_bytes=1_000_000,
            on_progress=lambda done, total: received.append(done),
        )
    assert received == []  # refused on the header, before any data frame


@pytest.mark.multipeer
@pytest.mark.timeout(30)
def test_unknown_peer_fails_within_timeout(pair: Pair) -> None:
    nobody = PeerID(b"\x12\x20" + os.urandom(32)).to_base58()  # a well-formed sha256 peer id
    timeout_s = 3.0
    started = time.perf_counter()
    with pytest.raises(StateTransferFailed):
        download_state(pair.service, "full", nobody, timeout_s=timeout_s)
    assert time.perf_counter() - started <= timeout_s + SLACK_S
    with pytest.raises(StateTransferFailed, match="malformed peer id"):
        download_state(pair.service, "full", "not-a-peer-id!", timeout_s=timeout_s)
    with pytest.raises(StateTransferFailed, match="myself"):
        download_state(pair.service, "full", pair.service.peer_id, timeout_s=timeout_s)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_group_averager_and_state_server_share_one_service(pair: Pair) -> None:
    """On each side one P2PService carries both an averaging round and a state download."""
    local = make_blob(3, 100_000, seed=1)
    averager = GroupAverager(pair.service, "avg")
    server = StateServer(pair.service, "local", lambda: local)
    try:
        averager.start()
        averager.wait_until_ready(timeout_s=30)
        server.start()
        assert server.run == "local" and server.handler_name == "local_state"
        pair.donor.send(
            {
                "op": "average_then_download",
                "key": "v0",
                "run": "local",
                "peer": pair.service.peer_id,
            }
        )
        tensors, weight = share_pair()
        result = averager.average(
            "v0",
            tensors,
            weight=weight,
            gather=b"requester",
            target_size=2,
            matchmaking_timeout_s=10.0,
            allreduce_timeout_s=10.0,
        )
        assert result.members == sorted([pair.service.peer_id, pair.donor_id])
        assert all(torch.equal(a, t) for a, t in zip(result.average, tensors, strict=True))
        answer = pair.donor.receive(30.0)  # the donor downloaded from this process's server
        assert answer["members"] == result.members and answer["average_ok"], answer
        assert answer["version"] == 3
        assert answer["sha256"] == hashlib.sha256(local.data).hexdigest()
        # and this process still downloads through the same service
        blob = download_state(pair.service, "full", pair.donor_id, timeout_s=30.0)
        assert blob.data == pair.donor_path.read_bytes()
    finally:
        server.shutdown()
        averager.shutdown()
        server.shutdown()  # idempotent
    assert pair.service.is_running  # the components' shutdown leaves the shared service up


@pytest.mark.multipeer
@pytest.mark.timeout(30)
def test_donor_stopped_mid_transfer_fails_at_timeout(pair: Pair) -> None:
    """SIGSTOP of the donor's process group (donor, DHT process, p2pd) once the first chunk is
    in: the requester gives up at its timeout, with how far it got, instead of hanging."""
    stopped = threading.Event()

    def stop_donor(received: int, total: int) -> None:
        if not stopped.is_set():
            stopped.set()
            pair.donor.signal_group(signal.SIGSTOP)

    timeout_s = 4.0
    started = time.perf_counter()
    try:
        with pytest.raises(StateTransferFailed, match="timed out") as failure:
            download_state(
                pair.service, "full", pair.donor_id, timeout_s=timeout_s, on_progress=stop_donor
            )
        elapsed_s = time.perf_counter() - started
    finally:
        pair.donor.signal_group(signal.SIGCONT)
    assert stopped.is_set()
    assert timeout_s - 0.5 <= elapsed_s <= timeout_s + SLACK_S
    assert "bytes received" in str(failure.value)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_updates_download_byte_identical_and_replay_to_the_head(pair: Pair) -> None:
    """A peer at version 0 fetches the donor's 3 updates one by one and replays them; run "full"
    serves both kinds of request (its full-state downloads are the tests above)."""
    state = initial_state()
    shapes = [tuple(t.shape) for t in state.theta]
    started = time.perf_counter()
    for version in range(UPDATES):
        data = download_update(pair.service, "full", pair.donor_id, version, timeout_s=10.0)
        assert data == pair.update_paths[version].read_bytes()
        record = UpdateRecord.from_bytes(data, shapes=shapes)
        assert (record.base_version, record.base_hash) == (state.version, state.hash())
        state.apply(list(record.average), record.count, record.shard_samples)
        assert state.hash() == record.result_hash
    assert state.version == UPDATES and state.hash() == pair.head_hash
    logger.info("3 updates fetched and replayed in %.2f s", time.perf_counter() - started)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_missing_refused_or_oversized_update_fails_cleanly(pair: Pair) -> None:
    for run, version, reason in (
        ("full", UPDATES, "no update from version 3"),  # the donor's head: nothing after it
        ("full", 1000, "no update from version 1000"),
        ("empty", 0, "no update log"),
        ("private", 0, "not allowed"),
        ("junk", 0, "malformed record"),
        ("nosuchrun", 0, None),
    ):
        started = time.perf_counter()
        with pytest.raises(StateTransferFailed, match=reason):
            download_update(pair.service, run, pair.donor_id, version, timeout_s=10.0)
        assert time.perf_counter() - started < 10.0
    with pytest.raises(StateTransferFailed, match="exceeds max_bytes"):
        download_update(pair.service, "full", pair.donor_id, 0, timeout_s=10.0, max_bytes=1000)
    with pytest.raises(StateTransferFailed, match="myself"):
        download_update(pair.service, "full", pair.service.peer_id, 0, timeout_s=10.0)
    # the donor still serves both kinds after those refusals
    assert download_update(pair.service, "full", pair.donor_id, 2, timeout_s=10.0) == (
        pair.update_paths[2].read_bytes()
    )


# --------------------------------------------------------------------------- unit tests


@pytest.mark.timeout(10)
def test_state_blob_rejects_bad_fields() -> None:
    good = {"version": 1, "state_hash": "ab" * 32, "data": b"x"}
    StateBlob(**good)
    for bad in (
        {"version": -1},
        {"version": True},
        {"version": 2**63},
        {"state_hash": ""},
        {"state_hash": "h" * 257},
        {"data": bytearray(b"x")},
    ):
        with pytest.raises(ValueError):
            StateBlob(**(good | bad))


@pytest.mark.timeout(10)
def test_bad_arguments_are_value_errors() -> None:
    service: Any = None  # arguments are checked before the service is touched
    for run, kwargs in (
        ("has-dash", {"timeout_s": 1.0}),
        ("ok", {"timeout_s": 0.0}),
        ("ok", {"timeout_s": float("inf")}),
        ("ok", {"timeout_s": 1.0, "max_bytes": -1}),
    ):
        with pytest.raises(ValueError):
            download_state(service, run, "x", **kwargs)
        with pytest.raises(ValueError):
            download_update(service, run, "x", 0, **kwargs)
    for version in (-1, True, 1.0, 2**63 - 1):
        with pytest.raises(ValueError):
            download_update(service, "ok", "x", version, timeout_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StateServer(service, "ok", lambda: None, updates=b"not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StateServer(service, "has.dot", lambda: None)
    with pytest.raises(ValueError):
        StateServer(service, "ok", lambda: None, max_uploads=0)
    server = StateServer(service, "ok", lambda: None)
    server.shutdown()  # before start: nothing to do
    server.shutdown()


@pytest.mark.timeout(10)
def test_service_calls_fail_cleanly_when_not_running() -> None:
    service = P2PService(None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        service.wait_until_ready(timeout_s=1.0)

    async def nothing() -> None:
        return None

    with pytest.raises(RuntimeError):
        service.run(nothing(), timeout_s=1.0)
    service.shutdown()
    service.shutdown()


if __name__ == "__main__":
    donor_main(Path(sys.argv[1]))
