"""The machinery every outer optimizer shares (outer.py holds the optimizers themselves): input
checks, fp32 working copies, lazily created state, and the state as plain data.

`state_dict()` is JSON scalars and a flat name -> tensor dict that safetensors can store, since
the state is replicated on every peer (DESIGN.md §3) and never pickled.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor

from diloco_peer.errors import ConfigError

HParam: TypeAlias = "int | float | str | list[float]"
"""An hyper-parameter value as stored in `state_dict()["hparams"]` (JSON-friendly)."""


# --------------------------------------------------------------------------- validation helpers


def real_number(name: str, value: object) -> float:
    """`value` as a finite float; bools and non-numbers are rejected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def integer_at_least(name: str, value: object, minimum: int) -> int:
    """`value` as an int >= `minimum`; bools and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def unit_interval(name: str, value: object) -> float:
    """A decay rate: a float in [0, 1)."""
    x = real_number(name, value)
    if not 0.0 <= x < 1.0:
        raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
    return x


def positive_number(name: str, value: object) -> float:
    x = real_number(name, value)
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
        self.lr = positive_number("lr", lr)
        # `step` calls so far: Adam's bias correction reads it, and it is the state's "step"
        # counter (checkpoints and state hashes carry it)
        self._step = 0
        # buffer name -> one fp32 tensor per parameter; empty until the first step or a load.
        self._state: dict[str, list[Tensor]] = {}

    # -- public API

    @property
    def buffer_count(self) -> int:
        """Model-sized fp32 tensors the state keeps per parameter (Nesterov: 1, Adam: 2)."""
        return len(self._buffers)

    @property
    @abstractmethod
    def hparams(self) -> dict[str, HParam]:
        """Hyper-parameters as JSON values; `load_state_dict` requires them to match."""

    @torch.no_grad()
    def step(self, params: Sequence[Tensor], pseudo_grad_sum: Sequence[Tensor], count: int) -> None:
        """Apply the pseudo-gradients of one group to `params`, in place.

        `pseudo_grad_sum[i]` is the sum over the group of the contributions for `params[i]`, and
        `count` (int >= 1) is how many contributions were summed. Raises `ConfigError` when the
        lists differ in length or any pair differs in shape; nothing is modified in that case.
        """
        count = integer_at_least("count", count, 1)
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

    @torch.no_grad()
    def step_part(
        self,
        params: Sequence[Tensor],
        part: Sequence[int],
        pseudo_grad_sum: Sequence[Tensor],
        count: int,
    ) -> None:
        """`step` on the parameters `part` indexes (a fragment, ALGORITHMS §1.2) and on their
        buffers alone; `pseudo_grad_sum` holds one tensor per index of `part`. The other
        parameters and their buffers are left as they are (the step counter still counts)."""
        params = list(params)
        if (
            not part
            or sorted(set(part)) != list(part)
            or not 0 <= part[0] <= part[-1] < len(params)
        ):
            raise ConfigError(f"a part indexes its parameters in order, got {list(part)}")
        self._prepare_state(params)
        whole = self._state
        self._state = {buf: [tensors[i] for i in part] for buf, tensors in whole.items()}
        try:
            self.step([params[i] for i in part], pseudo_grad_sum, count)
        finally:
            self._state = whole

    @torch.no_grad()
    def preview(
        self, params: Sequence[Tensor], pseudo_grad_sum: Sequence[Tensor], count: int
    ) -> list[Tensor]:
        """What `step` would make of `params`, as new tensors; the state and `params` are left
        as they are (an overlapped phase's eager start, ALGORITHMS §1.1)."""
        out = [p.detach().clone() for p in params]
        copy.deepcopy(self).step(out, pseudo_grad_sum, count)
        return out

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

    def load_state_dict(
        self, state: Mapping[str, Any], *, shapes: Sequence[tuple[int, ...]] | None = None
    ) -> None:
        """Restore a `state_dict()`; the tensors are copied, never aliased.

        Raises `ConfigError` when the optimizer name or hyper-parameters differ, a counter is
        missing or invalid, or the tensors are not a complete set of consistent shapes (also
        against this optimizer's current state, if it has one, and against the parameters'
        `shapes` when given: a state from elsewhere must fit the model before its first outer
        step, not crash it). Nothing changes on error.
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
        if shapes is not None:
            want = [tuple(s) for s in shapes]
            for buf, tensors in buffers.items():
                if [tuple(t.shape) for t in tensors] != want:
                    raise ConfigError(
                        f"outer optimizer state {buf!r} does not have the parameters' shapes"
                    )
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
            integer_at_least(f"counter {key!r}", value, 0)

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
