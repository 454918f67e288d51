"""What every stream protocol of the package (part exchange, state transfer, dial-back) needs:
the errors a broken stream raises, a bounded frame reader, and the answer linger.

Frames are `P2P.send_raw_data`'s: an 8-byte big-endian length, then that many bytes.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError

STREAM_ERRORS: tuple[type[BaseException], ...] = (
    P2PDaemonError,
    P2PHandlerError,
    OSError,
    EOFError,
    asyncio.TimeoutError,
    struct.error,
)
"""What a broken, refused or timed-out stream raises (ConnectionError is an OSError,
IncompleteReadError an EOFError)."""

ANSWER_LINGER_S = 10.0
"""How long a server keeps an answered stream open for the requester to close it (`linger`)."""


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int, error: Callable[[str], Exception]
) -> bytes:
    """One `P2P.send_raw_data` frame, refusing one longer than `max_bytes` before reading it
    (raises `error(reason)`): a peer's length prefix never sizes an allocation by itself."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise error(f"frame of {length} bytes, at most {max_bytes} expected")
    return await reader.readexactly(length)


def framed_size(data: bytes) -> int:
    """Bytes `data` takes on the stream as one frame: the length prefix, then the data."""
    return P2P.HEADER_LEN + len(data)


async def linger(reader: asyncio.StreamReader, timeout_s: float = ANSWER_LINGER_S) -> bool:
    """Wait until the requester has read the answer and closed its end (True), or `timeout_s`
    passed or the stream broke (False). Closing a served stream right after the last write
    sometimes cut the answer off on the requester's side under load (IncompleteReadError with 0
    bytes read, seen in CI with 6 peers on 2 cores), for state answers and all-reduce answers."""
    try:
        await asyncio.wait_for(reader.read(1), timeout_s)
    except (asyncio.TimeoutError, *STREAM_ERRORS):
        return False
    return True


def consume(future: asyncio.Future[object]) -> None:
    """Done-callback of an abandoned future: read its exception, so that asyncio does not log
    it as never retrieved."""
    if not future.cancelled():
        future.exception()
