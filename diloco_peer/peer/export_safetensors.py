"""`export --format safetensors`: this package's own model file plus a config.json that says
how to rebuild the model, and `load_exported`, which rebuilds it (checksums checked)."""

from __future__ import annotations

import json
from pathlib import Path

from diloco_peer.config import RunSpec
from diloco_peer.errors import CheckpointError
from diloco_peer.peer.checkpoint import (
    load_into_model,
    load_model_checkpoint,
    save_model_checkpoint,
)
from diloco_peer.peer.export_source import (
    EXPORT_FORMAT,
    ExportSource,
    model_description,
    source_doc,
)
from diloco_peer.peer.model import Transformer, build_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def write_safetensors(source: ExportSource, folder: Path) -> None:
    """Write the export's two files into `folder` (which `export_checkpoint` then publishes)."""
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
        "source": source_doc(source),
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
