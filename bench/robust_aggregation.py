"""What screening and robust aggregation cost a part's reducer, against the plain mean.

A reducer (diloco_peer/averaging/reducer.py) holds one part of every member's δ and runs
`answer_part` once all are in; the members wait for it, so its time adds to the round's. For
groups of --members and parts of --numel floats, each step alone, timed in the same process:

    mean               aggregate, "mean" (DiLoCo's weighted mean, the baseline of every ratio)
    trimmed_mean       aggregate, "trimmed-mean" (trim_fraction 0.2)
    centered_clip      aggregate, "centered-clip" (3 iterations)
    screen             screen_parts: length, finite, norm against the declared bound
    screen_cosine      screen_parts with min_cosine 0.1 (adds the leave-one-out median cosines)
    torch_sort_trimmed the same trimmed mean through torch.sort along the member axis: the
                       reference for robust.py's sorting network, never used by the reducer

Inputs are honest-like δ parts: a shared direction plus per-member noise twice as large
(pairwise cosine ~0.2), so screening keeps everyone and does its full work. Median of --repeats
timings each, after one warm-up; ratios are against "mean" of the same group and size.
Prints one JSON document on stdout (progress on stderr).

    python bench/robust_aggregation.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from diloco_peer.averaging.robust import Aggregation, aggregate, screen_parts

NOISE_RATIO = 2.0
MIN_COSINE = 0.1


def honest_parts(members: int, numel: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(numel, generator=generator)
    return [shared + NOISE_RATIO * torch.randn(numel, generator=generator) for _ in range(members)]


def sorted_trimmed_mean(parts: list[torch.Tensor], trimmed: int) -> torch.Tensor:
    ranked = torch.stack(parts).sort(dim=0).values  # [members, numel]
    return ranked[trimmed : len(parts) - trimmed].mean(dim=0)


def median_time_s(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up: allocator, first-call dispatch
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(members: int, numel: int, repeats: int, seed: int) -> dict[str, object]:
    parts = honest_parts(members, numel, seed)
    weights = [1.0] * members
    bounds = [float(torch.linalg.vector_norm(p)) for p in parts]
    trimmed = Aggregation(method="trimmed-mean")
    steps: dict[str, Callable[[], object]] = {
        "mean": lambda: aggregate(parts, weights, Aggregation()),
        "trimmed_mean": lambda: aggregate(parts, weights, trimmed),
        "centered_clip": lambda: aggregate(parts, weights, Aggregation(method="centered-clip")),
        "screen": lambda: screen_parts(parts, bounds, numel=numel, min_cosine=None, tolerance=0),
        "screen_cosine": lambda: screen_parts(
            parts, bounds, numel=numel, min_cosine=MIN_COSINE, tolerance=0
        ),
        "torch_sort_trimmed": lambda: sorted_trimmed_mean(parts, trimmed.trimmed(members)),
    }
    excluded = screen_parts(parts, bounds, numel=numel, min_cosine=MIN_COSINE, tolerance=0)
    if excluded:  # the inputs are meant to pass: a screen that excludes does less work
        raise SystemExit(f"honest-like parts were excluded: {excluded}")
    times = {}
    for name, step in steps.items():
        times[name] = median_time_s(step, repeats)
        print(
            f"[bench] {members:2d} x {numel:>9,d} {name:18s} {times[name] * 1e3:9.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    return {
        "members": members,
        "numel": numel,
        "time_s": times,
        "ratio_vs_mean": {name: t / times["mean"] for name, t in times.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--members", default="4,8,16", help="group sizes, comma-separated")
    p.add_argument("--numel", default="1000000,4000000", help="part sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.repeats < 1 or a.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(a.threads)
    results = [
        measure(members, numel, a.repeats, a.seed)
        for members in (int(x) for x in a.members.split(","))
        for numel in (int(x) for x in a.numel.split(","))
    ]
    doc = {
        "bench": "robust_aggregation",
        "repeats": a.repeats,
        "threads": a.threads,
        "noise_ratio": NOISE_RATIO,
        "min_cosine": MIN_COSINE,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "results": results,
    }
    print(json.dumps(doc, sort_keys=True))


if __name__ == "__main__":
    main()
