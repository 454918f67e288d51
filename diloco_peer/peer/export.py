"""Export a checkpoint's global model: as this package's safetensors + config, or as a
Hugging Face transformers `LlamaForCausalLM` folder.

Sources are model checkpoints (`simulate --save`) and peer checkpoints (`join
--checkpoint-dir`); of a peer checkpoint only the replicated global θ is exported, never the
peer's half-trained local replica. Every export is built in a temporary folder next to the
target, reloaded from there and checked to give the source model's logits, and only then
renamed into place, so a failed or wrong export never appears under the target's name.

Why our model maps exactly onto Llama (see model.py): pre-norm RMSNorm (same formula, eps
1e-6, normalised in fp32), SwiGLU MLP (`silu(gate) * up`), no biases, tied embeddings, full
multi-head attention scaled by 1/sqrt(head_dim), rotary positions with the original base. The
one difference is the rotary channel layout: ours rotates interleaved pairs (2j, 2j+1), HF's
`rotate_half` rotates split halves (j, j + D/2). Permuting the q and k rows of every head by
[0, 2, 4, ..., 1, 3, 5, ...] turns one into the other; q·k is unchanged because q and k get
the same permutation, and v / the output projection are not rotated, so they stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from diloco_peer.averaging.state import state_digest
from diloco_peer.config import RunSpec
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.errors import BadInput, CheckpointError, ConfigError, DilocoError
from diloco_peer.peer.checkpoint import FORMAT as MODEL_FORMAT
from diloco_peer.peer.checkpoint import (
    load_into_model,
    load_model_checkpoint,
    read_file_metadata,
    save_model_checkpoint,
)
from diloco_peer.peer.model import RMSNorm, Transformer, build_model

logger = logging.getLogger(__name__)

# Must equal swarm_peer.CHECKPOINT_FORMAT (a test checks); not imported from there because
# swarm_peer pulls in hivemind, which an offline export has no use for.
PEER_FORMAT = "diloco-peer/peer-checkpoint-v2"
EXPORT_FORMAT = "diloco-peer/export-v1"
FORMATS = ("safetensors", "hf")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SIDECAR_FILE = "diloco_peer.json"  # beside an hf export: where its weights came from
# Exported logits may differ from the source's by float reordering only; anything larger is a
# mapping bug, reported instead of exported. Relative to max(1, max |logit|).
VERIFY_TOLERANCE = 1e-4
VERIFY_BATCH = (2, 64)  # (sequences, tokens), tokens capped by the run's seq_len
_HF_INSTALL = "pip install 'diloco-peer[hf]'"

ExportFormat = Literal["safetensors", "hf"]


@dataclass(kw_only=True, frozen=True)
class ExportSpec:
    """One `export` invocation."""

    checkpoint: str
    """A model checkpoint (`simulate --save`) or a peer checkpoint (`join --checkpoint-dir`)."""
    out: str
    """Folder to create; an existing one must be empty unless `overwrite`."""
    format: ExportFormat = "safetensors"
    """`safetensors`: this package's model file + config.json; `hf`: a transformers Llama."""
    overwrite: bool = False
    """Replace a non-empty `out` folder (atomically: the old one survives a failed export)."""
    verify: bool = True
    """Reload the export and compare its logits with the source model's before publishing it."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"unknown export format {self.format!r}; choose one of: {', '.join(FORMATS)}"
            )


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


@dataclass(frozen=True)
class ExportResult:
    out: Path
    format: ExportFormat
    source: ExportSource
    max_logit_diff: float | None
    """Max |exported − source| logit on the verification batch; None if not verified."""
    logit_scale: float | None
    """Max |source logit| on that batch."""


# --------------------------------------------------------------------------- reading sources


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


# --------------------------------------------------------------------------- safetensors format


def model_description(model: Transformer) -> dict[str, Any]:
    """Everything needed to rebuild `model` besides the run: dims and fixed design choices."""
    cfg = model.cfg
    return {
        **asdict(cfg),
        "norm_eps": _norm_eps(model),
        "activation": "silu",
        "tied_embeddings": True,
        "rotary": "interleaved",
    }


def _write_safetensors(source: ExportSource, folder: Path) -> None:
    extra = {"exported_from": source.kind, "source_sha256": source.sha256}
    if source.version is not None:
        extra["version"] = source.version
    # A regular model checkpoint: `eval`, `simulate --init` and `load_exported` all read it.
    save_model_checkpoint(folder / WEIGHTS_FILE, source.model, source.run, extra=extra)
    config = {
        "format": EXPORT_FORMAT,
        "preset": source.run.model,
        "model": model_description(source.model),
        "run": source.run.to_dict(),
        "weights": WEIGHTS_FILE,
        "source": _source_doc(source),
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _source_doc(source: ExportSource) -> dict[str, Any]:
    return {
        "path": str(source.path),
        "kind": source.kind,
        "sha256": source.sha256,
        "version": source.version,
        "run_name": source.run_name,
    }


def load_exported(folder: str | Path) -> tuple[Transformer, RunSpec]:
    """Rebuild the model of a `--format safetensors` export (checksums checked)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; not a diloco-peer export") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{folder / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{folder}: not a diloco-peer export (format {EXPORT_FORMAT})")
    weights = folder / WEIGHTS_FILE
    ckpt = load_model_checkpoint(weights)
    try:
        described = config["model"]
        vocab = int(described["vocab_size"])
        run = RunSpec.from_dict(config["run"])
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{folder / CONFIG_FILE}: malformed ({e})") from None
    if run != ckpt.run:
        raise CheckpointError(f"{folder}: {CONFIG_FILE} and {WEIGHTS_FILE} name different runs")
    model = build_model(run.model, vocab, run.seed, run.seq_len)
    if model_description(model) != described:
        raise CheckpointError(f"{folder}: {CONFIG_FILE} describes another model than {run.model}")
    load_into_model(model, ckpt, weights)
    return model, run


# --------------------------------------------------------------------------- hf format


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise BadInput(
            f"--format hf needs the transformers package: {_HF_INSTALL}, "
            "or use --format safetensors"
        ) from None
    return transformers


def _norm_eps(model: Transformer) -> float:
    eps = {m.eps for m in model.modules() if isinstance(m, RMSNorm)}
    if len(eps) != 1:
        raise ConfigError(f"the model's RMSNorms use several eps values {sorted(eps)}")
    return eps.pop()


def check_llama_compatible(model: Transformer) -> None:
    """ConfigError naming what Llama cannot express, if anything. The logit check after the
    export catches what this structural check cannot see (e.g. a changed activation)."""
    cfg = model.cfg
    reasons = []
    if cfg.head_dim % 2:
        reasons.append(f"rotary positions need an even head_dim, the model has {cfg.head_dim}")
    biases = [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    if biases:
        reasons.append(f"it has biases ({', '.join(biases[:3])}, ...), the mapping carries none")
    try:
        _norm_eps(model)
    except ConfigError as e:
        reasons.append(f"{e}; Llama has a single rms_norm_eps")
    if reasons:
        raise ConfigError(
            "this model cannot be represented exactly as a transformers LlamaForCausalLM: "
            + "; ".join(reasons)
            + ". Use --format safetensors."
        )


def llama_config_kwargs(model: Transformer) -> dict[str, Any]:
    """LlamaConfig arguments describing `model` exactly."""
    cfg = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,  # full multi-head attention, no grouped KV
        "head_dim": cfg.head_dim,  # explicit: d_model need not equal n_head * head_dim
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": _norm_eps(model),
        "rope_theta": cfg.rope_base,  # transformers 5 folds it into rope_parameters
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        # The run's tokenizers have no BOS/EOS/PAD; Llama's defaults (1, 2) would be wrong.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _check_rope(config: Any, base: float) -> None:
    """The config as transformers understood it must give our plain rotary frequencies."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = getattr(config, "rope_scaling", None) or {}  # transformers 4: scaling lives here
    rope_type = params.get("rope_type", scaling.get("rope_type", "default"))
    if theta != base or rope_type != "default":
        raise ConfigError(
            f"this transformers version configures rotary embeddings as {rope_type!r} with base "
            f"{theta}, the model needs 'default' with base {base}; use --format safetensors"
        )


def _rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order taking our interleaved rotary pairs (2j, 2j+1) to HF's halves (j, j + D/2)."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under LlamaForCausalLM names, q/k rows permuted for `rotate_half`."""
    cfg = model.cfg
    H, D, C, F = cfg.n_head, cfg.head_dim, cfg.d_model, cfg.mlp_hidden
    perm = _rope_permutation(D)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}

    def rope_rows(w: torch.Tensor) -> torch.Tensor:
        # (H*D, C) -> (H, D, C), reorder each head's rows, back to (H*D, C)
        return w.view(H, D, C)[:, perm, :].reshape(H * D, C).contiguous()

    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"]  # tied; save_pretrained stores it once
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[src + "attn.qkv.weight"].split(H * D, dim=0)  # each (H*D, C)
        gate, up = sd[src + "mlp.gate_up.weight"].split(F, dim=0)  # each (F, C)
        out |= {
            dst + "input_layernorm.weight": sd[src + "norm1.weight"],
            dst + "self_attn.q_proj.weight": rope_rows(q),
            dst + "self_attn.k_proj.weight": rope_rows(k),
            dst + "self_attn.v_proj.weight": v.contiguous(),
            dst + "self_attn.o_proj.weight": sd[src + "attn.proj.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "norm2.weight"],
            dst + "mlp.gate_proj.weight": gate.contiguous(),
            dst + "mlp.up_proj.weight": up.contiguous(),
            dst + "mlp.down_proj.weight": sd[src + "mlp.down.weight"],
        }
    return out


def _write_hf(source: ExportSource, folder: Path) -> None:
    transformers = _require_transformers()
    model = source.model
    check_llama_compatible(model)
    config = transformers.LlamaConfig(**llama_config_kwargs(model))
    _check_rope(config, model.cfg.rope_base)
    with torch.random.fork_rng(devices=[]):  # its random init must not move the caller's RNG
        hf = transformers.LlamaForCausalLM(config).to(torch.float32)
    weights = llama_state_dict(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise DilocoError(
            f"Llama weight mapping is incomplete: missing {missing}, unexpected {unexpected}"
        )
    hf.tie_weights()
    hf.save_pretrained(folder, safe_serialization=True)
    sidecar = {
        "format": EXPORT_FORMAT,
        "preset": source.run.model,
        "model": model_description(model),
        "run": source.run.to_dict(),
        "source": _source_doc(source),
        "note": "q_proj/k_proj rows are permuted per head from diloco-peer's interleaved "
        "rotary layout to transformers' rotate_half layout; logits are unchanged",
    }
    (folder / SIDECAR_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")


def load_hf(folder: str | Path) -> Any:
    """An hf export as a transformers LlamaForCausalLM in fp32 (safetensors only, no pickle)."""
    transformers = _require_transformers()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(folder), use_safetensors=True, **{dtype_kw: torch.float32}
    )
    return model.eval()


# --------------------------------------------------------------------------- verification


def verify_batch(vocab_size: int, seq_len: int) -> torch.Tensor:
    """A fixed batch of random tokens, (B, T) with T = min(seq_len, VERIFY_BATCH[1])."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(vocab_size, (VERIFY_BATCH[0], min(seq_len, VERIFY_BATCH[1])), generator=g)


def compare_logits(
    reference: Transformer, forward: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, float]:
    """(max |forward − reference| logit, max |reference logit|) on `verify_batch`."""
    tokens = verify_batch(reference.cfg.vocab_size, reference.cfg.max_seq_len)
    reference.eval()
    with torch.no_grad():
        want = reference(tokens).float()
        got = forward(tokens).float()
    if got.shape != want.shape:
        return float("inf"), float(want.abs().max())
    return float((got - want).abs().max()), float(want.abs().max())


def _verify(source: ExportSource, folder: Path, fmt: ExportFormat) -> tuple[float, float]:
    if fmt == "hf":
        hf = load_hf(folder)
        diff, scale = compare_logits(source.model, lambda t: hf(input_ids=t).logits)
    else:
        rebuilt, _ = load_exported(folder)
        diff, scale = compare_logits(source.model, rebuilt)
    if not diff <= VERIFY_TOLERANCE * max(1.0, scale):
        raise DilocoError(
            f"the {fmt} export's logits differ from the checkpoint's by {diff:.3g} (logit scale "
            f"{scale:.3g}); nothing was written. The weight mapping in diloco_peer/peer/export.py "
            "no longer matches diloco_peer/peer/model.py"
        )
    return diff, scale


# --------------------------------------------------------------------------- output folder


def _check_out(out: Path, source_path: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise BadInput(f"--out {out} is not empty; pass --overwrite to replace it")
    if out.resolve() in source_path.resolve().parents:
        raise BadInput(f"--out {out} holds the checkpoint being exported; choose another folder")


def _sibling(out: Path, tag: str) -> Path:
    """A fresh hidden name next to `out`, on the same filesystem so renames are atomic."""
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _finish_files(folder: Path) -> None:
    """fsync every file and give it the folder's umask-derived mode: checkpoint writers use
    private temp files (0600), an export is meant to be shared like any new folder."""
    mode = folder.stat().st_mode & 0o666
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` folder to `out`; an existing `out` survives any failure."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    old = _sibling(out, "old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(spec: ExportSpec) -> ExportResult:
    """Read, convert, verify and publish; `spec.out` is untouched unless all of it worked."""
    out, source_path = Path(spec.out), Path(spec.checkpoint)
    _check_out(out, source_path, spec.overwrite)
    if spec.format == "hf":
        _require_transformers()  # before the (possibly long) read of the checkpoint
    source = load_export_source(source_path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out, "export")
        tmp.mkdir()  # mode from the umask, as a plain mkdir of `out` would have
    except OSError as e:
        raise BadInput(f"cannot create --out {out} ({e.strerror})") from None
    try:
        if spec.format == "hf":
            _write_hf(source, tmp)
        else:
            _write_safetensors(source, tmp)
        diff, scale = _verify(source, tmp, spec.format) if spec.verify else (None, None)
        _finish_files(tmp)
        _check_out(out, source_path, spec.overwrite)  # nobody filled it in the meantime
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "exported %s checkpoint %s as %s to %s (max logit diff %s)",
        *(source.kind, source_path, spec.format, out, diff),
    )
    return ExportResult(
        out=out, format=spec.format, source=source, max_logit_diff=diff, logit_scale=scale
    )
