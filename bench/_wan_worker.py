"""One peer of bench/wan.py, run inside a NetLab host and driven over stdin (one JSON per line).

    ip netns exec HOST python bench/_wan_worker.py

Prints `@@ {json}` lines on stdout (anything else there is noise); logs go to stderr. The first
stdin line is

    {"op": "join", "ip": "10.213.0.1", "initial_peers": [...], "role": ROLE, ...}

and the answer {"op": "ready", "peer": ..., "maddrs": [...]}. Then one command per line, one
answer each (plus `progress` lines during a download), until {"op": "quit"} or EOF.

Roles:

- "allreduce" (`numel`, `seeds`: every member's seed, `rank`: mine): a DHT, hivemind's plain
  `DecentralizedAverager` over one fp32 tensor of `numel` values, and our `GroupAverager`
  ("none": fp32 on the wire) on a P2PService, all sharing the DHT's p2p daemon. My contribution
  is randn(numel) seeded by seeds[rank]; the expected average is the mean of all of them.
    {"op": "ours", "key": K, "target_size": 4, "matchmaking_timeout_s": T, "allreduce_timeout_s": T}
    {"op": "hivemind", "timeout_s": T}
        -> {"ok": true, "step_s", "allreduce_s", "members", "max_error", ...} or {"ok": false, ...}
  hivemind's all-reduce phase is timed around `DecentralizedAverager._aggregate_with_group`
  (from the group being formed to the tensors being updated in place), in its own process; ours
  is split into phases (`trace_our_rounds`: parts in, reduce, answers back).
- "donor": a DHT, a P2PService and a StateServer (run "wan").
    {"op": "serve", "numel": N, "seed": S} -> {"state_hash", "bytes"}   (the same on every donor)
- "joiner": a DHT and a P2PService.
    {"op": "download", "donors": [...], "state_hash": H, "method": "multi"|"single",
     "timeout_s": T, "progress_at": 0.33}
        -> a {"op": "progress"} line once `progress_at` of the bytes are in (if given), then
           {"ok", "seconds", "bytes", "verified", ...}: verified = the sha256 of the bytes
           received equals `state_hash` (what the donors advertise) and they load as safetensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import multiprocessing as mp
import sys
import threading
import time
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.dht import DHT
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from diloco_peer.averaging.group_averager import GroupAverager
from diloco_peer.coordinator_free.state_transfer import (
    StateBlob,
    StateServer,
    StateTransferFailed,
    download_state,
    download_state_multi,
)
from diloco_peer.errors import AllReduceFailed, NoGroup
from diloco_peer.p2p.service import P2PService

RUN = "wan"
_READY_TIMEOUT_S = 60.0
_emit_lock = threading.Lock()


def emit(message: dict[str, Any]) -> None:
    with _emit_lock:
        sys.stdout.write("@@ " + json.dumps(message) + "\n")
        sys.stdout.flush()


class TimedAverager(DecentralizedAverager):
    """hivemind's averager, unchanged, plus the duration of its last all-reduce phase, written
    by its background process into shared memory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.last_allreduce_s = mp.Value(ctypes.c_double, -1.0)  # before the fork in start()
        super().__init__(*args, **kwargs)

    async def _aggregate_with_group(
        self, group_info: Any, min_vector_size: int, **kwargs: Any
    ) -> Any:
        started = time.perf_counter()
        try:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self.last_allreduce_s.value = time.perf_counter() - started


def trace_our_rounds() -> dict[str, Any] | None:
    """Timestamps of the last round, from wrappers around four methods of our all-reduce
    (allreduce.py): `PartExchange.all_reduce` (the round), `reducer.Round.deliver` (a member's
    part of mine is in), `reducer.Round._reduce` (my part, once every member's is in) and
    `member.PartSender._send_part` (the average of a part I sent is back). None if those
    methods are not there (renamed): the bench then reports no phases."""
    from diloco_peer.averaging import allreduce, member, reducer

    trace: dict[str, Any] = {}
    round_cls, exchange_cls, sender_cls = reducer.Round, allreduce.PartExchange, member.PartSender
    originals = [getattr(round_cls, "_reduce", None), getattr(round_cls, "deliver", None),
                 getattr(exchange_cls, "all_reduce", None),
                 getattr(sender_cls, "_send_part", None)]  # fmt: skip
    if any(f is None for f in originals):
        return None
    reduce_, deliver, all_reduce, send_part = originals

    async def timed_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        trace["parts_in"] = time.perf_counter()
        try:
            return await reduce_(self, *args, **kwargs)
        finally:
            trace["reduced"] = time.perf_counter()

    def timed_deliver(self: Any, sender: str, *args: Any, **kwargs: Any) -> Any:
        trace.setdefault("arrived", {})[self.members.index(sender)] = time.perf_counter()
        return deliver(self, sender, *args, **kwargs)

    async def timed_all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        trace.clear()
        trace["start"] = time.perf_counter()
        try:
            return await all_reduce(self, *args, **kwargs)
        finally:
            trace["end"] = time.perf_counter()

    async def timed_send_part(self: Any, rnd: Any, j: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return await send_part(self, rnd, j, *args, **kwargs)
        finally:
            trace.setdefault("answered", {})[j] = time.perf_counter()

    round_cls._reduce = timed_reduce  # type: ignore[method-assign]
    round_cls.deliver = timed_deliver  # type: ignore[method-assign]
    exchange_cls.all_reduce = timed_all_reduce  # type: ignore[method-assign]
    sender_cls._send_part = timed_send_part  # type: ignore[method-assign]
    return trace


def phases(trace: dict[str, Any] | None) -> dict[str, Any]:
    """The last round's phases: parts in (every member's part of mine arrived), reduce (my
    reducer's work), answers (until every part's average is back); and, since the round's
    start, when each member's part of mine arrived (`arrived_s`, by member index, mine
    included) and when the average of each part I sent came back (`answered_s`, by part)."""
    if not trace or not {"start", "parts_in", "reduced", "end"} <= trace.keys():
        return {}
    start = trace["start"]
    return {
        "started_at": start,  # time.perf_counter: CLOCK_MONOTONIC, one clock for every host
        "parts_in_s": trace["parts_in"] - start,
        "reduce_s": trace["reduced"] - trace["parts_in"],
        "answers_s": trace["end"] - trace["reduced"],
        "arrived_s": {str(i): t - start for i, t in sorted(trace.get("arrived", {}).items())},
        "answered_s": {str(j): t - start for j, t in sorted(trace.get("answered", {}).items())},
    }


def randn(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


class AllReducePeer:
    def __init__(self, dht: DHT, join: dict[str, Any]) -> None:
        numel, seeds, rank = int(join["numel"]), list(join["seeds"]), int(join["rank"])
        self.mine = randn(numel, seeds[rank])
        self.expected = torch.stack([randn(numel, s) for s in seeds]).mean(dim=0)
        self.numel = numel
        # hivemind forks its averager process here, before any thread of ours exists
        self.hivemind = TimedAverager(
            [torch.zeros(numel)], dht, start=False, prefix="wanhm",
            target_group_size=int(join.get("target_size", 4)),
            min_matchmaking_time=float(join.get("hivemind_matchmaking_s", 5.0)),
            request_timeout=3.0, allreduce_timeout=float(join.get("allreduce_timeout_s", 120.0)),
        )  # fmt: skip
        self.hivemind.run_in_background(await_ready=True, timeout=_READY_TIMEOUT_S)
        self.trace = trace_our_rounds()
        self.service = P2PService(dht)
        self.service.start()
        self.ours = GroupAverager(self.service, "wanar", compression="none")
        self.ours.start()
        self.ours.wait_until_ready(timeout_s=_READY_TIMEOUT_S)

    @property
    def peer_id(self) -> str:
        return self.ours.peer_id

    def run_ours(self, cmd: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            result = self.ours.average(
                cmd["key"], [self.mine], weight=1.0, gather=b"",
                target_size=int(cmd.get("target_size", 4)),
                matchmaking_timeout_s=float(cmd["matchmaking_timeout_s"]),
                allreduce_timeout_s=float(cmd["allreduce_timeout_s"]),
            )  # fmt: skip
        except (NoGroup, AllReduceFailed) as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        step_s = time.perf_counter() - started
        average = result.average[0]
        return {
            "ok": True,
            "step_s": step_s,
            "matchmaking_s": result.matchmaking_s,
            "allreduce_s": result.allreduce_s,
            "members": len(result.members),
            "bytes_sent": result.bytes_sent,
            "bytes_received": result.bytes_received,
            "max_error": float((average - self.expected).abs().max()),
            "sha256": hashlib.sha256(average.numpy().tobytes()).hexdigest(),
            **phases(self.trace),
        }

    def run_hivemind(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with self.hivemind.get_tensors() as tensors:
            tensors[0].copy_(self.mine)
        self.hivemind.last_allreduce_s.value = -1.0
        started = time.perf_counter()
        try:
            gathered = self.hivemind.step(weight=1.0, timeout=float(cmd["timeout_s"]))
        except Exception as e:  # hivemind raises whatever its round failed with
            return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        step_s = time.perf_counter() - started
        if gathered is None:
            return {"ok": False, "error": "step returned None (no group)"}
        with self.hivemind.get_tensors() as tensors:
            average = tensors[0].clone()
        return {
            "ok": True,
            "step_s": step_s,
            "allreduce_s": self.hivemind.last_allreduce_s.value,
            "members": len(gathered),
            "max_error": float((average - self.expected).abs().max()),
        }

    def shutdown(self) -> None:
        self.ours.shutdown()
        self.service.shutdown()
        self.hivemind.shutdown()


class Donor:
    def __init__(self, dht: DHT) -> None:
        self.blob: StateBlob | None = None
        self.service = P2PService(dht)
        self.service.start()
        self.service.wait_until_ready(timeout_s=_READY_TIMEOUT_S)
        self.peer_id = self.service.peer_id
        self.server = StateServer(self.service, RUN, provide=lambda: self.blob, max_uploads=8)
        self.server.start()
        self.server.wait_until_ready(timeout_s=_READY_TIMEOUT_S)

    def serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.blob = None
        tensors = {"theta": randn(int(cmd["numel"]), int(cmd["seed"]))}
        data = safetensors_save(tensors, {"version": "1"})
        self.blob = StateBlob(version=1, state_hash=hashlib.sha256(data).hexdigest(), data=data)
        return {"ok": True, "state_hash": self.blob.state_hash, "bytes": len(data)}

    def shutdown(self) -> None:
        self.server.shutdown()
        self.service.shutdown()


class Joiner:
    def __init__(self, dht: DHT) -> None:
        self.service = P2PService(dht)
        self.service.start()
        self.service.wait_until_ready(timeout_s=_READY_TIMEOUT_S)
        self.peer_id = self.service.peer_id

    def download(self, cmd: dict[str, Any]) -> dict[str, Any]:
        at = cmd.get("progress_at")
        told = {"done": at is None}
        started = time.perf_counter()

        def on_progress(received: int, total: int) -> None:
            if not told["done"] and total and received >= at * total:
                told["done"] = True
                emit({"op": "progress", "received": received, "total": total,
                      "seconds": time.perf_counter() - started})  # fmt: skip

        try:
            if cmd["method"] == "single":
                blob = download_state(
                    self.service, RUN, cmd["donors"][0], timeout_s=float(cmd["timeout_s"]),
                    on_progress=on_progress,
                )  # fmt: skip
            else:
                blob = download_state_multi(
                    self.service, RUN, cmd["donors"], cmd["state_hash"],
                    timeout_s=float(cmd["timeout_s"]), on_progress=on_progress,
                )  # fmt: skip
        except StateTransferFailed as e:
            return {"ok": False, "error": str(e)[:800], "seconds": time.perf_counter() - started}
        seconds = time.perf_counter() - started
        digest = hashlib.sha256(blob.data).hexdigest()
        try:
            loads = len(safetensors_load(blob.data)) > 0
        except Exception:  # any parse failure means an unusable state
            loads = False
        return {
            "ok": True,
            "seconds": seconds,
            "bytes": len(blob.data),
            "verified": digest == cmd["state_hash"] and loads,
            "sha256": digest,
        }

    def shutdown(self) -> None:
        self.service.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    join = json.loads(sys.stdin.readline() or "{}")
    if join.get("op") != "join":
        raise SystemExit(f"expected a join command first, got {join!r}")
    dht = DHT(
        start=True, host_maddrs=[f"/ip4/{join['ip']}/tcp/0"],
        initial_peers=join.get("initial_peers", []), await_ready=True,
    )  # fmt: skip
    peer: Any = None
    try:
        role = join["role"]
        if role == "allreduce":
            peer = AllReducePeer(dht, join)
        elif role == "donor":
            peer = Donor(dht)
        elif role == "joiner":
            peer = Joiner(dht)
        else:
            raise SystemExit(f"unknown role {role!r}")
        emit(
            {
                "op": "ready",
                "peer": peer.peer_id,
                "maddrs": [str(m) for m in dht.get_visible_maddrs()],
            }
        )
        handlers = {
            "ours": getattr(peer, "run_ours", None),
            "hivemind": getattr(peer, "run_hivemind", None),
            "serve": getattr(peer, "serve", None),
            "download": getattr(peer, "download", None),
        }
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            handler = handlers.get(cmd["op"])
            if handler is None:
                emit({"op": cmd["op"], "ok": False, "error": f"no {cmd['op']} for a {role}"})
                continue
            emit({"op": cmd["op"], **handler(cmd)})
    finally:
        if peer is not None:
            peer.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
