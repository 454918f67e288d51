"""What the simulator does with the workers' pseudo-gradients δ before an outer step: their sum
as a swarm would hand it to the outer optimizer, and their mean pairwise cosine similarity.

Compression (RunSpec.compression, RunSpec.prune_fraction) costs what it costs a swarm: a group of
two or more (a sync round, a `dn` grace-period group) is averaged by `all_reduce_in_memory`, the
swarm's own part split, codec and reduction (each δ pruned, each part encoded and decoded, the
average encoded and decoded once more); a group of one is applied as it is, as a lone swarm peer
applies its own δ. The naive async baselines, whose server applies each contribution alone, get
each δ pruned, encoded and decoded once (the upload). With `none` and no pruning nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from diloco_peer.averaging.compression import prune, round_trip
from diloco_peer.averaging.reference import all_reduce_in_memory
from diloco_peer.config import RunSpec


def mean_pairwise_cosine(deltas: Sequence[Sequence[torch.Tensor]]) -> float | None:
    """Mean pairwise cosine similarity of flattened pseudo-gradients (DiLoCo Fig. 10)."""
    if len(deltas) < 2:
        return None
    flat = torch.stack([torch.cat([t.flatten() for t in d]) for d in deltas]).double()
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    gram = unit @ unit.T
    m = len(deltas)
    return float((gram.sum() - gram.diagonal().sum()) / (m * (m - 1)))


def plain_sum(deltas: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Σ δ, tensor by tensor, with nothing lost on a wire."""
    return [torch.stack(ts).sum(0) for ts in zip(*deltas, strict=True)]


def lossy_wire(run: RunSpec) -> bool:
    """Whether the run's compression or pruning changes what a contribution carries."""
    return run.compression != "none" or run.prune_fraction > 0


def sent(delta: Sequence[torch.Tensor], run: RunSpec) -> torch.Tensor:
    """One contribution as a peer sends it: its tensors pruned, then flattened (fp32)."""
    flat = [t.detach().reshape(-1).to(torch.float32) for t in delta]
    if run.prune_fraction > 0:
        flat = [prune(t, run.prune_fraction) for t in flat]
    return torch.cat(flat)


def group_sum(deltas: Sequence[Sequence[torch.Tensor]], run: RunSpec) -> list[torch.Tensor]:
    """Σ δ of a group as a swarm applies it: count × the all-reduced average (what
    ReplicatedState.apply hands the outer optimizer; equal weights, as the simulator's mean
    has), or the plain sum without compression."""
    if not lossy_wire(run) or len(deltas) < 2:
        return plain_sum(deltas)
    shapes = [t.shape for t in deltas[0]]
    average = all_reduce_in_memory(
        [sent(d, run) for d in deltas], [1.0] * len(deltas), run.compression
    )
    parts = average.split([math.prod(shape) for shape in shapes])
    return [a.view(shape) * len(deltas) for a, shape in zip(parts, shapes, strict=True)]


def uploaded(delta: list[torch.Tensor], run: RunSpec) -> list[torch.Tensor]:
    """One contribution as a server receives it (the naive async baselines)."""
    if not lossy_wire(run):
        return delta
    shapes = [t.shape for t in delta]
    flat = round_trip(sent(delta, run), run.compression)
    parts = flat.split([math.prod(shape) for shape in shapes])
    return [a.view(shape) for a, shape in zip(parts, shapes, strict=True)]
