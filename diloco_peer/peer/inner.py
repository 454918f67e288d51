"""The inner loop: AdamW steps on one peer, returning the pseudo-gradient δ.

DiLoCo (ALGORITHMS §1): θ_local ← θ_global; H AdamW steps; δ = θ_global − θ_local. The AdamW
state stays on the peer across rounds and is never communicated. Learning rates follow a
warm-up + cosine schedule per data shard with a floor η_min (ALGORITHMS §2.6), because in async
mode nobody knows in advance how many steps a shard will get.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from diloco_peer.config import RunSpec
from diloco_peer.coordinator_free.dylu import SpeedMeter
from diloco_peer.errors import ConfigError
from diloco_peer.peer.model import autocast_context

log = logging.getLogger(__name__)

SHARD_SCHEDULE_STEPS = 10_000
"""T of each shard's cosine when the run sets none (`RunSpec.schedule_steps` 0), in a swarm (whose
length is open-ended) and in the simulator alike: one preset for both (issue 17). In the
simulator it beat a cosine over each shard's share of the budget for sync and DN + DyLU alike
(docs/results.md, the preset ablation)."""


@dataclass(kw_only=True, frozen=True)
class Schedule:
    """Warm-up + cosine with a floor, ALGORITHMS §2.6 (Async Local-SGD Eq. 3)."""

    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        # Clamped so a shard that runs past T stays at η_min instead of climbing back up.
        r = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1 + math.cos(math.pi * r))

    @classmethod
    def for_shard(cls, spec: RunSpec) -> Schedule:
        """A data shard's schedule: over the run's T, or SHARD_SCHEDULE_STEPS."""
        return cls.for_run(spec, spec.schedule_steps or SHARD_SCHEDULE_STEPS)

    @classmethod
    def for_run(cls, spec: RunSpec, total_steps: int, decay: bool = True) -> Schedule:
        """The run's schedule over `total_steps`; `decay=False` holds the peak after warm-up."""
        return cls(
            peak_lr=spec.inner_lr,
            min_lr=spec.inner_lr * spec.inner_min_lr_ratio if decay else spec.inner_lr,
            warmup_steps=spec.warmup_steps,
            total_steps=max(total_steps, spec.warmup_steps + 1),
        )


@dataclass(frozen=True)
class PhaseResult:
    """What one local phase produced."""

    delta: list[torch.Tensor]  # θ_start − θ_end, fp32 on CPU, one tensor per parameter
    steps: int
    samples: int
    mean_loss: float
    seconds: float  # measured wall-clock compute time


class InnerTrainer:
    """Owns one model replica and its AdamW state; runs local phases from a given θ."""

    def __init__(
        self,
        model: nn.Module,
        spec: RunSpec,
        device: torch.device | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.device = device or next(model.parameters()).device
        self.micro_batch_size = micro_batch_size or spec.batch_size
        if self.micro_batch_size <= 0:
            raise ConfigError(f"micro-batch size must be > 0, got {self.micro_batch_size}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=spec.inner_lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=spec.weight_decay,
        )
        self.speed = SpeedMeter()

    def load_params(self, theta: Sequence[torch.Tensor]) -> None:
        """θ_local ← θ_global (theta lives on CPU in fp32; the replica may live elsewhere)."""
        if len(theta) != len(self.params):
            raise ConfigError(f"expected {len(self.params)} tensors, got {len(theta)}")
        with torch.no_grad():
            for p, t in zip(self.params, theta, strict=True):
                p.copy_(t, non_blocking=True)

    @torch.no_grad()
    def rebase(
        self,
        new_global: Sequence[torch.Tensor],
        old_base: Sequence[torch.Tensor],
        keep: float = 1.0,
    ) -> None:
        """θ_local ← new_global + keep·(θ_local − old_base): the overlapped round's fold
        (ALGORITHMS §1.1). The progress made since `old_base` (× keep) is moved onto
        `new_global`; with `old_base` = `new_global` it is Streaming DiLoCo's merge."""
        for p, new, old in zip(self.params, new_global, old_base, strict=True):
            if keep == 1.0:
                p.add_((new.to(torch.float32) - old.to(torch.float32)).to(p.device, p.dtype))
            else:
                p.sub_(old.to(p.device, p.dtype)).mul_(keep).add_(new.to(p.device, p.dtype))

    def snapshot(self) -> list[torch.Tensor]:
        """The replica's current parameters as fp32 CPU tensors (copies)."""
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]

    @torch.no_grad()
    def delta_from(self, theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """δ = θ_global − θ_local (fp32, CPU): the pseudo-gradient of the replica as it stands."""
        return [
            t.to(torch.float32) - p.detach().to("cpu", torch.float32)
            for t, p in zip(theta, self.params, strict=True)
        ]

    def train_step(self, batches: Sequence[torch.Tensor], lr: float) -> float:
        """One optimizer step on the union of `batches` (each (b, T+1)); returns the mean loss.

        The union is cut into micro-batches and their gradients accumulated, so a small device
        reaches the run's batch size; each micro-batch loss is weighted by its share of samples.
        """
        self.model.train()
        chunks = [c for b in batches for c in b.split(self.micro_batch_size)]
        total = sum(c.shape[0] for c in chunks)
        loss_sum = 0.0
        for chunk in chunks:
            chunk = chunk.to(self.device, non_blocking=True)
            with autocast_context(self.device):
                loss = self.model.loss(chunk)
            (loss * (chunk.shape[0] / total)).backward()
            loss_sum += loss.item() * chunk.shape[0]
        if self.spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / total

    def train(
        self,
        steps: int,
        next_batches: Callable[[], Sequence[torch.Tensor]],
        schedule: Schedule,
        start_step: int,
        on_step: Callable[[int, float], None] | None = None,
    ) -> tuple[float, int]:
        """`steps` optimizer steps with lr from `schedule` at start_step, start_step+1, ...

        Returns (mean loss, samples). `on_step(i, loss)` is called after each step (progress).
        """
        t0 = time.perf_counter()
        loss_total, samples = 0.0, 0
        for i in range(steps):
            batches = next_batches()
            loss_total += self.train_step(batches, schedule.lr(start_step + i))
            samples += sum(b.shape[0] for b in batches)
            if on_step is not None:
                on_step(i + 1, loss_total / (i + 1))
        self.speed.update(steps, time.perf_counter() - t0)
        return loss_total / max(1, steps), samples

    def run_phase(
        self,
        theta: Sequence[torch.Tensor],
        steps: int,
        next_batches: Callable[[], Sequence[torch.Tensor]],
        schedule: Schedule,
        start_step: int,
        on_step: Callable[[int, float], None] | None = None,
        from_local: bool = False,
    ) -> PhaseResult:
        """One DiLoCo local phase from θ_global = `theta`; returns δ = θ_global − θ_local.

        `from_local=True` keeps the replica's own parameters as the starting point (a peer whose
        last contribution was dropped continues from its local θ, DiLoCo Fig. 8); δ is still
        measured against `theta`.
        """
        if steps < 1:
            raise ConfigError(f"a local phase needs at least one step, got {steps}")
        if not from_local:
            self.load_params(theta)
        t0 = time.perf_counter()
        loss, samples = self.train(steps, next_batches, schedule, start_step, on_step)
        delta = self.delta_from(theta)
        return PhaseResult(
            delta=delta,
            steps=steps,
            samples=samples,
            mean_loss=loss,
            seconds=time.perf_counter() - t0,
        )


def auto_micro_batch(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    reserve_bytes: int = 0,
) -> int:
    """The largest micro-batch (batch_size, batch_size/2, ..., 1) whose forward and backward
    fit the device's memory, with `reserve_bytes` held back (AdamW's moments, allocated later).

    Probes with random tokens and leaves no gradients behind. ConfigError if even one sequence
    does not fit."""
    size = batch_size
    while size >= 1:
        try:
            _probe(model, size, seq_len, vocab_size, device, reserve_bytes)
            return size
        except torch.cuda.OutOfMemoryError:
            size //= 2
        finally:
            for p in model.parameters():
                p.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    raise ConfigError("not even one sequence fits in the device's memory; use a smaller model")


def prepare_replica(
    model: nn.Module,
    run: RunSpec,
    device: torch.device,
    vocab_size: int,
    *,
    micro_batch_size: int,
    gpu_memory_fraction: float = 1.0,
) -> int:
    """Move `model` to `device` and pick its micro-batch; returns it (the run's batch size when
    `micro_batch_size` is 0).

    On CUDA, `gpu_memory_fraction` < 1 caps this process's share of the GPU's memory first, so
    `micro_batch_size=-1` ("auto") probes for the largest micro-batch within that cap, holding
    back room for AdamW's two moments. Elsewhere the fraction is ignored (with a warning) and
    "auto" is the run's batch size.
    """
    if device.type == "cuda" and gpu_memory_fraction < 1.0:
        # torch needs the device's index here ("cuda" alone raises ValueError)
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, index)
    elif gpu_memory_fraction < 1.0:
        log.warning("--gpu-memory-fraction applies to CUDA devices only; ignored on %s", device)
    model.to(device)
    if micro_batch_size != -1:
        return micro_batch_size or run.batch_size
    if device.type != "cuda":
        return run.batch_size
    # Held back while probing: AdamW's two moments, one more parameter-sized set for the
    # temporaries of its foreach update and of gradient clipping, and a tenth of the usable
    # memory for the allocator's fragmentation (measured on an H200: 150m under a 2.8 GiB cap
    # ran out of memory at its first step when only the moments were held back).
    index = device.index if device.index is not None else torch.cuda.current_device()
    usable = torch.cuda.get_device_properties(index).total_memory * gpu_memory_fraction
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return auto_micro_batch(
        model, run.batch_size, run.seq_len, vocab_size, device,
        reserve_bytes=3 * param_bytes + int(0.1 * usable),
    )  # fmt: skip


def _probe(
    model: nn.Module, size: int, seq_len: int, vocab_size: int, device: torch.device, reserve: int
) -> None:
    """One forward and backward of `size` sequences with `reserve` bytes held. A function of its
    own so that, when it runs out of memory, its tensors (the autograd graph too) die with its
    frame before the next, smaller try: as locals of the caller's loop they stayed alive during
    that try and made every smaller size fail as well (seen on an H200)."""
    held = torch.empty(reserve, dtype=torch.uint8, device=device) if reserve else None
    x = torch.randint(vocab_size, (size, seq_len + 1), device=device)
    with autocast_context(device):
        loss = model.loss(x)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del held


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    sequences: torch.Tensor,
    batch_size: int = 32,
    device: torch.device | None = None,
) -> float:
    """Mean next-token cross-entropy of `model` over packed `sequences` (n, T+1)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for chunk in sequences.split(batch_size):
            chunk = chunk.to(device)
            with autocast_context(device):
                loss = model.loss(chunk)
            total += loss.item() * chunk.shape[0]
            count += chunk.shape[0]
    finally:
        model.train(was_training)
    return total / max(1, count)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
