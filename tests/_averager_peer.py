"""One peer for tests/test_group_averager.py: a DHT, one P2PService shared by two GroupAverager
instances, driven by stdin.

    python tests/_averager_peer.py OUT_DIR

Prints `@@ {json}` lines on stdout (anything else there is noise to skip); logs go to stderr.
The first stdin line is {"op": "join", "initial_peers": [...]} (sent once a first peer is up, so
every peer imports torch and hivemind meanwhile); the answer is {"op": "ready", "peer": ...,
"maddrs": [...]}. Then one JSON command per stdin line, one answer each:

    {"op": "average", "averager": "fp32"|"fp16"|"int8"|"int4"|"int8_prune50", "key": "v0", "seed": 1, "scale": 0.25,
     "shapes": [[3, 4], ...], "weight": 1.0, "target_size": 3, "matchmaking_timeout_s": 5,
     "allreduce_timeout_s": 10, "die_after_group": false, "ack_delay_s": 0,
     "give_up_after_s": 1.0 (optional: `give_up` says True from then on)}
        -> {"op": "average", "ok": true, "sha256": ..., "path": <safetensors file>, ...}
           or {"op": "average", "ok": false, "error": "NoGroup"|"LeftOut"|"GaveUp"|"AllReduceFailed",
               "refusal": <CommitRefusal name, for LeftOut>, ...}
    {"op": "quit"}

A join command with "client": true makes this peer's "client" averager a client-mode one (it
reduces no part; the peer's DHT stays a server, so the other averagers are unaffected).

The contribution is `scale * randn(shape)` from a generator seeded with `seed`, so the test can
recompute every member's input. `die_after_group` SIGKILLs this peer's whole process group
(itself, its DHT process, its p2p daemon) right after it has joined a group. `ack_delay_s`
(fp32 averager only) stalls this peer that long between the group's assembly and its
acknowledgement, when it is a follower (GroupAverager's `delay_ack` fault). `withhold_parts`
(fp32 averager only) makes this peer a member that never sends its parts (`withhold_parts`
fault); a failed round's answer lists the members this peer waited for in vain ("silent").

The "signed" averager (fp32) is a real peer's: this peer's DHT runs under an `Identity` key, its
reducer signs receipts, and its admission takes every member's public key from the `gather`
bytes (which carry it, hex, after the seed), so answers' receipts are checked and compared
(averaging/receipts.py, echo.py). `equivocate` makes its reducer answer one member with other
bytes (the `equivocate` fault). Every answer lists the proofs this peer found since the last
command ("proofs": reducer, public key and both receipts, hex).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.dht import DHT
from safetensors.torch import save_file

from diloco_peer.averaging.group_averager import Admission, GroupAverager
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.averaging.receipts import Proof, Receipt
from diloco_peer.errors import AllReduceFailed, LeftOut, NoGroup
from diloco_peer.identity import Identity, peer_id_from_public_key
from diloco_peer.p2p.service import P2PService


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def contribution(seed: int, scale: float, shapes: list[list[int]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * scale for shape in shapes]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def kill_myself(key: str, members: list[str]) -> None:
    time.sleep(0.2)  # let the leader's answer reach every member: the group is formed for all
    os.killpg(os.getpgrp(), signal.SIGKILL)


def admit_with_keys(group: Group) -> Admission:
    """Every member, with the public key its gather bytes carry (if it is its peer id's)."""
    keys = {}
    for member, gathered in zip(group.members, group.gathered, strict=True):
        key = bytes.fromhex(gathered.decode().split(";key=")[-1])
        if peer_id_from_public_key(key) == member:
            keys[member] = key
    return Admission({m: None for m in keys}, {}, keys=keys)


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    return {"digest": receipt.digest.hex(), "part": receipt.part,
            "answer_hash": receipt.answer_hash.hex(), "signature": receipt.signature.hex()}  # fmt: skip


def proof_json(proof: Proof) -> dict[str, Any]:
    return {"reducer": proof.reducer, "public_key": proof.public_key.hex(),
            "first": receipt_json(proof.first), "second": receipt_json(proof.second)}  # fmt: skip


def run_average(
    averagers: dict[str, GroupAverager], cmd: dict[str, Any], out: Path, identity: Identity,
    proofs: list[Proof],
) -> None:  # fmt: skip
    averager = averagers[cmd["averager"]]
    tensors = contribution(cmd["seed"], cmd["scale"], cmd["shapes"])
    started = time.perf_counter()
    signed = cmd["averager"] == "signed"
    gather = f"seed={cmd['seed']}" + (f";key={identity.public_key.hex()}" if signed else "")
    try:
        result = averager.average(
            cmd["key"],
            tensors,
            weight=cmd["weight"],
            gather=gather.encode(),
            target_size=cmd["target_size"],
            matchmaking_timeout_s=cmd["matchmaking_timeout_s"],
            allreduce_timeout_s=cmd["allreduce_timeout_s"],
            admit=admit_with_keys if signed else None,
            give_up=(lambda: time.perf_counter() - started > cmd["give_up_after_s"])
            if "give_up_after_s" in cmd
            else None,
        )
    except (NoGroup, AllReduceFailed) as e:
        time.sleep(float(cmd.get("linger_s", 0.0)))  # let the others' echoes reach me
        emit(
            {
                "op": "average",
                "ok": False,
                "proofs": [proof_json(p) for p in proofs],
                "error": type(e).__name__,
                "refusal": e.refusal.name if isinstance(e, LeftOut) else None,
                "silent": list(e.silent) if isinstance(e, AllReduceFailed) else [],
                "message": str(e),
                "elapsed_s": time.perf_counter() - started,
            }
        )
        return
    elapsed_s = time.perf_counter() - started
    time.sleep(float(cmd.get("linger_s", 0.0)))
    path = out / f"{averager.peer_id}-{cmd['averager']}-{cmd['key']}.safetensors"
    save_file({str(i): t.contiguous() for i, t in enumerate(result.average)}, str(path))
    emit(
        {
            "op": "average",
            "ok": True,
            "elapsed_s": elapsed_s,
            "sha256": digest(result.average),
            "path": str(path),
            "members": result.members,
            "weights": result.weights,
            "gathered": {k: v.decode().split(";")[0] for k, v in result.gathered.items()},
            "proofs": [proof_json(p) for p in proofs],
            "group_id": result.group_id.hex(),
            "shapes": [list(t.shape) for t in result.average],
            "dtypes": sorted({str(t.dtype) for t in result.average}),
            "bytes_sent": result.bytes_sent,
            "bytes_received": result.bytes_received,
            "matchmaking_s": result.matchmaking_s,
            "allreduce_s": result.allreduce_s,
        }
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    join = json.loads(sys.stdin.readline() or "{}")
    if join.get("op") != "join":
        raise SystemExit(f"expected a join command first, got {join!r}")
    identity = Identity.generate()
    key_path = out / f"key-{os.getpid()}"
    identity.save(key_path)
    dht = DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=join["initial_peers"],
        identity_path=str(key_path),
    )  # fmt: skip
    service = P2PService(dht)
    averagers: dict[str, GroupAverager] = {}
    try:
        service.start()
        die = {"armed": False}
        stall = {"ack_delay_s": 0.0}
        mute = {"withhold_parts": False}
        fork = {"equivocate": False}
        proofs: list[Proof] = []

        def on_group(key: str, members: list[str]) -> None:
            if die["armed"]:
                kill_myself(key, members)

        averagers["fp32"] = GroupAverager(
            service,
            "t32",
            on_group=on_group,
            delay_ack=lambda key: stall["ack_delay_s"],
            withhold_parts=lambda key: mute["withhold_parts"],
        )
        averagers["fp16"] = GroupAverager(service, "t16", compression="fp16")
        averagers["int8"] = GroupAverager(service, "t8", compression="int8")
        averagers["int4"] = GroupAverager(service, "t4", compression="int4")
        averagers["int8_prune50"] = GroupAverager(
            service, "t8p", compression="int8", prune_fraction=0.5
        )
        averagers["client"] = GroupAverager(service, "tcm", client_mode=bool(join.get("client")))
        averagers["signed"] = GroupAverager(
            service, "tsg", sign=identity.sign, on_proof=proofs.append,
            equivocate=lambda key: fork["equivocate"],
        )  # fmt: skip
        for averager in averagers.values():
            averager.start()
        for averager in averagers.values():
            averager.wait_until_ready(timeout_s=30)
        emit(
            {
                "op": "ready",
                "peer": averagers["fp32"].peer_id,
                "maddrs": [str(m) for m in dht.get_visible_maddrs()],
            }
        )
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            die["armed"] = bool(cmd.get("die_after_group", False))
            stall["ack_delay_s"] = float(cmd.get("ack_delay_s", 0.0))
            mute["withhold_parts"] = bool(cmd.get("withhold_parts", False))
            fork["equivocate"] = bool(cmd.get("equivocate", False))
            proofs.clear()
            run_average(averagers, cmd, out, identity, proofs)
    finally:
        for averager in averagers.values():
            averager.shutdown()
        service.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
