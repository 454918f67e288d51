"""One peer of a swarm: the round loop of DESIGN §3 in synchronous mode.

catch up (download the head's state, check its hash) -> plan (shard by Eq. 2, H steps) ->
train (inner AdamW, δ) -> contribute (group keyed by version, all-reduce) -> apply (outer step
on CPU fp32, replicated) -> publish the new head. A failed group keeps δ and adds it to the
next contribution; a lone peer applies its own δ (k = 1, Lookahead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.dht import DHT
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_peer.averaging.allreduce import AllReduceFailed
from diloco_peer.averaging.group_averager import GroupAverager
from diloco_peer.averaging.matchmaking import NoGroup
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import PeerSpec, RunSpec
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.manifest import Manifest, SignedManifest, SwarmSettings
from diloco_peer.coordinator_free.sampler import shard_probabilities
from diloco_peer.coordinator_free.state_transfer import (
    StateBlob,
    StateServer,
    StateTransferFailed,
    download_state,
)
from diloco_peer.errors import BadInput, ConfigError, DilocoError
from diloco_peer.identity import Identity
from diloco_peer.p2p_service import P2PService
from diloco_peer.peer.checkpoint import atomic_write, read_file_metadata, safetensors_metadata
from diloco_peer.peer.data import ShardStream, TokenDataset, build_dataset, iid_shards
from diloco_peer.peer.events import EventLog
from diloco_peer.peer.inner import InnerTrainer, Schedule, evaluate_loss, perplexity
from diloco_peer.peer.model import build_model, resolve_device

log = logging.getLogger(__name__)

DEFAULT_SHARDS = 8
HEAD_TTL_S = 60.0
"""A head older than this is a peer that left; heartbeats refresh it every HEAD_TTL_S / 4."""
DHT_TIMEOUT_S = 10.0
STATE_TIMEOUT_S = 120.0
CHECKPOINT_FORMAT = "diloco-peer/peer-checkpoint-v1"


class StopRequested(Exception):
    """Raised inside the inner loop when SIGINT/SIGTERM asked the peer to stop."""


@dataclass
class RoundReport:
    """What one round did, for the progress line and the JSON log."""

    version: int
    state_hash: str
    group_size: int
    loss: float
    ppl: float | None
    comm_s: float
    payload_bytes: int
    members: list[str] = field(default_factory=list)


def default_run(model: str = "tiny") -> tuple[RunSpec, SwarmSettings]:
    """The built-in run: tiny model, built-in corpus, byte tokens, synchronous DiLoCo."""
    run = RunSpec(model=model, inner_steps=50, warmup_steps=20, num_shards=DEFAULT_SHARDS)
    return run, SwarmSettings(protocol="sync", sync_timeout_s=30.0, allreduce_timeout_s=60.0)


class SwarmPeer:
    """Wires identity, DHT, manifest, data, model, averager and state server for one peer."""

    def __init__(
        self,
        spec: PeerSpec,
        founding: tuple[RunSpec, SwarmSettings] | None = None,
        on_step: Any = None,
        on_round: Any = None,
    ) -> None:
        self.spec = spec
        self.founding = founding
        self.on_step = on_step or (lambda done, total, loss: None)
        self.on_round = on_round or (lambda report: None)
        self._stop = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-peer-")
        self.identity = self._load_identity()
        self.peer_id = self.identity.peer_id_str
        self.events = EventLog(spec.log_json, self.peer_id)
        self.dht: DHT | None = None
        self.service: P2PService | None = None
        self.averager: GroupAverager | None = None
        self.server: StateServer | None = None
        self._blob: StateBlob | None = None
        self._pending: list[torch.Tensor] | None = None
        self._pending_samples: dict[int, int] = {}
        self._ready = False  # set once start() succeeded: only then may shutdown() checkpoint
        self._seen: dict[str, records.PeerHead] = {}
        # Peers a group formed without, with the time: not waited for again until they publish
        # a newer head, so a dead peer costs at most one timed-out round (DESIGN §3).
        self._absent: dict[str, float] = {}
        self.rounds_done = 0
        self.contributions = 0
        self.last_loss: float | None = None

    # ----- setup -----

    def _load_identity(self) -> Identity:
        if self.spec.identity:
            return Identity.load(self.spec.identity)
        return Identity.generate()

    def _net(self) -> tuple[DHT, P2PService, GroupAverager, StateServer]:
        """The network parts, which exist once `start()` has run."""
        if self.dht is None or self.service is None or self.averager is None or self.server is None:
            raise RuntimeError("SwarmPeer.start() has not run")
        return self.dht, self.service, self.averager, self.server

    def request_stop(self) -> None:
        self._stop.set()

    def visible_maddrs(self) -> list[str]:
        if self.dht is None:
            return []
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def start(self) -> None:
        """Join or found the swarm, agree on the manifest, build everything the loop needs."""
        key_path = Path(self._tmp.name) / "identity.key"
        key_path.write_bytes(self.identity.to_bytes())
        key_path.chmod(0o600)
        run_name = self.spec.run_name
        try:
            self.dht = DHT(
                start=True,
                identity_path=str(key_path),
                host_maddrs=[f"/ip4/{self.spec.host}/tcp/{self.spec.port}"],
                announce_maddrs=list(self.spec.announce) or None,
                initial_peers=list(self.spec.swarm),
                record_validators=records.record_validators(self.identity, run_name),
                startup_timeout=30,
            )
        except Exception as e:  # hivemind reports bad addresses and busy ports this way
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise BadInput(f"cannot start the peer's network node: {reason}") from None
        resumed = self._checkpoint_manifest()
        if self.founding is not None:
            run, swarm = self.founding
            # A restarted founder keeps its run: the manifest it signed is in its checkpoint.
            self.signed = resumed or Manifest.create(run_name, run, swarm, self.identity)
            records.publish_manifest(
                self.dht, self.identity, self.signed, expiration_s=HEAD_TTL_S * 10,
                timeout_s=DHT_TIMEOUT_S,
            )  # fmt: skip
        else:
            self.signed = records.fetch_manifest(self.dht, run_name, timeout_s=DHT_TIMEOUT_S)
        self.manifest = self.signed.manifest
        self.run = self.manifest.run
        self.swarm = self.manifest.swarm
        if self.swarm.protocol != "sync":
            raise ConfigError("this build runs protocol 'sync' only; async mode is not built yet")
        self._build_training()
        self.service = P2PService(self.dht)
        self.service.start()
        self.service.wait_until_ready(timeout_s=30)
        prefix = "dp_" + hashlib.sha256(run_name.encode()).hexdigest()[:16]
        self.averager = GroupAverager(self.service, prefix, on_group=_fault_injection_hook())
        self.averager.start()
        self.averager.wait_until_ready(timeout_s=30)
        self.server = StateServer(self.service, prefix, lambda: self._blob)
        self.server.start()
        self._resume()
        self._snapshot()
        self._publish_head()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        self._ready = True
        self.events.emit(
            "start", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=None, maddrs=self.visible_maddrs(), run=run_name,
            manifest=self.signed.digest, ppl=self.eval_ppl(),
        )  # fmt: skip

    def _build_training(self) -> None:
        run = self.run
        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        source = self.spec.data or run.data
        self.data: TokenDataset = build_dataset(
            source, run.tokenizer, run.seq_len, run.val_sequences, run.max_tokens, run.seed
        )
        self.device = resolve_device(self.spec.device)
        init = build_model(run.model, self.data.vocab_size, run.seed, max_seq_len=run.seq_len)
        self.model = build_model(run.model, self.data.vocab_size, run.seed, run.seq_len)
        self.model.to(self.device)
        self.trainer = InnerTrainer(
            self.model, run, self.device, micro_batch_size=self.spec.micro_batch_size or None
        )
        num_shards = run.num_shards or DEFAULT_SHARDS
        self.shards = iid_shards(len(self.data.train), num_shards, run.seed)
        # Each peer walks each shard in its own order, so two peers never train the same batches.
        salt = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "big")
        self.streams = [
            ShardStream(self.data.train, idx, run.batch_size, seed=salt * 1000 + s)
            for s, idx in enumerate(self.shards)
        ]
        self.schedule = Schedule.for_run(run, total_steps=max(run.warmup_steps + 1, 10_000))
        outer = build_outer_optimizer(
            run.outer_optimizer, lr=run.outer_lr, momentum=run.outer_momentum,
            **({"buffer_size": run.dn_buffer_size or 1, "c": run.dn_c}
               if run.outer_optimizer == "delayed-nesterov" else {}),
        )  # fmt: skip
        self.state = ReplicatedState(
            [p.detach() for p in init.parameters()], outer, num_shards, self.signed.digest
        )
        self._eval_model = init  # holds θ_global for held-out evaluation, on CPU

    # ----- state: snapshot, catch-up, checkpoints -----

    def _snapshot(self) -> None:
        """Cache the serialised state the state server hands out (immutable bytes)."""
        data = st_save(self.state.tensors(), metadata=self.state.metadata())
        self._blob = StateBlob(version=self.state.version, state_hash=self.state.hash(), data=data)

    def _load_blob(self, data: bytes) -> None:
        try:
            metadata = safetensors_metadata(data, len(data), "downloaded state")
            tensors = st_load(data)
        except Exception as e:
            raise ConfigError(f"downloaded state is not a valid safetensors blob ({e})") from e
        self.state.load(tensors, metadata)

    def _live_heads(self) -> dict[str, records.PeerHead]:
        """Peers seen within HEAD_TTL_S. Heads are remembered across reads, so one slow or
        partial DHT read never makes the others vanish (a peer that thinks it is alone applies
        its own δ and forks the state); a departing peer's head (updated = 0) removes it."""
        dht = self._net()[0]
        try:
            heads = records.read_heads(dht, self.spec.run_name, timeout_s=DHT_TIMEOUT_S)
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.peer_id[-6:], self.state.version, e)
            heads = {}
        for peer, head in heads.items():
            known = self._seen.get(peer)
            if known is None or head.updated == 0.0 or head.updated >= known.updated:
                self._seen[peer] = head
        now = time.time()
        return {
            p: h
            for p, h in self._seen.items()
            if now - h.updated < HEAD_TTL_S and h.updated > self._absent.get(p, 0.0)
        }

    def catch_up(self) -> bool:
        """Move to the swarm's head if live peers are ahead, or heal a fork at our version.

        The head is the highest version live peers advertise; among its state hashes the one
        most peers hold wins, ties broken by the larger hash (DESIGN §3 counts contributions;
        peers on the branch are our proxy for that). The downloaded state must hash to it.
        """
        heads = self._live_heads()
        mine = self.state.hash() if self._blob is None else self._blob.state_hash
        others = [h for h in heads.values() if h.peer_id != self.peer_id]
        top = max((h.version for h in others), default=-1)
        if top < self.state.version:
            return False
        votes: dict[str, int] = {}
        for h in others:
            if h.version == top:
                votes[h.state_hash] = votes.get(h.state_hash, 0) + 1
        if top == self.state.version:
            votes[mine] = votes.get(mine, 0) + 1
        want = max(votes, key=lambda x: (votes[x], x))
        if top == self.state.version and want == mine:
            return False
        donors = [h.peer_id for h in others if h.version == top and h.state_hash == want]
        random.Random(self.peer_id).shuffle(donors)
        _, service, _, server = self._net()
        for donor in donors:
            t0 = time.time()
            try:
                blob = download_state(service, server.run, donor, timeout_s=STATE_TIMEOUT_S)
                self._load_blob(blob.data)
            except (StateTransferFailed, ConfigError) as e:
                log.warning("[%s] state from %s rejected: %s", self.peer_id[-6:], donor[-6:], e)
                continue
            if self.state.hash() != want:
                log.warning("[%s] state from %s has another hash", self.peer_id[-6:], donor[-6:])
                continue
            self._snapshot()
            self.events.emit(
                "catch_up", version=self.state.version, state_hash=want, group_size=0,
                loss=self.last_loss, donor=donor, seconds=time.time() - t0, bytes=len(blob.data),
                fork=top == self.state.version,
            )  # fmt: skip
            self._publish_head()
            return True
        return False

    def _checkpoint_manifest(self) -> SignedManifest | None:
        """The manifest stored in this peer's checkpoint, if there is a readable one."""
        path = self._checkpoint_path()
        if path is None or not path.is_file():
            return None
        try:
            meta = read_file_metadata(path)
            return SignedManifest.from_bytes(
                meta["manifest_bytes"].encode(), expected_run=self.spec.run_name
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, DilocoError):
            return None  # _resume() reports an unusable checkpoint with a clear error

    def _checkpoint_path(self) -> Path | None:
        if not self.spec.checkpoint_dir:
            return None
        return Path(self.spec.checkpoint_dir) / f"{self.spec.run_name}.peer.safetensors"

    def save_checkpoint(self) -> None:
        """Global state, local AdamW state and data positions, atomically."""
        path = self._checkpoint_path()
        if path is None:
            return
        tensors = {f"global.{k}": v for k, v in self.state.tensors().items()}
        opt = self.trainer.optimizer.state_dict()
        opt_meta: dict[str, Any] = {"param_groups": opt["param_groups"], "state": {}}
        for pid, st in opt["state"].items():
            entry = {}
            for name, value in st.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"adam.{pid}.{name}"] = value.detach().to("cpu").contiguous()
                    entry[name] = "tensor"
                else:
                    entry[name] = value
            opt_meta["state"][str(pid)] = entry
        for i, p in enumerate(self.trainer.params):
            tensors[f"local.{i}"] = p.detach().to("cpu").contiguous()
        meta = {
            "format": CHECKPOINT_FORMAT,
            "manifest": self.signed.digest,
            "manifest_bytes": self.signed.to_bytes().decode(),
            "peer": self.peer_id,
            "rounds_done": str(self.rounds_done),
            "streams": json.dumps([s.state_dict() for s in self.streams]),
            "adam": json.dumps(opt_meta, default=float),
            **{f"state.{k}": v for k, v in self.state.metadata().items()},
        }
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(st_save(tensors, metadata=meta)))

    def _resume(self) -> None:
        path = self._checkpoint_path()
        if path is None:
            return
        if path.exists():
            self._load_checkpoint(path)
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            probe = path.parent / f".probe-{self.peer_id[-8:]}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise BadInput(
                f"checkpoint directory {path.parent} is not writable ({e.strerror})"
            ) from None

    def _load_checkpoint(self, path: Path) -> None:
        from diloco_peer.errors import CheckpointError

        try:
            data = path.read_bytes()
            meta = safetensors_metadata(data, len(data), str(path))
            tensors = st_load(data)
            if meta.get("format") != CHECKPOINT_FORMAT:
                raise CheckpointError(f"{path}: not a diloco-peer peer checkpoint")
            if meta.get("manifest") != self.signed.digest:
                raise CheckpointError(f"{path}: checkpoint belongs to another run manifest")
            state_meta = {
                k.removeprefix("state."): v for k, v in meta.items() if k.startswith("state.")
            }
            self.state.load(
                {
                    k.removeprefix("global."): v
                    for k, v in tensors.items()
                    if k.startswith("global.")
                },
                state_meta,
            )
            self.trainer.load_params(
                [tensors[f"local.{i}"] for i in range(len(self.trainer.params))]
            )
            opt_meta = json.loads(meta["adam"])
            opt_state: dict[int, dict[str, Any]] = {}
            for pid, entry in opt_meta["state"].items():
                opt_state[int(pid)] = {
                    name: tensors[f"adam.{pid}.{name}"] if value == "tensor" else value
                    for name, value in entry.items()
                }
            self.trainer.optimizer.load_state_dict(
                {"state": opt_state, "param_groups": opt_meta["param_groups"]}
            )
            for stream, st in zip(self.streams, json.loads(meta["streams"]), strict=True):
                stream.load_state_dict(st)
            self.rounds_done = int(meta["rounds_done"])
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{path}: unreadable or corrupted peer checkpoint ({e})"
            ) from None
        self.events.emit(
            "resume", version=self.state.version, state_hash=self.state.hash(), group_size=0,
            loss=None, rounds_done=self.rounds_done,
        )  # fmt: skip

    # ----- heads -----

    def _publish_head(self, in_group: bool = False, leaving: bool = False) -> None:
        if self.dht is None:
            return
        head = records.PeerHead(
            # A departing peer's head says "seen at time 0": readers drop it as stale at once,
            # instead of waiting HEAD_TTL_S for its record to expire.
            **({"updated": 0.0} if leaving else {}),
            peer_id=self.peer_id,
            version=self.state.version,
            state_hash=self.state.hash() if self._blob is None else self._blob.state_hash,
            speed=self.trainer.speed.steps_per_s or 0.0,
            samples_per_s=(self.trainer.speed.steps_per_s or 0.0) * self.run.batch_size,
            loss=self.last_loss,
            in_group=in_group,
        )
        try:
            records.publish_head(
                self.dht, self.identity, self.spec.run_name, head,
                expiration_s=HEAD_TTL_S, timeout_s=DHT_TIMEOUT_S,
            )  # fmt: skip
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.peer_id[-6:], self.state.version, e)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEAD_TTL_S / 4):
            try:
                self._publish_head()
            except DilocoError as e:  # never let the heartbeat kill the peer
                log.warning("heartbeat failed: %s", e)

    # ----- the round -----

    def eval_ppl(self) -> float:
        with torch.no_grad():
            for p, t in zip(self._eval_model.parameters(), self.state.theta, strict=True):
                p.copy_(t)
        return perplexity(evaluate_loss(self._eval_model, self.data.val))

    def _pick_shard(self) -> int:
        probs = shard_probabilities([len(s) for s in self.shards], self.state.shard_samples)
        rng = random.Random(f"{self.peer_id}/{self.state.version}/{self.rounds_done}")
        return rng.choices(range(len(probs)), weights=probs)[0]

    def _train(self) -> tuple[list[torch.Tensor], int, int, float]:
        shard = self._pick_shard()
        steps = self.run.inner_steps
        start_step = self.state.shard_samples[shard] // self.run.batch_size

        def on_step(i: int, loss: float) -> None:
            self.on_step(i, steps, loss)
            if self._stop.is_set():
                raise StopRequested

        phase = self.trainer.run_phase(
            self.state.theta, steps, lambda: [self.streams[shard].next_batch()],
            self.schedule, start_step, on_step=on_step,
        )  # fmt: skip
        return phase.delta, shard, phase.samples, phase.mean_loss

    def run_round(self) -> RoundReport | None:
        """One round; None when the contribution could not be applied this time."""
        averager = self._net()[2]
        self.catch_up()
        if self.finished():
            return None
        delta, shard, samples, loss = self._train()
        self.last_loss = loss
        if self._pending is not None:  # re-contribute what a failed group left behind
            delta = [d + p for d, p in zip(delta, self._pending, strict=True)]
        shard_samples = dict(self._pending_samples)
        shard_samples[shard] = shard_samples.get(shard, 0) + samples
        self.catch_up()  # peers may have moved on while we trained
        heads = self._live_heads()
        # Sync mode waits for every live peer, also those still behind: they catch up to this
        # version before they contribute, and a group closed without them would leave them
        # waiting out the sync timeout alone.
        target = max(2, len(set(heads) | {self.peer_id}))
        header = json.dumps(
            {"peer": self.peer_id, "base_version": self.state.version, "steps": self.run.inner_steps,
             "samples": samples, "shards": {str(k): v for k, v in shard_samples.items()}},
            sort_keys=True,
        ).encode()  # fmt: skip
        weight = float(samples) if self.swarm.weighting == "samples" else 1.0
        t0 = time.time()
        others = [p for p in heads if p != self.peer_id]
        if not others:  # alone in the swarm: Lookahead mode, no one to wait for
            return self._commit(delta, [self.peer_id], shard_samples, shard, loss, t0)
        self._publish_head(in_group=True)
        try:
            result = averager.average(
                f"v{self.state.version}", delta, weight=weight, gather=header,
                target_size=target, matchmaking_timeout_s=self.swarm.sync_timeout_s,
                allreduce_timeout_s=self.swarm.allreduce_timeout_s,
            )  # fmt: skip
        except NoGroup:
            # Not a reason to mark anyone absent: they may simply have been late. Only a group
            # that formed without a peer shows it is gone (a lone decision here would fork).
            return self._keep(delta, shard_samples, "no group formed")
        except AllReduceFailed as e:
            return self._keep(delta, shard_samples, f"all-reduce failed: {e}")
        self._mark_absent(heads, present=result.members)
        group_shards: dict[int, int] = {}
        for blob in result.gathered.values():
            try:
                for k, v in json.loads(blob)["shards"].items():
                    group_shards[int(k)] = group_shards.get(int(k), 0) + int(v)
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("ignoring a malformed contribution header")
        return self._commit(result.average, result.members, group_shards, shard, loss, t0)

    def _commit(
        self,
        average: list[torch.Tensor],
        members: list[str],
        group_shards: dict[int, int],
        shard: int,
        loss: float,
        t0: float,
    ) -> RoundReport:
        """Apply the group's average: version v -> v+1, identical on every member."""
        comm_s = time.time() - t0
        self.state.apply(average, len(members), group_shards)
        self._pending, self._pending_samples = None, {}
        self.rounds_done += 1
        self.contributions += 1
        self._snapshot()
        self._publish_head()
        numel = sum(t.numel() for t in average)
        k = len(members)
        report = RoundReport(
            version=self.state.version, state_hash=self._blob.state_hash if self._blob else "",
            group_size=k, loss=loss, ppl=self.eval_ppl(), comm_s=comm_s,
            payload_bytes=int(2 * 4 * numel * (k - 1) / k), members=members,
        )  # fmt: skip
        self.events.emit(
            "round", version=report.version, state_hash=report.state_hash,
            group_size=report.group_size, loss=report.loss, ppl=report.ppl, comm_s=report.comm_s,
            payload_bytes=report.payload_bytes, members=members, shard=shard,
        )  # fmt: skip
        every = self.swarm.checkpoint_every
        if every and self.rounds_done % every == 0:
            self.save_checkpoint()
        self.on_round(report)
        return report

    def _mark_absent(self, expected: dict[str, records.PeerHead], present: list[str]) -> None:
        now = time.time()
        for peer in expected:
            if peer not in present:
                self._absent[peer] = now

    def _keep(self, delta: list[torch.Tensor], shard_samples: dict[int, int], why: str) -> None:
        self._pending, self._pending_samples = delta, shard_samples
        self.events.emit(
            "round_failed", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=self.last_loss, reason=why,
        )  # fmt: skip
        log.warning(
            "[%s round=%d] %s; δ kept for the next group",
            self.peer_id[-6:],
            self.state.version,
            why,
        )
        return None

    def finished(self) -> bool:
        """--max-rounds reached, --until-version reached, or a stop was requested."""
        spec = self.spec
        return (
            self._stop.is_set()
            or bool(spec.max_rounds and self.rounds_done >= spec.max_rounds)
            or bool(spec.until_version and self.state.version >= spec.until_version)
        )

    def run_loop(self) -> None:
        try:
            while not self.finished():
                self.run_round()
        except StopRequested:
            pass

    def shutdown(self) -> None:
        """Save a checkpoint, leave the DHT, free everything. Safe to call more than once."""
        self._stop.set()
        try:
            if self._ready:
                self.save_checkpoint()
                try:
                    self._publish_head(leaving=True)
                except Exception as e:  # the DHT may already be gone (Ctrl+C reaches it too)
                    log.debug("could not announce leaving: %s", e)
                self.events.emit(
                    "stop", version=self.state.version, state_hash=self.state.hash(),
                    group_size=0, loss=self.last_loss, rounds_done=self.rounds_done,
                )  # fmt: skip
        finally:
            for part in (self.server, self.averager, self.service):
                if part is not None:
                    try:
                        part.shutdown()
                    except Exception as e:  # best effort: we are leaving anyway
                        log.debug("shutdown: %s", e)
            if self.dht is not None:
                self.dht.shutdown()
            self.events.close()
            self._tmp.cleanup()


def _fault_injection_hook() -> Any:
    """Test-only fault injection: DILOCO_PEER_KILL_IN_GROUP=N makes this process SIGKILL itself
    right after joining its N-th group, before any part is exchanged (mid all-reduce for the
    other members)."""
    target = os.environ.get("DILOCO_PEER_KILL_IN_GROUP")
    if not target:
        return None
    joined = 0

    def hook(key: str, members: list[str]) -> None:
        nonlocal joined
        joined += 1
        if joined == int(target):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def install_signal_handlers(peer: SwarmPeer) -> None:
    """Ctrl+C / SIGTERM stop at the next safe point (between inner steps).

    Processes forked later (hivemind's DHT) inherit these handlers; there the signal keeps its
    default meaning, or `DHT.shutdown()` could never terminate its child."""
    main_pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        peer.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
