"""The `diloco-peer` command: wires typer flags onto config and components, nothing more.

Error contract (DESIGN §6): bad input -> one line on stderr, exit 2; other failures -> exit 1.
"""

from __future__ import annotations

import logging
import sys

import click
import typer

from diloco_peer.errors import BadInput

app = typer.Typer(
    name="diloco-peer",
    help="Decentralized DiLoCo training: join a swarm, simulate, evaluate.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from diloco_peer.cli import sim_cmd  # noqa: F401


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then exit."""
    sys.stderr.write(f"diloco-peer: error: {message}\n")
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        app(args=argv, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        fail("interrupted", code=130)
    except click.UsageError as e:
        fail(e.format_message().splitlines()[0] if e.format_message() else str(e))
    except click.ClickException as e:
        fail(e.format_message())
    except BadInput as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)


if __name__ == "__main__":
    main()
