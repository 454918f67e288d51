"""Part exchange: the all-reduce of one group, with bit-identical results on every member.

Why not hivemind's `AllReduceRunner` (DESIGN.md §1): there each member adds a received delta to its
own tensor, so members end with different bits, and a part whose reducer fails is silently left
un-averaged. Here each part has exactly one reducer, which

1. receives that part of every member's flat fp32 vector (members sorted by base58 peer id,
   the vector cut into len(members) near-equal contiguous parts, member i reduces part i),
2. combines them with `reduce_part` in sorted member order,
3. serializes the average ONCE and returns those same bytes to every member, itself included,

so every member decodes identical bytes into identical tensors. Any part that fails or times out
fails the whole round on every member that needs it: no partial result is ever returned.

Wire protocol, one libp2p stream per (sender, part) on the handler `<prefix>-part`, each message
framed as hivemind's `P2P.send_raw_data` does (8-byte big-endian length, then the payload):

    sender  -> reducer : _PART_HEADER (fixed struct, below)
    sender  -> reducer : the part, `numel` values encoded by compression.py's codec (fp32, fp16,
                         int8 or int4 blockwise; the header names it, every member uses the same)
    reducer -> sender  : b"OK" + the averaged part (same encoding)  |  b"ER" + utf-8 reason

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
from dataclasses import dataclass

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
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p_service import STREAM_ERRORS

logger = logging.getLogger(__name__)

# magic, protocol version, round digest (sha256), key tag (sha256 of the round key, cut), part
# index, codec id, weight, numel, sender's all-reduce timeout (so a reducer that has not started
# the round yet knows how long to wait)
_PART_HEADER = struct.Struct("<4sB32s8sIBdQd")
_MAGIC = b"DLCP"
_PROTOCOL_VERSION = 1

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


def reduce_part(parts: list[Tensor], weights: list[float]) -> Tensor:
    """Combine one part of every member: Σ_j w_j x_j / Σ_j w_j, summed in the order given.

    The hook for robust aggregation (DESIGN.md §4: clipping around the median, trimmed mean):
    anything that maps the members' parts (each 1-D fp32, same length, in sorted member order)
    and their weights to one 1-D fp32 tensor can replace it. Only the reducer runs it, so it need
    not be bit-reproducible across machines, only free of NaN.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError(f"reduce_part needs one weight per part, got {len(parts)}, {len(weights)}")
    total = math.fsum(weights)
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights, strict=True):
        acc.add_(part, alpha=weight)
    return acc.div_(total)


def part_sizes(numel: int, num_parts: int) -> list[int]:
    """Sizes of `num_parts` near-equal contiguous parts, larger ones first (torch.tensor_split)."""
    base, extra = divmod(numel, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def all_reduce_in_memory(
    contributions: Sequence[Tensor], weights: Sequence[float], compression: Compression
) -> Tensor:
    """What `PartExchange.all_reduce` returns on every member, computed in one process.

    `contributions` are the members' flat fp32 vectors in sorted member order. Each is cut into
    parts as the network round cuts it, each part encoded and decoded (the sender's bytes), the
    parts reduced with `reduce_part`, each average encoded and decoded once (the reducer's bytes):
    the same calls in the same order, so the same bits. Raises AllReduceFailed where a reducer
    would refuse (a non-finite average).
    """
    if not contributions or len(contributions) != len(weights):
        raise ValueError("all_reduce_in_memory needs one weight per contribution")
    numel = contributions[0].numel()
    if any(c.dim() != 1 or c.numel() != numel for c in contributions):
        raise ValueError("contributions must be 1-D tensors of the same length")
    split = [torch.tensor_split(c, len(contributions)) for c in contributions]
    averaged = []
    for j, size in enumerate(part_sizes(numel, len(contributions))):
        received = [decode(encode(parts[j], compression), size, compression) for parts in split]
        average = reduce_part(received, [float(w) for w in weights])
        if not bool(torch.isfinite(average).all()):
            raise AllReduceFailed(f"part {j}: the reduced part is not finite")
        averaged.append(decode(encode(average, compression), size, compression))
    return torch.cat(averaged)


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """One `P2P.send_raw_data` frame, refusing one longer than `max_bytes` before reading it."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise AllReduceFailed(f"frame of {length} bytes exceeds the expected {max_bytes}")
    return await reader.readexactly(length)


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
    ) -> None:
        loop = asyncio.get_running_loop()
        self.key, self.digest, self.compression = key, digest, compression
        self.members = list(members)
        self.weights = [float(w) for w in weights]
        self.me = me
        self.my_index = self.members.index(me)
        self.sizes = part_sizes(numel, len(self.members))
        self.deadline = loop.time() + timeout_s
        self.claimed: set[str] = (
            set()
        )  # senders whose part stream was accepted (duplicates refused)
        self.received: dict[str, Tensor] = {}
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

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def fail(self, reason: str) -> None:
        if not self.result.done():
            self.result.set_exception(AllReduceFailed(f"part {self.my_index}: {reason}"))

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

    def deliver(self, sender: str, part: Tensor) -> None:
        """Store a member's part; the last one in triggers the reduction (in sorted order)."""
        self.received[sender] = part
        if len(self.received) < len(self.members) or self.result.done():
            return
        average = reduce_part([self.received[m] for m in self.members], self.weights)
        if not bool(torch.isfinite(average).all()):
            self.fail("the reduced part is not finite")
            return
        self.result.set_result(encode(average, self.compression))  # serialized once, for all
        self.received.clear()  # the inputs are no longer needed


@dataclass(frozen=True)
class AllReduceResult:
    """What one member got from a round of `PartExchange.all_reduce`."""

    average: Tensor
    """1-D fp32, the same bits on every member."""
    bytes_sent: int
    """Frames (8-byte length prefix + payload) this peer wrote to the round's part streams."""
    bytes_received: int
    """Frames this peer read from them."""


class PartExchange:
    """Serves my parts as a reducer and runs rounds as a member; lives in one asyncio loop.

    One instance per `GroupAverager`, on a P2P replica of the DHT's daemon (same peer id).
    """

    def __init__(self, p2p: P2P, prefix: str, compression: Compression) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self._p2p, self._compression = p2p, compression
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
    ) -> AllReduceResult:
        """Average `flat` (1-D fp32) with the group; the same bits on every member, or raise.

        `members` (sorted), `weights` (same order) and `digest` must be what every member agreed
        on at matchmaking; a member whose view differs sends parts no reducer accepts.
        Raises AllReduceFailed if any part fails or the round outlives `allreduce_timeout_s`.
        The result counts the bytes of this round's part streams only (see the module docstring).
        """
        rnd = _Round(
            key=key,
            digest=digest,
            members=members,
            me=self._me,
            weights=weights,
            compression=self._compression,
            numel=flat.numel(),
            timeout_s=allreduce_timeout_s,
        )
        self._rounds[digest] = rnd
        self._pending_keys.pop(digest, None)
        started = self._round_started.pop(digest, None)
        if started is not None:
            started.set()  # parts that came before the round started here
        self.close_key(key)
        parts = torch.tensor_split(flat, len(rnd.members))
        sends: list[asyncio.Task[bytes]] = []
        try:
            for j, member in enumerate(rnd.members):
                if member == self._me:
                    # my own part of my own contribution: through the same encode/decode path
                    mine = decode(
                        encode(parts[j], self._compression), rnd.sizes[j], self._compression
                    )
                    rnd.claimed.add(member)
                    rnd.deliver(member, mine)
                    sends.append(asyncio.ensure_future(self._own_result(rnd)))
                else:
                    sends.append(asyncio.ensure_future(self._send_part(rnd, j, parts[j])))
                # a task cancelled as its wait_for completes may still end with an exception
                sends[-1].add_done_callback(_consume)
            done, pending = await asyncio.wait(
                sends, timeout=rnd.remaining_s(), return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                if task.exception() is not None:
                    raise AllReduceFailed(f"{rnd.tag} {task.exception()}")
            if pending:
                late = [
                    f"{j} ({_short(rnd.members[j])})" for j, t in enumerate(sends) if t in pending
                ]
                raise AllReduceFailed(
                    f"{rnd.tag} timed out after {allreduce_timeout_s} s; no average yet of parts {late}"
                )
            averaged = [task.result() for task in sends]
            bytes_sent, bytes_received = await rnd.traffic(max(rnd.remaining_s(), 1.0))
        except BaseException as e:
            rnd.fail(f"round aborted on its reducer: {e}")
            raise
        finally:
            for task in sends:
                task.cancel()
            loop = asyncio.get_running_loop()
            loop.call_later(_CLOSED_ROUND_RETAIN_S, self._forget, digest)
        average = torch.cat(
            [
                decode(data, size, self._compression)
                for data, size in zip(averaged, rnd.sizes, strict=True)
            ]
        )
        return AllReduceResult(average, bytes_sent, bytes_received)

    def _forget(self, digest: bytes) -> None:
        self._rounds.pop(digest, None)

    async def _own_result(self, rnd: _Round) -> bytes:
        try:
            return await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())
        except asyncio.TimeoutError:
            missing = [_short(m) for m in rnd.members if m not in rnd.claimed]
            raise AllReduceFailed(f"my part never received the parts of {missing}") from None

    async def _send_part(self, rnd: _Round, j: int, part: Tensor) -> bytes:
        reducer = rnd.members[j]
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
        if status != _OK or len(body) != len(payload):
            raise AllReduceFailed(f"part {j}: malformed answer from reducer {_short(reducer)}")
        return body

    async def _exchange(self, rnd: _Round, reducer: PeerID, header: bytes, payload: bytes) -> bytes:
        """Open a stream, send header and part, read the answer (the caller bounds the time)."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(reducer, self.handler_name)
        try:
            rnd.bytes_sent += _framed(header)
            await P2P.send_raw_data(header, writer)
            rnd.bytes_sent += _framed(payload)
            await P2P.send_raw_data(payload, writer)
            response = await _read_frame(reader, 2 + max(len(payload), _MAX_REASON_BYTES))
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
        if index != rnd.my_index:
            raise AllReduceFailed(f"I reduce part {rnd.my_index}, not part {index}")
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
        """Read an accepted member's part; return the round's average once every part is in."""
        numel = rnd.sizes[rnd.my_index]
        expected_bytes = encoded_size(numel, rnd.compression)
        try:
            payload = await asyncio.wait_for(_read_frame(reader, expected_bytes), rnd.remaining_s())
            rnd.bytes_received += _framed(payload)
            part = decode(payload, numel, rnd.compression)
            if not bool(torch.isfinite(part).all()):
                raise AllReduceFailed("part is not finite")
        except (AllReduceFailed, *_P2P_ERRORS) as e:
            # a member's part is lost: the round cannot complete, so tell everyone now
            rnd.fail(f"the part of {_short(sender)} failed: {type(e).__name__}: {e}")
            raise
        rnd.deliver(sender, part)
        return await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())
