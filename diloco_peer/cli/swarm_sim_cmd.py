"""`simulate-swarm`: the round protocol for many peers in virtual time, no training."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from diloco_peer.cli.app import app, configure_logging
from diloco_peer.swarm_sim.spec import SwarmSimSpec

_stderr = Console(stderr=True)
_DEFAULT = SwarmSimSpec()


@app.command("simulate-swarm")
def simulate_swarm_cmd(
    peers: int = typer.Option(_DEFAULT.peers, help="Live peers (churn keeps the number)."),
    protocol: str = typer.Option(_DEFAULT.protocol, help="sync|async."),
    hierarchy: str = typer.Option(
        _DEFAULT.hierarchy, help="none (one group per version) | two-stage (groups combined)."
    ),
    group_size: int = typer.Option(_DEFAULT.group_size, help="Most members of one group."),
    hours: float = typer.Option(_DEFAULT.hours, help="Virtual hours to simulate."),
    churn: float = typer.Option(
        _DEFAULT.churn_per_hour, help="Share of peers that crash per hour (as many join)."
    ),
    inner_steps: int = typer.Option(_DEFAULT.inner_steps, "--inner-steps", "-H", help="H."),
    step_s: float = typer.Option(_DEFAULT.step_s, help="Seconds per inner step, fastest device."),
    heterogeneity: str = typer.Option(
        _DEFAULT.heterogeneity, help="Device speeds: none|slight|moderate|very."
    ),
    jitter: float = typer.Option(_DEFAULT.jitter, help="Log-normal spread of phase times."),
    model_mb: float = typer.Option(_DEFAULT.model_mb, help="θ in fp32, MB."),
    compression: str = typer.Option(_DEFAULT.compression, help="All-reduce codec: none|fp16|int8."),
    outer_buffers: int = typer.Option(
        _DEFAULT.outer_buffers, help="Outer optimizer buffers in the state (Nesterov 1, DN 2)."
    ),
    bandwidth_mbit: float = typer.Option(_DEFAULT.bandwidth_mbit, help="Each peer's link."),
    bandwidth_spread: float = typer.Option(
        _DEFAULT.bandwidth_spread, help="Links log-uniform in [bandwidth/spread, bandwidth]."
    ),
    latency_s: float = typer.Option(_DEFAULT.latency_s, help="One-way latency."),
    dht_delay_s: float = typer.Option(_DEFAULT.dht_delay_s, help="DHT record delay."),
    sync_timeout_s: float = typer.Option(_DEFAULT.sync_timeout_s, help="Sync group search."),
    allreduce_timeout_s: float = typer.Option(_DEFAULT.allreduce_timeout_s, help="All-reduce."),
    grace_s: float = typer.Option(_DEFAULT.grace_s, help="Async grace period, seconds."),
    staleness_limit: int = typer.Option(_DEFAULT.staleness_limit, help="Drop staler δs."),
    seed: int = typer.Option(_DEFAULT.seed, help="Seed of speeds, links and churn."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Simulate the swarm's round protocol for 2 to 100,000 peers: versions per hour, bytes per
    peer per version, waits, forks, and how many finished phases reach an applied update."""
    configure_logging()
    spec = SwarmSimSpec(
        peers=peers, protocol=protocol, hierarchy=hierarchy, group_size=group_size, hours=hours,
        churn_per_hour=churn, inner_steps=inner_steps, step_s=step_s, heterogeneity=heterogeneity, jitter=jitter,
        model_mb=model_mb, compression=compression, outer_buffers=outer_buffers,
        bandwidth_mbit=bandwidth_mbit, bandwidth_spread=bandwidth_spread, latency_s=latency_s,
        dht_delay_s=dht_delay_s, sync_timeout_s=sync_timeout_s,
        allreduce_timeout_s=allreduce_timeout_s, grace_s=grace_s,
        staleness_limit=staleness_limit, seed=seed,
    )  # fmt: skip
    from diloco_peer.swarm_sim.engine import SwarmSim

    bar = Progress(
        TextColumn("[bold]swarm"), BarColumn(), TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(), console=_stderr, disable=not (_stderr.is_terminal or not json_out),
    )  # fmt: skip
    with bar:
        task = bar.add_task("swarm", total=spec.hours * 60, what="")

        def progress(now: float, sim: SwarmSim) -> None:
            head = sim.history.states[sim.head()].version
            what = f"{now / 60:.0f}/{spec.hours * 60:.0f} virtual min, version {head}"
            bar.update(task, completed=now / 60, what=what + f", {len(sim.live_peers())} live")

        doc = SwarmSim(spec, progress).run().document()
        bar.update(task, completed=spec.hours * 60)
    if json_out:
        sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
        return
    typer.echo(summary(doc))


def summary(doc: dict[str, Any]) -> str:
    phases, b = doc["phases"], doc["bytes_per_peer_version"]
    frac = doc["applied_fraction"]
    lines = [
        f"{doc['versions']} versions ({doc['versions_per_hour']:.1f}/h), forks {doc['forks']}, "
        f"groups failed {doc['groups']['failed']}, gave up to a rival "
        f"{doc['groups']['gave_up_to_a_rival']}, to a swarm that moved past its base "
        f"{doc['groups']['gave_up_moved_past']}",
        f"phases finished {phases['finished']}: applied {phases['applied']}, dropped as stale "
        f"{phases['dropped_stale']}, lost {phases['lost']}, in flight at the end "
        f"{phases['in_flight_at_end']}; applied share "
        + ("—" if frac is None else f"{frac:.3f}"),
        "per peer per version: received "
        + ("—" if b["received_models"] is None else f"{b['received_models']:.2f}")
        + " × θ, sent " + ("—" if b["sent_models"] is None else f"{b['sent_models']:.2f}")
        + " × θ (all-reduce)",
        "round wait s: mean " + _s(doc["wait_s"]["mean"]) + ", p90 " + _s(doc["wait_s"]["p90"])
        + ", utilization " + _s(doc["utilization"], 3),
    ]  # fmt: skip
    return "\n".join(lines)


def _s(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"
