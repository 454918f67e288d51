"""`dashboard`: the swarm's health page in a browser, read through the DHT as `status` does."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import typer

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.errors import BadInput


@app.command()
def dashboard(
    swarm: list[str] = typer.Option(..., help="Multiaddr of a peer in the swarm (repeatable)."),
    run: str = typer.Option("default", help="Run name."),
    host: str = typer.Option("127.0.0.1", help="Interface to serve on (others: 0.0.0.0)."),
    port: int = typer.Option(8080, help="TCP port of the page (0 = any free)."),
    owner: str | None = typer.Option(None, help="The run owner's peer id (pins the manifest)."),
    identity: Path | None = typer.Option(
        None, help="Private swarm: read under this allowlisted key file."
    ),
    allowlist: Path | None = typer.Option(
        None, help="Private swarm: show only the peers of this allowlist."
    ),
    refresh_s: float = typer.Option(2.0, help="Seconds between two reads of the swarm."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """A live web page of the run: peers, forks and bans, loss over versions, the manifest.

    Read-only; GET /api/swarm serves the same data as JSON. Stops on Ctrl+C or SIGTERM."""
    configure_logging(verbose)
    if not 0 <= port <= 65535:
        raise BadInput(f"--port must be in 0..65535, got {port}")
    if not 0.2 <= refresh_s <= 600:
        raise BadInput(f"--refresh-s must be in 0.2..600 seconds, got {refresh_s}")
    from diloco_peer.coordinator_free.allowlist import Allowlist
    from diloco_peer.coordinator_free.status import SwarmReader
    from diloco_peer.identity import Identity
    from diloco_peer.peer.dashboard import DashboardServer, Source, manifest_summary

    ident = Identity.load(str(identity)) if identity else None
    listed = Allowlist.load(str(allowlist), run=run) if allowlist else None
    reader = SwarmReader(swarm, run, identity=ident, allowed=listed.peer_ids if listed else None)
    try:
        signed = reader.manifest(owner=owner or (listed.owner_peer_id if listed else None))
        if listed is not None and listed.owner_peer_id != signed.owner_peer_id:
            raise BadInput(f"--allowlist is signed by {listed.owner_peer_id}, not by the run "
                           f"owner {signed.owner_peer_id}")  # fmt: skip
        source = Source(run=run, read_heads=reader.heads, manifest=manifest_summary(signed))
        server = DashboardServer(host, port, source, refresh_s=refresh_s)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        server.start()
        try:
            sys.stdout.write(f"dashboard of run {run} on http://{host}:{server.port}/\n")
            sys.stdout.flush()
            while not stop.wait(1.0):
                pass
        finally:
            server.shutdown()
    finally:
        reader.close()
