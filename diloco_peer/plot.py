"""Training curves from JSON logs, as one PNG of four panels (the `plot` command's logic).

Inputs are the event logs of `join --log-json` / `demo --log-json` (DESIGN §6: one JSON object
per line, read by peer/events.py; a demo log mixes several peers) and `simulate --json`
documents, so that simulated and real runs share a figure. matplotlib is imported only once the
inputs have been read, so that a bad input is refused quickly.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_peer.errors import BadInput
from diloco_peer.peer.events import parse_events

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Point = tuple[float, float]
# Events that carry something to draw; the others (catch_up, round_failed, ...) only count
# towards the run's first-event time.
_DRAWN = ("start", "round", "stop")
FIGSIZE_IN = (13.0, 9.0)
"""The figure's size in inches."""
DPI = 100
"""The PNG's dots per inch."""


@dataclass(frozen=True, kw_only=True)
class Curve:
    """One line of the figure: one peer of a swarm run, or a whole simulator run."""

    label: str
    """Legend text: the file's name, then the peer id's last 8 characters or the simulator's
    algorithm."""
    ppl_by_steps: tuple[Point, ...] = ()
    """(local steps applied swarm-wide, held-out perplexity), in order of steps."""
    ppl_by_time: tuple[Point, ...] = ()
    """(seconds since the run's first event, held-out perplexity), in time order."""
    group_size_by_version: tuple[Point, ...] = ()
    """(version a round reached, peers in the group that made it)."""
    comm_s_by_version: tuple[Point, ...] = ()
    """(version a round reached, seconds from the end of local training to the commit)."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run: a swarm (one curve per peer) or a simulator document (one curve)."""

    source: str
    """The file(s) it was read from, for messages."""
    virtual: bool
    """True for a simulator run: its time axis is virtual seconds, not wall-clock."""
    curves: tuple[Curve, ...]


@dataclass(frozen=True)
class _Event:
    label: str  # of the file it came from
    run_key: tuple[str, str]  # ("manifest", digest) or ("file", path), see _run_keys
    data: dict[str, Any]


# ----------------------------------------------------------------------------- reading


def _number(value: Any) -> float | None:
    """A finite JSON number (not a bool), else None; json.loads accepts NaN and Infinity."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _ppl(value: Any) -> float | None:
    ppl = _number(value)
    return ppl if ppl is not None and ppl > 0 else None


def _valid_event(obj: Any) -> dict[str, Any] | None:
    """The DESIGN §6 fields this command relies on, checked; None for anything else."""
    if not isinstance(obj, dict):
        return None
    peer = obj.get("peer")
    if not isinstance(obj.get("event"), str) or _number(obj.get("time")) is None:
        return None
    if not isinstance(peer, str) or not peer:
        return None
    if obj["event"] in _DRAWN and _count(obj.get("version")) is None:
        return None
    return obj


def _read_text(path: Path) -> str:
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if path.is_dir():
        raise BadInput(f"{path}: is a folder, not a log file")
    try:
        # A peer killed mid-write can leave a torn line, even a torn UTF-8 sequence: decode
        # leniently, and let the JSON parser reject that one line.
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from None


def _parse_lines(path: Path, text: str) -> tuple[list[dict[str, Any]], int]:
    """The valid events of a JSON-lines log and the number of lines skipped as broken."""
    parsed, unparsable = parse_events(text)
    events = [e for e in parsed if _valid_event(e) is not None]
    skipped = unparsable + len(parsed) - len(events)
    if not any(e["event"] in _DRAWN for e in events):
        lines = unparsable + len(parsed)
        detail = f"{skipped} of {lines} lines unparsable" if skipped else "no start/round/stop"
        raise BadInput(f"{path}: no usable events ({detail})")
    return events, skipped


def _simulator_run(path: Path, label: str, doc: dict[str, Any]) -> tuple[Run, int]:
    """A `simulate --json` document as a run of one curve; also the number of bad points."""
    curve = doc.get("curve")
    if not isinstance(curve, list):
        raise BadInput(f"{path}: 'curve' of a simulate --json document must be a list")
    by_steps: list[Point] = []
    by_time: list[Point] = []
    initial = _ppl(doc.get("initial_ppl"))
    if initial is not None:  # the simulator evaluates before its first step
        by_steps.append((0.0, initial))
        by_time.append((0.0, initial))
    bad = 0
    for point in curve:
        p = point if isinstance(point, dict) else {}
        steps, t = _number(p.get("local_steps")), _number(p.get("sim_time"))
        ppl = _ppl(p.get("ppl"))
        if steps is None or t is None or ppl is None:
            bad += 1
            continue
        by_steps.append((steps, ppl))
        by_time.append((t, ppl))
    if not by_steps:
        raise BadInput(f"{path}: simulate --json document without a usable curve point")
    algo = doc.get("algo") if isinstance(doc.get("algo"), str) else "simulator"
    line = Curve(
        label=f"{label} {algo}",
        ppl_by_steps=tuple(sorted(by_steps)),
        ppl_by_time=tuple(sorted(by_time)),
    )
    return Run(source=str(path), virtual=True, curves=(line,)), bad


def _run_keys(path: Path, events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Which run each event belongs to: the manifest digest of its peer's latest `start`.

    Logs of one swarm written on several machines share the digest and so are pooled (their
    peers' steps add up); a log file appended to by a second run (a new manifest, whose digest
    covers its creation time) is split. A peer seen before any of its starts takes its first
    start's digest, or the file's digest if the file has one, or else the file alone is the run.
    """
    digests = [
        e["manifest"]
        for e in events
        if e["event"] == "start" and isinstance(e.get("manifest"), str) and e["manifest"]
    ]
    first: dict[str, str] = {}
    for e in events:
        if e["event"] == "start" and isinstance(e.get("manifest"), str) and e["manifest"]:
            first.setdefault(e["peer"], e["manifest"])
    fallback = digests[0] if len(set(digests)) == 1 else None
    current: dict[str, str] = {}
    keys: list[tuple[str, str]] = []
    for e in events:
        if e["event"] == "start" and isinstance(e.get("manifest"), str) and e["manifest"]:
            current[e["peer"]] = e["manifest"]
        digest = current.get(e["peer"]) or first.get(e["peer"]) or fallback
        keys.append(("manifest", digest) if digest else ("file", str(path.resolve())))
    return keys


def _swarm_run(events: list[_Event], labels: dict[tuple[str, tuple[str, str]], str]) -> Run:
    """The curves of one swarm run, one per peer, from all its events across files."""
    # Swarm-wide local steps at version v: the steps of every round event up to v (each event
    # is one peer's contribution; a group's members all log its version and so share its total).
    # Deduplicated: a demo's combined log and a peer's own log may both be given.
    contributions: dict[tuple[str, int, float], int] = {}
    for ev in events:
        d = ev.data
        if d["event"] == "round":
            contributions[(d["peer"], d["version"], d["time"])] = _count(d.get("steps")) or 0
    by_version = sorted((version, steps) for (_, version, _), steps in contributions.items())
    versions = [version for version, _ in by_version]
    prefix = [0]
    for _, steps in by_version:
        prefix.append(prefix[-1] + steps)

    def steps_at(version: int) -> float:
        return float(prefix[bisect_right(versions, version)])

    t0 = min(float(ev.data["time"]) for ev in events)
    by_peer: dict[str, dict[tuple[str, float, int], _Event]] = {}
    for ev in events:
        d = ev.data
        if d["event"] in _DRAWN:
            by_peer.setdefault(d["peer"], {})[(d["event"], d["time"], d["version"])] = ev
    curves = []
    for peer, unique in by_peer.items():
        first = next(iter(unique.values()))
        steps: list[tuple[float, float, float]] = []  # (steps, time, ppl): time breaks ties
        times: list[Point] = []
        group: list[Point] = []
        comm: list[Point] = []
        for ev in sorted(unique.values(), key=lambda e: e.data["time"]):
            d = ev.data
            t, version = float(d["time"]) - t0, d["version"]
            # Round events carry ppl when evaluated that round; start and stop always try.
            ppl = _ppl(d.get("ppl"))
            if ppl is not None:
                steps.append((steps_at(version), t, ppl))
                times.append((t, ppl))
            if d["event"] == "round":
                size, comm_s = _count(d.get("group_size")), _number(d.get("comm_s"))
                if size is not None:
                    group.append((float(version), float(size)))
                if comm_s is not None and comm_s >= 0:
                    comm.append((float(version), comm_s))
        curves.append(
            Curve(
                label=f"{labels[(first.label, first.run_key)]} {peer[-8:]}",
                ppl_by_steps=tuple((x, ppl) for x, _, ppl in sorted(steps)),
                ppl_by_time=tuple(times),
                group_size_by_version=tuple(sorted(group)),
                comm_s_by_version=tuple(sorted(comm)),
            )
        )
    sources = sorted({ev.label for ev in events})
    return Run(source=", ".join(sources), virtual=False, curves=tuple(curves))


def _file_labels(paths: Sequence[Path]) -> list[str]:
    """File names, or the paths as given where two inputs share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def load_runs(paths: Sequence[Path]) -> tuple[list[Run], list[str]]:
    """The runs in these files, in order of first appearance, and notes on skipped lines.

    Raises BadInput for a missing, unreadable or empty file, or one with nothing to draw.
    """
    unique: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    runs: list[Run | list[_Event]] = []
    swarm: dict[tuple[str, str], list[_Event]] = {}
    labels: dict[tuple[str, tuple[str, str]], str] = {}
    notes: list[str] = []
    for path, label in zip(unique, _file_labels(unique), strict=True):
        text = _read_text(path)
        if not text.strip():
            raise BadInput(f"{path}: empty file")
        try:
            doc = json.loads(text)  # a simulate --json document, or a log of a single line
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict) and "curve" in doc:
            run, bad = _simulator_run(path, label, doc)
            runs.append(run)
            if bad:
                notes.append(f"{path}: skipped {bad} malformed curve point(s)")
            continue
        if isinstance(doc, dict) and "event" not in doc:
            hint = "; pass the demo's --log-json file" if "peers" in doc else ""
            raise BadInput(
                f"{path}: neither a --log-json event log nor a simulate --json document{hint}"
            )
        events, skipped = _parse_lines(path, text)
        if skipped:
            notes.append(f"{path}: skipped {skipped} unparsable or malformed line(s)")
        keys = _run_keys(path, events)
        order = list(dict.fromkeys(keys))  # this file's runs, in order of first appearance
        for n, key in enumerate(order):
            labels[(label, key)] = label if len(order) == 1 else f"{label}#{n + 1}"
        for key, data in zip(keys, events, strict=True):
            if key not in swarm:
                swarm[key] = []
                runs.append(swarm[key])  # placed now, built once every file is read
            swarm[key].append(_Event(label, key, data))
    built = [r if isinstance(r, Run) else _swarm_run(r, labels) for r in runs]
    # A run whose drawable events all lie in another run (an appended file's stray lines).
    return [r for r in built if r.curves], notes


# ----------------------------------------------------------------------------- drawing


def _draw(ax: Axes, points: Sequence[Point], label: str, style: dict[str, Any]) -> None:
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, label=label, **style)


def _finish(ax: Axes, title: str, xlabel: str, ylabel: str, empty: str, log_y: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if not handles:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="gray")
        return
    if log_y:  # perplexity falls over orders of magnitude
        from matplotlib.ticker import FuncFormatter

        def minor(value: float, _: int) -> str:
            # Over more than a decade, label 2, 3 and 5 only: nine labels a decade crowd.
            low, high = ax.get_ylim()
            mantissa = round(value / 10 ** math.floor(math.log10(value)))
            return f"{value:g}" if high < 10 * low or mantissa in (2, 3, 5) else ""

        ax.set_yscale("log")
        # Plain numbers ("30", "200") instead of "3×10¹".
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.legend(fontsize="small", ncol=1 if len(handles) <= 8 else 2)


def build_figure(runs: Sequence[Run], title: str | None = None) -> Figure:
    """Four panels: ppl vs local steps, ppl vs seconds, group size and communication seconds
    per round. Colours follow the curve across panels; simulator runs are dashed."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A bare Figure on the Agg canvas: no pyplot, no GUI backend, no global figure registry.
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_steps, ax_time), (ax_group, ax_comm) = fig.subplots(2, 2)
    lines = [(run, curve) for run in runs for curve in run.curves]
    colors = matplotlib.colormaps["tab10" if len(lines) <= 10 else "tab20"]
    for i, (run, curve) in enumerate(lines):
        style = {
            "color": colors(i % colors.N),
            "linestyle": "--" if run.virtual else "-",
            "marker": "o",
            "markersize": 3,
            "linewidth": 1.2,
        }
        _draw(ax_steps, curve.ppl_by_steps, curve.label, style)
        time_label = f"{curve.label} (virtual time)" if run.virtual else curve.label
        _draw(ax_time, curve.ppl_by_time, time_label, style)
        _draw(ax_group, curve.group_size_by_version, curve.label, style)
        _draw(ax_comm, curve.comm_s_by_version, curve.label, style)

    kinds = {run.virtual for run in runs}
    seconds = {
        frozenset({False}): "wall-clock seconds since the run's first event",
        frozenset({True}): "virtual seconds (simulator)",
    }.get(frozenset(kinds), "seconds since the run's start (wall-clock; simulator: virtual)")
    _finish(
        ax_steps, "Held-out perplexity vs local steps",
        "local steps applied, all peers (simulator: all workers)", "held-out perplexity",
        "no perplexity in these inputs", log_y=True,
    )  # fmt: skip
    _finish(
        ax_time, "Held-out perplexity vs time", seconds, "held-out perplexity",
        "no perplexity in these inputs", log_y=True,
    )  # fmt: skip
    _finish(
        ax_group, "Group size per round", "version (outer update)", "peers in the group",
        "no swarm rounds in these inputs", log_y=False,
    )  # fmt: skip
    _finish(
        ax_comm, "Communication per round", "version (outer update)",
        "communication seconds (wait + all-reduce)", "no swarm rounds in these inputs",
        log_y=False,
    )  # fmt: skip
    for ax in (ax_group, ax_comm):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    sizes = [size for _, curve in lines for _, size in curve.group_size_by_version]
    if sizes:  # from 0, so that a group of one reads as small; whole peers only
        ax_group.set_ylim(0, max(sizes) + 1)
        ax_group.yaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- writing


def check_out(out: Path, overwrite: bool, inputs: Sequence[Path]) -> None:
    """Refuse an --out that would not do: an input log, not a .png, a folder, an existing file
    without `overwrite`, a missing folder."""
    if out.exists() and any(p.exists() and os.path.samefile(p, out) for p in inputs):
        raise BadInput(f"--out {out} is one of the input logs")
    if out.suffix.lower() != ".png":
        raise BadInput(f"--out {out}: the figure is a PNG; give a name ending in .png")
    if out.is_dir():
        raise BadInput(f"--out {out} is a folder")
    if out.exists() and not overwrite:
        raise BadInput(f"{out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise BadInput(f"folder of {out} does not exist")


def save_png(fig: Figure, out: Path) -> None:
    """Write through a temporary file, so that a failed write leaves no partial PNG behind
    (which would then block a rerun without --overwrite)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    created = False
    try:
        with open(tmp, "xb") as f:  # created with the umask's permissions, like any output
            created = True
            fig.savefig(f, format="png", dpi=DPI)
        os.replace(tmp, out)
        created = False
    except OSError as e:
        raise BadInput(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        if created:  # never someone else's file that happened to have the name
            tmp.unlink(missing_ok=True)
