"""Keeping the DHT whole after a network partition (issue 15, "partitions heal").

hivemind's DHT drops a node from its routing table the first time a request to it goes
unanswered, and only a request from that node puts it back: nodes learn of others from the
answers of nodes they already know, and from those that call them. During a partition each
side's requests to the other side fail, so each side forgets the other; once the network is
whole again nobody calls across, the two halves stay two DHTs (each stores and reads the
heads on its own side), and the swarm trains on two branches for ever (measured: 4 peers split
2|2 for 30 s were still two DHTs, and two branches, 90 s after the network healed). Only when
TCP connections survived the cut may requests stalled in them arrive late and remind the
receiver; after a long outage nothing does. hivemind also blacklists a silent node with
exponential backoff, so even a node that is back in the table is skipped by searches for a
while.

The remedy is what Kademlia's bucket refresh would do with the right seeds: a peer remembers
the swarm's peers it has known (the initial peers it was given, the nodes of its routing table,
the peers whose heads it has read) and pings those missing from its routing table. A node that
answers a ping is put back in the table by hivemind itself, and we clear its blacklist entry.
`RejoinBook` is the rule (pure: who to ping now, with backoff for peers that do not answer);
`routed_peers` and `ping_peers` are the two bounded calls into the DHT process; `Rejoiner` is
the peer's background loop that runs them every REJOIN_PERIOD_S.

    book = RejoinBook(me)
    routed = routed_peers(dht, timeout_s=5)
    book.note({p: now for p in initial + list(routed)} | {p: h.updated for p, h in heads}, now)
    due = book.due(routed, now)
    book.record(due, ping_peers(dht, due, timeout_s=5), now)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import PeerID

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.errors import SwarmTimeout
from diloco_peer.lifecycle import ThreadPart

log = logging.getLogger(__name__)

MAX_KNOWN = 256
"""Peers a book remembers at most (the most recently noted win): heads come from others, so
a flood of keys must not grow it without bound."""
MAX_PINGS = 16
"""Peers pinged at most per call (the most recently noted first)."""
FORGET_S = 1800.0
"""A peer not noted for this long (no head, not in the routing table) is forgotten."""
FIRST_RETRY_S = 2.0
"""After a peer's first unanswered ping, the next one waits this long; each further failure
doubles the wait, up to MAX_RETRY_S."""
MAX_RETRY_S = 3.0
"""Short, so that the DHT is whole again within seconds of the network (a partition heals
within 2 rounds, issue 15): a peer missing from the table is pinged again at most
REJOIN_PERIOD_S + MAX_RETRY_S + PING_TIMEOUT_S (10 s) after its last unanswered ping began
(it was 8 s, for up to 15 s). A ping of a peer that is gone costs a failed dial every few
seconds until its head is FORGET_S old (at most MAX_PINGS of them at once)."""
REJOIN_PERIOD_S = 2.0
"""How often `Rejoiner` looks at the routing table (one cheap call into the DHT process)."""
TABLE_TIMEOUT_S = 10.0
"""Reading the routing table (it waits behind whatever the DHT process is doing)."""
PING_TIMEOUT_S = 5.0
"""One round of `Rejoiner`'s pings, all at once."""
REDIAL_AFTER = 2
"""Unanswered pings after which a peer's connections are closed before the next ping, so that
the ping dials anew. A TCP connection that outlived a network cut stalls in retransmission
backoff: after a 30 s cut, pings sent into it went unanswered for 10-14 s after the network
healed (its next retransmission), and the two sides mended their tables one peer at a time, out
of step, long enough for a second fork (measured, netlab, 2026-12-04); after longer cuts the
backoff reaches minutes. Not after the first failure: a busy peer that misses one ping keeps its
connection, and the streams on it (an all-reduce) with it."""
_CALL_SLACK_S = 2.0
"""On top of a call's own timeout, for the trip through the DHT process's pipe."""


@dataclass
class _Known:
    noted: float
    """When the peer was last noted (an initial peer, a head, a routing-table node)."""
    failures: int = 0
    """Unanswered pings since its last answer."""
    next_try: float = 0.0


class RejoinBook:
    """Whom to ping to mend the routing table (see the module docstring). Not thread-safe: one
    thread (the rejoin loop) uses it."""

    def __init__(
        self,
        me: str,
        *,
        max_known: int = MAX_KNOWN,
        forget_s: float = FORGET_S,
        first_retry_s: float = FIRST_RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
    ) -> None:
        self.me, self.max_known, self.forget_s = me, max_known, forget_s
        self.first_retry_s, self.max_retry_s = first_retry_s, max_retry_s
        self.known: dict[str, _Known] = {}

    def note(self, seen: Mapping[str, float], now: float) -> None:
        """Each peer of `seen` was part of the swarm at the time given (an initial peer or a
        routing-table node: now; a head: when it was published, never later than `now`)."""
        for peer, when in seen.items():
            if peer == self.me or not peer:
                continue
            when = min(when, now)
            entry = self.known.get(peer)
            if entry is None:
                self.known[peer] = _Known(noted=when)
            else:
                entry.noted = max(entry.noted, when)
        for peer, entry in list(self.known.items()):
            if now - entry.noted > self.forget_s:
                del self.known[peer]
        if len(self.known) > self.max_known:
            newest = sorted(self.known, key=lambda p: self.known[p].noted, reverse=True)
            for peer in newest[self.max_known :]:
                del self.known[peer]

    def due(self, routed: Collection[str], now: float, limit: int = MAX_PINGS) -> list[str]:
        """Known peers missing from the routing table (`routed`) whose next try has come, the
        most recently noted first, at most `limit`. A peer in the table needs no ping, and its
        backoff starts over."""
        out = []
        for peer, entry in self.known.items():
            if peer in routed:
                entry.failures, entry.next_try = 0, 0.0
            elif entry.next_try <= now:
                out.append(peer)
        out.sort(key=lambda p: self.known[p].noted, reverse=True)
        return out[:limit]

    def redial(self, peers: Iterable[str], busy: Collection[str] = ()) -> list[str]:
        """Those of `peers` that have not answered REDIAL_AFTER pings in a row: their old
        connections are dropped before the next ping. Never those in `busy`, whose connection
        carries a round's all-reduce or a state download now: on a slow link the DHT's pings
        wait behind its bulk transfer, and dropping the connection cut the all-reduce (netlab,
        2 Mbit, 20m: a failed round in 3 of 10). A stalled one fails the round (or the download)
        at its timeout; the redial follows."""
        return [
            p for p in peers
            if p in self.known and self.known[p].failures >= REDIAL_AFTER and p not in busy
        ]  # fmt: skip

    def record(self, pinged: Iterable[str], answered: Collection[str], now: float) -> None:
        """The outcome of pinging `pinged`: those in `answered` are back; the others wait
        FIRST_RETRY_S, doubled per failure, up to MAX_RETRY_S."""
        for peer in pinged:
            entry = self.known.get(peer)
            if entry is None:
                continue
            if peer in answered:
                entry.failures, entry.next_try = 0, 0.0
                continue
            wait_s = min(self.max_retry_s, self.first_retry_s * 2**entry.failures)
            entry.failures += 1
            entry.next_try = now + wait_s


# ----- calls into the DHT process (module-level coroutines: hivemind pickles them by name)


async def _routed(_dht: DHT, node: DHTNode) -> list[str]:
    """The routing table's nodes that searches would ask (hivemind skips blacklisted ones)."""
    table, blacklist = node.protocol.routing_table, node.blacklist
    return [p.to_base58() for p in list(table.peer_id_to_uid) if p not in blacklist]


def _peer_ids(peers: Iterable[str]) -> list[PeerID]:
    ids = []
    for peer in peers:
        try:
            ids.append(PeerID.from_base58(peer))
        except ValueError:
            log.debug("not a peer id: %r", peer[:64])
    return ids


async def _disconnect(node: DHTNode, peers: list[str], timeout_s: float) -> None:
    """Close this node's libp2p connections to `peers`, so the next call to each dials anew.
    hivemind keeps its daemon client private (`P2P._client`); the daemon's DISCONNECT request
    is the only way to drop a stalled connection."""
    client = getattr(node.protocol.p2p, "_client", None)
    ids = _peer_ids(peers)
    if client is None or not ids:
        return
    done, pending = await asyncio.wait(
        [asyncio.ensure_future(client.disconnect(p)) for p in ids], timeout=timeout_s
    )
    for task in pending:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            log.debug("could not disconnect a stalled peer: %r", task.exception())


async def _ping(
    _dht: DHT, node: DHTNode, peers: list[str], timeout_s: float, redial: list[str]
) -> list[str]:
    """Ping `peers` at once, after closing the connections to those of `redial`; those that
    answered (hivemind has put them in the routing table), their blacklist entries cleared."""
    await _disconnect(node, redial, timeout_s / 2)
    ids = _peer_ids(peers)
    tasks = [asyncio.ensure_future(node.protocol.call_ping(p)) for p in ids]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    answered = []
    for peer_id, task in zip(ids, tasks, strict=True):
        if task in done and task.exception() is None and task.result() is not None:
            node.blacklist.register_success(peer_id)
            answered.append(peer_id.to_base58())
    return answered


def _call(dht: DHT, coroutine: partial[object], timeout_s: float, what: str) -> object:
    future = dht.run_coroutine(coroutine, return_future=True)
    try:
        return future.result(timeout=timeout_s + _CALL_SLACK_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise SwarmTimeout(f"{what} did not finish within {timeout_s:g} s") from None


def routed_peers(dht: DHT, *, timeout_s: float) -> set[str]:
    """Peer ids (base58) in this node's routing table and not blacklisted."""
    found = _call(dht, partial(_routed), timeout_s, "reading the DHT routing table")
    return {p for p in found if isinstance(p, str)} if isinstance(found, list) else set()


def ping_peers(
    dht: DHT, peers: list[str], *, timeout_s: float, redial: Collection[str] = ()
) -> set[str]:
    """Ping `peers` from this DHT node (each at most `timeout_s`, plus half of it to first close
    the connections to those in `redial`); the ones that answered."""
    if not peers:
        return set()
    ping = partial(_ping, peers=list(peers), timeout_s=timeout_s, redial=sorted(redial))
    found = _call(dht, ping, 1.5 * timeout_s, f"pinging {len(peers)} DHT peers")
    return {p for p in found if isinstance(p, str)} if isinstance(found, list) else set()


class Rejoiner(ThreadPart):
    """Keeps this peer's DHT whole across network partitions: every REJOIN_PERIOD_S it pings the
    swarm's peers it knows of (initial peers, heads, routing-table nodes) that are missing from
    its routing table, with backoff for those that do not answer (`RejoinBook`). `on_rejoined`
    gets the peers that came back; `busy()` says whose connections carry our bulk transfer now
    (an all-reduce, a state download: never redialled)."""

    def __init__(
        self,
        dht: Callable[[], DHT | None],
        me: str,
        *,
        initial: Sequence[str],
        heads: Callable[[], Mapping[str, PeerHead]],
        on_rejoined: Callable[[list[str]], None],
        busy: Callable[[], Collection[str]] = frozenset,
        period_s: float = REJOIN_PERIOD_S,
        timeout_s: float = TABLE_TIMEOUT_S,
    ) -> None:
        super().__init__(
            "rejoin", join_timeout_s=timeout_s + 1.5 * PING_TIMEOUT_S + 2 * _CALL_SLACK_S
        )
        self._dht, self._initial, self._heads = dht, list(initial), heads
        self._on_rejoined, self._period_s, self._timeout_s = on_rejoined, period_s, timeout_s
        self._busy = busy
        self.me, self.book = me, RejoinBook(me)
        self.routed = -1
        """Routing-table nodes at the last look (-1: not looked yet)."""
        self.failures = 0

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.mend()
            except Exception as e:  # never let the loop die: the DHT would stay split
                self.failures += 1
                log.warning("DHT rejoin failed (%d so far): %r", self.failures, e)

    def mend(self) -> list[str]:
        """One look at the routing table, and pings to the known peers missing from it; the
        peers that answered (they are back in the table)."""
        dht = self._dht()
        if dht is None:
            return []
        now = time.time()
        routed = routed_peers(dht, timeout_s=self._timeout_s)
        # a client's DHT node answers no request; a departed peer's head says updated 0
        heads = {p: h.updated for p, h in dict(self._heads()).items() if not h.client}
        self.book.note(heads | {p: now for p in [*self._initial, *routed]}, now)
        if len(routed) != self.routed:
            log.info("[%s] DHT routing table: %d node(s), %d peer(s) known", self.me[-6:],
                     len(routed), len(self.book.known))  # fmt: skip
            self.routed = len(routed)
        due = self.book.due(routed, now)
        if not due:
            return []
        redial = self.book.redial(due, busy=self._busy())
        answered = ping_peers(dht, due, timeout_s=PING_TIMEOUT_S, redial=redial)
        self.book.record(due, answered, time.time())
        if answered:
            self._on_rejoined(sorted(answered))
        return sorted(answered)
