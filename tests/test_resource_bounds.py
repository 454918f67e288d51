"""Bounded resources per sender (DESIGN.md §4; issue 16, item 7): what one key with modified code
can hold of an honest peer's slots, memory and time.

- the part reducer: parts waiting for rounds not started here are counted per sender, with a
  global cap, and only after the allowlist (unit tests on fed streams, as tests/test_robust.py);
- the state server: a stream takes an upload slot only once its request is read and valid and
  its requester allowed, one peer holds at most `max_uploads_per_peer` of them, and a reader
  slower than the minimum rate loses its slot;
- the downloads: every one has a stall timeout, and catch-up's are bounded by the run's model
  size (`Replica.max_blob_bytes`, `max_record_bytes`), refused on the header before any data.

The network tests run a donor D and two requesters X and Y in this process, each its own DHT
(a forked process with its own p2p daemon) and P2PService; every node is shut down in
`finally`. The safetensors header bound is fuzzed with the other parsers (test_fuzz_parsers.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from safetensors.torch import save

from diloco_peer.averaging.compression import encode
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.partition import key_tag
from diloco_peer.averaging.reducer import MAX_WAITING_PER_SENDER, PartReducer, Round
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.averaging.wire import PART_HEADER, PROTOCOL_VERSION
from diloco_peer.config import MAX_SAFETENSORS_HEADER_BYTES
from diloco_peer.coordinator_free.state_transfer import (
    RefusalCode,
    StateBlob,
    StateServer,
    StateTransferFailed,
    TransferFailure,
    download_range,
    download_state,
    download_update,
)
from diloco_peer.coordinator_free.state_transfer.wire import StateRequest, handler_name
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.slots import SenderSlots
from diloco_peer.p2p.streams import read_frame
from diloco_peer.peer.catch_up import SwarmDownloads
from diloco_peer.peer.replica import Replica

SLACK_S = 3.0

# --------------------------------------------------------------------------- the slots rule


@pytest.mark.timeout(10)
def test_sender_slots_bound_each_sender_and_all_of_them() -> None:
    slots = SenderSlots(total=3, per_sender=2)
    assert [slots.take("x") for _ in range(3)] == [True, True, False]  # x: its 2, no more
    assert "held by this sender" in slots.why_not("x")
    assert slots.take("y") and not slots.take("z")  # y gets the last one; z finds none
    assert slots.why_not("z") == "all 3 taken"
    slots.give("x")
    assert slots.take("z") and (slots.held(), slots.held("x"), slots.held("z")) == (3, 1, 1)
    with pytest.raises(ValueError):
        slots.give("w")  # never took one
    assert SenderSlots(total=1, per_sender=5).per_sender == 1
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            SenderSlots(total=bad, per_sender=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the part reducer


def _peer(i: int) -> str:
    return PeerID(bytes([i]) * 34).to_base58()


def _part_stream(digest: bytes, values: list[float], weight: float = 1.0) -> asyncio.StreamReader:
    """What a sender writes for part 0 of a round of key "v0" (fp32), as the reducer reads it."""
    payload = encode(torch.tensor(values), "none")
    header = PART_HEADER.pack(
        b"DLCP", PROTOCOL_VERSION, digest, key_tag("v0"), 0, 0, weight, len(values), 5.0
    )
    reader = asyncio.StreamReader()
    for frame in (header, payload):
        reader.feed_data(len(frame).to_bytes(8, "big") + frame)
    reader.feed_eof()
    return reader


def _digest(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


@pytest.mark.timeout(20)
def test_one_sender_cannot_take_the_waiting_slots_of_others() -> None:
    """A key that sends parts for rounds nobody started (membership cannot be checked yet) holds
    at most MAX_WAITING_PER_SENDER waiting streams; the next ones are refused at once, and an
    honest member's part still waits for its round and joins it (the old reducer let one key
    hold all 64 pending rounds)."""

    async def scenario() -> None:
        me, hostile, honest = _peer(1), _peer(2), _peer(3)
        reducer = PartReducer()
        waiting = [
            asyncio.ensure_future(reducer.claim_part(hostile, _part_stream(_digest(i), [0.0])))
            for i in range(MAX_WAITING_PER_SENDER)
        ]
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiting)
        with pytest.raises(AllReduceFailed, match="held by this sender"):
            await asyncio.wait_for(
                reducer.claim_part(hostile, _part_stream(_digest(99), [0.0])), 1.0
            )
        members = sorted([me, honest])
        digest = _digest(1000)
        rnd = Round(key="v0", digest=digest, members=members, me=me, weights=[1.0, 1.0],
                    compression="none", numel=2, timeout_s=5.0,
                    reducers=[me])  # fmt: skip
        mine = asyncio.ensure_future(reducer.claim_part(honest, _part_stream(digest, [1.0, 2.0])))
        await asyncio.sleep(0.05)
        assert not mine.done()  # waits for the round, though the hostile key holds its maximum
        reducer.add([rnd])
        assert await asyncio.wait_for(mine, 1.0) is rnd
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        # the cancelled waiters gave their slots back: the key may send parts again
        again = asyncio.ensure_future(reducer.claim_part(hostile, _part_stream(_digest(7), [0.0])))
        await asyncio.sleep(0.05)
        assert not again.done()
        again.cancel()

    asyncio.run(scenario())


@pytest.mark.timeout(20)
def test_waiting_parts_have_a_global_cap_and_free_their_slots_when_they_end() -> None:
    async def scenario() -> None:
        reducer = PartReducer(max_waiting=3, max_waiting_per_sender=2)
        one, two, three = _peer(4), _peer(5), _peer(6)

        def wait(sender: str, i: int, wait_s: float = 5.0) -> asyncio.Future[Round]:
            return asyncio.ensure_future(
                reducer.find_round(_digest(i), key_tag("v0"), wait_s, sender)
            )

        first = [wait(one, 1, 0.3), wait(one, 2)]
        second = wait(two, 1)  # the same round as one's first: a second waiter of it
        await asyncio.sleep(0.05)
        with pytest.raises(AllReduceFailed, match="all 3 taken"):
            await wait(three, 3)
        with pytest.raises(AllReduceFailed, match="after 0.3 s"):
            await first[0]  # its round never started: its slot is free again
        third = wait(three, 3)
        await asyncio.sleep(0.05)
        assert not third.done()
        reducer.close_key("v0")  # every waiter of this key wakes, finds no round, gives back
        for waiter in (first[1], second, third):
            with pytest.raises(AllReduceFailed, match="no such group"):
                await asyncio.wait_for(waiter, 1.0)
        reducer.open_key("v0")
        assert not (late := wait(three, 4, 0.1)).done()
        with pytest.raises(AllReduceFailed, match="after 0.1 s"):
            await late

    asyncio.run(scenario())


@pytest.mark.timeout(20)
def test_a_sender_the_allowlist_refuses_is_turned_away_unread() -> None:
    """Its stream is refused before its header is read (here: one that never sends it), and
    holds no waiting slot; a broken allow() refuses too."""

    async def scenario() -> None:
        stranger, member = _peer(7), _peer(8)
        reducer = PartReducer(allow=lambda peer: peer != stranger, max_waiting=1)
        silent = asyncio.StreamReader()  # never fed: reading a header would wait 10 s
        started = time.perf_counter()
        with pytest.raises(AllReduceFailed, match="not allowed"):
            await asyncio.wait_for(reducer.claim_part(stranger, silent), 1.0)
        assert time.perf_counter() - started < 0.5
        member_part = asyncio.ensure_future(
            reducer.claim_part(member, _part_stream(_digest(1), [0.0]))
        )
        await asyncio.sleep(0.05)
        assert not member_part.done()  # the one slot was free for the member
        member_part.cancel()

        def broken(peer: str) -> bool:
            raise RuntimeError("allowlist unreadable")

        with pytest.raises(AllReduceFailed, match="RuntimeError"):
            await PartReducer(allow=broken).claim_part(member, _part_stream(_digest(2), [0.0]))

    asyncio.run(scenario())


# --------------------------------------------------------------------------- size bounds


def _replica(outer: str, steps: int) -> Replica:
    generator = torch.Generator().manual_seed(3)
    theta = [torch.randn(s, generator=generator) for s in ((64, 32), (32,), (5, 7))]
    state = ReplicatedState(theta, build_outer_optimizer(outer, lr=0.5, momentum=0.9),
                            num_shards=4, manifest_digest="m" * 64)  # fmt: skip
    for i in range(steps):
        state.apply([torch.full_like(t, 0.01 * (i + 1)) for t in theta], 2, {i % 4: 10})
    replica = Replica(state, UpdateLog(4))
    replica.snapshot()
    return replica


@pytest.mark.timeout(20)
@pytest.mark.parametrize("outer", ["sgd", "nesterov", "adam", "delayed-nesterov"])
def test_download_bounds_hold_any_state_of_the_model_and_little_more(outer: str) -> None:
    """A joiner at version 0 (no outer buffers yet) bounds a donor's state after steps (with
    them) and any update record, within the 1 MiB header bound: not 2**31 bytes."""
    joiner, donor = _replica(outer, 0), _replica(outer, 3)
    blob = donor.blob
    assert blob is not None
    assert joiner.max_blob_bytes() == donor.max_blob_bytes()
    assert (
        len(blob.data)
        <= joiner.max_blob_bytes()
        <= len(blob.data) + 8 + MAX_SAFETENSORS_HEADER_BYTES
    )
    record = donor.updates.get(0) or UpdateRecord(
        base_version=0, base_hash="a" * 64, result_hash="b" * 64, count=2, shard_samples={0: 1},
        average=tuple(torch.zeros_like(t) for t in donor.state.theta), info={"members": "x,y"},
    ).to_bytes()  # fmt: skip
    assert (
        len(record) <= joiner.max_record_bytes() <= len(record) + 8 + MAX_SAFETENSORS_HEADER_BYTES
    )
    assert joiner.max_record_bytes() < joiner.max_blob_bytes() or outer == "sgd"


# --------------------------------------------------------------------------- donor, requesters


@dataclass
class Node:
    dht: DHT
    service: P2PService
    servers: list[StateServer] = field(default_factory=list)

    def close(self) -> None:
        for server in reversed(self.servers):
            server.shutdown()
        self.service.shutdown()
        self.dht.shutdown()


def make_blob(numel: int, seed: int) -> StateBlob:
    generator = torch.Generator().manual_seed(seed)
    data = save({"theta": torch.randn(numel, generator=generator)}, {"version": "3"})
    return StateBlob(version=3, state_hash=hashlib.sha256(data).hexdigest(), data=data)


def held(
    gate: threading.Event, answers: set[int], limit_s: float = 20.0
) -> Callable[[int, int, int], Awaitable[None]]:
    """A `pace` that holds the first frame of the server's answers numbered in `answers` until
    `gate` is set (at most `limit_s`): an upload that stays in progress, holding its slot."""

    async def pace(answer: int, offset: int, length: int) -> None:
        deadline = time.monotonic() + limit_s
        while answer in answers and offset == 0 and not gate.is_set():
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)

    return pace


@dataclass
class Trio:
    donor: Node
    x: Node
    y: Node
    blob: StateBlob
    record: bytes
    gate: threading.Event

    @property
    def donor_id(self) -> str:
        return self.donor.service.peer_id


@pytest.fixture(scope="module")
def trio() -> Iterator[Trio]:
    blob = make_blob(2_000_000, seed=1)  # 8 MB
    average = (torch.randn(300_000, generator=torch.Generator().manual_seed(2)),)  # 1.2 MB
    record = UpdateRecord(base_version=0, base_hash="a" * 64, result_hash="b" * 64, count=2,
                          shard_samples={0: 1}, average=average, info={}).to_bytes()  # fmt: skip
    gate = threading.Event()
    nodes: list[Node] = []
    dhts: list[DHT] = []
    try:
        dhts.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        maddrs = [str(m) for m in dhts[0].get_visible_maddrs()]
        for _ in range(2):  # every DHT (a fork) before any service thread starts
            dhts.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs))
        for dht in dhts:
            nodes.append(Node(dht, P2PService(dht)))
            nodes[-1].service.start()
            nodes[-1].service.wait_until_ready(timeout_s=30)
        dhts.clear()  # the nodes own them now
        donor, x, y = nodes
        x_id = x.service.peer_id
        for run, kwargs in (
            ("perpeer", {"max_uploads": 3, "max_uploads_per_peer": 2, "pace": held(gate, {1, 2})}),
            ("gate", {"max_uploads": 1, "allow": lambda peer: peer != x_id}),
            ("rate", {"max_uploads": 1, "min_upload_bytes_s": 1 << 20, "upload_grace_s": 1.0}),
            (
                "stall",
                {
                    "max_uploads": 8,
                    "max_uploads_per_peer": 8,
                    "pace": held(threading.Event(), set(range(1, 99)), limit_s=5.0),
                },
            ),
            ("sizes", {}),
        ):
            server = StateServer(
                donor.service,
                run,
                lambda: blob,
                updates=lambda v: record if v == 0 else None,
                **kwargs,
            )
            donor.servers.append(server)
            server.start()
            server.wait_until_ready(timeout_s=30)
        yield Trio(donor, x, y, blob, record, gate)
    finally:
        gate.set()
        for node in reversed(nodes):
            node.close()
        for dht in dhts:
            dht.shutdown()


async def _open(
    p2p: P2P, donor: str, run: str, request: bytes | None
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw stream to `donor`'s state handler: send `request` (None: nothing) and read the
    first frame of the answer (b"" when nothing was sent)."""
    _, reader, writer = await p2p.call_binary_stream_handler(
        PeerID.from_base58(donor), handler_name(run)
    )
    if request is None:
        return b"", reader, writer
    await P2P.send_raw_data(request, writer)
    return await asyncio.wait_for(read_frame(reader, 4096, ValueError), 10.0), reader, writer


async def _close(writers: list[asyncio.StreamWriter]) -> None:
    """Close streams in their own loop."""
    for writer in writers:
        writer.close()


def _until_served(service: P2PService, donor: str, run: str, within_s: float) -> float:
    """Download the state from `donor`, asking again while it is busy; seconds it took."""
    started = time.perf_counter()
    while True:
        try:
            download_state(service, run, donor, timeout_s=10.0)
            return time.perf_counter() - started
        except StateTransferFailed as e:
            if e.refusal is not RefusalCode.BUSY or time.perf_counter() - started > within_s:
                raise
            time.sleep(0.2)


@pytest.mark.multipeer
@pytest.mark.timeout(90)  # the first test also starts the fixture
def test_one_requester_holds_at_most_its_share_of_upload_slots(trio: Trio) -> None:
    """X holds two uploads in progress (held by the donor's pace); its third stream is refused
    as busy, and Y is served from the slot X could not take (before: X took all of them)."""
    x, donor = trio.x.service, trio.donor_id
    opened = [
        x.run(_open(x.p2p, donor, "perpeer", StateRequest().encode()), 15.0) for _ in range(2)
    ]
    try:
        assert all(first.startswith(b"OK") for first, _, _ in opened)
        third, _, writer = x.run(_open(x.p2p, donor, "perpeer", StateRequest().encode()), 15.0)
        x.run(_close([writer]), 5.0)
        assert third.startswith(b"ERbusy: upload slots 2 held by this sender"), third
        blob = download_state(trio.y.service, "perpeer", donor, timeout_s=10.0)
        assert blob.data == trio.blob.data
    finally:
        trio.gate.set()
        x.run(_close([writer for _, _, writer in opened]), 5.0)


@pytest.mark.multipeer
@pytest.mark.timeout(40)
def test_streams_take_a_slot_only_after_the_request_and_the_allowlist(trio: Trio) -> None:
    """The donor serves one upload at a time. X (not on its allowlist) and Y open streams that
    never send a request, and X sends valid requests: X is refused at once, and Y's download
    is served while all of those are open (before: the first stream took the only slot)."""
    x, y, donor = trio.x.service, trio.y.service, trio.donor_id
    silent = [x.run(_open(x.p2p, donor, "gate", None), 15.0) for _ in range(2)]
    silent.append(y.run(_open(y.p2p, donor, "gate", None), 15.0))
    try:
        started = time.perf_counter()
        with pytest.raises(StateTransferFailed, match="not allowed") as failure:
            download_state(x, "gate", donor, timeout_s=10.0)
        assert failure.value.refusal is RefusalCode.NOT_ALLOWED
        assert time.perf_counter() - started < 2.0
        assert download_state(y, "gate", donor, timeout_s=10.0).data == trio.blob.data
    finally:
        x.run(_close([writer for _, _, writer in silent[:2]]), 5.0)
        y.run(_close([silent[2][2]]), 5.0)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_a_reader_slower_than_the_minimum_rate_loses_its_slot(trio: Trio) -> None:
    """The donor serves one upload at a time, at >= 1 MiB/s after a 1 s grace. X asks for the
    8 MB state and reads nothing after the header: the donor drops X once the buffers between
    them are full, so Y is served within seconds (before: 30 s per frame, ~35 kB/s), and X's
    stream ends short. Y itself, reading at full speed, is not dropped."""
    x, y, donor = trio.x.service, trio.y.service, trio.donor_id
    first, reader, writer = x.run(_open(x.p2p, donor, "rate", StateRequest().encode()), 15.0)
    try:
        assert first.startswith(b"OK")
        waited_s = _until_served(y, donor, "rate", within_s=20.0)
        assert waited_s < 1.0 + len(trio.blob.data) / (1 << 20) + SLACK_S, waited_s

        async def drain() -> int:
            received = 0
            try:
                while chunk := await asyncio.wait_for(reader.read(1 << 20), 5.0):
                    received += len(chunk)
            except (OSError, EOFError, asyncio.TimeoutError):
                pass
            return received

        assert x.run(drain(), 30.0) < len(trio.blob.data)  # the upload was cut off
    finally:
        x.run(_close([writer]), 5.0)


@pytest.mark.multipeer
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["state", "range", "update"])
def test_every_single_donor_download_fails_on_a_stall(trio: Trio, kind: str) -> None:
    """The donor sends the header, then nothing (its pace holds every answer's first frame for
    5 s): each single-donor download fails as STALLED after its stall timeout, long before
    its own timeout (before: it waited for the whole timeout)."""
    y, donor = trio.y.service, trio.donor_id
    bounds = {"timeout_s": 30.0, "stall_timeout_s": 1.5}
    download: dict[str, Callable[[], object]] = {
        "state": lambda: download_state(y, "stall", donor, **bounds),
        "range": lambda: download_range(y, "stall", donor, trio.blob.state_hash, 0, 10, **bounds),
        "update": lambda: download_update(y, "stall", donor, 0, **bounds),
    }
    started = time.perf_counter()
    with pytest.raises(StateTransferFailed, match="stalled") as failure:
        download[kind]()
    assert failure.value.kind is TransferFailure.STALLED
    assert time.perf_counter() - started < 1.5 + SLACK_S


@pytest.mark.multipeer
@pytest.mark.timeout(60)
def test_catch_up_downloads_are_bounded_by_the_known_sizes(trio: Trio) -> None:
    """SwarmDownloads refuses a donor announcing more than the run's state or record can take,
    on the answer's header, for every kind of download; within the bounds it downloads."""
    y, donor = trio.y.service, trio.donor_id
    state_bytes, record_bytes = len(trio.blob.data), len(trio.record)
    small = SwarmDownloads(
        y, "sizes", max_state_bytes=state_bytes - 1, max_update_bytes=record_bytes - 1
    )
    for attempt, kind in (
        (lambda: small.state(donor), TransferFailure.TOO_LARGE),
        # the one donor is dropped for it, and with it the download
        (lambda: small.state_multi([donor], trio.blob.state_hash), TransferFailure.NO_DONOR),
        (lambda: small.update(donor, 0), TransferFailure.TOO_LARGE),
    ):
        with pytest.raises(StateTransferFailed, match="exceeds max_bytes") as failure:
            attempt()
        assert failure.value.kind is kind
    exact = SwarmDownloads(y, "sizes", max_state_bytes=state_bytes, max_update_bytes=record_bytes)
    assert exact.state(donor).data == trio.blob.data
    assert exact.state_multi([donor], trio.blob.state_hash).data == trio.blob.data
    assert exact.update(donor, 0) == trio.record
