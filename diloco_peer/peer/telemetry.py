"""What a peer reports about itself: counters, the round report, Prometheus metrics (`join
--metrics-port`), TensorBoard scalars (`--tensorboard`) and its process's resource use.

The parts of a round record into one `Counters`; everything that reports reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_peer.errors import BadInput
from diloco_peer.peer.metrics import Metric, MetricsServer

log = logging.getLogger(__name__)


@dataclass
class RoundReport:
    """What one round did, for the progress line and the JSON log."""

    version: int
    state_hash: str
    group_size: int
    loss: float
    ppl: float | None
    comm_s: float
    bytes_sent: int
    bytes_received: int
    steps: int = 0
    staleness: int = 0
    members: list[str] = field(default_factory=list)


@dataclass
class Counters:
    """A peer's running totals (read by the round event, `status`, metrics, the stop event)."""

    rounds_done: int = 0
    """Rounds this peer applied (restored from its checkpoint)."""
    contributions: int = 0
    dropped: int = 0
    """Contributions dropped as older than the staleness limit."""
    compute_s: float = 0.0
    """Seconds spent training."""
    wait_s: float = 0.0
    """Seconds spent waiting on other peers (groups, all-reduce, catch-up)."""
    hidden_wait_s: float = 0.0
    """Of `wait_s`, the seconds an overlapped round waited while the next phase trained (the
    device was not idle: `idle_fraction` leaves them out)."""
    catch_up_s: float = 0.0
    """Seconds the last catch-up that moved this peer took (an async phase that trains on to
    meet peers at a later version ends that much before their phases do)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    last_loss: float | None = None
    last_report: RoundReport | None = None
    t_start: float = field(default_factory=time.time)
    started_training: bool = False
    """Set once the first phase completed."""
    t_first_train: float = 0.0
    """When the first completed phase began (wall clock)."""
    round_mark: tuple[float, float] | None = None
    """(wall clock, compute_s) when the last applied round ended."""
    utilization: float | None = None
    """Compute seconds over wall seconds from the previous applied round's end (or the first
    phase's start) to the last one's: the share of its time the device trained."""

    def active_s(self) -> float:
        """Seconds since the first training step (0 before it)."""
        return time.time() - self.t_first_train if self.started_training else 0.0

    def idle_fraction(self) -> float | None:
        active = self.active_s()
        return max(0.0, self.wait_s - self.hidden_wait_s) / active if active > 0 else None

    def add_round(self, report: RoundReport, now: float | None = None) -> None:
        now = time.time() if now is None else now
        since, computed = self.round_mark or (self.t_first_train, 0.0)
        wall = now - since
        if self.started_training and wall > 0:
            self.utilization = min(1.0, (self.compute_s - computed) / wall)
        self.round_mark = (now, self.compute_s)
        self.rounds_done += 1
        self.contributions += 1
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.last_report = report


def resources(device: torch.device) -> dict[str, float | None]:
    """This process's memory and CPU use (and GPU memory), for `status`."""
    import psutil

    try:
        proc = _process()
        rss, cpu = proc.memory_info().rss / 1e6, proc.cpu_percent(interval=None)
    except (psutil.Error, OSError):
        return {}
    gpu = torch.cuda.memory_allocated(device) / 1e6 if device.type == "cuda" else None
    return {"rss_mb": float(rss), "cpu_percent": float(cpu), "gpu_mem_mb": gpu}


_PROCESS: list[Any] = []  # one psutil.Process: cpu_percent measures since its previous call


def _process() -> Any:
    import psutil

    if not _PROCESS:
        _PROCESS.append(psutil.Process())
    return _PROCESS[0]


class TensorBoard:
    """One scalar per metric per round (`--tensorboard DIR`); a no-op without a folder."""

    def __init__(self, folder: str | None) -> None:
        self._writer: Any = None
        if not folder:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BadInput(
                "--tensorboard needs the tensorboard package: pip install 'diloco-peer[tb]'"
            ) from None
        try:
            self._writer = SummaryWriter(log_dir=folder, flush_secs=5)
        except OSError as e:
            raise BadInput(f"--tensorboard folder is not usable ({e})") from None

    def write(self, report: RoundReport, counters: Counters) -> None:
        if self._writer is None:
            return
        scalars = {
            "loss": report.loss, "ppl": report.ppl, "group_size": report.group_size,
            "comm_s": report.comm_s, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "staleness": report.staleness,
            "contributions": counters.contributions, "dropped": counters.dropped,
            "idle_fraction": counters.idle_fraction(), "utilization": counters.utilization,
        }  # fmt: skip
        for name, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(f"diloco/{name}", value, report.version)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@dataclass(frozen=True)
class Gauges:
    """The values metrics read that are not counters: each a callable, read per scrape."""

    version: Callable[[], int]
    speed: Callable[[], float | None]
    paused: Callable[[], bool]
    bans: Callable[[], int]
    bans_total: Callable[[], int]


def collect(counters: Counters, gauges: Gauges) -> list[Metric]:
    """The Prometheus metrics of one peer (names are a contract: existing scrapes use them)."""
    c, last = counters, counters.last_report
    return [
        Metric("diloco_peer_version", "gauge", "Version of the replicated state held.",
               gauges.version()),
        Metric("diloco_peer_rounds_total", "counter", "Rounds this peer applied.", c.rounds_done),
        Metric("diloco_peer_contributions_total", "counter", "Contributions applied.",
               c.contributions),
        Metric("diloco_peer_dropped_contributions_total", "counter",
               "Contributions dropped as too stale.", c.dropped),
        Metric("diloco_peer_loss", "gauge", "Mean training loss of the last phase.", c.last_loss),
        Metric("diloco_peer_ppl", "gauge", "Held-out perplexity at the last evaluation.",
               last.ppl if last else None),
        Metric("diloco_peer_group_size", "gauge", "Members of the last group.",
               last.group_size if last else None),
        Metric("diloco_peer_comm_seconds", "gauge", "Communication seconds, last round.",
               last.comm_s if last else None),
        Metric("diloco_peer_bytes_sent_total", "counter", "All-reduce bytes sent.", c.bytes_sent),
        Metric("diloco_peer_bytes_received_total", "counter", "All-reduce bytes received.",
               c.bytes_received),
        Metric("diloco_peer_compute_seconds_total", "counter", "Seconds spent training.",
               c.compute_s),
        Metric("diloco_peer_wait_seconds_total", "counter",
               "Seconds spent waiting on other peers (groups, all-reduce, catch-up).", c.wait_s),
        Metric("diloco_peer_compute_utilization", "gauge",
               "Share of the last round's wall time spent training.", c.utilization),
        Metric("diloco_peer_idle_fraction", "gauge",
               "wait_seconds_total / seconds since the first training step.", c.idle_fraction()),
        Metric("diloco_peer_inner_steps_per_second", "gauge", "Measured inner-step speed.",
               gauges.speed()),
        Metric("diloco_peer_paused", "gauge", "1 while paused (SIGUSR1).",
               1.0 if gauges.paused() else 0.0),
        Metric("diloco_peer_bans", "gauge", "Peers this peer currently bans.", gauges.bans()),
        Metric("diloco_peer_bans_total", "counter",
               "Bans issued (contributions excluded) since start.", gauges.bans_total()),
    ]  # fmt: skip


def serve_metrics(
    host: str, port: int, counters: Counters, gauges: Gauges, labels: dict[str, str]
) -> MetricsServer | None:
    """`--metrics-port`: a started MetricsServer (None with port -1)."""
    if port < 0:
        return None
    server = MetricsServer(host, port, lambda: collect(counters, gauges), labels)
    server.start()
    log.warning("[%s] metrics on http://%s:%d/metrics", labels["peer"][-6:], host, server.port)
    return server
