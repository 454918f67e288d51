"""`allow`: the run owner signs the list of public keys allowed into a private swarm."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.errors import ConfigError, IdentityError

# A public key file is a line or a few; anything this large is not one.
_MAX_KEY_FILE_BYTES = 1 << 20


def _keys_of(arg: str) -> list[bytes]:
    """The public keys one PUBKEY argument names: a file (one key per line; blank lines and
    `#` comments skipped) or the key itself (a diloco-peer-rsa or ssh-rsa line, or base64)."""
    from diloco_peer.identity import PUBLIC_KEY_TAG, parse_public_key

    path = Path(arg)
    shown = arg if len(arg) <= 48 else arg[:45] + "..."
    try:  # a key's text can make a path component too long to stat (ENAMETOOLONG)
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:
        is_dir = is_file = False
    if is_dir:
        raise ConfigError(f"{arg} is a folder, not a public key file")
    if not is_file:
        try:
            return [parse_public_key(arg)]
        except IdentityError as e:
            # A key is a long single word or a tagged line; anything else was meant as a file.
            if arg.startswith((PUBLIC_KEY_TAG, "ssh-")) or len(arg) > 100:
                raise ConfigError(f"public key {shown!r}: {e}") from None
            raise ConfigError(f"public key file {arg} does not exist") from None
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read public key file {path}: {e.strerror or e}") from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(f"public key file {path} is too large to be one")
    keys: list[bytes] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith(b"#"):
            continue
        try:
            keys.append(parse_public_key(line))
        except IdentityError as e:
            raise ConfigError(f"public key file {path}, line {number}: {e}") from None
    if not keys:
        raise ConfigError(f"public key file {path} holds no public key")
    return keys


@app.command()
def allow(
    public_keys: list[str] = typer.Argument(
        ...,
        metavar="PUBKEY...",
        help="A public key file (KEY.pub of `keygen`, ssh-rsa lines, one key per line) or a "
        "public key itself (a diloco-peer-rsa or ssh-rsa line, or a base64 libp2p key).",
    ),
    key: Path = typer.Option(..., "--key", help="The run owner's key file (signs the list)."),
    run: str = typer.Option(..., "--run", help="The run the list is for."),
    out: Path = typer.Option(..., "--out", help="Where to write the allowlist."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out file."),
) -> None:
    """Sign an allowlist: only these keys (and the owner's) may take part in a private run.

    Prints how many keys the list holds, then every allowed peer id, one per line.
    """
    configure_logging()
    from diloco_peer.coordinator_free.allowlist import Allowlist
    from diloco_peer.identity import Identity

    if out.exists() and not overwrite:  # before any work; save() checks again, race-free
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    owner = Identity.load(key)
    keys = [k for arg in public_keys for k in _keys_of(arg)]
    allowlist = Allowlist.create(owner, run, keys)
    allowlist.save(out, overwrite=overwrite)
    listed = len(allowlist.public_keys)
    typer.echo(
        f"{out}: {listed} public key{'s' if listed != 1 else ''} allowed in run {run} "
        f"(the owner {owner.peer_id_str} always is)"
    )
    for peer_id in sorted(allowlist.peer_ids):
        typer.echo(peer_id)
