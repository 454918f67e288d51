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
    server -> requester : b"OK" | b"NO" + utf-8 reason

The server opens a plain TCP connection to the IP address the requester's stream comes from (as
its libp2p daemon observed it), at the port asked, within DIAL_TIMEOUT_S, and closes it at once.
It dials no other address, so nobody can aim it at a third party; it dials at most
MAX_DIALS addresses at once, and refuses more (b"NO" + "busy").

The requester concludes "public" from any b"OK", "private" when every server that answered said
b"NO" (a dial that timed out or was refused), "unknown" when none answered (old peers, busy
peers, a broken stream): then nothing is known, and join keeps the mode it was given.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from multiaddr import Multiaddr

from diloco_peer.p2p.handler import HandlerServer
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import STREAM_ERRORS, read_frame

logger = logging.getLogger(__name__)

_REQUEST = struct.Struct(">4sBH")
_MAGIC = b"DLDB"
_VERSION = 1
_OK, _NO = b"OK", b"NO"
_MAX_REASON_BYTES = 200
DIAL_TIMEOUT_S = 3.0
"""How long a server waits for the requester's port to accept a TCP connection."""
_HANDLER_TIMEOUT_S = 10.0
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


def _handler_name(prefix: str) -> str:
    return f"{prefix}_dialback"


def _observed_ip(addr: Multiaddr | None) -> str | None:
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
            answer = await self._answer(info, reader)
            await asyncio.wait_for(P2P.send_raw_data(answer, writer), _HANDLER_TIMEOUT_S)
        except STREAM_ERRORS as e:
            logger.debug("dial-back for %s not answered: %r", info.peer_id.to_base58()[-6:], e)
        finally:
            writer.close()

    async def _answer(self, info: StreamInfo, reader: asyncio.StreamReader) -> bytes:
        try:
            raw = await asyncio.wait_for(
                read_frame(reader, _REQUEST.size, ValueError), _HANDLER_TIMEOUT_S
            )
        except ValueError:
            return _NO + b"bad request"
        if len(raw) != _REQUEST.size:
            return _NO + b"bad request"
        magic, version, port = _REQUEST.unpack(raw)
        if magic != _MAGIC or version != _VERSION or port == 0:
            return _NO + b"bad request"
        ip = _observed_ip(info.addr)
        if ip is None:
            return _NO + f"no IP address observed ({info.addr})".encode()[:_MAX_REASON_BYTES]
        if self._dialing >= MAX_DIALS:
            return _NO + b"busy"
        self._dialing += 1
        try:
            failure = await dial(ip, port, DIAL_TIMEOUT_S)
        finally:
            self._dialing -= 1
        requester = info.peer_id.to_base58()[-6:]
        logger.info("dial-back to %s at %s:%d: %s", requester, ip, port, failure or "ok")
        return _OK if failure is None else _NO + failure.encode()[:_MAX_REASON_BYTES]


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
    said: list[str] = []
    refused = 0
    for server in servers:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            answer = await asyncio.wait_for(_ask(service, prefix, server, port), left)
        except (*STREAM_ERRORS, ValueError) as e:
            said.append(f"{server[-6:]}: no answer ({type(e).__name__})")
            continue
        if answer[:2] == _OK:
            return Verdict("public", f"{server[-6:]} dialed this peer's port {port}")
        reason = answer[2:].decode("utf-8", errors="replace")[:_MAX_REASON_BYTES]
        said.append(f"{server[-6:]}: {reason}")
        if answer[:2] == _NO and reason not in ("busy", "bad request"):
            refused += 1
    status: Reachability = "private" if refused else "unknown"
    return Verdict(status, "; ".join(said) or "no peer to ask")


async def _ask(service: P2PService, prefix: str, server: str, port: int) -> bytes:
    p2p = await service.ready(_HANDLER_TIMEOUT_S)
    _, reader, writer = await p2p.call_binary_stream_handler(
        PeerID.from_base58(server), _handler_name(prefix)
    )
    try:
        await P2P.send_raw_data(_REQUEST.pack(_MAGIC, _VERSION, port), writer)
        return await read_frame(reader, 2 + _MAX_REASON_BYTES, ValueError)
    finally:
        writer.close()
