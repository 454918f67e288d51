"""Deterministic virtual-time simulator of DiLoCo and asynchronous Local-SGD.

Real training (the same model, data, inner loop and outer optimizers a peer uses), fake clocks:
each worker's inner steps take the virtual time of its device profile (ALGORITHMS §2.8), so the
papers' wall-clock experiments run on one CPU, reproducibly. Communication time is not modelled.

Because a local phase depends only on the θ it starts from, a worker's phase is computed when it
starts and its result is delivered at its virtual finish time. Ties are broken by worker index.

Compression (RunSpec.compression, RunSpec.prune_fraction) costs what it costs a swarm: a group of
two or more (a sync round, a `dn` grace-period group) is averaged by `all_reduce_in_memory`, the
swarm's own part split, codec and reduction (each δ pruned, each part encoded and decoded, the
average encoded and decoded once more); a group of one is applied as it is, as a lone swarm peer
applies its own δ. The naive async baselines, whose server applies each contribution alone, get
each δ pruned, encoded and decoded once (the upload). With `none` and no pruning nothing changes.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_peer.averaging.compression import prune, round_trip
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.reference import all_reduce_in_memory
from diloco_peer.config import SimSpec
from diloco_peer.coordinator_free.dylu import SpeedMeter, dylu_steps
from diloco_peer.coordinator_free.sampler import ShardSampler
from diloco_peer.peer.checkpoint import load_into_model, load_model_checkpoint
from diloco_peer.peer.data import (
    ShardStream,
    TokenDataset,
    build_dataset,
    iid_shards,
    kmeans_shards,
    sequence_features,
)
from diloco_peer.peer.inner import InnerTrainer, PhaseResult, Schedule, evaluate_loss, perplexity
from diloco_peer.peer.model import Transformer, build_model
from diloco_peer.sim.profiles import StepClock, step_seconds

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
ASYNC_ALGOS = ("async", "async-poly", "async-polythres", "async-buffer", "dn", "dn-dylu")


@dataclass
class _Worker:
    index: int
    trainer: InnerTrainer
    clock: StepClock
    speed: SpeedMeter = field(default_factory=SpeedMeter)
    busy_s: float = 0.0
    finish: float = math.inf  # virtual time the running phase ends; inf when not running
    start: float = 0.0
    base_version: int = 0
    shard: int = 0
    phase: PhaseResult | None = None
    keep_local: bool = False  # its last contribution was dropped: continue from local θ


def mean_pairwise_cosine(deltas: Sequence[Sequence[torch.Tensor]]) -> float | None:
    """Mean pairwise cosine similarity of flattened pseudo-gradients (DiLoCo Fig. 10)."""
    if len(deltas) < 2:
        return None
    flat = torch.stack([torch.cat([t.flatten() for t in d]) for d in deltas]).double()
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    gram = unit @ unit.T
    m = len(deltas)
    return float((gram.sum() - gram.diagonal().sum()) / (m * (m - 1)))


def active_workers(schedule: str, workers: int, progress: float) -> int:
    """Workers active at a point of the run (DiLoCo Fig. 7); progress in [0, 1)."""
    half = max(1, workers // 2)
    if schedule == "doubling":
        return half if progress < 0.5 else workers
    if schedule == "halving":
        return workers if progress < 0.5 else half
    if schedule == "ramp-up":
        return min(workers, 1 + int(progress * workers))
    if schedule == "ramp-down":
        return max(1, workers - int(progress * workers))
    return workers


class Simulator:
    """One simulated run. `run()` returns the JSON-ready result document."""

    def __init__(self, spec: SimSpec, on_progress: ProgressFn | None = None) -> None:
        self.spec = spec
        self.run_spec = spec.run
        self.on_progress = on_progress or (lambda done, total: None)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        torch.manual_seed(self.run_spec.seed)
        r = self.run_spec
        self.data: TokenDataset = build_dataset(
            r.data, r.tokenizer, r.seq_len, r.val_sequences, r.max_tokens, r.seed
        )
        self.model = self._initial_model()
        # θ_global: the global model's parameters, fp32 on CPU, updated in place by the outer step.
        self.theta = [p.data for p in self.model.parameters()]
        self.initial_ppl = self.eval_ppl()
        self.curve: list[dict[str, float]] = []
        self.cosines: list[float] = []
        self.eval_every = spec.eval_every or max(1, spec.total_steps // 20)
        self._next_eval = self.eval_every
        # Local steps spent so far (counted when their phase is delivered, even if its
        # contribution is then dropped): the x axis of the curve and the budget.
        self.local_steps = 0
        self.now = 0.0

    # ----- setup -----

    def _new_model(self) -> Transformer:
        r = self.run_spec
        return build_model(r.model, self.data.vocab_size, r.seed, max_seq_len=r.seq_len)

    def _initial_model(self) -> Transformer:
        model = self._new_model()
        if self.spec.init:
            ckpt = load_model_checkpoint(self.spec.init)
            load_into_model(model, ckpt, self.spec.init)
        if self.spec.pretrain_steps:
            # The papers' shared start: plain AdamW on all the data, warm-up then constant lr.
            trainer = InnerTrainer(model, self.run_spec)
            stream = ShardStream(
                self.data.train,
                torch.arange(len(self.data.train)),
                self.run_spec.batch_size,
                seed=self.run_spec.seed + 7919,
            )
            schedule = Schedule.for_run(self.run_spec, self.spec.pretrain_steps, decay=False)
            trainer.train(self.spec.pretrain_steps, lambda: [stream.next_batch()], schedule, 0)
        return model

    def _shards(self, count: int) -> list[torch.Tensor]:
        n = len(self.data.train)
        if self.run_spec.shards == "iid":
            return iid_shards(n, count, self.run_spec.seed)
        features = sequence_features(self.model, self.data.train)
        return kmeans_shards(features, count, self.run_spec.seed)

    def _streams(self, shards: Sequence[torch.Tensor]) -> list[ShardStream]:
        return [
            ShardStream(self.data.train, idx, self.run_spec.batch_size, seed=self.run_spec.seed + s)
            for s, idx in enumerate(shards)
        ]

    def _workers(self, count: int) -> list[_Worker]:
        seconds = step_seconds(self.spec.heterogeneity, count)
        workers = []
        for i in range(count):
            trainer = InnerTrainer(self._new_model(), self.run_spec)
            clock = StepClock(seconds[i], self.spec.jitter, seed=self.run_spec.seed * 1000 + i)
            worker = _Worker(index=i, trainer=trainer, clock=clock)
            # A one-step probe gives DyLU a first speed estimate before any phase has run.
            worker.speed.update(1, seconds[i])
            workers.append(worker)
        return workers

    # ----- bookkeeping -----

    def eval_ppl(self) -> float:
        return perplexity(evaluate_loss(self.model, self.data.val))

    def _progress(self, steps: int) -> None:
        self.local_steps += steps
        self.on_progress(self.local_steps, self.spec.total_steps)
        if self.local_steps >= self._next_eval:
            self._record()
            while self._next_eval <= self.local_steps:
                self._next_eval += self.eval_every

    def _record(self) -> None:
        point = {"local_steps": self.local_steps, "sim_time": self.now, "ppl": self.eval_ppl()}
        if not self.curve or self.curve[-1]["local_steps"] != self.local_steps:
            self.curve.append(point)

    # ----- algorithms -----

    def run(self) -> dict[str, Any]:
        algo = self.spec.algo
        extra: dict[str, Any]
        if algo == "single":
            extra = self._run_single()
        elif algo == "ddp":
            extra = self._run_ddp()
        elif algo == "sync":
            extra = self._run_sync()
        else:
            extra = self._run_async()
        self._record()
        return {
            "algo": algo,
            "final_ppl": self.curve[-1]["ppl"],
            "initial_ppl": self.initial_ppl,
            "sim_time": self.now,
            "local_steps": self.local_steps,
            "curve": self.curve,
            "cosine_similarity": self.cosines,
            **extra,
            "config": self.spec.to_dict(),
        }

    def _run_single(self) -> dict[str, Any]:
        """One worker (device 0's speed), the run's batch, total_steps AdamW steps."""
        trainer = InnerTrainer(self.model, self.run_spec)
        stream = self._streams([torch.arange(len(self.data.train))])[0]
        clock = StepClock(
            step_seconds(self.spec.heterogeneity, 1)[0],
            self.spec.jitter,
            seed=self.run_spec.seed * 1000,
        )
        schedule = Schedule.for_run(self.run_spec, self.spec.total_steps)
        done = 0
        while done < self.spec.total_steps:
            chunk = min(self.eval_every, self.spec.total_steps - done)
            trainer.train(chunk, lambda: [stream.next_batch()], schedule, done)
            self.now += clock.duration(chunk)
            done += chunk
            self._progress(chunk)
        return {"outer_updates": 0, "idle_fraction": [0.0]}

    def _run_ddp(self) -> dict[str, Any]:
        """Synchronous data parallel: every step averages all workers' gradients (k× batch);
        the slowest worker sets the pace."""
        k = self.spec.workers
        trainer = InnerTrainer(self.model, self.run_spec)
        streams = self._streams(self._shards(self.run_spec.num_shards or k))
        seconds = step_seconds(self.spec.heterogeneity, k)
        clocks = [
            StepClock(s, self.spec.jitter, seed=self.run_spec.seed * 1000 + i)
            for i, s in enumerate(seconds)
        ]
        updates = self.spec.total_steps // k
        schedule = Schedule.for_run(self.run_spec, updates)
        busy = [0.0] * k
        done = 0
        while done < updates:
            chunk = min(max(1, self.eval_every // k), updates - done)
            trainer.train(chunk, lambda: [s.next_batch() for s in streams[:k]], schedule, done)
            for _ in range(chunk):
                times = [c.duration(1) for c in clocks]
                self.now += max(times)
                busy = [b + t for b, t in zip(busy, times, strict=True)]
            done += chunk
            self._progress(chunk * k)
        return {"outer_updates": 0, "idle_fraction": self._idle(busy)}

    def _idle(self, busy: Sequence[float]) -> list[float]:
        return [max(0.0, 1 - b / self.now) if self.now > 0 else 0.0 for b in busy]

    def _outer(self, name: str, buffer_size: int = 1) -> Any:
        r = self.run_spec
        extra: dict[str, Any] = {}
        if name == "delayed-nesterov":
            extra = {"buffer_size": buffer_size, "c": r.dn_c}
        return build_outer_optimizer(name, lr=r.outer_lr, momentum=r.outer_momentum, **extra)

    def _sum(self, deltas: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.stack(ts).sum(0) for ts in zip(*deltas, strict=True)]

    @property
    def _lossy_wire(self) -> bool:
        return self.run_spec.compression != "none" or self.run_spec.prune_fraction > 0

    def _sent(self, delta: Sequence[torch.Tensor]) -> torch.Tensor:
        """One contribution as a peer sends it: its tensors pruned, then flattened (fp32)."""
        flat = [t.detach().reshape(-1).to(torch.float32) for t in delta]
        if self.run_spec.prune_fraction > 0:
            flat = [prune(t, self.run_spec.prune_fraction) for t in flat]
        return torch.cat(flat)

    def _group_sum(self, deltas: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """Σ δ of a group as a swarm applies it: count × the all-reduced average (what
        ReplicatedState.apply hands the outer optimizer; equal weights, as the simulator's mean
        has), or the plain sum without compression."""
        if not self._lossy_wire or len(deltas) < 2:
            return self._sum(deltas)
        shapes = [t.shape for t in deltas[0]]
        sent = [self._sent(d) for d in deltas]
        average = all_reduce_in_memory(sent, [1.0] * len(deltas), self.run_spec.compression)
        parts = average.split([math.prod(shape) for shape in shapes])
        return [a.view(shape) * len(deltas) for a, shape in zip(parts, shapes, strict=True)]

    def _uploaded(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """One contribution as a server receives it (the naive async baselines)."""
        if not self._lossy_wire:
            return delta
        shapes = [t.shape for t in delta]
        flat = round_trip(self._sent(delta), self.run_spec.compression)
        parts = flat.split([math.prod(shape) for shape in shapes])
        return [a.view(shape) for a, shape in zip(parts, shapes, strict=True)]

    def _run_sync(self) -> dict[str, Any]:
        """DiLoCo (ALGORITHMS §1): rounds of H steps on every active worker, then one outer step
        on the average of the contributions that arrived."""
        spec, r = self.spec, self.run_spec
        k = spec.workers
        shards = self._shards(r.num_shards or k)
        streams = self._streams(shards)
        horizon = r.schedule_steps or spec.total_steps // len(shards)
        schedules = [Schedule.for_run(r, horizon) for _ in shards]
        shard_steps = [0] * len(shards)
        workers = self._workers(k)
        outer = self._outer(r.outer_optimizer, buffer_size=r.dn_buffer_size or k)
        drop_rng = random.Random(r.seed + 104729)
        assigned, updates, dropped = 0, 0, 0
        while assigned < spec.total_steps:
            m = active_workers(spec.compute_schedule, k, assigned / spec.total_steps)
            steps = min(r.inner_steps, (spec.total_steps - assigned) // m)
            if steps < 1:
                break
            arrived, durations = [], []
            for w in workers[:m]:
                s = w.index % len(shards)
                phase = w.trainer.run_phase(
                    self.theta,
                    steps,
                    lambda s=s: [streams[s].next_batch()],
                    schedules[s],
                    shard_steps[s],
                    from_local=w.keep_local,
                )
                shard_steps[s] += steps
                durations.append(w.clock.duration(steps))
                w.keep_local = spec.drop_prob > 0 and drop_rng.random() < spec.drop_prob
                if w.keep_local:
                    dropped += 1
                else:
                    arrived.append(phase.delta)
            round_s = max(durations)
            for w, d in zip(workers[:m], durations, strict=True):
                w.busy_s += d
            self.now += round_s
            assigned += steps * m
            if arrived:
                cos = mean_pairwise_cosine(arrived)
                if cos is not None:
                    self.cosines.append(cos)
                with torch.no_grad():
                    outer.step(self.theta, self._group_sum(arrived), len(arrived))
                updates += 1
            self._progress(steps * m)
        return {
            "outer_updates": updates,
            "dropped_contributions": dropped,
            "idle_fraction": self._idle([w.busy_s for w in workers]),
        }

    def _run_async(self) -> dict[str, Any]:
        """Asynchronous Local-SGD with the paper's task scheduler and grace period (Alg. 2).

        `dn`/`dn-dylu` hand each grace-period group to Delayed Nesterov as (sum, count), as a
        swarm's all-reduce group does; the naive baselines apply each contribution on its own
        as the paper's server does."""
        spec, r = self.spec, self.run_spec
        algo, k = spec.algo, spec.workers
        shards = self._shards(r.num_shards or k)
        streams = self._streams(shards)
        sizes = [len(s) for s in shards]
        horizon = r.schedule_steps or spec.total_steps // len(shards)
        schedules = [Schedule.for_run(r, horizon) for _ in shards]
        shard_steps, shard_samples = [0] * len(shards), [0] * len(shards)
        sampler = ShardSampler(sizes, seed=r.seed)
        workers = self._workers(k)
        n_buffer = r.dn_buffer_size or k
        if algo in ("dn", "dn-dylu"):
            outer = self._outer("delayed-nesterov", buffer_size=n_buffer)
        else:
            outer = self._outer(r.outer_optimizer)
        buffer: list[list[torch.Tensor]] = []
        version = 0  # contributions applied so far; staleness is measured in these
        assigned, updates, dropped = 0, 0, 0
        staleness: list[int] = []

        def start(w: _Worker, now: float) -> None:
            nonlocal assigned
            left = spec.total_steps - assigned
            if left <= 0:
                return
            if algo == "dn-dylu":
                speeds = {x.index: x.speed.steps_per_s or 1.0 for x in workers}
                steps = dylu_steps(speeds, r.inner_steps)[w.index]
            else:
                steps = r.inner_steps
            steps = min(steps, left)
            s = sampler.sample(shard_samples)
            shard_samples[s] += steps * r.batch_size
            assigned += steps
            w.phase = w.trainer.run_phase(
                self.theta, steps, lambda: [streams[s].next_batch()], schedules[s], shard_steps[s]
            )
            shard_steps[s] += steps
            duration = w.clock.duration(steps)
            w.speed.update(steps, duration)
            w.busy_s += duration
            w.start, w.finish, w.base_version, w.shard = now, now + duration, version, s

        def apply_one(w: _Worker) -> None:
            nonlocal version, updates, dropped
            stale = version - w.base_version
            staleness.append(stale)
            if algo == "async-polythres" and stale > spec.staleness_threshold:
                dropped += 1
                return
            delta = self._uploaded(w.phase.delta)
            if algo in ("async-poly", "async-polythres"):
                delta = [t * (1 + stale) ** -0.5 for t in delta]
            version += 1
            if algo == "async-buffer":
                buffer.append(delta)
                if len(buffer) == n_buffer:
                    outer.step(self.theta, self._sum(buffer), len(buffer))
                    buffer.clear()
                    updates += 1
                return
            outer.step(self.theta, delta, 1)
            updates += 1

        for w in workers:
            start(w, 0.0)
        group: list[_Worker] = []
        window_open = math.inf  # arrival time of the group's first member
        while True:
            running = [w for w in workers if w.finish < math.inf]
            nxt = min(running, key=lambda w: (w.finish, w.index), default=None)
            if nxt is not None and (not group or nxt.finish <= window_open + spec.grace_s):
                # Arrives inside the grace window (or opens one).
                self.now = nxt.finish
                window_open = min(window_open, nxt.finish)
                nxt.finish = math.inf
                group.append(nxt)
                with torch.no_grad():
                    if algo not in ("dn", "dn-dylu"):
                        apply_one(nxt)
                continue
            if not group:
                break
            close = min(window_open + spec.grace_s, nxt.finish) if nxt else self.now
            deltas = [w.phase.delta for w in group]
            cos = mean_pairwise_cosine(deltas)
            if cos is not None:
                self.cosines.append(cos)
            if algo in ("dn", "dn-dylu"):
                staleness.extend(version - w.base_version for w in group)
                with torch.no_grad():
                    outer.step(self.theta, self._group_sum(deltas), len(group))
                version += len(group)
                updates += 1
            self.now = max(self.now, close)
            self._progress(sum(w.phase.steps for w in group))
            for w in group:
                w.phase = None
                start(w, self.now)
            group, window_open = [], math.inf
        total_samples = sum(shard_samples) or 1
        return {
            "outer_updates": updates,
            "dropped_contributions": dropped,
            "idle_fraction": self._idle([w.busy_s for w in workers]),
            "mean_staleness": sum(staleness) / max(1, len(staleness)),
            "max_staleness": max(staleness, default=0),
            "shard_share": [n / total_samples for n in shard_samples],
            "data_share": [s / sum(sizes) for s in sizes],
        }
