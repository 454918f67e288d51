"""`keygen`: create a peer's key file (its libp2p identity and signing key) and its public key."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.errors import IdentityError


@app.command()
def keygen(
    out: Path = typer.Option(..., "--out", help="Where to write the key file (mode 0600)."),
    overwrite: bool = typer.Option(
        False, help="Replace an existing key file and its .pub (a new peer id)."
    ),
) -> None:
    """Create an RSA-2048 key file KEY and its public key KEY.pub; print the peer id on stdout.

    KEY.pub is one line, `diloco-peer-rsa <base64 libp2p public key> <peer id>`: hand it to a
    run owner, whose `diloco-peer allow` reads it.
    """
    configure_logging()
    from diloco_peer.identity import Identity  # hivemind: imported only when needed

    public = out.with_name(out.name + ".pub")
    # Both files are checked before either is written, so a refusal leaves nothing behind.
    for path in (out, public):
        if path.exists() and not overwrite:
            raise IdentityError(f"{path} exists; pass --overwrite to replace it")
    identity = Identity.generate()
    if overwrite:
        # A stale KEY.pub must never outlive its key, even if writing the new one fails below.
        public.unlink(missing_ok=True)
    identity.save(out, overwrite=overwrite)
    identity.save_public_key(public, overwrite=overwrite)
    typer.echo(identity.peer_id_str)
