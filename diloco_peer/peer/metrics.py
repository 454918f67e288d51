"""A Prometheus endpoint for a long-running peer (`join --metrics-port`), on `prometheus_client`.

Serves `GET /metrics` from a daemon thread with prometheus_client's handler (the text format
0.0.4 by default, OpenMetrics when the scraper asks for it); the values come from a callback
that reads the peer's counters at each scrape (a custom collector), so the endpoint never blocks
training. Names and labels are a contract: existing scrapes and dashboards use them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Family
from prometheus_client.exposition import MetricsHandler, generate_latest
from prometheus_client.registry import Collector

from diloco_peer.errors import BadInput
from diloco_peer.lifecycle import BackgroundPart, ready_now

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What a scrape without an Accept header gets."""


@dataclass(frozen=True)
class Metric:
    name: str
    """The sample's name; a counter's ends in `_total`."""
    kind: Literal["gauge", "counter"]
    help: str
    value: float | None  # None: not known yet, the sample is left out


class _Callback(Collector):
    """The peer's metrics as prometheus_client families, read from `collect` at each scrape."""

    def __init__(self, collect: Callable[[], list[Metric]], labels: dict[str, str]) -> None:
        self._collect, self._labels = collect, dict(sorted(labels.items()))

    def collect(self) -> Iterator[Family]:
        names, values = list(self._labels), list(self._labels.values())
        for m in self._collect():
            family: Family
            if m.kind == "counter":  # prometheus_client names the family without `_total`
                family = CounterMetricFamily(m.name.removesuffix("_total"), m.help, labels=names)
            else:
                family = GaugeMetricFamily(m.name, m.help, labels=names)
            if m.value is not None:
                family.add_metric(values, float(m.value))
            yield family


def render(metrics: list[Metric], labels: dict[str, str]) -> str:
    """The text exposition format (0.0.4) of `metrics`, as a scrape receives it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Callback(lambda: metrics, labels))
    return generate_latest(registry).decode()


class MetricsServer(BackgroundPart):
    """`GET /metrics` on host:port; `collect()` is called per request. The port is bound at
    construction (BadInput if it cannot be), served once started."""

    def __init__(
        self, host: str, port: int, collect: Callable[[], list[Metric]], labels: dict[str, str]
    ) -> None:
        super().__init__()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Callback(collect, labels))

        class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc]
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    super().do_GET()
                except Exception as e:  # a scrape must never take the peer down
                    log.warning("metrics collection failed: %s", e)
                    self.send_error(500, "metrics collection failed")

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
