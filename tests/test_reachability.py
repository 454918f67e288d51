"""The dial-back probe (coordinator_free/reachability.py) between two real nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from conftest import loopback_services
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from diloco_peer.coordinator_free import reachability
from diloco_peer.coordinator_free.reachability import (
    DialBack,
    DialBackServer,
    Reply,
    conclude,
    observed_ip,
    probe,
)
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import read_frame

PREFIX = "dp_test"


def test_observed_ip_takes_the_address_and_nothing_else() -> None:
    assert observed_ip(Multiaddr("/ip4/10.213.0.3/tcp/31337")) == "10.213.0.3"
    assert observed_ip(Multiaddr("/ip6/::1/tcp/5")) == "::1"
    assert observed_ip(Multiaddr("/dns4/example.org/tcp/5")) is None
    assert observed_ip(None) is None


def test_replies_keep_their_bytes_and_parse_into_outcomes() -> None:
    for frame, outcome in (
        (b"OK", DialBack.DIALED),
        (b"NObusy", DialBack.BUSY),
        (b"NObad request", DialBack.BAD_REQUEST),
        (b"NO127.0.0.1:9: Connection refused", DialBack.DIAL_FAILED),
        (b"NOno IP address observed (None)", DialBack.DIAL_FAILED),
        (b"NObusy now", DialBack.DIAL_FAILED),  # the words are exact, not a prefix
        (b"XXbusy", DialBack.MALFORMED),
        (b"", DialBack.MALFORMED),
    ):
        reply = Reply.parse(frame)
        assert reply.outcome is outcome, frame
        if outcome is not DialBack.MALFORMED:
            assert reply.encode() == frame
    assert len(Reply(DialBack.DIAL_FAILED, "x" * 500).encode()) == 2 + 200


def test_verdict_from_the_replies() -> None:
    dialed, failed = Reply(DialBack.DIALED), Reply(DialBack.DIAL_FAILED, "no answer from x")
    busy, bad = Reply(DialBack.BUSY, "busy"), Reply(DialBack.BAD_REQUEST, "bad request")
    silent = Reply(DialBack.NO_ANSWER, "P2PHandlerError")
    assert conclude(9, []) == reachability.Verdict("unknown", "no peer to ask")
    assert conclude(9, [("aaaaaa1", failed), ("bbbbbb2", dialed)]).status == "public"
    assert conclude(9, [("aaaaaa1", dialed)]).detail == "aaaaa1 dialed this peer's port 9"
    private = conclude(9, [("aaaaaa1", busy), ("bbbbbb2", failed)])
    assert private == reachability.Verdict("private", "aaaaa1: busy; bbbbb2: no answer from x")
    unknown = conclude(9, [("aaaaaa1", busy), ("bbbbbb2", bad), ("cccccc3", silent)])
    assert unknown.status == "unknown"
    assert (
        unknown.detail == "aaaaa1: busy; bbbbb2: bad request; ccccc3: no answer (P2PHandlerError)"
    )


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[P2PService, P2PService, str]]:
    """A node serving dial-backs, and a second node that asks it; each with its P2P service."""
    with loopback_services(2) as services:
        server = DialBackServer(services[0], PREFIX)
        try:
            server.start()
            server.wait_until_ready(30)
            yield services[0], services[1], services[0].peer_id
        finally:
            server.shutdown()


@pytest.mark.timeout(60)
def test_an_open_port_is_public_and_a_closed_one_private(
    pair: tuple[P2PService, P2PService, str],
) -> None:
    _, asker, server_id = pair
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        verdict = probe(asker, PREFIX, [server_id], port=port, timeout_s=10)
        assert verdict.status == "public", verdict
    # nothing listens there any more: the server's dial is refused
    verdict = probe(asker, PREFIX, [server_id], port=port, timeout_s=10)
    assert verdict.status == "private" and server_id[-6:] in verdict.detail, verdict


@pytest.mark.timeout(60)
def test_no_server_to_ask_is_unknown_not_private(pair: tuple[P2PService, P2PService, str]) -> None:
    _, asker, server_id = pair
    # a peer without the handler (another prefix): no answer, so nothing is concluded
    verdict = probe(asker, "dp_other", [server_id], port=9, timeout_s=5)
    assert verdict.status == "unknown", verdict
    assert probe(asker, PREFIX, [], port=9, timeout_s=5).status == "unknown"
    with pytest.raises(ValueError):
        probe(asker, PREFIX, [server_id], port=0, timeout_s=5)


@pytest.mark.timeout(60)
def test_a_malformed_request_is_refused(pair: tuple[P2PService, P2PService, str]) -> None:
    _, asker, server_id = pair

    async def ask(raw: bytes) -> bytes | None:
        """The server's answer, or None when it closed the stream without one reaching us."""
        _, reader, writer = await asker.p2p.call_binary_stream_handler(
            PeerID.from_base58(server_id), f"{PREFIX}_dialback"
        )
        try:
            await P2P.send_raw_data(raw, writer)
            return await read_frame(reader, 1000, ValueError)
        except (ConnectionResetError, BrokenPipeError):
            return None
        finally:
            writer.close()

    for raw in (
        b"",
        b"DLDB",
        b"XXXX\x01\x00\x50",
        b"DLDB\x01\x00\x00",
        b"DLDB\x09\x00\x50",
    ):
        answer = asker.run(ask(raw), 20)
        assert answer == b"NObad request", (raw, answer)
    # Longer than a request: the server reads only the length header, answers and closes the
    # stream with the rest unread, which resets it; whether the answer gets here first is a
    # race (a 50-byte request usually wins it, 4 MB never does). Either way the server did not
    # dial, and it still answers the next request.
    for raw in (b"x" * 50, b"x" * 4_000_000):
        answer = asker.run(ask(raw), 20)
        assert answer in (b"NObad request", None), (len(raw), answer)
        assert asker.run(ask(b"DLDB\x09\x00\x50"), 20) == b"NObad request"


def test_dial_reports_why_it_failed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        failure = asyncio.run(reachability.dial("127.0.0.1", port, 2.0))
    assert failure is not None and str(port) in failure
