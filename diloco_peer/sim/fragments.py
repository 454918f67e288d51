"""Streaming DiLoCo's fragments in a simulated sync run (ALGORITHMS §1.2, `simulate --fragments`).

The model's parameters are cut into P fragments by transformer block (block i in fragment
i mod P, the paper's strided pattern; the embedding goes with fragment 0, the final norm with
fragment P − 1). A round of H inner steps is cut into P sub-phases; at the end of sub-phase j
every worker hands in fragment j's δ (its progress since fragment j's last sync, H steps), the
group all-reduces it in `comm_s` × the fragment's share of the model's values, and the
fragment's own outer optimizer steps it. Blocking, the workers wait for that all-reduce and
restart the fragment from θ_global; overlapped (`--overlap local`), they train on and fold the
fragment's new θ_global in when it arrives (ALGORITHMS §1.1's `rebase` or `mix`, on that
fragment alone). When the budget is spent, the fragments with progress not yet synced are
synced once more, so that every local step reaches θ_global, as in the unfragmented run.

Peak traffic falls by about P (each all-reduce carries one fragment); the bytes per round stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diloco_peer.averaging.fragments import fragment_of
from diloco_peer.config import SimSpec
from diloco_peer.errors import ConfigError
from diloco_peer.peer.inner import Schedule
from diloco_peer.sim.contributions import mean_pairwise_cosine
from diloco_peer.sim.worker import Worker, steps_before

if TYPE_CHECKING:
    from diloco_peer.sim.simulator import Simulator


def check_fragments(spec: SimSpec, names: Sequence[str]) -> None:
    """Raise ConfigError unless `spec.fragments` fits the model (`names`: its parameters) and
    the run is one the fragments are modelled for."""
    count, h = spec.fragments, spec.run.inner_steps
    if count < 1:
        raise ConfigError(f"fragments must be > 0, got {count}")
    if count == 1:
        return
    if count > h:
        raise ConfigError(f"--fragments {count} is more than H ({h})")
    modelled = (spec.algo, spec.overlap_term, spec.drop_prob, spec.compute_schedule) == (
        "sync", "own", 0.0, "constant"
    ) and spec.overlap in ("none", "local") and spec.overlap_fold in ("rebase", "mix")  # fmt: skip
    if not modelled:
        raise ConfigError("--fragments is modelled with --algo sync, --overlap none or local, "
                          "--overlap-fold rebase or mix, --overlap-term own, no --drop-prob "
                          "and a constant --compute-schedule")  # fmt: skip
    fragment_of(names, count)


def sub_phases(steps: int, count: int) -> list[int]:
    """A round's `steps` inner steps cut into `count` sub-phases of near-equal length (sub-phase
    j ends at round(j·steps/count)); a sub-phase may be empty when steps < count."""
    bounds = [round(j * steps / count) for j in range(count + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass
class _Held:
    """What one worker holds of one fragment: the θ_global its δ is measured against, and
    where its local parameters stood when the fragment was last handed in (`rebase`'s b)."""

    base: list[torch.Tensor]
    handed: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Arriving:
    """A fragment's new θ_global on its way to the workers: which fragment, its values, and the
    virtual time the all-reduce ends."""

    fragment: int
    theta: list[torch.Tensor]
    at: float


class FragmentedSync:
    """One fragmented sync run over the simulator's model, data and clocks."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        spec, r = sim.spec, sim.run_spec
        self.count = spec.fragments
        names = [n for n, _ in sim.model.named_parameters()]
        frag = fragment_of(names, self.count)
        self.members = [[i for i, g in enumerate(frag) if g == f] for f in range(self.count)]
        total = sum(t.numel() for t in sim.theta)
        self.share = [sum(sim.theta[i].numel() for i in m) / total for m in self.members]
        self.outers = [
            sim.outer_optimizer(r.outer_optimizer, buffer_size=r.dn_buffer_size or spec.workers)
            for _ in range(self.count)
        ]
        self.workers = sim.new_workers(spec.workers)
        for w in self.workers:
            w.trainer.load_params(sim.theta)
        self.held = [[_Held(self.global_part(f)) for f in range(self.count)] for _ in self.workers]
        self.arriving: _Arriving | None = None
        self.group_done = 0.0
        self.updates = 0
        self.pending = [False] * self.count

    # ----- one fragment's values -----

    def global_part(self, f: int) -> list[torch.Tensor]:
        """Fragment f of θ_global (copies)."""
        return [self.sim.theta[i].clone() for i in self.members[f]]

    def local_part(self, w: Worker, f: int) -> list[torch.Tensor]:
        """Fragment f of worker w's local parameters (fp32 CPU copies)."""
        params = w.trainer.params
        return [params[i].detach().to("cpu", torch.float32, copy=True) for i in self.members[f]]

    @torch.no_grad()
    def fold(self, w: Worker, arriving: _Arriving, restart: bool) -> None:
        """Fold a fragment's new θ_global into worker w (ALGORITHMS §1.2): `restart` (it is
        there before the sub-phase starts: blocking), restart the fragment from it; else
        `rebase` or `mix` with keep share κ on that fragment alone (`InnerTrainer.rebase`'s
        arithmetic)."""
        spec, f, held = self.sim.spec, arriving.fragment, self.held[w.index][arriving.fragment]
        keep = 0.0 if restart else spec.overlap_keep
        origin = held.handed if spec.overlap_fold == "rebase" else arriving.theta
        for i, new, old in zip(self.members[f], arriving.theta, origin, strict=True):
            p = w.trainer.params[i]
            if restart:
                p.copy_(new)
            elif keep == 1.0:
                p.add_((new - old).to(p.device, p.dtype))
            else:
                p.sub_(old.to(p.device, p.dtype)).mul_(keep).add_(new.to(p.device, p.dtype))
        held.base = arriving.theta

    # ----- the run -----

    def sub_phase(self, w: Worker, steps: int, stream: Any, schedule: Schedule, at: int) -> None:
        """Worker w trains `steps` inner steps from its shard's step `at`, folding in the
        fragment on its way when it arrives (blocking: before the first step)."""
        spec, sim = self.sim.spec, self.sim
        start = sim.now if spec.overlap == "none" else w.free_at
        if spec.overlap != "none" and spec.overlap_from == "group":
            start = max(start, self.group_done)
        arriving = self.arriving
        fold_after = 0 if arriving is None else steps_before(w.clock, start, arriving.at, steps)
        if arriving is not None and fold_after == 0:
            self.fold(w, arriving, restart=True)
        batches = lambda: [stream.next_batch()]  # noqa: E731
        if fold_after > 0:
            w.trainer.train(fold_after, batches, schedule, at)
            self.fold(w, arriving, restart=False)  # type: ignore[arg-type]
        if steps > fold_after:
            w.trainer.train(steps - fold_after, batches, schedule, at + fold_after)
        duration = w.clock.duration(steps)
        w.busy_s += duration
        w.free_at = max(start + duration, sim.now)

    def sync(self, f: int, workers: Sequence[Worker]) -> None:
        """Fragment f handed in by `workers` and all-reduced; its outer step is applied and its
        new θ_global sent on its way (it arrives `comm_s` × its share after the last hand-in)."""
        sim = self.sim
        deltas = []
        for w in workers:
            held = self.held[w.index][f]
            held.handed = self.local_part(w, f)
            deltas.append([b - x for b, x in zip(held.base, held.handed, strict=True)])
        # one all-reduce at a time: the run's last syncs follow each other
        self.group_done = max(sim.now, *(w.free_at for w in workers))
        sim.now = self.group_done + sim.spec.comm_s * self.share[f]
        cos = mean_pairwise_cosine(deltas)
        if cos is not None:
            sim.cosines.append(cos)
        params = [sim.theta[i] for i in self.members[f]]
        sim.group_step(self.outers[f], deltas, params)
        self.updates += 1
        self.pending[f] = False
        self.arriving = _Arriving(f, self.global_part(f), sim.now)

    def run(self) -> dict[str, Any]:
        sim, spec, r = self.sim, self.sim.spec, self.sim.run_spec
        k = spec.workers
        data = sim.sync_shards(k)
        assigned = 0
        while assigned < spec.total_steps:
            steps = min(r.inner_steps, (spec.total_steps - assigned) // k)
            if steps < 1:
                break
            # a shard per worker and round, as in the unfragmented run
            picked = [data.pick(w.index, steps, r.batch_size) for w in self.workers]
            for f, length in enumerate(sub_phases(steps, self.count)):
                if length == 0:
                    continue
                for w, s in zip(self.workers, picked, strict=True):
                    self.sub_phase(w, length, data.streams[s], data.schedules[s], data.steps[s])
                    data.steps[s] += length
                self.pending = [True] * self.count
                self.sync(f, self.workers)
                sim.progress(length * k)
            assigned += steps * k
        self._flush()
        return {
            "outer_updates": self.updates,
            "dropped_contributions": 0,
            "idle_fraction": sim.idle([w.busy_s for w in self.workers]),
            "shard_share": data.share(),
            "fragments": {"count": self.count, "share": self.share},
        }

    def _flush(self) -> None:
        """Sync once more every fragment trained since its last sync (the run's end). A curve
        point taken at these local steps before it goes: the run's last point is then taken
        after it (`Simulator.run`), so that the final ppl is the flushed θ_global's."""
        pending = [f for f in range(self.count) if self.pending[f]]
        for f in pending:
            self.sync(f, self.workers)
        curve = self.sim.curve
        if pending and curve and curve[-1]["local_steps"] == self.sim.local_steps:
            curve.pop()
