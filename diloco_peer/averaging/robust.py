"""Screening and robust aggregation of one all-reduce part (DESIGN.md §4), pure torch.

A part's reducer (reducer.py) holds that part of every member's flat fp32 pseudo-gradient δ.
Before combining them it screens each one (`screen_parts`): a part that is not finite, longer or
shorter than the part, larger than its member declared its whole δ to be (a slice of a vector
cannot be larger than the vector), or (optionally) pointing away from the others' coordinate-wise
median, is excluded. The others are combined by `aggregate`:

    mean           Σ w_i x_i / Σ w_i: DiLoCo's outer gradient, no robustness (one member can move
                   it anywhere)
    trimmed-mean   per coordinate, the k smallest and k largest values dropped, the rest averaged
                   (Yin, Chen, Ramchandran & Bartlett 2018, "Byzantine-Robust Distributed
                   Learning: Towards Optimal Statistical Rates", coordinate-wise trimmed mean):
                   robust to k arbitrary members
    centered-clip  Karimireddy, He & Jaggi 2021, "Learning from History for Byzantine Robust
                   Optimization", centered clipping: iterate v <- v + Σ w_i clip(x_i - v, τ) / Σ w_i
                   so each member moves v by at most τ (weighted)

The robust methods need a majority to center on: with fewer than 3 members they are the weighted
mean. Only the reducer runs any of this and sends the same bytes to every member, so it need not be
bit-reproducible across machines, only deterministic and free of NaN for finite inputs.

Sorting across members uses an odd-even transposition network of elementwise min/max (n rounds,
O(n²) vectorized ops, no index tensors): 2-10x faster than `torch.sort` along the member axis for
4 to 16 members (bench/robust_aggregation.py measures it and every cost here against the mean).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from diloco_peer.averaging.compression import COMPRESSIONS, Compression
from diloco_peer.config import AGGREGATIONS, AggregationName
from diloco_peer.errors import AllReduceFailed

_ROBUST_MIN_MEMBERS = 3
"""Fewer members have no majority: robust methods and cosine screening do not apply."""

_RELATIVE_NORM_TOLERANCE: dict[str, float] = {"none": 1e-5, "fp16": 1e-3, "int8": 0.03, "int4": 0.5}
"""How much larger than the sent part a decoded part's L2 norm can be, relative, per codec.

none: exact, but the sender's declared norm and the reducer's part norm are computed by two fp32
reductions in different orders (~1e-7 apart). fp16: a normal value's rounding is at most 2^-11
relative (4.9e-4); subnormals are covered by an absolute term (`norm_tolerance`). int8, int4: a
block's error can add up when every value but the absmax sits just above a rounding midpoint;
the worst block is +2.24% for int8 (the others at 11.5 quantization steps) and +47.6% for int4
(the others at half a step), checked in tests/test_robust.py. Gaussian values gain 0.003% (int8)
and 0.7% (int4), measured: these bounds are for the worst case, so no honest member is ever
excluded, and a member can exceed its own declaration by no more than them.
"""
_ABSOLUTE_NORM_SLACK = 1e-6
"""fp32 rounding room for a norm near zero."""
_FP16_SUBNORMAL_ERROR = 2.0**-25
"""Half the spacing of fp16 subnormals: the absolute rounding error of a value below 2^-14."""


@dataclass(kw_only=True, frozen=True)
class Aggregation:
    """How a reducer combines the screened parts of its members."""

    method: AggregationName = "mean"
    """"mean" (DiLoCo's), "trimmed-mean" or "centered-clip" (see the module docstring)."""
    trim_fraction: float = 0.2
    """trimmed-mean: the fraction of members dropped from EACH end, per coordinate (at least one
    per end from 3 members on, never leaving fewer than one value)."""
    clip_iterations: int = 3
    """centered-clip: iterations from the coordinate-wise median."""
    min_cosine: float | None = None
    """Exclude a part whose cosine with the coordinate-wise median of the other parts is below
    this (from 3 members on; see `screen_parts`); None: no direction screening."""

    def __post_init__(self) -> None:
        if self.method not in AGGREGATIONS:
            raise ValueError(
                f"aggregation method must be one of {AGGREGATIONS}, got {self.method!r}"
            )
        fraction = self.trim_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"trim_fraction must be a number, got {fraction!r}")
        if not 0 <= fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {fraction!r}")
        iterations = self.clip_iterations
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"clip_iterations must be an integer >= 1, got {iterations!r}")
        cosine = self.min_cosine
        if cosine is not None and (
            isinstance(cosine, bool)
            or not isinstance(cosine, (int, float))
            or not -1 <= cosine <= 1
        ):
            raise ValueError(f"min_cosine must be None or a number in [-1, 1], got {cosine!r}")

    def trimmed(self, members: int) -> int:
        """How many values trimmed-mean drops from each end of `members` values."""
        if self.trim_fraction == 0 or members < _ROBUST_MIN_MEMBERS:
            return 0
        count = math.floor(self.trim_fraction * members + 1e-9)  # 0.29 · 100 is 28.999...
        return min(max(count, 1), (members - 1) // 2)


class Reason(IntEnum):
    """Why a reducer excluded a member's part; the value is its code on the wire."""

    NON_FINITE = 1
    NORM = 2
    COSINE = 3
    MALFORMED = 4

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Reason.NON_FINITE: "non-finite",
    Reason.NORM: "norm above its declared bound",
    Reason.COSINE: "cosine with the median below the minimum",
    Reason.MALFORMED: "malformed",
}


@dataclass(frozen=True)
class Exclusion:
    """One excluded part: its reason, and the detail the reducer logs (never sent)."""

    reason: Reason
    detail: str

    def __str__(self) -> str:
        return self.detail


# --------------------------------------------------------------------------- aggregation


def reduce_part(parts: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """The weighted mean Σ_j w_j x_j / Σ_j w_j, summed in the order given (fp32).

    Every member's result must not depend on which reducer computed it, and the simulator's
    in-memory all-reduce must give the network's bits: this exact sequence of operations is
    what both run for "mean".
    """
    if not parts or len(parts) != len(weights):
        raise ValueError(f"reduce_part needs one weight per part, got {len(parts)}, {len(weights)}")
    total = math.fsum(weights)
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights, strict=True):
        acc.add_(part, alpha=weight)
    return acc.div_(total)


def aggregate(
    parts: Sequence[Tensor], weights: Sequence[float], aggregation: Aggregation
) -> Tensor:
    """Combine one part of every included member (1-D fp32, same length, sorted member order).

    "mean" is `reduce_part`. "trimmed-mean" is unweighted over the values it keeps: weights
    attach to members while trimming ranks each coordinate separately, and DiLoCo's weights
    (tokens per member) are near-equal anyway; with nothing to trim (fewer than 3 members, or
    trim_fraction 0) it is the weighted mean. "centered-clip" weights each member's clipped step.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError(f"aggregate needs one weight per part, got {len(parts)}, {len(weights)}")
    if aggregation.method == "trimmed-mean":
        trimmed = aggregation.trimmed(len(parts))
        if trimmed > 0:
            return _trimmed_mean(parts, trimmed)
    elif aggregation.method == "centered-clip" and len(parts) >= _ROBUST_MIN_MEMBERS:
        return _centered_clip(parts, weights, aggregation.clip_iterations)
    return reduce_part(parts, weights)


def sorted_rows(parts: Sequence[Tensor]) -> list[Tensor]:
    """Per coordinate, the members' values in increasing order: row r holds the r-th smallest.

    Odd-even transposition sort: n rounds of compare-exchange on neighbouring rows sort any
    input (Knuth, TAOCP vol. 3, §5.3.4); each compare-exchange is one elementwise min and max.
    """
    rows = list(parts)
    for round_ in range(len(rows)):
        for i in range(round_ % 2, len(rows) - 1, 2):
            low, high = rows[i], rows[i + 1]
            rows[i], rows[i + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return rows


def coordinate_median(parts: Sequence[Tensor]) -> Tensor:
    """Coordinate-wise median, the mean of the two middle values for an even count."""
    rows, middle = sorted_rows(parts), len(parts) // 2
    return rows[middle] if len(parts) % 2 else _midpoint(rows[middle - 1], rows[middle])


def _midpoint(a: Tensor, b: Tensor) -> Tensor:
    # halves first: the sum of two large values may overflow where their mean does not
    return a.mul(0.5).add_(b, alpha=0.5)


def _trimmed_mean(parts: Sequence[Tensor], trimmed: int) -> Tensor:
    kept = sorted_rows(parts)[trimmed : len(parts) - trimmed]
    acc = kept[0].clone()
    for row in kept[1:]:
        acc.add_(row)
    return acc.div_(len(kept))


def _centered_clip(parts: Sequence[Tensor], weights: Sequence[float], iterations: int) -> Tensor:
    """Centered clipping from the coordinate-wise median.

    The paper starts from the previous round's aggregate (its "history"); a reducer has none (each
    round is a new group), so it starts from the median, itself robust. The paper's τ comes from
    a variance bound no one knows here; τ = the median of the members' distances to v, taken anew
    at each iteration, adapts to the δs' scale and leaves the closer half of the members
    unclipped, so honest members pull v fully while a far outlier moves it by at most
    τ · w_i / Σ w per iteration. Each step is a convex combination of v and the x_i, so the result
    is never longer than max(‖median‖, max_i ‖x_i‖) (see `aggregate_norm_bound`).
    """
    total = math.fsum(weights)
    center = coordinate_median(parts)
    scratch = torch.empty_like(center)
    for _ in range(iterations):
        distances = [
            float(torch.linalg.vector_norm(torch.sub(part, center, out=scratch))) for part in parts
        ]
        tau = statistics.median(distances)
        step = torch.zeros_like(center)
        for part, weight, distance in zip(parts, weights, distances, strict=True):
            shrink = 1.0 if distance <= tau else tau / distance  # clip(z, τ) = z · min(1, τ/‖z‖)
            step.add_(torch.sub(part, center, out=scratch), alpha=weight * shrink)
        center = center + step.div_(total)
    return center


def aggregate_norm_bound(bounds: Sequence[float], aggregation: Aggregation) -> float:
    """The largest L2 norm `aggregate` can return for parts of L2 norms at most `bounds`.

    mean: a convex combination, at most max_i b_i. trimmed-mean dropping k per end: a kept value
    at a coordinate is bounded in magnitude by the (k+1)-th largest |x_i| there, whose square is
    at most the mean of the k+1 largest squares, so ‖result‖² ≤ Σ_i b_i² / (k+1). centered-clip:
    the median is bounded the same way with k+1 = ⌈n/2⌉, and each clipping step stays in the
    convex hull of v and the x_i. Members use it to check a reducer's answer (wire.py).
    """
    if not bounds:
        raise ValueError("aggregate_norm_bound needs at least one bound")
    largest, count = max(bounds), len(bounds)
    squares = math.fsum(b * b for b in bounds)
    if aggregation.method == "trimmed-mean" and aggregation.trimmed(count) > 0:
        return math.sqrt(squares / (aggregation.trimmed(count) + 1))
    if aggregation.method == "centered-clip" and count >= _ROBUST_MIN_MEMBERS:
        return max(largest, math.sqrt(squares / math.ceil(count / 2)))
    return largest


# --------------------------------------------------------------------------- screening


def norm_tolerance(codec: Compression, numel: int) -> tuple[float, float]:
    """(relative, absolute) room between a part's L2 norm before encoding and after decoding.

    A part passes the norm check when ‖decoded‖ ≤ bound · (1 + relative) + absolute. The absolute
    term is fp32 slack, plus for fp16 the worst subnormal rounding of every value (a δ whose
    values are all below 6e-5 can double its norm in fp16).
    """
    if codec not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {codec!r}")
    absolute = _ABSOLUTE_NORM_SLACK
    if codec == "fp16":
        absolute += math.sqrt(numel) * _FP16_SUBNORMAL_ERROR
    return _RELATIVE_NORM_TOLERANCE[codec], absolute


def screen_parts(
    parts: Sequence[Tensor],
    bounds: Sequence[float | None],
    *,
    numel: int,
    min_cosine: float | None,
    tolerance: float,
    slack: float = _ABSOLUTE_NORM_SLACK,
    reference: Tensor | None = None,
) -> dict[int, Exclusion]:
    """The parts a reducer must leave out, by index, with the reason.

    In order: not 1-D of `numel` values; not finite; L2 norm above bounds[i] · (1 + tolerance) +
    slack where bounds[i] (member i's declared L2 norm of its whole δ) is not None; then, when
    `min_cosine` is set and at least 3 parts remain, direction (`_direction_outliers`): a
    sign-flipped or random vector points away from what the others agree on. `reference`
    (`numel` values), when given, is taken out of every part before the direction check: a
    term honest parts share by construction (an overlapped `mix` δ's, ALGORITHMS §1.1), so that
    their directions are those of their training progress.
    """
    if len(parts) != len(bounds):
        raise ValueError(f"screen_parts needs one bound per part, got {len(parts)}, {len(bounds)}")
    excluded: dict[int, Exclusion] = {}
    for i, (part, bound) in enumerate(zip(parts, bounds, strict=True)):
        if part.dim() != 1 or part.numel() != numel:
            shape = tuple(part.shape)
            excluded[i] = Exclusion(Reason.MALFORMED, f"shape {shape}, expected ({numel},)")
            continue
        # one pass for both checks: a NaN or inf value makes the norm non-finite (and so may an
        # fp32 overflow of finite values, which then fails the bound)
        norm = float(torch.linalg.vector_norm(part))
        if not math.isfinite(norm) and not bool(torch.isfinite(part).all()):
            excluded[i] = Exclusion(Reason.NON_FINITE, "non-finite")
        elif bound is not None and not norm <= bound * (1 + tolerance) + slack:
            excluded[i] = Exclusion(Reason.NORM, f"norm {norm:.4g} above declared {bound:.4g}")
    remaining = [i for i in range(len(parts)) if i not in excluded]
    if min_cosine is not None:
        shift = reference if reference is not None and reference.shape == (numel,) else None
        directions = [parts[i] if shift is None else parts[i] - shift for i in remaining]
        outliers = _direction_outliers(directions, min_cosine)
        for k, cosine in outliers.items():
            detail = f"cosine {cosine:.3g} below {min_cosine}"
            excluded[remaining[k]] = Exclusion(Reason.COSINE, detail)
    return dict(sorted(excluded.items()))


def _direction_outliers(parts: Sequence[Tensor], min_cosine: float) -> dict[int, float]:
    """Index -> cosine of the parts that point away from the others, worst first, one at a time.

    A part is compared with the coordinate-wise median of the OTHER parts: with few members a
    part's own values pull a median that includes it toward itself (measured: a random vector
    among 3 honest-like ones has cosine ~0.4 with the median of all, ~0 with the others'). With
    a bad part among the others, an honest part's reference is skewed too (in a group of 3 its
    cosine drops to ~0), so only the worst part below `min_cosine` is removed, and the others
    are compared again without it, while at least 3 remain. At most fewer than half of `parts`
    are removed: screening by median assumes an honest majority, and if more look off the
    threshold is wrong for these δs. A zero part, or a zero reference, is not screened.
    """
    left, outliers = list(range(len(parts))), {}
    while len(left) >= _ROBUST_MIN_MEMBERS and 2 * (len(outliers) + 1) < len(parts):
        cosines = cosines_with_the_others([parts[i] for i in left])
        scored = [(c, k) for k, c in enumerate(cosines) if c is not None]
        if not scored or min(scored)[0] >= min_cosine:
            break
        cosine, worst = min(scored)
        outliers[left.pop(worst)] = cosine
    return outliers


def cosines_with_the_others(parts: Sequence[Tensor]) -> list[float | None]:
    """cos(x_i, median of the x_j, j ≠ i) for every i, from one sort of all n parts.

    Leaving x_i out of n sorted values s_0 ≤ … ≤ s_{n-1} shifts the median predictably. n even
    (h = n/2; n-1 left, odd): s_h if x_i ≤ s_{h-1}, else s_{h-1}. n odd (h = (n-1)/2; n-1 left,
    even): (s_h + s_{h+1})/2 if x_i < s_h, (s_{h-1} + s_h)/2 if x_i > s_h, (s_{h-1} + s_{h+1})/2
    if equal. Ties pick equal values, so either branch is right.
    """
    rows, h = sorted_rows(parts), len(parts) // 2
    cosines = []
    if len(parts) % 2 == 0:
        for part in parts:
            others = torch.where(part <= rows[h - 1], rows[h], rows[h - 1])
            cosines.append(cosine_similarity(part, others))
        return cosines
    above, below = _midpoint(rows[h], rows[h + 1]), _midpoint(rows[h - 1], rows[h])
    around = _midpoint(rows[h - 1], rows[h + 1])
    for part in parts:
        others = torch.where(part < rows[h], above, torch.where(part > rows[h], below, around))
        cosines.append(cosine_similarity(part, others))
    return cosines


def cosine_similarity(a: Tensor, b: Tensor) -> float | None:
    """cos(a, b) for finite vectors, None if either is zero."""
    norms = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    # |a·b| ≤ ‖a‖‖b‖: below fp32's largest value the dot product cannot overflow either
    if not 0 < norms < torch.finfo(torch.float32).max:  # zero, or squares under/overflowing
        a_max, b_max = float(a.abs().max()), float(b.abs().max())
        if a_max == 0 or b_max == 0:
            return None
        a, b = a / a_max, b / b_max  # rescaled: the largest magnitude is 1
        norms = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / norms


# --------------------------------------------------------------------------- one part's reduction


def screen_and_aggregate(
    received: Sequence[Tensor | Exclusion],
    weights: Sequence[float],
    bounds: Sequence[float | None] | None,
    aggregation: Aggregation,
    codec: Compression,
    numel: int,
    reference: Tensor | None = None,
) -> tuple[Tensor, dict[int, Exclusion]]:
    """What a reducer computes once every member's part is in: screen, exclude, aggregate.

    `received[i]` is member i's decoded part of `numel` values, or its Exclusion when it could
    not be decoded. Returns the average of the included parts and every exclusion by member
    index (sorted), with its detail. Raises AllReduceFailed if every member is excluded or the
    average is not finite (an fp32 overflow). `reference`: `screen_parts`'.
    """
    excluded = {i: p for i, p in enumerate(received) if isinstance(p, Exclusion)}
    decoded = [i for i, p in enumerate(received) if isinstance(p, Tensor)]
    relative, absolute = norm_tolerance(codec, numel)
    flagged = screen_parts(
        [received[i] for i in decoded],  # type: ignore[misc]  (Tensors by construction)
        [None if bounds is None else bounds[i] for i in decoded],
        numel=numel,
        min_cosine=aggregation.min_cosine,
        tolerance=relative,
        slack=absolute,
        reference=reference,
    )
    excluded |= {decoded[k]: exclusion for k, exclusion in flagged.items()}
    kept = [i for i in range(len(received)) if i not in excluded]
    if not kept:
        raise AllReduceFailed("every member's part was excluded")
    average = aggregate(
        [received[i] for i in kept],  # type: ignore[misc]
        [weights[i] for i in kept],
        aggregation,
    )
    if not bool(torch.isfinite(average).all()):
        raise AllReduceFailed("the reduced part is not finite")
    return average, dict(sorted(excluded.items()))


def check_bounds(bounds: Sequence[float | None] | None, members: int) -> None:
    """ValueError unless `bounds` is None or one bound per member, each None or a number >= 0."""
    if bounds is None:
        return
    if len(bounds) != members:
        raise ValueError(f"need one norm bound per member, got {len(bounds)} for {members}")
    for bound in bounds:
        if bound is not None and not bound >= 0:  # NaN fails too
            raise ValueError(f"a declared norm bound must be None or >= 0, got {bound!r}")


def average_norm_limit(
    bounds: Sequence[float], aggregation: Aggregation, codec: Compression, numel: int
) -> float:
    """The largest L2 norm an honest reducer's decoded average of one part can have, given the
    declared bounds of the members it included: each input within the screening tolerance, the
    aggregate's bound, then one more encoding."""
    relative, absolute = norm_tolerance(codec, numel)
    inputs = [b * (1 + relative) + absolute for b in bounds]
    return aggregate_norm_bound(inputs, aggregation) * (1 + relative) + absolute


def describe_exclusions(by_part: Mapping[int, Mapping[int, Reason]]) -> dict[int, str]:
    """Member index -> why it was excluded, from {part index: {member index: reason}}, e.g.
    "non-finite (parts 0, 2)". The part index names the reducer that made the claim."""
    parts_of: dict[int, dict[Reason, list[int]]] = defaultdict(lambda: defaultdict(list))
    for part in sorted(by_part):
        for member, reason in by_part[part].items():
            parts_of[member][reason].append(part)
    described = {}
    for member in sorted(parts_of):
        entries = []
        for reason, parts in sorted(parts_of[member].items()):
            plural = "s" if len(parts) > 1 else ""
            entries.append(f"{reason.label} (part{plural} {', '.join(map(str, parts))})")
        described[member] = "; ".join(entries)
    return described
