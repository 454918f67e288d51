"""Pseudo-gradient codecs and pruning (averaging/compression.py), their in-memory all-reduce,
and the run manifest and simulator settings that choose them."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_peer.averaging.compression import (
    BLOCK_SIZE,
    CODEC_ID,
    COMPRESSIONS,
    decode,
    encode,
    encoded_size,
    prune,
    quantization_step,
    round_trip,
)
from diloco_peer.averaging.partition import part_sizes
from diloco_peer.averaging.reference import all_reduce_in_memory
from diloco_peer.averaging.robust import reduce_part
from diloco_peer.config import RunSpec, SimSpec
from diloco_peer.errors import AllReduceFailed, ConfigError
from diloco_peer.sim.contributions import group_sum, plain_sum
from diloco_peer.sim.simulator import Simulator

QUANTIZED = ("int8", "int4")
FP32_ULP = 2.0**-23


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose scale changes by block (1e-6 .. 1e3): blocks must not share scales."""
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-6, 4, (numel // 50 + 1,), generator=generator).float()
    return torch.randn(numel, generator=generator) * scales.repeat_interleave(50)[:numel]


def block_bound(values: torch.Tensor, codec: str) -> torch.Tensor:
    """Per value, the worst error of a quantizing codec: absmax(its block) / (2·q_max), with
    room for the fp32 roundings of the scale, the division and the product."""
    step = quantization_step(codec)
    assert step is not None
    padded = torch.zeros(-(-values.numel() // BLOCK_SIZE) * BLOCK_SIZE)
    padded[: values.numel()] = values.abs()
    absmax = padded.view(-1, BLOCK_SIZE).amax(dim=1).repeat_interleave(BLOCK_SIZE)
    absmax = absmax[: values.numel()].double()
    return absmax * step / 2 * (1 + 1e-5) + absmax * 4 * FP32_ULP


# --------------------------------------------------------------------------- codecs


@pytest.mark.timeout(10)
@pytest.mark.parametrize("numel", [0, 1, 2, 127, 128, 129, 1001, 40_000])
def test_round_trip_error_per_codec(numel: int) -> None:
    x = _values(numel, seed=numel)
    assert torch.equal(round_trip(x, "none"), x)
    assert torch.equal(round_trip(x, "fp16"), x.half().float())
    for codec in QUANTIZED:
        y = round_trip(x, codec)
        assert y.dtype == torch.float32 and y.shape == x.shape
        error = (y.double() - x.double()).abs()
        assert bool((error <= block_bound(x, codec)).all()), codec
        # the bound is tight: rounding really happened at the stated resolution
        if numel >= 1001:
            ratio = (error / block_bound(x, codec)).max().item()
            assert 0.9 < ratio <= 1, (codec, ratio)


@pytest.mark.timeout(10)
def test_extremes_keep_their_sign_and_magnitude() -> None:
    x = torch.tensor([3.0, -3.0, 0.0, -0.0, 1e-30, 2.0])
    for codec in QUANTIZED:
        y = round_trip(x, codec)
        assert y[0].item() == pytest.approx(3.0, rel=1e-6) and y[1].item() == -y[0].item()
        assert y[2].item() == 0.0 and y[3].item() == 0.0 and y[4].item() == 0.0
    assert round_trip(torch.tensor([1e6]), "fp16").item() == 65504.0  # saturates, not inf
    for codec in COMPRESSIONS:  # an all-zero block has scale 0 and decodes to zeros
        assert torch.equal(round_trip(torch.zeros(300), codec), torch.zeros(300))


@pytest.mark.timeout(10)
def test_golden_bytes() -> None:
    """The wire layout, byte for byte (little-endian on every machine)."""
    x = torch.tensor([1.0, -0.6, 0.3, 0.0])
    assert encode(x, "none") == struct.pack("<4f", 1.0, -0.6, 0.3, 0.0)
    assert encode(x, "fp16") == struct.pack("<4e", 1.0, -0.6, 0.3, 0.0)
    # scale 1/127; -76.2 -> -76, 38.1 -> 38
    assert encode(x, "int8") == struct.pack(
        "<f4b", np.float32(1.0) / np.float32(127), 127, -76, 38, 0
    )
    # scale 1/7; codes 7, -4.2 -> -4, 2.1 -> 2, 0 stored as q + 8 = 15, 4, 10, 8, low nibble first
    assert encode(x, "int4") == struct.pack("<f", np.float32(1.0) / np.float32(7)) + bytes(
        [0x4F, 0x8A]
    )
    # an odd count: the last byte's high nibble holds the code of 0
    assert encode(torch.tensor([1.0, -1.0, 1.0]), "int4")[4:] == bytes([0x1F, 0x8F])
    # a second block starts after BLOCK_SIZE values, with its own scale
    two = encode(torch.cat([torch.full((BLOCK_SIZE,), 2.0), torch.tensor([-4.0])]), "int8")
    assert struct.unpack("<2f", two[:8]) == pytest.approx((2 / 127, 4 / 127))
    assert two[8:] == bytes([127]) * BLOCK_SIZE + struct.pack("b", -127)


@pytest.mark.timeout(10)
def test_encoded_sizes_and_ratios_against_fp32() -> None:
    for codec in COMPRESSIONS:
        for numel in (0, 1, 2, 127, 128, 129, 255, 1001):
            assert len(encode(_values(numel), codec)) == encoded_size(numel, codec)
    assert encoded_size(256, "int8") == 2 * 4 + 256 and encoded_size(257, "int4") == 3 * 4 + 129
    # a large tensor, and a 3-member part of tests/test_group_averager.py's contribution
    for numel in (1_000_000, 100_208):
        fp32 = encoded_size(numel, "none")
        assert fp32 / encoded_size(numel, "fp16") == 2
        assert fp32 / encoded_size(numel, "int8") >= 3.5
        assert fp32 / encoded_size(numel, "int4") >= 7
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            encoded_size(bad, "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encoded_size(4, "int2")  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_encoding_is_deterministic() -> None:
    x = _values(10_007, seed=3)
    for codec in COMPRESSIONS:
        first = encode(x, codec)
        assert encode(x.clone(), codec) == first
        assert encode(x.view(1, -1), codec) == first  # any shape: its values in order
        again = decode(first, x.numel(), codec)
        assert torch.equal(again, decode(first, x.numel(), codec))
        assert again.numpy().tobytes() == decode(bytes(first), x.numel(), codec).numpy().tobytes()


@pytest.mark.timeout(10)
def test_codec_ids_are_distinct_and_cover_every_codec() -> None:
    assert set(CODEC_ID) == set(COMPRESSIONS)
    assert sorted(CODEC_ID.values()) == list(range(len(COMPRESSIONS)))
    assert quantization_step("none") is None and quantization_step("int4") == 1 / 7


@pytest.mark.timeout(10)
def test_malformed_bytes_are_refused() -> None:
    x = _values(300)
    for codec in COMPRESSIONS:
        data = encode(x, codec)
        for bad in (data[:-1], data + b"\0", b""):
            with pytest.raises(AllReduceFailed, match="expected"):
                decode(bad, 300, codec)
    for codec in QUANTIZED:
        data = bytearray(encode(x, codec))
        for scale in (float("nan"), float("inf"), -1.0, -0.0):
            bad = struct.pack("<f", scale) + bytes(data[4:])
            with pytest.raises(AllReduceFailed, match="scale"):
                decode(bad, 300, codec)
        huge = struct.pack("<f", 3e38) + bytes(data[4:])  # finite scale, but q·scale overflows
        with pytest.raises(AllReduceFailed, match="inf"):
            decode(huge, 300, codec)
    int8 = bytearray(encode(x, "int8"))
    int8[3 * 4 + 5] = 0x80  # -128: outside [-127, 127]
    with pytest.raises(AllReduceFailed, match="code"):
        decode(bytes(int8), 300, "int8")
    int4 = bytearray(encode(x, "int4"))
    int4[3 * 4 + 5] &= 0xF0  # nibble 0 is q = -8: outside [-7, 7]
    with pytest.raises(AllReduceFailed, match="code"):
        decode(bytes(int4), 300, "int4")
    with pytest.raises(ValueError):
        decode(encode(x, "none"), 300, "int2")  # type: ignore[arg-type]
    for codec in QUANTIZED:
        with pytest.raises(ValueError, match="finite"):
            encode(torch.tensor([1.0, float("nan")]), codec)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=600),
    numel=st.integers(min_value=0, max_value=400),
    codec=st.sampled_from(COMPRESSIONS),
)
def test_decode_of_arbitrary_bytes_fails_cleanly(data: bytes, numel: int, codec: str) -> None:
    try:
        out = decode(data, numel, codec)  # type: ignore[arg-type]
    except AllReduceFailed:
        return
    assert out.dtype == torch.float32 and out.shape == (numel,)
    if codec in QUANTIZED:
        assert bool(torch.isfinite(out).all())


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32), max_size=300),
    codec=st.sampled_from(QUANTIZED),
)
def test_round_trip_of_arbitrary_finite_values(values: list[float], codec: str) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = round_trip(x, codec)  # type: ignore[arg-type]
    # a subnormal scale is rounded to a multiple of the smallest subnormal (2^-149), and the
    # product q·scale carries that rounding |q| <= 127 times (hypothesis found 4.67e-42 alone
    # in its block: error 4.3e-44, past the old slack of 8 steps)
    bound = block_bound(x, codec) + 2.0**-149 * 128
    assert bool(((y.double() - x.double()).abs() <= bound).all())


# --------------------------------------------------------------------------- pruning


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_prune_zeroes_exactly_the_smallest(fraction: float) -> None:
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(1))
    before = x.clone()
    y = prune(x, fraction)
    assert torch.equal(x, before)  # the input is left alone
    count = math.floor(fraction * x.numel())
    zeroed = y == 0
    assert int(zeroed.sum()) == count
    if 0 < count < x.numel():  # every zeroed magnitude <= every kept one; kept ones unchanged
        assert x.abs()[zeroed].max() <= x.abs()[~zeroed].min()
    assert torch.equal(y[~zeroed], x[~zeroed])


@pytest.mark.timeout(10)
def test_prune_breaks_ties_by_index() -> None:
    x = torch.tensor([2.0, -1.0, 1.0, 3.0, 1.0, -1.0, 0.5])
    # 4 of 7: 0.5, then three of the four 1.0 magnitudes, the lowest indices first
    assert prune(x, 4 / 7 + 1e-9).tolist() == [2.0, 0.0, 0.0, 3.0, 0.0, -1.0, 0.0]
    # a non-contiguous view: ties in the order of its values, not of its storage
    t = torch.tensor([[1.0, 5.0], [1.0, 6.0]]).t()  # values in order: 1, 1, 5, 6
    assert prune(t, 0.25).tolist() == [[0.0, 1.0], [5.0, 6.0]]
    for bad in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError):
            prune(x, bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- in-memory all-reduce


@pytest.mark.timeout(10)
def test_in_memory_all_reduce_splits_like_the_network_round() -> None:
    flats = [_values(1000, seed=s) for s in range(3)]
    weights = [1.0, 2.0, 0.5]
    assert torch.equal(all_reduce_in_memory(flats, weights, "none"), _split_mean(flats, weights))
    sizes = part_sizes(1000, 3)
    for codec in ("fp16", *QUANTIZED):
        result = all_reduce_in_memory(flats, weights, codec)  # type: ignore[arg-type]
        # by hand: every part quantized per member, reduced, quantized once more
        expected = []
        for j, part in enumerate(zip(*(f.tensor_split(3) for f in flats), strict=True)):
            received = [round_trip(p, codec) for p in part]  # type: ignore[arg-type]
            expected.append(round_trip(reduce_part(received, weights), codec))  # type: ignore[arg-type]
            assert expected[-1].numel() == sizes[j]
        assert torch.equal(result, torch.cat(expected))
    with pytest.raises(ValueError):
        all_reduce_in_memory(flats, [1.0], "none")
    with pytest.raises(AllReduceFailed):  # what a reducer refuses
        all_reduce_in_memory([torch.full((4,), 3e38)] * 2, [1.0, 1.0], "none")


def _split_mean(flats: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    parts = zip(*(f.tensor_split(len(flats)) for f in flats), strict=True)
    return torch.cat([reduce_part(list(p), weights) for p in parts])


# --------------------------------------------------------------------------- manifest, simulator


@pytest.mark.timeout(10)
def test_run_spec_fields_are_validated_and_round_trip() -> None:
    for codec in COMPRESSIONS:  # config.py lists the same names as compression.py
        assert RunSpec(compression=codec).compression == codec
    for bad in ("int2", "fp8", ""):
        with pytest.raises(ConfigError, match="compression"):
            RunSpec(compression=bad)
    for bad_fraction in (-0.1, 1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="prune_fraction"):
            RunSpec(prune_fraction=bad_fraction)
    run = RunSpec(compression="int4", prune_fraction=0.5)
    assert run.to_dict()["compression"] == "int4" and run.to_dict()["prune_fraction"] == 0.5
    assert RunSpec.from_dict(run.to_dict()) == run
    with pytest.raises(ConfigError):
        RunSpec.from_dict({"compression": 8})


def _sim(small_run: RunSpec, **kwargs: Any) -> dict[str, Any]:
    run_fields = {k: kwargs.pop(k) for k in list(kwargs) if k in RunSpec.__dataclass_fields__}
    run = dataclasses.replace(small_run, **run_fields)
    spec = SimSpec(run=run, workers=3, total_steps=30, threads=1, **kwargs)
    return Simulator(spec).run()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(
    "algo, extra",
    [("sync", {}), ("dn", {"grace_s": 1e9}), ("async", {})],
    ids=["sync", "dn-groups", "async-uploads"],
)
def test_simulator_applies_the_codec_deterministically(
    small_run: RunSpec, algo: str, extra: dict[str, Any]
) -> None:
    plain = _sim(small_run, algo=algo, **extra)
    lossy = _sim(small_run, algo=algo, compression="int4", prune_fraction=0.5, **extra)
    assert lossy == _sim(small_run, algo=algo, compression="int4", prune_fraction=0.5, **extra)
    assert lossy["config"]["run"]["compression"] == "int4"
    assert math.isfinite(lossy["final_ppl"]) and lossy["final_ppl"] < lossy["initial_ppl"]
    assert lossy["final_ppl"] != plain["final_ppl"]  # the codec was applied
    assert lossy["curve"][0]["ppl"] != plain["curve"][0]["ppl"]


@pytest.mark.timeout(10)
def test_simulator_group_sum_is_the_swarms_all_reduce(small_run: RunSpec) -> None:
    """A group's Σ δ in the simulator is count × what every swarm member gets."""
    generator = torch.Generator().manual_seed(5)
    shapes = [(7, 3), (50,), (2, 2, 2)]
    deltas = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(3)]
    run = dataclasses.replace(small_run, compression="int8", prune_fraction=0.25)
    flats = [torch.cat([prune(t.reshape(-1), 0.25) for t in d]) for d in deltas]
    expected = all_reduce_in_memory(flats, [1.0] * 3, "int8") * 3
    got = torch.cat([t.reshape(-1) for t in group_sum(deltas, run)])
    assert torch.equal(got, expected)
    assert [tuple(t.shape) for t in group_sum(deltas, run)] == shapes
    alone = group_sum(deltas[:1], run)  # a lone peer: its own δ, as it is
    assert all(torch.equal(a, b) for a, b in zip(alone, deltas[0], strict=True))
    run = small_run  # none, no pruning: the plain sum, as before
    assert all(
        torch.equal(a, b) for a, b in zip(group_sum(deltas, run), plain_sum(deltas), strict=True)
    )
