"""The swarm's health page over HTTP (`diloco-peer dashboard`, `join --dashboard-port`).

A poller thread reads the run's heads every `refresh_s` (through a `status` reader, or the
serving peer's own DHT node) into a `HeadBook` and a `Timeline`; `GET /api/swarm` builds the
document from them (coordinator_free/dashboard.py), `GET /` serves the page that fetches it.
Read-only: only GET is answered (http.server refuses other methods with 501), and nothing a
visitor sends reaches the swarm. Bound to 127.0.0.1 unless the caller says otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from diloco_peer.coordinator_free.dashboard import Timeline, dashboard_document
from diloco_peer.coordinator_free.manifest import SignedManifest
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HeadBook
from diloco_peer.errors import BadInput, SwarmTimeout
from diloco_peer.lifecycle import BackgroundPart, ready_now
from diloco_peer.peer.dashboard_page import PAGE
from diloco_peer.peer.events import read_events
from diloco_peer.peer_spec import PeerSpec

log = logging.getLogger(__name__)

REFRESH_S = 2.0
"""How often the poller reads the heads (and the page fetches the JSON)."""
JOIN_TIMEOUT_S = 15.0
"""How long `shutdown` waits for the poller (a DHT read is bounded by its own timeout)."""


def manifest_summary(signed: SignedManifest) -> dict[str, Any]:
    """The manifest as the page shows it: its fields, the owner's peer id and its digest."""
    doc = signed.manifest.to_dict()
    del doc["owner_public_key"]  # the owner's peer id says the same, readably
    return {"owner": signed.owner_peer_id, "digest": signed.digest, **doc}


@dataclass(frozen=True)
class Source:
    """Where the page's data comes from."""

    run: str
    read_heads: Callable[[], Mapping[str, PeerHead]]
    """One DHT read of the run's heads (SwarmTimeout when the DHT does not answer)."""
    manifest: Mapping[str, Any] | None
    """`manifest_summary` of the run's manifest."""
    event_log: str | None = None
    """The serving peer's event log (`join --log-json`): its rounds feed the chart."""
    served_by: str | None = None
    """The serving peer's id (None: the `dashboard` command)."""


class DashboardServer(BackgroundPart):
    """`GET /` and `GET /api/swarm` on host:port. The port is bound at construction (BadInput
    if it cannot be); the poller and the server run once started."""

    def __init__(self, host: str, port: int, source: Source, refresh_s: float = REFRESH_S) -> None:
        super().__init__()
        self.source, self.refresh_s = source, refresh_s
        self.book, self.timeline = HeadBook(me=""), Timeline()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._log_offset = 0
        self.poll_s: float | None = None
        """Seconds the last poll took (DHT read included), for the bench."""
        try:
            self._server = ThreadingHTTPServer((host, port), _handler(self))
        except (OSError, OverflowError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise BadInput(f"cannot serve the dashboard on {host}:{port} ({why})") from None
        self._server.daemon_threads = True
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="dashboard", daemon=True),
            threading.Thread(target=self._poll_loop, name="dashboard-poll", daemon=True),
        ]

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def poll(self) -> None:
        """Read the heads (and the event log's new lines) once into the book and timeline."""
        t0 = time.perf_counter()
        try:
            heads = self.source.read_heads()
        except SwarmTimeout as e:  # the page shows what it knew; liveness expires it in time
            log.warning("dashboard: %s", e)
            heads = {}
        events: list[dict[str, Any]] = []
        if self.source.event_log:
            events, self._log_offset = read_events(self.source.event_log, self._log_offset)
            # a log appended to by earlier runs under other keys: only this peer's lines count
            events = [e for e in events if e.get("peer") == self.source.served_by]
        now = time.time()
        with self._lock:
            self.book.merge(heads, now)
            self.book.forget(now)
            self.timeline.observe_heads(self.book.live(now), now)
            self.timeline.observe_events(events)
        self.poll_s = time.perf_counter() - t0

    def document(self) -> dict[str, Any]:
        """The JSON of `/api/swarm` now."""
        with self._lock:
            return dashboard_document(
                self.source.run, self.book, time.time(), timeline=self.timeline,
                manifest=self.source.manifest, served_by=self.source.served_by,
            )  # fmt: skip

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # the page must never take the peer (or itself) down
                log.warning("dashboard: reading the swarm failed: %r", e)
            self._stop.wait(self.refresh_s)

    def _begin(self) -> concurrent.futures.Future[None]:
        for thread in self._threads:
            thread.start()
        return ready_now()

    def _end(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        self._threads[1].join(timeout=JOIN_TIMEOUT_S)


def _handler(dashboard: DashboardServer) -> type[BaseHTTPRequestHandler]:
    page = PAGE.replace("{{REFRESH_MS}}", str(int(dashboard.refresh_s * 1000))).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0]
            if path == "/":
                self._send(page, "text/html; charset=utf-8")
            elif path == "/api/swarm":
                try:
                    doc = dashboard.document()
                except Exception as e:  # a visitor must never take the peer down
                    log.warning("dashboard: building the document failed: %r", e)
                    self.send_error(500, "building the document failed")
                    return
                body = json.dumps(doc, sort_keys=True, allow_nan=False, default=str).encode()
                self._send(body, "application/json")
            else:
                self.send_error(404, "only / and /api/swarm are served")

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # quiet
            log.debug("dashboard: " + format, *args)

    return Handler


def serve_dashboard(
    spec: PeerSpec,
    peer_id: str,
    read_heads: Callable[[], Mapping[str, PeerHead]],
    signed: SignedManifest,
) -> DashboardServer | None:
    """`join --dashboard-port`: a started DashboardServer of this peer's run (None with port
    -1), its chart fed by the peer's event log too when it writes one."""
    if spec.dashboard_port < 0:
        return None
    source = Source(run=spec.run_name, read_heads=read_heads, manifest=manifest_summary(signed),
                    event_log=spec.log_json, served_by=peer_id)  # fmt: skip
    server = DashboardServer(spec.dashboard_host, spec.dashboard_port, source)
    server.start()
    log.warning("[%s] dashboard on http://%s:%d/", peer_id[-6:], spec.dashboard_host, server.port)
    return server
