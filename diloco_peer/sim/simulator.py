"""Deterministic virtual-time simulator of DiLoCo and asynchronous Local-SGD.

Real training (the same model, data, inner loop and outer optimizers a peer uses), fake clocks:
each worker's inner steps take the virtual time of its device profile (ALGORITHMS §2.8), so the
papers' wall-clock experiments run on one CPU, reproducibly. An all-reduce takes `comm_s` virtual
seconds (0 by default); blocking rounds wait for it, overlapped ones (ALGORITHMS §1.1) train
through it.

Because a local phase depends only on the θ it starts from, a worker's phase is computed when it
starts and its result is delivered at its virtual finish time. Ties are broken by worker index.

This module holds the run's setup and bookkeeping and the synchronous algorithms (`single`,
`ddp`, `sync`); the asynchronous ones are in async_run.py, what happens to the δ of a group
(sum, compression, cosine) in contributions.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.config import SimSpec
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
from diloco_peer.peer.inner import InnerTrainer, Schedule, evaluate_loss, perplexity
from diloco_peer.peer.model import Transformer, build_model, resolve_device
from diloco_peer.sim.async_run import AsyncRun
from diloco_peer.sim.contributions import group_sum, mean_pairwise_cosine
from diloco_peer.sim.fragments import FragmentedSync, check_fragments
from diloco_peer.sim.profiles import StepClock, step_seconds
from diloco_peer.sim.worker import (
    Fold,
    LastGroup,
    Worker,
    eager_start,
    overlapped_phase,
    proxy_start,
    steps_before,
)

ProgressFn = Callable[[int, int], None]


@dataclass
class SyncShards:
    """A sync run's data: a seeded stream and an lr schedule per shard, the steps each
    schedule is at, the samples each shard gave, and where each phase goes: worker i on shard
    i (DiLoCo's placement) or, with more shards than workers (the built-in run's 8 for 4, where
    that placement leaves shards untrained), the shard Eq. 2 picks, as in the async runs."""

    streams: list[ShardStream]
    schedules: list[Schedule]
    sampler: ShardSampler | None
    steps: list[int]
    samples: list[int]

    def pick(self, index: int, steps: int, batch_size: int) -> int:
        """The shard worker `index`'s next phase of `steps` steps trains on (counted)."""
        s = index % len(self.streams) if self.sampler is None else self.sampler.sample(self.samples)
        self.samples[s] += steps * batch_size
        return s

    def share(self) -> list[float]:
        """Each shard's share of the samples trained on."""
        return [n / (sum(self.samples) or 1) for n in self.samples]


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

    def __init__(
        self, spec: SimSpec, on_progress: ProgressFn | None = None, device: str = "cpu"
    ) -> None:
        self.spec = spec
        # Where the replicas train and the global model is evaluated (`resolve_device`); CUDA
        # runs them under bf16 autocast, as a peer does, so its numbers differ from the CPU's.
        self.device = resolve_device(device)
        self._mirror: Transformer | None = None
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
        # bad input fails here, before any output
        check_fragments(spec, [n for n, _ in self.model.named_parameters()])
        # θ_global: the global model's parameters, fp32 on CPU (as a peer holds them), updated in
        # place by the outer step.
        self.theta = [p.data for p in self.model.parameters()]
        self.initial_ppl = self.eval_ppl()
        self.curve: list[dict[str, float]] = []
        self.cosines: list[float] = []
        self.damping: list[torch.Tensor] | None = None
        """`--overlap-term shared`: Δ − (θ_{v−1} − θ_v) of the last outer step."""
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

    def on_device(self, model: Transformer | None = None) -> Transformer:
        """`model` (the global model by default) where training runs: itself on CPU; elsewhere
        one device copy of it, reused. Training the copy leaves `model` as it was until
        `pull` copies the copy's parameters back."""
        model = self.model if model is None else model
        if self.device.type == "cpu":
            return model
        if self._mirror is None:
            self._mirror = self._new_model().to(self.device)
        self._mirror.load_state_dict(model.state_dict())
        return self._mirror

    @staticmethod
    @torch.no_grad()
    def pull(into: Transformer, trained: Transformer) -> None:
        """`into` ← `trained`'s parameters (nothing to do when they are one model)."""
        if trained is not into:
            for p, q in zip(into.parameters(), trained.parameters(), strict=True):
                p.copy_(q)

    def _initial_model(self) -> Transformer:
        model = self._new_model()
        if self.spec.init:
            ckpt = load_model_checkpoint(self.spec.init)
            load_into_model(model, ckpt, self.spec.init)
        if self.spec.pretrain_steps:
            # The papers' shared start: plain AdamW on all the data, warm-up then constant lr.
            trained = self.on_device(model)
            trainer = InnerTrainer(trained, self.run_spec)
            stream = ShardStream(
                self.data.train,
                torch.arange(len(self.data.train)),
                self.run_spec.batch_size,
                seed=self.run_spec.seed + 7919,
            )
            schedule = Schedule.for_run(self.run_spec, self.spec.pretrain_steps, decay=False)
            trainer.train(self.spec.pretrain_steps, lambda: [stream.next_batch()], schedule, 0)
            self.pull(model, trained)
        return model

    def shards(self, count: int) -> list[torch.Tensor]:
        """The training windows split into `count` shards, i.i.d. or k-means (DiLoCo §3)."""
        n = len(self.data.train)
        if self.run_spec.shards == "iid":
            return iid_shards(n, count, self.run_spec.seed)
        features = sequence_features(self.model, self.data.train)
        return kmeans_shards(features, count, self.run_spec.seed)

    def streams(self, shards: Sequence[torch.Tensor]) -> list[ShardStream]:
        """One seeded batch stream per shard."""
        return [
            ShardStream(self.data.train, idx, self.run_spec.batch_size, seed=self.run_spec.seed + s)
            for s, idx in enumerate(shards)
        ]

    def sync_shards(self, workers: int) -> SyncShards:
        """The data of a sync run of `workers` workers (`SyncShards`)."""
        r = self.run_spec
        shards = self.shards(r.num_shards or workers)
        streams, schedules = self.streams(shards), [Schedule.for_shard(r) for _ in shards]
        sampler = ShardSampler([len(x) for x in shards], r.seed) if len(shards) > workers else None
        return SyncShards(streams, schedules, sampler, [0] * len(shards), [0] * len(shards))

    def new_workers(self, count: int) -> list[Worker]:
        """`count` workers, each with its own replica and the clock of its device profile."""
        seconds = step_seconds(self.spec.heterogeneity, count)
        workers = []
        for i in range(count):
            trainer = InnerTrainer(self._new_model().to(self.device), self.run_spec)
            clock = StepClock(seconds[i], self.spec.jitter, seed=self.run_spec.seed * 1000 + i)
            worker = Worker(index=i, trainer=trainer, clock=clock)
            # A one-step probe gives DyLU a first speed estimate before any phase has run.
            worker.speed.update(1, seconds[i])
            workers.append(worker)
        return workers

    def outer_optimizer(self, name: str, buffer_size: int = 1) -> Any:
        """The run's outer optimizer `name` (Delayed Nesterov over `buffer_size` contributions)."""
        r = self.run_spec
        extra: dict[str, Any] = {}
        if name == "delayed-nesterov":
            extra = {"buffer_size": buffer_size, "c": r.dn_c}
        return build_outer_optimizer(name, lr=r.outer_lr, momentum=r.outer_momentum, **extra)

    def fold(self) -> Fold:
        """The overlapped phases' fold (`--overlap-fold`, `--overlap-keep`, `--overlap-term`)."""
        spec = self.spec
        return Fold(spec.overlap_fold, spec.overlap_keep, spec.overlap_term == "shared")

    def with_term(self, deltas: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """A group's δs as applied: with `--overlap-term shared`, each plus κ·(Δ − (θ_{v−1} −
        θ_v)) of the last outer step (the swarm's `common_term`, ALGORITHMS §1.1)."""
        if self.spec.overlap_term != "shared" or self.damping is None:
            return deltas
        keep, term = self.spec.overlap_keep, self.damping
        return [[d + keep * t for d, t in zip(delta, term, strict=True)] for delta in deltas]

    def group_step(
        self, outer: Any, deltas: list[list[torch.Tensor]], params: list[torch.Tensor] | None = None
    ) -> None:
        """One outer step on a group's δs (their sum as a swarm applies it, `group_sum`) to
        `params` (θ_global's tensors by default; a fragment's, ALGORITHMS §1.2); with
        `--overlap-term shared`, remember its damping (`with_term`)."""
        total = group_sum(deltas, self.run_spec)
        shared = self.spec.overlap_term == "shared"
        before = [t.clone() for t in self.theta] if shared else []
        average = [s / len(deltas) for s in total] if shared else []
        with torch.no_grad():
            outer.step(self.theta if params is None else params, total, len(deltas))
        if shared:
            self.damping = [
                a - (b - t) for a, b, t in zip(average, before, self.theta, strict=True)
            ]

    # ----- bookkeeping -----

    def eval_ppl(self) -> float:
        """Perplexity of the global model on the held-out windows."""
        return perplexity(evaluate_loss(self.on_device(), self.data.val))

    def progress(self, steps: int, at: float | None = None) -> None:
        """Count `steps` more local steps (delivered phases) and evaluate when one is due; the
        point's time is `at` (when the update is done everywhere), by default now."""
        self.local_steps += steps
        self.on_progress(self.local_steps, self.spec.total_steps)
        if self.local_steps >= self._next_eval:
            self._record(self.now if at is None else at)
            while self._next_eval <= self.local_steps:
                self._next_eval += self.eval_every

    def idle(self, busy: Sequence[float]) -> list[float]:
        """Each worker's idle share of the run's virtual time, from its busy seconds."""
        return [max(0.0, 1 - b / self.now) if self.now > 0 else 0.0 for b in busy]

    def _record(self, at: float | None = None) -> None:
        at = self.now if at is None else at
        point = {"local_steps": self.local_steps, "sim_time": at, "ppl": self.eval_ppl()}
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
        elif algo == "sync" and self.spec.fragments > 1:
            extra = FragmentedSync(self).run()
        elif algo == "sync":
            extra = self._run_sync()
        else:
            extra = AsyncRun(self).run()
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
        trained = self.on_device()
        trainer = InnerTrainer(trained, self.run_spec)
        stream = self.streams([torch.arange(len(self.data.train))])[0]
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
            self.pull(self.model, trained)
            self.now += clock.duration(chunk)
            done += chunk
            self.progress(chunk)
        return {"outer_updates": 0, "idle_fraction": [0.0]}

    def _run_ddp(self) -> dict[str, Any]:
        """Synchronous data parallel: every step averages all workers' gradients (k× batch);
        the slowest worker sets the pace."""
        k = self.spec.workers
        trained = self.on_device()
        trainer = InnerTrainer(trained, self.run_spec)
        streams = self.streams(self.shards(self.run_spec.num_shards or k))
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
            self.pull(self.model, trained)
            for _ in range(chunk):
                times = [c.duration(1) for c in clocks]
                self.now += max(times)
                busy = [b + t for b, t in zip(busy, times, strict=True)]
            done += chunk
            self.progress(chunk * k)
        return {"outer_updates": 0, "idle_fraction": self.idle(busy)}

    def _run_sync(self) -> dict[str, Any]:
        """DiLoCo (ALGORITHMS §1): rounds of H steps on every active worker, then one outer step
        on the average of the contributions that arrived, `comm_s` after the last phase ends.
        Blocking, every worker starts its next phase from the new θ_global once it exists;
        overlapped (ALGORITHMS §1.1), as soon as its own phase ends, folding θ_global in when
        the all-reduce is done."""
        spec, r = self.spec, self.run_spec
        k = spec.workers
        data = self.sync_shards(k)
        workers = self.new_workers(k)
        outer = self.outer_optimizer(r.outer_optimizer, buffer_size=r.dn_buffer_size or k)
        drop_rng = random.Random(r.seed + 104729)
        assigned, updates, dropped = 0, 0, 0
        last = LastGroup()  # the `proxy` rule's memory of the previous round
        while assigned < spec.total_steps:
            m = active_workers(spec.compute_schedule, k, assigned / spec.total_steps)
            steps = min(r.inner_steps, (spec.total_steps - assigned) // m)
            if steps < 1:
                break
            arrived = []
            for w in workers[:m]:
                s = data.pick(w.index, steps, r.batch_size)
                start = self.now if spec.overlap == "none" else w.free_at
                if spec.overlap != "none" and spec.overlap_from == "group":
                    start = max(start, self.now - spec.comm_s)  # the last phase's end
                fold_after = steps_before(w.clock, start, self.now, steps)
                # A dropped contribution's worker continues from its local θ (DiLoCo Fig. 8).
                phase = overlapped_phase(
                    w.trainer, self.theta, steps, -1 if w.keep_local else fold_after,
                    lambda s=s: [data.streams[s].next_batch()], data.schedules[s],
                    data.steps[s], w.start_from, self.fold(),
                )  # fmt: skip
                data.steps[s] += steps
                duration = w.clock.duration(steps)
                w.busy_s += duration
                w.free_at = max(start + duration, self.now)
                w.keep_local = spec.drop_prob > 0 and drop_rng.random() < spec.drop_prob
                if w.keep_local:
                    dropped += 1
                else:
                    arrived.append(phase.delta)
                if spec.overlap == "eager":  # overlap excludes drops: every δ arrives
                    w.start_from = eager_start(outer, self.theta, phase.delta, m)
                elif spec.overlap == "proxy":
                    w.start_from = proxy_start(outer, self.theta, w.index, phase.delta, m, last)
            self.now = max(w.free_at for w in workers[:m]) + spec.comm_s
            assigned += steps * m
            if arrived:
                arrived = self.with_term(arrived)
                cos = mean_pairwise_cosine(arrived)
                if cos is not None:
                    self.cosines.append(cos)
                self.group_step(outer, arrived)
                updates += 1
                if spec.overlap == "proxy":
                    last.record(workers[:m], arrived)
            self.progress(steps * m)
        return {
            "outer_updates": updates,
            "dropped_contributions": dropped,
            "idle_fraction": self.idle([w.busy_s for w in workers]),
            "shard_share": data.share(),
        }
