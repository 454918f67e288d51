"""Two running processes with one key: the later one leaves (a pure rule on the heads).

A peer's key is its name: two live processes that sign with it (a key file copied to a second
machine, a second `join` on a loaded box where hivemind's check at start missed the first) share
one peer id, so the swarm sees one peer whose head flips between two states, and libp2p routes
the id's connections to either. A start checks for a live holder (`lifeline.live_holders` on
this machine, hivemind's lookup through the --swarm peers), but that lookup can miss. So each
head says when its process started (`PeerHead.since`), and every read of the heads shows a peer
the record its key last stored:

    watch = KeyWatch(since=my_start)
    rival = watch.see(heads.get(me))    # None, or the other process once it is seen alive
    if rival and not rival.newer: ...   # it was there first: this process leaves (exit 2)

A head under our key from another incarnation may be a dead one's last (a crash, a restart
within the head's TTL), so it proves a live rival only once it was refreshed: two of its heads,
both dated after this process started, with different dates. A dead process publishes nothing
new. Of two live ones the one that started later leaves; the earlier one stays (each reads the
other's `since`, so both come to the same answer). Only a holder of the key can sign such a
head (records.py checks the signature), so nobody else can make a peer leave.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_peer.coordinator_free.records import PeerHead

MAX_INCARNATIONS = 8
"""Other incarnations a watch remembers (the oldest go first): only a key's holders sign them,
and a handful of restarts within a head's TTL is already unusual."""


@dataclass(frozen=True)
class Rival:
    """Another live process that signs heads with this peer's key."""

    since: float
    """When it started (DHT time, its own word)."""
    newer: bool
    """It started after this process did: it leaves, this one stays."""


class KeyWatch:
    """Tells from the heads read under this peer's own key whether another live process holds
    it (see the module docstring)."""

    def __init__(self, since: float) -> None:
        self.since = since
        self._first: dict[float, float] = {}
        """Per other incarnation (its `since`): the date of its first head dated after ours."""

    def see(self, head: PeerHead | None) -> Rival | None:
        """One read's head under our key; the rival once one of its heads proves it alive."""
        if head is None or head.since is None or head.since == self.since:
            return None
        if head.updated <= self.since:  # published before this process started (or leaving: 0)
            return None
        first = self._first.setdefault(head.since, head.updated)
        while len(self._first) > MAX_INCARNATIONS:
            del self._first[next(iter(self._first))]
        if head.updated == first:
            return None
        return Rival(since=head.since, newer=head.since > self.since)
