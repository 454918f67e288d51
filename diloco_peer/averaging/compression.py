"""Pseudo-gradient encodings on the wire, and magnitude pruning (DiLoCo §3.3, Table 6).

Every codec turns a 1-D fp32 tensor into bytes and back, the same way on every machine: the byte
layout is little-endian and fixed, and `decode` is one correctly rounded fp32 operation per value
(IEEE, so the same bytes decode to the same bits everywhere). Bit-identical averages still rely on
the all-reduce's invariant (allreduce.py): a reducer encodes an average once and every member
decodes those same bytes.

    codec  bytes for n values                     vs fp32 (large n)
    none   4·n      little-endian fp32            1×
    fp16   2·n      little-endian fp16            2×
    int8   4·⌈n/128⌉ + n        blockwise absmax   3.88×
    int4   4·⌈n/128⌉ + ⌈n/2⌉    blockwise absmax   7.53×

Blockwise absmax quantization (int8, int4), as in Dettmers et al. 2022 ("8-bit optimizers via
block-wise quantization") without their non-linear code book: the values are cut into blocks of
`BLOCK_SIZE` consecutive values (the last one shorter); a block's scale is s = absmax / q_max (fp32,
q_max = 127 for int8, 7 for int4) and each value x becomes q = round(x / s) in [-q_max, q_max]
(round half to even), decoded as q·s. The error of a value is at most s/2 = absmax/(2·q_max) plus
fp32 rounding. The layout is every block's scale (`<f4`) first, then the codes: one signed byte
each for int8; for int4 two codes per byte, stored as q + 8 (1..15), the earlier value in the low
nibble, an odd count padded with the code of 0. 128 values per block with an fp32 scale keeps the
scale overhead at 1/32 byte per value: int8 ≥ 3.5× and int4 ≥ 7× smaller than fp32 with margin,
and no scale can overflow or lose precision as an fp16 one would.

Pruning (`prune`) zeroes the smallest magnitudes of one tensor. It saves bytes only with a sparse
encoding, which none of these codecs is: today it only costs quality (and models DiLoCo Table 6).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from diloco_peer.config import COMPRESSIONS
from diloco_peer.config import CompressionName as Compression
from diloco_peer.errors import AllReduceFailed

__all__ = ["COMPRESSIONS", "Compression"]  # re-exported: the names are config.py's
CODEC_ID: dict[str, int] = {"none": 0, "fp16": 1, "int8": 2, "int4": 3}
"""The codec byte of the part header (wire.py) (never reuse a number for another encoding)."""

BLOCK_SIZE = 128
"""Values per quantization block (one fp32 scale each)."""
_Q_MAX: dict[str, int] = {"int8": 127, "int4": 7}
_FLOAT_DTYPE: dict[str, np.dtype] = {"none": np.dtype("<f4"), "fp16": np.dtype("<f2")}
_SCALE_DTYPE = np.dtype("<f4")
_INT4_OFFSET = 8  # a stored nibble is q + 8, so q = 0 is 0b1000 and nibble 0 is never valid


def _check_codec(codec: str) -> None:
    if codec not in CODEC_ID:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {codec!r}")


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK_SIZE)


def quantization_step(codec: str) -> float | None:
    """1 / q_max of a quantizing codec (a block's worst error is absmax · step / 2); None for
    the float codecs."""
    _check_codec(codec)
    q_max = _Q_MAX.get(codec)
    return None if q_max is None else 1.0 / q_max


def encoded_size(numel: int, codec: Compression) -> int:
    """Bytes `encode` makes of `numel` values."""
    _check_codec(codec)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    if codec in _FLOAT_DTYPE:
        return numel * _FLOAT_DTYPE[codec].itemsize
    codes = numel if codec == "int8" else (numel + 1) // 2
    return _blocks(numel) * _SCALE_DTYPE.itemsize + codes


def encode(values: Tensor, codec: Compression) -> bytes:
    """A 1-D tensor's values as `codec` bytes (see the module docstring for the layout).

    fp16 saturates at ±65504 (as hivemind's Float16Compression does) instead of turning large
    values into inf, which every reducer would refuse. The quantizing codecs need finite values
    (ValueError otherwise).
    """
    _check_codec(codec)
    values = values.detach().reshape(-1).to("cpu", torch.float32)
    if codec in _FLOAT_DTYPE:
        if codec == "fp16":
            values = values.clamp(torch.finfo(torch.float16).min, torch.finfo(torch.float16).max)
        array = values.contiguous().numpy()
        return array.astype(_FLOAT_DTYPE[codec], copy=False).tobytes()
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{codec} encodes finite values only")
    q_max, numel = _Q_MAX[codec], values.numel()
    blocks = torch.zeros(_blocks(numel) * BLOCK_SIZE, dtype=torch.float32)
    blocks[:numel] = values
    blocks = blocks.view(-1, BLOCK_SIZE)  # [num_blocks, BLOCK_SIZE], zero padded
    scales = blocks.abs().amax(dim=1) / q_max  # [num_blocks]; exact absmax, one rounding
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero blocks: q = 0
    codes = torch.round(blocks / divisors[:, None]).clamp_(-q_max, q_max)
    codes_np = codes.reshape(-1)[:numel].to(torch.int8).numpy()
    if codec == "int4":
        nibbles = (codes_np + np.int8(_INT4_OFFSET)).astype(np.uint8)  # 1..15
        if numel % 2:
            nibbles = np.append(nibbles, np.uint8(_INT4_OFFSET))
        codes_np = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    return scales.numpy().astype(_SCALE_DTYPE, copy=False).tobytes() + codes_np.tobytes()


def decode(data: bytes, numel: int, codec: Compression) -> Tensor:
    """Inverse of `encode`: always a fresh fp32 tensor of `numel` elements.

    Raises AllReduceFailed for bytes no encoder makes: a wrong length, and for int8/int4 a scale
    that is not finite or not positive (a negative zero included), a code outside
    [-q_max, q_max], or a value that decodes to inf.
    """
    expected = encoded_size(numel, codec)
    if len(data) != expected:
        raise AllReduceFailed(f"expected {expected} bytes of {codec}, got {len(data)}")
    if codec in _FLOAT_DTYPE:
        array = np.frombuffer(data, dtype=_FLOAT_DTYPE[codec]).astype(np.float32)  # a copy
        return torch.from_numpy(array)
    q_max, num_blocks = _Q_MAX[codec], _blocks(numel)
    scales = np.frombuffer(data, dtype=_SCALE_DTYPE, count=num_blocks).astype(np.float32)
    if not (np.isfinite(scales).all() and not np.signbit(scales).any()):
        raise AllReduceFailed(f"{codec} block scale is not a finite number >= 0")
    raw = np.frombuffer(data, dtype=np.uint8, offset=num_blocks * _SCALE_DTYPE.itemsize)
    if codec == "int8":
        codes = raw.view(np.int8)
    else:
        nibbles = np.empty(2 * raw.size, dtype=np.int8)
        nibbles[0::2] = raw & 0x0F
        nibbles[1::2] = raw >> 4
        codes = nibbles - np.int8(_INT4_OFFSET)
    if codes.size and int(np.abs(codes.astype(np.int16)).max()) > q_max:
        raise AllReduceFailed(f"{codec} code outside [-{q_max}, {q_max}]")
    # one fp32 multiply per value, correctly rounded: the same bits on every machine
    with np.errstate(over="ignore"):  # refused just below
        values = codes[:numel].astype(np.float32) * np.repeat(scales, BLOCK_SIZE)[:numel]
    if not np.isfinite(values).all():
        raise AllReduceFailed(f"{codec} values decode to inf")
    return torch.from_numpy(values)


def round_trip(values: Tensor, codec: Compression) -> Tensor:
    """`decode(encode(values))`: what the other side of the wire holds."""
    return decode(encode(values, codec), values.numel(), codec)


def prune(values: Tensor, fraction: float) -> Tensor:
    """A copy of `values` with its ⌊fraction · numel⌋ smallest magnitudes set to zero (DiLoCo
    Table 6: pruning 50% of each tensor's pseudo-gradient costs +0.4% perplexity).

    Among values of equal magnitude at the threshold, those at lower flat indices are zeroed
    first, so the result does not depend on the sorting algorithm. `fraction` in [0, 1); the
    values must be finite. Applied per tensor, before the tensors are flattened into one vector.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"prune fraction must be a number, got {fraction!r}")
    if not 0 <= fraction < 1:
        raise ValueError(f"prune fraction must be in [0, 1), got {fraction!r}")
    out = values.detach().clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    count = math.floor(fraction * flat.numel())
    if count == 0:
        return out
    magnitude = flat.abs()
    threshold = magnitude.kthvalue(count).values  # the count-th smallest magnitude
    below = magnitude < threshold
    ties = (magnitude == threshold).nonzero().view(-1)[: count - int(below.sum())]
    flat[below] = 0
    flat[ties] = 0
    return out
