"""The peer's JSON event log (DESIGN §6): one object per line, flushed as it is written."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class EventLog:
    """Appends `{"event", "time", "peer", ...}` lines to a file; a no-op without a path."""

    def __init__(self, path: str | None, peer: str) -> None:
        self.peer = peer
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        # Non-finite numbers (a diverged loss) are logged as null: JSON has no NaN.
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in fields.items()
        }
        record = {"event": event, "time": time.time(), "peer": self.peer, **clean}
        if self._file is not None:
            line = json.dumps(record, sort_keys=True, allow_nan=False, default=str)
            with self._lock:
                self._file.write(line + "\n")
                self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def parse_events(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of an event log's lines, and how many non-blank lines were not one.

    A peer killed mid-write leaves a torn last line; a hand-edited log may hold anything. Such
    lines are skipped and counted, never fatal: a reader wants every event that was written.
    """
    events: list[dict[str, Any]] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # torn, or nested beyond the parser's depth
            obj = None
        if isinstance(obj, dict):
            events.append(obj)
        else:
            skipped += 1
    return events, skipped


def read_events(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The events of the complete lines of the log at `path` from byte `offset` on, and the
    offset to pass next time (just past the last complete line).

    A line still being written (no newline yet) is left for the next call. A log that does not
    exist yet has no events: a peer creates its log only once it starts.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    events, _ = parse_events(chunk[:end].decode("utf-8", errors="replace"))
    return events, offset + end


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every complete event of the log at `path` (none if it does not exist yet)."""
    return read_events(path)[0]
