"""`join`, `demo` and `status`: the swarm from the command line."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.errors import BadInput
from diloco_peer.peer_spec import PeerSpec

if TYPE_CHECKING:
    from diloco_peer.demo import Demo

_out = Console()
_err = Console(stderr=True)


@app.command()
def join(
    swarm: list[str] = typer.Option(
        [], help="Multiaddr of a peer in the swarm (repeatable); none founds a new swarm."
    ),
    run: str = typer.Option("default", help="Run name to found or join."),
    config: Path | None = typer.Option(None, help="run.toml ([run], [swarm]) when founding."),
    model: str | None = typer.Option(None, help="Founding only: model preset of the built-in run."),
    inner_steps: int | None = typer.Option(None, "--inner-steps", "-H", help="Founding only: H."),
    protocol: str | None = typer.Option(
        None, help="Founding only: sync (DiLoCo) or async (DyLU + Delayed Nesterov)."
    ),
    expected_peers: int | None = typer.Option(
        None, help="Founding only: peers the run expects (first round waits for them)."
    ),
    overlap: bool = typer.Option(False, "--overlap", help="Founding only: overlapped rounds."),
    fragments: int | None = typer.Option(None, help="Founding only, sync: P model parts."),
    host: str = typer.Option("0.0.0.0", help="Interface to listen on."),
    port: int = typer.Option(0, help="TCP port (0 = any free)."),
    announce: list[str] = typer.Option([], help="Multiaddr others should dial (repeatable)."),
    client_mode: bool = typer.Option(
        False,
        "--client-mode",
        help="Dial out only, for a machine others cannot dial (NAT, firewall; see `doctor`).",
    ),
    identity: Path | None = typer.Option(None, help="Key file from `diloco-peer keygen`."),
    device: str = typer.Option("auto", help="auto|cpu|cuda"),
    batch_size: str = typer.Option(
        "0", help="Micro-batch (gradients accumulate to the run's batch); 'auto' fits memory."
    ),
    checkpoint_dir: Path | None = typer.Option(None, help="Save and resume checkpoints here."),
    max_rounds: int = typer.Option(0, help="Stop after this many rounds (0 = run until stopped)."),
    until_version: int = typer.Option(0, help="Stop once the swarm reaches this version."),
    until_steps: int = typer.Option(
        0, help="Stop once the swarm state holds this many local steps, all peers (0 = never)."
    ),
    log_json: Path | None = typer.Option(None, help="Append JSON events here."),
    data: str | None = typer.Option(None, help="Train on this local data (consortium mode)."),
    threads: int = typer.Option(0, help="torch threads (0 = default)."),
    shard: int = typer.Option(-1, help="Train only on this shard (default: the sampler picks)."),
    throttle: float = typer.Option(1.0, help="Emulate a slower device: run FACTOR times slower."),
    record_updates: Path | None = typer.Option(
        None, help="Debug: write every applied update (average, count) into this new folder."
    ),
    max_hours: float = typer.Option(0.0, help="Stop (checkpoint, leave) after this many hours."),
    metrics_port: int = typer.Option(-1, help="Prometheus metrics port (0 = any; default none)."),
    metrics_host: str = typer.Option("127.0.0.1", help="Interface of the metrics endpoint."),
    dashboard_port: int = typer.Option(-1, help="Health page port (0 = any; default none)."),
    dashboard_host: str = typer.Option("127.0.0.1", help="Interface of the health page."),
    tensorboard: Path | None = typer.Option(
        None, help="Write TensorBoard event files here (pip install 'diloco-peer[tb]')."
    ),
    gpu_memory_fraction: float = typer.Option(
        1.0, help="CUDA: share of the GPU's memory this peer may use."
    ),
    allowlist: Path | None = typer.Option(None, help="Private swarm: the owner's allowlist."),
    owner: str | None = typer.Option(None, help="Joining: the run owner's peer id."),
    chaos: str | None = typer.Option(None, hidden=True, help="Test only: misbehave (chaos.py)."),
    fault: list[str] = typer.Option([], hidden=True, help="Test only: NAME=N (faults.py)."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Join a swarm (or found one) and train with DiLoCo, synchronous or asynchronous.

    SIGUSR1 pauses the peer (it leaves the groups; nobody waits for it), SIGUSR2 resumes it."""
    configure_logging(verbose)
    spec = PeerSpec(
        run_name=run, swarm=tuple(swarm), config=_text(config), host=host, port=port,
        announce=tuple(announce), identity=_text(identity), device=device,
        micro_batch_size=_micro_batch(batch_size), checkpoint_dir=_text(checkpoint_dir),
        max_rounds=max_rounds, until_version=until_version, until_steps=until_steps,
        log_json=_text(log_json), data=data, threads=threads, shard=shard, throttle=throttle,
        record_updates=_text(record_updates), max_hours=max_hours, metrics_port=metrics_port,
        metrics_host=metrics_host, dashboard_port=dashboard_port, dashboard_host=dashboard_host,
        tensorboard=_text(tensorboard), client_mode=client_mode,
        gpu_memory_fraction=gpu_memory_fraction, allowlist=_text(allowlist), owner=owner,
    )  # fmt: skip
    flags = (expected_peers, overlap, fragments)
    founding = _founding(spec, config, model, inner_steps, protocol, flags)
    _train(spec, founding, (fault, chaos), quiet)


def _text(path: Path | None) -> str | None:
    return str(path) if path else None


def _micro_batch(text: str) -> int:
    if text == "auto":
        return -1
    try:
        return int(text)
    except ValueError:
        raise BadInput(f"--batch-size must be 'auto' or a number, got {text!r}") from None


def _founding(
    spec: PeerSpec,
    config: Path | None,
    model: str | None,
    inner_steps: int | None,
    protocol: str | None,
    flags: tuple[int | None, bool, int | None],
) -> tuple[RunSpec, SwarmSettings] | None:
    """The run a founding peer publishes (built-in, or --config) with the founding flags
    applied (`flags`: --expected-peers, --overlap, --fragments); None when joining, where
    those flags are refused."""
    expected_peers, overlap, fragments = flags
    from diloco_peer.config import default_run
    from diloco_peer.coordinator_free.manifest import check_fragments, load_run_config

    if not spec.swarm and spec.client_mode:
        raise BadInput("--client-mode needs --swarm: the founder must accept connections")
    if spec.swarm:
        if (model or inner_steps or config or protocol or expected_peers is not None or overlap
                or fragments is not None):  # fmt: skip
            raise BadInput(
                "--config, --model, --inner-steps, --protocol, --expected-peers, --overlap and "
                "--fragments only apply when founding a swarm"
            )
        return None
    if protocol not in (None, "sync", "async"):
        raise BadInput(f"unknown --protocol {protocol!r}; choose sync or async")
    if config is not None:
        run_spec, settings = load_run_config(config)
        if protocol:
            settings = dataclasses.replace(settings, protocol=protocol)
    else:
        run_spec, settings = default_run(model or "tiny", protocol or "sync")
    overrides = {"model": model, "inner_steps": inner_steps}
    run_spec = dataclasses.replace(run_spec, **{k: v for k, v in overrides.items() if v})
    if expected_peers is not None:
        settings = dataclasses.replace(settings, expected_peers=expected_peers)
    if overlap:
        settings = dataclasses.replace(settings, overlap=True)
    if fragments is not None:
        settings = dataclasses.replace(settings, fragments=fragments)
    check_fragments(run_spec, settings)
    if (settings.protocol == "async" and run_spec.outer_optimizer == "delayed-nesterov"
            and not run_spec.dn_buffer_size and not settings.expected_peers):  # fmt: skip
        # N = 1 applies each group member's share as its own Nesterov step: naive async,
        # which the async paper (and our simulator) found far worse than sync (ALGORITHMS §2.1)
        raise BadInput(
            "async mode needs --expected-peers N (Delayed Nesterov's buffer: about the number "
            "of peers that will train), or dn_buffer_size in the run config"
        )
    return run_spec, settings


def _train(
    spec: PeerSpec,
    founding: tuple[RunSpec, SwarmSettings] | None,
    faults: tuple[list[str], str | None],
    quiet: bool,
) -> None:
    """Run the peer until it stops, with a progress bar (unless `quiet`) and a line per round."""
    from diloco_peer.peer.faults import FaultPlan
    from diloco_peer.peer.signals import install_signal_handlers
    from diloco_peer.peer.swarm_peer import SwarmPeer

    progress = Progress(
        TextColumn("[bold]v{task.fields[version]}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
        console=_err, disable=quiet, transient=True,
    )  # fmt: skip
    task = progress.add_task("inner", total=None, version=0, loss="-")

    def on_step(done: int, total: int, loss: float) -> None:
        progress.update(task, completed=done, total=total, loss=f"{loss:.3f}")

    def on_round(r: Any) -> None:
        progress.update(task, version=r.version, completed=0)
        ppl = f"{r.ppl:.2f}" if r.ppl is not None else "-"
        stale = f", staleness {r.staleness}" if r.staleness else ""
        _err.print(
            f"round v{r.version}: group {r.group_size}, {r.steps} steps{stale}, loss {r.loss:.3f}, "
            f"held-out ppl {ppl}, comm {r.comm_s:.2f}s, sent {r.bytes_sent / 1e6:.2f} MB, "
            f"received {r.bytes_received / 1e6:.2f} MB, state {r.state_hash[:12]}"
        )

    plan = FaultPlan.parse(*faults)  # test-only flags: --fault NAME=N, --chaos MODE
    peer = SwarmPeer(spec, founding=founding, faults=plan, on_step=on_step, on_round=on_round)
    install_signal_handlers(peer)
    try:
        peer.start()
        addrs = " ".join(f"--swarm {m}" for m in peer.visible_maddrs())
        pin = f"--run {spec.run_name} --owner {peer.signed.owner_peer_id}"
        _out.print(f"swarm address (pass to others): diloco-peer join {addrs} {pin}",
                   soft_wrap=True)  # fmt: skip
        sys.stdout.flush()
        with progress:
            peer.run_loop()
    finally:
        peer.shutdown()
    _err.print(f"stopped at version {peer.state.version} after {peer.rounds_done} rounds")


@app.command()
def demo(
    peers: int = typer.Option(4, help="Peer processes to start on 127.0.0.1."),
    rounds: int = typer.Option(3, help="Train until the swarm state reaches this version."),
    total_steps: int = typer.Option(
        0, help="Instead of --rounds: train until the state holds this many local steps."
    ),
    model: str = typer.Option("tiny", help="Model preset of the built-in run."),
    inner_steps: int = typer.Option(50, "--inner-steps", "-H", help="Inner steps per round."),
    protocol: str = typer.Option("sync", help="sync (DiLoCo) or async (DyLU + Delayed Nesterov)."),
    heterogeneity: str = typer.Option(
        "none", help="Emulated device speeds (none|slight|moderate|very), by throttling peers."
    ),
    timeout_s: float = typer.Option(1800.0, help="Give up (and stop every peer) after this long."),
    log_json: Path | None = typer.Option(None, help="Also write every peer's events here."),
    overlap: bool = typer.Option(False, "--overlap", help="Train through each round's averaging."),
    fragments: int = typer.Option(
        1, help="Sync: average the model in this many parts, one a round."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON summary on stdout."),
) -> None:
    """A local swarm of real peer processes training the built-in run, with a summary."""
    configure_logging()
    from diloco_peer.demo import Demo, DemoSpec

    spec = DemoSpec(
        peers=peers, rounds=rounds, total_steps=total_steps, model=model, inner_steps=inner_steps,
        protocol=protocol, heterogeneity=heterogeneity, timeout_s=timeout_s, log_json=log_json,
        overlap=overlap, fragments=fragments,
    )  # fmt: skip
    _stop_on_sigterm()
    with Demo(spec) as run:
        run.launch()
        with Live(_demo_table(run), console=_err, refresh_per_second=2, transient=json_out) as live:
            for _ in run.follow():
                live.update(_demo_table(run))
    summary = run.summary()
    if json_out:
        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    else:
        before, after = summary["ppl_before"], summary["ppl_after"]
        agree = "agree" if summary["hashes_agree"] else "DIFFER"
        _out.print(
            f"swarm: version {summary['final_version']}, state hashes {agree}, "
            f"held-out ppl {before:.2f} -> {after:.2f}"
            if before and after
            else "swarm: no round completed"
        )
        _out.print(f"logs in {summary['logs']}")
    if any(p["exit_code"] != 0 for p in summary["peers"]):
        raise typer.Exit(1)


def _stop_on_sigterm() -> None:
    """SIGTERM stops the demo as Ctrl+C does: leaving the `with Demo` block stops every peer.
    Without it, SIGTERM ended the demo's process alone and its peers trained on."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _demo_table(run: Demo) -> Table:
    spec = run.spec
    t = Table(
        title=f"diloco-peer demo: {spec.peers} peers, {spec.protocol}, until version "
        f"{spec.rounds}, model {spec.model}, heterogeneity {spec.heterogeneity}"
    )
    for col in ("peer", "id", "rounds", "version", "loss", "held-out ppl", "state"):
        t.add_column(col)
    for i, r in enumerate(run.rows):
        t.add_row(
            f"peer{i}", (r.peer or "")[-8:], str(r.rounds),
            "-" if r.version is None else str(r.version), f"{r.loss:.3f}" if r.loss else "-",
            f"{r.ppl:.2f}" if r.ppl else "-", (r.state_hash or "")[:12],
        )  # fmt: skip
    return t


@app.command()
def status(
    swarm: list[str] = typer.Option(..., help="Multiaddr of a peer in the swarm (repeatable)."),
    run: str = typer.Option("default", help="Run name."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Live peers of a run: version, state hash, speed, last loss, last seen; forks, bans."""
    configure_logging()
    from diloco_peer.coordinator_free.status import read_heads, status_document

    doc = status_document(run, read_heads(swarm, run), time.time())
    if json_out:
        sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
        return
    t = Table(title=f"run {run}: head version {doc['head_version']}")
    for col in (
        "peer",
        "version",
        "state",
        "steps/s",
        "loss",
        "memory",
        "cpu",
        "busy",
        "seen",
        "banned by",
    ):
        t.add_column(col)
    for p in doc["peers"]:
        t.add_row(p["peer_id"][-10:] + (" (client)" if p["client"] else ""), str(p["version"]),
                  p["state_hash"][:12], f"{p['speed']:.2f}",
                  f"{p['loss']:.3f}" if p["loss"] is not None else "-",
                  f"{p['rss_mb']:.0f} MB" if p["rss_mb"] is not None else "-",
                  f"{p['cpu_percent']:.0f}%" if p["cpu_percent"] is not None else "-",
                  f"{100 * p['utilization']:.0f}%" if p["utilization"] is not None else "-",
                  f"{p['last_seen_s']:.0f}s ago", str(p["banned_by"] or "-"))  # fmt: skip
    _out.print(t)
    for peer, entry in sorted(doc["banned"].items()):
        _out.print(f"banned: {peer} by {len(entry['by'])} peer(s): {'; '.join(entry['reasons'])}")
    if doc["forks"]:
        _out.print(f"forks: {doc['forks']}")
