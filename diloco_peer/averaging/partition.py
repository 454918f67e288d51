"""How a round cuts a flat vector: chunks (sub-rounds), parts (one per reducer), and the names
that tie a part to its round. Every member derives the same from the same plan (allreduce.py)."""

from __future__ import annotations

import hashlib

CHUNK_VALUES = 1 << 20
"""A vector is pipelined in chunks of at least this many values (4 MiB of fp32)."""
MAX_CHUNKS = 8


def chunk_count(numel: int) -> int:
    """How many chunks a round of `numel` values goes in (every member derives the same).

    One part message per reducer means two phases: every part in, then every average out, each
    one stream per peer pair, and an emulated 100 Mbit link carried about 0.6 of its rate (bench/
    wan.py). With chunks, a reducer sends a chunk's averages while the next chunks' parts are
    still coming in, and each peer pair has one stream per chunk in flight. Each chunk is
    screened and aggregated on its own (robust.py); a member's declared norm bounds every
    chunk of its vector too. Vectors under 2 × CHUNK_VALUES go in one chunk, as before.
    """
    return max(1, min(MAX_CHUNKS, numel // CHUNK_VALUES))


def part_sizes(numel: int, num_parts: int) -> list[int]:
    """Sizes of `num_parts` near-equal contiguous parts, larger ones first (torch.tensor_split)."""
    base, extra = divmod(numel, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def chunk_digest(digest: bytes, chunk: int, chunks: int) -> bytes:
    """The digest of chunk `chunk`'s sub-round: the round's own when it goes in one chunk,
    sha256(digest + chunk index) otherwise."""
    if chunks == 1:
        return digest
    return hashlib.sha256(digest + chunk.to_bytes(4, "big")).digest()


def key_tag(key: str) -> bytes:
    """8 bytes that name a round key in part headers."""
    return hashlib.sha256(key.encode()).digest()[:8]
