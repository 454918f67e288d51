"""Model checkpoints: one safetensors file with the run config as JSON in its metadata.

Nothing is unpickled. Writes are atomic (temp file in the same folder, fsync, rename), so a
crash never leaves a half-written checkpoint under the real name. A SHA-256 of the tensor bytes
is stored in the metadata and checked on load, so flipped bytes are detected, not trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco_peer.config import MAX_SAFETENSORS_HEADER_BYTES, RunSpec
from diloco_peer.errors import CheckpointError

FORMAT = "diloco-peer/model-v1"


@dataclass(frozen=True)
class ModelCheckpoint:
    run: RunSpec
    tensors: dict[str, torch.Tensor]
    extra: dict[str, Any]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp_path)` then rename onto `path`; the old file survives any failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model_checkpoint(
    path: str | Path, model: torch.nn.Module, run: RunSpec, extra: dict[str, Any] | None = None
) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "format": FORMAT,
        "run": json.dumps(run.to_dict(), sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
        "sha256": tensors_digest(tensors),
    }
    atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def safetensors_metadata(head: bytes, total_size: int, source: str) -> dict[str, str]:
    """The `__metadata__` of a safetensors file or blob from its first bytes (at least the
    8-byte length and the JSON header), without trusting the rest. CheckpointError if
    malformed; `total_size` and MAX_SAFETENSORS_HEADER_BYTES bound the header length the prefix
    claims, before any of it is parsed (or, for a file, read)."""
    if len(head) < 8:
        raise CheckpointError(f"{source}: not a safetensors checkpoint (too short)")
    size = int.from_bytes(head[:8], "little")
    if (
        size <= 0
        or size > min(MAX_SAFETENSORS_HEADER_BYTES, total_size - 8)
        or len(head) < 8 + size
    ):
        raise CheckpointError(f"{source}: not a safetensors checkpoint (bad header size)")
    try:
        header = json.loads(head[8 : 8 + size])
    # ValueError: bad UTF-8 or JSON, or an integer literal past Python's digit limit;
    # RecursionError: arrays nested past the parser's depth limit.
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{source}: unreadable checkpoint header ({e.__class__.__name__})"
        ) from e
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: malformed checkpoint metadata")
    return meta


def read_file_metadata(path: Path) -> dict[str, str]:
    """`safetensors_metadata` of a file, reading only its header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else 0
            head += f.read(min(size, MAX_SAFETENSORS_HEADER_BYTES))
        total = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror})") from e
    return safetensors_metadata(head, total, str(path))


def _read_metadata(path: Path) -> dict[str, str]:
    """A model checkpoint's metadata, checked to be of this format."""
    meta = read_file_metadata(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a diloco-peer model checkpoint (format {FORMAT} expected)"
        )
    return meta


def load_model_checkpoint(path: str | Path) -> ModelCheckpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    meta = _read_metadata(path)
    try:
        run_dict = json.loads(meta["run"])
        extra = json.loads(meta.get("extra", "{}"))
        run = RunSpec.from_dict(run_dict)
    except (KeyError, TypeError, ValueError, RecursionError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{path}: malformed checkpoint metadata ({e})") from e
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupted checkpoint ({str(e).splitlines()[0]})") from e
    if tensors_digest(tensors) != meta.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch, the checkpoint is corrupted")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path}: malformed checkpoint metadata (extra)")
    return ModelCheckpoint(run=run, tensors=tensors, extra=extra)


def load_into_model(model: torch.nn.Module, ckpt: ModelCheckpoint, path: str | Path) -> None:
    """Copy checkpoint tensors into `model`; any name or shape mismatch is a CheckpointError."""
    expected = model.state_dict()
    if set(expected) != set(ckpt.tensors):
        raise CheckpointError(f"{path}: checkpoint tensors do not match the model")
    for name, t in ckpt.tensors.items():
        if t.shape != expected[name].shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                f"model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(ckpt.tensors)
