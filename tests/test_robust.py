"""Screening and robust aggregation (averaging/robust.py), in memory and over real libp2p streams.

Honest-like δ parts are a shared direction plus per-member noise twice as large (pairwise cosine
~0.2, pessimistic for workers training the same model from the same start). The network tests
start DHTs in this process (one per member, on 127.0.0.1, each with its P2PService, shared by
the module's network tests) and run PartExchange rounds on them; every service and DHT is shut
down in `finally`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import statistics
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
from conftest import loopback_services
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from diloco_peer.averaging.allreduce import PartExchange
from diloco_peer.averaging.compression import COMPRESSIONS, Compression, round_trip
from diloco_peer.averaging.member import AllReduceResult
from diloco_peer.averaging.receipts import read_answer
from diloco_peer.averaging.reducer import PartReducer, Round
from diloco_peer.averaging.reference import all_reduce_in_memory, all_reduce_in_memory_detailed
from diloco_peer.averaging.robust import (
    Aggregation,
    Reason,
    aggregate,
    aggregate_norm_bound,
    coordinate_median,
    cosine_similarity,
    cosines_with_the_others,
    norm_tolerance,
    reduce_part,
    screen_parts,
    sorted_rows,
)
from diloco_peer.averaging.wire import (
    MAGIC,
    PART_HEADER,
    PROTOCOL_VERSION,
    PartHeader,
    pack_answer,
    unpack_answer,
)
from diloco_peer.config import AGGREGATIONS
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.service import P2PService

NOISE_RATIO = 2.0


def honest_parts(members: int, numel: int, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=generator)
    return [shared + NOISE_RATIO * torch.randn(numel, generator=generator) for _ in range(members)]


def norms(parts: Sequence[Tensor]) -> list[float | None]:
    return [float(torch.linalg.vector_norm(p.double())) for p in parts]


# --------------------------------------------------------------------------- config


@pytest.mark.timeout(10)
def test_aggregation_fields_are_validated() -> None:
    assert AGGREGATIONS == ("mean", "trimmed-mean", "centered-clip")
    for method in AGGREGATIONS:
        assert Aggregation(method=method).method == method
    bad: list[dict[str, object]] = [
        {"method": "median"},
        {"trim_fraction": -0.1},
        {"trim_fraction": 0.5},
        {"trim_fraction": float("nan")},
        {"trim_fraction": True},
        {"clip_iterations": 0},
        {"clip_iterations": 1.5},
        {"clip_iterations": True},
        {"min_cosine": 1.5},
        {"min_cosine": float("nan")},
        {"min_cosine": False},
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            Aggregation(**fields)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_trimmed_count_per_end() -> None:
    default = Aggregation(method="trimmed-mean")  # 0.2
    assert [default.trimmed(n) for n in range(1, 12)] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2]
    assert Aggregation(trim_fraction=0.29).trimmed(100) == 29  # not 28 (0.29 · 100 < 29 in fp)
    assert Aggregation(trim_fraction=0.45).trimmed(5) == 2  # never fewer than one value left
    assert Aggregation(trim_fraction=0.45).trimmed(4) == 1
    assert Aggregation(trim_fraction=0.0).trimmed(10) == 0


# --------------------------------------------------------------------------- aggregation


@pytest.mark.timeout(10)
def test_sorting_network_and_medians_match_torch() -> None:
    generator = torch.Generator().manual_seed(1)
    for n in range(1, 10):
        # small integers: many ties, and a median is exact in fp32
        parts = [torch.randint(-3, 4, (500,), generator=generator).float() for _ in range(n)]
        stacked = torch.stack(parts)
        assert torch.equal(torch.stack(sorted_rows(parts)), stacked.sort(dim=0).values)
        assert torch.equal(coordinate_median(parts), stacked.quantile(0.5, dim=0))
        if n >= 2:
            others = [coordinate_median(parts[:i] + parts[i + 1 :]) for i in range(n)]
            slow = [cosine_similarity(p, other) for p, other in zip(parts, others, strict=True)]
            fast = cosines_with_the_others(parts)
            for a, b in zip(fast, slow, strict=True):
                assert (a is None and b is None) or abs(a - b) < 1e-6  # type: ignore[operator]


@pytest.mark.timeout(10)
def test_mean_is_reduce_part_bit_for_bit() -> None:
    parts = honest_parts(5, 10_001, seed=2)
    weights = [1.0, 2.5, 0.3, 7.0, 1.0]
    assert torch.equal(aggregate(parts, weights, Aggregation()), reduce_part(parts, weights))
    # golden numbers: Σ w x / Σ w
    small = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([0.0, -4.0])]
    assert aggregate(small, [1.0, 2.0, 1.0], Aggregation()).tolist() == [1.75, 2.5]
    # robust methods with nothing to trim or no majority are the weighted mean, bit for bit
    for aggregation in (
        Aggregation(method="trimmed-mean"),
        Aggregation(method="centered-clip"),
    ):
        got = aggregate(parts[:2], weights[:2], aggregation)
        assert torch.equal(got, reduce_part(parts[:2], weights[:2]))
    no_trim = Aggregation(method="trimmed-mean", trim_fraction=0.0)
    assert torch.equal(aggregate(parts, weights, no_trim), reduce_part(parts, weights))
    with pytest.raises(ValueError):
        aggregate(parts, weights[:2], Aggregation())


@pytest.mark.timeout(10)
def test_trimmed_mean_ignores_one_huge_outlier() -> None:
    honest = honest_parts(5, 4096, seed=3)
    outlier = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 1e6
    parts = [*honest[:2], outlier, *honest[2:]]
    result = aggregate(parts, [1.0] * 6, Aggregation(method="trimmed-mean"))  # trims 1 per end
    ranked = torch.stack(parts).double().sort(dim=0).values
    assert torch.allclose(result.double(), ranked[1:5].mean(dim=0), rtol=0, atol=1e-5)
    honest_mean = torch.stack(honest).mean(dim=0)
    spread = max(float((h - honest_mean).norm()) for h in honest)
    assert float((result - honest_mean).norm()) < 0.5 * spread
    assert float((reduce_part(parts, [1.0] * 6) - honest_mean).norm()) > 1e5  # the mean is lost
    # golden: per coordinate, the middle value of three
    small = [torch.tensor([1.0, 10.0]), torch.tensor([2.0, 20.0]), torch.tensor([3e6, -1e6])]
    assert aggregate(small, [1.0] * 3, Aggregation(method="trimmed-mean")).tolist() == [2.0, 10.0]


@pytest.mark.timeout(10)
def test_centered_clip_bounds_the_influence_of_a_huge_outlier() -> None:
    honest = honest_parts(7, 4096, seed=5)
    honest_mean = reduce_part(honest, [1.0] * 7)
    spread = statistics.median([float((h - honest_mean).norm()) for h in honest])
    clip = Aggregation(method="centered-clip")
    for scale in (1e3, 1e6):
        outlier = torch.randn(4096, generator=torch.Generator().manual_seed(6)) * scale
        result = aggregate([*honest, outlier], [1.0] * 8, clip)
        assert bool(torch.isfinite(result).all())
        # each of 3 iterations moves v by at most τ/8 toward the outlier, τ ~ the honest spread
        assert float((result - honest_mean).norm()) < 0.25 * spread, scale
    # a majority of identical parts: τ = 0, the center stays put, no 0/0
    same = torch.ones(10)
    result = aggregate([same, same, same, same * 1e6], [1.0] * 4, clip)
    assert torch.equal(result, same)


@pytest.mark.timeout(20)
def test_aggregate_norm_bound_holds() -> None:
    """Random groups, and one where the coordinate-wise median is longer than every input."""
    generator = torch.Generator().manual_seed(7)
    methods = [Aggregation(method=m) for m in AGGREGATIONS]
    methods.append(Aggregation(method="trimmed-mean", trim_fraction=0.45))
    for trial in range(60):
        n = 2 + trial % 9
        parts = [
            torch.randn(64, generator=generator) * float(torch.rand(1, generator=generator)) * 10
            for _ in range(n)
        ]
        bounds = [float(p.norm()) for p in parts]
        for aggregation in methods:
            result = aggregate(parts, [1.0 + i for i in range(n)], aggregation)
            assert float(result.norm()) <= aggregate_norm_bound(bounds, aggregation) * (1 + 1e-5)
    spiky = [
        torch.tensor([1.0, 1.0, 0.0]),
        torch.tensor([1.0, 0.0, 1.0]),
        torch.tensor([0, 1.0, 1]),
    ]
    median = aggregate(spiky, [1.0] * 3, Aggregation(method="trimmed-mean"))
    assert median.tolist() == [1.0, 1.0, 1.0]  # norm √3 > √2, every input's
    assert float(median.norm()) <= aggregate_norm_bound([math.sqrt(2)] * 3, methods[1]) + 1e-6


# --------------------------------------------------------------------------- screening


@pytest.mark.timeout(10)
def test_screen_parts_gives_each_reason() -> None:
    parts = honest_parts(4, 1000, seed=8)
    bounds = norms(parts)
    bad = list(parts)
    bad[0] = parts[0].clone()
    bad[0][17] = float("nan")
    bad[1] = parts[1] * 10  # ten times what its member declared for its whole δ
    bad[3] = parts[3][:999]
    excluded = screen_parts(bad, bounds, numel=1000, min_cosine=None, tolerance=0.0)
    assert {i: e.reason for i, e in excluded.items()} == {
        0: Reason.NON_FINITE,
        1: Reason.NORM,
        3: Reason.MALFORMED,
    }
    assert str(excluded[0]) == "non-finite"
    assert str(excluded[1]).startswith("norm ") and "above declared" in str(excluded[1])
    inf = [parts[0].clone(), *parts[1:]]
    inf[0][3] = -float("inf")
    assert list(screen_parts(inf, [None] * 4, numel=1000, min_cosine=None, tolerance=0)) == [0]
    # a part as long as its whole δ passes exactly; bounds of None are not checked
    assert not screen_parts(parts, bounds, numel=1000, min_cosine=None, tolerance=0.0)
    huge = [p * 1e30 for p in parts]  # finite values whose fp32 norm overflows
    assert not screen_parts(huge, [None] * 4, numel=1000, min_cosine=None, tolerance=0.0)
    flagged = screen_parts(huge, [1e38] * 4, numel=1000, min_cosine=None, tolerance=0.0)
    assert {e.reason for e in flagged.values()} == {Reason.NORM}
    with pytest.raises(ValueError):
        screen_parts(parts, bounds[:3], numel=1000, min_cosine=None, tolerance=0.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("members", [3, 4, 8, 16])
def test_cosine_screening_catches_flipped_and_random_parts(members: int) -> None:
    parts = honest_parts(members, 20_000, seed=members)

    def screen(candidate: list[Tensor]) -> dict[int, Reason]:
        none = [None] * len(candidate)
        excluded = screen_parts(candidate, none, numel=20_000, min_cosine=0.1, tolerance=0.0)
        return {i: e.reason for i, e in excluded.items()}

    assert screen(parts) == {}  # honest, correlated as δs are: everyone passes
    flipped = [parts[0], -parts[1], *parts[2:]]
    assert screen(flipped) == {1: Reason.COSINE}
    scale = float(parts[0].norm()) / math.sqrt(20_000)
    noise = torch.randn(20_000, generator=torch.Generator().manual_seed(9)) * scale
    assert screen([*parts[:-1], noise]) == {members - 1: Reason.COSINE}
    if members >= 8:  # two attackers, still a minority
        assert screen([-parts[0], noise, *parts[2:]]) == {0: Reason.COSINE, 1: Reason.COSINE}
    detail = screen_parts(flipped, [None] * members, numel=20_000, min_cosine=0.1, tolerance=0)[1]
    assert str(detail).startswith("cosine -") and str(detail).endswith("below 0.1")
    # the scale of the values does not matter (no fp32 overflow or underflow in the cosines)
    for scale in (1e-30, 1e19):
        assert screen([p * scale for p in flipped]) == {1: Reason.COSINE}
    # fewer than 3 parts: no direction to agree on, nothing screened by cosine
    assert screen(flipped[:2]) == {}
    # a zero part has no direction: not screened
    assert screen([torch.zeros(20_000), *parts[1:]]) == {}


@pytest.mark.timeout(30)
def test_a_term_every_part_shares_is_taken_out_before_the_direction_screen() -> None:
    """Overlapped `mix` δs (ALGORITHMS §1.1): progress plus a term every member of the group
    adds, which points against the progress (it damps the last outer step). Members whose
    progress is longer and shorter than the term then fall on its two sides, and the plain
    screen excludes an honest one; with the term as `reference`, the screen sees the progress
    alone: the honest pass, a flipped progress does not."""
    progress = honest_parts(3, 20_000, seed=5)
    direction = sum(progress) / 3
    term = -0.8 * direction * 2.0  # against the progress, between the short ones and the long
    lengths = (1.0, 1.0, 3.0)  # two phases that mixed (κ of their first part) and one that did not
    sent = [length * p + term for length, p in zip(lengths, progress, strict=True)]

    def screen(parts: list[Tensor], reference: Tensor | None) -> dict[int, Reason]:
        none = [None] * len(parts)
        excluded = screen_parts(parts, none, numel=20_000, min_cosine=0.02, tolerance=0.0,
                                reference=reference)  # fmt: skip
        return {i: e.reason for i, e in excluded.items()}

    assert screen(sent, None) == {2: Reason.COSINE}  # the honest long one, without reference
    assert screen(sent, term) == {}
    flipped = [sent[0], -3.0 * progress[1] + term, sent[2]]
    assert screen(flipped, term) == {1: Reason.COSINE}
    assert screen(sent, term[:10]) == {2: Reason.COSINE}  # a reference of another length: none


@pytest.mark.timeout(10)
def test_cosine_screening_never_excludes_a_majority() -> None:
    """Uncorrelated parts with too strict a threshold: fewer than half are excluded."""
    generator = torch.Generator().manual_seed(10)
    parts = [torch.randn(5000, generator=generator) for _ in range(7)]
    excluded = screen_parts(parts, [None] * 7, numel=5000, min_cosine=0.5, tolerance=0.0)
    assert 0 < len(excluded) <= 3


@pytest.mark.timeout(30)
def test_codec_tolerances_cover_the_worst_blocks() -> None:
    """A part's norm after decoding stays within `norm_tolerance` of its norm before, for the
    worst blocks there are (every value but the absmax just above a rounding midpoint), for
    fp16 subnormals, and for honest-like δs of every codec."""
    block = 128
    worst = {
        "int8": torch.tensor([127.0] + [11.5 + 1e-3] * (block - 1)) * 1e-3,
        "int4": torch.tensor([7.0] + [0.5 + 1e-3] * (block - 1)) * 1e-3,
        "fp16": torch.full((block,), 0.5001 * 2.0**-24),  # each rounds up to 2^-24
    }
    gains = {}
    for codec, values in worst.items():
        relative, absolute = norm_tolerance(codec, values.numel())  # type: ignore[arg-type]
        before = float(values.norm())
        after = float(round_trip(values, codec).norm())  # type: ignore[arg-type]
        assert after <= before * (1 + relative) + absolute, codec
        gains[codec] = after / before
    assert gains["int8"] > 1.02 and gains["int4"] > 1.47 and gains["fp16"] > 1.9  # near-tight
    for codec in COMPRESSIONS:
        parts = honest_parts(3, 100_000, seed=11)
        relative, absolute = norm_tolerance(codec, 100_000)
        for part in parts:
            after = float(round_trip(part, codec).norm())
            assert after <= float(part.norm()) * (1 + relative) + absolute, codec


# --------------------------------------------------------------------------- in memory


@pytest.mark.timeout(20)
def test_in_memory_all_reduce_excludes_and_reports() -> None:
    honest = honest_parts(3, 3001, seed=12)
    cheat = honest[2].clone()
    cheat[::500] = float("nan")  # in every part
    contributions = [honest[0], cheat, honest[1], honest[2]]
    weights = [1.0, 2.0, 3.0, 0.5]
    average, excluded = all_reduce_in_memory_detailed(contributions, weights, "none")
    assert excluded == {1: "non-finite (parts 0, 1, 2, 3)"}
    # fp32 and a mean: the honest members' average, bit for bit, however the vector is cut
    expected = all_reduce_in_memory([honest[0], honest[1], honest[2]], [1.0, 3.0, 0.5], "none")
    assert torch.equal(average, expected)
    assert torch.equal(all_reduce_in_memory(contributions, weights, "none"), average)
    # declared norms: one member sends more than it declared
    big = [honest[0], honest[1] * 5, honest[2]]
    bounds = norms(honest)
    for codec in COMPRESSIONS:
        robust = Aggregation(method="centered-clip", min_cosine=0.1)
        _, excluded = all_reduce_in_memory_detailed(big, [1.0] * 3, codec, robust, bounds)
        assert set(excluded) == {1} and excluded[1].startswith("norm above"), codec
    with pytest.raises(AllReduceFailed, match="every member"):
        all_reduce_in_memory([cheat, cheat], [1.0, 1.0], "fp16")
    for bad_bounds in ([1.0], [1.0, -1.0], [1.0, float("nan")]):
        with pytest.raises(ValueError):
            all_reduce_in_memory([honest[0], honest[1]], [1.0, 1.0], "none", bounds=bad_bounds)


# --------------------------------------------------------------------------- the answer


@pytest.mark.timeout(10)
def test_answer_round_trip_and_hostile_answers() -> None:
    average = torch.tensor([1.0, -2.0, 0.5])
    reasons = {0: Reason.NON_FINITE, 2: Reason.MALFORMED}
    data = pack_answer(reasons, average, "none")
    assert data[:8] == bytes([2, 0, 0, 0, 1, 2, 0, 4])  # count, (index, code) × 2, LE
    got, decoded = unpack_answer(data, None, Aggregation(), "none", members=4, numel=3)
    assert got == reasons and torch.equal(decoded, average)

    def refused(data: bytes, bounds: list[float | None] | None = None) -> None:
        with pytest.raises(AllReduceFailed):
            unpack_answer(data, bounds, Aggregation(), "none", members=4, numel=3)

    body = average.numpy().tobytes()
    for hostile in (
        b"",
        b"\x00",
        b"\x04\x00" + b"\x00\x00\x01" * 4 + body,  # everyone excluded
        b"\x01\x00" + b"\x04\x00\x01" + body,  # member out of range
        b"\x01\x00" + b"\x01\x00\x05" + body,  # unknown reason
        b"\x01\x00" + b"\x01\x00\x00" + body,
        b"\x02\x00" + b"\x01\x00\x01" * 2 + body,  # duplicate
        b"\x02\x00" + b"\x02\x00\x01\x01\x00\x01" + body,  # decreasing
        b"\x01\x00" + b"\x01\x00\x01",  # no average
        b"\x00\x00" + body + b"\x00",  # one byte too many
        b"\xff\xff" + body,
        b"\x00\x00" + torch.tensor([1.0, float("nan"), 0.0]).numpy().tobytes(),
    ):
        refused(hostile)
    refused(pack_answer({}, average * 100, "none"), bounds=[1.0, 2.0, 2.0, 2.0])
    # the excluded member's bound does not count; nor is anything checked if one is unknown
    fine = pack_answer({0: Reason.NORM}, average, "none")
    unpack_answer(fine, [1e-3, 3.0, 3.0, 3.0], Aggregation(), "none", members=4, numel=3)
    unpack_answer(pack_answer({}, average * 100, "none"), [1.0, None, 1.0, 1.0], Aggregation(),
                  "none", members=4, numel=3)  # fmt: skip


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40), members=st.integers(2, 5))
def test_any_answer_bytes_give_a_result_or_all_reduce_failed(data: bytes, members: int) -> None:
    for codec in ("none", "int8"):
        try:
            unpack_answer(data, [1.0] * members, Aggregation(), codec, members=members, numel=5)
        except AllReduceFailed:
            pass


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(
    data=st.one_of(
        st.binary(max_size=PART_HEADER.size + 2),
        st.binary(min_size=PART_HEADER.size - 5, max_size=PART_HEADER.size - 5).map(
            lambda rest: MAGIC + bytes([PROTOCOL_VERSION]) + rest
        ),
    )
)
def test_any_part_header_bytes_give_a_header_or_all_reduce_failed(data: bytes) -> None:
    try:
        header = PartHeader.unpack(data)
    except AllReduceFailed:
        return
    assert len(data) == PART_HEADER.size and data.startswith(MAGIC)
    assert math.isfinite(header.timeout_s) and header.timeout_s > 0


# --------------------------------------------------------------------------- over the network

T = TypeVar("T")
ROUND_TIMEOUT_S = 30.0
"""Backstop on a member's round, on top of its own all-reduce timeout."""


@pytest.fixture(scope="module")
def services() -> Iterator[list[P2PService]]:
    """4 DHTs on 127.0.0.1, each joined to the first, each with its P2P service."""
    with loopback_services(4) as started:
        yield started


def on_loop(service: P2PService, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start `coro` on the service's loop, where its P2P replica lives."""
    return asyncio.run_coroutine_threadsafe(coro, service.loop)


@dataclass(frozen=True)
class Member:
    service: P2PService
    exchange: PartExchange

    @property
    def me(self) -> str:
        return self.exchange.me


@contextmanager
def exchanges(
    services: list[P2PService], count: int, compression: Compression, aggregation: Aggregation
) -> Iterator[list[Member]]:
    """PartExchanges on `count` of the services, sorted by peer id (the round's member order)."""
    members = [
        Member(service, PartExchange(service, "rt", compression, aggregation))
        for service in services[:count]
    ]
    try:
        for member in members:
            member.exchange.start()
        for member in members:
            member.exchange.wait_until_ready(10)
        yield sorted(members, key=lambda m: m.me)
    finally:
        for member in members:
            member.exchange.shutdown()


def run_round(
    members: list[Member],
    flats: list[Tensor],
    weights: list[float],
    bounds: list[float | None] | None,
    key: str,
) -> list[AllReduceResult | BaseException]:
    """Every member's `all_reduce` at once; its result or the exception it raised."""
    ids = [m.me for m in members]
    digest = hashlib.sha256(key.encode()).digest()
    rounds = [
        on_loop(
            m.service,
            m.exchange.all_reduce(
                key=key,
                digest=digest,
                members=ids,
                weights=weights,
                flat=flat,
                allreduce_timeout_s=10.0,
                bounds=bounds,
            ),
        )
        for m, flat in zip(members, flats, strict=True)
    ]
    results: list[AllReduceResult | BaseException] = []
    for future in rounds:
        try:
            results.append(future.result(timeout=ROUND_TIMEOUT_S))
        except Exception as e:
            results.append(e)
    return results


def check_same_everywhere(
    results: list[AllReduceResult | BaseException], expected: Tensor, excluded: dict[str, str]
) -> None:
    for result in results:
        assert isinstance(result, AllReduceResult), repr(result)
        assert torch.equal(result.average, expected)
        assert result.excluded == excluded


@pytest.mark.multipeer
@pytest.mark.timeout(40)
def test_a_member_sending_nan_is_excluded_and_the_round_completes(
    services: list[P2PService],
) -> None:
    numel = 30_001

    with exchanges(services, 3, "none", Aggregation()) as group:
        flats = honest_parts(3, numel, seed=13)
        flats[1] = flats[1].clone()
        flats[1][::1000] = float("nan")  # in each of the 3 parts
        weights = [1.0, 2.0, 3.0]
        results = run_round(group, flats, weights, None, "nan")
        expected, by_index = all_reduce_in_memory_detailed(flats, weights, "none")
        culprit = {group[1].me: "non-finite (parts 0, 1, 2)"}
        assert by_index == {1: culprit[group[1].me]}
        # the same bits on every member, the culprit included (it still gets the answers),
        # and they are the honest members' average
        check_same_everywhere(results, expected, culprit)
        honest = all_reduce_in_memory([flats[0], flats[2]], [1.0, 3.0], "none")
        assert torch.equal(expected, honest)
        # the next round of the same members is unaffected
        flats[1] = honest_parts(3, numel, seed=14)[1]
        results = run_round(group, flats, weights, None, "next")
        check_same_everywhere(results, all_reduce_in_memory(flats, weights, "none"), {})


@pytest.mark.multipeer
@pytest.mark.timeout(40)
def test_a_part_above_its_declared_norm_is_excluded_int8_centered_clip(
    services: list[P2PService],
) -> None:
    numel = 40_000
    aggregation = Aggregation(method="centered-clip", min_cosine=0.1)

    with exchanges(services, 4, "int8", aggregation) as group:
        flats = honest_parts(4, numel, seed=15)
        bounds = norms(flats)
        flats[2] = flats[2] * 5  # declared its norm, sends five times as much
        weights = [1.0, 1.0, 2.0, 1.0]
        results = run_round(group, flats, weights, bounds, "norm")
        expected, by_index = all_reduce_in_memory_detailed(
            flats, weights, "int8", aggregation, bounds
        )
        assert by_index == {2: "norm above its declared bound (parts 0, 1, 2, 3)"}
        check_same_everywhere(results, expected, {group[2].me: by_index[2]})


@pytest.mark.multipeer
@pytest.mark.timeout(40)
def test_hostile_reducer_answers_fail_the_round(services: list[P2PService]) -> None:
    """Member A runs a real PartExchange; B's handler reads A's part and answers with crafted
    bytes. Every malformed or implausible answer is AllReduceFailed on A, nothing else."""
    numel = 1000
    average = torch.linspace(-1, 1, numel // 2)  # each member's part: 500 values
    body = average.numpy().tobytes()
    answers: list[tuple[bytes, str]] = [
        (b"\x02\x00" + body, "2 exclusions of 2"),  # everyone: longer ones are cut off
        (b"\x01\x00" + b"\x07\x00\x01" + body, "exclusion of member 7"),
        (b"\x01\x00" + b"\x00\x00\x09" + body, "for reason 9"),
        (b"\x00\x00" + body[:-1], "expected 2000 bytes"),
        (b"\x01", "too short"),
        (pack_answer({}, average * float("nan"), "none"), "non-finite"),
        (pack_answer({}, average * 1e3, "none"), "implausible"),
    ]
    # each after an empty receipt (A holds no keys: unchecked), plus a broken receipt
    answers = [(b"\x00\x00" + answer, why) for answer, why in answers]
    answers += [(b"\xff\xff" + body, "signature of"), (b"\x00", "no receipt")]
    service_a, service_b = services[:2]
    crafted: list[bytes] = []

    async def hostile(
        _: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await P2P.receive_raw_data(reader)  # header
        await P2P.receive_raw_data(reader)  # part
        await P2P.send_raw_data(b"OK" + crafted[-1], writer)
        writer.close()

    with exchanges(services, 1, "none", Aggregation()) as (honest,):
        service_b.run(service_b.p2p.add_binary_stream_handler("rt-part", hostile), 10)
        members = sorted([honest.me, service_b.peer_id])
        try:
            for k, (answer, reason) in enumerate(answers):
                crafted.append(answer)
                with pytest.raises(AllReduceFailed, match=reason):
                    on_loop(
                        service_a,
                        honest.exchange.all_reduce(
                            key=f"h{k}",
                            digest=hashlib.sha256(f"h{k}".encode()).digest(),
                            members=members,
                            weights=[1.0, 1.0],
                            flat=torch.linspace(-1, 1, numel),
                            allreduce_timeout_s=5.0,
                            bounds=[float(numel) ** 0.5] * 2,
                        ),
                    ).result(timeout=ROUND_TIMEOUT_S)
        finally:
            service_b.run(service_b.p2p.remove_binary_stream_handler("rt-part"), 10)


@pytest.mark.timeout(10)
def test_reducer_excludes_an_undecodable_part_and_refuses_its_sender() -> None:
    """Without a network: a part whose bytes no encoder makes (an int8 scale that is NaN) is
    excluded from the reducer's answer to the others, and its sender gets AllReduceFailed."""

    async def scenario() -> None:
        ids = sorted(PeerID(bytes([i]) * 34).to_base58() for i in (1, 2, 3))
        reducer = PartReducer()
        rnd = Round(
            key="v0",
            digest=b"d" * 32,
            members=ids,
            me=ids[0],
            weights=[1.0, 1.0, 1.0],
            compression="int8",
            numel=30,
            timeout_s=5.0,
        )
        parts = honest_parts(3, 10, seed=16)
        rnd.deliver(ids[0], round_trip(parts[0], "int8"))
        good = pack_answer({}, parts[1], "int8")[2:]  # the part's int8 bytes
        bad = b"\x00\x00\xc0\x7f" + good[4:]  # its scale: NaN
        refused = asyncio.ensure_future(deliver_bytes(reducer, rnd, ids[2], bad))
        answer = await asyncio.wait_for(deliver_bytes(reducer, rnd, ids[1], good), 2)
        with pytest.raises(AllReduceFailed, match="malformed part, excluded"):
            await asyncio.wait_for(refused, 2)
        _, answer = read_answer(answer, rnd.digest, 0, None)  # unsigned: no receipt key here
        excluded, average = unpack_answer(answer, None, Aggregation(), "int8", members=3, numel=10)
        assert excluded == {2: Reason.MALFORMED}
        expected = reduce_part([round_trip(parts[0], "int8"), round_trip(parts[1], "int8")], [1, 1])
        assert torch.equal(average, round_trip(expected, "int8"))

    asyncio.run(scenario())


async def deliver_bytes(reducer: PartReducer, rnd: Round, sender: str, payload: bytes) -> bytes:
    """What the reducer does with a part's payload frame once its header was accepted."""
    reader = asyncio.StreamReader()
    reader.feed_data(len(payload).to_bytes(8, "big") + payload)
    reader.feed_eof()
    rnd.claimed.add(sender)
    return await reducer.reduce_part(rnd, sender, reader)
