"""Helpers the benches share (each bench runs as `python bench/NAME.py`, so this directory is
on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON events of a peer's `--log-json` file; lines still being written are skipped."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


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
