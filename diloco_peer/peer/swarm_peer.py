"""One peer of a swarm: the round loop of DESIGN §3, one mechanism for sync and async.

catch up (replay the missed updates, or download the head's state; check its hash) -> plan
(shard by Eq. 2; H steps in sync mode, DyLU in async mode) -> train (inner AdamW, δ) ->
contribute (group keyed by the head version: sync waits for every live peer, async at most the
grace period) -> apply (outer step on CPU fp32, replicated) -> publish the new head.

A failed group keeps δ and adds it to the next contribution; a δ computed on an older version
is applied at the head (its staleness is logged) unless it is older than the staleness limit;
a lone peer applies its own δ (k = 1, Lookahead). A peer whose branch lost a fork downloads the
winner and re-contributes the δ it had applied on the losing branch.
"""

from __future__ import annotations

import contextlib
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
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diloco_peer.averaging.allreduce import AllReduceFailed
from diloco_peer.averaging.group_averager import GroupAverager
from diloco_peer.averaging.matchmaking import NoGroup
from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.robust import Aggregation
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import DEFAULT_SHARDS, PeerSpec, RunSpec, SwarmSettings
from diloco_peer.coordinator_free import reachability, records
from diloco_peer.coordinator_free.allowlist import Allowlist
from diloco_peer.coordinator_free.dylu import dylu_steps
from diloco_peer.coordinator_free.manifest import Manifest, SignedManifest
from diloco_peer.coordinator_free.reachability import DialBackServer
from diloco_peer.coordinator_free.sampler import fill_shards
from diloco_peer.coordinator_free.state_transfer import (
    StateBlob,
    StateServer,
    StateTransferFailed,
    download_state,
    download_state_multi,
    download_update,
)
from diloco_peer.coordinator_free.update_log import UpdateLog, UpdateRecord
from diloco_peer.errors import BadInput, ConfigError, DilocoError, P2PServiceStopped
from diloco_peer.identity import Identity
from diloco_peer.p2p.service import P2PService
from diloco_peer.peer.checkpoint import (
    atomic_write,
    read_file_metadata,
    safetensors_metadata,
    tensors_digest,
)
from diloco_peer.peer.data import ShardStream, TokenDataset, build_dataset, iid_shards
from diloco_peer.peer.events import EventLog
from diloco_peer.peer.inner import (
    InnerTrainer,
    Schedule,
    evaluate_loss,
    perplexity,
    prepare_replica,
)
from diloco_peer.peer.model import build_model, resolve_device
from diloco_peer.peer.trust import Chaos, Guard

log = logging.getLogger(__name__)

HEAD_TTL_S = 60.0
"""A head older than this is a peer that left; heartbeats refresh it every HEAD_TTL_S / 4."""
DHT_TIMEOUT_S = 10.0
STATE_TIMEOUT_S = 120.0
SETTLE_MAX_S = 60.0
ETA_REFRESH_S = 1.0
"""Async: how often (at most) a training peer re-checks its phase's end and the extension loop
re-reads the others' (`_refresh_eta`, `_extend_phase`)."""
ETA_DRIFT_S = 0.5
"""Async: a phase's end moved by more than this is published again."""
"""At the run's end, how long a peer waits at most for peers still in a phase (`_settle`)."""
REACHABILITY_TIMEOUT_S = 10.0
"""A joiner's dial-back probe (reachability.py): at most this long before it trains."""
CHECKPOINT_FORMAT = "diloco-peer/peer-checkpoint-v2"
"""v2 added the sha256 of everything in the file (v1 files are refused with a clear error)."""


class StopRequested(Exception):
    """Raised inside the inner loop when SIGINT/SIGTERM asked the peer to stop."""


class _PauseRequested(Exception):
    """Raised inside the inner loop when SIGUSR1 asked the peer to pause; carries the steps done."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.steps = steps


@dataclass
class RoundReport:
    """What one round did, for the progress line and the JSON log."""

    version: int
    state_hash: str
    group_size: int
    loss: float
    ppl: float | None
    comm_s: float
    bytes_sent: int
    bytes_received: int
    steps: int = 0
    staleness: int = 0
    members: list[str] = field(default_factory=list)


def _head_plan(plan: list[int], batch: int) -> dict[str, int]:
    """A phase's steps per shard as a head publishes them: samples per shard, the largest
    `records.MAX_PLAN_SHARDS` shards only."""
    top = sorted((n, s) for s, n in enumerate(plan) if n)[-records.MAX_PLAN_SHARDS :]
    return {str(s): n * batch for n, s in sorted(top, key=lambda x: x[1])}


@dataclass
class _Contribution:
    """This peer's δ waiting to be applied: trained on `base_version`, maybe several phases."""

    delta: list[torch.Tensor]
    base_version: int
    shard_samples: dict[int, int]
    steps: int

    def merge(self, other: _Contribution) -> _Contribution:
        samples = dict(self.shard_samples)
        for k, v in other.shard_samples.items():
            samples[k] = samples.get(k, 0) + v
        return _Contribution(
            [a + b for a, b in zip(self.delta, other.delta, strict=True)],
            min(self.base_version, other.base_version), samples, self.steps + other.steps,
        )  # fmt: skip


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
        self._paused = threading.Event()
        self._t_start = time.time()
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-peer-")
        self.chaos = Chaos.parse(spec.chaos) if spec.chaos else None
        self.identity = self._load_identity()
        self.peer_id = self.identity.peer_id_str
        self.events = EventLog(spec.log_json, self.peer_id)
        self.dht: DHT | None = None
        self.service: P2PService | None = None
        self.averager: GroupAverager | None = None
        self.server: StateServer | None = None
        self.dialback: DialBackServer | None = None
        self.client_mode = spec.client_mode
        """Dial out only: `--client-mode`, or set at start when no swarm peer could dial us."""
        self._blob: StateBlob | None = None
        self._pending: _Contribution | None = None
        # The δ this peer applied last, with the version it produced: if that version's branch
        # loses a fork, the δ is contributed again (DESIGN §3).
        self._last_own: tuple[int, _Contribution] | None = None
        self._last_step_t = 0.0
        self._waited_again = False
        self._eta: float | None = None
        self._eta_checked = 0.0  # perf_counter of the last _refresh_eta check
        # The other members of the group committed last: they plan their next phase with us.
        self._co_planners: list[str] = []
        self._phase_plan: dict[str, int] | None = None  # samples per shard, published with eta
        self._started_training = False
        self._t_first_train = 0.0
        self._ready = False  # set once start() succeeded: only then may shutdown() checkpoint
        self._seen: dict[str, records.PeerHead] = {}
        # Peers a group formed without, with the time: not waited for again until they publish
        # a newer head, so a dead peer costs at most one timed-out round (DESIGN §3).
        self._absent: dict[str, float] = {}
        self._allowed: Any = lambda peer: True  # a private swarm replaces it in start()
        self._departed_version = -1  # the highest version a peer announced as it left
        self.rounds_done = 0
        self.contributions = 0
        self.dropped = 0
        self.last_loss: float | None = None
        self.compute_s = 0.0
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_report: RoundReport | None = None
        self.metrics: Any = None
        self.tensorboard: Any = None

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

    def request_pause(self) -> None:
        """Leave the swarm's groups at the next safe point and wait for `request_resume()`."""
        self._paused.set()

    def request_resume(self) -> None:
        self._paused.clear()

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
        self.allowlist = self._load_allowlist()
        allowed = None if self.allowlist is None else self.allowlist.peer_ids
        # A joiner that was not told starts as a client (dial out only) and asks a swarm peer to
        # dial it (reachability.py); only then does it become a full DHT node, so that a
        # machine nobody can dial never enters the others' routing tables.
        probing = self.founding is None and not self.spec.client_mode and not self.spec.announce
        self.client_mode = self.spec.client_mode or probing
        self.dht = self._start_dht(key_path, allowed, self.spec.port)
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
        self._allowed = self._check_allowlist()
        self.run = self.manifest.run
        self.swarm = self.manifest.swarm
        self._build_training()
        self.updates = UpdateLog(self.swarm.keep_updates)
        self._prepare_record_dir()
        self.service = P2PService(self.dht)
        self.service.start()
        self.service.wait_until_ready(timeout_s=30)
        prefix = "dp_" + hashlib.sha256(run_name.encode()).hexdigest()[:16]
        if probing:
            self._check_reachability(prefix, key_path, allowed)
        self.guard = Guard(
            self.identity, run_name, self.swarm, allow=self._allowed, chaos=self.chaos
        )
        self.averager = GroupAverager(
            self.service, prefix, compression=self.run.compression,
            prune_fraction=self.run.prune_fraction,
            aggregation=Aggregation(method=self.swarm.aggregation, min_cosine=(
                None if self.swarm.min_cosine <= -1 else self.swarm.min_cosine)),
            on_group=_fault_injection_hook(), tamper=self.guard.tamper,
            client_mode=self.client_mode,
        )  # fmt: skip
        self.averager.start()
        self.averager.wait_until_ready(timeout_s=30)
        self.server = StateServer(
            self.service,
            prefix,
            lambda: self._blob,
            updates=self.updates.get,
            allow=self._allowed,
        )
        self.server.start()
        self.server.wait_until_ready(timeout_s=30)
        if not self.client_mode:  # joiners ask a peer like this one whether they can be dialed
            self.dialback = DialBackServer(self.service, prefix)
            self.dialback.start()
            self.dialback.wait_until_ready(timeout_s=30)
        self._resume()
        self._snapshot()
        self._publish_head()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        self._start_metrics()
        self._open_tensorboard()
        self._ready = True
        self.events.emit(
            "start", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=None, maddrs=self.visible_maddrs(), run=run_name,
            manifest=self.signed.digest, ppl=self.eval_ppl(),
        )  # fmt: skip

    def _start_dht(self, key_path: Path, allowed: frozenset[str] | None, port: int) -> DHT:
        """This peer's DHT node (and libp2p daemon), in client mode if `self.client_mode`."""
        try:
            return DHT(
                start=True,
                identity_path=str(key_path),
                host_maddrs=[f"/ip4/{self.spec.host}/tcp/{port}"],
                announce_maddrs=list(self.spec.announce) or None,
                initial_peers=list(self.spec.swarm),
                record_validators=records.record_validators(
                    self.identity, self.spec.run_name, allowed
                ),
                startup_timeout=30,
                client_mode=self.client_mode,
                # a restart after the reachability probe reuses the key of the node it replaces
                check_if_identity_free=self.dht is None,
            )
        except Exception as e:  # hivemind reports bad addresses and busy ports this way
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise BadInput(f"cannot start the peer's network node: {reason}") from None

    def _check_reachability(
        self, prefix: str, key_path: Path, allowed: frozenset[str] | None
    ) -> None:
        """Ask a swarm peer to dial this (client-mode) one on its port (reachability.py). If it
        did, or if no peer answered, start over as a full peer on the same port; if it could
        not, stay a client rather than stall every group that would count on reaching us."""
        port = 0
        for maddr in self.dht.get_visible_maddrs() if self.dht is not None else []:
            with contextlib.suppress(Exception):  # an address without a TCP port
                port = int(maddr.value_for_protocol("tcp"))
                break
        servers = list(
            dict.fromkeys(Multiaddr(a).value_for_protocol("p2p") for a in self.spec.swarm)
        )
        verdict = reachability.Verdict("unknown", "no port or no swarm peer to ask")
        if port and servers and self.service is not None:
            try:
                verdict = reachability.probe(
                    self.service, prefix, servers, port=port, timeout_s=REACHABILITY_TIMEOUT_S
                )
            except (TimeoutError, P2PServiceStopped) as e:
                verdict = reachability.Verdict("unknown", f"the probe failed: {e!r}")
        self.events.emit(
            "reachability", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=None, status=verdict.status, detail=verdict.detail, port=port,
        )  # fmt: skip
        if verdict.status == "private":
            log.warning(
                "[%s] no swarm peer can dial this machine (%s): taking part in client mode "
                "(dial out only; see `diloco-peer doctor`, or forward a port and pass --announce)",
                self.peer_id[-6:], verdict.detail,
            )  # fmt: skip
            return
        log.info("[%s] reachability: %s (%s)", self.peer_id[-6:], verdict.status, verdict.detail)
        if self.service is not None:
            self.service.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        self.client_mode = False
        self.dht = self._start_dht(key_path, allowed, port)
        self.service = P2PService(self.dht)
        self.service.start()
        self.service.wait_until_ready(timeout_s=30)

    def _load_allowlist(self) -> Allowlist | None:
        """`--allowlist`, checked for this run and this peer (its owner is checked against the
        manifest's once that is known)."""
        if not self.spec.allowlist:
            return None
        allowlist = Allowlist.load(self.spec.allowlist, run=self.spec.run_name)
        if not allowlist.allows(self.peer_id):
            raise BadInput(f"this peer's key ({self.peer_id}) is not on the allowlist")
        return allowlist

    def _check_allowlist(self) -> Any:
        """The allowlist's membership test (everyone is allowed without one)."""
        if self.allowlist is None:
            return lambda peer: True
        if self.allowlist.owner_peer_id != self.signed.owner_peer_id:
            raise BadInput(
                f"--allowlist is signed by {self.allowlist.owner_peer_id}, not by the run owner "
                f"{self.signed.owner_peer_id}"
            )
        return self.allowlist.allows

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
        micro = prepare_replica(
            self.model, run, self.device, self.data.vocab_size,
            micro_batch_size=self.spec.micro_batch_size,
            gpu_memory_fraction=self.spec.gpu_memory_fraction,
        )  # fmt: skip
        log.info("[%s] micro-batch %d of %d on %s", self.peer_id[-6:], micro, run.batch_size,
                 self.device)  # fmt: skip
        self.trainer = InnerTrainer(self.model, run, self.device, micro_batch_size=micro or None)
        num_shards = run.num_shards or DEFAULT_SHARDS
        if self.spec.shard >= num_shards:
            raise BadInput(f"--shard {self.spec.shard} is out of range: the run has {num_shards}")
        self.shards = iid_shards(len(self.data.train), num_shards, run.seed)
        # Each peer walks each shard in its own order, so two peers never train the same batches;
        # a pinned shard is walked in its canonical order, the simulator's.
        salt = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "big")
        self.streams = [
            ShardStream(
                self.data.train,
                idx,
                run.batch_size,
                seed=run.seed + s if self.spec.shard == s else salt * 1000 + s,
            )  # fmt: skip
            for s, idx in enumerate(self.shards)
        ]
        self.schedule = Schedule.for_run(run, total_steps=run.schedule_steps or 10_000)
        outer = build_outer_optimizer(
            run.outer_optimizer, lr=run.outer_lr, momentum=run.outer_momentum,
            **({"buffer_size": run.dn_buffer_size or self.swarm.expected_peers or 1, "c": run.dn_c}
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
            heads = records.read_heads(
                dht, self.spec.run_name, timeout_s=DHT_TIMEOUT_S, allow=self._allowed
            )
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.peer_id[-6:], self.state.version, e)
            heads = {}
        for peer, head in heads.items():
            if head.updated == 0.0 and peer != self.peer_id:  # a peer that left, at its version
                self._departed_version = max(self._departed_version, head.version)
            known = self._seen.get(peer)
            if known is None or head.updated == 0.0 or head.updated >= known.updated:
                self._seen[peer] = head
        now = time.time()
        if self.rounds_done < _TEST_ALONE_ROUNDS and self._started_training:
            # test hook: once it has trained, this peer does not see the others for its first
            # rounds (to make a fork); it still waits for --expected-peers before training
            return {p: h for p, h in self._seen.items() if p == self.peer_id}
        return {
            p: h
            for p, h in self._seen.items()
            if now - h.updated < HEAD_TTL_S and h.updated > self._absent.get(p, 0.0)
        }

    def catch_up(self) -> bool:
        """Move to the swarm's head if live peers are ahead, or heal a fork at our version.

        The head is the highest version live peers advertise; among its state hashes the one
        most peers hold wins, ties broken by the larger hash (DESIGN §3 counts contributions;
        peers on the branch are our proxy for that). A peer a few versions behind replays the
        missed updates from a donor's log when that costs less than the full state; otherwise
        (or if the replay fails) it downloads the full state. Either way the result must hash to
        the winning hash. A peer whose own branch lost contributes its last δ again.
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
        donors = [
            h.peer_id
            for h in others
            if h.version == top and h.state_hash == want and not h.client  # nobody dials those
        ]
        random.Random(f"{self.peer_id}/{top}").shuffle(donors)
        old_version = self.state.version
        t0 = time.time()
        lost_fork = top == old_version  # same version, another hash: our branch lost
        how, nbytes, donor_used = "", 0, ""
        missed = top - old_version
        model_bytes = 4 * sum(t.numel() for t in self.state.theta)
        full_bytes = len(self._blob.data) if self._blob is not None else 0
        if 0 < missed <= self.swarm.keep_updates and missed * model_bytes < full_bytes:
            for donor in donors[:2]:
                outcome = self._replay(donor, top, want)
                if isinstance(outcome, int):
                    how, nbytes, donor_used = "replay", outcome, donor
                    break
                if outcome == "fork":
                    lost_fork = True
                    break
        if not how:
            # From all donors at once in ranges first; from one donor at a time if that fails or
            # gives another hash (a hostile donor's ranges spoil a multi-donor download).
            sources = ([donors] if len(donors) > 1 else []) + [[donor] for donor in donors]
            for source in sources:
                donor = ",".join(source)  # the event's donor: one peer id, or several
                label = donor[-6:] if len(source) == 1 else f"{len(source)} donors"
                try:
                    if len(source) > 1:
                        blob = download_state_multi(
                            self._net()[1], self._net()[3].run, source, want,
                            timeout_s=STATE_TIMEOUT_S,
                        )  # fmt: skip
                    else:
                        blob = download_state(
                            self._net()[1], self._net()[3].run, donor, timeout_s=STATE_TIMEOUT_S
                        )
                    self._load_blob(blob.data)
                except (StateTransferFailed, ConfigError) as e:
                    log.warning("[%s] state from %s rejected: %s", self._tag(), label, e)
                    self._restore_blob()
                    continue
                if self.state.hash() != want:
                    log.warning("[%s] state from %s has another hash", self._tag(), label)
                    self._restore_blob()
                    continue
                how, nbytes, donor_used = "download", len(blob.data), donor
                if self.spec.record_updates:  # the replay of recorded updates restarts here
                    path = Path(self.spec.record_updates) / f"state-{top:08d}.safetensors"
                    atomic_write(path, lambda tmp, data=blob.data: Path(tmp).write_bytes(data))
                break
        if not how:
            return False
        self._snapshot()
        self.wait_s += time.time() - t0
        recontributed = self._recontribute_if_lost(lost_fork, old_version)
        self.events.emit(
            "catch_up", version=self.state.version, state_hash=want, group_size=0,
            loss=self.last_loss, donor=donor_used, seconds=time.time() - t0, bytes=nbytes,
            fork=lost_fork, method=how, from_version=old_version, recontributed=recontributed,
        )  # fmt: skip
        self._publish_head()
        return True

    def _replay(self, donor: str, top: int, want: str) -> int | str:
        """Replay updates old_version..top-1 from `donor`'s log; the downloaded byte count on
        success, "fork" if the donor's chain does not start from our state, "failed" otherwise.
        On failure the state is restored from the cached blob of our version."""
        _, service, _, server = self._net()
        shapes = [tuple(t.shape) for t in self.state.theta]
        nbytes = 0
        replayed: list[UpdateRecord] = []
        try:
            for base in range(self.state.version, top):
                data = download_update(service, server.run, donor, base, timeout_s=DHT_TIMEOUT_S)
                nbytes += len(data)
                record = UpdateRecord.from_bytes(data, shapes=shapes)
                if record.base_version != base:
                    raise ValueError(f"asked for version {base}, got {record.base_version}")
                if record.base_hash != self.state.hash():
                    if base == self._blob_version():
                        self._restore_blob()
                        return "fork"
                    raise ValueError(f"update {base} does not extend version {base}")
                self._apply_record(record)
                replayed.append(record)
            if self.state.hash() != want:
                raise ValueError("replayed state does not hash to the head's hash")
        except (StateTransferFailed, ValueError, ConfigError) as e:
            log.info("[%s] replay from %s failed: %s", self._tag(), donor[-6:], e)
            self._restore_blob()
            return "failed"
        for record in replayed:
            self._keep_record(record)
        return nbytes

    def _blob_version(self) -> int:
        return self._blob.version if self._blob is not None else self.state.version

    def _restore_blob(self) -> None:
        """Back to the state of the cached blob (our last published version)."""
        if self._blob is not None and self.state.hash() != self._blob.state_hash:
            self._load_blob(self._blob.data)

    def _recontribute_if_lost(self, lost_fork: bool, old_version: int) -> bool:
        """Our branch lost: the δ that produced our old version goes into the next group."""
        if not lost_fork or self._last_own is None or self._last_own[0] != old_version:
            return False
        own = self._last_own[1]
        self._last_own = None
        self._pending = own if self._pending is None else self._pending.merge(own)
        log.warning(
            "[%s] our branch at v%d lost a fork; our δ goes into the next group",
            self._tag(), old_version,
        )  # fmt: skip
        return True

    def _apply_record(self, record: UpdateRecord) -> None:
        """Apply one replayed update; it must give the hash its record names."""
        self.state.apply(list(record.average), record.count, record.shard_samples)
        if self.state.hash() != record.result_hash:
            raise ValueError(f"update {record.base_version} gives another state hash")

    def _keep_record(self, record: UpdateRecord) -> None:
        """Keep an applied update for others to replay (and on disk with --record-updates)."""
        self.updates.append(record)
        if self.spec.record_updates:
            path = Path(self.spec.record_updates) / f"update-{record.base_version:08d}.safetensors"
            data = self.updates.get(record.base_version) or record.to_bytes()
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

    def _prepare_record_dir(self) -> None:
        if not self.spec.record_updates:
            return
        folder = Path(self.spec.record_updates)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(
                f"--record-updates folder {folder} is not usable ({e.strerror})"
            ) from None
        if any(folder.glob("update-*.safetensors")):
            raise BadInput(f"--record-updates folder {folder} already holds updates; use a new one")

    def _tag(self) -> str:
        return f"{self.peer_id[-6:]} v{self.state.version}"

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
        if self._pending is not None:  # a δ not applied yet goes into the next group after resume
            pending = self._pending
            tensors.update({f"pending.{i}": d.contiguous() for i, d in enumerate(pending.delta)})
            meta["pending"] = json.dumps(
                {"base_version": pending.base_version, "steps": pending.steps,
                 "shards": {str(k): v for k, v in pending.shard_samples.items()}}
            )  # fmt: skip
        meta["sha256"] = _checkpoint_digest(tensors, meta)
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
            if meta.get("format") == "diloco-peer/peer-checkpoint-v1":
                raise CheckpointError(
                    f"{path}: a peer checkpoint of an older diloco-peer (no checksum); move it "
                    "away to start this peer afresh"
                )
            if meta.get("format") != CHECKPOINT_FORMAT:
                raise CheckpointError(f"{path}: not a diloco-peer peer checkpoint")
            if meta.get("sha256") != _checkpoint_digest(tensors, meta):
                raise CheckpointError(
                    f"{path}: corrupted peer checkpoint (its sha256 does not match; the file is "
                    "left as it is)"
                )
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
            if "pending" in meta:
                info = json.loads(meta["pending"])
                self._pending = _Contribution(
                    [tensors[f"pending.{i}"] for i in range(len(self.state.theta))],
                    int(info["base_version"]),
                    {int(k): int(v) for k, v in info["shards"].items()},
                    int(info["steps"]),
                )
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{path}: unreadable or corrupted peer checkpoint ({e})"
            ) from None
        self.events.emit(
            "resume", version=self.state.version, state_hash=self.state.hash(), group_size=0,
            loss=None, rounds_done=self.rounds_done,
            pending_steps=self._pending.steps if self._pending is not None else 0,
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
            eta=self._eta,
            plan=self._phase_plan if self._eta is not None else None,
            bans=self._bans_for_head(),
            client=self.client_mode,
            **self._resources(),
        )
        try:
            records.publish_head(
                self.dht, self.identity, self.spec.run_name, head,
                expiration_s=HEAD_TTL_S, timeout_s=DHT_TIMEOUT_S,
            )  # fmt: skip
        except records.SwarmTimeout as e:
            log.warning("[%s round=%d] %s", self.peer_id[-6:], self.state.version, e)

    def _bans_for_head(self) -> dict[str, str] | None:
        guard = getattr(self, "guard", None)
        if guard is None:
            return None
        active = guard.bans.active(self.state.version)
        recent = sorted(active.items(), key=lambda kv: kv[1].since_version)[-records.MAX_BANS :]
        return {p: b.reason[: records.MAX_BAN_REASON] for p, b in recent} or None

    def _open_tensorboard(self) -> None:
        if not self.spec.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BadInput(
                "--tensorboard needs the tensorboard package: pip install 'diloco-peer[tb]'"
            ) from None
        try:
            self.tensorboard = SummaryWriter(log_dir=self.spec.tensorboard, flush_secs=5)
        except OSError as e:
            raise BadInput(f"--tensorboard folder is not usable ({e})") from None

    def _write_tensorboard(self, report: RoundReport) -> None:
        if self.tensorboard is None:
            return
        active = time.time() - self._t_first_train if self._started_training else 0.0
        scalars = {
            "loss": report.loss, "ppl": report.ppl, "group_size": report.group_size,
            "comm_s": report.comm_s, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "staleness": report.staleness,
            "contributions": self.contributions, "dropped": self.dropped,
            "idle_fraction": self.wait_s / active if active > 0 else None,
        }  # fmt: skip
        for name, value in scalars.items():
            if value is not None:
                self.tensorboard.add_scalar(f"diloco/{name}", value, report.version)

    def _start_metrics(self) -> None:
        if self.spec.metrics_port < 0:
            return
        from diloco_peer.peer.metrics import MetricsServer

        self.metrics = MetricsServer(
            self.spec.metrics_host, self.spec.metrics_port, self._collect_metrics,
            {"peer": self.peer_id, "run": self.spec.run_name},
        )  # fmt: skip
        self.metrics.start()
        log.warning(
            "[%s] metrics on http://%s:%d/metrics", self._tag(), self.spec.metrics_host,
            self.metrics.port,
        )  # fmt: skip

    def _collect_metrics(self) -> list[Any]:
        from diloco_peer.peer.metrics import Metric

        last = self.last_report
        active = time.time() - self._t_first_train if self._started_training else 0.0
        return [
            Metric("diloco_peer_version", "gauge", "Version of the replicated state held.",
                   self.state.version),
            Metric("diloco_peer_rounds_total", "counter", "Rounds this peer applied.",
                   self.rounds_done),
            Metric("diloco_peer_contributions_total", "counter", "Contributions applied.",
                   self.contributions),
            Metric("diloco_peer_dropped_contributions_total", "counter",
                   "Contributions dropped as too stale.", self.dropped),
            Metric("diloco_peer_loss", "gauge", "Mean training loss of the last phase.",
                   self.last_loss),
            Metric("diloco_peer_ppl", "gauge", "Held-out perplexity at the last evaluation.",
                   last.ppl if last else None),
            Metric("diloco_peer_group_size", "gauge", "Members of the last group.",
                   last.group_size if last else None),
            Metric("diloco_peer_comm_seconds", "gauge", "Communication seconds, last round.",
                   last.comm_s if last else None),
            Metric("diloco_peer_bytes_sent_total", "counter", "All-reduce bytes sent.",
                   self.bytes_sent),
            Metric("diloco_peer_bytes_received_total", "counter", "All-reduce bytes received.",
                   self.bytes_received),
            Metric("diloco_peer_compute_seconds_total", "counter", "Seconds spent training.",
                   self.compute_s),
            Metric("diloco_peer_wait_seconds_total", "counter",
                   "Seconds spent waiting on other peers (groups, all-reduce, catch-up).",
                   self.wait_s),
            Metric("diloco_peer_idle_fraction", "gauge",
                   "wait_seconds_total / seconds since the first training step.",
                   self.wait_s / active if active > 0 else None),
            Metric("diloco_peer_inner_steps_per_second", "gauge", "Measured inner-step speed.",
                   self.trainer.speed.steps_per_s),
            Metric("diloco_peer_paused", "gauge", "1 while paused (SIGUSR1).",
                   1.0 if self._paused.is_set() else 0.0),
            Metric("diloco_peer_bans", "gauge", "Peers this peer currently bans.",
                   len(self.guard.bans.active(self.state.version))),
            Metric("diloco_peer_bans_total", "counter",
                   "Bans issued (contributions excluded) since start.", self.guard.bans.total),
        ]  # fmt: skip

    def _resources(self) -> dict[str, float | None]:
        """This process's memory and CPU use (and GPU memory), for `status`."""
        import psutil

        try:
            proc = self._proc if hasattr(self, "_proc") else psutil.Process()
            self._proc = proc
            rss, cpu = proc.memory_info().rss / 1e6, proc.cpu_percent(interval=None)
        except (psutil.Error, OSError):
            return {}
        gpu = None
        if self.device.type == "cuda":
            gpu = torch.cuda.memory_allocated(self.device) / 1e6
        return {"rss_mb": float(rss), "cpu_percent": float(cpu), "gpu_mem_mb": gpu}

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEAD_TTL_S / 4):
            if self._paused.is_set():
                continue  # a paused peer stays out of the others' live set
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

    def _shard_counts(self) -> list[int]:
        """Samples per shard the state holds plus those other peers' running phases will add
        (they publish their plan with their phase), so peers that plan at about the same time
        do not all fill the same under-trained shards."""
        counts = list(self.state.shard_samples)
        fresh = time.time() - HEAD_TTL_S
        oldest = self.state.version - self.swarm.staleness_limit
        for p, h in self._seen.items():  # as read by the round's last _live_heads()
            if p == self.peer_id or h.eta is None or not h.plan or h.updated <= fresh:
                continue
            if h.version < oldest:
                continue
            for shard, samples in h.plan.items():
                if int(shard) < len(counts):
                    counts[int(shard)] += samples
        return counts

    def _plan_shards(self, steps: int, others: int = 0) -> list[int]:
        """Steps per shard for a phase of `steps` steps: the pinned `--shard`, or each step to
        the shard furthest below its share (Eq. 2's terms, filled exactly: `fill_shards`), this
        phase taking its part of a fill shared with `others` steps planned at the same time."""
        if self.spec.shard >= 0:
            plan = [0] * len(self.shards)
            plan[self.spec.shard] = steps
            return plan
        rng = random.Random(f"{self.peer_id}/{self.state.version}/{self.rounds_done}")
        return fill_shards(
            [len(s) for s in self.shards], self._shard_counts(), steps, self.run.batch_size, rng,
            others=others,
        )  # fmt: skip

    def _plan_steps(self, heads: dict[str, records.PeerHead]) -> int:
        """H in sync mode; in async mode DyLU (Eq. 6) over the speeds live peers publish.

        A peer that has not measured its own speed yet runs a short probe phase (at most 3
        steps), so a slow device learns it is slow before it holds the others up."""
        if self.swarm.protocol == "sync":
            return self.run.inner_steps
        mine = self.trainer.speed.steps_per_s
        if mine is None:
            return self._probe_steps()
        return self._dylu(heads)[self.peer_id]

    def _probe_steps(self) -> int:
        return max(1, min(3, self.run.inner_steps // 4))

    def _dylu(self, heads: dict[str, records.PeerHead]) -> dict[str, int]:
        """DyLU steps (Eq. 6) of this peer and of every live peer that published a speed."""
        speeds = {p: x.speed for p, x in heads.items() if p != self.peer_id}
        speeds[self.peer_id] = self.trainer.speed.steps_per_s or 0.0
        speeds = {p: v for p, v in speeds.items() if v > 0}
        return dylu_steps(speeds, self.run.inner_steps) if speeds else {}

    def _unseen_steps(self, heads: dict[str, records.PeerHead]) -> int:
        """Steps other peers plan at the same moment as this one, before their plans can show
        in their heads: in sync mode every other live peer's H (a round starts together); in
        async mode those of the other members of the group this peer committed with last (they
        start their next phase from the same commit), unless their head already shows it."""
        if self.swarm.protocol == "sync":
            return self.run.inner_steps * sum(1 for p in heads if p != self.peer_id)
        dylu = self._dylu(heads)
        unseen = 0
        for p in self._co_planners:
            h = heads.get(p)
            if h is None or (h.eta is not None and h.plan and h.version >= self.state.version):
                continue  # gone, or its plan is already counted as in flight
            unseen += dylu.get(p, self._probe_steps())
        return unseen

    def _train(self, steps: int, others: int = 0) -> tuple[_Contribution, float]:
        """One local phase of `steps` steps from the state's θ, its steps spread over shards by
        `_plan_shards` (one segment per shard, each at its shard's own lr step, Eq. 3), with
        `others` steps planned by other peers at the same moment; async may extend it
        (`_extend_phase`). Returns the contribution and the mean loss."""
        plan = self._plan_shards(steps, others)
        base = self.state.version
        done = [0] * len(plan)  # steps trained per shard in this phase
        self._last_step_t = time.perf_counter()
        offset = 0  # steps of the phase before the current segment
        phase_t0 = time.perf_counter()

        def on_step(i: int, loss: float) -> None:
            if self._paused.is_set() and offset + i < steps:
                raise _PauseRequested(offset + i)
            if self.spec.throttle > 1.0:  # emulate a slower device: pad the step just taken
                self._stop.wait(
                    (self.spec.throttle - 1.0) * (time.perf_counter() - self._last_step_t)
                )
            self._last_step_t = time.perf_counter()
            self._refresh_eta(offset + i, steps, phase_t0)
            self.on_step(min(offset + i, steps), steps, loss)
            if self._stop.is_set():
                raise StopRequested

        if not self._started_training:
            self._t_first_train = time.time()
        speed = self.trainer.speed.steps_per_s
        if self.swarm.protocol == "async" and speed:
            # Tell the swarm when this phase should end (async groups wait only for peers
            # expected within the grace period) and which shards it trains.
            self._eta = get_dht_time() + steps / speed
            self._phase_plan = _head_plan(plan, self.run.batch_size)
            self._publish_head()
            self._eta_checked = time.perf_counter()
        t0 = time.perf_counter()
        loss_sum = 0.0
        self.trainer.load_params(self.state.theta)
        try:
            for shard, count in enumerate(plan):
                if count == 0:
                    continue
                loss, _ = self.trainer.train(
                    count, self._batches(shard, done), self.schedule,
                    self._shard_step(shard), on_step=on_step,
                )  # fmt: skip
                loss_sum += loss * count
                offset += count
        except _PauseRequested as p:
            # Keep what the phase did so far: it is contributed after the pause (stale, not lost).
            self.compute_s += time.perf_counter() - t0
            delta = self.trainer.delta_from(self.state.theta)
            partial = _Contribution(delta, base, self._samples(done), p.steps)
            self._pending = partial if self._pending is None else self._pending.merge(partial)
            self._eta = None
            raise
        extra = self._extend_phase(steps, done, on_step)
        if extra:
            loss_sum += extra[1] * extra[0]
            steps += extra[0]
        delta = self.trainer.delta_from(self.state.theta)
        self.compute_s += time.perf_counter() - t0
        # `_eta` (now past) and the plan stay in the head until the δ is applied or kept: a
        # head that catch-up publishes between the phase and the group search must not say
        # "not training", or a peer finishing at the same moment applies alone while this one
        # waits the grace period for it in vain (seen in the bench).
        self._started_training = True
        return _Contribution(delta, base, self._samples(done), steps), loss_sum / steps

    def _refresh_eta(self, done: int, planned: int, since: float) -> None:
        """Async: publish the phase's end again when the pace measured in this phase (steps
        `done` of `planned` since `since`) moved it by more than ETA_DRIFT_S: a peer sharing its
        device, or slowed by others, would otherwise be waited for at the wrong time."""
        now = time.perf_counter()
        if self._eta is None or done < 2 or done >= planned:
            return
        if now - self._eta_checked < ETA_REFRESH_S:
            return
        self._eta_checked = now
        eta = get_dht_time() + (planned - done) * (now - since) / done
        if abs(eta - self._eta) > ETA_DRIFT_S:
            self._eta = eta
            self._publish_head()

    def _batches(self, shard: int, done: list[int]) -> Any:
        """The batch source of one shard for `InnerTrainer.train`; counts the steps it serves."""

        def next_batches() -> list[torch.Tensor]:
            done[shard] += 1
            return [self.streams[shard].next_batch()]

        return next_batches

    def _shard_step(self, shard: int) -> int:
        """The shard's own lr step (Eq. 3): the steps the state holds on it."""
        return self.state.shard_samples[shard] // self.run.batch_size

    def _samples(self, done: list[int]) -> dict[int, int]:
        return {s: n * self.run.batch_size for s, n in enumerate(done) if n}

    def _extend_phase(
        self, planned: int, done: list[int], on_step: Any
    ) -> tuple[int, float] | None:
        """Async: rather than idle until peers expected within the grace period arrive, keep
        training (at most as many steps again as planned) until the latest of them should be
        done, each extra step on the shard furthest below its share. Returns (extra steps,
        their mean loss), or None."""
        speed = self.trainer.speed.steps_per_s
        if self.swarm.protocol != "async" or not speed:
            return None
        until = self._expected_until()
        if until is None:
            return None
        step_s, read = 1.0 / speed, time.perf_counter()
        counts = self._shard_counts()
        sizes = [len(s) for s in self.shards]
        rng = random.Random(f"{self.peer_id}/{self.state.version}/{self.rounds_done}/extend")
        extra, loss_sum = 0, 0.0
        while extra < planned and until is not None and get_dht_time() + step_s <= until:
            if self.spec.shard >= 0:
                shard = self.spec.shard
            else:
                mine = [c + d * self.run.batch_size for c, d in zip(counts, done, strict=True)]
                shard = fill_shards(sizes, mine, 1, self.run.batch_size, rng).index(1)
            step = self._shard_step(shard) + done[shard]
            loss, _ = self.trainer.train(
                1, self._batches(shard, done), self.schedule, step,
                on_step=lambda i, value: on_step(planned, value),
            )  # fmt: skip
            loss_sum += loss
            extra += 1
            if time.perf_counter() - read >= ETA_REFRESH_S:  # they may have arrived or slipped
                until, read = self._expected_until(), time.perf_counter()
        return (extra, loss_sum / extra) if extra else None

    def _expected_until(self) -> float | None:
        """Async: the latest end of the other peers' phases that end within the grace period
        (DHT time), or None if there are none."""
        now = get_dht_time()
        etas = [
            h.eta
            for p, h in self._live_heads().items()
            if p != self.peer_id and h.eta is not None and now < h.eta <= now + self.swarm.grace_s
        ]
        return max(etas) if etas else None

    def wait_for_expected_peers(self) -> None:
        """Before the first round: wait until `expected_peers` are live (bounded), so that a
        swarm started together trains together instead of the first peer running alone."""
        want = self.swarm.expected_peers
        if want <= 1 or self._started_training:
            return
        deadline = time.time() + self.swarm.start_timeout_s
        shown = -1
        while not self._stop.is_set():
            live = len(set(self._live_heads()) | {self.peer_id})
            if live >= want:
                return
            if live != shown:
                log.info("[%s] %d of %d expected peers are live; waiting", self._tag(), live, want)
                shown = live
            if time.time() > deadline:
                log.warning(
                    "[%s] only %d of %d expected peers after %.0f s; training anyway",
                    self._tag(), live, want, self.swarm.start_timeout_s,
                )  # fmt: skip
                return
            self._stop.wait(1.0)

    def run_round(self) -> RoundReport | None:
        """One round; None when the contribution could not be applied this time."""
        self.catch_up()
        if self.finished():
            return None
        heads = self._live_heads()
        mine, loss = self._train(self._plan_steps(heads), self._unseen_steps(heads))
        self.last_loss = loss
        if self._pending is not None:  # re-contribute what a failed or losing group left
            mine, self._pending = self._pending.merge(mine), None
        t0 = time.time()
        self.catch_up()  # peers may have moved on while we trained
        if self.finished():  # the swarm reached the run's end while we trained
            log.info("[%s] the run reached its end; last δ not contributed", self._tag())
            self._eta = None
            return None
        self._waited_again = False
        for _ in range(2 + self.swarm.staleness_limit):
            outcome = self._contribute(mine, loss, t0)
            if outcome != "retry":
                return outcome
        return self._keep(mine, "the swarm kept moving while we looked for a group", t0)

    def _contribute(self, mine: _Contribution, loss: float, t0: float) -> RoundReport | None | str:
        """Find a group at our version and apply its average; "retry" if the head moved on
        while we waited (async), so the caller tries again at the new head."""
        averager = self._net()[2]
        staleness = self.state.version - mine.base_version
        if staleness > self.swarm.staleness_limit:
            self.dropped += 1
            self._eta = None
            self.events.emit(
                "dropped", version=self.state.version, state_hash=self.state.hash(),
                group_size=0, loss=loss, staleness=staleness, steps=mine.steps,
                limit=self.swarm.staleness_limit, dropped_total=self.dropped,
            )  # fmt: skip
            log.warning("[%s] δ of staleness %d dropped", self._tag(), staleness)
            return None
        heads = self._live_heads()
        others = [p for p in heads if p != self.peer_id]
        if not others:  # alone in the swarm: Lookahead mode, no one to wait for
            return self._commit(mine, [self.peer_id], None, loss, t0)
        asynchronous = self.swarm.protocol == "async"
        # Sync mode waits for every live peer, also those still behind: they catch up to this
        # version before they contribute. Async mode waits only for the peers already looking
        # for a group at our state and those whose phase ends within the grace period; with
        # nobody to wait for, it applies its δ at once.
        if asynchronous:
            others = self._expected_soon(heads)
            if not others:
                return self._commit(mine, [self.peer_id], None, loss, t0)
        target = min(self.swarm.group_size, len(others) + 1)
        # Keyed by version and state: peers on two branches of a fork never average together
        # (each would apply the average to another base).
        key = f"v{self.state.version}_{self._blob_hash()[:16]}"
        offer = self.guard.offer(
            mine.delta, key=key, version=self.state.version, state_hash=self._blob_hash(),
            base_version=mine.base_version, steps=mine.steps, shard_samples=mine.shard_samples,
        )  # fmt: skip
        weight = (
            float(sum(mine.shard_samples.values())) if self.swarm.weighting == "samples" else 1.0
        )
        self._publish_head(in_group=True)
        waited = time.time()
        try:
            result = averager.average(
                key, offer.delta, weight=weight, gather=offer.gather,
                target_size=max(2, target),
                matchmaking_timeout_s=self.swarm.grace_s if asynchronous else self.swarm.sync_timeout_s,
                allreduce_timeout_s=self.swarm.allreduce_timeout_s,
                admit=self.guard.admit(offer.round),
            )  # fmt: skip
        except NoGroup:
            self._log_exclusions(loss)
            self.wait_s += time.time() - waited
            if not asynchronous:
                # Not a reason to mark anyone absent: they may simply have been late. Only a
                # group that formed without a peer shows it is gone (a lone decision would fork).
                return self._keep(mine, "no group formed", t0)
            # Async: nobody came within the grace period. If the swarm moved on meanwhile, go
            # to its head and try there. If a peer at our state says it is looking for a group
            # too, matchmaking missed it: look once more instead of forking the state. Otherwise
            # apply our δ alone (a group of one).
            if self.catch_up():
                return "retry"
            if not self._waited_again and self._someone_grouping():
                self._waited_again = True
                return "retry"
            return self._commit(mine, [self.peer_id], None, loss, t0)
        except AllReduceFailed as e:
            self._log_exclusions(loss)
            self.wait_s += time.time() - waited
            return self._keep(mine, f"all-reduce failed: {e}", t0)
        self.wait_s += time.time() - waited
        if not asynchronous:
            self._mark_absent(heads, present=result.members)
        self.guard.settle(result, self.state.version)
        self._log_exclusions(loss)
        group_shards = self.guard.group_shards(result)
        stalenesses = self.guard.staleness(result, self.state.version)
        return self._commit(mine, result.contributors, result, loss, t0, group_shards, stalenesses)

    def _log_exclusions(self, loss: float) -> None:
        for peer, reason in self.guard.drain_exclusions():
            self.events.emit(
                "excluded", version=self.state.version, state_hash=self._blob_hash(),
                group_size=0, loss=loss, excluded_peer=peer, reason=reason,
            )  # fmt: skip

    def _expected_soon(self, heads: dict[str, records.PeerHead]) -> list[str]:
        """Async: the peers worth waiting for: in a group search at our state, or training a
        phase that ends within the grace period, or new (no speed measured yet)."""
        mine, soon = self._blob_hash(), get_dht_time() + self.swarm.grace_s
        out = []
        for p, h in heads.items():
            if p == self.peer_id or h.version > self.state.version:
                continue
            grouping = h.in_group and h.version == self.state.version and h.state_hash == mine
            finishing = h.eta is not None and h.eta <= soon
            if grouping or finishing or (h.speed == 0 and not h.in_group):
                out.append(p)
        return out

    def _someone_grouping(self) -> bool:
        """Another live peer at our version and state has announced it is in a group search."""
        mine = self._blob_hash()
        return any(
            h.in_group and h.version == self.state.version and h.state_hash == mine
            for p, h in self._live_heads().items()
            if p != self.peer_id
        )

    def _commit(
        self,
        mine: _Contribution,
        members: list[str],
        result: Any,
        loss: float,
        t0: float,
        group_shards: dict[int, int] | None = None,
        stalenesses: dict[str, int] | None = None,
    ) -> RoundReport:
        """Apply the group's average (ours alone when `result` is None): v -> v+1, identical on
        every member."""
        comm_s = time.time() - t0
        base_version, base_hash = self.state.version, self._blob_hash()
        average = mine.delta if result is None else result.average
        shards = mine.shard_samples if group_shards is None else group_shards
        staleness = base_version - mine.base_version
        self.state.apply(average, len(members), shards)
        record = UpdateRecord(
            base_version=base_version, base_hash=base_hash, result_hash=self.state.hash(),
            count=len(members), shard_samples=dict(shards),
            average=tuple(a.to("cpu", torch.float32).contiguous() for a in average),
            info={"members": ",".join(members)},
        )  # fmt: skip
        self._keep_record(record)
        self._last_own = (self.state.version, mine)
        self.rounds_done += 1
        self._eta = None  # the phase's samples are in the state now, no longer in flight
        self._co_planners = [p for p in members if p != self.peer_id]
        self.contributions += 1
        self._snapshot()
        self._publish_head()
        every = self.swarm.eval_every
        ppl = self.eval_ppl() if every and self.state.version % every == 0 else None
        report = RoundReport(
            version=self.state.version, state_hash=record.result_hash, group_size=len(members),
            loss=loss, ppl=ppl, comm_s=comm_s,
            bytes_sent=getattr(result, "bytes_sent", 0), bytes_received=getattr(result, "bytes_received", 0),
            steps=mine.steps, staleness=staleness, members=members,
        )  # fmt: skip
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.last_report = report
        self._write_tensorboard(report)
        self.events.emit(
            "round", version=report.version, state_hash=report.state_hash,
            group_size=report.group_size, loss=report.loss, ppl=report.ppl, comm_s=report.comm_s,
            bytes_sent=report.bytes_sent, bytes_received=report.bytes_received, members=members,
            shards={str(k): v for k, v in mine.shard_samples.items()}, steps=mine.steps,
            staleness=staleness, group_staleness=stalenesses or {self.peer_id[-8:]: staleness},
            compute_s=self.compute_s, wait_s=self.wait_s, dropped=self.dropped,
            speed=self.trainer.speed.steps_per_s,
        )  # fmt: skip
        every = self.swarm.checkpoint_every
        if every and self.rounds_done % every == 0:
            self.save_checkpoint()
        self.on_round(report)
        return report

    def _blob_hash(self) -> str:
        return self.state.hash() if self._blob is None else self._blob.state_hash

    def _mark_absent(self, expected: dict[str, records.PeerHead], present: list[str]) -> None:
        now = time.time()
        for peer in expected:
            if peer not in present:
                self._absent[peer] = now

    def _keep(self, mine: _Contribution, why: str, t0: float) -> None:
        self._pending = mine
        self._eta = None
        self.events.emit(
            "round_failed", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=self.last_loss, reason=why, seconds=time.time() - t0,
        )  # fmt: skip
        log.warning("[%s] %s; δ kept for the next group", self._tag(), why)
        return None

    def finished(self) -> bool:
        """--max-rounds, --until-version or --until-steps reached, or a stop was requested."""
        spec = self.spec
        return (
            self._stop.is_set()
            or bool(spec.max_rounds and self.rounds_done >= spec.max_rounds)
            or bool(spec.until_version and self.state.version >= spec.until_version)
            # the others reached the run's end and left while this peer trained: applying its
            # δ alone now would only make a state nobody else holds
            or bool(spec.until_version and self._departed_version >= spec.until_version)
            or bool(spec.until_steps and self.applied_steps() >= spec.until_steps)
            or bool(spec.max_hours and time.time() - self._t_start >= spec.max_hours * 3600)
        )

    def applied_steps(self) -> int:
        """Local steps the swarm state holds, all peers together (from the shard counters)."""
        return sum(self.state.shard_samples) // self.run.batch_size

    def run_loop(self) -> None:
        try:
            self.wait_for_expected_peers()
            while not self.finished():
                if self._paused.is_set():
                    self._pause()
                    continue
                try:
                    self.run_round()
                except _PauseRequested:
                    continue
            self._settle()
        except StopRequested:
            pass

    def _settle(self) -> None:
        """At the run's end (--until-version/--until-steps), stay live for a moment and heal a
        fork of the last versions, so peers that stop together stop on one state."""
        spec = self.spec
        swarm_end = (spec.until_version and self.state.version >= spec.until_version) or (
            spec.until_steps and self.applied_steps() >= spec.until_steps
        )
        if self._stop.is_set() or not swarm_end:
            return
        if self._eta is not None:  # a last phase that will not be contributed: not working
            self._eta = None
            self._publish_head()
        asynchronous = self.swarm.protocol == "async"
        start = time.time()
        deadline = start + max(3.0, 2 * self.swarm.grace_s if asynchronous else 0)
        while not self._stop.is_set():
            self.catch_up()
            now = time.time()
            # Async: a peer still in a phase (or a group) at our version or below will commit
            # a version of its own; leaving before it does would leave it on another branch
            # (seen: two pairs ended on two different last versions). Stay until it is done.
            if asynchronous and self._still_working():
                deadline = max(deadline, min(start + SETTLE_MAX_S, now + self.swarm.grace_s))
            if now >= deadline:
                return
            self._stop.wait(0.5)

    def _still_working(self) -> bool:
        """Another live peer at our version or below is training a phase or in a group."""
        return any(
            p != self.peer_id
            and h.version <= self.state.version
            and (h.in_group or h.eta is not None)  # a peer's commit republishes eta None
            for p, h in self._live_heads().items()
        )

    def _pause(self) -> None:
        """Leave (others drop our head at once, so nobody waits for us), wait, come back."""
        self._publish_head(leaving=True)
        self.events.emit(
            "pause", version=self.state.version, state_hash=self._blob_hash(), group_size=0,
            loss=self.last_loss,
            pending_steps=self._pending.steps if self._pending is not None else 0,
        )  # fmt: skip
        log.warning("[%s] paused (SIGUSR2 resumes)", self._tag())
        t0 = time.time()
        while self._paused.is_set() and not self.finished():
            self._stop.wait(0.5)
        self._publish_head()
        self.events.emit(
            "unpause", version=self.state.version, state_hash=self._blob_hash(), group_size=0,
            loss=self.last_loss, paused_s=time.time() - t0,
        )  # fmt: skip

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
                    ppl=self.eval_ppl(), compute_s=self.compute_s, wait_s=self.wait_s,
                    dropped=self.dropped, shard_samples=self.state.shard_samples,
                    applied_steps=self.applied_steps(),
                    finite=all(bool(torch.isfinite(t).all()) for t in self.state.theta),
                    bans=self._bans_for_head() or {}, bans_total=self.guard.bans.total,
                    data_share=[len(x) / len(self.data.train) for x in self.shards],
                    active_s=time.time() - self._t_first_train if self._started_training else 0.0,
                )  # fmt: skip
        finally:
            if self.metrics is not None:
                self.metrics.shutdown()
            if self.tensorboard is not None:
                self.tensorboard.close()
            for part in (self.dialback, self.server, self.averager, self.service):
                if part is not None:
                    try:
                        part.shutdown()
                    except Exception as e:  # best effort: we are leaving anyway
                        log.debug("shutdown: %s", e)
            if self.dht is not None:
                self.dht.shutdown()
            self.events.close()
            self._tmp.cleanup()


_TEST_ALONE_ROUNDS = int(os.environ.get("DILOCO_PEER_ALONE_ROUNDS", "0") or 0)
"""Test-only: a peer ignores the others' heads for its first N rounds, so two such peers apply
their own δ alone at the same version and fork the state (the fork-healing test)."""


def _checkpoint_digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over every tensor (names, dtypes, shapes, bytes) and every metadata entry but
    itself: a flipped byte anywhere in a peer checkpoint is detected on load."""
    h = hashlib.sha256(tensors_digest(tensors).encode())
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(rest, sort_keys=True).encode())
    return h.hexdigest()


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
    """Ctrl+C / SIGTERM stop at the next safe point (between inner steps); SIGUSR1 pauses the
    peer (it leaves the groups, keeping its partial δ), SIGUSR2 resumes it.

    Processes forked later (hivemind's DHT) inherit these handlers; there the signal keeps its
    default meaning, or `DHT.shutdown()` could never terminate its child."""
    main_pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        peer.request_stop()

    def pause_handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGUSR1:
            peer.request_pause()
        else:
            peer.request_resume()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGUSR1, pause_handler)
    signal.signal(signal.SIGUSR2, pause_handler)
