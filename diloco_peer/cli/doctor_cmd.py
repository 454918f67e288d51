"""`doctor`: can this machine take part in a swarm? One line per check, with a fix for each."""

from __future__ import annotations

import json
import logging
import sys

import typer

from diloco_peer.cli.app import app, configure_logging


@app.command()
def doctor(
    swarm: list[str] = typer.Option(..., help="Multiaddr of a peer in the swarm (repeatable)."),
    run: str = typer.Option("default", help="Run name."),
    host: str = typer.Option("0.0.0.0", help="Interface `join` would listen on."),
    port: int = typer.Option(0, help="TCP port `join` would listen on (0 = any free)."),
    announce: list[str] = typer.Option([], help="Multiaddr others should dial (as for join)."),
    timeout_s: float = typer.Option(45.0, help="Budget of all network waits together."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Diagnose whether this machine can join a swarm: swarm reachable, reachable from outside,
    clock offset, port, relays, manifest. Exit 0 if no check FAILs, 1 otherwise."""
    configure_logging(verbose)
    if not verbose:  # the doctor reports failed dial-backs itself; hivemind's warnings repeat them
        logging.getLogger("hivemind").setLevel(logging.ERROR)
    from diloco_peer.peer.doctor import DoctorSpec, run_doctor

    spec = DoctorSpec(
        swarm=tuple(swarm), run=run, host=host, port=port, announce=tuple(announce),
        timeout_s=timeout_s,
    )  # fmt: skip
    report = run_doctor(spec, progress=lambda text: sys.stderr.write(f"doctor: {text}...\n"))
    if json_out:
        sys.stdout.write(json.dumps(report.to_dict(), sort_keys=True) + "\n")
    else:
        sys.stdout.write("".join(c.line() + "\n" for c in report.checks))
    # Not typer.Exit: with standalone_mode=False, main() would drop its code and exit 0.
    sys.exit(report.exit_code)
