"""The `diloco-peer` command: wires typer flags onto config and components, nothing more.

Error contract (DESIGN §6): bad input -> one line on stderr, exit 2; other failures -> exit 1.
"""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.28 ships its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions  # type: ignore[no-redef]

# Imported for their side effect of adding commands to `app`.
from diloco_peer.cli import (  # noqa: F401
    allow_cmd,
    dashboard_cmd,
    doctor_cmd,
    export_cmd,
    keygen_cmd,
    plot_cmd,
    sim_cmd,
    swarm_cmd,
    swarm_sim_cmd,
)
from diloco_peer.cli.app import app, fail
from diloco_peer.errors import BadInput

# typer's own Exit/Abort and, where it has them, its click copy's; a tuple works for `except`.
_EXITS = tuple({typer.Exit, getattr(click_exceptions, "Exit", typer.Exit)})
_ABORTS = tuple({typer.Abort, getattr(click_exceptions, "Abort", typer.Abort)})
_NO_ARGS = getattr(click_exceptions, "NoArgsIsHelpError", ())


def main(argv: list[str] | None = None) -> None:
    try:
        # without standalone mode, click returns a command's `typer.Exit(code)` instead of
        # raising it: that code must still become the process's exit status
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except _EXITS as e:
        sys.exit(e.exit_code)
    except _ABORTS:
        fail("interrupted", code=130)
    except _NO_ARGS as e:
        # Bare `diloco-peer`: the help text is the useful answer, but it is still not a command.
        sys.stderr.write(e.format_message().strip() + "\n")
        sys.exit(2)
    except click_exceptions.UsageError as e:
        message = e.format_message().strip()
        fail(message.splitlines()[0] if message else "invalid usage; see --help")
    except click_exceptions.ClickException as e:
        fail(e.format_message())
    except BadInput as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
