"""What `export` reads: the global model of a model checkpoint (`simulate --save`) or of a peer
checkpoint (`join --checkpoint-dir`), and how an export describes it.

Of a peer checkpoint only the replicated global θ is read, never the peer's half-trained local
replica, and only after the replicated state's hash has been recomputed from the stored tensors
(a flipped bit is refused, not exported).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from diloco_peer.averaging.state import state_digest
from diloco_peer.config import RunSpec
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.errors import BadInput, CheckpointError, ConfigError
from diloco_peer.peer.checkpoint import FORMAT as MODEL_FORMAT
from diloco_peer.peer.checkpoint import load_into_model, load_model_checkpoint, read_file_metadata
from diloco_peer.peer.model import RMSNorm, Transformer, build_model
from diloco_peer.peer.peer_checkpoint import CHECKPOINT_FORMAT

PEER_FORMAT = CHECKPOINT_FORMAT
"""The `format` tag of a peer checkpoint (`join --checkpoint-dir`)."""
EXPORT_FORMAT = "diloco-peer/export-v1"
"""The `format` tag of an export's config.json (safetensors) or sidecar (hf)."""


@dataclass(frozen=True)
class ExportSource:
    """The global model of a checkpoint, ready to export."""

    path: Path
    kind: Literal["model", "peer"]
    run: RunSpec
    model: Transformer
    sha256: str
    """SHA-256 of the checkpoint file's bytes."""
    version: int | None = None
    """Global state version (peer checkpoints only)."""
    run_name: str | None = None
    """Swarm run name (peer checkpoints only)."""


def load_export_source(path: str | Path) -> ExportSource:
    """The global model of a model or peer checkpoint; CheckpointError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    kind = read_file_metadata(path).get("format")
    if kind == MODEL_FORMAT:
        return _load_model_source(path)
    if kind == PEER_FORMAT:
        return _load_peer_source(path)
    raise CheckpointError(
        f"{path}: not a diloco-peer checkpoint (format {kind!r}; expected {MODEL_FORMAT} from "
        f"`simulate --save` or {PEER_FORMAT} from `join --checkpoint-dir`)"
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror})") from None
    return h.hexdigest()


def _vocab_size(run: RunSpec, embedding: torch.Tensor | None, path: Path) -> int:
    """The vocabulary from the stored embedding's rows, checked against the tokenizer where
    that costs nothing (`bytes`); any other mismatch shows up as a shape mismatch later."""
    if embedding is None or embedding.dim() != 2:
        raise CheckpointError(f"{path}: checkpoint has no token embedding matrix")
    vocab = int(embedding.shape[0])
    if run.tokenizer == "bytes" and vocab != 256:
        raise CheckpointError(
            f"{path}: embedding has {vocab} rows but the run's byte tokenizer has 256 tokens"
        )
    return vocab


def _load_model_source(path: Path) -> ExportSource:
    ckpt = load_model_checkpoint(path)  # checks the format tag and the tensors' checksum
    run = ckpt.run
    vocab = _vocab_size(run, ckpt.tensors.get("embed.weight"), path)
    model = build_model(run.model, vocab, run.seed, max_seq_len=run.seq_len)
    load_into_model(model, ckpt, path)
    return ExportSource(path=path, kind="model", run=run, model=model, sha256=_file_sha256(path))


def _load_peer_source(path: Path) -> ExportSource:
    meta = read_file_metadata(path)
    try:
        signed = SignedManifest.from_bytes(str(meta["manifest_bytes"]).encode())
    except KeyError:
        raise CheckpointError(f"{path}: peer checkpoint without its run manifest") from None
    except BadInput as e:  # ManifestError: unsigned, altered, another protocol version
        raise CheckpointError(f"{path}: {e}") from None
    if meta.get("manifest") != signed.digest:
        raise CheckpointError(f"{path}: peer checkpoint's state belongs to another manifest")
    try:  # only the replicated state: the local replica and AdamW moments stay on disk
        with safe_open(str(path), framework="pt") as f:
            names = [k for k in f.keys() if k.startswith("global.")]  # not a mapping
            state = {k.removeprefix("global."): f.get_tensor(k) for k in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupted checkpoint ({str(e).splitlines()[0]})") from None
    version = _check_state_hash(state, meta, path)
    count = sum(k.startswith("theta.") for k in state)
    theta = [state[f"theta.{i}"] for i in range(count) if f"theta.{i}" in state]
    if len(theta) != count:
        raise CheckpointError(f"{path}: global θ tensors are not numbered 0..{count - 1}")

    run = signed.manifest.run
    model = build_model(
        run.model, _vocab_size(run, theta[0] if theta else None, path), run.seed, run.seq_len
    )
    params = list(model.parameters())  # the order `ReplicatedState` was built in
    if len(params) != len(theta):
        raise CheckpointError(
            f"{path}: {len(theta)} global tensors, the {run.model} model has {len(params)}"
        )
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(params, theta, strict=True)):
            if t.shape != p.shape or t.dtype != torch.float32:
                raise CheckpointError(
                    f"{path}: global.theta.{i} is {t.dtype} {tuple(t.shape)}, "
                    f"the model expects float32 {tuple(p.shape)}"
                )
            p.copy_(t)
    return ExportSource(
        path=path, kind="peer", run=run, model=model, sha256=_file_sha256(path),
        version=version, run_name=signed.manifest.run_name,
    )  # fmt: skip


def _check_state_hash(state: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> int:
    """Recompute the replicated state's hash from the stored tensors (`state_digest`, as
    `ReplicatedState.hash` does) and compare it with the one saved beside them, so flipped
    bytes are detected. Returns the state's version."""
    try:
        state_json, expected = meta["state.state"], meta["state.state_hash"]
        version = int(json.loads(state_json)["version"])
    # OverflowError: int(Infinity) (json.loads reads it); RecursionError: deep nesting.
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"{path}: malformed peer checkpoint metadata ({e})") from None
    if state_digest(state_json, state) != expected:
        raise CheckpointError(f"{path}: global state does not match its hash; it is corrupted")
    return version


# --------------------------------------------------------------------------- description


def norm_eps(model: Transformer) -> float:
    """The one eps all of the model's RMSNorms use; ConfigError if they use several."""
    eps = {m.eps for m in model.modules() if isinstance(m, RMSNorm)}
    if len(eps) != 1:
        raise ConfigError(f"the model's RMSNorms use several eps values {sorted(eps)}")
    return eps.pop()


def model_description(model: Transformer) -> dict[str, Any]:
    """Everything needed to rebuild `model` besides the run: dims and fixed design choices."""
    cfg = model.cfg
    return {
        **asdict(cfg),
        "norm_eps": norm_eps(model),
        "activation": "silu",
        "tied_embeddings": True,
        "rotary": "interleaved",
    }


def source_doc(source: ExportSource) -> dict[str, Any]:
    """Where an export's weights came from, as its config.json (or sidecar) records it."""
    return {
        "path": str(source.path),
        "kind": source.kind,
        "sha256": source.sha256,
        "version": source.version,
        "run_name": source.run_name,
    }
