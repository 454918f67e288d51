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
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor

from diloco_peer.config import OUTER_OPTIMIZERS
from diloco_peer.errors import ConfigError

HParam: TypeAlias = "int | float | str | list[float]"
"""An hyper-parameter value as stored in `state_dict()["hparams"]` (JSON-friendly)."""


# --------------------------------------------------------------------------- validation helpers


def _real(name: str, value: object) -> float:
    """`value` as a finite float; bools and non-numbers are rejected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def _integer(name: str, value: object, minimum: int) -> int:
    """`value` as an int >= `minimum`; bools and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _unit_interval(name: str, value: object) -> float:
    """A decay rate: a float in [0, 1)."""
    x = _real(name, value)
    if not 0.0 <= x < 1.0:
        raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
    return x


def _positive(name: str, value: object) -> float:
    x = _real(name, value)
    if not x > 0.0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return x


def _check_inputs(params: Sequence[Tensor], sums: Sequence[Tensor]) -> None:
    """Both lists hold tensors, pairwise of equal shape; params are floating point, not none."""
    if not params:
        raise ConfigError("params is empty: an outer step needs at least one tensor")
    if len(params) != len(sums):
        raise ConfigError(
            f"params and pseudo_grad_sum differ in length: {len(params)} vs {len(sums)}"
        )
    for i, (p, s) in enumerate(zip(params, sums, strict=True)):
        if not isinstance(p, Tensor) or not isinstance(s, Tensor):
            raise ConfigError(f"params[{i}] and pseudo_grad_sum[{i}] must be tensors")
        if not p.is_floating_point():
            raise ConfigError(f"params[{i}] must be a floating point tensor, got {p.dtype}")
        if p.shape != s.shape:
            raise ConfigError(
                f"shape mismatch at index {i}: param {tuple(p.shape)} vs "
                f"pseudo-gradient {tuple(s.shape)}"
            )


def _average(work: Sequence[Tensor], sums: Sequence[Tensor], count: int) -> list[Tensor]:
    """Δ = sum / count as fp32 tensors on each parameter's device.

    With count == 1 and matching dtype/device the caller's tensors are returned as they are (read
    only, never written); otherwise one new tensor per parameter.
    """
    out: list[Tensor] = []
    for p, s in zip(work, sums, strict=True):
        d = s.to(device=p.device, dtype=torch.float32)
        if count != 1:
            # `to` returns `s` itself when nothing changes: never divide the caller's tensor.
            d = d / count if d is s else d.div_(count)
        out.append(d)
    return out


# --------------------------------------------------------------------------- base class


class OuterOptimizer(ABC):
    """Common machinery: input checks, fp32 working copies, lazily created state, state I/O.

    Subclasses declare `name`, the per-parameter buffers they keep (`_buffers`), their
    hyper-parameters, and implement `_update` on fp32 tensors.
    """

    name: ClassVar[str]
    _buffers: ClassVar[tuple[str, ...]] = ()
    """Names of the per-parameter state tensors; `state_dict` keys are `"<buffer>.<index>"`."""

    def __init__(self, lr: float) -> None:
        self.lr = _positive("lr", lr)
        self._step = 0
        # buffer name -> one fp32 tensor per parameter; empty until the first step or a load.
        self._state: dict[str, list[Tensor]] = {}

    # -- public API

    @property
    @abstractmethod
    def hparams(self) -> dict[str, HParam]:
        """Hyper-parameters as JSON values; `load_state_dict` requires them to match."""

    @property
    def steps_taken(self) -> int:
        """Number of `step` calls applied so far (restored by `load_state_dict`)."""
        return self._step

    @torch.no_grad()
    def step(self, params: Sequence[Tensor], pseudo_grad_sum: Sequence[Tensor], count: int) -> None:
        """Apply the pseudo-gradients of one group to `params`, in place.

        `pseudo_grad_sum[i]` is the sum over the group of the contributions for `params[i]`, and
        `count` (int >= 1) is how many contributions were summed. Raises `ConfigError` when the
        lists differ in length or any pair differs in shape; nothing is modified in that case.
        """
        count = _integer("count", count, 1)
        params = list(params)
        sums = list(pseudo_grad_sum)
        _check_inputs(params, sums)
        # Parameters kept in another dtype are stepped through an fp32 copy, then written back.
        work = [p if p.dtype == torch.float32 else p.detach().float() for p in params]
        self._prepare_state(work)
        delta = _average(work, sums, count)
        self._update(work, delta, count)
        for p, w in zip(params, work, strict=True):
            if w is not p:
                p.copy_(w)
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically, as plain data.

        Returns `{"name", "hparams", "counters", "tensors"}`: `hparams` and `counters` hold JSON
        scalars (and lists), `tensors` is a flat `{"m.0": Tensor, ...}` dict of fp32 clones that
        safetensors can store (empty before the first step).
        """
        tensors = {
            f"{buf}.{i}": t.detach().clone()
            for buf in self._buffers
            for i, t in enumerate(self._state.get(buf, []))
        }
        return {
            "name": self.name,
            "hparams": self.hparams,
            "counters": self._counters(),
            "tensors": tensors,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; the tensors are copied, never aliased.

        Raises `ConfigError` when the optimizer name or hyper-parameters differ, a counter is
        missing or invalid, or the tensors are not a complete set of consistent shapes (also
        against this optimizer's current state, if it has one). Nothing changes on error.
        """
        if not isinstance(state, Mapping):
            raise ConfigError("outer optimizer state must be a mapping")
        missing = {"name", "hparams", "counters", "tensors"} - set(state)
        if missing:
            raise ConfigError(f"outer optimizer state lacks {sorted(missing)}")
        if state["name"] != self.name:
            raise ConfigError(
                f"outer optimizer state is for {state['name']!r}, this optimizer is {self.name!r}"
            )
        hparams = _json_normalize(state["hparams"])
        if hparams != self.hparams:
            raise ConfigError(
                f"outer optimizer hyper-parameters differ: state has {hparams}, "
                f"this optimizer has {self.hparams}"
            )
        counters = state["counters"]
        if not isinstance(counters, Mapping):
            raise ConfigError("outer optimizer state 'counters' must be a mapping")
        self._check_counters(counters)
        buffers = self._parse_tensors(state["tensors"])
        step = counters["step"]
        if self._buffers and (step == 0) != (not buffers):
            raise ConfigError(
                f"outer optimizer state has step={step} but "
                f"{'no' if not buffers else 'some'} state tensors"
            )

        new_state: dict[str, list[Tensor]] = {}
        for buf, tensors in buffers.items():
            current = self._state.get(buf)
            if current is not None:
                # Keep the existing buffers (and their device); copy_ never aliases `state`.
                for dst, src in zip(current, tensors, strict=True):
                    dst.copy_(src)
                new_state[buf] = current
            else:
                new_state[buf] = [t.detach().to(dtype=torch.float32, copy=True) for t in tensors]
        self._state = new_state
        self._load_counters(counters)

    # -- subclass hooks

    @abstractmethod
    def _update(self, params: list[Tensor], delta: list[Tensor], count: int) -> None:
        """Update fp32 `params` in place from the group average `delta` of `count` contributions."""

    def _counters(self) -> dict[str, int]:
        return {"step": self._step}

    def _check_counters(self, counters: Mapping[str, Any]) -> None:
        """Loaded counters have exactly the keys of `_counters()`, each an int >= 0."""
        if set(counters) != set(self._counters()):
            raise ConfigError(
                f"outer optimizer counters must have exactly the keys {sorted(self._counters())}"
            )
        for key, value in counters.items():
            _integer(f"counter {key!r}", value, 0)

    def _load_counters(self, counters: Mapping[str, int]) -> None:
        """Restore the counters checked by `_check_counters`."""
        self._step = counters["step"]

    # -- internals

    def _prepare_state(self, work: Sequence[Tensor]) -> None:
        """Create zero buffers on the first step; otherwise check them against `work`."""
        if not self._buffers:
            return
        if not self._state:
            self._state = {
                buf: [torch.zeros_like(p, dtype=torch.float32) for p in work]
                for buf in self._buffers
            }
            return
        for buf in self._buffers:
            tensors = self._state[buf]
            if len(tensors) != len(work):
                raise ConfigError(
                    f"outer optimizer state has {len(tensors)} tensors per buffer, "
                    f"got {len(work)} params"
                )
            for i, (t, p) in enumerate(zip(tensors, work, strict=True)):
                if t.shape != p.shape:
                    raise ConfigError(
                        f"outer optimizer state {buf}.{i} has shape {tuple(t.shape)}, "
                        f"param has {tuple(p.shape)}"
                    )
        for buf in self._buffers:
            # State loaded on another device (e.g. a CPU checkpoint) follows the params.
            self._state[buf] = [
                t if t.device == p.device else t.to(p.device)
                for t, p in zip(self._state[buf], work, strict=True)
            ]

    def _parse_tensors(self, tensors: object) -> dict[str, list[Tensor]]:
        """Split a flat `{"m.0": ...}` dict into complete, consistent per-buffer lists."""
        if not isinstance(tensors, Mapping):
            raise ConfigError("outer optimizer state 'tensors' must be a mapping")
        if not tensors:
            return {}
        grouped: dict[str, dict[int, Tensor]] = {buf: {} for buf in self._buffers}
        for key, value in tensors.items():
            buf, _, index = str(key).rpartition(".")
            # Canonical decimal indices only, so "m.01" cannot shadow "m.1".
            canonical = index.isascii() and index.isdigit() and str(int(index)) == index
            if buf not in grouped or not canonical:
                raise ConfigError(
                    f"unexpected tensor {key!r} in {self.name!r} state; expected names "
                    f"{', '.join(b + '.<i>' for b in self._buffers) or '(none)'}"
                )
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise ConfigError(f"state tensor {key!r} must be a floating point tensor")
            grouped[buf][int(index)] = value
        counts = {len(v) for v in grouped.values()}
        n = counts.pop()
        if counts or any(set(v) != set(range(n)) for v in grouped.values()):
            raise ConfigError(
                f"{self.name!r} state tensors must be {', '.join(self._buffers)} "
                f"each indexed 0..n-1 with the same n"
            )
        lists = {buf: [v[i] for i in range(n)] for buf, v in grouped.items()}
        shapes = [t.shape for t in lists[self._buffers[0]]]
        for buf, ts in lists.items():
            for i, (t, shape) in enumerate(zip(ts, shapes, strict=True)):
                if t.shape != shape:
                    raise ConfigError(f"state tensor {buf}.{i} has shape {tuple(t.shape)}")
        if self._state:
            current = [t.shape for t in self._state[self._buffers[0]]]
            if current != shapes:
                raise ConfigError("state tensor shapes do not match this optimizer's parameters")
        return lists


def _json_normalize(value: object) -> object:
    """Tuples become lists, recursively, so that a JSON round trip compares equal."""
    if isinstance(value, Mapping):
        return {k: _json_normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_normalize(v) for v in value]
    return value


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
        self.momentum = _unit_interval("momentum", momentum)

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
            _unit_interval("betas[0]", betas[0]),
            _unit_interval("betas[1]", betas[1]),
        )
        self.eps = _positive("eps", eps)

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
        self.momentum = _unit_interval("momentum", momentum)
        self.buffer_size = _integer("buffer_size", buffer_size, 1)
        self.c = _real("c", c)
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
