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
