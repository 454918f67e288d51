"""What a protocol simulation reports: versions per hour, bytes per peer per version, the wait
of a round, forks, and the fate of every finished phase (applied on the head's chain, dropped
as stale, lost with a crashed peer, or still in flight at the end)."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco_peer.swarm_sim.spec import SwarmSimSpec

if TYPE_CHECKING:
    from diloco_peer.swarm_sim.engine import Delta, Peer, SwarmSim


@dataclass
class Tally:
    spec: SwarmSimSpec
    started: int = 0
    finished: set[int] = field(default_factory=set)
    dropped_phases: set[int] = field(default_factory=set)
    compute_s: float = 0.0
    wait_s: list[float] = field(default_factory=list)
    recv: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    catch_ups: Counter[str] = field(default_factory=Counter)
    kept_why: Counter[str] = field(default_factory=Counter)
    group_sizes: list[int] = field(default_factory=list)
    failed_groups: int = 0
    rival_groups: int = 0
    moved_past_groups: int = 0
    lost_forks: int = 0
    crashes: int = 0
    lost_with_crash: set[int] = field(default_factory=set)
    doc: dict[str, Any] = field(default_factory=dict)

    def phase_started(self) -> int:
        self.started += 1
        return self.started

    def phase_finished(self, phase: int, seconds: float) -> None:
        self.finished.add(phase)
        self.compute_s += seconds

    def received(self, p: Peer, nbytes: float, method: str) -> None:
        self.recv[p.id] += nbytes
        self.catch_ups[method] += 1

    def moved(self, p: Peer, nbytes: float) -> None:
        """An all-reduce: `nbytes` each way."""
        self.recv[p.id] += nbytes
        self.sent[p.id] += nbytes

    def kept(self, why: str) -> None:
        self.kept_why[why] += 1

    def dropped(self, d: Delta) -> None:
        self.dropped_phases.update(d.phases)

    def crashed(self, p: Peer) -> None:
        self.crashes += 1
        for d in (p.mine, p.pending):
            if d is not None:
                self.lost_with_crash.update(d.phases)

    def close(self, sim: SwarmSim) -> Tally:
        head = sim.head()
        chain = sim.history.chain(head)
        applied = {ph for v in chain for ph in v.phases} & self.finished
        in_flight = {
            ph for p in sim.live_peers() for d in (p.mine, p.pending) if d for ph in d.phases
        } - applied
        dropped = self.dropped_phases - applied - in_flight
        lost = self.finished - applied - in_flight - dropped
        decided = len(applied) + len(dropped) + len(lost)
        times = [v.at for v in chain]
        peer_versions = 0
        for p in sim.peers.values():
            gone = sim.end if p.died is None else p.died
            peer_versions += bisect.bisect_right(times, gone) - bisect.bisect_left(times, p.joined)
        model = self.spec.model_bytes
        hours = self.spec.hours
        waits = sorted(self.wait_s)
        self.doc = {
            "config": self.spec.to_dict(),
            "versions": len(chain),
            "versions_per_hour": len(chain) / hours,
            "versions_per_hour_steady": (
                (len(chain) - 1) / (times[-1] - times[0]) * 3600
                if len(chain) > 1 and times[-1] > times[0]
                else None
            ),  # fmt: skip
            "forks": sim.history.forks,
            "lost_forks": self.lost_forks,
            "phases": {
                "finished": len(self.finished),
                "applied": len(applied),
                "dropped_stale": len(dropped),
                "lost": len(lost),
                "in_flight_at_end": len(in_flight),
            },  # fmt: skip
            "applied_fraction": len(applied) / decided if decided else None,
            "bytes_per_peer_version": {
                "received": sum(self.recv.values()) / peer_versions if peer_versions else None,
                "sent": sum(self.sent.values()) / peer_versions if peer_versions else None,
                "received_models": (
                    sum(self.recv.values()) / peer_versions / model if peer_versions else None
                ),
                "sent_models": (
                    sum(self.sent.values()) / peer_versions / model if peer_versions else None
                ),
            },  # fmt: skip
            "wait_s": {
                "mean": statistics.fmean(waits) if waits else None,
                "p90": waits[int(0.9 * (len(waits) - 1))] if waits else None,
                "max": waits[-1] if waits else None,
            },  # fmt: skip
            "utilization": (
                self.compute_s / (self.compute_s + sum(waits)) if self.compute_s else None
            ),  # fmt: skip
            "group_size": {
                "mean": statistics.fmean(self.group_sizes) if self.group_sizes else None,
                "max": max(self.group_sizes, default=0),
            },  # fmt: skip
            "groups": {
                "failed": self.failed_groups,
                "gave_up_to_a_rival": self.rival_groups,
                "gave_up_moved_past": self.moved_past_groups,
            },  # fmt: skip
            "kept": dict(self.kept_why),
            "catch_ups": dict(self.catch_ups),
            "peers": {
                "at_end": len(sim.live_peers()),
                "crashed": self.crashes,
                "ever": len(sim.peers),
            },  # fmt: skip
        }
        return self

    def document(self) -> dict[str, Any]:
        return self.doc
