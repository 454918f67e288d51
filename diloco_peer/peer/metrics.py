"""A Prometheus text-format endpoint for a long-running peer (`join --metrics-port`).

Serves `GET /metrics` in the text exposition format (version 0.0.4) from a daemon thread; the
values come from a callback that reads the peer's counters, so the endpoint never blocks training.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from diloco_peer.errors import BadInput
from diloco_peer.lifecycle import BackgroundPart, ready_now

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" or "counter"
    help: str
    value: float | None  # None: not known yet, the sample is left out


def render(metrics: list[Metric], labels: dict[str, str]) -> str:
    """The text exposition format: HELP and TYPE lines, then one sample per metric."""

    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    label_text = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items()))
    lines = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        if m.value is not None:
            v = float(m.value)
            text = "NaN" if math.isnan(v) else ("+Inf" if v == math.inf else repr(v))
            lines.append(f"{m.name}{{{label_text}}} {text}")
    return "\n".join(lines) + "\n"


class MetricsServer(BackgroundPart):
    """`GET /metrics` on host:port; `collect()` is called per request. The port is bound at
    construction (BadInput if it cannot be), served once started."""

    def __init__(
        self, host: str, port: int, collect: Callable[[], list[Metric]], labels: dict[str, str]
    ) -> None:
        super().__init__()
        self._collect, self._labels = collect, labels
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    body = render(outer._collect(), outer._labels).encode()
                except Exception as e:  # a scrape must never take the peer down
                    log.warning("metrics collection failed: %s", e)
                    self.send_error(500, "metrics collection failed")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet
                log.debug("metrics: " + format, *args)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise BadInput(f"cannot serve metrics on {host}:{port} ({e.strerror})") from None
        self._server.daemon_threads = True
        self._server.timeout = 1.0
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _begin(self) -> concurrent.futures.Future[None]:
        self._thread.start()
        return ready_now()

    def _end(self) -> None:
        self._server.shutdown()
        self._server.server_close()
