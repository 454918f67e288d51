"""The simulator's asynchronous runs: Local-SGD with the async paper's task scheduler and grace
period (arXiv 2401.09135, Alg. 2), and the naive baselines it is compared with.

Workers run phases back to back; a phase's result is delivered at its virtual finish time, in
order of (finish, worker index). The first arrival opens a grace window, the longer of `grace_s`
and `grace_share` of a phase (H at the fastest speed); everyone arriving inside it joins the
group. `dn`/`dn-dylu` hand each group to Delayed Nesterov as (sum, count), as a swarm's
all-reduce group does; the naive baselines (`async`, `async-poly`, `async-polythres`,
`async-buffer`) apply each contribution on its own as the paper's server does. When the group
closes, its all-reduce takes `comm_s`; blocking, its workers start their next phase from the new
θ_global after it; overlapped (ALGORITHMS §1.1), each started its next phase when its own ended
and folds θ_global in when the all-reduce is done.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from diloco_peer.coordinator_free.dylu import dylu_phase_s, dylu_steps
from diloco_peer.coordinator_free.sampler import ShardSampler
from diloco_peer.peer.inner import Schedule
from diloco_peer.sim.contributions import mean_pairwise_cosine, plain_sum, uploaded
from diloco_peer.sim.worker import (
    LastGroup,
    Worker,
    eager_start,
    overlapped_phase,
    proxy_start,
    steps_before,
)

if TYPE_CHECKING:
    from diloco_peer.sim.simulator import Simulator

GROUPED_ALGOS = ("dn", "dn-dylu")
"""Algorithms that apply a grace-period group as one all-reduced contribution."""


class AsyncRun:
    """One asynchronous run on `sim`'s model, data and virtual clock; `run()` returns the
    algorithm's part of the result document."""

    def __init__(self, sim: Simulator) -> None:
        spec, r = sim.spec, sim.run_spec
        self.sim, self.spec, self.run_spec = sim, spec, r
        self.algo = spec.algo
        shards = sim.shards(r.num_shards or spec.workers)
        self.streams = sim.streams(shards)
        self.sizes = [len(s) for s in shards]
        self.schedules = [Schedule.for_shard(r) for _ in shards]
        self.shard_steps, self.shard_samples = [0] * len(shards), [0] * len(shards)
        self.sampler = ShardSampler(self.sizes, seed=r.seed)
        self.workers = sim.new_workers(spec.workers)
        self.n_buffer = r.dn_buffer_size or spec.workers
        if self.algo in GROUPED_ALGOS:
            self.outer = sim.outer_optimizer("delayed-nesterov", buffer_size=self.n_buffer)
        else:
            self.outer = sim.outer_optimizer(r.outer_optimizer)
        self.buffer: list[list[torch.Tensor]] = []
        self.version = 0  # contributions applied so far; staleness is measured in these
        self.assigned, self.updates, self.dropped = 0, 0, 0
        self.staleness: list[int] = []
        self.last_fold = 0.0  # when the last group's all-reduce is done
        # The eager rule's guess of a group's size: every worker (what DyLU aims at).
        self.eager_n = spec.workers
        self.last = LastGroup()  # the `proxy` rule's memory of the last group applied

    def run(self) -> dict[str, Any]:
        """Deliver phases in virtual-time order until the step budget is spent."""
        for w in self.workers:
            self._start(w, 0.0, 0.0)
        group: list[Worker] = []
        window_open = math.inf  # arrival time of the group's first member
        grace_s = 0.0  # the open window's length
        while True:
            running = [w for w in self.workers if w.finish < math.inf]
            nxt = min(running, key=lambda w: (w.finish, w.index), default=None)
            if nxt is not None and (not group or nxt.finish <= window_open + grace_s):
                # Arrives inside the grace window (or opens one).
                self.sim.now = nxt.finish
                if not group:
                    window_open, grace_s = nxt.finish, self._grace_s()
                nxt.free_at, nxt.finish = nxt.finish, math.inf
                group.append(nxt)
                if self.algo not in GROUPED_ALGOS:
                    with torch.no_grad():
                        self._apply_one(nxt)
                continue
            if not group:
                break
            close = min(window_open + grace_s, nxt.finish) if nxt else self.sim.now
            self._close_group(group, close)
            group, window_open = [], math.inf
        self.sim.now = max(self.sim.now, self.last_fold)
        return self._result()

    def _grace_s(self) -> float:
        """The grace window: the longer of grace_s and grace_share of a phase as DyLU sizes it
        (H at the fastest measured speed), as SwarmSettings.grace has it in a swarm."""
        speeds = {w.index: w.speed.steps_per_s or 1.0 for w in self.workers}
        phase_s = dylu_phase_s(speeds, self.run_spec.inner_steps) or 0.0
        return max(self.spec.grace_s, self.spec.grace_share * phase_s)

    def _steps(self, w: Worker) -> int:
        """The next phase's length: DyLU's share of H for `dn-dylu` (§2.3), else H."""
        if self.algo == "dn-dylu":
            speeds = {x.index: x.speed.steps_per_s or 1.0 for x in self.workers}
            return dylu_steps(speeds, self.run_spec.inner_steps)[w.index]
        return self.run_spec.inner_steps

    def _start(self, w: Worker, start: float, fold_at: float) -> None:
        """Run `w`'s next phase from virtual time `start` (on a shard the sampler picks), with
        the current θ_global folded in at `fold_at` (from the start when that is no later), and
        schedule its delivery; nothing when the step budget is spent."""
        r = self.run_spec
        left = self.spec.total_steps - self.assigned
        if left <= 0:
            return
        steps = min(self._steps(w), left)
        s = self.sampler.sample(self.shard_samples)
        self.shard_samples[s] += steps * r.batch_size
        self.assigned += steps
        stream = self.streams[s]
        w.phase = overlapped_phase(
            w.trainer, self.sim.theta, steps, steps_before(w.clock, start, fold_at, steps),
            lambda: [stream.next_batch()], self.schedules[s], self.shard_steps[s], w.start_from,
            self.sim.fold(),
        )  # fmt: skip
        self.shard_steps[s] += steps
        duration = w.clock.duration(steps)
        w.speed.update(steps, duration)
        w.busy_s += duration
        w.finish, w.base_version = max(start + duration, fold_at), self.version

    def _apply_one(self, w: Worker) -> None:
        """A naive baseline's server applies one contribution on arrival (or buffers it)."""
        stale = self.version - w.base_version
        self.staleness.append(stale)
        if self.algo == "async-polythres" and stale > self.spec.staleness_threshold:
            self.dropped += 1
            return
        delta = uploaded(w.phase.delta, self.run_spec)
        if self.algo in ("async-poly", "async-polythres"):
            delta = [t * (1 + stale) ** -0.5 for t in delta]
        self.version += 1
        if self.algo == "async-buffer":
            self.buffer.append(delta)
            if len(self.buffer) == self.n_buffer:
                self.outer.step(self.sim.theta, plain_sum(self.buffer), len(self.buffer))
                self.buffer.clear()
                self.updates += 1
            return
        self.outer.step(self.sim.theta, delta, 1)
        self.updates += 1

    def _close_group(self, group: list[Worker], close: float) -> None:
        """The grace window closes at virtual time `close`: `dn` applies the group as one
        contribution, its all-reduce done `comm_s` later; every member starts its next phase."""
        deltas = self.sim.with_term([w.phase.delta for w in group])
        cos = mean_pairwise_cosine(deltas)
        if cos is not None:
            self.sim.cosines.append(cos)
        if self.spec.overlap == "eager":  # from the state the group is applied to
            for w in group:
                w.start_from = eager_start(self.outer, self.sim.theta, w.phase.delta, self.eager_n)
        elif self.spec.overlap == "proxy":
            for w in group:
                w.start_from = proxy_start(
                    self.outer, self.sim.theta, w.index, w.phase.delta, self.eager_n, self.last
                )
            self.last.record(group, deltas)
        if self.algo in GROUPED_ALGOS:
            self.staleness.extend(self.version - w.base_version for w in group)
            self.sim.group_step(self.outer, deltas)
            self.version += len(group)
            self.updates += 1
        self.sim.now = max(self.sim.now, close)
        self.last_fold = self.sim.now + self.spec.comm_s
        self.sim.progress(sum(w.phase.steps for w in group), at=self.last_fold)
        for w in group:
            w.phase = None
            start = self.last_fold  # blocking
            if self.spec.overlap != "none":
                start = w.free_at if self.spec.overlap_from == "phase" else self.sim.now
            self._start(w, start, self.last_fold)

    def _result(self) -> dict[str, Any]:
        total_samples = sum(self.shard_samples) or 1
        return {
            "outer_updates": self.updates,
            "dropped_contributions": self.dropped,
            "idle_fraction": self.sim.idle([w.busy_s for w in self.workers]),
            "mean_staleness": sum(self.staleness) / max(1, len(self.staleness)),
            "max_staleness": max(self.staleness, default=0),
            "shard_share": [n / total_samples for n in self.shard_samples],
            "data_share": [s / sum(self.sizes) for s in self.sizes],
        }
