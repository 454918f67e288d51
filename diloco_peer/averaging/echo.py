"""The receipt echo (receipts.py, step 2): once its answers are in, a member shows its receipts
to every other reducer of the round, and gets that reducer's receipts back, on one stream each
(`<prefix>-receipts`):

    member  -> reducer : ECHO_HEAD (magic, version, the round's digest)
    member  -> reducer : its receipts (receipts.pack_receipts), at most chunks × reducers
    reducer -> member  : OK + its own receipts | ER + utf-8 reason (wire.refusal)

The reducer answers once its own answers are in (bounded by its round's deadline), and compares
the member's receipts with its own: a contradiction there is reported (`on_proof`) but does not
fail its round. The member compares the reducer's receipts with its own and fails its round
unless the reducer confirmed every one (`ReceiptDesk.confirm`), reporting any proof: that rule
alone keeps two honest members from committing different averages (receipts.py, step 3).

A hostile peer is bounded: only a member of an open round is read, once per round; the list is
read only up to the round's count of receipts; each comparison checks a signature only where a
hash differs, at most once per slot; at most `_MAX_ROUNDS` rounds are remembered.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from diloco_peer.averaging.receipts import (
    Comparison,
    Proof,
    Receipt,
    compare,
    pack_receipts,
    receipts_size,
    unpack_receipts,
)
from diloco_peer.averaging.wire import ERROR, MAX_REASON_BYTES, OK, refusal
from diloco_peer.errors import AllReduceFailed
from diloco_peer.p2p.handler import HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, consume, linger, read_frame

logger = logging.getLogger(__name__)

ECHO_HEAD = struct.Struct("<4sB32s")
"""magic, protocol version, the round's digest (round_plan.RoundPlan.digest)."""
_MAGIC = b"DLCE"
_VERSION = 1
_HEAD_TIMEOUT_S = 10.0
"""How long a reducer waits for the head of an echo stream it did not open."""
_WRITE_TIMEOUT_S = 10.0
_RETAIN_S = 60.0
"""How long a finished round stays known, so that a late echo gets an answer."""
_MAX_ROUNDS = 16


def pack_head(digest: bytes) -> bytes:
    return ECHO_HEAD.pack(_MAGIC, _VERSION, digest)


def unpack_head(raw: bytes) -> bytes:
    """The round digest an echo names; AllReduceFailed unless it is one of this version."""
    if len(raw) != ECHO_HEAD.size:
        raise AllReduceFailed(f"an echo head of {len(raw)} bytes")
    magic, version, digest = ECHO_HEAD.unpack(raw)
    if magic != _MAGIC or version != _VERSION:
        raise AllReduceFailed(f"unknown echo protocol {magic!r} v{version}")
    return digest


@dataclass
class _Ledger:
    """One round's receipts as this member holds them, in the service's loop."""

    members: frozenset[str]
    reducers: tuple[tuple[str, bytes], ...]
    """(peer id, public key) of the reducer of each part."""
    count: int
    """Receipts every member holds: chunks × reducers."""
    deadline: float
    """Loop time at which the round's all-reduce time is up."""
    mine: asyncio.Future[tuple[Receipt, ...]]
    echoed: set[str] = field(default_factory=set)
    """Members whose echo was read (one each)."""


class ReceiptDesk(HandlerServer):
    """Both sides of the receipt echo for one GroupAverager, on the process's P2PService.

        desk.open(digest, members, reducers, count, deadline)   # as the all-reduce starts
        desk.settle(digest, receipts)                           # my answers are in, checked
        await desk.confirm(digest, me, receipts)                # AllReduceFailed unless agreed
        desk.close(digest)                                      # forgotten a while later

    :param on_proof: called in the loop thread with every contradiction found, verified
        (`receipts.Proof`), on either side; peer/trust.py bans on it.
    """

    def __init__(self, service: P2PService, prefix: str, on_proof: Callable[[Proof], None]) -> None:
        super().__init__(service)
        self._handler_name = f"{prefix}-receipts"
        self._on_proof = on_proof
        self._ledgers: dict[bytes, _Ledger] = {}  # loop thread only, oldest first

    @property
    def handler_name(self) -> str:
        return self._handler_name

    def open(
        self,
        digest: bytes,
        members: Sequence[str],
        reducers: Sequence[tuple[str, bytes]],
        count: int,
        deadline: float,
    ) -> None:
        """A round starts: echoes naming `digest` are read from now on (loop thread)."""
        while len(self._ledgers) >= _MAX_ROUNDS:
            self._ledgers.pop(next(iter(self._ledgers)))
        mine: asyncio.Future[tuple[Receipt, ...]] = asyncio.get_running_loop().create_future()
        mine.add_done_callback(consume)
        self._ledgers[digest] = _Ledger(frozenset(members), tuple(reducers), count, deadline, mine)

    def settle(self, digest: bytes, receipts: Sequence[Receipt]) -> None:
        """My answers are in and their receipts checked: echoes get them from now on."""
        ledger = self._ledgers.get(digest)
        if ledger is not None and not ledger.mine.done():
            ledger.mine.set_result(tuple(receipts))

    def fail(self, digest: bytes, reason: str) -> None:
        """My round failed before my receipts were in: echoes are refused."""
        ledger = self._ledgers.get(digest)
        if ledger is not None and not ledger.mine.done():
            ledger.mine.set_exception(AllReduceFailed(f"my round failed: {reason}"))

    def close(self, digest: bytes) -> None:
        """The round is over here; late echoes still get an answer for a while."""
        asyncio.get_running_loop().call_later(_RETAIN_S, self._ledgers.pop, digest, None)

    # ------------------------------------------------------------------ the member's side

    async def confirm(self, digest: bytes, me: str, receipts: Sequence[Receipt]) -> None:
        """Show `receipts` to every other reducer of the round, at once; return once each has
        confirmed every one. AllReduceFailed otherwise (a proof, a receipt not confirmed, an
        echo refused or timed out): my round must not commit, since another member may hold
        other bytes. Proofs go to `on_proof` first."""
        ledger = self._ledgers[digest]
        others = [peer for peer, _ in ledger.reducers if peer != me]
        outcomes = await asyncio.gather(
            *(self._echo(ledger, digest, peer, receipts) for peer in others),
            return_exceptions=True,
        )
        problems: list[str] = []
        for peer, outcome in zip(others, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, (AllReduceFailed, *STREAM_ERRORS)):
                    raise outcome
                problems.append(f"{peer[-6:]}: {type(outcome).__name__}: {outcome}")
                continue
            self._report(outcome)
            problems += [f"{p.reducer[-6:]} {p.describe()}" for p in outcome.proofs]
            if outcome.unconfirmed and not outcome.proofs:
                problems.append(f"{peer[-6:]} confirmed {len(outcome.unconfirmed)} receipts less")
        if problems:
            raise AllReduceFailed(f"receipts disagree: {'; '.join(problems)}")

    async def _echo(
        self, ledger: _Ledger, digest: bytes, peer: str, receipts: Sequence[Receipt]
    ) -> Comparison:
        """One echo: my receipts to `peer`, its receipts back, compared."""
        loop = asyncio.get_running_loop()
        remaining_s = max(0.0, ledger.deadline - loop.time())
        _, reader, writer = await asyncio.wait_for(
            self._service.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), self._handler_name
            ),
            remaining_s,
        )
        try:
            await P2P.send_raw_data(pack_head(digest), writer)
            await P2P.send_raw_data(pack_receipts(receipts), writer)
            most = len(OK) + max(receipts_size(ledger.count), MAX_REASON_BYTES)
            response = await asyncio.wait_for(
                read_frame(reader, most, AllReduceFailed),
                max(0.0, ledger.deadline - loop.time()),
            )
        finally:
            writer.close()
        status, body = response[: len(OK)], response[len(OK) :]
        if status == ERROR:
            raise AllReduceFailed(f"refused: {body.decode('utf-8', errors='replace')}")
        if status != OK:
            raise AllReduceFailed("a malformed answer")
        return compare(receipts, unpack_receipts(body, ledger.count), ledger.reducers)

    # ------------------------------------------------------------------ the reducer's side

    async def _handle(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = info.peer_id.to_base58()  # libp2p-authenticated
        try:
            try:
                answer = OK + await self._answer(sender, reader)
            except AllReduceFailed as e:
                answer = refusal(e)
            await asyncio.wait_for(P2P.send_raw_data(answer, writer), _WRITE_TIMEOUT_S)
            await linger(reader)  # until the member has read it and closed its end
        except (AllReduceFailed, *STREAM_ERRORS) as e:
            logger.debug("receipt echo of %s: %r", sender[-6:], e)
        finally:
            writer.close()

    async def _answer(self, sender: str, reader: asyncio.StreamReader) -> bytes:
        """Read a member's receipts, compare them with mine once mine are in; my receipts."""
        raw = await asyncio.wait_for(
            read_frame(reader, ECHO_HEAD.size, AllReduceFailed), _HEAD_TIMEOUT_S
        )
        ledger = self._ledgers.get(unpack_head(raw))
        if ledger is None or sender not in ledger.members:
            raise AllReduceFailed("no such round here, or not a member of it")
        if sender in ledger.echoed:
            raise AllReduceFailed("a second echo for this round")
        ledger.echoed.add(sender)
        remaining_s = max(0.0, ledger.deadline - asyncio.get_running_loop().time())
        data = await asyncio.wait_for(
            read_frame(reader, receipts_size(ledger.count), AllReduceFailed), remaining_s
        )
        theirs = unpack_receipts(data, ledger.count)
        try:
            mine = await asyncio.wait_for(asyncio.shield(ledger.mine), remaining_s)
        except asyncio.TimeoutError:
            raise AllReduceFailed("my answers are not in yet") from None
        self._report(compare(mine, theirs, ledger.reducers))
        return pack_receipts(mine)

    def _report(self, comparison: Comparison) -> None:
        for proof in comparison.proofs:
            logger.warning("reducer %s %s (proven)", proof.reducer[-8:], proof.describe())
            try:
                self._on_proof(proof)
            except Exception:  # a broken callback must not cost the round its answer
                logger.exception("on_proof failed")
