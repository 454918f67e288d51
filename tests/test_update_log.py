"""The replay log: UpdateRecord's wire format and checks, UpdateLog's bound and chain rule, and
an in-process replay of recorded updates onto a second ReplicatedState (DESIGN.md §3, 1)."""

from __future__ import annotations

import hashlib
import json
import struct
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.coordinator_free.update_log import (
    FORMAT,
    REPLAY_SLACK,
    UpdateLog,
    UpdateRecord,
    log_capacity,
    peek_update,
    replay_horizon,
    replays,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES = [(3, 4), (5,), ()]
MODEL_SHAPES = [(3, 4), (5,), (2, 1, 3)]
"""θ's shapes in the replay (ReplicatedState.hash cannot view a 0-dim tensor as bytes)."""


def fake_hash(tag: object) -> str:
    return hashlib.sha256(str(tag).encode()).hexdigest()


def make_record(base_version: int = 4, seed: int = 0, **changes: object) -> UpdateRecord:
    generator = torch.Generator().manual_seed(seed)
    fields: dict[str, object] = {
        "base_version": base_version,
        "base_hash": fake_hash(base_version),
        "result_hash": fake_hash(base_version + 1),
        "count": 3,
        "shard_samples": {2: 640, 0: 128},
        "average": tuple(torch.randn(s, generator=generator) for s in SHAPES),
        "info": {"members": "a,b,c", "staleness": "0"},
    }
    return UpdateRecord(**(fields | changes))  # type: ignore[arg-type]


def chain(count: int, start: int = 0) -> list[UpdateRecord]:
    """`count` records forming a chain: each one's base_hash is the previous one's result."""
    return [make_record(v, seed=v) for v in range(start, start + count)]


def split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors blob's JSON header and its data section."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def with_metadata(data: bytes, **changes: str) -> bytes:
    header, body = split(data)
    header["__metadata__"] = header["__metadata__"] | changes
    return join(header, body)


# --------------------------------------------------------------------------- UpdateRecord


@pytest.mark.timeout(10)
def test_record_round_trips_bit_exactly() -> None:
    record = make_record(shard_samples={}, info={})
    data = record.to_bytes()
    again = UpdateRecord.from_bytes(data, shapes=SHAPES)
    for name in ("base_version", "base_hash", "result_hash", "count", "shard_samples", "info"):
        assert getattr(again, name) == getattr(record, name), name
    assert len(again.average) == len(SHAPES)
    for a, b in zip(again.average, record.average, strict=True):
        assert a.dtype == torch.float32 and a.is_contiguous() and a.shape == b.shape
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # the same bits
    a0 = again.average[0]
    a0 += 1  # writable, and owned by the record rather than by the received bytes
    assert peek_update(data) == (record.base_version, record.result_hash)
    full = make_record()
    assert UpdateRecord.from_bytes(full.to_bytes()).shard_samples == {0: 128, 2: 640}
    assert UpdateRecord.from_bytes(full.to_bytes()).info == full.info
    # plain safetensors: any reader sees avg.{i} and the format tag
    assert set(load(data)) == {"avg.0", "avg.1", "avg.2"}
    assert split(data)[0]["__metadata__"]["format"] == FORMAT == "diloco-peer/update-v1"


@pytest.mark.timeout(10)
def test_record_copies_dicts_and_serialises_shared_tensors() -> None:
    shards, info = {1: 5}, {"k": "v"}
    record = make_record(shard_samples=shards, info=info)
    shards[1], info["k"] = 6, "w"
    assert record.shard_samples == {1: 5} and record.info == {"k": "v"}
    t = torch.ones(4)
    again = UpdateRecord.from_bytes(make_record(average=(t, t)).to_bytes())
    assert all(torch.equal(a, t) for a in again.average)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "changes",
    [
        {"base_version": -1},
        {"base_version": True},
        {"base_version": 2**63 - 1},  # no version after it
        {"base_hash": ""},
        {"base_hash": "AB"},  # hexdigest is lowercase
        {"result_hash": "g" * 64},
        {"result_hash": "a" * 129},
        {"count": 0},
        {"count": 1.0},
        {"shard_samples": {-1: 3}},
        {"shard_samples": {0: -3}},
        {"shard_samples": [(0, 3)]},
        {"average": ()},
        {"average": (torch.ones(2, dtype=torch.float64),)},
        {"average": (torch.ones(2, 3).t(),)},  # not contiguous
        {"average": (torch.tensor([1.0, float("nan")]),)},
        {"average": (torch.tensor([float("-inf")]),)},
        {"average": ([1.0, 2.0],)},
        {"info": {"k": 1}},
        {"info": {"k": "x" * (1 << 20)}},
    ],
)
def test_record_rejects_bad_fields(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_record(**changes)


@pytest.mark.timeout(10)
def test_from_bytes_rejects_wrong_shape_nan_count_tag_and_truncation() -> None:
    data = make_record().to_bytes()
    header, body = split(data)
    cases: dict[str, tuple[bytes, str]] = {
        "truncated": (data[:-1], "bytes after|overlaps|gap|data_offsets"),
        "short": (data[:5], "too short"),
        "header cut": (data[: len(data) // 3], "header"),
        "bad tag": (with_metadata(data, format="diloco-peer/update-v0"), "format"),
        "no tag": (join(header | {"__metadata__": {}}, body), "format"),
        "count 0": (with_metadata(data, count="0"), "count"),
        "count text": (with_metadata(data, count=" 3"), "count"),
        "version sign": (with_metadata(data, base_version="+4"), "base_version"),
        "hash": (with_metadata(data, base_hash="xyz"), "base_hash"),
        "extra key": (with_metadata(data, note="hi"), "keys"),
        "shards": (with_metadata(data, shard_samples='{"0": 3}'), "shard_samples"),
        "shards twice": (with_metadata(data, shard_samples="[[0, 1], [0, 2]]"), "twice"),
        "info": (with_metadata(data, info='{"a": 1}'), "info"),
        "info NaN": (with_metadata(data, info='{"a": NaN}'), "info"),
    }
    nan = make_record(average=(torch.ones(2),)).to_bytes()
    nan = nan[:-4] + struct.pack("<f", float("nan"))  # the last value: raw bytes, not checked
    cases["NaN"] = (nan, "NaN")
    renamed = dict(header)
    renamed["avg.5"] = renamed.pop("avg.2")
    cases["names"] = (join(renamed, body), "avg.0")
    as_f16 = header | {"avg.2": header["avg.2"] | {"dtype": "F16"}}
    cases["dtype"] = (join(as_f16, body), "float32")
    for name, (bad, reason) in cases.items():
        with pytest.raises(ValueError, match=reason):
            UpdateRecord.from_bytes(bad)
            pytest.fail(name)
    with pytest.raises(ValueError, match="shape"):
        UpdateRecord.from_bytes(data, shapes=[(4, 3), (5,), ()])
    with pytest.raises(ValueError, match="parameters"):
        UpdateRecord.from_bytes(data, shapes=SHAPES[:2])
    with pytest.raises(ValueError):
        UpdateRecord.from_bytes("not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):  # another safetensors file, not a record
        UpdateRecord.from_bytes(
            save({"avg.0": torch.ones(2, dtype=torch.int64)}, header["__metadata__"])
        )
    with pytest.raises(ValueError, match="nested"):
        deep = b"[" * 100_000 + b"]" * 100_000
        UpdateRecord.from_bytes(struct.pack("<Q", len(deep)) + deep)


VALID = make_record().to_bytes()


@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=2000))
def test_from_bytes_of_random_bytes_raises_only_value_error(data: bytes) -> None:
    try:
        UpdateRecord.from_bytes(data)
    except ValueError:
        pass


@pytest.mark.timeout(120)
@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255), st.sampled_from("sid")),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, len(VALID)),
)
def test_from_bytes_of_mutated_record_raises_only_value_error(
    edits: list[tuple[int, int, str]], cut: int
) -> None:
    data = bytearray(VALID)
    for position, value, kind in edits:
        position = min(position, len(data) - 1) if data else 0
        if kind == "s" and data:
            data[position] = value  # substitute
        elif kind == "i":
            data.insert(position, value)
        elif data:
            del data[position]
    for candidate in (bytes(data), bytes(data[:cut])):
        try:
            record = UpdateRecord.from_bytes(candidate, shapes=SHAPES)
        except ValueError:
            continue
        assert record.count >= 1 and all(torch.isfinite(t).all() for t in record.average)


json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)


@pytest.mark.timeout(120)
@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["format", "base_version", "base_hash", "count", "shard_samples", "info"]),
        st.text(max_size=12) | json_values.map(json.dumps),
        max_size=6,
    ),
    st.dictionaries(
        st.sampled_from(["avg.0", "avg.1", "avg.2", "avg.3", "x"]),
        json_values
        | st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "F16", "I64", 3]),
                "shape": st.lists(st.integers(-1, 5), max_size=3) | json_values,
                "data_offsets": st.lists(st.integers(-4, 300), max_size=3) | json_values,
            }
        ),
        max_size=4,
    ),
)
def test_from_bytes_of_forged_headers_raises_only_value_error(
    metadata: dict[str, str], tensors: dict[str, object]
) -> None:
    """Well-formed JSON headers with wrong fields reach the checks that bit flips do not."""
    header, body = split(VALID)
    forged = header["__metadata__"] | metadata
    for data in (join({"__metadata__": forged} | tensors, body), join(header | tensors, body)):
        try:
            UpdateRecord.from_bytes(data)
            peek_update(data)
        except ValueError:
            pass


# --------------------------------------------------------------------------- UpdateLog


@pytest.mark.timeout(10)
def test_log_keeps_the_last_capacity_records() -> None:
    log = UpdateLog(capacity=3)
    assert len(log) == 0 and log.oldest() is None and log.newest() is None
    records = chain(5)
    for record in records:
        log.append(record)
    assert len(log) == 3 and (log.oldest(), log.newest()) == (2, 4)
    assert log.get(0) is None and log.get(1) is None and log.get(5) is None
    for v in (2, 3, 4):
        data = log.get(v)
        assert data is not None and peek_update(data) == (v, records[v].result_hash)
    assert log.get(4) is log.get(4)  # serialised once, at append
    log.clear()
    assert len(log) == 0 and log.newest() is None
    nothing = UpdateLog(capacity=0)
    nothing.append(records[0])
    assert len(nothing) == 0 and nothing.get(0) is None
    assert UpdateLog().capacity == 16
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError):
            UpdateLog(capacity=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        log.append(records[0].to_bytes())  # type: ignore[arg-type]


def test_replay_pays_while_the_missed_updates_cost_less_than_the_state() -> None:
    model = 1000  # θ's bytes; a state is θ, k outer buffers and a header of a few hundred bytes
    assert replay_horizon(model, model + 300) == 1  # SGD, or any state before the first step
    assert replay_horizon(model, 2 * model + 300) == 2  # Nesterov: θ and the momentum
    assert replay_horizon(model, 3 * model + 300) == 3  # Adam, Delayed Nesterov: two buffers
    assert replay_horizon(model, 2 * model) == 1  # n × update < state, strictly
    assert replay_horizon(model, 2 * model + 1) == 2
    assert replay_horizon(0, 5000) == replay_horizon(model, 0) == 0  # unknown: never replay
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError):
            replay_horizon(bad, 5000)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            replay_horizon(model, bad)  # type: ignore[arg-type]


def test_the_log_keeps_the_horizon_plus_the_slack_never_more_than_l() -> None:
    model = 1000
    assert REPLAY_SLACK == 1
    nesterov = 2 * model + 300
    assert log_capacity(16, model, nesterov) == 2 + REPLAY_SLACK  # was 16
    assert log_capacity(16, model, 3 * model + 300) == 3 + REPLAY_SLACK
    assert log_capacity(16, model, model + 300) == 1 + REPLAY_SLACK  # version 0: θ alone
    assert log_capacity(2, model, nesterov) == 2  # L bounds it
    assert log_capacity(1, model, nesterov) == 1
    assert log_capacity(0, model, nesterov) == 0  # L = 0: no replay at all
    assert log_capacity(16, model, 0) == 0  # no state yet: replay never pays
    assert log_capacity(16, 4, 10**6) == 16  # a tiny model in a big header: L
    with pytest.raises(ValueError):
        log_capacity(-1, model, nesterov)


@pytest.mark.timeout(10)
def test_fit_shrinks_the_log_to_what_replay_can_use_and_its_bytes_stay_flat() -> None:
    log = UpdateLog(capacity=16)
    records = chain(40)
    for record in records[:10]:
        log.append(record)
    assert (len(log), log.limit, log.capacity) == (10, 16, 16)
    model = 1000  # θ's bytes, as the replica says (the records' own size does not matter)
    assert log.fit(model, 2 * model + 300) == 3  # Nesterov's state: keep 2 + slack
    assert (log.oldest(), log.newest(), log.capacity) == (7, 9, 3)
    sizes = []
    for record in records[10:]:
        log.append(record)
        sizes.append(log.nbytes())
    assert (len(log), log.oldest(), log.newest()) == (3, 37, 39)
    assert len(set(sizes)) == 1 and sizes[0] == sum(len(log.get(v) or b"") for v in (37, 38, 39))
    assert log.fit(model, 10**9) == 16  # never past L, however big the state
    assert log.fit(model, 0) == 0 and len(log) == 0 and log.nbytes() == 0
    log.append(records[0])
    assert len(log) == 0


@pytest.mark.timeout(10)
def test_log_is_always_a_contiguous_chain() -> None:
    log = UpdateLog(capacity=8)
    for record in chain(3):
        log.append(record)
    log.append(make_record(10, seed=10))  # a jump (after a full-state download): restart
    assert (log.oldest(), log.newest(), len(log)) == (10, 10, 1)
    log.append(make_record(11, seed=11))
    assert (log.oldest(), log.newest()) == (10, 11)
    log.append(make_record(11, seed=99))  # the same version again (a fork healed): restart
    assert (log.oldest(), log.newest(), len(log)) == (11, 11, 1)
    log.append(make_record(12, seed=12, base_hash=fake_hash("other")))  # next version, but
    assert (log.oldest(), log.newest(), len(log)) == (12, 12, 1)  # not from the newest result
    log.append(make_record(5, seed=5))  # backwards
    assert (log.oldest(), log.newest(), len(log)) == (5, 5, 1)


@pytest.mark.timeout(30)
def test_log_reads_while_another_thread_appends() -> None:
    log = UpdateLog(capacity=4)
    records = chain(200)
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            newest, oldest = log.newest(), log.oldest()
            if newest is not None and oldest is not None:
                assert newest - oldest < 4
                seen.append(newest)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for record in records:
            log.append(record)
    finally:
        done.set()
        reader.join(timeout=10)
    assert seen and seen == sorted(seen)
    assert (log.oldest(), log.newest()) == (196, 199)


# --------------------------------------------------------------------------- replay


def make_state(seed: int) -> ReplicatedState:
    generator = torch.Generator().manual_seed(seed)
    theta = [torch.randn(s, generator=generator) for s in MODEL_SHAPES]
    outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    return ReplicatedState(theta, outer, num_shards=4, manifest_digest="m" * 64)


@pytest.mark.timeout(30)
def test_replaying_recorded_updates_reproduces_every_state_hash() -> None:
    """One peer applies 3 group averages and logs them; another, from the same initial state,
    replays the serialised records and holds the same bits after each."""
    head, behind = make_state(seed=1), make_state(seed=1)
    log = UpdateLog(capacity=16)
    hashes = [head.hash()]
    generator = torch.Generator().manual_seed(2)
    for round_ in range(3):
        average = tuple(torch.randn(s, generator=generator) * 1e-2 for s in MODEL_SHAPES)
        count, shards = round_ + 1, {round_ % 4: 32 * (round_ + 1)}
        base_version, base_hash = head.version, head.hash()
        head.apply(list(average), count, shards)
        log.append(
            UpdateRecord(
                base_version=base_version,
                base_hash=base_hash,
                result_hash=head.hash(),
                count=count,
                shard_samples=shards,
                average=average,
                info={"round": str(round_)},
            )
        )
        hashes.append(head.hash())
    assert len(set(hashes)) == 4 and (log.oldest(), log.newest()) == (0, 2)
    assert behind.hash() == hashes[0]
    shapes = [tuple(t.shape) for t in behind.theta]
    while behind.version <= log.newest():  # type: ignore[operator]
        data = log.get(behind.version)
        assert data is not None
        record = UpdateRecord.from_bytes(data, shapes=shapes)
        assert (record.base_version, record.base_hash) == (behind.version, behind.hash())
        behind.apply(list(record.average), record.count, record.shard_samples)
        assert behind.hash() == record.result_hash == hashes[behind.version]
    assert behind.version == head.version == 3
    assert behind.shard_samples == head.shard_samples == [32, 64, 96, 0]


def test_catch_up_replays_within_the_window_and_heals_a_fork_at_its_own_version() -> None:
    assert replays(1, 2) and replays(2, 2)
    assert not replays(3, 2)  # further behind: the full state costs less
    assert replays(0, 2)  # a fork at our version: the winner's update from our parent
    assert not replays(0, 0) and not replays(1, 0)  # no log: always the full state
