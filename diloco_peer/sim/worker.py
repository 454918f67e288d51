"""One simulated worker: its replica's inner trainer, its device's virtual clock, and the
phase it is running; and the overlapped phase (ALGORITHMS §1.1) both simulated algorithms run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from diloco_peer.averaging.outer_base import OuterOptimizer
from diloco_peer.config import FoldRule
from diloco_peer.coordinator_free.dylu import SpeedMeter
from diloco_peer.peer.inner import InnerTrainer, PhaseResult, Schedule
from diloco_peer.sim.contributions import plain_sum
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
    free_at: float = 0.0
    """Virtual time its last phase ended (overlapped runs start the next one there)."""
    start_from: list[torch.Tensor] | None = None
    """Where its next overlapped phase starts under the `eager` and `proxy` rules (None: its own
    local θ)."""


def steps_before(clock: StepClock, start: float, fold_at: float, steps: int) -> int:
    """Inner steps a phase that starts at `start` runs before an update that arrives at
    `fold_at` is folded in: the step under way when it arrives finishes first (mean step time,
    no jitter); at most `steps`."""
    if fold_at <= start:
        return 0
    return min(steps, math.ceil((fold_at - start) / clock.seconds_per_step - 1e-9))


def eager_start(
    outer: OuterOptimizer, theta: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], n: int
) -> list[torch.Tensor]:
    """The eager rule's start (ALGORITHMS §1.1): the outer step from θ_global previewed as if
    each of the `n` contributions it expects equalled this worker's own fresh δ."""
    return outer.preview(theta, [t * n for t in delta], n)


@dataclass
class LastGroup:
    """The last group applied, as the `proxy` rule uses it: each member's own δ, by worker
    index."""

    own: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def record(self, members: Sequence[Worker], deltas: Sequence[Sequence[torch.Tensor]]) -> None:
        """Remember this group for the next proxy starts."""
        self.own = {w.index: list(d) for w, d in zip(members, deltas, strict=True)}

    def others_mean(self, index: int) -> list[torch.Tensor] | None:
        """The mean δ of the last group's members other than worker `index` (None: none)."""
        others = [d for i, d in self.own.items() if i != index]
        if not others:
            return None
        return [t / len(others) for t in plain_sum(others)]


def proxy_start(
    outer: OuterOptimizer,
    theta: Sequence[torch.Tensor],
    index: int,
    delta: Sequence[torch.Tensor],
    n: int,
    last: LastGroup,
) -> list[torch.Tensor]:
    """The `proxy` rule's start (ALGORITHMS §1.1), the eager-updates paper's proxy: the outer
    step from θ_global previewed as if, of the `n` contributions it expects, one were this
    worker's fresh δ and each other the mean δ of the other members of the last group applied
    (`eager`'s start when there is none)."""
    rest = last.others_mean(index)
    if rest is None:
        return eager_start(outer, theta, delta, n)
    guess = [d + r * (n - 1) for d, r in zip(delta, rest, strict=True)]
    return outer.preview(theta, guess, n)


@dataclass(frozen=True)
class Fold:
    """How an overlapped phase folds the new θ_global in (ALGORITHMS §1.1). `rebase`: the
    progress made since the phase's start, × `keep`, moved onto θ_global (`keep` 1: all of it;
    0: restart from θ_global). `mix`: θ_global + keep·(θ_local − θ_global), Streaming DiLoCo's
    merge of the local and the global parameters."""

    rule: FoldRule = "rebase"
    keep: float = 1.0
    shared: bool = False
    """`mix` with `--overlap-term shared`: the δ loses the κ·(θ − base) the merge leaves in it
    (the swarm's `Overlap.report`); the term its group shares is added when it is applied."""

    def apply(self, trainer: InnerTrainer, theta: Sequence[torch.Tensor],
              base: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:  # fmt: skip
        """Fold `theta` in. `pull` (mix's parameters) returns what its δ adds to θ − θ_local
        so that it is the phase's own progress: (θ_after − θ) + (base − θ_before)."""
        before = trainer.snapshot() if self.rule == "pull" else None
        trainer.rebase(theta, base if self.rule == "rebase" else theta, self.keep)
        if self.rule == "mix" and self.shared:
            return [self.keep * (b - t) for b, t in zip(base, theta, strict=True)]
        if before is None:
            return None
        return [a - t + b - f for a, t, b, f
                in zip(trainer.snapshot(), theta, base, before, strict=True)]  # fmt: skip


def overlapped_phase(
    trainer: InnerTrainer,
    theta: Sequence[torch.Tensor],
    steps: int,
    fold_after: int,
    next_batches: Callable[[], Sequence[torch.Tensor]],
    schedule: Schedule,
    start_step: int,
    start_from: Sequence[torch.Tensor] | None = None,
    fold: Fold = Fold(),
) -> PhaseResult:
    """A local phase that starts from `start_from` (by default the replica's own parameters,
    where its last phase ended) and folds in the new global state `theta` after `fold_after`
    steps, keeping the progress made since the start (ALGORITHMS §1.1); its δ is measured
    against `theta`. With `fold_after` 0 it is the blocking phase from `theta`; with a negative
    one nothing is folded in (a sync worker whose contribution was dropped continues from its
    local θ, DiLoCo Fig. 8)."""
    if fold_after <= 0:
        return trainer.run_phase(theta, steps, next_batches, schedule, start_step,
                                 from_local=fold_after < 0)  # fmt: skip
    if start_from is not None:
        trainer.load_params(start_from)
    base = trainer.snapshot()
    loss, samples = trainer.train(fold_after, next_batches, schedule, start_step)
    correction = fold.apply(trainer, theta, base)
    rest = steps - fold_after
    if rest <= 0:
        delta = trainer.delta_from(theta)
        seconds, tail_samples, mean_loss = 0.0, 0, loss
    else:
        tail = trainer.run_phase(theta, rest, next_batches, schedule, start_step + fold_after,
                                 from_local=True)  # fmt: skip
        delta, seconds, tail_samples = tail.delta, tail.seconds, tail.samples
        mean_loss = (loss * fold_after + tail.mean_loss * rest) / steps
    if correction is not None:
        delta = [d + c for d, c in zip(delta, correction, strict=True)]
    return PhaseResult(delta, steps, samples + tail_samples, mean_loss, seconds)
