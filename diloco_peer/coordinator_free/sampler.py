"""Shard sampler: pick the shard for a new phase so that every shard gets its share (§2.5).

Eq. 2 of arXiv 2401.09135: `pᵢ ∝ max(|Dᵢ| / Σⱼ|Dⱼ| − nᵢ / Σⱼnⱼ, 0)`, nᵢ the samples already
trained on shard i. Shards behind their share are favoured, shards ahead of it are never picked.
If no sample was trained yet or every term is 0 (exactly on target), fall back to `pᵢ ∝ |Dᵢ|`.

The terms are computed in integers: `|Dᵢ|/S − nᵢ/N = (|Dᵢ|·N − nᵢ·S) / (S·N)`, so "every term
is 0" is an exact test (floats would leave 1e-17 residues that put all the mass on one shard),
and a draw depends on nothing but the integers and the seeded generator, on every peer alike.

`fill_shards` is the same rule made exact for a swarm: instead of one draw putting a whole phase
on one shard, a phase's steps go to the shards that are furthest behind their share of the
total after the phase (water-filling Eq. 2's terms). A real run ends at a fixed number of steps,
and a phase of H steps is a large part of a shard's share at the end (50 steps of 16 samples are
40% of a shard's 2,000 after 1,000 steps over 8 shards): draws of whole phases leave shares tens of
percent off, filling keeps every shard within one step of its share.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_peer.errors import ConfigError


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    out = list(sizes)
    if not out:
        raise ConfigError("at least one shard is needed")
    for i, size in enumerate(out):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigError(f"shard size {i} must be an integer > 0, got {size!r}")
    return out


def _weights(sizes: list[int], counts: Sequence[int]) -> list[int]:
    """Integer weights proportional to the probabilities of Eq. 2 (with its fallback)."""
    counts = list(counts)
    if len(counts) != len(sizes):
        raise ConfigError(f"got {len(counts)} sample counts for {len(sizes)} shards")
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"sample count of shard {i} must be an integer >= 0, got {n!r}")
    total_size, total_count = sum(sizes), sum(counts)
    if total_count == 0:
        return sizes
    terms = [max(d * total_count - n * total_size, 0) for d, n in zip(sizes, counts, strict=True)]
    return terms if any(terms) else sizes


def shard_probabilities(sizes: Sequence[int], counts: Sequence[int]) -> list[float]:
    """Eq. 2 probabilities (ALGORITHMS §2.5) for shards of `sizes` with `counts` samples trained.

    Raises `ConfigError` unless sizes are ints > 0 and counts are ints >= 0 of the same length.
    """
    weights = _weights(_check_sizes(sizes), counts)
    total = sum(weights)
    return [w / total for w in weights]


def fill_shards(
    sizes: Sequence[int],
    counts: Sequence[int],
    steps: int,
    batch: int,
    rng: random.Random,
    others: int = 0,
) -> list[int]:
    """Steps per shard for a phase of `steps` steps of `batch` samples, given `counts` samples
    already trained (or in flight) per shard: the steps go to the shards furthest below their
    share |Dᵢ|/Σ|D| of the total after the phase (Eq. 2's terms, made exact: water-filling).

    `others` are the steps that peers planning at the same moment, unseen, will add (a sync
    round's other peers, the other members of the group just committed): the fill is computed
    for all of them together and this phase takes its part, `steps` of every `steps + others`,
    so that concurrent planners do not each correct the same shortfall in full. Ties and
    rounding are broken by `rng`, so peers that plan at the same moment round differently.
    Raises `ConfigError` on bad sizes or counts, or `steps` or `others` < 0, `batch` < 1.
    """
    sizes = _check_sizes(sizes)
    _weights(sizes, counts)  # validates counts
    for name, value in (("steps", steps), ("others", others)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be an integer >= 1, got {batch!r}")
    total_size, all_steps = sum(sizes), steps + others
    final = sum(counts) + all_steps * batch
    # Deficit of shard i at the final total, scaled by Σ|D| to stay in integers.
    heap = [(-(d * final - n * total_size), rng.random(), i)
            for i, (d, n) in enumerate(zip(sizes, counts, strict=True))]  # fmt: skip
    heapq.heapify(heap)
    fill = [0] * len(sizes)
    for _ in range(all_steps):
        deficit, tie, i = heapq.heappop(heap)
        fill[i] += 1
        heapq.heappush(heap, (deficit + batch * total_size, tie, i))
    if others == 0:
        return fill
    # This phase's part of the fill, `steps`/`all_steps` of each shard's, rounded to whole
    # steps by largest remainder (integers: fill[i]·steps = q·all_steps + r).
    out = [f * steps // all_steps for f in fill]
    order = sorted(
        range(len(sizes)), key=lambda i: (fill[i] * steps % all_steps, rng.random()), reverse=True
    )
    for i in order[: steps - sum(out)]:
        out[i] += 1
    return out


class ShardSampler:
    """Draws the shard of each new phase from Eq. 2 (ALGORITHMS §2.5), deterministically.

    It owns a `random.Random(seed)`; peers that share the seed and the counts draw the same
    shards. `state_dict()` is JSON data so that the generator travels with the replicated state.
    """

    def __init__(self, sizes: Sequence[int], seed: int) -> None:
        """`sizes`: |Dᵢ| per shard (ints > 0); `seed`: the generator's seed (int)."""
        self.sizes = _check_sizes(sizes)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self._rng = random.Random(seed)

    def sample(self, counts: Sequence[int]) -> int:
        """Index of the shard for the next phase, given the samples trained per shard so far."""
        weights = _weights(self.sizes, counts)
        cumulative = list(itertools.accumulate(weights))
        # Integer draw in [0, total): exact, and shards with weight 0 can never be chosen.
        return bisect.bisect_right(cumulative, self._rng.randrange(cumulative[-1]))

    def state_dict(self) -> dict[str, Any]:
        """`{"sizes", "seed", "rng"}` as JSON data; `rng` is `random.getstate()` as lists."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "sizes": list(self.sizes),
            "seed": self.seed,
            "rng": [version, list(internal), gauss_next],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; raises `ConfigError` if the shard sizes differ or the
        generator state is malformed (nothing changes then)."""
        if not isinstance(state, Mapping) or not {"sizes", "rng"} <= set(state):
            raise ConfigError("shard sampler state must be a mapping with 'sizes' and 'rng'")
        if list(state["sizes"]) != self.sizes:
            raise ConfigError(
                f"shard sampler state is for shard sizes {state['sizes']}, not {self.sizes}"
            )
        seed = state.get("seed", self.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"shard sampler state has a non-integer seed {seed!r}")
        rng = random.Random()
        try:
            version, internal, gauss_next = state["rng"]
            rng.setstate((version, tuple(internal), gauss_next))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed shard sampler generator state: {exc}") from exc
        self._rng = rng
        self.seed = seed
