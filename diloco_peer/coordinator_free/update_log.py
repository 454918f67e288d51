"""The replay log: the last L applied updates, kept and served by every peer (DESIGN.md §3, 1).

The replicated state is a log: version v+1 is the outer step applied to version v with that
version's group average and member count. A peer behind by at most L versions fetches the missed
updates one by one from a peer that still holds them and replays them:

    record = UpdateRecord.from_bytes(blob, shapes=state.update_shapes())
    if record.base_version != state.version or record.base_hash != state.hash(): ...  # not mine
    state.apply(list(record.average), record.count, record.shard_samples)
    if state.hash() != record.result_hash: ...  # a bad record: fall back to a full download

Each download is one model-sized tensor set, instead of the full state with its optimizer
buffers. A record's hashes are what its donor claims; the replay above checks them, and the
final hash must equal what the head peers advertise in their signed DHT records.

Replay pays only while the missed updates cost fewer bytes than the state (`replay_horizon`):
θ plus k outer buffers makes k + 1 versions at most (Nesterov: 2), whatever L is. A peer keeps
just the updates such a replay asks it for (`log_capacity`): L = 16 records of a 150M-parameter
model would hold ~7.8 GB of RAM that no replay could use.

Wire format (safetensors, never pickle, DESIGN.md §4): the tensors `avg.0` .. `avg.{n-1}` (fp32,
one per parameter, in θ's order) and string metadata `format` (= FORMAT), `base_version`,
`count` (decimal), `base_hash`, `result_hash` (lowercase hex), `shard_samples` (JSON list of
`[shard, samples]` pairs, by shard), `info` (JSON object, str -> str). `from_bytes` reads that
layout itself: the 8-byte little-endian header length, the JSON header, then the raw data, which
it copies once into the result's tensors; every field is checked before any tensor is built.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import save

from diloco_peer.config import MAX_SAFETENSORS_HEADER_BYTES

FORMAT = "diloco-peer/update-v1"
"""The `format` tag of a serialised UpdateRecord; another tag is refused."""
_KEYS = frozenset(
    {"format", "base_version", "base_hash", "result_hash", "count", "shard_samples", "info"}
)
_HASH = re.compile(r"[0-9a-f]{1,128}")
"""A state hash as `hashlib`'s hexdigest writes it."""
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
"""Integers in metadata: ASCII digits, no sign, no leading zero (int() alone accepts ' +1_0')."""
_MAX_INT = 2**63 - 1
_MAX_METADATA_BYTES = MAX_SAFETENSORS_HEADER_BYTES // 2
"""Bound on `shard_samples` plus `info` as JSON strings inside the header (escapes included): a
record is tensors plus a little metadata, and its header (the metadata plus ~100 bytes per
tensor) must stay within MAX_SAFETENSORS_HEADER_BYTES, the most a parser accepts."""
_MAX_DIMS = 64
"""torch's own limit; also keeps a hostile shape's product a small integer to compute."""
_F32 = "F32"
_F32_BYTES = 4


def _int_in(name: str, value: object, low: int, high: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > _MAX_DIMS:
        raise ValueError(f"a shape must be a list of at most {_MAX_DIMS} ints")
    return tuple(_int_in("a shape dimension", d, 0) for d in value)


@dataclass(frozen=True, kw_only=True, eq=False)
class UpdateRecord:
    """One applied update: version `base_version` -> `base_version + 1` (DESIGN.md §3, 5).

    Immutable once built (the dicts are copied; do not modify the tensors in place). Compared
    by identity: two records are the same update when their bytes or hashes are.
    Any bad field raises ValueError.
    """

    base_version: int
    """The version v the update applies to."""
    base_hash: str
    """`state_hash(v)`: the state the update applies to (lowercase hex, at most 128 chars)."""
    result_hash: str
    """`state_hash(v + 1)` after applying it."""
    count: int
    """How many contributions the group average is over (>= 1)."""
    shard_samples: dict[int, int]
    """Shard -> samples the group's members added to that shard's counter nᵢ (>= 0 each)."""
    average: tuple[torch.Tensor, ...]
    """The group average of δ, one fp32 contiguous CPU tensor per parameter, in θ's order."""
    info: dict[str, str] = field(default_factory=dict)
    """Free-form small strings (members, staleness, ...): shown, never trusted."""

    def __post_init__(self) -> None:
        _int_in("base_version", self.base_version, 0, _MAX_INT - 1)  # v + 1 must fit as well
        for name in ("base_hash", "result_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _HASH.fullmatch(value):
                raise ValueError(f"{name} must be lowercase hex of 1 to 128 chars, got {value!r}")
        _int_in("count", self.count, 1)
        if not isinstance(self.shard_samples, Mapping):
            raise ValueError("shard_samples must be a dict of shard -> samples")
        shards = {
            _int_in("a shard", s, 0): _int_in(f"samples of shard {s}", n, 0)
            for s, n in self.shard_samples.items()
        }
        if not isinstance(self.info, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.info.items()
        ):
            raise ValueError("info must be a dict of str -> str")
        if not isinstance(self.average, (tuple, list)) or not self.average:
            raise ValueError("average must be a non-empty tuple of tensors")
        for i, t in enumerate(self.average):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"average[{i}] is a {type(t).__name__}, not a tensor")
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.layout != torch.strided:
                raise ValueError(f"average[{i}] must be fp32 on CPU, got {t.dtype} on {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"average[{i}] must be contiguous")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"average[{i}] has NaN or infinite values")
        # Dicts are copied so that the caller's later edits cannot change a logged record.
        object.__setattr__(self, "shard_samples", dict(sorted(shards.items())))
        object.__setattr__(self, "info", dict(self.info))
        object.__setattr__(self, "average", tuple(self.average))
        # as the header holds them: JSON strings, escapes included (ASCII-only escapes are an
        # upper bound on the UTF-8 safetensors writes)
        size = len(json.dumps(self._shards_json())) + len(json.dumps(self._info_json()))
        if size > _MAX_METADATA_BYTES:
            raise ValueError(
                f"shard_samples and info take {size} bytes, at most {_MAX_METADATA_BYTES}"
            )

    def _shards_json(self) -> str:
        return json.dumps([[s, n] for s, n in self.shard_samples.items()])

    def _info_json(self) -> str:
        return json.dumps(self.info, sort_keys=True)

    def to_bytes(self) -> bytes:
        """safetensors bytes: `avg.{i}` tensors plus string metadata (module docstring)."""
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for i, t in enumerate(self.average):
            t = t.detach()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in storages:
                t = t.clone()  # safetensors refuses tensors that share memory, e.g. (t, t)
            storages.add(ptr)
            tensors[f"avg.{i}"] = t
        metadata = {
            "format": FORMAT,
            "base_version": str(self.base_version),
            "base_hash": self.base_hash,
            "result_hash": self.result_hash,
            "count": str(self.count),
            "shard_samples": self._shards_json(),
            "info": self._info_json(),
        }
        return save(tensors, metadata)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, shapes: Sequence[tuple[int, ...]] | None = None
    ) -> UpdateRecord:
        """Parse and check `to_bytes()` output from any source (a donor may be hostile).

        `shapes`, when given, are θ's shapes: the record must have exactly one tensor of each.
        Raises ValueError with a short reason for anything wrong, and nothing else, whatever
        the bytes.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"an update record is bytes, got {type(data).__name__}")
        data = bytes(data)
        entries, metadata, start = _read_header(data)
        meta = _read_metadata(metadata)
        expected = [f"avg.{i}" for i in range(len(entries))]
        if sorted(entries) != sorted(expected):
            raise ValueError("tensors must be named avg.0 .. avg.{n-1}")
        if shapes is not None:
            try:
                want = [tuple(int(d) for d in s) for s in shapes]
            except (TypeError, ValueError):
                raise ValueError("shapes must be a sequence of tuples of ints") from None
            got = [entries[name][0] for name in expected]
            if len(got) != len(want):
                raise ValueError(f"{len(got)} tensors, the model has {len(want)} parameters")
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if g != w:
                    raise ValueError(f"avg.{i} has shape {list(g)}, the model's is {list(w)}")
        average = []
        for name in expected:
            shape, begin, end = entries[name]
            # '<f4': safetensors data is little-endian; astype copies into a writable array.
            array = np.frombuffer(
                data, dtype="<f4", count=(end - begin) // _F32_BYTES, offset=start + begin
            )
            average.append(torch.from_numpy(array.astype(np.float32)).reshape(shape))
        return cls(average=tuple(average), **meta)


def peek_update(data: bytes) -> tuple[int, str]:
    """(base_version, result_hash) of a serialised record, from its header only (cheap: what a
    donor puts in its answer's header). ValueError if the header or metadata is malformed."""
    _, metadata, _ = _read_header(data)
    meta = _read_metadata(metadata)
    return meta["base_version"], meta["result_hash"]


def _short(text: str | None) -> str:
    """A network string in an error message: quoted and cut, whatever its length."""
    return repr(text if text is None or len(text) <= 40 else text[:40] + "...")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in JSON")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: bytes | str, what: str) -> Any:
    """Strict JSON: UTF-8 only, no duplicate keys, no NaN/Infinity; ValueError otherwise."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")  # json.loads(bytes) would also guess UTF-16/32
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:  # deeply nested arrays: not a ValueError in the json module
        raise ValueError(f"{what}: nested too deeply") from None
    except ValueError as e:  # also UnicodeDecodeError, JSONDecodeError, huge int literals
        raise ValueError(f"{what}: not valid JSON ({type(e).__name__})") from None


def _read_header(
    data: bytes,
) -> tuple[dict[str, tuple[tuple[int, ...], int, int]], dict[str, str], int]:
    """The safetensors header, checked: name -> (shape, begin, end) of fp32 tensors whose data
    exactly tiles the buffer, the string metadata, and where the data starts."""
    if not isinstance(data, bytes) or len(data) < 8:
        raise ValueError("not an update record (too short)")
    size = int.from_bytes(data[:8], "little")
    if not 2 <= size <= min(MAX_SAFETENSORS_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"not an update record (header of {size} bytes)")
    header = _json(data[8 : 8 + size], "record header")
    if not isinstance(header, dict):
        raise ValueError("record header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("record has no string metadata")
    start, length = 8 + size, len(data) - 8 - size
    entries: dict[str, tuple[tuple[int, ...], int, int]] = {}
    for name, entry in header.items():
        tensor = f"tensor {_short(name)}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{tensor}: malformed entry")
        if entry["dtype"] != _F32:
            raise ValueError(f"{tensor}: dtype {_short(str(entry['dtype']))}, float32 expected")
        shape = _shape(entry["shape"])
        offsets = entry["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"{tensor}: malformed data_offsets")
        begin, end = (_int_in(f"{tensor}: a data offset", x, 0) for x in offsets)
        if end > length:
            raise ValueError(f"{tensor}: data_offsets past the end (truncated record?)")
        if end - begin != math.prod(shape) * _F32_BYTES:
            raise ValueError(f"{tensor}: data_offsets do not match its shape")
        entries[name] = (shape, begin, end)
    # The tensors' bytes must tile the data exactly: no gap, no overlap, nothing after.
    position = 0
    for _, begin, end in sorted(entries.values(), key=lambda e: (e[1], e[2])):
        if begin != position:
            raise ValueError("tensor data overlaps or leaves a gap")
        position = end
    if position != length:
        raise ValueError(f"{length - position} bytes after the last tensor")
    return entries, metadata, start


def _read_metadata(metadata: dict[str, str]) -> dict[str, Any]:
    """UpdateRecord's fields but `average`, parsed from the string metadata; the record's
    constructor checks their ranges."""
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"not an update record of format {FORMAT} ({_short(metadata.get('format'))})"
        )
    missing, unknown = _KEYS - set(metadata), set(metadata) - _KEYS
    if missing:
        raise ValueError(f"record metadata lacks {', '.join(sorted(missing))}")
    if unknown:
        raise ValueError(
            f"record metadata has {len(unknown)} unknown keys: {_short(min(unknown))}..."
        )
    ints = {}
    for name in ("base_version", "count"):
        if not _DECIMAL.fullmatch(metadata[name]):
            raise ValueError(f"{name} is not a decimal integer: {_short(metadata[name])}")
        ints[name] = int(metadata[name])
    pairs = _json(metadata["shard_samples"], "shard_samples")
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError("shard_samples must be a JSON list of [shard, samples] pairs")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s, _ in pairs):
        raise ValueError("shard_samples: shards must be integers")
    shard_samples = {s: n for s, n in pairs}
    if len(shard_samples) != len(pairs):
        raise ValueError("shard_samples names a shard twice")
    info = _json(metadata["info"], "info")
    if not isinstance(info, dict):
        raise ValueError("info must be a JSON object")
    return {
        **ints,
        "base_hash": metadata["base_hash"],
        "result_hash": metadata["result_hash"],
        "shard_samples": shard_samples,
        "info": info,
    }


REPLAY_SLACK = 1
"""Versions a donor may commit between a replayer's reading of its head and the replay's
requests: the updates asked for then end one version below the donor's newest."""


def replay_horizon(update_bytes: int, state_bytes: int) -> int:
    """The most missed versions a peer replays instead of downloading the full state.

    Replaying n versions downloads n updates of `update_bytes` (θ's fp32 size) each, so it pays
    while n × update_bytes < state_bytes. A state of θ and k outer buffers (Nesterov: k = 1;
    Adam, Delayed Nesterov: k = 2) plus its header gives k + 1; 0 when either size is unknown.
    """
    _int_in("update_bytes", update_bytes, 0)
    _int_in("state_bytes", state_bytes, 0)
    if update_bytes == 0 or state_bytes == 0:
        return 0
    return (state_bytes - 1) // update_bytes


def replays(missed: int, window: int) -> bool:
    """Whether catch-up replays updates (else it downloads the full state): `missed` versions
    behind the head within the replay `window` (`min(L, replay_horizon)`), or a fork at our own
    version (`missed` 0), healed by replaying the winner's update from our parent state."""
    return 0 < missed <= window or (missed == 0 and window > 0)


def log_capacity(keep_updates: int, update_bytes: int, state_bytes: int) -> int:
    """How many applied updates a peer keeps: every one a replay could ask it for.

    A replayer behind by at most `min(L, replay_horizon)` versions asks for that many updates,
    ending at most REPLAY_SLACK versions below the donor's newest; older records would only
    take memory (one model-sized record each). Never more than the run's L (`keep_updates`);
    none when replay never pays.
    """
    _int_in("keep_updates", keep_updates, 0)
    horizon = min(keep_updates, replay_horizon(update_bytes, state_bytes))
    return 0 if horizon == 0 else min(keep_updates, horizon + REPLAY_SLACK)


class UpdateLog:
    """The last `capacity` applied updates as serialised records, keyed by base version.

    Always a contiguous chain: each record applies to the state the previous one produced
    (consecutive versions, matching hashes). Appending anything else (a jump after a full-state
    download, a fork healed onto another branch) drops the older records first. Thread-safe:
    `append` serialises outside the lock, so `get` from the asyncio loop thread (a StateServer's
    `updates=log.get`) only ever waits for a dict operation.
    """

    def __init__(self, capacity: int = 16) -> None:
        self.limit = _int_in("capacity", capacity, 0)
        """L, the run's bound (`SwarmSettings.keep_updates`): `fit` never keeps more."""
        self._capacity = self.limit
        self._lock = threading.Lock()
        self._records: dict[int, bytes] = {}  # insertion order = version order
        self._head_hash: str | None = None  # result_hash of the newest record

    @property
    def capacity(self) -> int:
        """Records kept at most now: L until `fit` sizes the log to what replay can use."""
        return self._capacity

    def fit(self, update_bytes: int, state_bytes: int) -> int:
        """Keep only what a replay can ask for (`log_capacity`), given θ's size and the
        serialised state's (both change only when the outer buffers appear, after the first
        step); the oldest records go first. Returns the new capacity."""
        capacity = log_capacity(self.limit, update_bytes, state_bytes)
        with self._lock:
            self._capacity = capacity
            self._evict()
        return capacity

    def _evict(self) -> None:
        while len(self._records) > self._capacity:
            del self._records[next(iter(self._records))]

    def nbytes(self) -> int:
        """Bytes of the records kept (what the log costs in memory)."""
        with self._lock:
            return sum(len(data) for data in self._records.values())

    def append(self, record: UpdateRecord) -> None:
        """Keep `record` (serialised once, now) as the newest update, evicting the oldest."""
        if not isinstance(record, UpdateRecord):
            raise ValueError(f"expected an UpdateRecord, got {type(record).__name__}")
        if self._capacity == 0:
            return
        data = record.to_bytes()
        with self._lock:
            newest = next(reversed(self._records), None)
            if newest is None or (
                record.base_version != newest + 1 or record.base_hash != self._head_hash
            ):
                self._records.clear()
            self._records[record.base_version] = data
            self._head_hash = record.result_hash
            self._evict()

    def get(self, base_version: int) -> bytes | None:
        """The serialised record that applies to `base_version`, or None if not kept."""
        with self._lock:
            return self._records.get(base_version)

    def oldest(self) -> int | None:
        """The lowest base version kept, or None when empty."""
        with self._lock:
            return next(iter(self._records), None)

    def newest(self) -> int | None:
        """The highest base version kept, or None when empty."""
        with self._lock:
            return next(reversed(self._records), None)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._head_hash = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


__all__ = [
    "FORMAT",
    "REPLAY_SLACK",
    "UpdateLog",
    "UpdateRecord",
    "log_capacity",
    "peek_update",
    "replay_horizon",
]
