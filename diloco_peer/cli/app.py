"""The typer app every command module adds its command to, the CLI's logging and `fail`.

Command modules import this module, never `main.py` (which imports them), so that `cli/` has
no import loop.
"""

from __future__ import annotations

import logging
import os
import sys

# hivemind logs at INFO to stderr by default; the CLI keeps stderr for its own lines (and
# errors to exactly one line). Must be set before hivemind is first imported.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import typer  # noqa: E402

app = typer.Typer(
    name="diloco-peer",
    help="Decentralized DiLoCo training: join a swarm, simulate, evaluate.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose else logging.WARNING)


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then exit."""
    sys.stderr.write(f"diloco-peer: error: {message}\n")
    sys.exit(code)
