"""GroupAverager: the front end that forms a group and all-reduces with it, for a training thread.

    service = P2PService(dht)        # one per process, shared with other components
    service.start()
    averager = GroupAverager(service, "run1", compression="int8", prune_fraction=0.0)
    averager.start()
    averager.wait_until_ready(timeout_s=30)   # waits for the service too
    result = averager.average(f"v{version}", deltas, weight=samples, gather=header,
                              target_size=64, matchmaking_timeout_s=10, allreduce_timeout_s=60)
    ...
    averager.shutdown()
    service.shutdown()

`average` blocks the calling thread; the work runs in the service's background asyncio loop, on
its P2P replica of the DHT's daemon (same peer id), so the stream handlers keep serving other
members between calls. Its outcomes (DESIGN.md §3, steps 4-5):

- a `GroupResult`: every member holds the same `average` bits and the same member list;
- `NoGroup`: nobody else came in time; a lone peer applies its own δ;
- `LeftOut` (a NoGroup): a group formed under this key without this peer (it did not
  acknowledge the group in time, commit.py); δ is kept, never applied alone;
- `AllReduceFailed`: a group was formed but did not finish; nothing is applied, δ is kept.

A round: hivemind's matchmaking (matchmaking.py), the commit step (commit.py: only the members
that acknowledged the group count), the admission of the committed members (round_plan.py),
the part exchange (allreduce.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch
from torch import Tensor

from diloco_peer.averaging.allreduce import SETUP_TIMEOUT_S, PartExchange
from diloco_peer.averaging.commit import COMMIT_PROTOCOL, CommitDesk, commit, commit_window_s
from diloco_peer.averaging.compression import COMPRESSIONS, Compression, prune
from diloco_peer.averaging.echo import ReceiptDesk
from diloco_peer.averaging.matchmaking import GATHER_PROTOCOL, Frame, Group, form_group
from diloco_peer.averaging.member import AllReduceResult
from diloco_peer.averaging.partition import chunk_count
from diloco_peer.averaging.receipts import Proof, Sign
from diloco_peer.averaging.robust import Aggregation
from diloco_peer.averaging.round_plan import (
    Admission,
    GroupResult,
    RoundPlan,
    describe,
    group_result,
    plan_round,
)
from diloco_peer.errors import AllReduceFailed, LeftOut, NoGroup, P2PServiceStopped
from diloco_peer.lifecycle import BackgroundPart
from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S
from diloco_peer.p2p.service import P2PService

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
"""Prefixes and keys: no '.' (hivemind's group keys) and no '-' (our separator)."""
_MAX_GATHER_BYTES = 64 * 1024
_CALL_SLACK_S = 5.0
"""Backstop on top of a call's own timeouts, for the training thread's wait on the loop."""


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def flatten(tensors: Sequence[Tensor], prune_fraction: float) -> Tensor:
    """One fp32 CPU vector, copied, so the training thread may change its tensors right after;
    each tensor pruned first when `prune_fraction` > 0."""
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise ValueError("tensors must be a non-empty list of torch.Tensor")
    if not all(t.is_floating_point() for t in tensors):
        raise ValueError("tensors must be floating point")
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
    if flat.numel() == 0:
        raise ValueError("tensors hold no element")
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("tensors hold NaN or inf: such a contribution must not be averaged")
    if prune_fraction > 0:  # per tensor (DiLoCo Table 6)
        sizes = [t.numel() for t in tensors]
        flat = torch.cat([prune(part, prune_fraction) for part in flat.split(sizes)])
    return flat


class GroupAverager(BackgroundPart):
    """Forms groups of peers that call `average` with the same key, and all-reduces within them.

    :param service: this process's P2PService, started before `start()` (not necessarily ready:
        `wait_until_ready` waits for it too); its peer id is this averager's identity. Shut the
        averager down before the service.
    :param prefix: names this averager's streams and DHT keys; peers must use the same prefix.
    :param compression: encoding of parts and averages on the wire (compression.py): "none"
        (fp32), "fp16", "int8" or "int4" (blockwise absmax). Lossy codecs round each member's
        part and the average once each; every member still gets the same bits.
    :param prune_fraction: in [0, 1): before sending, zero this fraction of the smallest
        magnitudes of each tensor passed to `average` (DiLoCo Table 6; `compression.prune`).
        The caller's tensors are not changed. It costs quality and saves no bytes (no codec is
        sparse). Both settings come from the run manifest (RunSpec.compression,
        RunSpec.prune_fraction) and are part of the group schema: averagers that differ in
        either never form a group together.
    :param aggregation: how each part reducer combines and screens the members' parts
        (robust.py: mean, trimmed mean or centered clipping; the minimum cosine). From the
        manifest, like compression.
    :param on_group: called in the loop thread with (key, sorted members) once a group is
        committed, before any part is sent. For metrics and for fault injection in tests
        ("kill this peer right after it joined a group").
    :param delay_ack: test-only fault: called in the loop thread with the round key when this
        peer, a follower, is about to acknowledge a group (commit.py); it waits the seconds
        returned first, as a peer that stalls between the group's assembly and its commit.
    :param withhold_parts: test-only fault: called in the loop thread with the round key once
        the round's plan is known; True makes this peer a member that never sends its parts
        (its round fails at the all-reduce timeout, and so does everyone's: allreduce.py).
    :param tamper: test-only (`join --chaos`): applied to the flat vector after its checks, so
        a hostile peer can send what an honest one never would (NaN, a scaled or random δ).
    :param client_mode: this peer cannot be dialed (behind a NAT or a firewall; its DHT is in
        client mode too). It joins groups that others lead, sends its parts and reads the
        averages over streams it opens itself, and reduces no part: the members that accept
        connections share the parts. A group with fewer than two admitted members that are not
        clients is NoGroup (round_plan.sole_reducer).
    :param allow: called in the loop thread with a peer id: False for a key outside a private
        swarm's allowlist, whose part streams are refused unread (admission keeps it out of
        groups anyway; this keeps it from holding the reducer's waiting slots).
    :param sign: this peer's `Identity.sign`: its reducer signs a receipt for every answer
        (receipts.py). When an admission gives the members' keys (`Admission.keys`), every
        answer's receipt is checked and the members compare their receipts before a round
        returns (echo.py): a round whose receipts disagree fails.
    :param on_proof: called in the loop thread with each proof that a reducer equivocated
        (two contradicting receipts it signed, `receipts.Proof`), whenever this peer finds one.
    :param equivocate: test-only fault: called in the loop thread with the round key; True
        makes this peer's reducer answer one member with other bytes, signed (a forked part).
    :param bias: test-only fault, likewise: its reducer answers every member a fixed direction
        as long as the members' norm check allows, instead of the average (wire.answer_part).
    :param frame: test-only fault (`matchmaking.Frame`): as a leader, this peer lists a member
        that never joined, or with an envelope it did not send, and counts its ACK.
    """

    def __init__(
        self,
        service: P2PService,
        prefix: str,
        *,
        compression: Compression = "none",
        prune_fraction: float = 0.0,
        aggregation: Aggregation | None = None,
        on_group: Callable[[str, list[str]], None] | None = None,
        tamper: Callable[[Tensor], Tensor] | None = None,
        client_mode: bool = False,
        delay_ack: Callable[[str], float] | None = None,
        withhold_parts: Callable[[str], bool] | None = None,
        allow: Callable[[str], bool] = lambda peer: True,
        sign: Sign | None = None,
        on_proof: Callable[[Proof], None] | None = None,
        equivocate: Callable[[str], bool] | None = None,
        bias: Callable[[str], bool] | None = None,
        frame: Frame | None = None,
    ) -> None:
        if not _NAME.fullmatch(prefix):
            raise ValueError(f"prefix must match {_NAME.pattern}, got {prefix!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if (
            isinstance(prune_fraction, bool)
            or not isinstance(prune_fraction, (int, float))
            or not 0 <= prune_fraction < 1
        ):
            raise ValueError(f"prune_fraction must be a number in [0, 1), got {prune_fraction!r}")
        super().__init__()
        self._service, self._prefix, self._compression = service, prefix, compression
        self._prune_fraction = float(prune_fraction)
        self._aggregation = aggregation or Aggregation()
        self._on_group = on_group
        self._tamper = tamper
        self._client_mode = bool(client_mode)
        self._delay_ack = delay_ack
        self._withhold_parts = withhold_parts
        self._equivocate = equivocate
        self._bias = bias
        self._frame = frame
        self._exchange = PartExchange(service, prefix, compression, self._aggregation, allow, sign)
        self._desk = CommitDesk(service, prefix)
        self._receipts = ReceiptDesk(service, prefix, on_proof or (lambda proof: None))
        self._peer_id: str | None = None
        self._busy = threading.Lock()  # one average() at a time
        self._searching = False  # the running average() is looking for its group
        self._round: asyncio.Task[Any] | None = None  # in the loop: the running round

    @property
    def part_name(self) -> str:
        return f"GroupAverager {self._prefix}"

    # ------------------------------------------------------------------ lifecycle

    def _begin(self) -> concurrent.futures.Future[None]:
        """Register the part and commit handlers on the service's loop, once its replica is
        connected."""
        self._exchange.start()
        return asyncio.run_coroutine_threadsafe(self._setup(), self._service.loop)

    async def _setup(self) -> None:
        await self._exchange.ready(SETUP_TIMEOUT_S)
        for desk in (self._desk, self._receipts):
            desk.start()  # the service's replica is up: registering takes one daemon call
            await desk.ready(SETUP_TIMEOUT_S)
        self._peer_id = self._service.peer_id
        logger.info("[%s] GroupAverager %s ready", self._peer_id[-6:], self._prefix)

    def _end(self) -> None:
        """Stop serving (the service keeps running): a round in progress fails now instead of
        at its timeout; answers to other members' parts get a grace period (PartExchange)."""
        if not self._service.is_running:
            return  # its loop is gone, and with it the handler and any round
        try:
            self._service.run(self._cancel_round(), HANDLER_CALL_TIMEOUT_S)
        except (TimeoutError, P2PServiceStopped) as e:
            logger.warning("GroupAverager %s: shutdown incomplete: %r", self._prefix, e)
        self._exchange.shutdown()
        self._desk.shutdown()
        self._receipts.shutdown()

    async def _cancel_round(self) -> None:
        if self._round is not None:
            self._round.cancel()

    @property
    def peer_id(self) -> str:
        """This peer's base58 id (known once ready)."""
        if self._peer_id is None:
            raise RuntimeError("GroupAverager is not ready")
        return self._peer_id

    # ------------------------------------------------------------------ rounds

    def average(
        self,
        key: str,
        tensors: list[Tensor],
        *,
        weight: float,
        gather: bytes,
        target_size: int,
        matchmaking_timeout_s: float,
        allreduce_timeout_s: float,
        admit: Callable[[Group], Admission] | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> GroupResult:
        """Form a group with the peers calling with the same `key`, then average with it.

        `admit`, called in the loop thread once the group is formed, decides which members take
        part (their signed headers are in `Group.gathered`) and with which weights; without it,
        all of them do, each with the `weight` it sent in its envelope (which an admission that
        sets weights ignores). If it leaves this peer alone, that is NoGroup.

        The group closes once `target_size` members are in, or with whoever came (at least two)
        when about `matchmaking_timeout_s` has passed; it counts the members that acknowledged
        it (commit.py: a step carved out of `allreduce_timeout_s`). Returns in at most
        matchmaking_timeout_s + allreduce_timeout_s (plus a few seconds of daemon calls).
        Raises NoGroup if no other peer joined in time, LeftOut (a NoGroup) if a group formed
        without this peer, AllReduceFailed if the group did not complete its exchange (no
        partial result is ever returned), ValueError on bad input. `give_up`, asked in the
        calling thread every few seconds while the group forms: once it says True, a search
        that nobody has joined yet ends (GaveUp, a NoGroup).
        """
        if not isinstance(key, str) or not _NAME.fullmatch(key):
            raise ValueError(f"key must match {_NAME.pattern}, got {key!r}")
        weight = _positive("weight", weight)
        matchmaking_timeout_s = _positive("matchmaking_timeout_s", matchmaking_timeout_s)
        allreduce_timeout_s = _positive("allreduce_timeout_s", allreduce_timeout_s)
        if isinstance(target_size, bool) or not isinstance(target_size, int) or target_size < 2:
            raise ValueError(f"target_size must be an integer >= 2, got {target_size!r}")
        if not isinstance(gather, bytes) or len(gather) > _MAX_GATHER_BYTES:
            raise ValueError(f"gather must be bytes of at most {_MAX_GATHER_BYTES}")
        flat = flatten(tensors, self._prune_fraction)
        if self._tamper is not None:
            flat = self._tamper(flat)
        shapes = [tuple(t.shape) for t in tensors]
        ready = self._ready
        if ready is None or not ready.done() or ready.cancelled() or ready.exception() is not None:
            raise RuntimeError("GroupAverager is not ready: start() and wait_until_ready() first")
        if self.stopped:
            raise RuntimeError("GroupAverager is shut down")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("average() is already running on this GroupAverager")
        tag = f"[{self.peer_id[-6:]} round={key}]"
        # the round bounds itself; this backstop adds the daemon calls' bounds and some slack
        budget_s = matchmaking_timeout_s + allreduce_timeout_s
        budget_s += 3 * HANDLER_CALL_TIMEOUT_S + _CALL_SLACK_S
        quit_, poll = self._poller(give_up, tag)
        self._searching = True
        try:
            round_ = self._average(
                key, flat, shapes, weight=weight, gather=gather, target_size=target_size,
                matchmaking_timeout_s=matchmaking_timeout_s,
                allreduce_timeout_s=allreduce_timeout_s, admit=admit, give_up=quit_,
            )  # fmt: skip
            return self._service.run(self._tracked(round_), budget_s, poll)
        except NoGroup as e:
            logger.info("%s", e)
            raise
        except AllReduceFailed as e:
            logger.warning("%s", e)
            raise
        except TimeoutError as e:  # raised inside the round, or the backstop: a failed round
            raise AllReduceFailed(
                f"{tag} {str(e) or 'timed out'} (budget {budget_s:.1f} s)"
            ) from None
        except P2PServiceStopped:
            raise AllReduceFailed(f"{tag} the averager or its P2P service was shut down") from None
        finally:
            self._searching = False
            self._busy.release()

    def _poller(
        self, give_up: Callable[[], bool] | None, tag: str
    ) -> tuple[threading.Event | None, Callable[[], None] | None]:
        """The event a search stops on, and the poll that sets it once `give_up` says so while
        the group forms (a question that fails is a no: the round goes on)."""
        if give_up is None:
            return None, None
        quit_ = threading.Event()

        def poll() -> None:
            try:
                if self._searching and give_up():
                    quit_.set()
            except Exception as e:
                logger.warning("%s give_up failed: %r", tag, e)

        return quit_, poll

    async def _tracked(self, round_: Coroutine[Any, Any, GroupResult]) -> GroupResult:
        """Runs a round as the task that shutdown() cancels."""
        self._round = asyncio.current_task()
        try:
            return await round_
        finally:
            self._round = None

    async def _average(
        self,
        key: str,
        flat: Tensor,
        shapes: list[tuple[int, ...]],
        *,
        weight: float,
        gather: bytes,
        target_size: int,
        matchmaking_timeout_s: float,
        allreduce_timeout_s: float,
        admit: Callable[[Group], Admission] | None,
        give_up: threading.Event | None,
    ) -> GroupResult:
        """One round in the loop: form a group, commit it, admit its members, all-reduce."""
        tag = f"[{self.peer_id[-6:]} round={key}]"
        started = time.perf_counter()
        group, commit_s = await self._form_group(
            key, shapes, weight=weight, gather=gather, target_size=target_size,
            matchmaking_timeout_s=matchmaking_timeout_s, allreduce_timeout_s=allreduce_timeout_s,
            give_up=give_up,
        )  # fmt: skip
        formed = time.perf_counter()
        logger.info("%s group of %d committed in %.2f s", tag, len(group.members), formed - started)
        if self._on_group is not None:
            self._on_group(key, list(group.members))
        try:
            plan = plan_round(self.peer_id, group, admit, tag)
        except (NoGroup, AllReduceFailed):
            self._exchange.close_key(key)
            raise
        reduced = await self._all_reduce(key, plan, flat, allreduce_timeout_s - commit_s)
        if reduced.excluded:
            logger.warning("%s parts refused: %s", tag, describe(reduced.excluded))
        done = time.perf_counter()
        logger.info(
            "%s all-reduce of %d floats done in %.2f s (%d B sent, %d B received)", tag,
            reduced.average.numel(), done - formed, reduced.bytes_sent, reduced.bytes_received,
        )  # fmt: skip
        return group_result(group, plan, reduced, shapes, formed - started, done - formed)

    async def _all_reduce(
        self, key: str, plan: RoundPlan, flat: Tensor, timeout_s: float
    ) -> AllReduceResult:
        """The part exchange, then (when the plan has keys) the receipt echo: the round returns
        only if every other reducer confirmed every receipt this peer holds (echo.py)."""
        if plan.keys is not None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            count = chunk_count(flat.numel()) * len(plan.reducers)
            self._receipts.open(plan.digest, plan.members, plan.keys, count, deadline)
        try:
            reduced = await self._exchange.all_reduce(
                key=key, digest=plan.digest, members=plan.members, weights=plan.weights,
                flat=flat, allreduce_timeout_s=timeout_s, bounds=plan.bounds,
                reducers=plan.reducers,
                keys=None if plan.keys is None else [k for _, k in plan.keys],
                withhold=self._withhold_parts is not None and self._withhold_parts(key),
                equivocate=self._equivocate is not None and self._equivocate(key),
                bias=self._bias is not None and self._bias(key), reference=plan.reference,
            )  # fmt: skip
            if plan.keys is not None:
                self._receipts.settle(plan.digest, reduced.receipts)
                try:
                    await self._receipts.confirm(plan.digest, self.peer_id, reduced.receipts)
                except AllReduceFailed as e:
                    raise AllReduceFailed(f"[{self.peer_id[-6:]} round={key}] {e}") from None
            return reduced
        except BaseException as e:
            if plan.keys is not None:
                self._receipts.fail(plan.digest, str(e))
            raise
        finally:
            if plan.keys is not None:
                self._receipts.close(plan.digest)

    def _lead(self, proposed: Group, window_s: float) -> None:
        """As the leader of `proposed`: take its members' ACKs (a hostile one forges one)."""
        self._desk.open(proposed, window_s)
        framed = self._frame.framed if self._frame is not None else None
        if framed is not None and framed in proposed.members:
            self._desk.forge_ack(proposed, framed)

    async def _form_group(
        self,
        key: str,
        shapes: list[tuple[int, ...]],
        *,
        weight: float,
        gather: bytes,
        target_size: int,
        matchmaking_timeout_s: float,
        allreduce_timeout_s: float,
        give_up: threading.Event | None = None,
    ) -> tuple[Group, float]:
        """hivemind's matchmaking among the peers that call with this key and the same schema,
        then the commit step (commit.py); the committed group, and the seconds the commit took
        (carved out of the all-reduce's time). Once it fails, parts of other groups with this
        key are refused (matchmaking.py)."""
        # peers whose tensors differ in layout or encoding must never meet: hivemind rejects a
        # join request whose schema hash differs from the leader's
        schema = (
            f"{self._prefix}|{key}|{self._compression}|{self._prune_fraction!r}|{shapes}|"
            f"{self._aggregation!r}|{GATHER_PROTOCOL}|{COMMIT_PROTOCOL}"
        )  # members check averages against their own aggregation
        window_s = commit_window_s(allreduce_timeout_s)
        self._exchange.open_key(key)
        try:
            group = await form_group(
                dht=self._service.dht,
                p2p=self._service.p2p,
                namespace=f"{self._prefix}-{key}",
                key=key,
                schema_hash=hashlib.sha256(schema.encode()).digest(),
                weight=weight,
                gather=gather,
                target_size=target_size,
                matchmaking_timeout_s=matchmaking_timeout_s,
                client_mode=self._client_mode,
                on_lead=lambda proposed: self._lead(proposed, window_s),
                frame=self._frame,
                give_up=give_up,
            )
            self._searching = False
            matched = time.perf_counter()
            if self._frame is not None:
                self._frame.seen(group, self.peer_id)
            if self._delay_ack is not None and group.leader != self.peer_id:
                await asyncio.sleep(self._delay_ack(key))
            committed = await commit(
                self._desk, self._service.p2p, group, self.peer_id,
                allreduce_timeout_s=allreduce_timeout_s,
            )  # fmt: skip
            commit_s = time.perf_counter() - matched
            if commit_s >= allreduce_timeout_s:
                raise AllReduceFailed(f"the commit step took the all-reduce's {commit_s:.1f} s")
            return committed, commit_s
        except BaseException:
            self._exchange.close_key(key)  # in no group: others' parts naming this key are refused
            raise


__all__ = ["Admission", "AllReduceFailed", "GroupAverager", "GroupResult", "LeftOut", "NoGroup"]
