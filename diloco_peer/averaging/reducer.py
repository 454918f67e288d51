"""The reducer side of the part exchange (allreduce.py): the rounds this peer is in, and the part
of each that it reduces.

A reducer accepts a member's part stream into its round only if the header matches the plan
every member agreed on; it trusts nothing in the header it can check elsewhere: the sender is the
libp2p-authenticated stream peer id (not a header field), and must be a member of the round named
by the header's digest; its weight must equal the one agreed at matchmaking. Once every member's
part is in (its own included), it screens and aggregates them (robust.py), serializes the answer
ONCE (wire.py), signs its receipt once (receipts.py) and sends those same bytes to every member.

A part that arrives whole but does not decode is excluded and its sender refused; one that never
arrives whole (a broken stream, a timeout, a frame longer than the part's encoding, refused
unread) fails the round, as a crashed member does.

Traffic is counted per round (`Round.bytes_sent`, `bytes_received`): every frame, length prefix
included, on both ends of every stream the round uses, as a member and as a reducer. A stream
counts for a round from the moment its reducer accepts the part; parts refused before (unknown
round, stranger, duplicate) count for no round.

A part for a round not started here may wait for it; membership of such a round cannot be
checked yet, so what a sender can hold is bounded instead (`SenderSlots`): at most
`MAX_WAITING_PER_SENDER` of its streams wait at once, `MAX_WAITING_PARTS` in all, and a sender the
allowlist refuses is turned away before it is read at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P
from torch import Tensor

from diloco_peer.averaging.compression import CODEC_ID, Compression, decode, encoded_size
from diloco_peer.averaging.partition import MAX_CHUNKS, key_tag, part_sizes
from diloco_peer.averaging.receipts import Sign, forge_answer, seal_answer
from diloco_peer.averaging.robust import Aggregation, Exclusion, Reason
from diloco_peer.averaging.wire import OK, PART_HEADER, PartHeader, answer_part, refusal
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.slots import SenderSlots
from diloco_peer.p2p.streams import STREAM_ERRORS, consume, framed_size, linger, read_frame

logger = logging.getLogger(__name__)

EXCHANGE_ERRORS = (*STREAM_ERRORS, ValueError)
"""What a broken, refused or timed-out part stream raises; each becomes AllReduceFailed."""

_HEADER_TIMEOUT_S = 10.0
"""How long a reducer waits for the header of a stream it did not open."""
_UNKNOWN_ROUND_WAIT_S = 30.0
"""Upper bound on how long a part may wait for its round to start locally (matchmaking ends at
slightly different moments on different members; the sender's own timeout bounds it further)."""
_CLOSED_ROUND_RETAIN_S = 60.0
"""How long a finished round stays known, so a late part gets its answer or a prompt refusal."""
MAX_WAITING_PER_SENDER = 2 * MAX_CHUNKS
"""Part streams of one sender that may wait at once for rounds not started here. An honest
member sends one stream per chunk of its round (at most MAX_CHUNKS), and may have the streams of
a round that failed on its side still waiting here (up to _UNKNOWN_ROUND_WAIT_S): twice that.
One key opening more streams only gets them refused; it cannot take the others' slots."""
MAX_WAITING_PARTS = 256
"""Part streams of all senders that may wait at once for rounds not started here: a bound on the
memory parts naming rounds this peer never joins can hold (16 senders of a full round each)."""
_MAX_CLOSED_KEYS = 256
SILENCE_SHARE = 0.5
"""A member whose part my reducer lacks when the round fails is named silent only if the round
failed at least this share of its time after it started here. Every honest member opens all its
part streams as its round starts (member.py), and rounds start within the commit window of each
other; half the all-reduce time leaves room for both and for a slow link, while a round that
fails at its deadline (as every member's does when one stays silent) always names the silent
one, even on members that hear of the failure from another member first."""


def short_id(peer: str) -> str:
    """How logs and messages name a peer: the end of its base58 id."""
    return peer[-6:]


class Round:
    """One round as one member sees it: the plan every member agreed on, plus my part's inbox."""

    def __init__(
        self,
        *,
        key: str,
        digest: bytes,
        members: Sequence[str],
        me: str,
        weights: Sequence[float],
        compression: Compression,
        numel: int,
        timeout_s: float,
        aggregation: Aggregation = Aggregation(),
        bounds: Sequence[float | None] | None = None,
        reducers: Sequence[str] | None = None,
        sign: Sign | None = None,
        equivocate: bool = False,
        bias: bool = False,
        reference: Tensor | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.key, self.digest, self.compression = key, digest, compression
        self.aggregation, self.bounds = aggregation, None if bounds is None else list(bounds)
        self.members = list(members)
        self.reducers = self.members if reducers is None else list(reducers)
        if not self.reducers or [m for m in self.members if m in self.reducers] != self.reducers:
            raise ValueError("reducers must be a non-empty subsequence of the sorted members")
        self.weights = [float(w) for w in weights]
        self.me = me
        self.my_index = self.members.index(me)
        self.my_part = self.reducers.index(me) if me in self.reducers else None
        """The part I reduce; None in client mode."""
        self.sign = sign
        """Signs my answer's receipt (receipts.py); None: unsigned (tests without keys)."""
        self.victim = next((m for m in self.members if m != me), None) if equivocate else None
        """Test-only fault: the member my reducer answers with other bytes (receipts.py)."""
        self.bias = bias
        """Test-only fault: my reducer answers a fixed direction within the bound (answer_part)."""
        self.sizes = part_sizes(numel, len(self.reducers))
        self.reference = reference
        """`numel` values the direction screen takes out of every part (robust.screen_parts)."""
        self.started, self.timeout_s = loop.time(), timeout_s
        self.deadline = self.started + timeout_s
        self.claimed: set[str] = set()
        """Senders whose part stream was accepted (duplicates refused)."""
        self.received: dict[str, Tensor | Exclusion] = {}
        self.arrived: set[str] = set()
        """Members whose whole part reached my reducer (decodable or not), mine included."""
        self._reduction: asyncio.Future[None] | None = None  # referenced while it runs
        self.result: asyncio.Future[bytes] = loop.create_future()
        self.result.add_done_callback(consume)
        # frames of this round's streams, both ends, both roles (a reducer's answer is counted
        # just before it is written, so `traffic` waits for every accepted part's answer)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._unanswered = 0
        self._all_answered = asyncio.Event()
        self._all_answered.set()

    @property
    def tag(self) -> str:
        return f"[{short_id(self.me)} round={self.key}]"

    @property
    def part(self) -> int:
        """The part I reduce, on the reducer's side; AllReduceFailed in client mode."""
        if self.my_part is None:
            raise AllReduceFailed("I reduce no part in this round (client mode)")
        return self.my_part

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def fail(self, reason: str) -> None:
        if not self.result.done():
            self.result.set_exception(AllReduceFailed(f"part {self.my_part}: {reason}"))

    def accept(self, sender: str, header_bytes: int) -> None:
        """A member's part stream joins the round; it owes one `answered()` call from now on."""
        self.claimed.add(sender)
        self.bytes_received += header_bytes
        self._unanswered += 1
        self._all_answered.clear()

    def answered(self) -> None:
        """An accepted stream's answer is counted (or it will never send one)."""
        self._unanswered -= 1
        if self._unanswered == 0:
            self._all_answered.set()

    async def traffic(self, wait_s: float) -> tuple[int, int]:
        """(bytes sent, bytes received) once every accepted part's answer is counted.

        Called after the round succeeded here: the result is then set, so the handlers that
        answer it only need their turn in the loop. Past `wait_s` (never expected) the counts
        are returned as they stand rather than failing a round for its bookkeeping.
        """
        try:
            await asyncio.wait_for(self._all_answered.wait(), wait_s)
        except asyncio.TimeoutError:
            logger.debug("%s traffic counted without %d answers", self.tag, self._unanswered)
        return self.bytes_sent, self.bytes_received

    def deliver(self, sender: str, part: Tensor | Exclusion) -> None:
        """Store a member's decoded part (or why it could not be decoded); the last one in
        starts the reduction (in sorted member order)."""
        self.received[sender] = part
        self.arrived.add(sender)
        if len(self.received) < len(self.members) or self.result.done():
            return
        received = [self.received.pop(m) for m in self.members]
        self._reduction = asyncio.ensure_future(self._reduce(received))

    async def _reduce(self, received: list[Tensor | Exclusion]) -> None:
        """Screen, aggregate, serialize and sign the answer once, for all, in a worker thread:
        robust methods take up to ~1 s for 16 parts of 4M floats (bench/robust_aggregation.py),
        which must not stall the loop's other streams (torch releases the GIL)."""
        try:
            answer, excluded = await asyncio.to_thread(
                answer_part,
                received,
                self.weights,
                self.bounds,
                self.aggregation,
                self.compression,
                self.sizes[self.part],
                self.bias,
                self._my_reference(),
            )
            answer = await asyncio.to_thread(seal_answer, answer, self.digest, self.part, self.sign)
        except AllReduceFailed as e:
            self.fail(str(e))
            return
        except Exception as e:  # a bug here must fail the round now, not at its timeout
            logger.exception("%s reducing part %s failed", self.tag, self.my_part)
            self.fail(f"{type(e).__name__}: {e}")
            return
        if excluded:  # the details stay here; the answer carries only the reason codes
            details = "; ".join(f"{short_id(self.members[i])}: {e}" for i, e in excluded.items())
            logger.warning("%s part %s excluded %s", self.tag, self.my_part, details)
        if not self.result.done():  # the round may have failed meanwhile
            self.result.set_result(answer)

    def _my_reference(self) -> Tensor | None:
        """The slice of `reference` my part covers."""
        if self.reference is None:
            return None
        start = sum(self.sizes[: self.part])
        return self.reference[start : start + self.sizes[self.part]]


def silent_members(rounds: Sequence[Round], now: float) -> tuple[str, ...]:
    """The members whose part never reached my reducer in a failed round's sub-rounds `rounds`
    (loop time `now`), sorted: the ones this peer waited for in vain. Nobody when the round
    failed before SILENCE_SHARE of its time (their parts may still have been on the way), or
    when I reduce no part (client mode: I waited for nobody's part). Only what my own reducer
    saw counts: a reducer that never answers me may itself be waiting for someone else."""
    silent: set[str] = set()
    for rnd in rounds:
        if rnd.my_part is None or now - rnd.started < SILENCE_SHARE * rnd.timeout_s:
            continue
        silent.update(m for m in rnd.members if m not in rnd.arrived and m != rnd.me)
    return tuple(sorted(silent))


class PartReducer:
    """The rounds this peer is in, by digest, and the part streams other members open to it.

    Lives in one asyncio loop (the P2P service's). A part may arrive before its round starts
    here (matchmaking ends at slightly different moments on different members): it waits for
    the round, boundedly, unless this peer's matchmaking for that key is over (`close_key`).

    :param allow: called in the loop thread with a sender's authenticated peer id; a part from a
        sender it refuses (a private swarm's allowlist) is turned away before its header is read.
    :param max_waiting, max_waiting_per_sender: bounds on the part streams waiting for rounds not
        started here, in all and per sender (MAX_WAITING_PARTS, MAX_WAITING_PER_SENDER).
    """

    def __init__(
        self,
        *,
        allow: Callable[[str], bool] = lambda peer: True,
        max_waiting: int = MAX_WAITING_PARTS,
        max_waiting_per_sender: int = MAX_WAITING_PER_SENDER,
    ) -> None:
        self._allow = allow
        self._rounds: dict[bytes, Round] = {}
        # parts that arrived before their round started here wait on these, by round digest
        self._pending: dict[bytes, _Pending] = {}
        self._waiting = SenderSlots(max_waiting, max_waiting_per_sender)
        # keys whose matchmaking is over here (insertion-ordered, oldest dropped first): a part
        # for an unknown round of such a key is refused at once instead of waiting in vain
        self._closed_keys: dict[bytes, None] = {}

    # ------------------------------------------------------------------ rounds and keys

    def open_key(self, key: str) -> None:
        """Matchmaking for `key` begins: parts of a group with this key may come (again)."""
        self._closed_keys.pop(key_tag(key), None)

    def close_key(self, key: str) -> None:
        """Matchmaking for `key` is over here: refuse parts of any other group with this key,
        including those already waiting (this peer thinks it is in no group, or in another)."""
        tag = key_tag(key)
        self._closed_keys[tag] = None
        while len(self._closed_keys) > _MAX_CLOSED_KEYS:
            del self._closed_keys[next(iter(self._closed_keys))]
        for digest, pending in list(self._pending.items()):
            if pending.tag == tag and digest not in self._rounds:
                del self._pending[digest]
                pending.started.set()  # the waiters wake and find no round

    def add(self, rounds: Iterable[Round]) -> None:
        """These rounds start here: parts for them are accepted, those waiting wake up."""
        for rnd in rounds:
            self._rounds[rnd.digest] = rnd
            pending = self._pending.pop(rnd.digest, None)
            if pending is not None:
                pending.started.set()  # parts that came before the round started here

    def retire(self, rounds: Iterable[Round]) -> None:
        """These rounds are over here; they stay known for a while, so that a late part gets
        its answer or a prompt refusal."""
        loop = asyncio.get_running_loop()
        for rnd in rounds:
            loop.call_later(_CLOSED_ROUND_RETAIN_S, self._forget, rnd.digest)

    def _forget(self, digest: bytes) -> None:
        self._rounds.pop(digest, None)

    async def find_round(self, digest: bytes, tag: bytes, wait_s: float, sender: str) -> Round:
        """The round `digest` names, waiting up to `wait_s` for it to start here;
        AllReduceFailed if it does not, if its key's matchmaking is over here, or if `sender`
        (or everyone) has too many parts waiting already (`SenderSlots`)."""
        rnd = self._rounds.get(digest)
        if rnd is not None:
            return rnd
        if tag in self._closed_keys:
            raise AllReduceFailed("this peer is in no such group (its matchmaking ended otherwise)")
        if not self._waiting.take(sender):
            raise AllReduceFailed(
                "too many parts waiting for rounds this peer has not started "
                f"(slots {self._waiting.why_not(sender)})"
            )
        pending = self._pending.get(digest)
        if pending is None:
            pending = self._pending[digest] = _Pending(tag)
        pending.waiters += 1
        try:
            await asyncio.wait_for(pending.started.wait(), wait_s)
        except asyncio.TimeoutError:
            raise AllReduceFailed(
                f"no round {digest.hex()[:12]} here after {wait_s:.1f} s"
            ) from None
        finally:
            self._waiting.give(sender)
            pending.waiters -= 1
            if pending.waiters == 0 and self._pending.get(digest) is pending:
                del self._pending[digest]  # nobody started it, and nobody waits any more
        rnd = self._rounds.get(digest)
        if rnd is None:
            raise AllReduceFailed("this peer is in no such group (its matchmaking ended otherwise)")
        return rnd

    # ------------------------------------------------------------------ part streams

    async def serve(
        self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One part stream from `sender` (the libp2p-authenticated peer id), from its header to
        the answer's delivery; closes the stream."""
        try:
            await self.serve_part(sender, reader, writer)
            # closed only once the member has read the answer and closed its end (streams.linger)
            if not await linger(reader):
                logger.debug("%s did not close the answer stream", short_id(sender))
        except EXCHANGE_ERRORS as e:
            logger.debug("answer to %s not delivered: %r", short_id(sender), e)
        finally:
            writer.close()

    async def serve_part(
        self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Accept a member's part, reduce it, answer with the average or the reason it failed."""
        try:
            rnd = await self.claim_part(sender, reader)
        except (AllReduceFailed, *EXCHANGE_ERRORS) as e:
            # refused before joining a round: this stream counts for none
            await asyncio.wait_for(P2P.send_raw_data(_refuse(sender, e), writer), _HEADER_TIMEOUT_S)
            return
        reply_timeout_s = _HEADER_TIMEOUT_S
        try:
            try:
                response = OK + await self.reduce_part(rnd, sender, reader)
                if sender == rnd.victim:  # a test-only fault: other bytes for this member
                    response = OK + forge_answer(
                        response[len(OK) :], rnd.digest, rnd.part, rnd.sign
                    )
                reply_timeout_s = max(rnd.remaining_s(), 1.0)
            except (AllReduceFailed, *EXCHANGE_ERRORS) as e:
                response = _refuse(sender, e)
            # counted before it is written (send_raw_data hands the whole frame to the stream
            # before it first waits): the round's counts need not wait for slow receivers
            rnd.bytes_sent += framed_size(response)
        finally:
            rnd.answered()
        await asyncio.wait_for(P2P.send_raw_data(response, writer), reply_timeout_s)

    async def claim_part(self, sender: str, reader: asyncio.StreamReader) -> Round:
        """Read a part's header and accept the stream into its round, or raise AllReduceFailed.
        A sender the allowlist refuses is refused before anything is read."""
        try:
            allowed = bool(self._allow(sender))
        except Exception as e:  # a broken allow() refuses rather than accepting by accident
            logger.exception("allow(%s) failed", short_id(sender))
            raise AllReduceFailed(f"not allowed ({type(e).__name__} in the check)") from None
        if not allowed:
            raise AllReduceFailed(f"{short_id(sender)} is not allowed in this swarm")
        raw = await asyncio.wait_for(
            read_frame(reader, PART_HEADER.size, AllReduceFailed), _HEADER_TIMEOUT_S
        )
        header = PartHeader.unpack(raw)
        wait_s = min(header.timeout_s, _UNKNOWN_ROUND_WAIT_S)
        rnd = await self.find_round(header.digest, header.key_tag, wait_s, sender)
        _check_against_plan(rnd, sender, header)
        rnd.accept(sender, framed_size(raw))
        return rnd

    async def reduce_part(self, rnd: Round, sender: str, reader: asyncio.StreamReader) -> bytes:
        """Read an accepted member's part; return the round's answer once every part is in.

        A part that arrives whole but does not decode is excluded and its sender refused (an
        AllReduceFailed here); one that does not arrive whole fails the round.
        """
        numel = rnd.sizes[rnd.part]
        expected_bytes = encoded_size(numel, rnd.compression)
        try:
            payload = await asyncio.wait_for(
                read_frame(reader, expected_bytes, AllReduceFailed), rnd.remaining_s()
            )
            rnd.bytes_received += framed_size(payload)
        except (AllReduceFailed, *EXCHANGE_ERRORS) as e:
            # a member's part is lost: the round cannot complete, so tell everyone now
            rnd.fail(f"the part of {short_id(sender)} failed: {type(e).__name__}: {e}")
            raise
        try:
            part: Tensor | Exclusion = decode(payload, numel, rnd.compression)
        except AllReduceFailed as e:
            rnd.deliver(sender, Exclusion(Reason.MALFORMED, str(e)))
            raise AllReduceFailed(f"malformed part, excluded: {e}") from None
        rnd.deliver(sender, part)
        return await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())


@dataclass
class _Pending:
    """A round not started here that parts wait for: its key's tag (from the first part's
    header), the event that wakes them, and how many wait."""

    tag: bytes
    started: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0


def _check_against_plan(rnd: Round, sender: str, header: PartHeader) -> None:
    """AllReduceFailed unless the part fits the plan every member agreed on; the sender is the
    authenticated stream peer."""
    if sender not in rnd.members or sender == rnd.me:
        raise AllReduceFailed(f"{short_id(sender)} is not a member of round {rnd.key}")
    if header.part != rnd.part:
        raise AllReduceFailed(f"I reduce part {rnd.part}, not part {header.part}")
    if header.codec != CODEC_ID[rnd.compression]:
        raise AllReduceFailed(f"codec {header.codec} differs from mine ({rnd.compression})")
    if header.numel != rnd.sizes[header.part]:
        raise AllReduceFailed(f"part of {header.numel} elements, expected {rnd.sizes[header.part]}")
    if header.weight != rnd.weights[rnd.members.index(sender)]:
        raise AllReduceFailed(f"weight {header.weight} differs from the one agreed at matchmaking")
    if sender in rnd.claimed:
        raise AllReduceFailed(f"duplicate part from {short_id(sender)}")
    if rnd.result.done():
        raise AllReduceFailed("round is already over on its reducer")


def _refuse(sender: str, error: Exception) -> bytes:
    """The answer to a part that failed (wire.refusal), logged."""
    logger.debug("part from %s refused: %s", short_id(sender), error)
    return refusal(error)
