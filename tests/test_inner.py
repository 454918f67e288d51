"""The inner loop: the lr schedule's numbers, micro-batch accumulation, δ, evaluation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from diloco_peer.config import RunSpec
from diloco_peer.errors import ConfigError
from diloco_peer.peer.data import TokenDataset
from diloco_peer.peer.inner import InnerTrainer, Schedule, evaluate_loss, perplexity
from diloco_peer.peer.model import build_model

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 256


def _batch(n: int, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _trainer(run: RunSpec, seed: int = 0, micro_batch_size: int | None = None) -> InnerTrainer:
    model = build_model(run.model, VOCAB, seed=seed, max_seq_len=run.seq_len)
    return InnerTrainer(model, run, micro_batch_size=micro_batch_size)


def _const(lr: float) -> Schedule:
    return Schedule(peak_lr=lr, min_lr=lr, warmup_steps=0, total_steps=1)


# ----------------------------------------------------------------------------- schedule


def test_schedule_golden_values() -> None:
    s = Schedule(peak_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    # Linear warm-up reaches the peak on the last warm-up step: η·(step+1)/W.
    assert [s.lr(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
    # Cosine over the T−W = 10 remaining steps: η_min + ½(η−η_min)(1+cos πr).
    assert s.lr(4) == pytest.approx(1.0, abs=1e-12)  # r = 0
    assert s.lr(9) == pytest.approx(0.55, abs=1e-12)  # r = ½: midpoint of peak and floor
    assert s.lr(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)), abs=1e-12)
    assert s.lr(14) == pytest.approx(0.1, abs=1e-12)  # r = 1
    # Clamped past T: a shard that keeps going stays at the floor instead of climbing back.
    assert [s.lr(i) for i in (15, 24, 34, 1000)] == pytest.approx([0.1] * 4, abs=1e-12)


def test_schedule_is_monotone_after_warmup() -> None:
    s = Schedule(peak_lr=3e-3, min_lr=3e-4, warmup_steps=10, total_steps=100)
    lrs = [s.lr(i) for i in range(10, 150)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert min(lrs) == pytest.approx(3e-4)


def test_schedule_without_warmup_starts_at_peak() -> None:
    s = Schedule(peak_lr=2.0, min_lr=1.0, warmup_steps=0, total_steps=10)
    assert s.lr(0) == 2.0
    assert s.lr(5) == pytest.approx(1.5)


def test_schedule_for_run(small_run: RunSpec) -> None:
    run = dataclasses.replace(small_run, inner_lr=1e-3, inner_min_lr_ratio=0.1, warmup_steps=5)
    s = Schedule.for_run(run, total_steps=25)
    assert (s.peak_lr, s.min_lr, s.warmup_steps, s.total_steps) == (
        1e-3,
        pytest.approx(1e-4),
        5,
        25,
    )
    # No decay holds the peak after warm-up; a total shorter than warm-up is lifted past it.
    flat = Schedule.for_run(run, total_steps=2, decay=False)
    assert flat.min_lr == flat.peak_lr == 1e-3
    assert flat.total_steps == 6
    assert flat.lr(100) == 1e-3


# ----------------------------------------------------------------------------- train_step


def _record_grads(trainer: InnerTrainer) -> list[list[torch.Tensor]]:
    """Wrap the optimizer so each step first records the gradients it is about to apply."""
    recorded: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        recorded.append([p.grad.detach().clone() for p in trainer.params])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    return recorded


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_micro_batch_accumulation_equals_one_full_batch(small_run: RunSpec, micro: int) -> None:
    # micro=3 cuts 8 samples into 3+3+2: each chunk must be weighted by its share of samples.
    # Gradients are compared before the optimizer, unclipped, because AdamW's first step is
    # g/|g| and would hide a wrong overall scale.
    run = dataclasses.replace(small_run, batch_size=8, grad_clip=0.0)
    full, accumulated = _trainer(run, micro_batch_size=8), _trainer(run, micro_batch_size=micro)
    grads_full, grads_acc = _record_grads(full), _record_grads(accumulated)
    batch = _batch(8)
    for step in range(2):  # the second step also exercises AdamW's moments
        loss_full = full.train_step([batch], lr=1e-4)
        loss_acc = accumulated.train_step([batch], lr=1e-4)
        assert loss_acc == pytest.approx(loss_full, rel=1e-5), step
    for g_full, g_acc in zip(grads_full, grads_acc, strict=True):
        for a, b in zip(g_full, g_acc, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    # lr 1e-4 rather than 1e-3: AdamW's first step turns fp32 rounding of a near-zero
    # gradient into up to lr·1e-2 of parameter noise.
    for a, b in zip(full.snapshot(), accumulated.snapshot(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    # Gradients are cleared after each step, so nothing leaks into the next one.
    assert all(p.grad is None for p in accumulated.params)


def test_gradient_clip_applies_to_the_accumulated_gradient(small_run: RunSpec) -> None:
    run = dataclasses.replace(small_run, batch_size=8, grad_clip=0.05)
    trainer = _trainer(run, micro_batch_size=3)
    grads = _record_grads(trainer)
    trainer.train_step([_batch(8)], lr=1e-4)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[0]]))
    assert norm == pytest.approx(0.05, rel=1e-4)  # an untrained model's gradient norm is > 0.05


def test_several_batches_are_one_step_on_their_union(small_run: RunSpec) -> None:
    run = dataclasses.replace(small_run, batch_size=8)
    joined, split = _trainer(run), _trainer(run, micro_batch_size=8)
    batch = _batch(8, seed=1)
    # lr 1e-4, as above: at 1e-3 AdamW's first step turned fp32 rounding into 1.06e-5 of
    # parameter difference here (torch 2.13, CPU), just over the tolerance.
    loss_joined = joined.train_step([batch], lr=1e-4)
    loss_split = split.train_step([batch[:5], batch[5:]], lr=1e-4)
    assert loss_split == pytest.approx(loss_joined, rel=1e-5)
    for a, b in zip(joined.snapshot(), split.snapshot(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_train_step_returns_the_pre_step_loss(small_run: RunSpec) -> None:
    trainer = _trainer(small_run)
    batch = _batch(4, seed=2)
    with torch.no_grad():
        expected = trainer.model.loss(batch).item()
    assert trainer.train_step([batch], lr=1e-3) == pytest.approx(expected, rel=1e-5)


def test_zero_lr_leaves_the_weights_alone(small_run: RunSpec) -> None:
    # AdamW's decoupled weight decay is scaled by lr too, so lr = 0 moves nothing.
    trainer = _trainer(small_run)
    before = trainer.snapshot()
    trainer.train_step([_batch(4)], lr=0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.snapshot(), strict=True))


def test_micro_batch_size_must_be_positive(small_run: RunSpec) -> None:
    with pytest.raises(ConfigError, match="micro-batch size"):
        _trainer(small_run, micro_batch_size=-1)


def test_loss_decreases_on_a_repeated_batch(
    small_run: RunSpec, small_dataset: TokenDataset
) -> None:
    trainer = _trainer(small_run)
    batch = small_dataset.train[:4]
    losses = [trainer.train_step([batch], lr=3e-3) for _ in range(30)]
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)
    assert losses[-1] < 0.6 * losses[0]
    assert all(math.isfinite(x) for x in losses)


def test_train_counts_samples_and_reports_progress(small_run: RunSpec) -> None:
    trainer = _trainer(small_run)
    seen: list[tuple[int, float]] = []
    loss, samples = trainer.train(
        3, lambda: [_batch(4), _batch(2, seed=1)], _const(1e-3), 0, lambda i, x: seen.append((i, x))
    )
    assert samples == 18
    assert [i for i, _ in seen] == [1, 2, 3]
    assert seen[-1][1] == pytest.approx(loss)
    assert trainer.speed.steps_per_s is not None and trainer.speed.steps_per_s > 0


# ----------------------------------------------------------------------------- run_phase


def test_run_phase_returns_theta_minus_trained_params(small_run: RunSpec) -> None:
    trainer = _trainer(small_run, seed=1)  # the replica starts elsewhere than θ
    theta = [p.detach().clone() for p in build_model("nano", VOCAB, 0, 32).parameters()]
    theta_before = [t.clone() for t in theta]
    batches = iter([_batch(4, seed=s) for s in range(3)])
    phase = trainer.run_phase(theta, 3, lambda: [next(batches)], _const(1e-3), start_step=0)
    assert (phase.steps, phase.samples) == (3, 12)
    assert math.isfinite(phase.mean_loss) and phase.seconds >= 0
    # θ is read, never written.
    assert all(torch.equal(a, b) for a, b in zip(theta, theta_before, strict=True))
    trained = trainer.snapshot()
    assert len(phase.delta) == len(theta)
    for d, t, p in zip(phase.delta, theta, trained, strict=True):
        assert d.dtype == torch.float32 and d.device.type == "cpu"
        assert torch.allclose(d, t - p, atol=0, rtol=0)
    # Three steps at lr 1e-3 move every weight matrix, but by no more than ~3·lr each.
    assert all(d.abs().amax() > 0 for d in phase.delta)
    assert max(d.abs().amax().item() for d in phase.delta) < 3.5e-3


def test_run_phase_starts_from_theta_or_from_the_local_replica(small_run: RunSpec) -> None:
    # lr = 0 freezes the weights (AdamW's decay is lr-scaled), so δ shows only the start point.
    trainer = _trainer(small_run, seed=1)
    local = trainer.snapshot()
    theta = [p.detach().clone() for p in build_model("nano", VOCAB, 0, 32).parameters()]
    from_local = trainer.run_phase(theta, 1, lambda: [_batch(4)], _const(0.0), 0, from_local=True)
    for d, t, p in zip(from_local.delta, theta, local, strict=True):
        assert torch.equal(d, t - p)
    from_theta = trainer.run_phase(theta, 1, lambda: [_batch(4)], _const(0.0), 0)
    assert all(torch.count_nonzero(d) == 0 for d in from_theta.delta)


def test_run_phase_uses_the_schedule_from_start_step(small_run: RunSpec) -> None:
    # Warm-up step 0 has lr = 0 only if the schedule is read at start_step; a schedule whose
    # lr is 0 at steps >= 10 must leave the weights alone when started at step 10.
    schedule = Schedule(peak_lr=1e-3, min_lr=0.0, warmup_steps=0, total_steps=10)
    trainer = _trainer(small_run)
    theta = trainer.snapshot()
    late = trainer.run_phase(theta, 2, lambda: [_batch(4)], schedule, start_step=10)
    assert all(torch.count_nonzero(d) == 0 for d in late.delta)
    early = trainer.run_phase(theta, 2, lambda: [_batch(4)], schedule, start_step=0)
    assert any(torch.count_nonzero(d) > 0 for d in early.delta)


def test_run_phase_rejects_bad_input(small_run: RunSpec) -> None:
    trainer = _trainer(small_run)
    theta = trainer.snapshot()
    with pytest.raises(ConfigError, match="at least one step"):
        trainer.run_phase(theta, 0, lambda: [_batch(4)], _const(1e-3), 0)
    with pytest.raises(ConfigError, match="expected"):
        trainer.run_phase(theta[:-1], 1, lambda: [_batch(4)], _const(1e-3), 0)


# ----------------------------------------------------------------------------- evaluation


def test_evaluate_loss_is_the_sample_mean_whatever_the_batching(
    small_dataset: TokenDataset,
) -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=32)
    val = small_dataset.val
    assert len(val) == 8
    with torch.no_grad():
        expected = sum(model.loss(val[i : i + 1]).item() for i in range(len(val))) / len(val)
    for batch_size in (1, 3, 8, 100):
        assert evaluate_loss(model, val, batch_size=batch_size) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_loss_restores_the_training_mode(
    small_dataset: TokenDataset, training: bool
) -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=32)
    model.train(training)
    evaluate_loss(model, small_dataset.val)
    assert model.training is training


def test_perplexity() -> None:
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e6) == math.exp(50.0)  # capped: a diverged run still prints a number


class _FitsFour(torch.nn.Module):
    """A model whose backward 'runs out of memory' above 4 sequences (pure logic of the probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.tried: list[int] = []

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        self.tried.append(x.shape[0])
        if x.shape[0] > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return (self.w * x[:, :3].float()).sum()


def test_auto_micro_batch_halves_until_it_fits() -> None:
    from diloco_peer.peer.inner import auto_micro_batch

    model = _FitsFour()
    assert auto_micro_batch(model, 16, 8, 256, torch.device("cpu")) == 4
    assert model.tried == [16, 8, 4]
    assert model.w.grad is None  # the probe leaves no gradients behind


def test_auto_micro_batch_fails_clearly_when_nothing_fits() -> None:
    from diloco_peer.errors import ConfigError
    from diloco_peer.peer.inner import auto_micro_batch

    class NothingFits(_FitsFour):
        def loss(self, x: torch.Tensor) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(ConfigError, match="not even one sequence"):
        auto_micro_batch(NothingFits(), 8, 8, 256, torch.device("cpu"))
