"""A peer's own pseudo-gradient on its way into the swarm state (DESIGN §3 steps 3-5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Contribution:
    """This peer's δ waiting to be applied: trained on `base_version`, maybe several phases."""

    delta: list[torch.Tensor]
    base_version: int
    shard_samples: dict[int, int]
    steps: int

    def merge(self, other: Contribution) -> Contribution:
        samples = dict(self.shard_samples)
        for k, v in other.shard_samples.items():
            samples[k] = samples.get(k, 0) + v
        return Contribution(
            [a + b for a, b in zip(self.delta, other.delta, strict=True)],
            min(self.base_version, other.base_version), samples, self.steps + other.steps,
        )  # fmt: skip
