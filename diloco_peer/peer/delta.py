"""A peer's own pseudo-gradient on its way into the swarm state (DESIGN §3 steps 3-5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from diloco_peer.config import SwarmSettings


class Damped(Protocol):
    def last_damping(self) -> list[torch.Tensor] | None: ...


def common_term(swarm: SwarmSettings, replica: Damped) -> list[torch.Tensor] | None:
    """What an overlapped `mix` δ offered at the replica's version v carries besides the phases'
    progress: κ·(Δ − (θ_{v−1} − θ_v)) of the update that made v, the same for every member of a
    group keyed by v (ALGORITHMS §1.1). None for other rules, blocking rounds, and a replica
    that does not know it (`Replica.last_damping`)."""
    damping = replica.last_damping() if swarm.mixes else None
    return None if damping is None else [swarm.overlap_keep * t for t in damping]


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


class Ledger:
    """This peer's own δs not yet settled: the pending one (from a failed group, a pause or a
    checkpoint), and the one it applied last, which goes into a later group again if the branch
    it produced loses a fork (DESIGN §3)."""

    def __init__(self) -> None:
        self.pending: Contribution | None = None
        self.last_own: tuple[int, Contribution] | None = None
        """(the version it produced, the δ)."""

    def add(self, contribution: Contribution) -> None:
        self.pending = contribution if self.pending is None else self.pending.merge(contribution)

    def take(self, fresh: Contribution) -> Contribution:
        """`fresh` with whatever was pending merged in; nothing is pending afterwards."""
        if self.pending is None:
            return fresh
        merged, self.pending = self.pending.merge(fresh), None
        return merged

    def owns(self, version: int) -> bool:
        """Our own δ produced `version` (and would go into a later group if it lost a fork)."""
        return self.last_own is not None and self.last_own[0] == version

    def recontribute(self, lost_version: int) -> bool:
        """Our branch at `lost_version` lost: the δ that produced it goes into the next group."""
        if self.last_own is None or self.last_own[0] != lost_version:
            return False
        own = self.last_own[1]
        self.last_own = None
        self.add(own)
        return True
