"""Can the swarm dial this peer? The dial-back probe behind `join`'s automatic client mode.

    server = DialBackServer(service, prefix)     # every peer that accepts connections
    server.start()
    ...
    verdict = probe(service, prefix, swarm_peer_ids, port=31337, timeout_s=10)   # a joiner
    if verdict.status == "private": ...          # restart in client mode (join does)

A peer behind a NAT or a firewall that refuses inbound connections can still open streams, and
libp2p runs the streams others open to it over connections it opened itself; so hivemind's own
checks (a validated DHT ping) pass behind any NAT, and the first sign of trouble would be a part
reducer that nobody can reach, failing a whole round. A joiner therefore asks a swarm peer to
dial it afresh, as libp2p's AutoNAT does, before it takes part as a full peer.

Wire protocol (v1), one libp2p stream on the handler `<prefix>_dialback`, frames as hivemind's
`P2P.send_raw_data` (8-byte big-endian length, then the payload):

    requester -> server : b"DLDB" + u8 version + u16 port (big-endian)
    server -> requester : b"OK" | b"NO" + utf-8 reason ("busy", "bad request", or why the dial
                          failed)

The server opens a plain TCP connection to the IP address the requester's stream comes from (as
its libp2p daemon observed it), at the port asked, within DIAL_TIMEOUT_S, and closes it at once.
It dials no other address, so nobody can aim it at a third party; it dials at most
MAX_DIALS addresses at once, and refuses more (b"NO" + "busy").

The requester concludes "public" from any b"OK", "private" when a server that answered said
b"NO" for a dial that timed out or was refused, "unknown" when none answered or none could try
(old peers, busy peers, a broken stream): then nothing is known, and join keeps the mode it was
given. `Reply.parse` turns an answer into a typed `DialBack` outcome, the one place its reason is
read; `conclude` (a pure function of the replies) gives the verdict.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from multiaddr import Multiaddr

from diloco_peer.p2p.handler import HANDLER_CALL_TIMEOUT_S, HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, read_frame

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct(">4sBH")
_MAGIC = b"DLDB"
_VERSION = 1
_OK, _NO = b"OK", b"NO"
_BUSY, _BAD_REQUEST = "busy", "bad request"
_MAX_REASON_BYTES = 200
DIAL_TIMEOUT_S = 3.0
"""How long a server waits for the requester's port to accept a TCP connection."""
_CALL_SLACK_S = 5.0
MAX_DIALS = 8
"""Dial-backs a server runs at once (joiners arriving together all get theirs)."""
_MAX_SERVERS = 2
"""Peers a probe asks, one after another, until one dials it (a NAT'd joiner waits for both
to time out: 2 × DIAL_TIMEOUT_S)."""

Reachability = Literal["public", "private", "unknown"]


@dataclass(frozen=True)
class Verdict:
    status: Reachability
    detail: str
    """Who said what, for the log."""


class DialBack(Enum):
    """What became of one dial-back request."""

    DIALED = "dialed"
    """b"OK": the server connected to the requester's port."""
    DIAL_FAILED = "dial failed"
    """b"NO" + why: the server tried, and the port did not accept (or it saw no IP to dial)."""
    BUSY = "busy"
    """b"NObusy": the server runs MAX_DIALS dial-backs already; it did not try."""
    BAD_REQUEST = "bad request"
    """b"NObad request": the server did not understand the request; it did not try."""
    MALFORMED = "malformed"
    """An answer that is neither b"OK" nor b"NO"."""
    NO_ANSWER = "no answer"
    """No answer at all (no handler, a broken stream, out of time): requester side only."""


@dataclass(frozen=True)
class Reply:
    """A server's answer to one dial-back request: the outcome, and the reason as sent (for
    DIAL_FAILED, the server's words on the dial; for NO_ANSWER, the error's type)."""

    outcome: DialBack
    reason: str = ""

    def encode(self) -> bytes:
        """The answer frame (never called for MALFORMED or NO_ANSWER)."""
        if self.outcome is DialBack.DIALED:
            return _OK
        return _NO + self.reason.encode()[:_MAX_REASON_BYTES]

    @classmethod
    def parse(cls, frame: bytes) -> Reply:
        """The answer a server sent: the one place its reason's words are read."""
        reason = frame[2:].decode("utf-8", errors="replace")[:_MAX_REASON_BYTES]
        if frame[:2] == _OK:
            return cls(DialBack.DIALED, reason)
        if frame[:2] != _NO:
            return cls(DialBack.MALFORMED, reason)
        if reason == _BUSY:
            return cls(DialBack.BUSY, reason)
        if reason == _BAD_REQUEST:
            return cls(DialBack.BAD_REQUEST, reason)
        return cls(DialBack.DIAL_FAILED, reason)


_BAD = Reply(DialBack.BAD_REQUEST, _BAD_REQUEST)


def conclude(port: int, replies: Sequence[tuple[str, Reply]]) -> Verdict:
    """The verdict on `port` from the servers' replies, in the order they were asked: "public"
    once one dialed it, "private" if one tried and failed, else "unknown" (nothing is known)."""
    said: list[str] = []
    refused = 0
    for server, reply in replies:
        if reply.outcome is DialBack.DIALED:
            return Verdict("public", f"{server[-6:]} dialed this peer's port {port}")
        if reply.outcome is DialBack.NO_ANSWER:
            said.append(f"{server[-6:]}: no answer ({reply.reason})")
            continue
        said.append(f"{server[-6:]}: {reply.reason}")
        if reply.outcome is DialBack.DIAL_FAILED:
            refused += 1
    status: Reachability = "private" if refused else "unknown"
    return Verdict(status, "; ".join(said) or "no peer to ask")


def _handler_name(prefix: str) -> str:
    return f"{prefix}_dialback"


def observed_ip(addr: Multiaddr | None) -> str | None:
    """The IP address of a stream's remote end, from the daemon's observed multiaddr."""
    if addr is None:
        return None
    for proto in ("ip4", "ip6"):
        try:
            text = addr.value_for_protocol(proto)
        except Exception:  # multiaddr raises its own error types for a missing protocol
            continue
        try:
            return str(ipaddress.ip_address(text))
        except ValueError:
            return None
    return None


async def dial(ip: str, port: int, timeout_s: float) -> str | None:
    """Open and close a TCP connection to ip:port; None on success, else why it failed."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer from {ip}:{port} within {timeout_s:.0f} s"
    except OSError as e:
        return f"{ip}:{port}: {e.strerror or type(e).__name__}"
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, asyncio.TimeoutError):
        pass
    return None


class DialBackServer(HandlerServer):
    """Answers dial-back requests on the service's loop (a peer that accepts connections)."""

    def __init__(self, service: P2PService, prefix: str) -> None:
        super().__init__(service)
        self._prefix = prefix
        self._dialing = 0  # loop thread only

    @property
    def handler_name(self) -> str:
        return _handler_name(self._prefix)

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            reply = await self._answer(info, reader)
            await asyncio.wait_for(
                P2P.send_raw_data(reply.encode(), writer), HANDLER_CALL_TIMEOUT_S
            )
        except STREAM_ERRORS as e:
            logger.debug("dial-back for %s not answered: %r", info.peer_id.to_base58()[-6:], e)
        finally:
            writer.close()

    async def _answer(self, info: StreamInfo, reader: asyncio.StreamReader) -> Reply:
        try:
            raw = await asyncio.wait_for(
                read_frame(reader, _REQUEST.size, ValueError), HANDLER_CALL_TIMEOUT_S
            )
        except ValueError:
            return _BAD
        if len(raw) != _REQUEST.size:
            return _BAD
        magic, version, port = _REQUEST.unpack(raw)
        if magic != _MAGIC or version != _VERSION or port == 0:
            return _BAD
        ip = observed_ip(info.addr)
        if ip is None:
            return Reply(DialBack.DIAL_FAILED, f"no IP address observed ({info.addr})")
        if self._dialing >= MAX_DIALS:
            return Reply(DialBack.BUSY, _BUSY)
        self._dialing += 1
        try:
            failure = await dial(ip, port, DIAL_TIMEOUT_S)
        finally:
            self._dialing -= 1
        requester = info.peer_id.to_base58()[-6:]
        logger.info("dial-back to %s at %s:%d: %s", requester, ip, port, failure or "ok")
        return Reply(DialBack.DIALED) if failure is None else Reply(DialBack.DIAL_FAILED, failure)


def probe(
    service: P2PService, prefix: str, servers: Sequence[str], *, port: int, timeout_s: float
) -> Verdict:
    """Ask up to two of `servers` (base58 peer ids) to dial this peer's `port`; see above."""
    if not 0 < port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    return service.run(
        _probe(service, prefix, list(servers)[:_MAX_SERVERS], port, timeout_s),
        timeout_s + _CALL_SLACK_S,
    )


async def _probe(
    service: P2PService, prefix: str, servers: list[str], port: int, timeout_s: float
) -> Verdict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    replies: list[tuple[str, Reply]] = []
    for server in servers:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            answer = await asyncio.wait_for(_ask(service, prefix, server, port), left)
        except (*STREAM_ERRORS, ValueError) as e:
            replies.append((server, Reply(DialBack.NO_ANSWER, type(e).__name__)))
            continue
        replies.append((server, Reply.parse(answer)))
        if replies[-1][1].outcome is DialBack.DIALED:
            break
    return conclude(port, replies)


async def _ask(service: P2PService, prefix: str, server: str, port: int) -> bytes:
    p2p = await service.ready(HANDLER_CALL_TIMEOUT_S)
    _, reader, writer = await p2p.call_binary_stream_handler(
        PeerID.from_base58(server), _handler_name(prefix)
    )
    try:
        await P2P.send_raw_data(_REQUEST.pack(_MAGIC, _VERSION, port), writer)
        return await read_frame(reader, 2 + _MAX_REASON_BYTES, ValueError)
    finally:
        writer.close()
