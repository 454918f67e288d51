"""Part exchange: the all-reduce of one group, with bit-identical results on every member.

Why not hivemind's `AllReduceRunner` (DESIGN.md §1): there each member adds a received delta to its
own tensor, so members end with different bits, and a part whose reducer fails is silently left
un-averaged. Here each part has exactly one reducer, which

1. receives that part of every member's flat fp32 vector (members sorted by base58 peer id;
   the reducers are the members that accept connections, in the same order: the vector is cut
   into len(reducers) near-equal contiguous parts, reducer j reduces part j; a member in client
   mode, which nobody can dial, only sends its parts and reads the averages),
2. screens them and combines the rest in sorted member order (robust.py: `answer_part`),
3. serializes the average and the list of excluded members ONCE and returns those same bytes
   to every member, itself included,

so every member decodes identical bytes into identical tensors and the same exclusions. Any part
that fails or times out fails the whole round on every member that needs it: no partial result
is ever returned.

Screening (DESIGN.md §4, robust.py) costs no round trip: a reducer leaves out of its part's
aggregate a member whose part is not finite, longer than the L2 norm that member declared for its
whole vector (`bounds`), pointing away from the others (`Aggregation.min_cosine`), or undecodable.
The round goes on with the others; every member learns who was excluded from which part
(`AllReduceResult.excluded`). The sender of a non-finite or too long part still gets the answer,
the sender of undecodable bytes a refusal. A part that never arrives whole (a broken stream, a
timeout, a frame longer than the part's encoding, refused unread) still fails the round, as a
crashed member does; so does a part from which every member is excluded.

A long vector goes in chunks (`chunk_count`), each chunk a sub-round of its own with the steps
above and its own digest, all at once: reducer j reduces part j of every chunk and answers each
as soon as that chunk's parts are in, so averages flow back while later chunks still come in.

Wire protocol, one libp2p stream per (sender, chunk, part) on the handler `<prefix>-part`, each
message framed as hivemind's `P2P.send_raw_data` does (8-byte big-endian length, then the
payload):

    sender  -> reducer : _PART_HEADER (fixed struct, below)
    sender  -> reducer : the part, `numel` values encoded by compression.py's codec (fp32, fp16,
                         int8 or int4 blockwise; the header names it, every member uses the same)
    reducer -> sender  : b"OK" + exclusions + the averaged part (same encoding)
                         | b"ER" + utf-8 reason
    exclusions         : u16 count, then count × (u16 member index, u8 reason code), indices
                         strictly increasing (little-endian; codes: robust.Reason, 1 non-finite,
                         2 norm, 3 cosine, 4 malformed); count < number of members

A member refuses an answer (AllReduceFailed) whose length is not exactly that, whose indices or
codes are out of range, or whose average is not finite or longer than the aggregate of the
included members' declared norms can be (`robust.average_norm_limit`).

Lossy codecs lose precision twice: once on each member's part (the reducer decodes it before
reducing), once on the average (encoded once by the reducer, decoded by everyone).
`all_reduce_in_memory` computes the same result in one process, for the simulator and tests.

The reducer trusts nothing in the header it can check elsewhere: the sender is the
libp2p-authenticated stream peer id (not a header field), and must be a member of the round named
by the header's digest; its weight must equal the one agreed at matchmaking.

Traffic is counted per round (`_Round.bytes_sent`, `bytes_received`): every frame above, length
prefix included, on both ends of every stream the round uses, as a member and as a reducer. A
stream counts for a round from the moment its reducer accepts the part; parts refused before
(unknown round, stranger, duplicate) count for no round. Matchmaking's RPCs are not counted here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from torch import Tensor

from diloco_peer.averaging.compression import (
    CODEC_ID,
    COMPRESSIONS,
    Compression,
    decode,
    encode,
    encoded_size,
)
from diloco_peer.averaging.robust import (
    Aggregation,
    Exclusion,
    Reason,
    answer_part,
    answer_size,
    check_bounds,
    describe_exclusions,
    unpack_answer,
)
from diloco_peer.averaging.robust import reduce_part as reduce_part  # re-exported
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.streams import STREAM_ERRORS, read_frame

logger = logging.getLogger(__name__)

# magic, protocol version, round digest (sha256), key tag (sha256 of the round key, cut), part
# index, codec id, weight, numel, sender's all-reduce timeout (so a reducer that has not started
# the round yet knows how long to wait)
_PART_HEADER = struct.Struct("<4sB32s8sIBdQd")
_MAGIC = b"DLCP"
_PROTOCOL_VERSION = 3  # 2: answers carry exclusions; 3: chunks and client-mode members

_ANSWER_LINGER_S = 10.0
"""How long a reducer waits for a member to close an answered stream before closing it."""
_HEADER_TIMEOUT_S = 10.0
"""How long a reducer waits for the header of a stream it did not open."""
_UNKNOWN_ROUND_WAIT_S = 30.0
"""Upper bound on how long a part may wait for its round to start locally (matchmaking ends at
slightly different moments on different members; the sender's own timeout bounds it further)."""
_CLOSED_ROUND_RETAIN_S = 60.0
"""How long a finished round stays known, so a late part gets its answer or a prompt refusal."""
_MAX_PENDING_ROUNDS = 64
"""Unknown round digests a reducer is willing to wait for at once (a bound on memory for parts
that name rounds this peer never joins)."""
_MAX_CLOSED_KEYS = 256
_MAX_REASON_BYTES = 512
_OK, _ERROR = b"OK", b"ER"
_P2P_ERRORS = (*STREAM_ERRORS, ValueError)
"""What a broken, refused or timed-out stream raises (ConnectionError is an OSError,
IncompleteReadError an EOFError); each becomes AllReduceFailed."""


CHUNK_VALUES = 1 << 20
"""A vector is pipelined in chunks of at least this many values (4 MiB of fp32)."""
MAX_CHUNKS = 8


def chunk_count(numel: int) -> int:
    """How many chunks a round of `numel` values goes in (every member derives the same).

    One part message per reducer means two phases: every part in, then every average out, each
    one stream per peer pair, and an emulated 100 Mbit link carried about 0.6 of its rate (bench/
    wan.py). With chunks, a reducer sends a chunk's averages while the next chunks' parts are
    still coming in, and each peer pair has one stream per chunk in flight. Each chunk is
    screened and aggregated on its own (robust.py); a member's declared norm bounds every
    chunk of its vector too. Vectors under 2 × CHUNK_VALUES go in one chunk, as before.
    """
    return max(1, min(MAX_CHUNKS, numel // CHUNK_VALUES))


def part_sizes(numel: int, num_parts: int) -> list[int]:
    """Sizes of `num_parts` near-equal contiguous parts, larger ones first (torch.tensor_split)."""
    base, extra = divmod(numel, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def all_reduce_in_memory(
    contributions: Sequence[Tensor],
    weights: Sequence[float],
    compression: Compression,
    aggregation: Aggregation = Aggregation(),
    bounds: Sequence[float | None] | None = None,
    num_parts: int | None = None,
) -> Tensor:
    """What `PartExchange.all_reduce` returns on every member, computed in one process.

    `contributions` are the members' flat fp32 vectors in sorted member order; `num_parts` the
    number of reducers (default: every member). Each is cut into parts as the network round
    cuts it, each part encoded and decoded (the sender's bytes), the
    parts screened and aggregated and the answer packed by `answer_part` (the reducer's bytes),
    then unpacked as a member checks it: the same calls in the same order, so the same bits. Raises AllReduceFailed where a round would fail (a non-finite average, every member
    excluded from a part).
    """
    average, _ = all_reduce_in_memory_detailed(
        contributions, weights, compression, aggregation, bounds, num_parts
    )
    return average


def all_reduce_in_memory_detailed(
    contributions: Sequence[Tensor],
    weights: Sequence[float],
    compression: Compression,
    aggregation: Aggregation = Aggregation(),
    bounds: Sequence[float | None] | None = None,
    num_parts: int | None = None,
) -> tuple[Tensor, dict[int, str]]:
    """`all_reduce_in_memory`, plus the exclusions every member would learn: member index ->
    why (as `AllReduceResult.excluded` words it)."""
    if not contributions or len(contributions) != len(weights):
        raise ValueError("all_reduce_in_memory needs one weight per contribution")
    numel = contributions[0].numel()
    if any(c.dim() != 1 or c.numel() != numel for c in contributions):
        raise ValueError("contributions must be 1-D tensors of the same length")
    check_bounds(bounds, len(contributions))
    weights = [float(w) for w in weights]
    num_parts = len(contributions) if num_parts is None else num_parts
    if not 1 <= num_parts <= len(contributions):
        raise ValueError(f"num_parts must be in [1, {len(contributions)}], got {num_parts}")
    averaged: list[Tensor] = []
    by_part: dict[int, dict[int, Reason]] = {}
    chunked = [torch.tensor_split(c, chunk_count(numel)) for c in contributions]
    for chunks in zip(*chunked, strict=True):
        split = [torch.tensor_split(chunk, num_parts) for chunk in chunks]
        for j, size in enumerate(part_sizes(chunks[0].numel(), num_parts)):
            received = [decode(encode(parts[j], compression), size, compression) for parts in split]
            try:
                answer, _ = answer_part(received, weights, bounds, aggregation, compression, size)
                claims, average = unpack_answer(
                    answer, bounds, aggregation, compression, members=len(split), numel=size
                )
            except AllReduceFailed as e:
                raise AllReduceFailed(f"part {j}: {e}") from None
            for member, reason in claims.items():
                by_part.setdefault(j, {}).setdefault(member, reason)
            averaged.append(average)
    return torch.cat(averaged), describe_exclusions(by_part)


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    return await read_frame(reader, max_bytes, AllReduceFailed)


def _framed(data: bytes) -> int:
    """Bytes `data` takes on the stream as one frame: the length prefix, then the data."""
    return P2P.HEADER_LEN + len(data)


def key_tag(key: str) -> bytes:
    """8 bytes that name a round key in part headers."""
    return hashlib.sha256(key.encode()).digest()[:8]


def _consume(future: asyncio.Future[object]) -> None:
    """Read a finished future's exception, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _short(peer: str) -> str:
    return peer[-6:]


def _refusal(sender: str, error: Exception) -> bytes:
    """The answer to a part that failed: b"ER" + a short reason."""
    logger.debug("part from %s refused: %s", _short(sender), error)
    return _ERROR + f"{type(error).__name__}: {error}".encode()[:_MAX_REASON_BYTES]


class _Round:
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
        self.sizes = part_sizes(numel, len(self.reducers))
        self.deadline = loop.time() + timeout_s
        self.claimed: set[str] = (
            set()
        )  # senders whose part stream was accepted (duplicates refused)
        self.received: dict[str, Tensor | Exclusion] = {}
        self._reduction: asyncio.Future[None] | None = None  # referenced while it runs
        self.result: asyncio.Future[bytes] = loop.create_future()
        self.result.add_done_callback(_consume)
        # frames of this round's streams, both ends, both roles (a reducer's answer is counted
        # just before it is written, so `traffic` waits for every accepted part's answer)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._unanswered = 0
        self._all_answered = asyncio.Event()
        self._all_answered.set()

    @property
    def tag(self) -> str:
        return f"[{_short(self.me)} round={self.key}]"

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
        if len(self.received) < len(self.members) or self.result.done():
            return
        received = [self.received.pop(m) for m in self.members]
        self._reduction = asyncio.ensure_future(self._reduce(received))

    async def _reduce(self, received: list[Tensor | Exclusion]) -> None:
        """Screen, aggregate and serialize the answer once, for all, in a worker thread: robust
        methods take up to ~1 s for 16 parts of 4M floats (bench/robust_aggregation.py), which
        must not stall the loop's other streams (torch releases the GIL)."""
        try:
            answer, excluded = await asyncio.to_thread(
                answer_part,
                received,
                self.weights,
                self.bounds,
                self.aggregation,
                self.compression,
                self.sizes[self.part],
            )
        except AllReduceFailed as e:
            self.fail(str(e))
            return
        except Exception as e:  # a bug here must fail the round now, not at its timeout
            logger.exception("%s reducing part %s failed", self.tag, self.my_part)
            self.fail(f"{type(e).__name__}: {e}")
            return
        if excluded:  # the details stay here; the answer carries only the reason codes
            details = "; ".join(f"{_short(self.members[i])}: {e}" for i, e in excluded.items())
            logger.warning("%s part %s excluded %s", self.tag, self.my_part, details)
        if not self.result.done():  # the round may have failed meanwhile
            self.result.set_result(answer)


@dataclass(frozen=True)
class AllReduceResult:
    """What one member got from a round of `PartExchange.all_reduce`."""

    average: Tensor
    """1-D fp32, the same bits on every member."""
    bytes_sent: int
    """Frames (8-byte length prefix + payload) this peer wrote to the round's part streams."""
    bytes_received: int
    """Frames this peer read from them."""
    excluded: dict[str, str]
    """Member peer id -> why some reducer left its part out (e.g. "non-finite (parts 0, 2)"),
    the same on every member. Each part's reducer claims its own exclusions: the part index
    names the accuser (members[j] reduces part j)."""
    accusations: dict[str, int] = field(default_factory=dict)
    """Member peer id -> how many parts' reducers excluded it (a member banned on the word of
    most reducers, not of one, which may be hostile)."""


class PartExchange:
    """Serves my parts as a reducer and runs rounds as a member; lives in one asyncio loop.

    One instance per `GroupAverager`, on a P2P replica of the DHT's daemon (same peer id).
    Every member of a group must use the same `compression` and `aggregation`: a member checks
    each answer against the bound of its own aggregation method.
    """

    def __init__(
        self,
        p2p: P2P,
        prefix: str,
        compression: Compression,
        aggregation: Aggregation = Aggregation(),
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if not isinstance(aggregation, Aggregation):
            raise ValueError(f"aggregation must be an Aggregation, got {aggregation!r}")
        self._p2p, self._compression, self._aggregation = p2p, compression, aggregation
        self.handler_name = f"{prefix}-part"
        self._me = p2p.peer_id.to_base58()
        self._rounds: dict[bytes, _Round] = {}
        # parts that arrived before their round started here wait on these, by round digest
        self._round_started: dict[bytes, asyncio.Event] = {}
        self._pending_keys: dict[bytes, bytes] = {}  # digest -> key tag, for those parts
        # keys whose matchmaking is over here (insertion-ordered, oldest dropped first): a part
        # for an unknown round of such a key is refused at once instead of waiting in vain
        self._closed_keys: dict[bytes, None] = {}
        self._serving: set[asyncio.Task[None]] = set()

    async def start(self, timeout_s: float) -> None:
        await asyncio.wait_for(
            self._p2p.add_binary_stream_handler(self.handler_name, self._handle_stream), timeout_s
        )

    async def stop(self, grace_s: float) -> None:
        """Stop accepting parts; let answers already being sent finish for up to `grace_s`."""
        try:
            await asyncio.wait_for(
                self._p2p.remove_binary_stream_handler(self.handler_name), grace_s
            )
        except _P2P_ERRORS as e:
            logger.debug("removing handler %s failed: %r", self.handler_name, e)
        if self._serving:
            await asyncio.wait(set(self._serving), timeout=grace_s)

    # ------------------------------------------------------------------ member side

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
        for digest, pending_tag in list(self._pending_keys.items()):
            if pending_tag == tag and digest not in self._rounds:
                self._pending_keys.pop(digest)
                self._round_started.pop(digest).set()  # the waiter wakes and finds no round

    async def all_reduce(
        self,
        *,
        key: str,
        digest: bytes,
        members: Sequence[str],
        weights: Sequence[float],
        flat: Tensor,
        allreduce_timeout_s: float,
        bounds: Sequence[float | None] | None = None,
        reducers: Sequence[str] | None = None,
    ) -> AllReduceResult:
        """Average `flat` (1-D fp32) with the group; the same bits on every member, or raise.

        `members` (sorted), `weights` and `bounds` (same order), `reducers` (the members that
        accept connections, in the same order; default all) and `digest` must be what every
        member agreed on at matchmaking; a member whose view differs sends parts no reducer
        accepts, or checks answers differently. `bounds[i]` is member i's declared L2 norm of
        its whole `flat`, or any larger number such as its δ's norm before pruning (None: not
        checked); the caller validates them (ValueError for a negative or NaN one). Raises
        AllReduceFailed if any part fails or the round outlives `allreduce_timeout_s`. The
        result counts the bytes of this round's part streams only (see the module docstring).

        A long vector goes as `chunk_count(numel)` chunks, each a sub-round of its own (digest
        sha256(digest + chunk index)), all at once: a reducer answers a chunk's part as soon
        as that chunk is in, while the members still send the next chunks (see chunk_count).
        """
        check_bounds(bounds, len(members))
        chunks = torch.tensor_split(flat, chunk_count(flat.numel()))
        rounds = []
        for c, chunk in enumerate(chunks):
            sub_digest = (
                digest
                if len(chunks) == 1
                else hashlib.sha256(digest + c.to_bytes(4, "big")).digest()
            )
            rnd = _Round(
                key=key,
                digest=sub_digest,
                members=members,
                me=self._me,
                weights=weights,
                compression=self._compression,
                numel=chunk.numel(),
                timeout_s=allreduce_timeout_s,
                aggregation=self._aggregation,
                bounds=bounds,
                reducers=reducers,
            )
            rounds.append(rnd)
        for rnd in rounds:  # every sub-round is known before the key closes (close_key)
            self._rounds[rnd.digest] = rnd
            self._pending_keys.pop(rnd.digest, None)
            started = self._round_started.pop(rnd.digest, None)
            if started is not None:
                started.set()  # parts that came before the round started here
        self.close_key(key)
        sends: list[tuple[_Round, int, asyncio.Task[tuple[dict[int, Reason], Tensor]]]] = []
        try:
            for rnd, chunk in zip(rounds, chunks, strict=True):
                parts = torch.tensor_split(chunk, len(rnd.reducers))
                for j, reducer in enumerate(rnd.reducers):
                    if reducer == self._me:
                        # my own part of my own contribution: the same encode/decode path
                        mine = decode(
                            encode(parts[j], self._compression), rnd.sizes[j], self._compression
                        )
                        rnd.claimed.add(reducer)
                        rnd.deliver(reducer, mine)
                        task = asyncio.ensure_future(self._own_result(rnd))
                    else:
                        task = asyncio.ensure_future(self._send_part(rnd, j, parts[j]))
                    # a task cancelled as its wait_for completes may still end with an exception
                    task.add_done_callback(_consume)
                    sends.append((rnd, j, task))
            done, pending = await asyncio.wait(
                [task for _, _, task in sends],
                timeout=rounds[0].remaining_s(),
                return_when=asyncio.FIRST_EXCEPTION,
            )
            for task in done:
                if task.exception() is not None:
                    raise AllReduceFailed(f"{rounds[0].tag} {task.exception()}")
            if pending:
                late = sorted(
                    {f"{j} ({_short(rnd.reducers[j])})" for rnd, j, t in sends if t in pending}
                )
                raise AllReduceFailed(
                    f"{rounds[0].tag} timed out after {allreduce_timeout_s} s; no average yet "
                    f"of parts {late}"
                )
            bytes_sent = bytes_received = 0
            for rnd in rounds:
                sent, received = await rnd.traffic(max(rnd.remaining_s(), 1.0))
                bytes_sent, bytes_received = bytes_sent + sent, bytes_received + received
        except BaseException as e:
            for rnd in rounds:
                rnd.fail(f"round aborted on its reducer: {e}")
            raise
        finally:
            for _, _, task in sends:
                task.cancel()
            loop = asyncio.get_running_loop()
            for rnd in rounds:
                loop.call_later(_CLOSED_ROUND_RETAIN_S, self._forget, rnd.digest)
        # part j of every chunk has the same reducer: its claims are merged, so that the
        # accusations count reducers (as without chunks), not chunks
        by_reducer: dict[int, dict[int, Reason]] = {}
        for _, j, task in sends:
            for member, reason in task.result()[0].items():
                by_reducer.setdefault(j, {}).setdefault(member, reason)
        described = describe_exclusions(by_reducer)
        members = rounds[0].members
        return AllReduceResult(
            average=torch.cat([task.result()[1] for _, _, task in sends]),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            excluded={members[i]: why for i, why in described.items()},
            accusations={
                members[i]: sum(i in claims for claims in by_reducer.values()) for i in described
            },
        )

    def _read_answer(self, rnd: _Round, j: int, body: bytes) -> tuple[dict[int, Reason], Tensor]:
        """Part j's exclusions and decoded average, checked (robust.unpack_answer)."""
        try:
            return unpack_answer(
                body,
                rnd.bounds,
                self._aggregation,
                self._compression,
                members=len(rnd.members),
                numel=rnd.sizes[j],
            )
        except AllReduceFailed as e:
            reducer = _short(rnd.reducers[j])
            raise AllReduceFailed(f"part {j}: reducer {reducer} answered badly: {e}") from None

    def _forget(self, digest: bytes) -> None:
        self._rounds.pop(digest, None)

    async def _own_result(self, rnd: _Round) -> tuple[dict[int, Reason], Tensor]:
        try:
            body = await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())
        except asyncio.TimeoutError:
            missing = [_short(m) for m in rnd.members if m not in rnd.claimed]
            raise AllReduceFailed(f"my part never received the parts of {missing}") from None
        return self._read_answer(rnd, rnd.part, body)  # as every member reads it

    async def _send_part(
        self, rnd: _Round, j: int, part: Tensor
    ) -> tuple[dict[int, Reason], Tensor]:
        reducer = rnd.reducers[j]
        header = _PART_HEADER.pack(
            _MAGIC,
            _PROTOCOL_VERSION,
            rnd.digest,
            key_tag(rnd.key),
            j,
            CODEC_ID[self._compression],
            rnd.weights[rnd.my_index],
            rnd.sizes[j],
            rnd.remaining_s(),
        )
        payload = encode(part, self._compression)
        try:
            response = await asyncio.wait_for(
                self._exchange(rnd, PeerID.from_base58(reducer), header, payload),
                rnd.remaining_s(),
            )
        except AllReduceFailed as e:
            raise AllReduceFailed(f"part {j} (reducer {_short(reducer)}): {e}") from None
        except _P2P_ERRORS as e:
            raise AllReduceFailed(
                f"part {j} (reducer {_short(reducer)}): {type(e).__name__}: {e}"
            ) from None
        status, body = response[:2], response[2:]
        if status == _ERROR:
            reason = body.decode("utf-8", errors="replace")
            raise AllReduceFailed(f"part {j}: reducer {_short(reducer)} refused: {reason}")
        if status != _OK:
            raise AllReduceFailed(f"part {j}: malformed answer from reducer {_short(reducer)}")
        return self._read_answer(rnd, j, body)  # checked now: a bad answer fails the round now

    async def _exchange(self, rnd: _Round, reducer: PeerID, header: bytes, payload: bytes) -> bytes:
        """Open a stream, send header and part, read the answer (the caller bounds the time)."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(reducer, self.handler_name)
        try:
            rnd.bytes_sent += _framed(header)
            await P2P.send_raw_data(header, writer)
            rnd.bytes_sent += _framed(payload)
            await P2P.send_raw_data(payload, writer)
            most = answer_size(len(rnd.members), len(payload))  # the average: as long as my part
            response = await _read_frame(reader, 2 + max(most, _MAX_REASON_BYTES))
            rnd.bytes_received += _framed(response)
            return response
        finally:
            writer.close()

    # ------------------------------------------------------------------ reducer side

    async def _handle_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        sender = info.peer_id.to_base58()  # authenticated by libp2p, unlike anything in the header
        try:
            await self._serve_part(sender, reader, writer)
            # Close only once the member has read the answer and closed its end (or after a
            # while): closing right after the last write sometimes cut the answer short on the
            # member's side (IncompleteReadError seen under load, 6 peers on 2 cores).
            await asyncio.wait_for(reader.read(1), _ANSWER_LINGER_S)
        except asyncio.TimeoutError:
            logger.debug(
                "%s kept the answer stream open past %.0f s", _short(sender), _ANSWER_LINGER_S
            )
        except _P2P_ERRORS as e:
            logger.debug("answer to %s not delivered: %r", _short(sender), e)
        finally:
            writer.close()
            if task is not None:
                self._serving.discard(task)

    async def _serve_part(
        self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Accept a member's part, reduce it, answer with the average or the reason it failed."""
        try:
            rnd = await self._claim_part(sender, reader)
        except (AllReduceFailed, *_P2P_ERRORS) as e:
            # refused before joining a round: this stream counts for none
            await asyncio.wait_for(
                P2P.send_raw_data(_refusal(sender, e), writer), _HEADER_TIMEOUT_S
            )
            return
        reply_timeout_s = _HEADER_TIMEOUT_S
        try:
            try:
                response = _OK + await self._reduce_part(rnd, sender, reader)
                reply_timeout_s = max(rnd.remaining_s(), 1.0)
            except (AllReduceFailed, *_P2P_ERRORS) as e:
                response = _refusal(sender, e)
            # counted before it is written (send_raw_data hands the whole frame to the stream
            # before it first waits): the round's counts need not wait for slow receivers
            rnd.bytes_sent += _framed(response)
        finally:
            rnd.answered()
        await asyncio.wait_for(P2P.send_raw_data(response, writer), reply_timeout_s)

    async def _find_round(self, digest: bytes, tag: bytes, wait_s: float) -> _Round:
        rnd = self._rounds.get(digest)
        if rnd is not None:
            return rnd
        if tag in self._closed_keys:
            raise AllReduceFailed("this peer is in no such group (its matchmaking ended otherwise)")
        started = self._round_started.get(digest)
        if started is None:
            if len(self._round_started) >= _MAX_PENDING_ROUNDS:
                raise AllReduceFailed("too many parts for rounds this peer has not started")
            started = self._round_started[digest] = asyncio.Event()
            self._pending_keys[digest] = tag
        try:
            await asyncio.wait_for(started.wait(), wait_s)
        except asyncio.TimeoutError:
            if self._round_started.get(digest) is started:  # nobody started it: drop the entry
                self._round_started.pop(digest)
                self._pending_keys.pop(digest, None)
            raise AllReduceFailed(
                f"no round {digest.hex()[:12]} here after {wait_s:.1f} s"
            ) from None
        rnd = self._rounds.get(digest)
        if rnd is None:
            raise AllReduceFailed("this peer is in no such group (its matchmaking ended otherwise)")
        return rnd

    async def _claim_part(self, sender: str, reader: asyncio.StreamReader) -> _Round:
        """Read a part's header and accept the stream into its round, or raise AllReduceFailed."""
        raw = await asyncio.wait_for(_read_frame(reader, _PART_HEADER.size), _HEADER_TIMEOUT_S)
        if len(raw) != _PART_HEADER.size:
            raise AllReduceFailed(f"part header of {len(raw)} bytes, expected {_PART_HEADER.size}")
        magic, version, digest, tag, index, codec, weight, numel, timeout_s = _PART_HEADER.unpack(
            raw
        )
        if magic != _MAGIC or version != _PROTOCOL_VERSION:
            raise AllReduceFailed(f"unknown part protocol {magic!r} v{version}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise AllReduceFailed(f"bad timeout {timeout_s} in part header")
        rnd = await self._find_round(digest, tag, min(timeout_s, _UNKNOWN_ROUND_WAIT_S))
        # checks against the agreed plan; the sender is the authenticated stream peer
        if sender not in rnd.members or sender == self._me:
            raise AllReduceFailed(f"{_short(sender)} is not a member of round {rnd.key}")
        if index != rnd.part:
            raise AllReduceFailed(f"I reduce part {rnd.part}, not part {index}")
        if codec != CODEC_ID[rnd.compression]:
            raise AllReduceFailed(f"codec {codec} differs from mine ({rnd.compression})")
        if numel != rnd.sizes[index]:
            raise AllReduceFailed(f"part of {numel} elements, expected {rnd.sizes[index]}")
        if weight != rnd.weights[rnd.members.index(sender)]:
            raise AllReduceFailed(f"weight {weight} differs from the one agreed at matchmaking")
        if sender in rnd.claimed:
            raise AllReduceFailed(f"duplicate part from {_short(sender)}")
        if rnd.result.done():
            raise AllReduceFailed("round is already over on its reducer")
        rnd.accept(sender, _framed(raw))
        return rnd

    async def _reduce_part(self, rnd: _Round, sender: str, reader: asyncio.StreamReader) -> bytes:
        """Read an accepted member's part; return the round's answer once every part is in.

        A part that arrives whole but does not decode is excluded and its sender refused (an
        AllReduceFailed here); one that does not arrive whole fails the round.
        """
        numel = rnd.sizes[rnd.part]
        expected_bytes = encoded_size(numel, rnd.compression)
        try:
            payload = await asyncio.wait_for(_read_frame(reader, expected_bytes), rnd.remaining_s())
            rnd.bytes_received += _framed(payload)
        except (AllReduceFailed, *_P2P_ERRORS) as e:
            # a member's part is lost: the round cannot complete, so tell everyone now
            rnd.fail(f"the part of {_short(sender)} failed: {type(e).__name__}: {e}")
            raise
        try:
            part: Tensor | Exclusion = decode(payload, numel, rnd.compression)
        except AllReduceFailed as e:
            rnd.deliver(sender, Exclusion(Reason.MALFORMED, str(e)))
            raise AllReduceFailed(f"malformed part, excluded: {e}") from None
        rnd.deliver(sender, part)
        return await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())
