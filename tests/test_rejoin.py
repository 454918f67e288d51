"""Whom a peer pings to mend its DHT routing table after a partition (coordinator_free/rejoin.py):
the pure rule, with no DHT. Between real DHT nodes on a split network: test_partition.py. And
how a joining node's start is tried again while no `--swarm` peer answers (network.start_dht);
a wrong address failing with exit 2 between real processes: test_swarm.py."""

from __future__ import annotations

import pytest

from diloco_peer.coordinator_free.rejoin import RejoinBook
from diloco_peer.errors import BadInput
from diloco_peer.peer.network import (
    BOOTSTRAP_BACKOFF_S,
    BOOTSTRAP_TRIES,
    initial_peer_ids,
    start_dht,
)


def test_known_peers_missing_from_the_table_are_pinged_the_newest_first() -> None:
    book = RejoinBook("me")
    book.note({"a": 100.0, "b": 90.0, "c": 95.0, "me": 100.0, "": 100.0}, now=100.0)
    assert sorted(book.known) == ["a", "b", "c"]  # never ourselves, never an empty id
    assert book.due(routed={"c"}, now=100.0) == ["a", "b"]
    assert book.due(routed={"a", "b", "c"}, now=100.0) == []  # a whole table: nothing to do
    assert book.due(routed=set(), now=100.0, limit=2) == ["a", "c"]


def test_a_silent_peer_is_pinged_again_with_backoff_and_an_answer_resets_it() -> None:
    book = RejoinBook("me", first_retry_s=2.0, max_retry_s=8.0)
    book.note({"a": 0.0}, now=0.0)
    waits = []
    now = 0.0
    for _ in range(5):  # a ping, no answer: when is the next one due?
        assert book.due(set(), now) == ["a"]
        book.record(["a"], answered=set(), now=now)
        waits.append(book.known["a"].next_try - now)
        assert book.due(set(), now + waits[-1] - 0.1) == []
        now += waits[-1]
    assert waits == [2.0, 4.0, 8.0, 8.0, 8.0]  # doubled, up to the cap
    book.record(["a"], answered={"a"}, now=now)  # it answered: back, backoff forgotten
    assert book.known["a"].failures == 0 and book.due(set(), now) == ["a"]
    book.record(["a"], answered=set(), now=now)
    book.due({"a"}, now + 1.0)  # in the table again (it called us): backoff forgotten too
    assert book.known["a"].failures == 0 and book.due(set(), now + 1.0) == ["a"]
    book.record(["zz"], answered=set(), now=now)  # a peer the book does not know: ignored
    assert "zz" not in book.known


def test_a_peer_silent_for_two_pings_is_redialled_and_an_answer_ends_it() -> None:
    book = RejoinBook("me")
    book.note({"a": 0.0, "b": 0.0}, now=0.0)
    book.record(["a", "b"], answered=set(), now=0.0)
    assert book.redial(["a", "b"]) == []  # one miss: a busy peer keeps its connection
    book.record(["a", "b"], answered={"b"}, now=10.0)
    assert book.redial(["a", "b", "zz"]) == ["a"]  # two misses in a row; b answered the second
    book.record(["a"], answered={"a"}, now=20.0)
    assert book.redial(["a", "b"]) == []


def test_a_peer_whose_connection_carries_an_all_reduce_is_never_redialled() -> None:
    # on a slow link the DHT's pings wait behind the all-reduce's bulk transfer; dropping the
    # connection would cut the round's streams (both sides' rounds failed within 0.1 s)
    book = RejoinBook("me")
    book.note({"a": 0.0, "b": 0.0}, now=0.0)
    for now in (0.0, 10.0):
        book.record(["a", "b"], answered=set(), now=now)
    assert book.redial(["a", "b"], busy={"a"}) == ["b"]
    assert book.redial(["a", "b"], busy=frozenset()) == ["a", "b"]  # the round is over


def test_heads_long_gone_are_forgotten_and_the_book_stays_bounded() -> None:
    book = RejoinBook("me", max_known=3, forget_s=100.0)
    book.note({"old": 0.0, "left": 0.0, "x": 150.0}, now=150.0)  # a departed head: updated 0
    assert sorted(book.known) == ["x"]
    book.note({"x": 10.0}, now=160.0)  # an older sighting never makes a peer look older
    assert book.known["x"].noted == 150.0
    book.note({"future": 10_000.0}, now=160.0)  # a head's time is never believed past now
    assert book.known["future"].noted == 160.0
    book.note({f"p{i}": 170.0 + i for i in range(5)}, now=180.0)  # a flood of keys
    assert sorted(book.known) == ["p2", "p3", "p4"]  # the most recently noted stay


def test_the_initial_peers_are_named_by_the_join_multiaddrs() -> None:
    a = "/ip4/10.0.0.1/tcp/4000/p2p/QmWn4jsMYyVBDVxEXPg912m154r1pyNhkcKWPpJ22s7fas"
    b = "/ip4/10.0.0.2/tcp/4000/p2p/QmVhfXkchG688o3mzPSy78SSt8DVWX4d7ZCY33omDvmSek"
    same_as_a = "/ip4/192.168.1.1/tcp/31337/p2p/QmWn4jsMYyVBDVxEXPg912m154r1pyNhkcKWPpJ22s7fas"
    assert initial_peer_ids([a, b, same_as_a, "/ip4/10.0.0.3/tcp/1"]) == [
        "QmWn4jsMYyVBDVxEXPg912m154r1pyNhkcKWPpJ22s7fas",
        "QmVhfXkchG688o3mzPSy78SSt8DVWX4d7ZCY33omDvmSek",
    ]


class Starts:
    """A node start that fails like hivemind's daemon when no `--swarm` peer answers, `fails`
    times, then starts."""

    def __init__(self, fails: int, reason: str = "failed to connect to bootstrap peers") -> None:
        self.fails, self.reason, self.calls = fails, reason, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError(f"P2P daemon failed to start\n{self.reason}")
        return "dht"


def test_a_join_whose_swarm_peers_do_not_answer_at_once_tries_again_with_backoff() -> None:
    # a founder busy with a round (or a loaded machine) may miss a newcomer's first dial
    waits: list[float] = []
    start = Starts(fails=2)
    assert start_dht(start, sleep=waits.append) == "dht"  # type: ignore[arg-type]
    assert start.calls == 3 and waits == [BOOTSTRAP_BACKOFF_S, 2 * BOOTSTRAP_BACKOFF_S]
    # nobody answers at all (a wrong address): bad input after the last try, never more tries
    waits.clear()
    start = Starts(fails=99)
    with pytest.raises(BadInput, match=rf"no peer of --swarm answered \({BOOTSTRAP_TRIES} tries"):
        start_dht(start, sleep=waits.append)  # type: ignore[arg-type]
    assert start.calls == BOOTSTRAP_TRIES and len(waits) == BOOTSTRAP_TRIES - 1
    # any other failure (a busy port, a key in use) is bad input at once
    start = Starts(fails=1, reason="address already in use")
    with pytest.raises(BadInput, match="cannot start the peer's network node: address already"):
        start_dht(start, sleep=waits.append)  # type: ignore[arg-type]
    assert start.calls == 1


def test_a_node_the_swarm_cannot_dial_back_is_refused_with_what_to_do() -> None:
    # hivemind blames a firewall; the same words come when this key runs in another process
    waits: list[float] = []
    start = Starts(fails=1, reason="ValidationError: Peer QmX can't access this node. Probably, "
                                   "libp2p has failed to bypass the firewall")  # fmt: skip
    with pytest.raises(BadInput) as refused:
        start_dht(start, sleep=waits.append)  # type: ignore[arg-type]
    line = str(refused.value)
    assert start.calls == 1 and not waits and "\n" not in line
    assert line.startswith("cannot start the peer's network node: ")
    for remedy in ("--port", "--announce", "--client-mode", "other process"):
        assert remedy in line, remedy
