"""One simulated worker: its replica's inner trainer, its device's virtual clock, and the
phase it is running."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco_peer.coordinator_free.dylu import SpeedMeter
from diloco_peer.peer.inner import InnerTrainer, PhaseResult
from diloco_peer.sim.profiles import StepClock


@dataclass
class Worker:
    """A worker of the simulated swarm; `index` also breaks ties between equal finish times."""

    index: int
    trainer: InnerTrainer
    clock: StepClock
    speed: SpeedMeter = field(default_factory=SpeedMeter)
    busy_s: float = 0.0
    """Virtual seconds spent training (the rest of the run is idle time)."""
    finish: float = math.inf
    """Virtual time the running phase ends; inf when not running."""
    base_version: int = 0
    """The version its running phase started from (async runs: staleness is measured from it)."""
    phase: PhaseResult | None = None
    keep_local: bool = False
    """Its last contribution was dropped: it continues from its local θ (sync `drop_prob`)."""
