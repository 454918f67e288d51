"""The part exchange's wire format (allreduce.py): the part header, the reducer's answer, refusals.

One libp2p stream per (sender, chunk, part) on the handler `<prefix>-part`, each message framed
as hivemind's `P2P.send_raw_data` does (8-byte big-endian length, then the payload):

    sender  -> reducer : PART_HEADER (fixed struct, `PartHeader`)
    sender  -> reducer : the part, `numel` values encoded by compression.py's codec (fp32, fp16,
                         int8 or int4 blockwise; the header names it, every member uses the same)
    reducer -> sender  : OK + receipt + exclusions + the averaged part (same encoding)
                         | ERROR + utf-8 reason                              (`refusal`)
    receipt            : u16 length, the reducer's signature over the round digest, the part
                         and sha256(exclusions + average)  (receipts.py `seal_answer`)
    exclusions         : u16 count, then count × (u16 member index, u8 reason code), indices
                         strictly increasing (little-endian; codes: robust.Reason, 1 non-finite,
                         2 norm, 3 cosine, 4 malformed); count < number of members

A member refuses an answer (AllReduceFailed) whose length is not exactly that, whose indices or
codes are out of range, or whose average is not finite or longer than the aggregate of the
included members' declared norms can be (`robust.average_norm_limit`).

Changing any byte of this format means a new PROTOCOL_VERSION.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_peer.averaging.compression import Compression, decode, encode
from diloco_peer.averaging.robust import (
    Aggregation,
    Exclusion,
    Reason,
    aggregate_norm_bound,
    average_norm_limit,
    screen_and_aggregate,
)
from diloco_peer.errors import AllReduceFailed

MAX_SIGNATURE_BYTES = 1024
"""An RSA-8192 signature (identity.MAX_RSA_BITS); RSA-2048 ones are 256 bytes."""
SIGNATURE_LENGTH = struct.Struct("<H")
"""The u16 length in front of a receipt's signature (receipts.py)."""
SIGNATURE_HEAD = SIGNATURE_LENGTH.size
"""Bytes an answer carries before the signature itself (an unsigned one: these alone)."""

PART_HEADER = struct.Struct("<4sB32s8sIBdQd")
"""magic, protocol version, round digest (sha256), key tag (sha256 of the round key, cut), part
index, codec id, weight, numel, sender's all-reduce timeout (so a reducer that has not started
the round yet knows how long to wait)."""
MAGIC = b"DLCP"
PROTOCOL_VERSION = 4  # 2: answers carry exclusions; 3: chunks and client-mode members; 4: receipts

OK, ERROR = b"OK", b"ER"
"""The two-byte status that starts every answer."""
MAX_REASON_BYTES = 512
"""A refusal's reason is cut to this many bytes."""

_EXCLUSION_COUNT = struct.Struct("<H")
_EXCLUSION = struct.Struct("<HB")  # member index, Reason code


@dataclass(frozen=True)
class PartHeader:
    """What a sender says about the part that follows (PART_HEADER on the wire)."""

    digest: bytes
    """The (sub-)round's digest, agreed at matchmaking."""
    key_tag: bytes
    """`partition.key_tag` of the round key."""
    part: int
    """Which part of the chunk this is (reducer j reduces part j)."""
    codec: int
    """`compression.CODEC_ID` of the part's encoding."""
    weight: float
    """The sender's averaging weight, as agreed at matchmaking."""
    numel: int
    """Values in the part."""
    timeout_s: float
    """What is left of the sender's all-reduce timeout."""

    def pack(self) -> bytes:
        return PART_HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.digest,
            self.key_tag,
            self.part,
            self.codec,
            self.weight,
            self.numel,
            self.timeout_s,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> PartHeader:
        """The header in `raw`; AllReduceFailed unless it is one of this protocol version with
        a finite, positive timeout (the rest is checked against the round, reducer.py)."""
        if len(raw) != PART_HEADER.size:
            raise AllReduceFailed(f"part header of {len(raw)} bytes, expected {PART_HEADER.size}")
        magic, version, digest, tag, part, codec, weight, numel, timeout_s = PART_HEADER.unpack(raw)
        if magic != MAGIC or version != PROTOCOL_VERSION:
            raise AllReduceFailed(f"unknown part protocol {magic!r} v{version}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise AllReduceFailed(f"bad timeout {timeout_s} in part header")
        return cls(digest, tag, part, codec, weight, numel, timeout_s)


def refusal(error: Exception) -> bytes:
    """The answer to a part that failed: ERROR + a short reason."""
    return ERROR + f"{type(error).__name__}: {error}".encode()[:MAX_REASON_BYTES]


def answer_size(members: int, average_bytes: int) -> int:
    """The most bytes `pack_answer` makes in a group of `members` (all but one excluded) for an
    average of `average_bytes` encoded."""
    return _EXCLUSION_COUNT.size + (members - 1) * _EXCLUSION.size + average_bytes


def max_response_size(members: int, part_bytes: int) -> int:
    """The longest answer frame a sender reads for a part of `part_bytes` encoded: the status,
    then a receipt and an answer (whose average is as long as the part), or a refusal's reason."""
    receipt = SIGNATURE_HEAD + MAX_SIGNATURE_BYTES
    return len(OK) + max(receipt + answer_size(members, part_bytes), MAX_REASON_BYTES)


def pack_answer(excluded: Mapping[int, Reason], average: Tensor, codec: Compression) -> bytes:
    """A reducer's answer after OK, serialized once for every member: u16 count, count × (u16
    member index, u8 Reason code) with increasing indices, little-endian, then the average in
    the round's codec."""
    entries = [_EXCLUSION.pack(i, excluded[i]) for i in sorted(excluded)]
    return _EXCLUSION_COUNT.pack(len(excluded)) + b"".join(entries) + encode(average, codec)


def unpack_answer(
    data: bytes,
    bounds: Sequence[float | None] | None,
    aggregation: Aggregation,
    codec: Compression,
    *,
    members: int,
    numel: int,
) -> tuple[dict[int, Reason], Tensor]:
    """(member index -> reason, decoded average) of a reducer's answer, as a member checks it.

    AllReduceFailed unless: the count is below `members` (a reducer with nobody left fails
    instead), the indices strictly increase below `members`, every code is a Reason, the length
    is exact, the average is finite and no longer than the members the reducer included can make
    it (`average_norm_limit`; skipped unless every one of them declared a bound).
    """
    if len(data) < _EXCLUSION_COUNT.size:
        raise AllReduceFailed(f"{len(data)} bytes, too short for an exclusion count")
    (count,) = _EXCLUSION_COUNT.unpack_from(data)
    head = _EXCLUSION_COUNT.size + count * _EXCLUSION.size
    if count >= members or len(data) < head:
        raise AllReduceFailed(f"{count} exclusions of {members} members in {len(data)} bytes")
    excluded: dict[int, Reason] = {}
    previous = -1
    for index, code in _EXCLUSION.iter_unpack(data[_EXCLUSION_COUNT.size : head]):
        if not previous < index < members or code not in Reason._value2member_map_:
            raise AllReduceFailed(f"exclusion of member {index} for reason {code}")
        excluded[index], previous = Reason(code), index
    average = decode(data[head:], numel, codec)  # AllReduceFailed unless exactly the right size
    if not bool(torch.isfinite(average).all()):
        raise AllReduceFailed("a non-finite average")
    included = [b for i, b in enumerate(bounds or ()) if i not in excluded]
    if included and None not in included:
        limit = average_norm_limit(included, aggregation, codec, numel)  # type: ignore[arg-type]
        norm = float(torch.linalg.vector_norm(average))
        if not norm <= limit:
            raise AllReduceFailed(f"an implausible average (norm {norm:.4g} above {limit:.4g})")
    return excluded, average


def answer_part(
    received: Sequence[Tensor | Exclusion],
    weights: Sequence[float],
    bounds: Sequence[float | None] | None,
    aggregation: Aggregation,
    codec: Compression,
    numel: int,
    bias: bool = False,
    reference: Tensor | None = None,
) -> tuple[bytes, dict[int, Exclusion]]:
    """What a reducer answers once every member's part is in: screen, exclude, aggregate
    (`robust.screen_and_aggregate`), and serialize the answer (`pack_answer`) once, for
    every member. Returns the answer and every exclusion by member index, with its detail.

    `bias` is a test-only fault: the answer is a fixed direction (the same in every round),
    as long as the members' check allows (the longest declared norm it included, for a mean),
    instead of the average: a reducer patched to steer its part within the norm bound.
    `reference`: what the direction screen takes out of every part (`robust.screen_parts`)."""
    average, excluded = screen_and_aggregate(
        received, weights, bounds, aggregation, codec, numel, reference
    )
    included = [b for i, b in enumerate(bounds or ()) if b is not None and i not in excluded]
    if bias and included:
        direction = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        limit = 0.9 * aggregate_norm_bound(included, aggregation)
        average = direction * (limit / float(direction.norm()))
    reasons = {i: exclusion.reason for i, exclusion in excluded.items()}
    return pack_answer(reasons, average, codec), excluded
