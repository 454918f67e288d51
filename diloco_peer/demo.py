"""`demo`: a local swarm of real peer processes training the built-in run, and its summary.

The peers are `join` processes on 127.0.0.1 (local_swarm.py) in a new temporary folder; the
founder gets the run as a run.toml, the others its address. Heterogeneity is emulated by
throttling peers with the simulator's speed profiles (sim/profiles.py). What each peer does is
followed through its event log (DESIGN §6) into a `PeerRow`, and the rows give the summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from diloco_peer.config import (
    HETEROGENEITY,
    PROTOCOLS,
    Heterogeneity,
    ModelPreset,
    Protocol,
    default_run,
)
from diloco_peer.coordinator_free.manifest import check_fragments, dump_run_config
from diloco_peer.errors import ConfigError, LocalPeerFailed
from diloco_peer.local_swarm import LocalSwarm
from diloco_peer.peer.events import read_events
from diloco_peer.sim.profiles import step_seconds

FOUNDER_START_S = 120.0
"""How long, from the demo's start, the founder may take to publish its address."""
POLL_S = 0.5
"""How often the peers' logs are read while they train."""
STOP_GRACE_S = 20.0
"""How long peers get to leave after SIGTERM (a timeout, an error) before SIGKILL."""


@dataclass(kw_only=True, frozen=True)
class DemoSpec:
    """What `demo` runs; the flags of the same names."""

    peers: int
    """Peer processes to start on 127.0.0.1."""
    rounds: int
    """Train until the swarm state reaches this version."""
    total_steps: int
    """Instead of `rounds` when positive: until the state holds this many local steps."""
    model: ModelPreset
    """Model preset of the built-in run."""
    inner_steps: int
    """H: inner steps per round."""
    protocol: Protocol
    """sync (DiLoCo) or async (DyLU + Delayed Nesterov)."""
    heterogeneity: Heterogeneity
    """Emulated device speeds, one of HETEROGENEITY (by throttling peers)."""
    timeout_s: float
    """Give up (and stop every peer) after this long."""
    log_json: Path | None = None
    """Also append every peer's events here."""
    overlap: bool = False
    """Overlapped rounds (the manifest's swarm.overlap, ALGORITHMS §1.1)."""
    fragments: int = 1
    """Sync: the model averaged in this many parts, one per round (swarm.fragments, §1.2)."""

    def __post_init__(self) -> None:
        if self.peers < 1 or self.rounds < 1:
            raise ConfigError("--peers and --rounds must be >= 1")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown --protocol {self.protocol!r}; choose sync or async")
        if self.heterogeneity not in HETEROGENEITY:
            raise ConfigError(
                f"unknown --heterogeneity {self.heterogeneity!r}; choose {'|'.join(HETEROGENEITY)}"
            )


@dataclass
class PeerRow:
    """One peer of the demo as its events so far describe it; `version` is None until its
    first event."""

    peer: str | None = None
    version: int | None = None
    state_hash: str | None = None
    rounds: int = 0
    local_steps: int = 0
    loss: float | None = None
    ppl: float | None = None
    ppl_start: float | None = None
    ppl_stop: float | None = None
    applied_steps: int | None = None
    shard_samples: Any = None
    data_share: Any = None
    active_s: float | None = None
    compute_s: float | None = None
    utilization: list[float] = field(default_factory=list)
    """Compute seconds over wall seconds of each applied round (its event)."""
    idle_fraction: float | None = None
    dropped: int = 0

    def feed(self, ev: dict[str, Any]) -> None:
        """Take one event of this peer's log into the row."""
        self.peer = ev.get("peer")
        self.version = ev.get("version", self.version or 0)
        self.state_hash = ev.get("state_hash", self.state_hash)
        kind = ev["event"]
        if kind == "start":
            self.ppl_start = ev.get("ppl")
        elif kind == "round":
            self.rounds += 1
            self.loss, self.ppl = ev.get("loss"), ev.get("ppl")
            self.local_steps += ev.get("steps", 0)
            if ev.get("utilization") is not None:
                self.utilization.append(ev["utilization"])
        elif kind == "stop":
            self.ppl_stop = ev.get("ppl")
            self.applied_steps = ev.get("applied_steps")
            self.shard_samples = ev.get("shard_samples")
            self.data_share = ev.get("data_share")
            active = ev.get("active_s") or 0.0
            self.active_s = active
            self.compute_s = ev.get("compute_s")
            self.idle_fraction = ev.get("wait_s", 0.0) / active if active else None
            self.dropped = ev.get("dropped", 0)


class Demo:
    """One demo run: its folder and run.toml (made at once), its peers (`launch`), their rows
    (`follow`), the summary. Leaving a `with` block stops every peer."""

    def __init__(self, spec: DemoSpec) -> None:
        self.spec = spec
        seconds = step_seconds(spec.heterogeneity, spec.peers)
        self.throttles = [s / min(seconds) for s in seconds]
        run_spec, settings = default_run(spec.model, spec.protocol)
        # Sync mode waits for its slowest peer: give it the time that peer needs.
        settings = dataclasses.replace(
            settings,
            expected_peers=spec.peers,
            overlap=spec.overlap,
            fragments=spec.fragments,
            sync_timeout_s=settings.sync_timeout_s * max(self.throttles),
        )
        run_spec = dataclasses.replace(run_spec, inner_steps=spec.inner_steps)
        check_fragments(run_spec, settings)
        self.started = time.time()
        self.workdir = Path(tempfile.mkdtemp(prefix="diloco-demo-"))
        self.config = self.workdir / "run.toml"
        self.config.write_text(dump_run_config(run_spec, settings), encoding="utf-8")
        threads = max(1, (os.cpu_count() or 2) // spec.peers)
        until = (
            ["--until-steps", str(spec.total_steps)]
            if spec.total_steps
            else ["--until-version", str(spec.rounds)]
        )
        self.swarm = LocalSwarm(
            self.workdir, run="demo", stop_grace_s=STOP_GRACE_S,
            join_args=["--host", "127.0.0.1", "-v", *until, "--quiet", "--threads", str(threads)],
        )  # fmt: skip
        self.rows = [PeerRow() for _ in range(spec.peers)]
        self._offsets = [0] * spec.peers

    def launch(self) -> None:
        """Start the founder, wait for its address, then start the other peers."""
        founder, log = self.swarm.start(
            "peer0", "--config", str(self.config), "--throttle", f"{self.throttles[0]:.4f}"
        )
        try:
            wait_s = FOUNDER_START_S - (time.time() - self.started)
            maddr = self.swarm.address(log, max(0.0, wait_s), proc=founder)
        except (TimeoutError, LocalPeerFailed):
            raise RuntimeError("the founding peer did not start") from None
        for i in range(1, self.spec.peers):
            self.swarm.start(f"peer{i}", "--swarm", maddr, "--throttle", f"{self.throttles[i]:.4f}")

    def follow(self) -> Iterator[None]:
        """Read the peers' logs into `rows` until every peer has exited, yielding after each
        read. Raises RuntimeError once the run is past its timeout."""
        while self.swarm.running():
            if time.time() - self.started > self.spec.timeout_s:
                raise RuntimeError(f"demo did not finish within {self.spec.timeout_s:g} s")
            self.poll()
            yield
            time.sleep(POLL_S)
        self.poll()
        yield

    def poll(self) -> None:
        """Take what each peer logged since the last call into its row (and --log-json)."""
        for i, row in enumerate(self.rows):
            log = self.workdir / f"peer{i}.jsonl"
            events, self._offsets[i] = read_events(log, self._offsets[i])
            for ev in events:
                row.feed(ev)
            if self.spec.log_json is not None and events:
                with open(self.spec.log_json, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(ev, sort_keys=True) + "\n" for ev in events)

    def summary(self) -> dict[str, Any]:
        """The demo's JSON document (DESIGN §6): every peer, whether their states agree, the
        held-out ppl before and after. Exit codes are those of stopped peers: call after
        leaving the `with` block."""
        rows, codes = self.rows, [p.returncode for p in self.swarm.procs]
        final_version = max((r.version or 0 for r in rows), default=0)
        at_final = {r.state_hash for r in rows if r.version == final_version}
        ppl_after = next(
            (getattr(r, k) for k in ("ppl_stop", "ppl") for r in rows
             if r.version == final_version and getattr(r, k)),
            None,
        )  # fmt: skip
        return {
            "peers": [
                {"name": f"peer{i}", "peer_id": r.peer, "rounds": r.rounds,
                 "contributions": r.rounds, "final_version": r.version,
                 "state_hash": r.state_hash, "exit_code": codes[i],
                 "local_steps": r.local_steps, "throttle": self.throttles[i],
                 "active_s": r.active_s, "compute_s": r.compute_s,
                 "idle_fraction": r.idle_fraction, "dropped": r.dropped,
                 "utilization": statistics.median(r.utilization) if r.utilization else None}
                for i, r in enumerate(rows)
            ],
            "final_version": final_version,
            "hashes_agree": len(at_final) == 1 and all(r.version == final_version for r in rows),
            "ppl_before": rows[0].ppl_start if rows else None,
            "ppl_after": ppl_after,
            "protocol": self.spec.protocol,
            "overlap": self.spec.overlap,
            "fragments": self.spec.fragments,
            "heterogeneity": self.spec.heterogeneity,
            "applied_steps": max((r.applied_steps or 0 for r in rows), default=0),
            "shard_samples": next(
                (r.shard_samples for r in rows if r.version == final_version), None
            ),
            "data_share": next((r.data_share for r in rows if r.data_share), None),
            "wall_s": time.time() - self.started,
            "logs": str(self.workdir),
        }  # fmt: skip

    def __enter__(self) -> Demo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.swarm.close()
