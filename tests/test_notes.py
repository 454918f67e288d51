"""Round notes (coordinator_free/notes.py): the bounded store, the wire format, and two real
nodes on 127.0.0.1 posting to each other."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from conftest import loopback_services
from hivemind.p2p import P2P, PeerID

from diloco_peer.coordinator_free import notes as notes_module
from diloco_peer.coordinator_free.notes import (
    MAX_NOTE_BYTES,
    MAX_SENDERS,
    MAX_VERSIONS,
    Note,
    NoteBox,
    Notes,
    pack_note,
    unpack_note,
)
from diloco_peer.p2p.service import P2PService
from diloco_peer.p2p.streams import read_frame

PREFIX = "dp_test"


def test_a_note_round_trips_and_anything_else_is_refused() -> None:
    raw = pack_note(Note.SEAL, 7, b"seal")
    assert unpack_note(raw) == (Note.SEAL, 7, b"seal")
    assert unpack_note(pack_note(Note.UPDATE, 0, b"")) == (Note.UPDATE, 0, b"")
    for bad in (b"", raw[:5], b"XXXX" + raw[4:], raw[:4] + b"\x02" + raw[5:],
                raw[:5] + b"\x09" + raw[6:]):  # fmt: skip
        with pytest.raises(ValueError):
            unpack_note(bad)


def test_the_first_note_of_a_sender_is_kept_and_the_senders_are_bounded() -> None:
    kept = Notes()
    assert kept.add("a", Note.SEAL, 3, b"first")
    assert not kept.add("a", Note.SEAL, 3, b"second")  # a sender cannot replace its note
    assert kept.add("a", Note.UPDATE, 3, b"other kind")
    assert kept.received(Note.SEAL, 3) == {"a": b"first"}
    for i in range(MAX_SENDERS - 1):
        assert kept.add(f"s{i}", Note.SEAL, 3, b"x")
    assert not kept.add("one too many", Note.SEAL, 3, b"x")
    assert len(kept.received(Note.SEAL, 3)) == MAX_SENDERS


def test_the_oldest_versions_are_forgotten_first_and_older_ones_refused() -> None:
    kept = Notes()
    for v in range(10, 10 + MAX_VERSIONS):
        assert kept.add("a", Note.SEAL, v, b"x")
    assert not kept.add("a", Note.SEAL, 9, b"x")  # older than all kept: no slot taken
    assert kept.add("a", Note.SEAL, 10 + MAX_VERSIONS, b"x")  # forgets version 10
    assert kept.received(Note.SEAL, 10) == {}
    assert kept.received(Note.SEAL, 11) == {"a": b"x"}


def test_wait_returns_once_every_sender_posted_or_the_time_is_up() -> None:
    kept = Notes()
    t0 = time.monotonic()
    assert not kept.wait(Note.SEAL, 1, ["a"], 0.2)
    assert time.monotonic() - t0 >= 0.2
    later = threading.Timer(0.1, kept.add, ("a", Note.SEAL, 1, b"x"))
    later.start()
    try:
        assert kept.wait(Note.SEAL, 1, ["a"], 10.0)
    finally:
        later.cancel()
    assert not kept.wait(Note.SEAL, 1, ["a", "b"], 0.05)


@pytest.fixture(scope="module")
def boxes() -> Iterator[tuple[list[NoteBox], list[P2PService], dict[str, object]]]:
    """Two nodes with a note box each; `setting` holds what their rules read (the receivers'
    version, the peers the allowlist refuses)."""
    setting: dict[str, object] = {"version": 5, "refused": set()}
    made: list[NoteBox] = []
    with loopback_services(2) as services:
        try:
            for service in services:
                box = NoteBox(
                    service, PREFIX, allow=lambda p: p not in setting["refused"],  # type: ignore[operator]
                    version=lambda: setting["version"],  # type: ignore[arg-type,return-value]
                )  # fmt: skip
                made.append(box)
                box.start()
                box.wait_until_ready(30)
            yield made, services, setting
        finally:
            for box in made:
                box.shutdown()


@pytest.mark.timeout(60)
def test_a_posted_note_arrives_from_its_sender(
    boxes: tuple[list[NoteBox], list[P2PService], dict[str, object]],
) -> None:
    (a, b), (sa, sb), _ = boxes
    a.post(sb.peer_id, Note.SEAL, 5, b"a's seal")
    assert b.wait(Note.SEAL, 5, [sa.peer_id], 20)
    assert b.received(Note.SEAL, 5) == {sa.peer_id: b"a's seal"}
    b.post(sa.peer_id, Note.UPDATE, 4, b"h" * 64)  # a version within the window
    assert a.wait(Note.UPDATE, 4, [sb.peer_id], 20)


@pytest.mark.timeout(60)
def test_notes_far_from_the_receivers_version_or_from_refused_peers_are_not_kept(
    boxes: tuple[list[NoteBox], list[P2PService], dict[str, object]],
) -> None:
    (a, b), (sa, sb), setting = boxes
    a.post(sb.peer_id, Note.SEAL, 50, b"far ahead")
    a.post(sb.peer_id, Note.SEAL, 2, b"far behind")
    setting["refused"] = {sa.peer_id}
    try:
        a.post(sb.peer_id, Note.SEAL, 6, b"refused sender")
        assert not b.wait(Note.SEAL, 6, [sa.peer_id], 3)
    finally:
        setting["refused"] = set()
    assert b.received(Note.SEAL, 50) == {} and b.received(Note.SEAL, 2) == {}
    a.post(sb.peer_id, Note.SEAL, 6, b"allowed again")  # the box still serves
    assert b.wait(Note.SEAL, 6, [sa.peer_id], 20)


@pytest.mark.timeout(60)
def test_an_oversized_or_malformed_note_is_refused_and_the_box_keeps_serving(
    boxes: tuple[list[NoteBox], list[P2PService], dict[str, object]],
) -> None:
    (_, b), (sa, sb), _ = boxes

    async def send(raw: bytes) -> bytes | None:
        _, reader, writer = await sa.p2p.call_binary_stream_handler(
            PeerID.from_base58(sb.peer_id), f"{PREFIX}-notes"
        )
        try:
            await P2P.send_raw_data(raw, writer)
            return await read_frame(reader, 100, ValueError)
        except (ConnectionResetError, BrokenPipeError, EOFError):
            return None  # the box closed the stream without reading the rest
        finally:
            writer.close()

    assert sa.run(send(b"DLNO"), 20) in (b"NO", None)
    assert sa.run(send(pack_note(Note.SEAL, 7, b"x" * MAX_NOTE_BYTES)), 20) in (b"NO", None)
    assert b.received(Note.SEAL, 7) == {}
    assert sa.run(send(pack_note(Note.SEAL, 7, b"fits")), 20) == b"OK"
    assert b.received(Note.SEAL, 7) == {sa.peer_id: b"fits"}


def test_post_never_raises_for_a_peer_that_cannot_be_reached(
    boxes: tuple[list[NoteBox], list[P2PService], dict[str, object]],
) -> None:
    (a, _), _, _ = boxes
    nobody = "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51"
    a.post(nobody, Note.SEAL, 5, b"x")  # returns at once; delivery fails in the background
    a.post(nobody, Note.SEAL, 5, b"y" * (notes_module.MAX_NOTE_BYTES + 1))  # not even sent
