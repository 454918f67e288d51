"""The bookkeeping of one multi-donor download (multi.py): the queue of ranges, the workers
that fetch them (one per stream), the copies of a range in flight, and what each donor did.

What happens to a donor after a failed range is decided by the failure's typed kind and
refusal code (`retry_later`, `counts_as_stream_failure`, `may_predate_ranges`), never by its
message. When a range is fetched again, and which copy is cancelled, is endgame.py's rule.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from diloco_peer.coordinator_free.state_transfer.endgame import (
    SILENCE_S,
    CopyPace,
    DonorPace,
    pooled,
    take_again,
)
from diloco_peer.coordinator_free.state_transfer.transfer import (
    CANCEL_GRACE_S,
    Progress,
    first_of,
    open_answer,
    read_data,
    unreachable,
)
from diloco_peer.coordinator_free.state_transfer.wire import (
    CHUNK_BYTES,
    Header,
    RangeRequest,
    data_bytes,
    handler_name,
    malformed,
)
from diloco_peer.errors import RefusalCode, StateTransferFailed, TransferFailure

logger = logging.getLogger(__name__)

FIRST_RANGE_BYTES = 64 << 10
"""The first range of a multi-donor download, asked of one donor before the others start: small,
since it is there to learn the blob's length."""
BUSY_BACKOFF_S = (0.25, 4.0)
"""The first and the longest wait before asking a busy donor again."""
MAX_STREAM_FAILURES = 3
"""Broken or stalled streams a donor may have before it is dropped (one broken stream is no
proof that a donor left; a refusal other than "busy" drops it at once)."""
END_GAME_POLL_S = 0.1
"""How often a stream with nothing to do looks again whether a copy in flight has stalled."""


def retry_later(failure: StateTransferFailed) -> bool:
    """A busy donor: ask it again after a while."""
    return failure.kind is TransferFailure.REFUSED and failure.refusal is RefusalCode.BUSY


def counts_as_stream_failure(failure: StateTransferFailed) -> bool:
    """A failure of the stream rather than an answer of the donor's: the donor may still be
    there, so it is dropped only after MAX_STREAM_FAILURES of them."""
    return failure.kind in (TransferFailure.STREAM_BROKEN, TransferFailure.STALLED)


def may_predate_ranges(failure: StateTransferFailed) -> bool:
    """A donor of before ranged requests refuses one as a bad or unknown request, or breaks the
    stream (it closes it on the unread part of the request, which may reset it before its
    refusal arrives): a whole download from it may still work."""
    return counts_as_stream_failure(failure) or (
        failure.kind is TransferFailure.REFUSED
        and failure.refusal in (RefusalCode.BAD_REQUEST, RefusalCode.UNKNOWN_REQUEST)
    )


def backoff_s(attempt: int) -> float:
    """The wait before asking a busy donor again, after `attempt` busy answers in a row."""
    low_s, high_s = BUSY_BACKOFF_S
    return min(low_s * 2**attempt, high_s)


class NoRangeDonors(Exception):
    """No donor answered a ranged request, and `donors` may predate them
    (`may_predate_ranges`), so a whole download from one of them may still work."""

    def __init__(self, donors: list[str]) -> None:
        super().__init__(f"{len(donors)} donors predate ranged requests")
        self.donors = donors


@dataclass(eq=False)
class Copy:
    """One stream's fetch of the rest of one range from one donor."""

    donor: str
    start: int
    """Where in its range it starts: what the requester had of the range when it asked."""
    started_s: float
    got: int = 0
    """Data bytes received."""
    last_s: float = 0.0
    """When its last byte arrived (`started_s` before the first)."""
    task: asyncio.Task[StateTransferFailed | None] | None = None

    @property
    def end(self) -> int:
        """How far into its range this copy has come."""
        return self.start + self.got

    def pace(self, left_bytes: int, now_s: float) -> CopyPace:
        return CopyPace(self.got, left_bytes, now_s - self.started_s, now_s - self.last_s)

    def cancel(self) -> None:
        """Stop it: the task ends, closing its stream, so the donor's bytes stop flowing."""
        if self.task is not None:
            self.task.cancel()


@dataclass(eq=False)
class Range:
    """One range of the blob being fetched: what the requester has of it, from its start."""

    offset: int
    length: int
    have: int = 0
    chunks: list[bytes] = field(default_factory=list)
    """The bytes [0, have) of the range, in pieces as they arrived."""
    copies: list[Copy] = field(default_factory=list)
    """The copies in flight, oldest first (at most two: the end game takes a range once)."""

    def arrived(self, copy: Copy, piece: bytes) -> list[Copy]:
        """`copy` received `piece`: keep what is new; returns the older copies it overtook
        (all they would still send is here already: cancel them)."""
        copy.got += len(piece)
        if copy.end <= self.have:  # a copy catching up, or one about to be cancelled
            return []
        self.chunks.append(piece[len(piece) - (copy.end - self.have) :])
        self.have = copy.end
        older = self.copies[: self.copies.index(copy)] if copy in self.copies else []
        return [other for other in older if other.end < copy.end]


class MultiDownload:
    """One multi-donor download: the queue of ranges and what each donor did, shared by one
    worker per stream. Lives in the service's loop thread only (no locks needed)."""

    def __init__(
        self,
        run: str,
        state_hash: str,
        range_bytes: int,
        max_bytes: int,
        stall_timeout_s: float,
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        self.handler = handler_name(run)
        self.state_hash, self.range_bytes = state_hash, range_bytes
        self.max_bytes, self.stall_timeout_s = max_bytes, stall_timeout_s
        self.silence_s = min(SILENCE_S, stall_timeout_s / 2)
        self.peers: dict[str, PeerID] = {}
        """Donors still in the download."""
        self.reasons: dict[str, str] = {}
        """Donors dropped, and why (for messages)."""
        self.served: collections.Counter[str] = collections.Counter()
        """Ranges each donor completed (for logs and tests)."""
        self.failures: collections.Counter[str] = collections.Counter()
        """Broken or stalled streams per donor (`MAX_STREAM_FAILURES` drop it)."""
        self.pace: collections.defaultdict[str, DonorPace] = collections.defaultdict(DonorPace)
        self.progress = Progress(on_progress)
        """The blob's bytes the requester has, counted once per range as it completes."""
        self.received = 0
        """Every data byte read off the streams, copies cancelled or failed included."""
        self.again = 0
        """Ranges the end game fetched again from another donor."""
        self.expect: tuple[int, int] | None = None
        """(version, length) of the first answer: every later answer must repeat them."""
        self.done: dict[int, bytes] = {}
        self.todo: collections.deque[int] = collections.deque()
        self.ranges: dict[int, Range] = {}
        """Ranges started and not done yet."""
        self.tasks: set[asyncio.Task[StateTransferFailed | None]] = set()
        """Copies' tasks not done yet (cancelled ones close their streams on the way out)."""
        self.first = 0
        """The first range's length; the others start after it, every `range_bytes`."""
        self.count = 0
        self._changed = asyncio.Event()

    def admit(self, donors: list[object], me: str) -> None:
        """Take `donors` (ids from DHT records: a network input) into the download, once each;
        the ones that cannot be donors go to `reasons`."""
        for donor in dict.fromkeys(donors):
            if not isinstance(donor, str):
                self.reasons[repr(donor)] = "not a peer id"
            elif donor == me:
                self.reasons[donor] = "cannot download from myself"
            else:
                try:
                    self.peers[donor] = PeerID.from_base58(donor)
                except (ValueError, TypeError) as e:
                    self.reasons[donor] = f"malformed peer id: {e}"

    def describe(self) -> str:
        dropped = "; ".join(f"{d[-6:]}: {r}" for d, r in self.reasons.items()) or "none"
        return f"{self.progress.describe()}; donors dropped: {dropped}"

    def span(self, index: int) -> tuple[int, int]:
        """Range `index` as (offset, length): 0 is the first range, then `range_bytes` each."""
        if self.expect is None or index < 1:
            raise RuntimeError(f"range {index} asked before the first answer or out of order")
        offset = self.first + (index - 1) * self.range_bytes
        return offset, min(self.range_bytes, self.expect[1] - offset)

    @property
    def complete(self) -> bool:
        return self.expect is not None and len(self.done) == self.count

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # waiters hold the one that was set

    async def _changes(self, timeout_s: float) -> None:
        """Until `_notify` or `timeout_s` (a bound for the loops that call it, not a failure)."""
        await first_of(asyncio.ensure_future(self._changed.wait()), timeout_s)

    def _drop(self, donor: str, failure: StateTransferFailed) -> None:
        self.reasons[donor] = str(failure)
        logger.info("dropped donor %s: %s", donor[-6:], failure)

    async def run(self, p2p: P2P, streams_per_donor: int) -> tuple[int, bytes]:
        """The download: the first range, then all donors' workers; (version, data)."""
        await self._first_range(p2p)
        if self.expect is None:  # _first_range returns only once it knows the blob
            raise StateTransferFailed(
                f"no donor described the state ({self.describe()})", kind=TransferFailure.NO_DONOR
            )
        workers = [  # round-robin: the first ranges go to as many donors as there are
            asyncio.create_task(self._work(p2p, donor))
            for _ in range(streams_per_donor)
            for donor in list(self.peers)
        ]
        for worker in workers:  # wakes the wait below once the task counts as done
            worker.add_done_callback(lambda _: self._notify())
        try:
            while not self.complete and not all(w.done() for w in workers):
                await self._changes(1.0)
            for worker in workers:  # a bug in a worker surfaces, it does not pass as a drop
                if worker.done() and not worker.cancelled() and worker.exception() is not None:
                    raise worker.exception()  # type: ignore[misc]
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if self.tasks:  # cancelled with their workers: let them close their streams
                await asyncio.wait(set(self.tasks), timeout=CANCEL_GRACE_S)
        if not self.complete:
            raise StateTransferFailed(
                f"no donor left ({self.describe()})", kind=TransferFailure.NO_DONOR
            )
        data = b"".join(self.done[i] for i in range(self.count))
        if len(data) != self.expect[1]:  # the spans add up by construction: a bug otherwise
            raise StateTransferFailed(
                f"assembled {len(data)} bytes, not {self.expect[1]}",
                kind=TransferFailure.MALFORMED,
            )
        return self.expect[0], data

    async def _first_range(self, p2p: P2P) -> None:
        """Ask the donors in turn for the first range, which names the blob's version and
        length; split the rest into ranges. Busy donors are asked again after a while (the
        caller's timeout bounds that). Raises NoRangeDonors or StateTransferFailed."""
        old: list[str] = []  # refused ranged requests, or broke the stream: perhaps older builds
        later: dict[str, tuple[PeerID, StateTransferFailed]] = {}  # busy or broken, for now
        first = min(self.range_bytes, FIRST_RANGE_BYTES)
        for attempt in itertools.count():
            for donor, peer in list(self.peers.items()):
                failure = await self._range(p2p, peer, 0, first)
                if isinstance(failure, bytes):  # no failure: the first range's data
                    self._split(donor, failure)
                    self.peers.update({d: p for d, (p, _) in later.items()})
                    return
                del self.peers[donor]
                if counts_as_stream_failure(failure):
                    self.failures[donor] += 1
                if retry_later(failure) or counts_as_stream_failure(failure):
                    later[donor] = (peer, failure)
                else:
                    self._drop(donor, failure)
                if may_predate_ranges(failure):
                    old.append(donor)
            busy = {d: p for d, (p, f) in later.items() if retry_later(f)}
            if old or not busy:
                break
            await asyncio.sleep(backoff_s(attempt))
            for donor in busy:
                del later[donor]
            self.peers.update(busy)
        for donor, (_, failure) in later.items():
            self.reasons[donor] = str(failure)
        if old:
            raise NoRangeDonors(old)
        raise StateTransferFailed(
            f"no donor served the first range ({self.describe()})", kind=TransferFailure.NO_DONOR
        )

    def _split(self, donor: str, data: bytes) -> None:
        """`donor` served the first range, `data`: queue the rest of the blob as ranges."""
        total = self.expect[1]  # type: ignore[index]  # set by the answer that gave `data`
        self.first = len(data)  # `first` bytes, or the whole blob if shorter
        self.count = 1 + -(-(total - self.first) // self.range_bytes)
        self.done[0] = data
        self.served[donor] += 1
        self.todo.extend(range(1, self.count))
        self.progress.total = total
        self.progress.add(len(data))

    async def _range(
        self, p2p: P2P, peer: PeerID, offset: int, length: int
    ) -> bytes | StateTransferFailed:
        """One ranged download (the first range), checked against the first answer: its data,
        or why it failed."""
        chunks: list[bytes] = []

        def arrived(piece: bytes) -> None:
            self.received += len(piece)
            chunks.append(piece)

        failure = await self._ask(p2p, peer, RangeRequest(self.state_hash, offset, length), arrived)
        return b"".join(chunks) if failure is None else failure

    async def _ask(
        self, p2p: P2P, peer: PeerID, request: RangeRequest, on_piece: Callable[[bytes], None]
    ) -> StateTransferFailed | None:
        """One ranged request, its data handed to `on_piece` as it arrives: None once all of it
        came, or why it failed (returned, not raised: every failure is an outcome the caller
        sorts by its kind). A cancellation closes the stream."""
        try:
            header, reader, writer = await open_answer(
                p2p, self.handler, peer, request.encode(), stall_timeout_s=self.stall_timeout_s
            )
            try:
                wrong = self._check(header)
                if wrong is not None:
                    return wrong
                count = data_bytes(header, self.max_bytes, request.span)
                if self.count and count != request.length:  # ranges end inside the blob
                    return malformed(f"{count} bytes for a range of {request.length}")
                await read_data(reader, count, on_piece, self.stall_timeout_s)
            finally:
                writer.close()
        except StateTransferFailed as e:
            return e
        except (OSError, EOFError, struct.error) as e:
            return StateTransferFailed(
                f"stream broken: {type(e).__name__}: {e}", kind=TransferFailure.STREAM_BROKEN
            )
        except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
            return unreachable(e)
        return None

    def _check(self, header: Header) -> StateTransferFailed | None:
        """Why an answer's header does not fit the first answer's, or None."""
        wrong = TransferFailure.WRONG_ANSWER
        if header.state_hash != self.state_hash:  # the donor checked the hash we named: echoes it
            return StateTransferFailed(f"answered for state {header.state_hash[:16]}", kind=wrong)
        if self.expect is None:
            self.expect = (header.version, header.length)
        elif (header.version, header.length) != self.expect:
            return StateTransferFailed(
                f"inconsistent: version {header.version}, {header.length} bytes "
                f"(others: {self.expect})",
                kind=wrong,
            )
        return None

    def _take(self, donor: str) -> int | None:
        """The next range for `donor`: from the queue, else (the end game) one in flight at
        one other donor whose copy has stalled (endgame.py); None when there is nothing for it
        to do now."""
        if self.todo:
            return self.todo.popleft()
        now_s = time.monotonic()
        single = (
            (index, rng.copies[0].pace(rng.length - rng.have, now_s))
            for index, rng in self.ranges.items()
            if len(rng.copies) == 1 and rng.copies[0].donor != donor
        )
        fresh = self.pace[donor]
        if fresh.bytes == 0:  # no copy of its own yet: guess it as fast as the others so far
            fresh = pooled(self.pace.values())
        index = take_again(single, fresh, self.silence_s)
        if index is not None:
            rng = self.ranges[index]
            self.again += 1
            logger.info(
                "range %d again from %s: its copy at %s is stalled (%s)",
                index,
                donor[-6:],
                rng.copies[0].donor[-6:],
                rng.copies[0].pace(rng.length - rng.have, now_s),
            )
        return index

    async def _work(self, p2p: P2P, donor: str) -> None:
        """One stream's worth of one donor: ranges from the queue, or stalled ones in the end
        game, until none is left or the donor is dropped."""
        peer = self.peers[donor]
        busy_streak = 0
        while not self.complete and donor in self.peers:
            index = self._take(donor)
            if index is None:
                await self._changes(END_GAME_POLL_S)
                continue
            got = await self._copy(p2p, peer, donor, index)
            if got is None:  # the range is done, by this copy or another
                busy_streak = 0
                continue
            if retry_later(got):
                await asyncio.sleep(backoff_s(busy_streak))
                busy_streak += 1
                continue
            if counts_as_stream_failure(got):
                self.failures[donor] += 1
                if self.failures[donor] < MAX_STREAM_FAILURES:
                    continue
            if donor in self.peers:
                del self.peers[donor]
                self._drop(donor, got)

    async def _copy(
        self, p2p: P2P, peer: PeerID, donor: str, index: int
    ) -> StateTransferFailed | None:
        """Fetch the rest of range `index` from `donor`: None when the range is done (by this
        copy, or by another that cancelled this one), or why this copy failed (the range then
        goes back to the queue unless another copy is still at it)."""
        rng = self.ranges.get(index)
        if rng is None:
            rng = self.ranges[index] = Range(*self.span(index))
        now_s = time.monotonic()
        copy = Copy(donor, rng.have, now_s, last_s=now_s)
        rng.copies.append(copy)
        request = RangeRequest(self.state_hash, rng.offset + copy.start, rng.length - copy.start)
        task = asyncio.ensure_future(
            self._ask(p2p, peer, request, lambda piece: self._arrived(index, rng, copy, piece))
        )
        copy.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        # as the single downloads did, each frame may take `stall_timeout_s`, and the answer
        frames = 2 + math.ceil(request.length / CHUNK_BYTES)
        try:
            in_time = await first_of(task, self.stall_timeout_s * frames)
        finally:
            rng.copies.remove(copy)
            self.pace[donor].add(copy.got, time.monotonic() - copy.started_s)
        if index in self.done:
            return None  # complete: this copy completed it, or was cancelled as the slower one
        failure: StateTransferFailed | None = None  # cancelled: a newer copy overtook it
        if not in_time:
            failure = StateTransferFailed(
                f"range {index} not done in {self.stall_timeout_s * frames:.0f} s",
                kind=TransferFailure.STALLED,
            )
        elif not task.cancelled():
            failure = task.result()
        if not rng.copies:  # nobody else at it (an overtaking copy may have failed since)
            self.todo.appendleft(index)  # first in line for the next free stream, from `have`
            self._notify()
        return failure

    def _arrived(self, index: int, rng: Range, copy: Copy, piece: bytes) -> None:
        """A piece of `copy` of range `index`: keep it if new, cancel copies it overtook, and
        complete the range when it is all here (cancelling any other copy at once)."""
        self.received += len(piece)
        copy.last_s = time.monotonic()
        for other in rng.arrived(copy, piece):
            logger.debug("range %d: %s overtook %s", index, copy.donor[-6:], other.donor[-6:])
            other.cancel()
        if rng.have < rng.length or index in self.done:
            return
        self.done[index] = b"".join(rng.chunks)
        del self.ranges[index]
        self.served[copy.donor] += 1
        self.progress.add(rng.length)
        for other in rng.copies:
            if other is not copy:
                other.cancel()
        self._notify()
