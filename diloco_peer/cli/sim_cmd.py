"""`simulate` and `eval`: the engine without a network."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.config import GRACE_SHARE, SIM_ALGOS, RunSpec, SimSpec, default_run
from diloco_peer.errors import BadInput

_stderr = Console(stderr=True)


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("local steps"),
        TimeElapsedColumn(),
        console=_stderr,
        disable=not enabled,
        transient=False,
    )


def _check_new_file(path: Path | None, overwrite: bool) -> None:
    if path is None:
        return
    if path.exists() and not overwrite:
        raise BadInput(f"{path} exists; pass --overwrite to replace it")
    if path.parent and not path.parent.exists():
        raise BadInput(f"folder of {path} does not exist")


def _emit_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")


PRESET = default_run()
"""The swarm's built-in run: simulate's defaults are its settings (one preset, issue 17)."""


@app.command()
def simulate(
    algo: str = typer.Option("sync", help="|".join(SIM_ALGOS)),
    workers: int = typer.Option(4, help="Simulated workers (k)."),
    total_steps: int = typer.Option(800, help="Budget of local steps summed over all workers."),
    inner_steps: int = typer.Option(
        50, "--inner-steps", "-H", help="H: inner steps per round (fastest worker under DyLU)."
    ),
    heterogeneity: str = typer.Option("none", help="Device speeds: none|slight|moderate|very."),
    jitter: float = typer.Option(0.0, help="Per-step log-normal jitter of virtual step times."),
    grace_s: float = typer.Option(PRESET[1].grace_s, help="Async grace period, virtual s."),
    grace_share: float = typer.Option(GRACE_SHARE, help="Async grace, share of a phase."),
    comm_s: float = typer.Option(0.0, help="Virtual seconds one all-reduce takes."),
    overlap: str = typer.Option("none", help="Overlapped rounds: none|eager|local|proxy."),
    overlap_fold: str = typer.Option(PRESET[1].fold, help="Fold: rebase|mix|pull."),
    overlap_keep: float = typer.Option(PRESET[1].keep, help="The fold's share κ kept."),
    overlap_from: str = typer.Option(PRESET[1].start_from, help="Phases start: phase|group."),
    overlap_term: str = typer.Option("own", help="mix δ: own (as measured) | shared (swarm's)."),
    fragments: int = typer.Option(1, help="Sync: Streaming DiLoCo's fragments per round."),
    staleness_threshold: int = typer.Option(10, help="async-polythres drops staler contributions."),
    drop_prob: float = typer.Option(0.0, help="Sync: chance a contribution is lost (Fig. 8)."),
    compute_schedule: str = typer.Option(
        "constant", help="Sync: constant|doubling|halving|ramp-up|ramp-down."
    ),
    shards: str = typer.Option("iid", help="iid or non-iid (k-means on the model's features)."),
    num_shards: int = typer.Option(PRESET[0].num_shards, help="Data shards; 0: one per worker."),
    schedule_steps: int = typer.Option(0, help="T of each shard's cosine; 0 = 10,000."),
    outer_optimizer: str = typer.Option(
        "nesterov", help="sgd|sgdm|nesterov|adam|delayed-nesterov (sync)."
    ),
    outer_lr: float = typer.Option(0.7, help="Outer learning rate."),
    outer_momentum: float = typer.Option(0.9, help="Outer momentum."),
    dn_buffer_size: int = typer.Option(0, help="Delayed Nesterov N; 0 = workers."),
    dn_c: float = typer.Option(0.0, help="Delayed Nesterov leak c in [0, 1/N]."),
    compression: str = typer.Option(
        RunSpec.compression, help="Pseudo-gradients on the wire: none|fp16|int8|int4."
    ),
    prune_fraction: float = typer.Option(
        RunSpec.prune_fraction, help="Zero this fraction of each δ tensor's smallest values."
    ),
    inner_lr: float = typer.Option(RunSpec.inner_lr, help="Peak AdamW learning rate."),
    warmup_steps: int = typer.Option(PRESET[0].warmup_steps, help="Warm-up steps of a schedule."),
    batch_size: int = typer.Option(RunSpec.batch_size, help="Sequences per inner step."),
    seq_len: int = typer.Option(RunSpec.seq_len, help="Tokens per sequence."),
    pretrain_steps: int = typer.Option(0, help="Shared single-worker pretraining steps first."),
    model: str = typer.Option("nano", help="Model preset: nano|tiny|20m|60m|150m|400m."),
    data: str = typer.Option(RunSpec.data, help="builtin:python-stdlib, a path or a hub name."),
    tokenizer: str = typer.Option(RunSpec.tokenizer, help="bytes|tokenizer.json path|bpe:VOCAB."),
    max_tokens: int = typer.Option(RunSpec.max_tokens, help="Corpus token cap (0 = none)."),
    val_sequences: int = typer.Option(RunSpec.val_sequences, help="Held-out sequences for ppl."),
    seed: int = typer.Option(0, help="Seed of everything."),
    init: Path | None = typer.Option(None, help="Start from this checkpoint."),
    save: Path | None = typer.Option(None, help="Write the final global model here (safetensors)."),
    overwrite: bool = typer.Option(False, help="Allow --save to replace an existing file."),
    eval_every: int = typer.Option(0, help="Evaluate every N local steps (0 = about 20 points)."),
    threads: int = typer.Option(0, help="torch threads (0 = default)."),
    device: str = typer.Option("cpu", help="cpu|cuda|auto: where the replicas train."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run DiLoCo / asynchronous Local-SGD in deterministic virtual time."""
    configure_logging(verbose)
    run = RunSpec(
        model=model, data=data, tokenizer=tokenizer, max_tokens=max_tokens, seq_len=seq_len,
        batch_size=batch_size, val_sequences=val_sequences, inner_lr=inner_lr,
        warmup_steps=warmup_steps, inner_steps=inner_steps, outer_optimizer=outer_optimizer,
        outer_lr=outer_lr, outer_momentum=outer_momentum, dn_buffer_size=dn_buffer_size,
        dn_c=dn_c, shards=shards, num_shards=num_shards, schedule_steps=schedule_steps, seed=seed,
        compression=compression, prune_fraction=prune_fraction,
    )  # fmt: skip
    spec = SimSpec(
        run=run, algo=algo, workers=workers, total_steps=total_steps, heterogeneity=heterogeneity,
        jitter=jitter, grace_s=grace_s, grace_share=grace_share, comm_s=comm_s, overlap=overlap,
        overlap_fold=overlap_fold, overlap_keep=overlap_keep, overlap_from=overlap_from,
        overlap_term=overlap_term, fragments=fragments, drop_prob=drop_prob, threads=threads,
        staleness_threshold=staleness_threshold, compute_schedule=compute_schedule,
        pretrain_steps=pretrain_steps, eval_every=eval_every, init=str(init) if init else None,
    )  # fmt: skip
    _check_new_file(save, overwrite)
    _simulate(spec, save, json_out, device)


def _simulate(spec: SimSpec, save: Path | None, json_out: bool, device: str = "cpu") -> None:
    """Run the simulator with a progress bar, save its model if asked, print the result."""
    from diloco_peer.sim.simulator import Simulator  # heavy imports only when needed

    # builds data and model; bad input fails here, before any output
    sim = Simulator(spec, device=device)
    with _progress_bar(enabled=_stderr.is_terminal or not json_out) as bar:
        task = bar.add_task(spec.algo, total=spec.total_steps)
        sim.on_progress = lambda done, total: bar.update(task, completed=done, total=total)
        result = sim.run()
    if save is not None:
        from diloco_peer.peer.checkpoint import save_model_checkpoint

        extra = {"algo": spec.algo, "final_ppl": result["final_ppl"],
                 "local_steps": result["local_steps"]}  # fmt: skip
        save_model_checkpoint(save, sim.model, spec.run, extra=extra)
    if json_out:
        _emit_json(result)
        return
    typer.echo(
        f"{spec.algo}: ppl {result['initial_ppl']:.2f} -> {result['final_ppl']:.2f} after "
        f"{result['local_steps']} local steps, {result['outer_updates']} outer updates, "
        f"sim time {result['sim_time']:.1f}s"
    )
    if save is not None:
        typer.echo(f"saved {save}")


@app.command("eval")
def eval_cmd(
    checkpoint: Path = typer.Option(..., help="A safetensors checkpoint written by diloco-peer."),
    data: str | None = typer.Option(None, help="Evaluate on this source instead of the run's."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Validation perplexity of a checkpoint."""
    configure_logging()
    from dataclasses import replace

    from diloco_peer.peer.checkpoint import load_into_model, load_model_checkpoint
    from diloco_peer.peer.data import build_dataset
    from diloco_peer.peer.inner import evaluate_loss, perplexity
    from diloco_peer.peer.model import build_model

    ckpt = load_model_checkpoint(checkpoint)
    run = replace(ckpt.run, data=data) if data else ckpt.run
    dataset = build_dataset(
        run.data, run.tokenizer, run.seq_len, run.val_sequences, run.max_tokens, run.seed
    )
    model = build_model(run.model, dataset.vocab_size, run.seed, max_seq_len=run.seq_len)
    load_into_model(model, ckpt, checkpoint)
    loss = evaluate_loss(model, dataset.val)
    doc = {
        "checkpoint": str(checkpoint),
        "loss": loss,
        "ppl": perplexity(loss),
        "val_sequences": len(dataset.val),
        "data": run.data,
        "model": run.model,
    }
    if json_out:
        _emit_json(doc)
    else:
        typer.echo(f"{checkpoint}: validation ppl {doc['ppl']:.3f} (loss {loss:.4f}) on {run.data}")
