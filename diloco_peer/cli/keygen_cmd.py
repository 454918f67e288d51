"""`keygen`: create a peer's key file (its libp2p identity and signing key)."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_peer.cli.main import app, configure_logging
from diloco_peer.identity import Identity


@app.command()
def keygen(
    out: Path = typer.Option(..., "--out", help="Where to write the key file (mode 0600)."),
    overwrite: bool = typer.Option(False, help="Replace an existing key file (a new peer id)."),
) -> None:
    """Create an RSA-2048 key file and print its peer id on stdout."""
    configure_logging()
    identity = Identity.generate()
    identity.save(out, overwrite=overwrite)
    typer.echo(identity.peer_id_str)
