"""The CUDA paths of a peer, on a real GPU: `--batch-size auto`, `--gpu-memory-fraction`, bf16.

These paths cannot run on the CI machines (no GPU), so this script is what checks them when a
GPU is at hand. It needs torch with CUDA and this package's training modules only (no hivemind:
the swarm's network parts are the same on every device).

For each model preset and memory fraction, in a fresh process (a memory cap is per process):
`peer.inner.prepare_replica` caps the memory and probes the micro-batch exactly as `join` does;
then a local phase of --steps AdamW steps runs under bf16 autocast on the built-in corpus. It
reports the micro-batch chosen, the peak memory against the cap, steps per second, the first
and last losses and whether δ is finite. A short CPU phase of the first preset, from the same
start and batches, gives the bf16-vs-fp32 gap of the first loss.

    python bench/gpu_smoke.py --models 60m 150m --fractions 1.0 0.05 --steps 30

One JSON document on stdout; exit 1 if any check fails (peak over the cap, non-finite δ,
GPU loss not decreasing, bf16 first loss off fp32's by > 1%, no CUDA).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import Any


def one_config(model_name: str, fraction: float, steps: int, device_name: str) -> dict[str, Any]:
    import dataclasses

    import torch

    from diloco_peer.config import RunSpec
    from diloco_peer.peer.data import ShardStream, build_dataset, iid_shards
    from diloco_peer.peer.inner import InnerTrainer, Schedule, prepare_replica
    from diloco_peer.peer.model import build_model, count_parameters

    device = torch.device(device_name)
    run = dataclasses.replace(RunSpec(model=model_name), batch_size=64, seq_len=256)
    data = build_dataset(run.data, run.tokenizer, run.seq_len, 16, 2_000_000, run.seed)
    model = build_model(run.model, data.vocab_size, run.seed, run.seq_len)
    t0 = time.perf_counter()
    micro = prepare_replica(
        model, run, device, data.vocab_size, micro_batch_size=-1, gpu_memory_fraction=fraction
    )
    probe_s = time.perf_counter() - t0
    trainer = InnerTrainer(model, run, device, micro_batch_size=micro)
    shard = iid_shards(len(data.train), 1, run.seed)[0]
    stream = ShardStream(data.train, shard, run.batch_size, seed=0)
    schedule = Schedule(peak_lr=run.inner_lr, min_lr=run.inner_lr * 0.1, warmup_steps=5,
                        total_steps=steps)  # fmt: skip
    theta = trainer.snapshot()
    losses: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    phase = trainer.run_phase(
        theta, steps, lambda: [stream.next_batch()], schedule, 0,
        on_step=lambda i, mean: losses.append(mean * i - sum(losses)),
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {
        "model": model_name, "params": count_parameters(model), "device": device_name,
        "fraction": fraction, "micro_batch": micro, "batch": run.batch_size,
        "probe_s": round(probe_s, 3), "steps": steps, "steps_per_s": steps / seconds,
        "first_loss": losses[0], "last_loss": losses[-1],
        "delta_finite": all(bool(torch.isfinite(d).all()) for d in phase.delta),
    }  # fmt: skip
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cap_bytes"] = int(total * fraction)
        out["peak_bytes"] = int(torch.cuda.max_memory_reserved(device))
        out["peak_within_cap"] = out["peak_bytes"] <= out["cap_bytes"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["60m", "150m"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.05])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cpu-steps", type=int, default=10)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "FRACTION", "DEVICE"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.one:
        model, fraction, device = args.one
        steps = args.steps if device == "cuda" else args.cpu_steps
        print(json.dumps(one_config(model, float(fraction), steps, device)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    runs, failures = [], []
    configs = [(m, f, "cuda") for m in args.models for f in args.fractions]
    configs.append((args.models[0], 1.0, "cpu"))
    for model, fraction, device in configs:
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--cpu-steps",
               str(args.cpu_steps), "--one", model, str(fraction), device]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            failures.append(f"{model}/{fraction}/{device}: {proc.stderr.strip()[-500:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(r)
        if not r["delta_finite"] or not math.isfinite(r["last_loss"]):
            failures.append(f"{model}/{fraction}/{device}: non-finite δ or loss")
        if device == "cuda" and r["last_loss"] >= r["first_loss"]:
            failures.append(f"{model}/{fraction}/{device}: loss did not decrease")
        if device == "cuda" and not r["peak_within_cap"]:
            failures.append(f"{model}/{fraction}: peak {r['peak_bytes']} over cap {r['cap_bytes']}")
    # bf16 autocast against fp32: same init, same first batch, so the first losses must agree
    gap = None
    cpu = [r for r in runs if r["device"] == "cpu"]
    gpu = [r for r in runs if r["device"] == "cuda" and r["model"] == args.models[0]]
    if cpu and gpu:
        gap = abs(gpu[0]["first_loss"] - cpu[0]["first_loss"]) / cpu[0]["first_loss"]
        if gap > 0.01:
            failures.append(f"bf16 first loss differs from fp32's by {gap:.2%}")
    print(json.dumps({"runs": runs, "bf16_first_loss_gap": gap, "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
