"""One local phase (DESIGN §3 steps 2-3): plan its steps and shards, train from θ_global, return
the pseudo-gradient δ = θ_global − θ_local with the samples it trained per shard.

Plan: H steps in sync mode, DyLU (Eq. 6) over the speeds live peers publish in async mode (a
peer without a measured speed first runs a short probe phase); each step goes to the shard
furthest below its share (Eq. 2's terms, filled exactly by `fill_shards`), counting what the
others have in flight. Async: the phase publishes when it should end (`Activity.eta`), and
rather than idle until peers expected within the grace period arrive, it keeps training; it also
trains on until the time it was planned to take (its steps at the speed it planned them with:
DyLU sizes phases to end together, and a speed measured low, as a 3-step probe's often is,
would end it early, alone), and, when its group formed without it, until the next group's
phases end, so that it meets that group rather than apply its δ alone.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from hivemind.utils import get_dht_time

from diloco_peer.averaging.fragments import fragment_parts
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import DEFAULT_SHARDS, RunSpec, SwarmSettings
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.dylu import dylu_steps
from diloco_peer.coordinator_free.sampler import fill_shards
from diloco_peer.coordinator_free.swarm_view import SwarmView, phase_steps, probe_steps
from diloco_peer.errors import BadInput
from diloco_peer.peer.data import ShardStream, TokenDataset, build_dataset, iid_shards
from diloco_peer.peer.delta import Contribution
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.inner import (
    InnerTrainer,
    Schedule,
    evaluate_loss,
    perplexity,
    prepare_replica,
)
from diloco_peer.peer.model import build_model, resolve_device
from diloco_peer.peer.telemetry import Counters
from diloco_peer.peer_spec import PeerSpec

ETA_REFRESH_S = 1.0
"""Async: how often (at most) a training peer re-checks its phase's end and the extension loop
re-reads the others' (`_refresh_eta`, `_extend`)."""
ETA_DRIFT_S = 0.5
"""Async: a phase's end moved by more than this is published again."""
REJOIN_SHARE = 1.0
"""Async: a phase that has trained its steps trains on (at most as many again) until the other
peers' phases end, for those ending up to this share of a phase after the grace period too
(`_expected_until`): a peer whose group formed without it then meets the next group, where it
applied its δ alone before (netlab: lone commits and groups out of step; ALGORITHMS §2.3)."""


class StopRequested(Exception):
    """Raised inside the inner loop when SIGINT/SIGTERM asked the peer to stop."""


class PhasePaused(Exception):
    """SIGUSR1 asked the peer to pause mid-phase, or the round an overlapped phase folded in
    reached the run's end; carries what the phase did so far (kept: contributed after the
    pause, stale, not lost; at the run's end it stays in the ledger as a blocking peer's last
    δ does)."""

    def __init__(self, partial: Contribution) -> None:
        super().__init__(partial.steps)
        self.partial = partial


class _Pause(Exception):
    """Inside the inner loop: a pause after `steps` steps of the phase."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.steps = steps


@dataclass
class Training:
    """What one machine trains with: data, shards and their streams, the model and its inner
    optimizer, the replicated state, and a CPU model that holds θ_global for evaluation."""

    data: TokenDataset
    device: torch.device
    trainer: InnerTrainer
    shards: list[Any]
    streams: list[ShardStream]
    schedule: Schedule
    state: ReplicatedState
    eval_model: torch.nn.Module

    def eval_ppl(self) -> float:
        """Held-out perplexity of θ_global."""
        with torch.no_grad():
            for p, t in zip(self.eval_model.parameters(), self.state.theta, strict=True):
                p.copy_(t)
        return perplexity(evaluate_loss(self.eval_model, self.data.val))

    def grace_s(self, swarm: SwarmSettings, view: SwarmView) -> float:
        """Async: the grace period now, around a phase as DyLU sizes it (SwarmView.phase_s)."""
        speed = self.trainer.speed.steps_per_s
        return swarm.grace(view.phase_s(speed, self.trainer.spec.inner_steps))


def build_training(
    run: RunSpec, swarm: SwarmSettings, spec: PeerSpec, peer_id: str, manifest_digest: str
) -> Training:
    """The data, model, trainer and replicated state of `run` on this machine."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    data = build_dataset(
        spec.data or run.data, run.tokenizer, run.seq_len, run.val_sequences, run.max_tokens,
        run.seed,
    )  # fmt: skip
    device = resolve_device(spec.device)
    init = build_model(run.model, data.vocab_size, run.seed, max_seq_len=run.seq_len)
    model = build_model(run.model, data.vocab_size, run.seed, run.seq_len)
    micro = prepare_replica(
        model, run, device, data.vocab_size, micro_batch_size=spec.micro_batch_size,
        gpu_memory_fraction=spec.gpu_memory_fraction,
    )  # fmt: skip
    trainer = InnerTrainer(model, run, device, micro_batch_size=micro or None)
    num_shards = run.num_shards or DEFAULT_SHARDS
    if spec.shard >= num_shards:
        raise BadInput(f"--shard {spec.shard} is out of range: the run has {num_shards}")
    shards = iid_shards(len(data.train), num_shards, run.seed)
    # Each peer walks each shard in its own order, so two peers never train the same batches;
    # a pinned shard is walked in its canonical order, the simulator's.
    salt = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")
    streams = [
        ShardStream(
            data.train,
            idx,
            run.batch_size,
            seed=run.seed + s if spec.shard == s else salt * 1000 + s,
        )  # fmt: skip
        for s, idx in enumerate(shards)
    ]
    outer = build_outer_optimizer(
        run.outer_optimizer, lr=run.outer_lr, momentum=run.outer_momentum,
        **({"buffer_size": run.dn_buffer_size or swarm.expected_peers or 1, "c": run.dn_c}
           if run.outer_optimizer == "delayed-nesterov" else {}),
    )  # fmt: skip
    parts = fragment_parts([n for n, _ in init.named_parameters()], swarm.fragments)
    state = ReplicatedState([p.detach() for p in init.parameters()], outer, num_shards,
                            manifest_digest, parts=parts)  # fmt: skip
    schedule = Schedule.for_shard(run)
    return Training(data, device, trainer, shards, streams, schedule, state, init)


def head_plan(plan: list[int], batch: int) -> dict[str, int]:
    """A phase's steps per shard as a head publishes them: samples per shard, the largest
    `records.MAX_PLAN_SHARDS` shards only."""
    top = sorted((n, s) for s, n in enumerate(plan) if n)[-records.MAX_PLAN_SHARDS :]
    return {str(s): n * batch for n, s in sorted(top, key=lambda x: x[1])}


class Folds(Protocol):
    """A round in flight whose θ_global a phase folds in (peer/overlap.py `Overlap`)."""

    def await_group(self) -> None: ...

    def begin_phase(self) -> bool: ...

    def poll(self) -> bool: ...

    def settle(self) -> None: ...

    def report(self, delta: list[torch.Tensor]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Controls:
    """How the rest of the peer steers a phase."""

    stop: threading.Event
    paused: threading.Event
    on_step: Callable[[int, int, float], None]
    """Progress: (steps done, steps planned, loss)."""
    publish_head: Callable[[], None]
    view: Callable[[], SwarmView]
    """The swarm as the last head read saw it."""
    run_ended: Callable[[], bool] = lambda: False
    """The run reached its end: an overlapped phase stops then (its round reached it), rather
    than train on for a δ nobody will apply."""


class Phase:
    """Plans and trains one local phase at a time (see the module docstring)."""

    def __init__(
        self,
        training: Training,
        *,
        run: RunSpec,
        swarm: SwarmSettings,
        me: str,
        pinned_shard: int,
        throttle: float,
        in_flight: Callable[[list[int], int], list[int]],
        activity: Activity,
        counters: Counters,
        controls: Controls,
        carried: Callable[[], list[torch.Tensor] | None] = lambda: None,
    ) -> None:
        self.t, self.run, self.swarm, self.me = training, run, swarm, me
        self.pinned_shard, self.throttle = pinned_shard, throttle
        self._in_flight, self.activity, self.counters = in_flight, activity, counters
        self.controls, self._carried = controls, carried
        self._last_step_t = 0.0
        self._eta_checked = 0.0  # perf_counter of the last _refresh_eta check
        self._compute_mark = 0.0  # perf_counter up to which compute_s counts this phase
        self._planned_end: float | None = None
        """Async: when (DHT time) this phase should end as planned: its steps at the speed it
        planned them with (`_announce`); it trains on until then (`_extend`; ALGORITHMS §2.3
        in docs/algorithms.md)."""

    # ----- planning

    @property
    def asynchronous(self) -> bool:
        return self.swarm.protocol == "async"

    def probe_steps(self) -> int:
        return probe_steps(self.run.inner_steps)

    def steps_of(self, view: SwarmView) -> dict[str, int]:
        """DyLU steps (Eq. 6) of this peer and of every live peer that published a speed."""
        speeds = view.speeds(self.t.trainer.speed.steps_per_s)
        return dylu_steps(speeds, self.run.inner_steps) if speeds else {}

    def plan_steps(self, view: SwarmView) -> int:
        """H in sync mode (H / fragments: a round per fragment), else DyLU over the speeds live
        peers publish, or a probe phase (at most 3 steps) until this peer has measured its own
        speed, so a slow device learns it is slow before it holds the others up."""
        steps = phase_steps(
            view, self.t.trainer.speed.steps_per_s, inner_steps=self.run.inner_steps,
            asynchronous=self.asynchronous,
        )  # fmt: skip
        return steps if self.asynchronous else max(1, steps // self.swarm.fragments)

    def unseen_steps(self, view: SwarmView, co_planners: list[str]) -> int:
        """Steps others plan at the same moment (SwarmView.unseen_steps)."""
        return view.unseen_steps(
            synchronous=not self.asynchronous,
            inner_steps=self.run.inner_steps // self.swarm.fragments,
            co_planners=co_planners, steps_of=self.steps_of(view) if self.asynchronous else {},
            probe_steps=self.probe_steps(),
        )  # fmt: skip

    def _shard_counts(self) -> list[int]:
        state = self.t.state
        return self._in_flight(
            list(state.shard_samples), state.version - self.swarm.staleness_limit
        )

    def plan_shards(self, steps: int, others: int = 0) -> list[int]:
        """Steps per shard: the pinned `--shard`, or each step to the shard furthest below its
        share, this phase taking its part of a fill shared with `others` steps planned at the
        same time."""
        if self.pinned_shard >= 0:
            plan = [0] * len(self.t.shards)
            plan[self.pinned_shard] = steps
            return plan
        rng = random.Random(f"{self.me}/{self.t.state.version}/{self.counters.rounds_done}")
        return fill_shards(
            [len(s) for s in self.t.shards], self._shard_counts(), steps, self.run.batch_size,
            rng, others=others,
        )  # fmt: skip

    # ----- training

    def train(
        self, steps: int, others: int = 0, overlap: Folds | None = None
    ) -> tuple[Contribution, float]:
        """One local phase of `steps` steps from the state's θ (one segment per shard, each at
        its shard's own lr step, Eq. 3); async may extend it. With a round in flight
        (`overlap`), from the local parameters, folding the round's θ_global in at the first
        step boundary after it ends (peer/overlap.py); else from θ − `carried()` (fragments'
        progress not yet synced, `Ledger.carried`). Returns the contribution and the mean loss.
        Raises PhasePaused or StopRequested."""
        if overlap is not None:  # `overlap_from = "group"`: the round's group is formed first
            overlap.await_group()
        plan = self.plan_shards(steps, others)
        done = [0] * len(plan)  # steps trained per shard in this phase
        self._last_step_t = time.perf_counter()
        phase_t0, offset = time.perf_counter(), [0]  # steps of the phase before the segment
        on_step = self._step_callback(steps, phase_t0, offset, overlap)
        if not self.counters.started_training:
            self.counters.t_first_train = time.time()
        self.activity.training = True
        self._announce(steps, plan)
        self._compute_mark = time.perf_counter()
        loss_sum = 0.0
        if overlap is None or not overlap.begin_phase():
            pending, theta = self._carried(), self.t.state.theta
            self.t.trainer.load_params(torch._foreach_sub(theta, pending) if pending else theta)
        try:
            for shard, count in enumerate(plan):
                if count == 0:
                    continue
                loss, _ = self.t.trainer.train(
                    count, self._batches(shard, done), self.t.schedule, self._shard_step(shard),
                    on_step=on_step,
                )  # fmt: skip
                loss_sum += loss * count
                offset[0] += count
        except _Pause as p:
            self._charge()
            self.activity.training = False
            if overlap is not None:
                overlap.settle()
            delta, base = self._delta(overlap), self.t.state.version
            self.activity.idle()
            raise PhasePaused(Contribution(delta, base, self._samples(done), p.steps)) from None
        except StopRequested:
            self.activity.training = False
            raise
        extra = self._extend(steps, done, on_step)
        if extra:
            loss_sum += extra[1] * extra[0]
            steps += extra[0]
        self._publish_end(get_dht_time(), later=False)
        self._charge()
        self.activity.training = False
        if overlap is not None:  # a round still in flight: wait for it, fold at the end
            overlap.settle()
        # the state the phase folded in (a blocking phase's: the one it started from)
        delta, base = self._delta(overlap), self.t.state.version
        # The eta (now past) and the plan stay in the head until the δ is applied or kept: a
        # head that catch-up publishes between the phase and the group search must not say
        # "not training", or a peer finishing at the same moment applies alone while this one
        # waits the grace period for it in vain (seen in the bench).
        self.counters.started_training = True
        return Contribution(delta, base, self._samples(done), steps), loss_sum / steps

    def _step_callback(
        self, steps: int, phase_t0: float, offset: list[int], overlap: Folds | None = None
    ) -> Callable[[int, float], None]:
        controls = self.controls

        def on_step(i: int, loss: float) -> None:
            if overlap is not None:
                overlap.poll()
            if offset[0] + i < steps and (controls.paused.is_set() or self._ended(overlap)):
                raise _Pause(offset[0] + i)
            if self.throttle > 1.0:  # emulate a slower device: pad the step just taken
                controls.stop.wait(
                    (self.throttle - 1.0) * (time.perf_counter() - self._last_step_t)
                )
            self._last_step_t = time.perf_counter()
            self._charge()
            self._refresh_eta(offset[0] + i, steps, phase_t0)
            controls.on_step(min(offset[0] + i, steps), steps, loss)
            if controls.stop.is_set():
                raise StopRequested

        return on_step

    def _ended(self, overlap: Folds | None) -> bool:
        """Overlapped: the round in flight (or just folded in) reached the run's end, so the
        rest of this phase would never be applied; it ends as a pause does (PhasePaused)."""
        return overlap is not None and not self.controls.stop.is_set() and self.controls.run_ended()

    def _delta(self, overlap: Folds | None) -> list[torch.Tensor]:
        """δ = θ_global − θ_local (as an overlapped fold reports it)."""
        delta = self.t.trainer.delta_from(self.t.state.theta)
        return delta if overlap is None else overlap.report(delta)

    def _charge(self) -> None:
        """Count the seconds trained since the last mark in `compute_s` (step by step, so that
        the round thread of an overlapped round reads it current)."""
        now = time.perf_counter()
        self.counters.compute_s += now - self._compute_mark
        self._compute_mark = now

    def _announce(self, steps: int, plan: list[int]) -> None:
        """Async: tell the swarm when this phase should end (async groups wait only for peers
        expected within the grace period) and which shards it trains."""
        speed = self.t.trainer.speed.steps_per_s
        self._planned_end = None
        if self.asynchronous and speed:
            self.activity.eta = self._planned_end = get_dht_time() + steps / speed
            self.activity.plan = head_plan(plan, self.run.batch_size)
            self.controls.publish_head()
            self._eta_checked = time.perf_counter()

    def _refresh_eta(self, done: int, planned: int, since: float) -> None:
        """Async: publish the phase's end again when the pace measured in this phase (steps
        `done` of `planned` since `since`) moved it by more than ETA_DRIFT_S: a peer sharing its
        device, or slowed by others, would otherwise be waited for at the wrong time. A phase
        ahead of its plan trains on to the planned end (`_extend`, at most `planned` steps more),
        so that stays its end."""
        now = time.perf_counter()
        if self.activity.eta is None or done < 2 or done >= planned:
            return
        if now - self._eta_checked < ETA_REFRESH_S:
            return
        self._eta_checked = now
        pace, dht_now = (now - since) / done, get_dht_time()
        new = dht_now + (planned - done) * pace
        if self._planned_end is not None and self._planned_end > new:
            new = min(self._planned_end, dht_now + (2 * planned - done) * pace)
        self._publish_end(new)

    def _publish_end(self, end: float, *, later: bool = True) -> None:
        """Async: publish `end` (DHT time) as this phase's end if it differs from the published
        one by more than ETA_DRIFT_S (`later` False: only if it is earlier). An end published
        from a slow stretch of the phase stays in the future after the phase is over: peers
        ending then saw nobody due and committed alone at the same moment (netlab, two peers
        whose phases ended 0.1 s apart)."""
        eta = self.activity.eta
        if not self.asynchronous or eta is None or abs(end - eta) <= ETA_DRIFT_S:
            return
        if later or end < eta:
            self.activity.eta = end
            self.controls.publish_head()

    def _batches(self, shard: int, done: list[int]) -> Callable[[], list[torch.Tensor]]:
        """The batch source of one shard for `InnerTrainer.train`; counts the steps it serves."""

        def next_batches() -> list[torch.Tensor]:
            done[shard] += 1
            return [self.t.streams[shard].next_batch()]

        return next_batches

    def _shard_step(self, shard: int) -> int:
        """The shard's own lr step (Eq. 3): the steps the state holds on it."""
        return self.t.state.shard_samples[shard] // self.run.batch_size

    def _samples(self, done: list[int]) -> dict[int, int]:
        return {s: n * self.run.batch_size for s, n in enumerate(done) if n}

    def _expected_until(self) -> float | None:
        """Async: the latest end of the other peers' phases that end within the grace period,
        or within REJOIN_SHARE of a phase after it: a peer whose phase ended after its group
        formed without it trains on to meet the group after it rather than apply alone, ending
        its last catch-up's seconds early where that group is at a later version (it must catch
        up first)."""
        view = self.controls.view()
        speed = self.t.trainer.speed.steps_per_s
        window = self.t.grace_s(self.swarm, view)
        window += REJOIN_SHARE * (view.phase_s(speed, self.run.inner_steps) or 0.0)
        return view.expected_until(get_dht_time(), window, self.counters.catch_up_s)

    def _extension_end(self) -> float | None:
        """Async: until when (DHT time) a phase that has trained its planned steps trains on:
        the later of the others' ends (`_expected_until`) and its own planned end."""
        ends = [t for t in (self._expected_until(), self._planned_end) if t is not None]
        return max(ends) if ends else None

    def _extend(
        self, planned: int, done: list[int], on_step: Callable[[int, float], None]
    ) -> tuple[int, float] | None:
        """Async: rather than idle until peers expected within the grace period arrive (or
        apply alone, when they are a phase ahead: `_expected_until`), keep training (at most as
        many steps again as planned) until the latest of them should be done, or until this
        phase's planned end if that is later, each extra step on the shard furthest below its
        share. Returns (extra steps, their mean loss), or None."""
        speed = self.t.trainer.speed.steps_per_s
        if not self.asynchronous or not speed:
            return None
        until = self._extension_end()
        if until is None:
            return None
        step_s, read = 1.0 / speed, time.perf_counter()
        self._publish_end(min(until, get_dht_time() + planned * step_s))
        counts = self._shard_counts()
        sizes = [len(s) for s in self.t.shards]
        rng = random.Random(f"{self.me}/{self.t.state.version}/{self.counters.rounds_done}/extend")
        extra, loss_sum = 0, 0.0
        while extra < planned and until is not None and get_dht_time() + step_s <= until:
            if self.pinned_shard >= 0:
                shard = self.pinned_shard
            else:
                mine = [c + d * self.run.batch_size for c, d in zip(counts, done, strict=True)]
                shard = fill_shards(sizes, mine, 1, self.run.batch_size, rng).index(1)
            step = self._shard_step(shard) + done[shard]
            loss, _ = self.t.trainer.train(
                1, self._batches(shard, done), self.t.schedule, step,
                on_step=lambda i, value: on_step(planned, value),
            )  # fmt: skip
            loss_sum += loss
            extra += 1
            if time.perf_counter() - read >= ETA_REFRESH_S:  # they may have arrived or slipped
                until, read = self._extension_end(), time.perf_counter()
                if until is not None:  # the end we now train to, within the bound
                    self._publish_end(min(until, get_dht_time() + (planned - extra) * step_s))
        return (extra, loss_sum / extra) if extra else None
