"""Part exchange: the all-reduce of one group, with bit-identical results on every member.

Why not hivemind's `AllReduceRunner` (DESIGN.md §1): there each member adds a received delta to its
own tensor, so members end with different bits, and a part whose reducer fails is silently left
un-averaged. Here each part has exactly one reducer, which

1. receives that part of every member's flat fp32 vector (members sorted by base58 peer id;
   the reducers are the members that accept connections, in the same order: the vector is cut
   into len(reducers) near-equal contiguous parts, reducer j reduces part j; a member in client
   mode, which nobody can dial, only sends its parts and reads the averages),
2. screens them and combines the rest in sorted member order (robust.py),
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
the sender of undecodable bytes a refusal. A part that never arrives whole still fails the round,
as a crashed member does; so does a part from which every member is excluded.

A long vector goes in chunks (`partition.chunk_count`), each chunk a sub-round of its own with
the steps above and its own digest, all at once: reducer j reduces part j of every chunk and
answers each as soon as that chunk's parts are in, so averages flow back while later chunks
still come in.

Lossy codecs lose precision twice: once on each member's part (the reducer decodes it before
reducing), once on the average (encoded once by the reducer, decoded by everyone).
`reference.all_reduce_in_memory` computes the same result in one process, for the simulator and
tests.

The jobs, one module each: `partition` (chunks, parts, digests), `wire` (the bytes on the
streams), `reducer` (the rounds this peer is in, and the parts it reduces), `member` (sending my
parts, reading the averages), `reference` (the in-memory all-reduce); `PartExchange`, here, ties
them to one stream handler of the process's P2P service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from diloco_peer.averaging.compression import COMPRESSIONS, Compression
from diloco_peer.averaging.member import AllReduceResult, PartSender
from diloco_peer.averaging.partition import chunk_count, chunk_digest
from diloco_peer.averaging.receipts import Sign
from diloco_peer.averaging.reducer import PartReducer, Round
from diloco_peer.averaging.robust import Aggregation, check_bounds
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S, HandlerServer
from diloco_peer.p2p.service import P2PService

_SERVICE_READY_TIMEOUT_S = 60.0
"""How long registering the handler waits for the service's replica (its own setup is bounded
too)."""
_SHUTDOWN_GRACE_S = 3.0
"""How long shutdown lets answers to other members' parts finish being sent."""

SETUP_TIMEOUT_S = _SERVICE_READY_TIMEOUT_S + HANDLER_CALL_TIMEOUT_S
"""The longest `start` takes to serve: the service's replica, then the handler."""


def _chunks(
    flat: Tensor, reference: Tensor | None
) -> tuple[tuple[Tensor, ...], Sequence[Tensor | None]]:
    """`flat` in its chunks (`chunk_count`), and `reference` (as long as `flat`: what my
    reducer's direction screen takes out of every member's part, robust.screen_parts) in the
    same chunks; ValueError if its length differs."""
    chunks = torch.tensor_split(flat, chunk_count(flat.numel()))
    if reference is None:
        return chunks, [None] * len(chunks)
    if reference.shape != flat.shape:
        raise ValueError(f"reference has shape {tuple(reference.shape)}, not {tuple(flat.shape)}")
    return chunks, torch.tensor_split(reference, len(chunks))


class PartExchange(HandlerServer):
    """Serves my parts as a reducer and runs rounds as a member, on the service's loop.

    One instance per `GroupAverager`, on the process's P2PService (a replica of the DHT's
    daemon, same peer id). Every member of a group must use the same `compression` and
    `aggregation`: a member checks each answer against the bound of its own aggregation method.
    `allow` (a private swarm's allowlist) refuses part streams of other keys before reading them.
    `sign` (this peer's `Identity.sign`) signs the receipt of every answer its reducer sends
    (receipts.py); without it answers go unsigned, which members holding keys refuse.

        exchange = PartExchange(service, "run1", "int8")
        exchange.start()
        exchange.wait_until_ready(timeout_s=30)      # or, in the loop: await exchange.ready(30)
        result = await exchange.all_reduce(...)      # in the service's loop
        exchange.shutdown()                          # answers being sent get a grace period
    """

    _shutdown_s = HANDLER_CALL_TIMEOUT_S + _SHUTDOWN_GRACE_S + 1.0
    """Removing the handler, then letting answers being sent finish."""

    def __init__(
        self,
        service: P2PService,
        prefix: str,
        compression: Compression,
        aggregation: Aggregation = Aggregation(),
        allow: Callable[[str], bool] = lambda peer: True,
        sign: Sign | None = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if not isinstance(aggregation, Aggregation):
            raise ValueError(f"aggregation must be an Aggregation, got {aggregation!r}")
        super().__init__(service)
        self._compression, self._aggregation, self._sign = compression, aggregation, sign
        self._handler_name = f"{prefix}-part"
        self._reducer = PartReducer(allow=allow)  # strangers are refused before they are read
        self._serving: set[asyncio.Task[Any]] = set()  # loop thread only

    @property
    def handler_name(self) -> str:
        return self._handler_name

    @property
    def me(self) -> str:
        """This peer's base58 id (once ready): the service's."""
        return self._service.peer_id

    # ------------------------------------------------------------------ lifecycle

    async def _register(self) -> None:
        await self._service.ready(_SERVICE_READY_TIMEOUT_S)
        await super()._register()

    async def _unregister(self) -> None:
        """Stop accepting parts; let answers already being sent finish for a moment."""
        await super()._unregister()
        if self._serving:
            await asyncio.wait(set(self._serving), timeout=_SHUTDOWN_GRACE_S)

    async def _handle(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._serving.add(task)
        try:
            # the sender is the libp2p-authenticated peer id, unlike anything in the header
            await self._reducer.serve(info.peer_id.to_base58(), reader, writer)
        finally:
            if task is not None:
                self._serving.discard(task)

    # ------------------------------------------------------------------ rounds

    def open_key(self, key: str) -> None:
        """Matchmaking for `key` begins: parts of a group with this key may come (again)."""
        self._reducer.open_key(key)

    def close_key(self, key: str) -> None:
        """Matchmaking for `key` is over here: refuse parts of any other group with this key,
        including those already waiting (this peer thinks it is in no group, or in another)."""
        self._reducer.close_key(key)

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
        keys: Sequence[bytes] | None = None,
        withhold: bool = False,
        equivocate: bool = False,
        bias: bool = False,
        reference: Tensor | None = None,
    ) -> AllReduceResult:
        """Average `flat` (1-D fp32) with the group; the same bits on every member, or raise.

        `members` (sorted), `weights` and `bounds` (same order), `reducers` (the members that
        accept connections, in the same order; default all) and `digest` must be what every
        member agreed on at matchmaking; a member whose view differs sends parts no reducer
        accepts, or checks answers differently. `keys` (each reducer's public key, in part
        order): every answer's receipt must verify under its reducer's key (receipts.py). `bounds[i]` is member i's declared L2 norm of
        its whole `flat`, or any larger number such as its δ's norm before pruning (None: not
        checked); the caller validates them (ValueError for a negative or NaN one). Raises
        AllReduceFailed if any part fails or the round outlives `allreduce_timeout_s`. The
        result counts the bytes of this round's part streams only (reducer.py).

        A long vector goes as `chunk_count(numel)` chunks, each a sub-round of its own (digest
        `partition.chunk_digest`), all at once: a reducer answers a chunk's part as soon as
        that chunk is in, while the members still send the next chunks (see chunk_count).
        Runs in the service's loop, once the exchange is ready. `withhold` is a test-only
        fault: this peer is in the round (its reducer takes the others' parts) but sends none
        of its own, as a member patched never to send its parts; AllReduceFailed at the timeout.
        `equivocate` is another: my reducer answers one member (the first other, sorted) with
        other bytes, signed, as a reducer patched to fork its part (receipts.forge_answer);
        `bias`, a reducer answering a fixed direction within the bound (wire.answer_part).
        `reference`: `_chunks`.
        """
        check_bounds(bounds, len(members))
        chunks, shifts = _chunks(flat, reference)
        rounds = [
            Round(
                key=key,
                digest=chunk_digest(digest, c, len(chunks)),
                members=members,
                me=self.me,
                weights=weights,
                compression=self._compression,
                numel=chunk.numel(),
                timeout_s=allreduce_timeout_s,
                aggregation=self._aggregation,
                bounds=bounds,
                reducers=reducers,
                sign=self._sign,
                equivocate=equivocate,
                bias=bias,
                reference=shifts[c],
            )
            for c, chunk in enumerate(chunks)
        ]
        self._reducer.add(rounds)  # every sub-round is known before the key closes
        self._reducer.close_key(key)
        if withhold:
            try:
                await asyncio.sleep(allreduce_timeout_s)
                raise AllReduceFailed(f"{rounds[0].tag} withheld my parts (a test fault)")
            finally:
                for rnd in rounds:
                    rnd.fail("withheld")
                self._reducer.retire(rounds)
        sender = PartSender(
            self._service.p2p, self.handler_name, self._compression, self._aggregation, keys
        )
        try:
            return await sender.run(rounds, chunks, allreduce_timeout_s)
        finally:
            self._reducer.retire(rounds)


__all__ = ["AllReduceFailed", "AllReduceResult", "PartExchange"]
