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
    return None if damping is None else [swarm.keep * t for t in damping]


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
    checkpoint; with fragments, also the progress the last round did not sync), and the one it
    applied last, which goes into a later group again if the branch it produced loses a fork
    (DESIGN §3)."""

    def __init__(self, fragmented: bool = False) -> None:
        self.pending: Contribution | None = None
        self.last_own: tuple[int, Contribution] | None = None
        """(the version it produced, the δ)."""
        self.fragmented = fragmented
        """Fragments (docs/algorithms.md §1.3): a round sends one fragment of the δ (`send`),
        and the next phase trains from θ − pending (`carried`), so `take` does not add the
        pending tensors again."""

    def add(self, contribution: Contribution) -> None:
        self.pending = contribution if self.pending is None else self.pending.merge(contribution)

    def take(self, fresh: Contribution) -> Contribution:
        """`fresh` with whatever was pending merged in; nothing is pending afterwards. With
        fragments `fresh` was trained from θ − `carried()`: its δ holds the pending one, whose
        samples and steps (not yet applied) join it."""
        if self.pending is None:
            return fresh
        pending, self.pending = self.pending, None
        merged = pending.merge(fresh)
        if not self.fragmented:
            return merged
        return Contribution(fresh.delta, fresh.base_version, merged.shard_samples, merged.steps)

    def carried(self) -> list[torch.Tensor] | None:
        """Fragments: the pending δ, which the next phase starts from θ − it; else None."""
        return self.pending.delta if self.fragmented and self.pending is not None else None

    def send(self, mine: Contribution, part: list[int]) -> Contribution:
        """What a round sends of `mine`: with fragments, the fragment `part` indexes, the rest
        waiting here for a later phase to train on (`split`); else all of it."""
        if not self.fragmented:
            return mine
        sent, rest = split(mine, part)
        if any(bool(t.any()) for t in rest.delta):  # nothing left: the flush synced it all
            self.add(rest)
        return sent

    def unsynced(self, parts: list[list[int]]) -> list[int]:
        """The fragments (indices into `parts`) the pending δ holds progress on."""
        if self.pending is None:
            return []
        delta = self.pending.delta
        return [f for f, part in enumerate(parts) if any(bool(delta[i].any()) for i in part)]

    def forget(self, parts: list[list[int]]) -> None:
        """A restart from a checkpoint that rounds of ours outlived: the first of them carried
        the pending δ's samples and steps, each its progress on its fragment (`parts`); none
        of it is offered again (`peer_checkpoint.sent_since`)."""
        if self.pending is None or not parts:
            return
        gone = {i for part in parts for i in part}
        delta = [torch.zeros_like(d) if i in gone else d for i, d in enumerate(self.pending.delta)]
        left = any(bool(d.any()) for d in delta)
        self.pending = Contribution(delta, self.pending.base_version, {}, 0) if left else None

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


def split(mine: Contribution, part: list[int]) -> tuple[Contribution, Contribution]:
    """Fragments: (the δ of the fragment `part` indexes, with the phase's samples and steps, for
    the round; the other fragments' progress, which the next phase trains on from θ − it)."""
    inside = set(part)
    kept = [torch.zeros_like(d) if i in inside else d for i, d in enumerate(mine.delta)]
    sent = [d if i in inside else torch.zeros_like(d) for i, d in enumerate(mine.delta)]
    return (
        Contribution(sent, mine.base_version, mine.shard_samples, mine.steps),
        Contribution(kept, mine.base_version, {}, 0),
    )
