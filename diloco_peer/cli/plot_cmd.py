"""`plot`: training curves from JSON logs, as one PNG of four panels (diloco_peer/plot.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_peer.cli.app import app, configure_logging


@app.command()
def plot(
    logs: list[Path] = typer.Argument(
        ...,
        metavar="LOG",
        help="Event logs of join/demo --log-json, or simulate --json documents.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="The PNG to write."),
    title: str | None = typer.Option(None, help="Title above the four panels."),
    overwrite: bool = typer.Option(False, help="Allow --out to replace an existing file."),
) -> None:
    """Training curves of swarm logs and simulator runs: one PNG of four panels."""
    configure_logging()
    from diloco_peer.plot import build_figure, check_out, load_runs, save_png  # matplotlib

    check_out(out, overwrite, logs)
    runs, notes = load_runs(logs)
    save_png(build_figure(runs, title), out)
    for note in notes:
        typer.echo(f"diloco-peer: note: {note}", err=True)
    curves = sum(len(r.curves) for r in runs)
    typer.echo(f"wrote {out} ({len(runs)} run(s), {curves} curve(s))")
