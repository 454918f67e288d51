"""Streaming DiLoCo's fragments (ALGORITHMS §1.2): which parameters each fragment holds.

The model's parameters are cut into P fragments by transformer block (block i in fragment
i mod P, the paper's strided pattern; the parameters before the first block, the embedding, go
with fragment 0, those after the last, the final norm and the head, with fragment P − 1). The
simulator syncs them on its own schedule (`sim/fragments.py`); a swarm syncs fragment v mod P
at version v (`ReplicatedState.part`). Pure: names in, indices out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from diloco_peer.errors import ConfigError

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def fragment_of(names: Sequence[str], count: int) -> list[int]:
    """Each parameter's fragment, by name: transformer block i in fragment i mod `count`; the
    parameters before the first block in fragment 0, those after the last in `count` − 1.
    Raises ConfigError when a fragment would be empty (more fragments than blocks)."""
    blocks = [_BLOCK.search(n) for n in names]
    indices = [int(m.group(1)) for m in blocks if m]
    if count < 1 or len(set(indices)) < count:
        raise ConfigError(
            f"fragments {count} needs as many transformer blocks; "
            f"the model has {len(set(indices))} transformer blocks"
        )
    out, seen_block = [], False
    for m in blocks:
        if m:
            seen_block = True
            out.append(int(m.group(1)) % count)
        else:
            out.append(count - 1 if seen_block else 0)
    return out


def fragment_parts(names: Sequence[str], count: int) -> list[list[int]]:
    """The parameter indices of each of `count` fragments, in parameter order (`fragment_of`);
    one part holding every index when `count` is 1."""
    if count == 1:
        return [list(range(len(names)))]
    of = fragment_of(names, count)
    return [[i for i, f in enumerate(of) if f == j] for j in range(count)]
