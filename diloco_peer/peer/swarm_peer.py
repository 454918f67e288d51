"""One peer of a swarm: the round loop of DESIGN §3, one mechanism for sync and async.

catch up (replay the missed updates, or download the head's state; check its hash) -> plan
(shard by Eq. 2; H steps in sync mode, DyLU in async mode) -> train (inner AdamW, δ) ->
contribute (group keyed by the head version: sync waits for every live peer, async at most the
grace period) -> apply (outer step on CPU fp32, replicated) -> publish the new head.

`SwarmPeer` wires the parts and runs the loop; each part has one job in its own module:

    network.py          DHT node, P2P service, manifest agreement, averager and servers
    replica.py          the replicated state, its published snapshot, the update log
    heads.py            this peer's head on the DHT, the others' heads (the HeadBook)
    catch_up.py         replay or download to the head `SwarmView.choose_head` picks
    certify.py          seal what we commit, verify the certificate of what we replay
    phase.py            planning and inner training (δ)
    round.py            contribute, commit or keep (a typed outcome), the δ ledger
    run_end.py          the swarm's end: sync what fragments left unsynced, heal a last fork
    peer_checkpoint.py  save and resume
    telemetry.py        counters, round report, metrics, TensorBoard

The swarm's rules (liveness, the fork vote, whom to wait for, the run's end) are pure functions
in coordinator_free/swarm_view.py. Faults for tests arrive as a `FaultPlan`.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diloco_peer.averaging.contribution import Limits
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free import records
from diloco_peer.coordinator_free.reachability import Verdict
from diloco_peer.coordinator_free.rejoin import Rejoiner
from diloco_peer.coordinator_free.swarm_view import HeadChoice, run_ended
from diloco_peer.coordinator_free.update_log import UpdateLog
from diloco_peer.identity import Identity
from diloco_peer.lifeline import Lifeline
from diloco_peer.peer import peer_checkpoint
from diloco_peer.peer.catch_up import Accept, CatchUp
from diloco_peer.peer.certify import Certifier
from diloco_peer.peer.dashboard import DashboardServer, serve_dashboard
from diloco_peer.peer.delta import Contribution, Ledger
from diloco_peer.peer.events import EventLog
from diloco_peer.peer.faults import FaultPlan
from diloco_peer.peer.heads import Activity, Facts, HeadChannel, Heartbeat
from diloco_peer.peer.metrics import MetricsServer
from diloco_peer.peer.network import (
    Network,
    Node,
    agree_on_manifest,
    allowed_by,
    become_reachable,
    initial_peer_ids,
    load_allowlist,
    open_node,
    run_prefix,
    start_lifeline,
)
from diloco_peer.peer.overlap import Overlap
from diloco_peer.peer.phase import Controls, Phase, PhasePaused, StopRequested, build_training
from diloco_peer.peer.replica import Replica, prepare_record_dir
from diloco_peer.peer.round import Round, RoundOutcome
from diloco_peer.peer.run_end import RunEnd
from diloco_peer.peer.telemetry import (
    Counters,
    Gauges,
    RoundReport,
    TensorBoard,
    resources,
    serve_metrics,
)
from diloco_peer.peer.trust import Guard
from diloco_peer.peer_spec import PeerSpec

log = logging.getLogger(__name__)


class SwarmPeer:
    """One peer: `start()`, `run_loop()`, `shutdown()` (see the module docstring)."""

    def __init__(
        self,
        spec: PeerSpec,
        founding: tuple[RunSpec, SwarmSettings] | None = None,
        faults: FaultPlan | None = None,
        on_step: Callable[[int, int, float], None] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
    ) -> None:
        self.spec, self.founding, self.faults = spec, founding, faults or FaultPlan()
        self.on_step = on_step or (lambda done, total, loss: None)
        self.on_round = on_round or (lambda report: None)
        self._stop, self._paused = threading.Event(), threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-peer-")
        self.identity = Identity.load(spec.identity) if spec.identity else Identity.generate()
        self.peer_id = self.identity.peer_id_str
        self.events = EventLog(spec.log_json, self.peer_id)
        self.counters, self.activity = Counters(), Activity()
        self.node: Node | None = None
        self.net: Network | None = None
        self.heartbeat: Heartbeat | None = None
        self.rejoiner: Rejoiner | None = None
        self.metrics: MetricsServer | None = None
        self.dashboard: DashboardServer | None = None
        self.lifeline: Lifeline | None = None
        self.tensorboard = TensorBoard(None)
        self._ready = False  # set once start() succeeded: only then may shutdown() checkpoint
        self._checkpoint_due = False  # overlapped rounds: saved at the next phase's end

    # ----- control (any thread)

    def request_stop(self) -> None:
        self._stop.set()

    def request_pause(self) -> None:
        """Leave the swarm's groups at the next safe point and wait for `request_resume()`."""
        self._paused.set()

    def request_resume(self) -> None:
        self._paused.clear()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.node.dht.get_visible_maddrs()] if self.node else []

    @property
    def state(self) -> ReplicatedState:
        return self.replica.state

    @property
    def rounds_done(self) -> int:
        return self.counters.rounds_done

    # ----- start

    def start(self) -> None:
        """Join or found the swarm, agree on the manifest, build everything the loop needs."""
        ckpt = peer_checkpoint.checkpoint_path(self.spec.checkpoint_dir, self.spec.run_name)
        if ckpt is not None and not ckpt.exists():  # bad input fails before the network starts
            peer_checkpoint.check_writable(ckpt, self.peer_id)
        checked = not self.faults.unchecked_key  # a test's stand-in for a check that missed
        self.lifeline, key_path = start_lifeline(self.identity, Path(self._tmp.name), checked)
        allowlist = load_allowlist(self.spec.allowlist, self.spec.run_name, self.peer_id)
        allowed = None if allowlist is None else allowlist.peer_ids
        validators = records.record_validators(self.identity, self.spec.run_name, allowed)
        # A joiner that was not told starts as a client (dial out only) and asks a swarm peer to
        # dial it (reachability.py); only then does it become a full DHT node, so that a
        # machine nobody can dial never enters the others' routing tables.
        probing = self.founding is None and not self.spec.client_mode and not self.spec.announce
        self.node = open_node(self.spec, key_path, validators, port=self.spec.port,
                              client_mode=self.spec.client_mode or probing,
                              identity_checked=checked, lifeline=self.lifeline)  # fmt: skip
        stored = peer_checkpoint.stored_manifest(ckpt, self.spec.run_name)
        signer = allowlist.owner_peer_id if allowlist else None
        self.signed = agree_on_manifest(self.node.dht, self.identity, self.spec.run_name,
                                        self.founding, stored, owner=self.spec.owner,
                                        allowlist_owner=signer, swarm=self.spec.swarm)  # fmt: skip
        self.run, self.swarm = self.signed.manifest.run, self.signed.manifest.swarm
        self._allowed = allowed_by(allowlist, self.signed.owner_peer_id)
        self._build()
        prefix = run_prefix(self.spec.run_name)
        if probing:
            self._probe(prefix, key_path, validators)
        self.net = Network.serve(
            self.node, prefix, run=self.run, swarm=self.swarm, guard=self.guard,
            faults=self.faults, blob=lambda: self.replica.blob,
            parent=lambda: self.replica.parent, updates=self.replica.updates.get,
            allow=self._allowed, version=lambda: self.replica.version,
        )  # fmt: skip
        self.catching_up = CatchUp(self.replica, self.net.downloads(self.replica), me=self.peer_id,
                                   keep_updates=self.swarm.keep_updates,
                                   verify=self.certifier.verify, with_step=self.swarm.mixes)  # fmt: skip
        self._resume(ckpt)
        self.replica.snapshot()
        self.heads.publish()
        self.heartbeat = Heartbeat(self.heads.publish, self._paused, wake=self.heads.wake)
        self.heartbeat.start()
        self.rejoiner = self.heads.rejoiner(initial_peer_ids(self.spec.swarm), self.events,
                                            self._paused)  # fmt: skip
        self.rejoiner.start()  # the DHT is whole again after a network partition (rejoin.py)
        self._start_metrics()
        self._ready = True
        self.events.emit(
            "start", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=None, maddrs=self.visible_maddrs(), run=self.spec.run_name,
            manifest=self.signed.digest, ppl=self.training.eval_ppl(),
        )  # fmt: skip

    def _build(self) -> None:
        """Training, replica and the parts of the round."""
        spec, run, swarm = self.spec, self.run, self.swarm
        self.training = build_training(run, swarm, spec, self.peer_id, self.signed.digest)
        trainer = self.training.trainer
        log.info("[%s] micro-batch %s of %d on %s", self.peer_id[-6:], trainer.micro_batch_size,
                 run.batch_size, self.training.device)  # fmt: skip
        prepare_record_dir(spec.record_updates)
        self.replica = Replica(self.training.state, UpdateLog(swarm.keep_updates),
                               spec.record_updates)  # fmt: skip
        self.guard = Guard(self.identity, spec.run_name, swarm, allow=self._allowed,
                           chaos=self.faults.chaos, limits=Limits.of(run, swarm))  # fmt: skip
        self.tensorboard, self.ledger = TensorBoard(spec.tensorboard), Ledger(swarm.fragments > 1)
        self.certifier = Certifier(lambda: self.node.dht if self.node else None, self.guard,
                                   recent_norms=self.replica.recent_norms)  # fmt: skip
        facts = Facts(
            speed=lambda: trainer.speed.steps_per_s, batch_size=run.batch_size,
            client_mode=lambda: self.node is not None and self.node.client_mode,
            bans=lambda: self.guard.head_bans(self.state.version), resources=lambda: resources(self.training.device),
        )  # fmt: skip
        self.heads = HeadChannel(
            lambda: self.node.dht if self.node else None, self.identity, spec.run_name,
            allow=self._allowed, replica=self.replica, counters=self.counters,
            activity=self.activity, facts=facts, faults=self.faults, manifest=self.signed,
            stop=self._stop,
        )  # fmt: skip
        self.phase = Phase(
            self.training, run=run, swarm=swarm, me=self.peer_id, pinned_shard=spec.shard,
            throttle=spec.throttle, activity=self.activity, counters=self.counters,
            in_flight=self.heads.in_flight, carried=self.ledger.carried,
            controls=Controls(self._stop, self._paused, self.on_step, self.heads.publish_soon,
                              self.heads.view, self.finished),
        )  # fmt: skip
        self.overlap = Overlap(trainer, lambda: self.state.theta, swarm, self.activity,
                               self.counters, carried=self.ledger.carried)  # fmt: skip
        self.round = Round(
            me=self.peer_id, swarm=swarm, replica=self.replica, training=self.training,
            guard=self.guard, averager=lambda: self._network().averager, heads=self.heads,
            activity=self.activity, counters=self.counters, ledger=self.ledger,
            events=self.events, tensorboard=self.tensorboard, catch_up=self.catch_up,
            certifier=self.certifier, notes=lambda: self._network().notes,
        )  # fmt: skip
        self.run_end = RunEnd(
            spec=spec, swarm=swarm, replica=self.replica, ledger=self.ledger, round_=self.round,
            heads=self.heads, activity=self.activity, counters=self.counters,
            training=self.training, catch_up=self.catch_up, stop=self._stop,
            applied_steps=self.applied_steps, on_round=self.applied,
        )  # fmt: skip

    def _probe(self, prefix: str, key_path: Path, validators: list[Any]) -> None:
        """A joiner in client mode asks a swarm peer to dial it (`become_reachable`)."""

        def emit(verdict: Verdict, port: int) -> None:
            self.events.emit(
                "reachability", version=self.state.version, state_hash=self.state.hash(),
                group_size=0, loss=None, status=verdict.status, detail=verdict.detail, port=port,
            )  # fmt: skip

        self.node = become_reachable(self._node(), self.spec, prefix, key_path, validators, emit,
                                     self.lifeline)  # fmt: skip

    def _resume(self, path: Path | None) -> None:
        if path is None:
            return
        if not path.exists():
            return  # checked writable in start()
        resumed = peer_checkpoint.load(path, self._checkpoint_parts())
        self.counters.rounds_done = resumed.rounds_done
        self.ledger.pending = resumed.pending
        sent = peer_checkpoint.sent_since(path, self.state.version)  # applied after it
        self.ledger.forget([self.state.parts[f] for f in sent if 0 <= f < len(self.state.parts)])
        self.events.emit(
            "resume", version=self.state.version, state_hash=self.state.hash(), group_size=0,
            loss=None, rounds_done=self.counters.rounds_done,
            pending_steps=resumed.pending.steps if resumed.pending is not None else 0,
            unsynced=self.ledger.unsynced(self.state.parts), forgotten=sent,
        )  # fmt: skip

    def _start_metrics(self) -> None:
        gauges = Gauges(
            version=lambda: self.state.version, speed=lambda: self.training.trainer.speed.steps_per_s,
            paused=self._paused.is_set, bans=lambda: len(self.guard.bans.active(self.state.version)),
            bans_total=lambda: self.guard.bans.total,
        )  # fmt: skip
        self.metrics = serve_metrics(self.spec.metrics_host, self.spec.metrics_port, self.counters,
                                     gauges, {"peer": self.peer_id, "run": self.spec.run_name})  # fmt: skip
        self.dashboard = serve_dashboard(self.spec, self.peer_id, self.heads.read, self.signed)

    # ----- the loop

    def run_loop(self) -> None:
        try:
            if not self.counters.started_training:  # a swarm started together trains together
                self.heads.wait_for_peers(self.swarm.expected_peers, self.swarm.start_timeout_s,
                                          self._stop)  # fmt: skip
            while not self.finished():
                if self._paused.is_set():
                    self.overlap.wait()  # the round in flight ends first
                    self._pause()
                    continue
                try:
                    self.run_round()
                except PhasePaused as p:  # kept: contributed after the pause (stale, not lost)
                    self.ledger.add(self.ledger.take(p.partial))
            self.overlap.wait()
            self.run_end.finish()
        except StopRequested:
            self.overlap.wait()  # its δ is applied or kept before the checkpoint
        self.heads.check_key()  # another live process with our key: exit 2

    def run_round(self) -> RoundOutcome | None:
        """One phase and its round; None when the run reached its end before δ could be
        contributed, or when the round runs in the background (`swarm.overlap`)."""
        if not self.overlap.in_flight:  # a round in flight catches up itself
            self.catch_up()
        if self.finished():
            return None
        view = self.heads.view()
        steps, others = (
            self.phase.plan_steps(view),
            self.phase.unseen_steps(view, self.round.co_planners),
        )
        fresh, loss = self.phase.train(steps, others, self.overlap if self.swarm.overlap else None)
        self.counters.last_loss = loss
        if self._checkpoint_due:  # overlapped: at a phase's end, AdamW and the data at rest,
            self._checkpoint_due = False  # the ledger not yet taken (`applied`: the sent log)
            self.save_checkpoint()
        mine = self.ledger.take(fresh)  # with what a failed or losing group left
        t0 = time.time()
        if self.swarm.overlap:  # the next phase trains while this round runs
            self.overlap.start(lambda: self.contribute(mine, loss, t0))
            return None
        return self.contribute(mine, loss, t0)

    def contribute(self, mine: Contribution, loss: float, t0: float) -> RoundOutcome | None:
        """Catch up, then the round of `mine` (in the background under `swarm.overlap`)."""
        self.catch_up()  # peers may have moved on while we trained
        if self.finished():  # the swarm reached the run's end while we trained
            if self.ledger.fragmented:  # the flush at the end syncs what it can of it
                self.ledger.add(mine)
            log.info("[%s] the run reached its end; last δ not contributed", self._tag())
            self.activity.idle()
            return None
        outcome = self.round.run(self.ledger.send(mine, self.state.part()), loss, t0)
        if outcome.report is not None:
            self.applied(outcome.report)
            every = self.swarm.checkpoint_every
            if every and self.counters.rounds_done % every == 0 and self.swarm.overlap:
                self._checkpoint_due = True
            elif every and self.counters.rounds_done % every == 0:
                self.save_checkpoint()
        return outcome

    def applied(self, report: RoundReport) -> None:
        """An update holding our δ was applied: the checkpoint's sent log says which fragment
        of its pending δ went (a restart does not offer it again), then `on_round`."""
        path = peer_checkpoint.checkpoint_path(self.spec.checkpoint_dir, self.spec.run_name)
        if path is not None and path.exists():
            fragment = (report.version - 1) % len(self.state.parts)
            peer_checkpoint.record_sent(path, fragment, report.version)
        self.on_round(report)

    def catch_up(
        self, hint: HeadChoice | None = None, publish: bool = True, accept: Accept | None = None
    ) -> bool:
        """Move to the head `CatchUp.target` picks (`hint`, else the swarm's if `accept` takes
        it), or heal a fork at our version; a peer whose branch lost contributes its last δ
        again. `publish`: publish our head if we moved (else the caller does it later)."""
        choice = self.catching_up.target(self.heads.view, hint, accept)
        if choice is None:
            return False
        with self.activity.exchange(choice.donors):  # the rejoiner spares their connections
            moved = self.catching_up.run(choice, probe_fork=self.ledger.owns(self.state.version))
        if moved is None:
            return False
        self.counters.wait_s += moved.seconds
        self.counters.catch_up_s = moved.seconds
        recontributed = moved.lost_fork and self.ledger.recontribute(moved.from_version)
        if recontributed:
            log.warning("[%s] our branch at v%d lost a fork; our δ goes into the next group",
                        self._tag(), moved.from_version)  # fmt: skip
        self.events.emit(
            "catch_up", version=self.state.version, state_hash=choice.state_hash, group_size=0,
            loss=self.counters.last_loss, donor=moved.donor, seconds=moved.seconds,
            bytes=moved.bytes, fork=moved.lost_fork, method=moved.method,
            from_version=moved.from_version, recontributed=recontributed, stepped=moved.stepped,
        )  # fmt: skip
        if publish:
            self.heads.publish()
        return True

    def finished(self) -> bool:
        """--max-rounds, --until-version or --until-steps reached, or a stop was requested."""
        return self._stop.is_set() or run_ended(
            self.spec, rounds_done=self.counters.rounds_done, version=self.state.version,
            departed_version=self.heads.departed_version,
            applied_steps=self.applied_steps(), elapsed_s=time.time() - self.counters.t_start,
        )  # fmt: skip

    def applied_steps(self) -> int:
        """Local steps the swarm state holds, all peers together (from the shard counters)."""
        return sum(self.state.shard_samples) // self.run.batch_size

    def _pause(self) -> None:
        """Leave (others drop our head at once, so nobody waits for us), wait, come back."""
        self.heads.publish(leaving=True)
        pending = self.ledger.pending
        self.events.emit(
            "pause", version=self.state.version, state_hash=self.replica.published_hash,
            group_size=0, loss=self.counters.last_loss,
            pending_steps=pending.steps if pending is not None else 0,
        )  # fmt: skip
        log.warning("[%s] paused (SIGUSR2 resumes)", self._tag())
        t0 = time.time()
        while self._paused.is_set() and not self.finished():
            self._stop.wait(0.5)
        self.heads.publish()
        self.events.emit(
            "unpause", version=self.state.version, state_hash=self.replica.published_hash,
            group_size=0, loss=self.counters.last_loss, paused_s=time.time() - t0,
        )  # fmt: skip

    # ----- checkpoints and shutdown

    def _checkpoint_parts(self) -> peer_checkpoint.PeerParts:
        t = self.training
        return peer_checkpoint.PeerParts(t.state, t.trainer, t.streams, self.signed, self.peer_id)

    def save_checkpoint(self) -> None:
        """Global state, local AdamW state, data positions and a pending δ, atomically."""
        path = peer_checkpoint.checkpoint_path(self.spec.checkpoint_dir, self.spec.run_name)
        if path is not None:
            version = self.state.version
            peer_checkpoint.save(path, self._checkpoint_parts(), self.counters.rounds_done,
                                 self.ledger.pending)  # fmt: skip
            peer_checkpoint.clear_sent(path, version)

    def shutdown(self) -> None:
        """Save a checkpoint, leave the DHT, free everything. Safe to call more than once."""
        self._stop.set()
        try:
            if self._ready:
                self.save_checkpoint()
                try:
                    self.heads.publish(leaving=True)
                except Exception as e:  # the DHT may already be gone (Ctrl+C reaches it too)
                    log.debug("could not announce leaving: %s", e)
                self._emit_stop()
        finally:
            for part in (self.heartbeat, self.rejoiner, self.metrics, self.dashboard):
                if part is not None:
                    part.shutdown()
            self.tensorboard.close()
            if self.net is not None:
                self.net.shutdown()
            elif self.node is not None:  # start() failed before the servers ran
                self.node.shutdown()
            self.events.close()
            self._tmp.cleanup()
            if self.lifeline is not None:
                self.lifeline.close()

    def _emit_stop(self) -> None:
        c = self.counters
        self.events.emit(
            "stop", version=self.state.version, state_hash=self.state.hash(),
            group_size=0, loss=c.last_loss, rounds_done=c.rounds_done,
            ppl=self.training.eval_ppl(), compute_s=c.compute_s, wait_s=c.wait_s,
            hidden_wait_s=c.hidden_wait_s, dropped=c.dropped,
            shard_samples=self.state.shard_samples, applied_steps=self.applied_steps(),
            finite=all(bool(torch.isfinite(t).all()) for t in self.state.theta),
            bans=self.guard.head_bans(self.state.version) or {}, bans_total=self.guard.bans.total,
            data_share=[len(x) / len(self.training.data.train) for x in self.training.shards],
            active_s=c.active_s(), unsynced=self.ledger.unsynced(self.state.parts),
        )  # fmt: skip

    # ----- small helpers

    def _network(self) -> Network:
        if self.net is None:
            raise RuntimeError("SwarmPeer.start() has not run")
        return self.net

    def _node(self) -> Node:
        if self.node is None:
            raise RuntimeError("SwarmPeer.start() has not run")
        return self.node

    def _tag(self) -> str:
        return f"{self.peer_id[-6:]} v{self.state.version}"
