"""Helpers the benches share (each bench runs as `python bench/NAME.py`, so this directory is
on sys.path). Peers are launched and their event logs read by diloco_peer/local_swarm.py and
diloco_peer/peer/events.py."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any


def write_section(path: Path, generated: str, begin: str, end: str, notes_marker: str) -> None:
    """Replace a bench's section between its `begin` and `end` markers (or append it), keeping
    every byte outside the markers, and any notes written under `notes_marker` inside them."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    notes = notes_marker + "\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        inside, tail = rest.split(end, 1)
        if notes_marker in inside:
            notes = inside[inside.index(notes_marker) :]
    else:
        head, tail = old + ("\n" if old and not old.endswith("\n\n") else ""), "\n"
    section = f"{begin}\n{generated}\n{notes}"
    if not section.endswith("\n"):
        section += "\n"
    path.write_text(f"{head}{section}{end}{tail}", encoding="utf-8")


def publish(doc: dict[str, Any], json_path: Path | None, markdown: Path | None, section: str,
            begin: str, end: str, notes_marker: str) -> None:  # fmt: skip
    """A bench's result: the JSON document on stdout, in `json_path` if given, and its rendered
    `section` in the `markdown` page if given (`write_section`)."""
    text = json.dumps(doc, indent=1)
    print(text)
    if json_path:
        json_path.write_text(text)
    if markdown:
        write_section(markdown, section, begin, end, notes_marker)


def exit_on_sigterm() -> None:
    """SIGTERM (a `kill`, a job's time limit) ends the bench as Ctrl-C does, through its `with`
    blocks: its peers run in sessions of their own and its netlab namespaces outlive it, so
    without this a SIGTERM left both behind (seen 2026-12-06: 5 namespaces of bench/overlap.py).
    Either signal says so on stderr first: stopping the peers takes up to their stop grace, and
    a bench that went silent for it looked hung."""

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        print(f"{name}: stopping the bench's peers and removing its network lab (a few seconds)",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(128 + signum)  # through the `with` blocks, without a traceback

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
