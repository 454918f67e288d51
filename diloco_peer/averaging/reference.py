"""The all-reduce of one group computed in one process: what `PartExchange.all_reduce` returns on
every member, bit for bit, for the simulator and the tests (allreduce.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diloco_peer.averaging.compression import Compression, decode, encode
from diloco_peer.averaging.partition import chunk_count, part_sizes
from diloco_peer.averaging.robust import Aggregation, Reason, check_bounds, describe_exclusions
from diloco_peer.averaging.wire import answer_part, unpack_answer
from diloco_peer.errors import AllReduceFailed


def all_reduce_in_memory(
    contributions: Sequence[Tensor],
    weights: Sequence[float],
    compression: Compression,
    aggregation: Aggregation = Aggregation(),
    bounds: Sequence[float | None] | None = None,
    num_parts: int | None = None,
) -> Tensor:
    """What `PartExchange.all_reduce` returns on every member, computed in one process.

    `contributions` are the members' flat fp32 vectors in sorted member order; `num_parts` the
    number of reducers (default: every member). Each is cut into parts as the network round
    cuts it, each part encoded and decoded (the sender's bytes), the parts screened and
    aggregated and the answer packed by `answer_part` (the reducer's bytes), then unpacked as a
    member checks it: the same calls in the same order, so the same bits. Raises
    AllReduceFailed where a round would fail (a non-finite average, every member excluded from a
    part).
    """
    average, _ = all_reduce_in_memory_detailed(
        contributions, weights, compression, aggregation, bounds, num_parts
    )
    return average


def all_reduce_in_memory_detailed(
    contributions: Sequence[Tensor],
    weights: Sequence[float],
    compression: Compression,
    aggregation: Aggregation = Aggregation(),
    bounds: Sequence[float | None] | None = None,
    num_parts: int | None = None,
) -> tuple[Tensor, dict[int, str]]:
    """`all_reduce_in_memory`, plus the exclusions every member would learn: member index ->
    why (as `AllReduceResult.excluded` words it)."""
    if not contributions or len(contributions) != len(weights):
        raise ValueError("all_reduce_in_memory needs one weight per contribution")
    numel = contributions[0].numel()
    if any(c.dim() != 1 or c.numel() != numel for c in contributions):
        raise ValueError("contributions must be 1-D tensors of the same length")
    check_bounds(bounds, len(contributions))
    weights = [float(w) for w in weights]
    num_parts = len(contributions) if num_parts is None else num_parts
    if not 1 <= num_parts <= len(contributions):
        raise ValueError(f"num_parts must be in [1, {len(contributions)}], got {num_parts}")
    averaged: list[Tensor] = []
    by_part: dict[int, dict[int, Reason]] = {}
    chunked = [torch.tensor_split(c, chunk_count(numel)) for c in contributions]
    for chunks in zip(*chunked, strict=True):
        split = [torch.tensor_split(chunk, num_parts) for chunk in chunks]
        for j, size in enumerate(part_sizes(chunks[0].numel(), num_parts)):
            received = [decode(encode(parts[j], compression), size, compression) for parts in split]
            try:
                answer, _ = answer_part(received, weights, bounds, aggregation, compression, size)
                claims, average = unpack_answer(
                    answer, bounds, aggregation, compression, members=len(split), numel=size
                )
            except AllReduceFailed as e:
                raise AllReduceFailed(f"part {j}: {e}") from None
            for member, reason in claims.items():
                by_part.setdefault(j, {}).setdefault(member, reason)
            averaged.append(average)
    return torch.cat(averaged), describe_exclusions(by_part)
