"""`export`: a checkpoint's global model as safetensors + config, or as a transformers Llama."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_peer.cli.app import app, configure_logging, fail
from diloco_peer.errors import BadInput, DilocoError


@app.command()
def export(
    checkpoint: Path = typer.Option(
        ...,
        help="A model checkpoint (simulate --save) or a peer checkpoint (join --checkpoint-dir).",
    ),
    out: Path = typer.Option(..., help="Folder to write; must be new or empty unless --overwrite."),
    fmt: str = typer.Option(
        "safetensors",
        "--format",
        help="safetensors (model.safetensors + config.json for diloco-peer) or hf "
        "(a transformers LlamaForCausalLM folder; needs the [hf] extra).",
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty --out folder."),
    verify: bool = typer.Option(
        True, "--verify/--no-verify", help="Reload the export and compare logits before writing."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Export the global model of a checkpoint (never a peer's local replica)."""
    configure_logging(verbose)
    from diloco_peer.peer.export import ExportSpec, export_checkpoint

    spec = ExportSpec(
        checkpoint=str(checkpoint), out=str(out), format=fmt,  # type: ignore[arg-type]
        overwrite=overwrite, verify=verify,
    )  # fmt: skip
    if fmt == "hf" and not verbose:
        _quiet_transformers()
    try:
        result = export_checkpoint(spec)
    except BadInput:
        raise
    except DilocoError as e:  # a failed self-check: not the user's fault, still one line
        fail(str(e), code=1)
        return
    source = result.source
    version = f" at version {source.version}" if source.version is not None else ""
    check = (
        f"; max logit difference {result.max_logit_diff:.2e} (logit scale {result.logit_scale:.3g})"
        if result.max_logit_diff is not None
        else ""
    )
    typer.echo(f"exported {source.kind} checkpoint {checkpoint}{version} as {fmt} to {out}{check}")


def _quiet_transformers() -> None:
    """transformers logs load reports and advice to stderr; the CLI keeps stderr for errors."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return  # export_checkpoint reports the missing package
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
