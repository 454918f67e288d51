"""Export a checkpoint's global model: as this package's safetensors + config
(export_safetensors.py), or as a Hugging Face transformers `LlamaForCausalLM` folder
(export_hf.py).

Sources are model checkpoints (`simulate --save`) and peer checkpoints (`join
--checkpoint-dir`), read by export_source.py; of a peer checkpoint only the replicated global θ
is exported, never the peer's half-trained local replica. Every export is built in a temporary
folder next to the target, reloaded from there and checked to give the source model's logits,
and only then renamed into place, so a failed or wrong export never appears under the target's
name.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from diloco_peer.errors import BadInput, ConfigError, DilocoError
from diloco_peer.peer.export_hf import load_hf, require_transformers, write_hf
from diloco_peer.peer.export_safetensors import load_exported, write_safetensors
from diloco_peer.peer.export_source import ExportSource, load_export_source
from diloco_peer.peer.model import Transformer

logger = logging.getLogger(__name__)

FORMATS = ("safetensors", "hf")
# Exported logits may differ from the source's by float reordering only; anything larger is a
# mapping bug, reported instead of exported. Relative to max(1, max |logit|).
VERIFY_TOLERANCE = 1e-4
VERIFY_BATCH = (2, 64)  # (sequences, tokens), tokens capped by the run's seq_len

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
class ExportResult:
    out: Path
    format: ExportFormat
    source: ExportSource
    max_logit_diff: float | None
    """Max |exported − source| logit on the verification batch; None if not verified."""
    logit_scale: float | None
    """Max |source logit| on that batch."""


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
            f"{scale:.3g}); nothing was written. The weight mapping in "
            "diloco_peer/peer/export_hf.py no longer matches diloco_peer/peer/model.py"
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
        require_transformers()  # before the (possibly long) read of the checkpoint
    source = load_export_source(source_path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out, "export")
        tmp.mkdir()  # mode from the umask, as a plain mkdir of `out` would have
    except OSError as e:
        raise BadInput(f"cannot create --out {out} ({e.strerror})") from None
    try:
        if spec.format == "hf":
            write_hf(source, tmp)
        else:
            write_safetensors(source, tmp)
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
