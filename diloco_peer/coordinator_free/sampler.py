"""Shard sampler: pick the shard for a new phase so that every shard gets its share (§2.5).

Eq. 2 of arXiv 2401.09135: `pᵢ ∝ max(|Dᵢ| / Σⱼ|Dⱼ| − nᵢ / Σⱼnⱼ, 0)`, nᵢ the samples already
trained on shard i. Shards behind their share are favoured, shards ahead of it are never picked.
If no sample was trained yet or every term is 0 (exactly on target), fall back to `pᵢ ∝ |Dᵢ|`.

The terms are computed in integers: `|Dᵢ|/S − nᵢ/N = (|Dᵢ|·N − nᵢ·S) / (S·N)`, so "every term
is 0" is an exact test (floats would leave 1e-17 residues that put all the mass on one shard),
and a draw depends on nothing but the integers and the seeded generator, on every peer alike.
"""

from __future__ import annotations

import bisect
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
