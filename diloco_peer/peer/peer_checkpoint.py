"""A peer's checkpoint (`join --checkpoint-dir`): global state, local AdamW state, the local
parameters, data positions and a pending δ, in one safetensors file written atomically.

Metadata holds the signed manifest (so a restarted founder keeps its run), the rounds done and
a sha256 of everything in the file: a flipped byte is refused with a clear error, and the file
is left as it is. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.errors import BadInput, CheckpointError, DilocoError
from diloco_peer.peer.checkpoint import (
    atomic_write,
    read_file_metadata,
    safetensors_metadata,
    tensors_digest,
)
from diloco_peer.peer.data import ShardStream
from diloco_peer.peer.delta import Contribution
from diloco_peer.peer.inner import InnerTrainer

CHECKPOINT_FORMAT = "diloco-peer/peer-checkpoint-v2"
"""v2 added the sha256 of everything in the file (v1 files are refused with a clear error)."""


def checkpoint_path(checkpoint_dir: str | None, run_name: str) -> Path | None:
    if not checkpoint_dir:
        return None
    return Path(checkpoint_dir) / f"{run_name}.peer.safetensors"


def checkpoint_digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over every tensor (names, dtypes, shapes, bytes) and every metadata entry but
    itself: a flipped byte anywhere in a peer checkpoint is detected on load."""
    h = hashlib.sha256(tensors_digest(tensors).encode())
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(rest, sort_keys=True).encode())
    return h.hexdigest()


def stored_manifest(path: Path | None, run_name: str) -> SignedManifest | None:
    """The manifest stored in a peer checkpoint, if there is a readable one (`load` reports an
    unusable checkpoint with a clear error)."""
    if path is None or not path.is_file():
        return None
    try:
        meta = read_file_metadata(path)
        return SignedManifest.from_bytes(meta["manifest_bytes"].encode(), expected_run=run_name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DilocoError):
        return None


def check_writable(path: Path, peer_id: str) -> None:
    """The checkpoint folder exists (made if needed) and takes files, or BadInput."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".probe-{peer_id[-8:]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(
            f"checkpoint directory {path.parent} is not writable ({e.strerror})"
        ) from None


@dataclass(frozen=True)
class PeerParts:
    """What a peer checkpoint saves and restores, in place."""

    state: ReplicatedState
    trainer: InnerTrainer
    streams: Sequence[ShardStream]
    signed: SignedManifest
    peer_id: str


def save(path: Path, parts: PeerParts, rounds_done: int, pending: Contribution | None) -> None:
    """Global state, local AdamW state and data positions (and a pending δ), atomically."""
    tensors = {f"global.{k}": v for k, v in parts.state.tensors().items()}
    opt = parts.trainer.optimizer.state_dict()
    opt_meta: dict[str, Any] = {"param_groups": opt["param_groups"], "state": {}}
    for pid, st in opt["state"].items():
        entry = {}
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"adam.{pid}.{name}"] = value.detach().to("cpu").contiguous()
                entry[name] = "tensor"
            else:
                entry[name] = value
        opt_meta["state"][str(pid)] = entry
    for i, p in enumerate(parts.trainer.params):
        tensors[f"local.{i}"] = p.detach().to("cpu").contiguous()
    meta = {
        "format": CHECKPOINT_FORMAT,
        "manifest": parts.signed.digest,
        "manifest_bytes": parts.signed.to_bytes().decode(),
        "peer": parts.peer_id,
        "rounds_done": str(rounds_done),
        "streams": json.dumps([s.state_dict() for s in parts.streams]),
        "adam": json.dumps(opt_meta, default=float),
        **{f"state.{k}": v for k, v in parts.state.metadata().items()},
    }
    if pending is not None:  # a δ not applied yet goes into the next group after resume
        tensors.update({f"pending.{i}": d.contiguous() for i, d in enumerate(pending.delta)})
        meta["pending"] = json.dumps(
            {"base_version": pending.base_version, "steps": pending.steps,
             "shards": {str(k): v for k, v in pending.shard_samples.items()}}
        )  # fmt: skip
    meta["sha256"] = checkpoint_digest(tensors, meta)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(st_save(tensors, metadata=meta)))


MAX_SENT = 4096
"""At most this many fragments in a sent log (a file of another kind is refused)."""


def sent_path(path: Path) -> Path:
    """The checkpoint's sent log: the fragments of the δ in its pending that rounds of ours
    applied after it was written (`record_sent`, `sent_since`)."""
    return path.with_name(path.name + ".sent.json")


def record_sent(path: Path, fragment: int, produced: int) -> None:
    """A round of ours produced version `produced` with our δ's `fragment` (every δ: one
    fragment, 0) after the checkpoint at `path` was written: a restart from that checkpoint
    must not offer it again (`Ledger.forget`). One small JSON object, written atomically."""
    log = _read_sent(sent_path(path))
    log[str(fragment)] = max(produced, log.get(str(fragment), produced))
    atomic_write(sent_path(path), lambda tmp: Path(tmp).write_text(json.dumps(log)))


def clear_sent(path: Path, version: int) -> None:
    """The checkpoint just written at `version` holds every update up to it (an overlapped
    round may have applied a later one meanwhile: its entry stays)."""
    log = {f: v for f, v in _read_sent(sent_path(path)).items() if v > version}
    if log:
        atomic_write(sent_path(path), lambda tmp: Path(tmp).write_text(json.dumps(log)))
    else:
        sent_path(path).unlink(missing_ok=True)


def sent_since(path: Path, version: int) -> list[int]:
    """The fragments rounds of ours applied above `version` (the checkpoint's): an entry at or
    below it was written before the checkpoint (a crash between the two writes)."""
    return sorted(int(f) for f, v in _read_sent(sent_path(path)).items() if v > version)


def _read_sent(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    try:
        log = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(log, dict) or len(log) > MAX_SENT:
            raise ValueError(f"not an object of at most {MAX_SENT} fragments")
        return {str(int(f)): int(v) for f, v in log.items()}
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"{path}: unreadable sent log ({e}); it says which parts of the checkpoint's "
            "pending δ the swarm applied already: remove it to resume anyway (they may then "
            "be applied twice)"
        ) from None


@dataclass(frozen=True)
class Resumed:
    rounds_done: int
    pending: Contribution | None


def load(path: Path, parts: PeerParts) -> Resumed:
    """Restore `parts` from the checkpoint at `path`; CheckpointError (one clear line, the file
    left as it is) if it is unreadable, corrupted, of another format or of another run."""
    try:
        data = path.read_bytes()
        meta = safetensors_metadata(data, len(data), str(path))
        tensors = st_load(data)
        _check(path, meta, tensors, parts.signed.digest)
        return _restore(parts, meta, tensors)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable or corrupted peer checkpoint ({e})") from None


def _check(
    path: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor], manifest: str
) -> None:
    if meta.get("format") == "diloco-peer/peer-checkpoint-v1":
        raise CheckpointError(
            f"{path}: a peer checkpoint of an older diloco-peer (no checksum); move it "
            "away to start this peer afresh"
        )
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a diloco-peer peer checkpoint")
    if meta.get("sha256") != checkpoint_digest(tensors, meta):
        raise CheckpointError(
            f"{path}: corrupted peer checkpoint (its sha256 does not match; the file is "
            "left as it is)"
        )
    if meta.get("manifest") != manifest:
        raise CheckpointError(f"{path}: checkpoint belongs to another run manifest")


def _restore(parts: PeerParts, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> Resumed:
    state_meta = {k.removeprefix("state."): v for k, v in meta.items() if k.startswith("state.")}
    parts.state.load(
        {k.removeprefix("global."): v for k, v in tensors.items() if k.startswith("global.")},
        state_meta,
    )
    trainer = parts.trainer
    trainer.load_params([tensors[f"local.{i}"] for i in range(len(trainer.params))])
    opt_meta = json.loads(meta["adam"])
    opt_state: dict[int, dict[str, Any]] = {}
    for pid, entry in opt_meta["state"].items():
        opt_state[int(pid)] = {
            name: tensors[f"adam.{pid}.{name}"] if value == "tensor" else value
            for name, value in entry.items()
        }
    trainer.optimizer.load_state_dict(
        {"state": opt_state, "param_groups": opt_meta["param_groups"]}
    )
    for stream, st in zip(parts.streams, json.loads(meta["streams"]), strict=True):
        stream.load_state_dict(st)
    pending = None
    if "pending" in meta:
        info = json.loads(meta["pending"])
        pending = Contribution(
            [tensors[f"pending.{i}"] for i in range(len(parts.state.theta))],
            int(info["base_version"]),
            {int(k): int(v) for k, v in info["shards"].items()},
            int(info["steps"]),
        )
    return Resumed(int(meta["rounds_done"]), pending)
