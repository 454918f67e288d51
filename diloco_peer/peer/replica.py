"""This peer's copy of the replicated state (DESIGN §3): the state, the serialised blob it serves,
and the log of applied updates it keeps for others to replay.

The blob is the state as last published: catch-up and the round change `state` in place and
either `snapshot()` (the change is kept, the head moves) or `restore()` (back to the blob). The
blob's hash is the one the peer's head advertises while the state is being changed.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_peer.averaging.certificate import GroupPart, pack_groups, pack_headers
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import MAX_SAFETENSORS_HEADER_BYTES
from diloco_peer.coordinator_free.state_transfer import StateBlob
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import BadInput, ConfigError
from diloco_peer.peer.checkpoint import atomic_write, safetensors_metadata

log = logging.getLogger(__name__)

RECENT_NORMS = 8
"""Applied updates whose norms `recent_norms` remembers."""


class Replica:
    """The state, its published snapshot, and the update log (with `--record-updates` on disk)."""

    def __init__(
        self, state: ReplicatedState, updates: UpdateLog, record_dir: str | None = None
    ) -> None:
        self.state = state
        self.updates = updates
        self.record_dir = Path(record_dir) if record_dir else None
        self.blob: StateBlob | None = None
        self.parent: StateBlob | None = None
        """The snapshot of the version just below ours, while we hold the one right after it: a
        fork at our version heals by replaying the winning branch from it (catch_up.py), which
        verifies that branch's certificate; downloading it whole would take one key's word."""
        self._below: StateBlob | None = None
        """A downloaded state the replica stepped from (`step_from`): the next snapshot's
        `parent`."""
        self._jumped = False
        """Whether a state other than the snapshot's was loaded whole (a download, the parent)
        since the last snapshot: the next version is then not known to be stepped from it."""
        self._norms = [deque[float](maxlen=RECENT_NORMS) for _ in state.parts]
        """Per fragment (one list for the whole model): norms of its last updates."""
        self._damping: tuple[tuple[str, str], list[torch.Tensor]] | None = None
        """`last_damping` of the step between these (parent, blob) hashes."""

    def recent_norms(self) -> list[float]:
        """Norms of the last updates applied here to the fragment the next update moves (a
        replayed one is screened against them; fragments differ in size)."""
        return list(self._norms[self.state.version % len(self._norms)])

    # ----- the published snapshot

    def snapshot(self) -> None:
        """Cache the serialised state the state server hands out (immutable bytes), and size
        the update log to what a replay can ask for against a state of that size."""
        data = st_save(self.state.tensors(), metadata=self.state.metadata())
        blob = StateBlob(version=self.state.version, state_hash=self.state.hash(), data=data)
        below, self._below = self._below, None
        stepped, self._jumped = not self._jumped, False
        if below is not None and blob.version == below.version + 1:
            self.parent = below
        elif self.blob is not None and blob.version == self.blob.version + 1 and stepped:
            self.parent = self.blob  # not after a download of the next version: another branch's
        elif self.blob is None or blob.version != self.blob.version:
            self.parent = None  # a jump: we never held the version below this one
        self.blob = blob
        self.updates.fit(self.replay_bytes(), len(data))

    def update_bytes(self) -> int:
        """θ's size in fp32: what one update of the whole model holds (its tensors)."""
        return 4 * sum(t.numel() for t in self.state.theta)

    def replay_bytes(self) -> int:
        """What one replayed update downloads, on average: θ's size over the fragments (each
        update carries one), so that replay reaches P times as far with P fragments."""
        return -(-self.update_bytes() // len(self.state.parts))

    def max_blob_bytes(self) -> int:
        """The most bytes any serialised state of this run takes: θ and each outer buffer in
        fp32 (whether or not ours exist yet: none before the first outer step), behind a
        safetensors header of at most MAX_SAFETENSORS_HEADER_BYTES. Every peer of the run has
        the same model, so a donor that announces more is refused before it sends any."""
        tensors = (1 + self.state.outer.buffer_count) * self.update_bytes()
        return 8 + MAX_SAFETENSORS_HEADER_BYTES + tensors

    def max_record_bytes(self) -> int:
        """The most bytes a serialised update record of this run takes: one fp32 average per
        parameter behind a header of at most MAX_SAFETENSORS_HEADER_BYTES."""
        return 8 + MAX_SAFETENSORS_HEADER_BYTES + self.update_bytes()

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def published_hash(self) -> str:
        """The hash this peer advertises: the snapshot's (the state's before the first one)."""
        return self.at()[1]

    def at(self) -> tuple[int, str]:
        """(published version, published hash): where this replica is for every other peer (its
        head, a round's group key, a swarm view), the snapshot the state server hands out.
        Between a group's `prepare` and its `publish` the state is one version ahead of it: a
        head that paired the state's version with the snapshot's hash named a state nobody
        holds (seen: two peers' heartbeats said "v6 = v5's hash" during their commit, and a
        third peer followed that "fork" back to v5 and contributed its δ twice). One read of the
        snapshot, which another thread may replace meanwhile (`snapshot`)."""
        blob = self.blob
        return (
            (self.state.version, self.state.hash())
            if blob is None
            else (blob.version, blob.state_hash)
        )

    @property
    def published_version(self) -> int:
        """The version this peer advertises: the snapshot's (the state's before the first one)."""
        return self.blob.version if self.blob is not None else self.state.version

    def load_parent(self) -> None:
        """Back to the version below ours (`parent`), to replay another branch from it."""
        if self.parent is None:
            raise ValueError("no parent state kept")
        self.load(self.parent.data)

    def step_from(self, below: StateBlob, record: UpdateRecord) -> None:
        """Load a downloaded state and apply the update from it (a certified record), so that
        the version reached keeps `below` as its parent (`last_damping`); ConfigError or
        ValueError (the replica then needs `restore`) unless `below` holds the state its hash
        names, at the record's base, and the record gives the hash it names."""
        self.load(below.data)
        at = (below.version, below.state_hash, self.state.version, self.state.hash())
        if at != (record.base_version, record.base_hash) * 2:
            raise ValueError("the state below the head is not the one its update starts from")
        self.apply_record(record)
        self._below = below

    def restore(self) -> None:
        """Back to the state of the snapshot (our last published version)."""
        self._below = None
        if self.blob is not None and self.state.hash() != self.blob.state_hash:
            self.load(self.blob.data)
        self._jumped = False  # the state is the snapshot's again

    def load(self, data: bytes) -> None:
        """Replace the state by serialised bytes (a download, or the snapshot); ConfigError if
        they are not a valid state of this run."""
        try:
            metadata = safetensors_metadata(data, len(data), "downloaded state")
            tensors = st_load(data)
        except Exception as e:
            raise ConfigError(f"downloaded state is not a valid safetensors blob ({e})") from e
        self.state.load(tensors, metadata)
        self._jumped = self.blob is None or data is not self.blob.data

    def last_damping(self) -> list[torch.Tensor] | None:
        """Δ − (θ_{v−1} − θ_v) of the update that made our published version v: its average
        less the step it moved θ by (ALGORITHMS §1.1: an overlapped `mix` δ carries κ times
        it), from the update log's record and the snapshot of the version below (`parent`);
        None when we did not step to v from v − 1 here (a download, a jump) or its record is
        gone from the log."""
        blob, parent, data = self.blob, self.parent, self.updates.get(self.state.version - 1)
        if data is None or blob is None or parent is None or blob.version != self.state.version:
            return None
        at = (parent.state_hash, blob.state_hash)
        if self._damping is not None and self._damping[0] == at:
            return self._damping[1]
        record = UpdateRecord.from_bytes(data)  # kept by us: checked when it was applied
        if (record.base_hash, record.result_hash) != at:
            return None  # another branch's update at that version
        before = st_load(parent.data)
        damping = [
            a - (before[f"theta.{i}"] - t)
            for i, (a, t) in enumerate(zip(record.average, self.state.theta, strict=True))
        ]
        self._damping = (at, damping)
        return damping

    # ----- updates

    def commit(
        self,
        average: Sequence[torch.Tensor],
        members: Sequence[str],
        shard_samples: dict[int, int],
        headers: Mapping[str, bytes],
    ) -> UpdateRecord:
        """Apply a group's average as the next version and publish it (`prepare`, `publish`)."""
        record = self.prepare(average, members, shard_samples, headers)
        self.publish(record)
        return record

    def prepare(
        self,
        average: Sequence[torch.Tensor],
        members: Sequence[str],
        shard_samples: dict[int, int],
        headers: Mapping[str, bytes],
        groups: Sequence[GroupPart] | None = None,
    ) -> UpdateRecord:
        """Apply a group's average to the state (identical on every member), not yet published:
        the update, with the members' signed `headers` for its certificate (peer/certify.py),
        and a two-stage update's `groups`. `publish` keeps it; `restore` gives it up."""
        base_version, base_hash = self.state.version, self.published_hash
        self.state.apply(average, len(members), shard_samples)
        info = {"members": ",".join(members), "headers": pack_headers(headers)}
        if groups is not None:
            info["groups"] = pack_groups(groups)
        return UpdateRecord(
            base_version=base_version, base_hash=base_hash, result_hash=self.state.hash(),
            count=len(members), shard_samples=dict(shard_samples),
            average=tuple(a.to("cpu", torch.float32).contiguous() for a in average),
            info=info,
        )  # fmt: skip

    def publish(self, record: UpdateRecord) -> None:
        """Keep a prepared update for replay and publish the new snapshot."""
        self.keep(record)
        self.snapshot()

    def apply_record(self, record: UpdateRecord) -> None:
        """Apply one replayed update; ValueError unless it gives the hash its record names."""
        self.state.apply(list(record.average), record.count, record.shard_samples)
        if self.state.hash() != record.result_hash:
            raise ValueError(f"update {record.base_version} gives another state hash")

    def keep(self, record: UpdateRecord) -> None:
        """Keep an applied update for others to replay (and on disk with --record-updates)."""
        self.updates.append(record)
        squares = sum(float(a.double().square().sum()) for a in record.average)
        self._norms[record.base_version % len(self._norms)].append(math.sqrt(squares))
        if self.record_dir is not None:
            path = self.record_dir / f"update-{record.base_version:08d}.safetensors"
            data = self.updates.get(record.base_version) or record.to_bytes()
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

    def record_state(self, version: int, data: bytes) -> None:
        """With --record-updates, a downloaded full state: the replay of recorded updates
        restarts from it."""
        if self.record_dir is not None:
            path = self.record_dir / f"state-{version:08d}.safetensors"
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def prepare_record_dir(folder: str | None) -> None:
    """`--record-updates`: a usable folder that holds no updates yet, or BadInput."""
    if not folder:
        return
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--record-updates folder {path} is not usable ({e.strerror})") from None
    if any(path.glob("update-*.safetensors")):
        raise BadInput(f"--record-updates folder {path} already holds updates; use a new one")
