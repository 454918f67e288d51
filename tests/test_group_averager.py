"""GroupAverager end to end: real peer processes on 127.0.0.1, plus unit tests of its pieces.

Each peer is tests/_averager_peer.py in its own process group (its DHT process and p2p daemon
included), driven by JSON lines on stdin; every group is SIGKILLed in `finally`, whatever the
outcome. Contributions are `scale * randn` from per-peer seeds, so the true weighted mean is
recomputed here and every member's result is compared with it (within the codec's rounding), with
the other members' bits, with the simulator's in-memory all-reduce of the same inputs (bit for
bit), and every member's measured part-stream traffic with the frames the protocol sends.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from safetensors.torch import load_file

from diloco_peer.averaging.compression import (
    BLOCK_SIZE,
    Compression,
    decode,
    encode,
    encoded_size,
    prune,
    quantization_step,
)
from diloco_peer.averaging.group_averager import GroupAverager, flatten
from diloco_peer.averaging.matchmaking import group_digest, pack_gather, validate_group
from diloco_peer.averaging.partition import chunk_count, key_tag, part_sizes
from diloco_peer.averaging.receipts import SIGNATURE_HEAD, Proof, Receipt, read_answer
from diloco_peer.averaging.reducer import SILENCE_SHARE, PartReducer, Round, silent_members
from diloco_peer.averaging.reference import all_reduce_in_memory
from diloco_peer.averaging.robust import reduce_part
from diloco_peer.averaging.wire import PART_HEADER, PROTOCOL_VERSION, pack_answer
from diloco_peer.errors import AllReduceFailed
from diloco_peer.identity import Identity
from diloco_peer.p2p.service import POLL_S

PEER_SCRIPT = Path(__file__).with_name("_averager_peer.py")
SHAPES = [[300_000], [17, 33], [5], [2, 3, 4]]
SIZES = [math.prod(shape) for shape in SHAPES]
NUMEL = sum(SIZES)
SCALE = 0.25  # pseudo-gradient-like values: |x| < 2, where fp16's rounding error stays < 1e-3
READY_TIMEOUT_S = 60.0
SLACK_S = 3.0
NO_EXCLUSIONS = len(pack_answer({}, torch.zeros(0), "none"))  # an answer's head: u16 count 0
# each peer process's averagers (tests/_averager_peer.py): codec and prune fraction
AVERAGERS: dict[str, tuple[Compression, float]] = {
    "fp32": ("none", 0.0),
    "fp16": ("fp16", 0.0),
    "int8": ("int8", 0.0),
    "int4": ("int4", 0.0),
    "int8_prune50": ("int8", 0.5),
    "client": ("none", 0.0),  # fp32; peer 2 of the trio is in client mode (reduces no part)
    "signed": ("none", 0.0),  # fp32, signed receipts checked and compared (receipts.py)
}
RSA_2048_SIGNATURE = 256
REDUCER_KEY = Identity.generate()
CLIENTS = (2,)
"""The trio's peers whose "client" averager is in client mode."""


# --------------------------------------------------------------------------- the peer processes


class Peer:
    """One peer process; its `@@` stdout lines are parsed by a reader thread into a queue."""

    def __init__(self, out_dir: Path, index: int) -> None:
        self.index = index
        self.log_path = out_dir / f"peer{index}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), str(out_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,  # its own process group: killpg reaches DHT and p2pd too
            text=True,
        )
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.peer_id = ""
        self.maddrs: list[str] = []
        self._quitting = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.messages.put(json.loads(line[3:]))

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"peer {self.index} sent nothing within {timeout_s} s "
                f"(exit code {self.proc.poll()}); log tail:\n{self.log_tail()}"
            ) from None

    def join(self, initial_peers: list[str]) -> None:
        self.send({"op": "join", "initial_peers": initial_peers, "client": self.index in CLIENTS})

    def wait_ready(self) -> None:
        ready = self.receive(READY_TIMEOUT_S)
        assert ready["op"] == "ready", ready
        self.peer_id, self.maddrs = ready["peer"], ready["maddrs"]

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def quit(self) -> None:
        """Ask to quit (once), without waiting."""
        if self._quitting or self.proc.poll() is not None:
            return
        self._quitting = True
        try:
            self.send({"op": "quit"})
        except OSError:
            pass

    def close(self) -> None:
        """Ask to quit, then SIGKILL the whole process group whatever happened."""
        self.quit()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # DHT process and p2pd may outlive the peer
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._log.close()


@contextmanager
def swarm(out_dir: Path, size: int) -> Iterator[list[Peer]]:
    """`size` ready peers; all of them killed on exit, even if starting them failed."""
    peers: list[Peer] = []
    try:
        peers = [Peer(out_dir, i) for i in range(size)]  # all import torch + hivemind at once
        peers[0].join([])
        peers[0].wait_ready()
        for peer in peers[1:]:
            peer.join(peers[0].maddrs)
        for peer in peers[1:]:
            peer.wait_ready()
        yield peers
    finally:
        for peer in peers:
            peer.quit()  # all at once: each takes a few seconds to shut its parts down
        for peer in peers:
            peer.close()


def average_command(key: str, seed: int, weight: float, **overrides: Any) -> dict[str, Any]:
    command = {
        "op": "average",
        "averager": "fp32",
        "key": key,
        "seed": seed,
        "scale": SCALE,
        "shapes": SHAPES,
        "weight": weight,
        "target_size": 3,
        "matchmaking_timeout_s": 10.0,
        "allreduce_timeout_s": 20.0,
        "die_after_group": False,
    }
    command.update(overrides)
    return command


def run_round(peers: list[Peer], commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send each peer its command at once, then collect every answer."""
    for peer, command in zip(peers, commands, strict=True):
        peer.send(command)
    budget_s = max(c["matchmaking_timeout_s"] + c["allreduce_timeout_s"] for c in commands) + 30
    return [peer.receive(budget_s) for peer in peers]


def contribution(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * SCALE for shape in SHAPES]


def sent(seed: int, prune_fraction: float = 0.0) -> torch.Tensor:
    """A member's contribution as it goes on the wire: each tensor pruned, then flattened."""
    return torch.cat([prune(t.reshape(-1), prune_fraction) for t in contribution(seed)])


def true_mean(
    seeds: list[int], weights: list[float], prune_fraction: float = 0.0
) -> list[torch.Tensor]:
    """Σ w_i x_i / Σ w_i in float64 (x_i pruned as its sender prunes it)."""
    inputs = [sent(s, prune_fraction).double() for s in seeds]
    total = math.fsum(weights)
    mean = sum(w * x for w, x in zip(weights, inputs, strict=True)) / total
    return [part.view(shape) for part, shape in zip(mean.split(SIZES), SHAPES, strict=True)]


def rounding_bound(values: torch.Tensor, k: int, compression: Compression) -> torch.Tensor:
    """Per value of a flat vector sent to a group of k, the worst error of its encoding: half a
    quantization step of its block, blocks restarting at each of the k parts (fp32 rounding of
    the scale and the product included); zero for fp32, half an fp16 ulp for fp16."""
    values = values.double().abs()
    if compression == "none":
        return torch.zeros_like(values)
    if compression == "fp16":
        return values * 2.0**-11 + 2.0**-25  # half an ulp, subnormals included
    step = quantization_step(compression)
    assert step is not None
    bounds = []
    for part in values.tensor_split(k):
        blocks = torch.zeros(-(-part.numel() // BLOCK_SIZE) * BLOCK_SIZE, dtype=torch.float64)
        blocks[: part.numel()] = part
        absmax = blocks.view(-1, BLOCK_SIZE).amax(dim=1).repeat_interleave(BLOCK_SIZE)
        bounds.append(absmax[: part.numel()] * (step / 2 * (1 + 1e-5) + 4 * 2.0**-23))
    return torch.cat(bounds)


def average_bound(
    seeds: list[int], weights: list[float], compression: Compression, prune_fraction: float
) -> torch.Tensor:
    """Per value, how far a group's result may be from the true mean: each member's part is
    rounded (a weighted mean of those errors), the reduced average rounded once more (around
    a value within the first error of the true mean), plus fp32 reduction error."""
    k, total = len(seeds), math.fsum(weights)
    first = (
        sum(
            w * rounding_bound(sent(s, prune_fraction), k, compression)
            for s, w in zip(seeds, weights, strict=True)
        )
        / total
    )
    mean = torch.cat([t.reshape(-1) for t in true_mean(seeds, weights, prune_fraction)])
    second = rounding_bound(mean.abs() + first, k, compression)
    return first + second + 1e-6 * (mean.abs() + 1)


def check_traffic(
    peers: list[Peer],
    answers: list[dict[str, Any]],
    compression: Compression,
    clients: Sequence[str] = (),
    signature: int = 0,
) -> None:
    """Each member's measured bytes: near the butterfly's 2·b·n·(k−1)/k each way, exactly the
    frames (8-byte length prefix + payload) the protocol sends, and every byte sent was read.
    With `clients` (members that reduce nothing), the k parts are the r reducers' and exact
    counts are checked for those frames instead."""
    k = len(peers)
    ideal = 2 * encoded_size(NUMEL, compression) * (k - 1) / k
    members = sorted(p.peer_id for p in peers)
    reducers = [m for m in members if m not in clients]
    sizes = part_sizes(NUMEL, len(reducers))

    def part(size: int) -> int:  # sender -> reducer: header frame, then the part's frame
        return 8 + PART_HEADER.size + 8 + encoded_size(size, compression)

    def answer(size: int) -> int:  # reducer -> sender: b"OK" + receipt + no exclusions + average
        return 8 + 2 + SIGNATURE_HEAD + signature + NO_EXCLUSIONS + encoded_size(size, compression)

    for peer, result in zip(peers, answers, strict=True):
        if peer.peer_id in clients:  # sends every part away, reads every average back
            assert result["bytes_sent"] == sum(map(part, sizes))
            assert result["bytes_received"] == sum(map(answer, sizes))
            continue
        mine = reducers.index(peer.peer_id)  # the part this member reduces
        others = [size for j, size in enumerate(sizes) if j != mine]
        if not clients:
            for field in ("bytes_sent", "bytes_received"):
                assert 0.9 * ideal <= result[field] <= 1.3 * ideal, (peer.index, field, result)
        assert result["bytes_sent"] == sum(map(part, others)) + (k - 1) * answer(sizes[mine])
        assert result["bytes_received"] == sum(map(answer, others)) + (k - 1) * part(sizes[mine])
        assert result["matchmaking_s"] > 0 and result["allreduce_s"] > 0, result
        assert result["matchmaking_s"] + result["allreduce_s"] <= result["elapsed_s"], result
    sent = sum(result["bytes_sent"] for result in answers)
    assert sent == sum(result["bytes_received"] for result in answers)


def check_round(
    peers: list[Peer],
    answers: list[dict[str, Any]],
    seeds: list[int],
    weights: list[float],
    tolerance: float,
    averager: str = "fp32",
    clients: Sequence[str] = (),
) -> None:
    """Every member succeeded with the same bits, within `tolerance` of the true weighted mean
    and within the rounding bound of the averager's codec, bit-identical to the simulator's
    in-memory all-reduce, and its traffic was counted exactly."""
    compression, prune_fraction = AVERAGERS[averager]
    for answer, peer in zip(answers, peers, strict=True):
        assert answer["ok"], f"peer {peer.index}: {answer}\n{peer.log_tail()}"
    assert len({a["sha256"] for a in answers}) == 1, "members hold different bits"
    assert len({a["group_id"] for a in answers}) == 1
    ids = [p.peer_id for p in peers]
    for answer in answers:
        assert answer["members"] == sorted(ids)
        assert answer["weights"] == dict(zip(ids, weights, strict=True))
        assert answer["gathered"] == {i: f"seed={s}" for i, s in zip(ids, seeds, strict=True)}
        assert answer["shapes"] == SHAPES and answer["dtypes"] == ["torch.float32"]
    result = load_file(answers[0]["path"])
    for i, expected in enumerate(true_mean(seeds, weights, prune_fraction)):
        error = (result[str(i)].double() - expected).abs().max().item()
        assert error <= tolerance, f"tensor {i}: max error {error} > {tolerance}"
    flat = torch.cat([result[str(i)].reshape(-1) for i in range(len(SHAPES))])
    expected = torch.cat([t.reshape(-1) for t in true_mean(seeds, weights, prune_fraction)])
    bound = average_bound(seeds, weights, compression, prune_fraction)
    excess = ((flat.double() - expected).abs() - bound).max().item()
    assert excess <= 0, f"{averager}: an error exceeds the codec's bound by {excess}"
    # the simulator's all-reduce (sim/simulator.py) computes these very bits
    by_member = {p.peer_id: (s, w) for p, s, w in zip(peers, seeds, weights, strict=True)}
    ordered = [by_member[m] for m in sorted(by_member)]
    in_memory = all_reduce_in_memory(
        [sent(s, prune_fraction) for s, _ in ordered],
        [w for _, w in ordered],
        compression,
        num_parts=len(ordered) - len(clients),
    )
    assert torch.equal(flat, in_memory), f"{averager}: the network and in-memory bits differ"
    signature = RSA_2048_SIGNATURE if averager == "signed" else 0
    check_traffic(peers, answers, compression, clients, signature)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Peer]]:
    with swarm(tmp_path_factory.mktemp("trio"), 3) as peers:
        yield peers


# --------------------------------------------------------------------------- multi-peer tests


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_three_peers_uneven_weights_two_consecutive_rounds(trio: list[Peer]) -> None:
    for key, seeds, weights in (
        ("v0", [1, 2, 3], [1.0, 2.0, 5.0]),
        ("v1", [4, 5, 6], [3.0, 1.0, 0.5]),
    ):
        commands = [average_command(key, s, w) for s, w in zip(seeds, weights, strict=True)]
        check_round(trio, run_round(trio, commands), seeds, weights, tolerance=1e-6)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_a_client_mode_member_contributes_but_reduces_nothing(trio: list[Peer]) -> None:
    """Peer 2 cannot be dialed (client mode): it joins the group another peer leads, its δ is
    in the average, the other two reduce half the vector each, and it only opens streams."""
    seeds, weights = [51, 52, 53], [1.0, 2.0, 1.5]
    commands = [
        average_command("vc", s, w, averager="client") for s, w in zip(seeds, weights, strict=True)
    ]
    answers = run_round(trio, commands)
    clients = [trio[i].peer_id for i in CLIENTS]
    check_round(trio, answers, seeds, weights, tolerance=1e-6, averager="client", clients=clients)


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_a_long_vector_goes_in_chunks_with_the_same_bits(trio: list[Peer]) -> None:
    """A vector of 2.2M values goes as 2 pipelined chunks (partition.chunk_count): every
    member gets the same bits, the in-memory all-reduce (which chunks the same way) too, and
    the peer in client mode still reduces nothing (it sends all it has, in more streams)."""
    shapes = [[2_200_000], [7]]
    numel = sum(math.prod(shape) for shape in shapes)
    assert chunk_count(numel) == 2
    seeds, weights = [61, 62, 63], [1.0, 2.0, 1.0]
    for averager, codec in (("fp32", "none"), ("int8", "int8"), ("client", "none")):
        commands = [
            average_command(f"long_{averager}", s, w, averager=averager, shapes=shapes)
            for s, w in zip(seeds, weights, strict=True)
        ]
        answers = run_round(trio, commands)
        assert all(a["ok"] for a in answers), answers
        assert len({a["sha256"] for a in answers}) == 1, averager
        inputs = {}
        for peer, seed in zip(trio, seeds, strict=True):
            generator = torch.Generator().manual_seed(seed)
            flat = torch.cat([torch.randn(sh, generator=generator).reshape(-1) for sh in shapes])
            inputs[peer.peer_id] = flat * SCALE
        order = sorted(inputs)
        by_id = dict(zip((p.peer_id for p in trio), weights, strict=True))
        clients = [trio[i].peer_id for i in CLIENTS] if averager == "client" else []
        expected = all_reduce_in_memory(
            [inputs[m] for m in order], [by_id[m] for m in order], codec,
            num_parts=len(order) - len(clients),
        )  # fmt: skip
        result = load_file(answers[0]["path"])
        got = torch.cat([result[str(i)].reshape(-1) for i in range(len(shapes))])
        assert torch.equal(got, expected), averager
        if clients:  # the client sent every part of both chunks and reduced none
            client = answers[CLIENTS[0]]
            assert abs(client["bytes_sent"] - 4 * numel) < 0.001 * 4 * numel, client


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_three_peers_fp16(trio: list[Peer]) -> None:
    seeds, weights = [7, 8, 9], [1.0, 1.0, 2.0]
    commands = [
        average_command("v0", s, w, averager="fp16") for s, w in zip(seeds, weights, strict=True)
    ]
    answers = run_round(trio, commands)
    check_round(trio, answers, seeds, weights, tolerance=1e-3, averager="fp16")
    # fp16 really was used: the result differs from the fp32 mean by more than fp32 rounding
    result = load_file(answers[0]["path"])
    assert (result["0"].double() - true_mean(seeds, weights)[0]).abs().max().item() > 1e-6


@pytest.mark.multipeer
@pytest.mark.timeout(90)
def test_three_peers_every_codec_on_the_same_inputs(trio: list[Peer]) -> None:
    """Blockwise int8 and int4 (and fp32, fp16 for comparison) on the same contributions: the
    same bits on every member, within the codec's bound of the true mean, and the bytes each
    member sends shrink as the codec promises (framing and headers included)."""
    seeds, weights = [31, 32, 33], [1.0, 3.0, 2.0]
    sent_bytes: dict[str, int] = {}
    tolerances = {"fp32": 1e-6, "fp16": 1e-3, "int8": 0.02, "int4": 0.3}
    for averager, tolerance in tolerances.items():
        commands = [
            average_command(f"c_{averager}", s, w, averager=averager)
            for s, w in zip(seeds, weights, strict=True)
        ]
        answers = run_round(trio, commands)
        check_round(trio, answers, seeds, weights, tolerance=tolerance, averager=averager)
        sent_bytes[averager] = max(a["bytes_sent"] for a in answers)
        if averager in ("int8", "int4"):  # really quantized: coarser than fp16 would be
            result = load_file(answers[0]["path"])
            error = (result["0"].double() - true_mean(seeds, weights)[0]).abs().max().item()
            assert error > 1e-3, (averager, error)
    assert sent_bytes["fp32"] / sent_bytes["fp16"] >= 1.99
    assert sent_bytes["fp32"] / sent_bytes["int8"] >= 3.5
    assert sent_bytes["fp32"] / sent_bytes["int4"] >= 7


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_three_peers_int8_with_pruning(trio: list[Peer]) -> None:
    """Each sender zeroes half of each of its tensors before sending; the group averages those
    pruned contributions (the true mean checked is the mean of the pruned inputs)."""
    seeds, weights = [41, 42, 43], [2.0, 1.0, 1.0]
    commands = [
        average_command("vp", s, w, averager="int8_prune50")
        for s, w in zip(seeds, weights, strict=True)
    ]
    answers = run_round(trio, commands)
    check_round(trio, answers, seeds, weights, tolerance=0.02, averager="int8_prune50")
    result = load_file(answers[0]["path"])
    unpruned = true_mean(seeds, weights)[0]
    assert (result["0"].double() - unpruned).abs().max().item() > 0.05  # pruning took effect


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_lone_key_gets_no_group_while_others_pair(trio: list[Peer]) -> None:
    """Peer 0 alone under its key gets NoGroup in time; peers 1, 2 (another key, target 3)
    close a group of two when their time is up: keys isolate groups."""
    timeout_s = 3.0
    commands = [
        average_command("solo", 11, 1.0, matchmaking_timeout_s=timeout_s),
        average_command("pair", 12, 1.0, matchmaking_timeout_s=timeout_s),
        average_command("pair", 13, 3.0, matchmaking_timeout_s=timeout_s),
    ]
    lone, *pair = run_round(trio, commands)
    assert not lone["ok"] and lone["error"] == "NoGroup", lone
    assert lone["elapsed_s"] <= timeout_s + SLACK_S, lone
    check_round(trio[1:], pair, [12, 13], [1.0, 3.0], tolerance=1e-6)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_a_lone_search_gives_up_when_asked_while_a_pair_averages(trio: list[Peer]) -> None:
    """Peer 0, alone under its key, is told after 1 s that the swarm moved past its state: it
    stops looking within a poll or two (GaveUp), not at its 20 s deadline; peers 1 and 2, under
    another key, average as usual."""
    commands = [
        average_command("solo", 11, 1.0, matchmaking_timeout_s=20.0, give_up_after_s=1.0),
        average_command("pair", 12, 1.0, matchmaking_timeout_s=3.0),
        average_command("pair", 13, 3.0, matchmaking_timeout_s=3.0),
    ]
    lone, *pair = run_round(trio, commands)
    assert not lone["ok"] and lone["error"] == "GaveUp", lone
    assert lone["elapsed_s"] <= 1.0 + 2 * POLL_S + SLACK_S, lone
    check_round(trio[1:], pair, [12, 13], [1.0, 3.0], tolerance=1e-6)


@pytest.mark.multipeer
@pytest.mark.timeout(90)
def test_a_member_that_does_not_acknowledge_is_left_out_and_the_others_average(
    trio: list[Peer],
) -> None:
    """The commit step (averaging/commit.py). Peer 2 asks last, so it follows (a leader is
    whoever declared the earliest deadline), and it stalls between the group's assembly and its
    acknowledgement, past the leader's window (min(5, 0.2 x 8) = 1.6 s). The leader commits
    peers 0 and 1 only: they average between them, with the very bits of the in-memory
    all-reduce of their two inputs; peer 2 is told it is not in (LeftOut, TOO_LATE) instead of
    failing a round the others count it in. Without the step, the leader would count peer 2,
    and peers 0 and 1 would fail waiting for its parts."""
    seeds, weights, allreduce_s, stall_s = [71, 72, 73], [1.0, 2.0, 4.0], 8.0, 4.0
    commands = [
        average_command("vack", s, w, allreduce_timeout_s=allreduce_s)
        for s, w in zip(seeds, weights, strict=True)
    ]
    commands[2]["ack_delay_s"] = stall_s
    for peer, command in zip(trio[:2], commands[:2], strict=True):
        peer.send(command)
    time.sleep(1.0)  # a later deadline than both: peer 2 cannot lead
    trio[2].send(commands[2])
    budget_s = commands[0]["matchmaking_timeout_s"] + allreduce_s + 30
    answers = [peer.receive(budget_s) for peer in trio]
    check_round(trio[:2], answers[:2], seeds[:2], weights[:2], tolerance=1e-6)
    left = answers[2]
    assert not left["ok"] and left["error"] == "LeftOut", f"{left}\n{trio[2].log_tail()}"
    assert left["refusal"] == "TOO_LATE", left
    # it knew within its stall plus one answer, well inside the round's time
    assert left["elapsed_s"] <= commands[2]["matchmaking_timeout_s"] + stall_s + SLACK_S, left


@pytest.mark.multipeer
@pytest.mark.timeout(120)
def test_peer_killed_after_joining_fails_round_for_survivors(tmp_path: Path) -> None:
    """SIGKILL of a member right after matchmaking: the survivors fail (or, had it died before
    the group closed, average without it), within the timeouts, never half-averaged."""
    matchmaking_s, allreduce_s = 10.0, 5.0
    with swarm(tmp_path, 3) as peers:
        seeds, weights = [21, 22, 23], [1.0, 2.0, 3.0]
        commands = [
            average_command(
                "vk",
                s,
                w,
                matchmaking_timeout_s=matchmaking_s,
                allreduce_timeout_s=allreduce_s,
                die_after_group=(i == 2),
            )
            for i, (s, w) in enumerate(zip(seeds, weights, strict=True))
        ]
        for peer, command in zip(peers, commands, strict=True):
            peer.send(command)
        survivors = [p.receive(matchmaking_s + allreduce_s + 30) for p in peers[:2]]
        assert peers[2].proc.wait(timeout=10) == -signal.SIGKILL
        for answer in survivors:
            assert answer["elapsed_s"] <= matchmaking_s + allreduce_s + SLACK_S, answer
            assert answer["ok"] or answer["error"] in ("AllReduceFailed", "NoGroup"), answer
        if any(a["ok"] for a in survivors):  # a smaller group, formed before the victim joined
            check_round(peers[:2], survivors, seeds[:2], weights[:2], tolerance=1e-6)


@pytest.mark.multipeer
@pytest.mark.timeout(90)
def test_a_member_that_never_sends_its_parts_is_named_by_the_others(trio: list[Peer]) -> None:
    """Issue 16, item 4: peer 2 joins the group and commits, then sends none of its parts (the
    `withhold_parts` fault). The others' rounds fail at their all-reduce timeout, as before,
    and now each names peer 2, and only it: their reducers never got its part."""
    seeds, allreduce_s = [81, 82, 83], 6.0
    commands = [average_command("vmute", s, 1.0, allreduce_timeout_s=allreduce_s) for s in seeds]
    commands[2]["withhold_parts"] = True
    answers = run_round(trio, commands)
    for answer in answers[:2]:
        assert not answer["ok"] and answer["error"] == "AllReduceFailed", answer
        assert answer["silent"] == [trio[2].peer_id], answer
        assert answer["elapsed_s"] <= commands[0]["matchmaking_timeout_s"] + allreduce_s + SLACK_S
    assert not answers[2]["ok"] and answers[2]["silent"] == [], answers[2]


@pytest.mark.multipeer
@pytest.mark.timeout(90)
def test_signed_receipts_are_checked_and_compared_in_an_honest_round(trio: list[Peer]) -> None:
    """Issue 16, item 8: with keys, every answer carries its reducer's signed receipt, and the
    members compare them before the round returns; an honest round still gives every member the
    in-memory all-reduce's bits, finds no proof, and costs one signature per answer on the wire."""
    seeds, weights = [91, 92, 93], [1.0, 1.0, 1.0]
    commands = [average_command("vsig", s, 1.0, averager="signed") for s in seeds]
    answers = run_round(trio, commands)
    check_round(trio, answers, seeds, weights, tolerance=1e-6, averager="signed")
    assert all(a["proofs"] == [] for a in answers), answers


def _receipt(doc: dict[str, Any]) -> Receipt:
    return Receipt(bytes.fromhex(doc["digest"]), doc["part"], bytes.fromhex(doc["answer_hash"]),
                   bytes.fromhex(doc["signature"]))  # fmt: skip


@pytest.mark.multipeer
@pytest.mark.timeout(90)
def test_a_reducer_that_forks_its_part_is_proven_by_the_honest_members(trio: list[Peer]) -> None:
    """Issue 16, item 8: peer 0's reducer answers one member with other bytes (a bit of its
    average flipped, signed anew: within every bound a member checks). The honest members
    compare receipts before committing: neither returns an average (no divergent state), and
    each holds a proof against peer 0, and only against it, that the test re-verifies with
    peer 0's key alone."""
    seeds = [94, 95, 96]
    commands = [average_command("vfork", s, 1.0, averager="signed", linger_s=1.0) for s in seeds]
    commands[0]["equivocate"] = True
    answers = run_round(trio, commands)
    culprit = trio[0].peer_id
    for peer, answer in zip(trio[1:], answers[1:], strict=True):
        assert not answer["ok"] and answer["error"] == "AllReduceFailed", answer
        assert "receipts disagree" in answer["message"], answer
        assert answer["proofs"], f"{answer}\n{peer.log_tail()}"
        for doc in answer["proofs"]:
            assert doc["reducer"] == culprit, doc  # 0 honest peers accused
            proof = Proof(culprit, bytes.fromhex(doc["public_key"]), _receipt(doc["first"]),
                          _receipt(doc["second"]))  # fmt: skip
            assert proof.holds(), doc


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_a_group_whose_only_reducer_is_one_key_does_not_form(trio: list[Peer]) -> None:
    """Issue 16, item 8: peer 2 is in client mode; a group of peer 0 and peer 2 would have peer
    0 as its only reducer, free to answer peer 2 anything. Both get NoGroup, neither averages."""
    pair = [trio[0], trio[2]]
    commands = [average_command("vsole", s, 1.0, averager="client", target_size=2,
                                matchmaking_timeout_s=5.0) for s in (97, 98)]  # fmt: skip
    answers = run_round(pair, commands)
    for answer in answers:
        assert not answer["ok"] and answer["error"] == "NoGroup", answer
        assert "two reducers" in answer["message"], answer


# --------------------------------------------------------------------------- unit tests


@pytest.mark.timeout(10)
def test_reduce_part_is_the_weighted_mean() -> None:
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([0.0, -4.0])]
    mean = reduce_part(parts, [1.0, 2.0, 1.0])
    assert torch.allclose(mean, torch.tensor([7.0 / 4, 10.0 / 4]))
    with pytest.raises(ValueError):
        reduce_part(parts, [1.0])


@pytest.mark.timeout(10)
def test_part_sizes_match_tensor_split() -> None:
    for numel, k in ((10, 3), (300_624, 3), (5, 5), (7, 2)):
        sizes = part_sizes(numel, k)
        assert sizes == [p.numel() for p in torch.tensor_split(torch.zeros(numel), k)]


@pytest.mark.timeout(10)
def test_flatten_prunes_a_copy_of_each_tensor() -> None:
    tensors = [torch.arange(1.0, 11.0), -torch.arange(1.0, 5.0).view(2, 2)]
    flat = flatten(tensors, 0.5)
    assert flat.tolist() == [0.0] * 5 + [6.0, 7.0, 8.0, 9.0, 10.0] + [0.0, 0.0, -3.0, -4.0]
    assert tensors[0][0].item() == 1.0  # the caller's tensors are left alone
    assert torch.equal(flatten(tensors, 0.0), torch.cat([t.reshape(-1) for t in tensors]))


@pytest.mark.timeout(10)
def test_encode_decode_round_trip() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    assert torch.equal(decode(encode(x, "none"), 1001, "none"), x)
    half = decode(encode(x, "fp16"), 1001, "fp16")
    assert half.dtype == torch.float32 and torch.equal(half, x.half().float())
    with pytest.raises(AllReduceFailed):
        decode(encode(x, "none")[:-4], 1001, "none")


@pytest.mark.timeout(10)
def test_parts_for_a_key_this_peer_left_are_refused_at_once() -> None:
    """A part that names a round this peer has not started waits for it, unless this peer's
    matchmaking for that key is over (e.g. it got NoGroup while others counted it in)."""

    async def scenario() -> None:
        reducer = PartReducer()
        reducer.open_key("v0")
        waiting = asyncio.ensure_future(reducer.find_round(b"d" * 32, key_tag("v0"), 5.0, "x"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        reducer.close_key("v0")
        with pytest.raises(AllReduceFailed, match="no such group"):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(AllReduceFailed, match="no such group"):
            await asyncio.wait_for(reducer.find_round(b"e" * 32, key_tag("v0"), 5.0, "x"), 1.0)
        reducer.open_key("v0")  # a retry under the same key: parts wait again (bounded)
        with pytest.raises(AllReduceFailed, match="after 0.1 s"):
            await reducer.find_round(b"e" * 32, key_tag("v0"), 0.1, "x")

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_a_failed_round_names_the_members_whose_part_never_reached_my_reducer() -> None:
    """reducer.silent_members: only members whose part my reducer lacks, only once the round
    failed late enough (SILENCE_SHARE of its time), never in client mode."""

    async def scenario() -> None:
        members = ["Qm1", "Qm2", "Qm3", "Qm4"]

        def sub_round(me: str, reducers: list[str] | None = None) -> Round:
            return Round(key="v0", digest=b"d" * 32, members=members, me=me,
                         weights=[1.0] * 4, compression="none", numel=8, timeout_s=10.0,
                         reducers=reducers)  # fmt: skip

        rnd = sub_round("Qm1")
        rnd.arrived |= {"Qm1", "Qm3"}
        assert silent_members([rnd], rnd.started + 1.0) == ()  # early: parts may be on the way
        late = rnd.started + SILENCE_SHARE * 10.0
        assert silent_members([rnd], late) == ("Qm2", "Qm4")
        other = sub_round("Qm1")
        other.arrived |= {"Qm1", "Qm2", "Qm3"}  # another chunk: Qm2's part came there
        assert silent_members([rnd, other], late) == ("Qm2", "Qm4")
        client = sub_round("Qm1", reducers=["Qm2", "Qm3", "Qm4"])
        assert silent_members([client], late) == ()  # I reduce nothing: I waited for nobody

    asyncio.run(scenario())


def _part_stream(
    digest: bytes, index: int, weight: float, values: list[float]
) -> asyncio.StreamReader:
    """What a sender writes for one part (round key "v0", fp32), as the reducer reads it."""
    payload = encode(torch.tensor(values), "none")
    header = PART_HEADER.pack(
        b"DLCP", PROTOCOL_VERSION, digest, key_tag("v0"), index, 0, weight, len(values), 5.0
    )
    reader = asyncio.StreamReader()
    for frame in (header, payload):
        reader.feed_data(len(frame).to_bytes(8, "big") + frame)
    reader.feed_eof()
    return reader


async def _accept(reducer: PartReducer, sender: str, reader: asyncio.StreamReader) -> bytes:
    """What the stream handler does with a part, up to its answer (not written here)."""
    rnd = await reducer.claim_part(sender, reader)
    try:
        return await reducer.reduce_part(rnd, sender, reader)
    finally:
        rnd.answered()


@pytest.mark.timeout(10)
def test_reducer_checks_every_part_against_the_agreed_group() -> None:
    async def scenario() -> None:
        members = sorted(PeerID(bytes([i]) * 34).to_base58() for i in (1, 2, 3))
        me, one, two = members
        outsider = PeerID(b"\x09" * 34).to_base58()
        reducer = PartReducer()
        digest = b"d" * 32
        rnd = Round(
            key="v0",
            digest=digest,
            members=members,
            me=me,
            weights=[1.0, 2.0, 3.0],
            compression="none",
            numel=9,  # parts of 3: I reduce part 0
            timeout_s=5.0,
            sign=REDUCER_KEY.sign,
        )
        reducer.add([rnd])
        reducer.close_key("v0")
        refused = [
            (outsider, _part_stream(digest, 0, 1.0, [0.0] * 3), "not a member"),
            (one, _part_stream(digest, 0, 9.0, [0.0] * 3), "weight"),
            (one, _part_stream(digest, 1, 2.0, [0.0] * 3), "not part 1"),
            (one, _part_stream(digest, 0, 2.0, [0.0] * 4), "elements"),
            (one, _part_stream(b"x" * 32, 0, 2.0, [0.0] * 3), "no such group"),
        ]
        for sender, reader, reason in refused:
            with pytest.raises(AllReduceFailed, match=reason):
                await asyncio.wait_for(_accept(reducer, sender, reader), 1.0)
        rnd.claimed.add(me)
        rnd.deliver(me, torch.full((3,), 1.0))
        first = asyncio.ensure_future(
            _accept(reducer, one, _part_stream(digest, 0, 2.0, [2.0] * 3))
        )
        await asyncio.sleep(0.05)
        with pytest.raises(AllReduceFailed, match="duplicate"):
            await _accept(reducer, one, _part_stream(digest, 0, 2.0, [5.0] * 3))
        # meanwhile, a round of another key (a pair) completes here: its bytes are its own
        other = Round(
            key="v1",
            digest=b"o" * 32,
            members=[me, one],
            me=me,
            weights=[1.0, 2.0],
            compression="none",
            numel=6,
            timeout_s=5.0,
        )
        reducer.add([other])
        other.claimed.add(me)
        other.deliver(me, torch.zeros(3))
        await asyncio.wait_for(
            _accept(reducer, one, _part_stream(other.digest, 0, 2.0, [1.0] * 3)), 1.0
        )
        last = _accept(reducer, two, _part_stream(digest, 0, 3.0, [4.0] * 3))
        for_one, for_two = await asyncio.wait_for(asyncio.gather(first, last), 1.0)
        assert for_one == for_two  # the same bytes, and one signed receipt, for every member
        _, answer = read_answer(for_one, digest, 0, REDUCER_KEY.public_key)
        assert answer[:NO_EXCLUSIONS] == b"\x00\x00"  # the answer excludes nobody
        average = decode(answer[NO_EXCLUSIONS:], 3, "none")
        assert torch.allclose(average, torch.full((3,), 17.0 / 6))
        # each round: its accepted streams' frames, read in full; refused streams count for none
        framed_part = 8 + PART_HEADER.size + 8 + 3 * 4
        assert await rnd.traffic(1.0) == (0, 2 * framed_part)
        assert await other.traffic(1.0) == (0, framed_part)

    asyncio.run(scenario())


def _group_info(peers: list[PeerID], envelopes: list[bytes]) -> GroupInfo:
    return GroupInfo(b"gid", tuple(peers), tuple(envelopes))


@pytest.mark.timeout(10)
def test_validate_group_sorts_and_rejects_bad_leaders() -> None:
    a, b, c = (PeerID(bytes([i]) * 34) for i in (3, 1, 2))
    envs = [pack_gather(w, f"g{w}".encode(), client=w == 2.0) for w in (1.0, 2.0, 3.0)]
    leader = c.to_base58()
    group = validate_group(
        "v0", _group_info([a, b, c], envs), a.to_base58(), envs[0], leader=leader
    )
    assert group.leader == leader
    by_id = {
        p.to_base58(): (w, e) for p, w, e in zip((a, b, c), (1.0, 2.0, 3.0), envs, strict=True)
    }
    assert list(group.members) == sorted(by_id)
    assert list(group.weights) == [by_id[m][0] for m in group.members]
    assert group.gathered[group.members.index(a.to_base58())] == b"g1.0"
    assert list(group.clients) == [m == b.to_base58() for m in group.members]  # b: weight 2.0
    # the digest binds the member list and every envelope
    assert group.digest == group_digest(
        "v0", b"gid", group.members, tuple(by_id[m][1] for m in group.members)
    )
    bad = [
        (_group_info([a, b, b], envs), envs[0]),  # duplicate member
        (_group_info([b, c], envs[1:]), envs[0]),  # I am not in it
        (_group_info([a], envs[:1]), envs[0]),  # alone
        (_group_info([a, b, c], envs), pack_gather(9.0, b"g1.0")),  # my envelope altered
        (_group_info([a, b, c], [envs[0], b"junk", envs[2]]), envs[0]),  # malformed envelope
        (_group_info([a, b, c], [envs[0], pack_gather(-1.0, b""), envs[2]]), envs[0]),
        (
            _group_info([a, b, c], [envs[0], envs[1][:13] + b"\x04" + envs[1][14:], envs[2]]),
            envs[0],
        ),  # flag
    ]
    for info, mine in bad:
        with pytest.raises(AllReduceFailed):
            validate_group("v0", info, a.to_base58(), mine, leader=leader)
    outsider = PeerID(b"\x07" * 34).to_base58()
    for wrong in (outsider, b.to_base58()):  # not a member; a client (nobody can dial it)
        with pytest.raises(AllReduceFailed, match="leads"):
            validate_group("v0", _group_info([a, b, c], envs), a.to_base58(), envs[0], leader=wrong)


@pytest.mark.timeout(10)
def test_an_averager_is_safe_to_shut_down_before_start() -> None:
    averager = GroupAverager(None, "ok")  # type: ignore[arg-type]  (never started: no service)
    with pytest.raises(RuntimeError):
        averager.wait_until_ready(1.0)
    averager.shutdown()
    averager.shutdown()  # idempotent
    with pytest.raises(RuntimeError):
        averager.start()  # not after a shutdown


@pytest.mark.timeout(10)
def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError):
        GroupAverager(None, "has.dot")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GroupAverager(None, "ok", compression="int2")  # type: ignore[arg-type]
    for fraction in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError):
            GroupAverager(None, "ok", prune_fraction=fraction)  # type: ignore[arg-type]
    averager = GroupAverager(None, "ok")  # type: ignore[arg-type]
    good = {"weight": 1.0, "gather": b"", "target_size": 2}
    good |= {"matchmaking_timeout_s": 1.0, "allreduce_timeout_s": 1.0}
    x = [torch.ones(3)]
    for key, tensors, overrides in (
        ("v-0", x, {}),
        ("v0", [], {}),
        ("v0", [torch.tensor([float("nan")])], {}),
        ("v0", x, {"weight": 0.0}),
        ("v0", x, {"target_size": 1}),
        ("v0", x, {"allreduce_timeout_s": float("inf")}),
    ):
        with pytest.raises(ValueError):
            averager.average(key, tensors, **(good | overrides))
    with pytest.raises(RuntimeError):  # valid call, but never started
        averager.average("v0", x, **good)
    averager.shutdown()
    averager.shutdown()  # idempotent
