"""Outer optimizers: how θ moves once a group's pseudo-gradients are known.

Formulas are ALGORITHMS.md §1 (DiLoCo outer step: `sgd`, `sgdm`, `nesterov`, `adam`) and §2.2
(Delayed Nesterov, Algorithm 3 of arXiv 2401.09135). Every optimizer takes the same call:

    opt.step(params, pseudo_grad_sum, count)

where `pseudo_grad_sum` is the sum of `count` contributions δᵢ (what an all-reduce of a group
returns) and `params` is θ, updated in place. `sgd`, `sgdm`, `nesterov` and `adam` take one outer
step on the average Δ = sum / count (synchronous DiLoCo); `delayed-nesterov` applies `count`
consecutive contributions, each equal to Δ (§2.2, "How a group reaches the outer optimizer").

All math runs in fp32 on the parameters' device. The state (momentum, Adam moments, the DN buffer
and counters) is replicated on every peer, so `state_dict()` is plain data: JSON scalars and a
flat name -> tensor dict that safetensors can store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from diloco_peer.averaging.outer_base import (
    HParam,
    OuterOptimizer,
    integer_at_least,
    positive_number,
    real_number,
    unit_interval,
)
from diloco_peer.config import OUTER_OPTIMIZERS
from diloco_peer.errors import ConfigError

# --------------------------------------------------------------------------- optimizers


class OuterSGD(OuterOptimizer):
    """`sgd` (ALGORITHMS §1): θ ← θ − lr·Δ. With lr = 1 this is FedAvg. Keeps no state."""

    name = "sgd"

    @property
    def hparams(self) -> dict[str, HParam]:
        return {"lr": self.lr}

    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        torch._foreach_add_(params, delta, alpha=-self.lr)


class _MomentumBase(OuterOptimizer):
    """Shared by heavy-ball and Nesterov: one momentum buffer `m` per parameter."""

    _buffers = ("m",)

    def __init__(self, lr: float, momentum: float) -> None:
        super().__init__(lr)
        self.momentum = unit_interval("momentum", momentum)

    @property
    def hparams(self) -> dict[str, HParam]:
        return {"lr": self.lr, "momentum": self.momentum}


class OuterSGDM(_MomentumBase):
    """`sgdm`, heavy ball (ALGORITHMS §1): m ← μ·m + Δ ; θ ← θ − lr·m."""

    name = "sgdm"

    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        m = self._state["m"]
        torch._foreach_mul_(m, self.momentum)
        torch._foreach_add_(m, delta)
        torch._foreach_add_(params, m, alpha=-self.lr)


class OuterNesterov(_MomentumBase):
    """`nesterov`, the DiLoCo default (ALGORITHMS §1): m ← μ·m + Δ ; θ ← θ − lr·(Δ + μ·m).

    Same as `torch.optim.SGD(momentum=μ, nesterov=True, dampening=0)` fed Δ as the gradient (up to
    fp32 rounding: the two terms are subtracted separately to avoid a model-sized temporary).
    """

    name = "nesterov"

    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        m = self._state["m"]
        torch._foreach_mul_(m, self.momentum)
        torch._foreach_add_(m, delta)
        torch._foreach_add_(params, delta, alpha=-self.lr)
        torch._foreach_add_(params, m, alpha=-self.lr * self.momentum)


class OuterAdam(OuterOptimizer):
    """`adam` (ALGORITHMS §1, DiLoCo Fig. 6): `torch.optim.Adam` semantics on Δ.

    m ← β₁m + (1−β₁)Δ ; v ← β₂v + (1−β₂)Δ² ; θ ← θ − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε),
    no weight decay. ε defaults to 0.1: pseudo-gradients are large and Adam is unstable with a
    small ε (DiLoCo §"outer optimizers"). The `momentum` argument of `build_outer_optimizer` is
    ignored; β₁ plays its role.
    """

    name = "adam"
    _buffers = ("m", "v")

    def __init__(self, lr: float, betas: Sequence[float] = (0.9, 0.999), eps: float = 0.1) -> None:
        super().__init__(lr)
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise ConfigError(f"betas must be a pair of numbers, got {betas!r}")
        self.betas = (
            unit_interval("betas[0]", betas[0]),
            unit_interval("betas[1]", betas[1]),
        )
        self.eps = positive_number("eps", eps)

    @property
    def hparams(self) -> dict[str, HParam]:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps}

    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        beta1, beta2 = self.betas
        t = self._step + 1
        step_size = self.lr / (1.0 - beta1**t)
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**t)
        # Per tensor (not _foreach) so that the `denom` temporary is one tensor, not a model.
        for p, d, m, v in zip(params, delta, self._state["m"], self._state["v"], strict=True):
            m.lerp_(d, 1.0 - beta1)
            v.mul_(beta2).addcmul_(d, d, value=1.0 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)


class DelayedNesterov(OuterOptimizer):
    """`delayed-nesterov`, Algorithm 3 of arXiv 2401.09135 (ALGORITHMS §2.2).

    State: momentum m, buffer B, contribution counter t. Each contribution g does
    B ← B + g, then if (t+1) mod N == 0: m ← β·m + B/N ; θ ← θ − lr·((1 − cN + c)·β·m + g/N) ;
    B ← 0, else θ ← θ − lr·(c·β·m + g/N); then t ← t + 1.

    A call with `count` = k applies k consecutive contributions, each equal to Δ = sum / k. Runs of
    contributions between two buffer boundaries are applied in closed form (a run of j identical
    steps moves θ by j times one step, since m is frozen inside a run), so a call costs a few
    passes over the model however large k is. With c = 0 and N = k, a synchronous group of k
    equals one Nesterov step on Δ.
    """

    name = "delayed-nesterov"
    _buffers = ("m", "buf")

    def __init__(self, lr: float, momentum: float, buffer_size: int = 1, c: float = 0.0) -> None:
        super().__init__(lr)
        self.momentum = unit_interval("momentum", momentum)
        self.buffer_size = integer_at_least("buffer_size", buffer_size, 1)
        self.c = real_number("c", c)
        if not 0.0 <= self.c <= 1.0 / self.buffer_size:
            raise ConfigError(
                f"c must be in [0, 1/buffer_size] = [0, {1.0 / self.buffer_size:g}], got {c!r}"
            )
        self._t = 0  # contributions applied so far

    @property
    def hparams(self) -> dict[str, HParam]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "buffer_size": self.buffer_size,
            "c": self.c,
        }

    @property
    def contributions(self) -> int:
        """t of Algorithm 3: contributions applied so far."""
        return self._t

    def _counters(self) -> dict[str, int]:
        return {"step": self._step, "t": self._t}

    def _check_counters(self, counters: Mapping[str, Any]) -> None:
        super()._check_counters(counters)
        t, step = counters["t"], counters["step"]
        if t < step or (t == 0) != (step == 0):
            raise ConfigError(
                f"delayed-nesterov state has t={t} contributions for step={step} calls; "
                "every step applies at least one contribution"
            )

    def _load_counters(self, counters: Mapping[str, int]) -> None:
        super()._load_counters(counters)
        self._t = counters["t"]

    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        n, beta, c, lr = self.buffer_size, self.momentum, self.c, self.lr
        m, buf = self._state["m"], self._state["buf"]
        remaining = count
        while remaining > 0:
            to_boundary = n - self._t % n  # contributions up to and including the next boundary
            j = min(remaining, to_boundary)
            hits = j == to_boundary
            frozen = j - 1 if hits else j  # steps of this run that leave m unchanged
            buffer_empty = self._t % n == 0  # B is reset at each boundary
            if c > 0.0 and frozen > 0:
                torch._foreach_add_(params, m, alpha=-lr * frozen * c * beta)
            # Every step of the run, boundary or not, carries g/N.
            torch._foreach_add_(params, delta, alpha=-lr * j / n)
            if hits:
                # m ← β·m + (B + j·g)/N, without materialising B + j·g.
                torch._foreach_mul_(m, beta)
                if not buffer_empty:
                    torch._foreach_add_(m, buf, alpha=1.0 / n)
                    torch._foreach_zero_(buf)
                torch._foreach_add_(m, delta, alpha=j / n)
                torch._foreach_add_(params, m, alpha=-lr * (1.0 - c * n + c) * beta)
            else:
                torch._foreach_add_(buf, delta, alpha=float(j))
            self._t += j
            remaining -= j


# --------------------------------------------------------------------------- factory

_Factory = Callable[..., OuterOptimizer]

_REGISTRY: dict[str, tuple[_Factory, frozenset[str]]] = {
    "sgd": (lambda lr, momentum: OuterSGD(lr), frozenset()),
    "sgdm": (lambda lr, momentum: OuterSGDM(lr, momentum), frozenset()),
    "nesterov": (lambda lr, momentum: OuterNesterov(lr, momentum), frozenset()),
    "adam": (
        lambda lr, momentum, **kw: OuterAdam(lr, **kw),
        frozenset({"betas", "eps"}),
    ),
    "delayed-nesterov": (
        lambda lr, momentum, **kw: DelayedNesterov(lr, momentum, **kw),
        frozenset({"buffer_size", "c"}),
    ),
}
if tuple(_REGISTRY) != OUTER_OPTIMIZERS:  # pragma: no cover - guards edits of this module
    raise ImportError("outer optimizer registry and OUTER_OPTIMIZERS disagree")


def build_outer_optimizer(
    name: str, lr: float = 0.7, momentum: float = 0.9, **extra: Any
) -> OuterOptimizer:
    """Build one of `OUTER_OPTIMIZERS` (ALGORITHMS §1 and §2.2).

    `momentum` is μ for `sgdm`/`nesterov` and β for `delayed-nesterov`; `sgd` and `adam` ignore it.
    Extra keyword arguments: `betas` (default (0.9, 0.999)) and `eps` (default 0.1) for `adam`;
    `buffer_size` N (int >= 1, default 1) and `c` (in [0, 1/N], default 0.0) for
    `delayed-nesterov`. Raises `ConfigError` for an unknown name, an option the chosen optimizer
    does not take, or an out-of-range value.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ConfigError(
            f"unknown outer optimizer {name!r}; choose one of: {', '.join(OUTER_OPTIMIZERS)}"
        )
    factory, accepted = _REGISTRY[name]
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ConfigError(
            f"outer optimizer {name!r} does not take {', '.join(unknown)}; "
            f"it accepts: {', '.join(sorted(accepted)) or 'no extra options'}"
        )
    return factory(lr, momentum, **extra)
