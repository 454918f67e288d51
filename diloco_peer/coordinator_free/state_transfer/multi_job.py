"""The bookkeeping of one multi-donor download (multi.py): the queue of ranges, the workers
that fetch them (one per stream), and what each donor did.

What happens to a donor after a failed range is decided by the failure's typed kind and
refusal code (`retry_later`, `counts_as_stream_failure`, `may_predate_ranges`), never by its
message.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import struct
from collections.abc import Callable

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from diloco_peer.coordinator_free.state_transfer.transfer import (
    Progress,
    first_of,
    transfer,
    unreachable,
)
from diloco_peer.coordinator_free.state_transfer.wire import RangeRequest, handler_name
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
        self.peers: dict[str, PeerID] = {}
        """Donors still in the download."""
        self.reasons: dict[str, str] = {}
        """Donors dropped, and why (for messages)."""
        self.served: collections.Counter[str] = collections.Counter()
        """Ranges each donor delivered first (for logs and tests)."""
        self.failures: collections.Counter[str] = collections.Counter()
        """Broken or stalled streams per donor (`MAX_STREAM_FAILURES` drop it)."""
        self.progress = Progress(on_progress)
        self.expect: tuple[int, int] | None = None
        """(version, length) of the first answer: every later answer must repeat them."""
        self.done: dict[int, bytes] = {}
        self.todo: collections.deque[int] = collections.deque()
        self.fetching: dict[int, list[str]] = {}
        """Ranges in flight, and which donors fetch them (in the order they started)."""
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
        workers = [
            asyncio.create_task(self._work(p2p, donor))
            for donor in list(self.peers)
            for _ in range(streams_per_donor)
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
        """One ranged download, checked against the first answer: its data, or why it failed
        (returned, not raised: every failure is an outcome the caller sorts by its kind)."""
        request = RangeRequest(self.state_hash, offset, length)
        try:
            header, data = await transfer(
                p2p,
                self.handler,
                peer,
                request.encode(),
                self.max_bytes,
                Progress(None),
                span=request.span,
                stall_timeout_s=self.stall_timeout_s,
            )
        except StateTransferFailed as e:
            return e
        except (OSError, EOFError, struct.error) as e:
            return StateTransferFailed(
                f"stream broken: {type(e).__name__}: {e}", kind=TransferFailure.STREAM_BROKEN
            )
        except (P2PDaemonError, P2PHandlerError) as e:  # e.g. unreachable peer, no such handler
            return unreachable(e)
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
        return data

    def _take(self, donor: str) -> int | None:
        """The next range for `donor`: from the queue, else (the end game) the oldest range in
        flight at one other donor only; None when there is nothing for it to do now."""
        if self.todo:
            return self.todo.popleft()
        for index, fetchers in self.fetching.items():  # dicts keep insertion order: oldest first
            if len(fetchers) == 1 and donor not in fetchers and index not in self.done:
                return index
        return None

    async def _work(self, p2p: P2P, donor: str) -> None:
        """One stream's worth of one donor: ranges from the queue until none is left or the
        donor is dropped."""
        peer = self.peers[donor]
        busy_streak = 0
        while not self.complete and donor in self.peers:
            index = self._take(donor)
            if index is None:
                await self._changes(1.0)
                continue
            self.fetching.setdefault(index, []).append(donor)
            try:
                got = await self._range(p2p, peer, *self.span(index))
            finally:  # also when cancelled: leave the bookkeeping consistent
                fetchers = self.fetching.get(index, [])
                if donor in fetchers:
                    fetchers.remove(donor)
                if not fetchers:
                    self.fetching.pop(index, None)
            if isinstance(got, bytes):
                busy_streak = 0
                if index not in self.done:
                    self.done[index] = got
                    self.served[donor] += 1
                    self.progress.add(len(got))
                self._notify()
                continue
            if index not in self.done and index not in self.fetching:
                self.todo.appendleft(index)  # first in line for the next free stream
            self._notify()
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
