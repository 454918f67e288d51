"""The member side of the part exchange (allreduce.py): send each part of my vector to its reducer,
read and check the averages, and put the round's result together.

Every part, of every chunk, goes at once on a stream of its own; my own part of each chunk goes
through the same encode/decode path, straight into my reducer's inbox. The round fails as soon
as any part fails, or when the all-reduce timeout runs out with an average still missing: no
partial result is ever returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID
from torch import Tensor

from diloco_peer.averaging.compression import CODEC_ID, Compression, decode, encode
from diloco_peer.averaging.partition import key_tag
from diloco_peer.averaging.receipts import Receipt, read_answer
from diloco_peer.averaging.reducer import EXCHANGE_ERRORS, Round, short_id, silent_members
from diloco_peer.averaging.robust import Aggregation, Reason, describe_exclusions
from diloco_peer.averaging.wire import (
    ERROR,
    OK,
    PartHeader,
    max_response_size,
    unpack_answer,
)
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.streams import consume, framed_size, read_frame

PartAnswer = tuple[dict[int, Reason], Tensor, Receipt]
"""A part's exclusions (member index -> reason), its decoded average, its reducer's receipt."""


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
    """Member peer id -> how many parts' reducers excluded it."""
    witnessed: dict[str, str] = field(default_factory=dict)
    """Member peer id -> why MY reducer left its part out (`robust.Reason.label`): what this
    peer saw itself on the member's authenticated stream, unlike the other reducers' word."""
    receipts: tuple[Receipt, ...] = ()
    """Every part's receipt, chunk then part order (checked when the round had keys): what
    this member shows the other reducers (echo.py)."""


@dataclass(frozen=True)
class _Send:
    """Part `part` of a chunk's round, on its way to its reducer and back."""

    rnd: Round
    part: int
    task: asyncio.Task[PartAnswer]


class PartSender:
    """Runs rounds as a member: my parts out on streams I open, the averages back.

    :param p2p: this peer's P2P replica (its peer id is every round's `me`).
    :param handler_name: the reducers' part handler.
    :param compression, aggregation: the group's, the same on every member: answers are
        checked against this aggregation's bound.
    :param keys: each reducer's public key, in part order: an answer whose receipt its reducer
        did not sign fails the round (receipts.py). None: receipts are not checked (no keys).
    """

    def __init__(
        self,
        p2p: P2P,
        handler_name: str,
        compression: Compression,
        aggregation: Aggregation,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        self._p2p, self._handler_name = p2p, handler_name
        self._compression, self._aggregation = compression, aggregation
        self._keys = keys

    async def run(
        self, rounds: Sequence[Round], chunks: Sequence[Tensor], allreduce_timeout_s: float
    ) -> AllReduceResult:
        """Each chunk's parts to their reducers, at once; the averages back, checked.

        `rounds[c]` is chunk c's sub-round, already known to this peer's reducer. Raises
        AllReduceFailed (and fails every round here, so that the members waiting on my parts
        learn it now) if any part fails or an average is missing after `allreduce_timeout_s`.
        """
        sends: list[_Send] = []
        try:
            self._send_all(rounds, chunks, sends)
            await _wait_for_answers(sends, rounds[0], allreduce_timeout_s)
            bytes_sent = bytes_received = 0
            for rnd in rounds:
                sent, received = await rnd.traffic(max(rnd.remaining_s(), 1.0))
                bytes_sent, bytes_received = bytes_sent + sent, bytes_received + received
        except BaseException as e:
            for rnd in rounds:
                rnd.fail(f"round aborted on its reducer: {e}")
            silent = silent_members(rounds, asyncio.get_running_loop().time())
            if isinstance(e, AllReduceFailed) and silent:
                names = ", ".join(short_id(m) for m in silent)
                raise AllReduceFailed(f"{e}; my reducer never got the parts of {names}",
                                      silent=silent) from None  # fmt: skip
            raise
        finally:
            for send in sends:
                send.task.cancel()
        return _result(sends, rounds[0], bytes_sent, bytes_received)

    def _send_all(
        self, rounds: Sequence[Round], chunks: Sequence[Tensor], sends: list[_Send]
    ) -> None:
        """Start every part's exchange (appended to `sends` as they start)."""
        for rnd, chunk in zip(rounds, chunks, strict=True):
            parts = torch.tensor_split(chunk, len(rnd.reducers))
            for j, reducer in enumerate(rnd.reducers):
                if reducer == rnd.me:
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
                task.add_done_callback(consume)
                sends.append(_Send(rnd, j, task))

    def _read_answer(self, rnd: Round, j: int, body: bytes) -> PartAnswer:
        """Part j's exclusions, decoded average and receipt, checked (receipts.read_answer,
        wire.unpack_answer)."""
        try:
            key = None if self._keys is None else self._keys[j]
            receipt, answer = read_answer(body, rnd.digest, j, key)
            excluded, average = unpack_answer(
                answer,
                rnd.bounds,
                self._aggregation,
                self._compression,
                members=len(rnd.members),
                numel=rnd.sizes[j],
            )
            return excluded, average, receipt
        except AllReduceFailed as e:
            reducer = short_id(rnd.reducers[j])
            raise AllReduceFailed(f"part {j}: reducer {reducer} answered badly: {e}") from None

    async def _own_result(self, rnd: Round) -> PartAnswer:
        try:
            body = await asyncio.wait_for(asyncio.shield(rnd.result), rnd.remaining_s())
        except asyncio.TimeoutError:
            missing = [short_id(m) for m in rnd.members if m not in rnd.claimed]
            raise AllReduceFailed(f"my part never received the parts of {missing}") from None
        return self._read_answer(rnd, rnd.part, body)  # as every member reads it

    async def _send_part(self, rnd: Round, j: int, part: Tensor) -> PartAnswer:
        reducer = rnd.reducers[j]
        header = PartHeader(
            digest=rnd.digest,
            key_tag=key_tag(rnd.key),
            part=j,
            codec=CODEC_ID[self._compression],
            weight=rnd.weights[rnd.my_index],
            numel=rnd.sizes[j],
            timeout_s=rnd.remaining_s(),
        )
        payload = encode(part, self._compression)
        try:
            response = await asyncio.wait_for(
                self._exchange(rnd, PeerID.from_base58(reducer), header.pack(), payload),
                rnd.remaining_s(),
            )
        except AllReduceFailed as e:
            raise AllReduceFailed(f"part {j} (reducer {short_id(reducer)}): {e}") from None
        except EXCHANGE_ERRORS as e:
            raise AllReduceFailed(
                f"part {j} (reducer {short_id(reducer)}): {type(e).__name__}: {e}"
            ) from None
        status, body = response[: len(OK)], response[len(OK) :]
        if status == ERROR:
            reason = body.decode("utf-8", errors="replace")
            raise AllReduceFailed(f"part {j}: reducer {short_id(reducer)} refused: {reason}")
        if status != OK:
            raise AllReduceFailed(f"part {j}: malformed answer from reducer {short_id(reducer)}")
        return self._read_answer(rnd, j, body)  # checked now: a bad answer fails the round now

    async def _exchange(self, rnd: Round, reducer: PeerID, header: bytes, payload: bytes) -> bytes:
        """Open a stream, send header and part, read the answer (the caller bounds the time)."""
        _, reader, writer = await self._p2p.call_binary_stream_handler(reducer, self._handler_name)
        try:
            rnd.bytes_sent += framed_size(header)
            await P2P.send_raw_data(header, writer)
            rnd.bytes_sent += framed_size(payload)
            await P2P.send_raw_data(payload, writer)
            most = max_response_size(len(rnd.members), len(payload))  # average: as long as my part
            response = await read_frame(reader, most, AllReduceFailed)
            rnd.bytes_received += framed_size(response)
            return response
        finally:
            writer.close()


async def _wait_for_answers(sends: list[_Send], first: Round, allreduce_timeout_s: float) -> None:
    """Until every part's average is in; AllReduceFailed at the first failure, or when the
    round's time is up."""
    done, pending = await asyncio.wait(
        [send.task for send in sends],
        timeout=first.remaining_s(),
        return_when=asyncio.FIRST_EXCEPTION,
    )
    for task in done:
        if task.exception() is not None:
            raise AllReduceFailed(f"{first.tag} {task.exception()}")
    if pending:
        late = sorted(
            {f"{s.part} ({short_id(s.rnd.reducers[s.part])})" for s in sends if s.task in pending}
        )
        raise AllReduceFailed(
            f"{first.tag} timed out after {allreduce_timeout_s} s; no average yet of parts {late}"
        )


def _result(
    sends: list[_Send], first: Round, bytes_sent: int, bytes_received: int
) -> AllReduceResult:
    """The round's result from every part's answer, in chunk then part order."""
    members = first.members
    # part j of every chunk has the same reducer: its claims are merged, so that the
    # accusations count reducers (as without chunks), not chunks
    by_reducer: dict[int, dict[int, Reason]] = {}
    for send in sends:
        for member, reason in send.task.result()[0].items():
            by_reducer.setdefault(send.part, {}).setdefault(member, reason)
    described = describe_exclusions(by_reducer)
    return AllReduceResult(
        average=torch.cat([send.task.result()[1] for send in sends]),
        bytes_sent=bytes_sent,
        bytes_received=bytes_received,
        excluded={members[i]: why for i, why in described.items()},
        receipts=tuple(send.task.result()[2] for send in sends),
        accusations={
            members[i]: sum(i in claims for claims in by_reducer.values()) for i in described
        },
        witnessed={
            members[i]: reason.label
            for i, reason in sorted(by_reducer.get(first.my_part, {}).items())
        }
        if first.my_part is not None
        else {},
    )
