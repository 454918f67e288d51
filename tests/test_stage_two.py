"""A round's second stage (peer/stage_two.py) with round notes: the members' seals reach the
delegate as notes (the DHT still decides when a note is false), and the delegate's note sends its
members to replay the update from it. The rest of the round is faked here; real peers run it in
tests/test_two_stage.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any

import pytest

from diloco_peer.averaging import hierarchy
from diloco_peer.averaging.contribution import ContributionRejected
from diloco_peer.averaging.matchmaking import Group
from diloco_peer.coordinator_free.notes import Note, Notes
from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.coordinator_free.swarm_view import HeadChoice, SwarmView
from diloco_peer.errors import AllReduceFailed
from diloco_peer.peer import stage_two
from diloco_peer.peer.heads import Activity
from diloco_peer.peer.stage_two import StageTwo

LEADER, ME, OTHER = "leader", "me", "other"
HASH = "ab" * 32


class Box(Notes):
    """Notes as a NoteBox holds them, posting into a list."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[tuple[str, Note, int, bytes]] = []

    def post(self, peer: str, kind: Note, version: int, body: bytes = b"") -> None:
        self.posted.append((peer, kind, version, body))

    def wait(self, kind: Note, version: int, senders: Collection[str], timeout_s: float) -> bool:
        return super().wait(kind, version, senders, min(timeout_s, 0.01))


def member(
    box: Box | None, moves_on_hint: bool = True, heads: dict[str, PeerHead] | None = None
) -> tuple[Any, list[Any]]:
    """A round of a member that is not its group's delegate, at version 3; `heads`: the live
    heads its catch-up reads (SwarmPeer.catch_up's choice, and its `accept`)."""
    calls: list[Any] = []
    replica = SimpleNamespace(version=3, updates={})

    def catch_up(
        hint: HeadChoice | None = None,
        publish: bool = True,
        accept: Callable[[SwarmView, HeadChoice], bool] | None = None,
    ) -> bool:
        calls.append((hint, publish))
        if hint is not None and moves_on_hint:
            replica.version = hint.version
            return True
        if hint is None and heads:
            view = SwarmView(ME, replica.version, HASH, dict(heads))
            choice = view.choose_head(replay_window=2)
            if choice is not None and (accept is None or accept(view, choice)):
                replica.version = choice.version
                return True
        return False

    published: list[bool] = []
    rnd = SimpleNamespace(
        me=ME, replica=replica, notes=lambda: box, catch_up=catch_up,
        counters=SimpleNamespace(wait_s=0.0),
        heads=SimpleNamespace(publish=lambda: published.append(True)),
        keep=lambda mine, why, t0: ("kept", why),
    )  # fmt: skip
    rnd.published = published
    return rnd, calls


def test_the_delegates_note_sends_a_member_to_replay_from_the_delegate() -> None:
    box = Box()
    box.add(LEADER, Note.UPDATE, 3, HASH.encode())
    rnd, calls = member(box)
    outcome = StageTwo()._await(rnd, None, LEADER, (0, 0), 1.0, 0.0, 1e18, None)  # type: ignore[arg-type]
    hint, publish = calls[0]
    assert hint == HeadChoice(4, HASH, (LEADER,), lost_fork=False, endorsed=False)
    assert publish is False  # the round publishes our head once, as it settles
    # this fake replica keeps no record of it: kept, and the head we moved to is published
    assert outcome == ("kept", "our group's combined update never came")
    assert rnd.published == [True]


@pytest.mark.parametrize("body", [b"", b"zz" * 32, HASH.encode()[:-1], ("é" * 32).encode()])
def test_a_note_that_names_no_hash_is_not_followed(body: bytes) -> None:
    box = Box()
    box.add(LEADER, Note.UPDATE, 3, body)
    box.add(OTHER, Note.UPDATE, 3, HASH.encode())  # not our delegate's
    rnd, calls = member(box)
    outcome = StageTwo()._await(rnd, None, LEADER, (0, 0), 1.0, 0.0, time.time() + 0.3, None)  # type: ignore[arg-type]
    assert outcome == ("kept", "our group's combined update never came")
    assert calls and all(hint is None for hint, _ in calls)
    assert rnd.published == []  # we never moved


def test_a_hint_that_does_not_replay_is_tried_once_then_the_heads_are_watched() -> None:
    box = Box()
    box.add(LEADER, Note.UPDATE, 3, HASH.encode())
    rnd, calls = member(box, moves_on_hint=False)
    StageTwo()._await(rnd, None, LEADER, (0, 0), 1.0, 0.0, time.time() + 1.2, None)  # type: ignore[arg-type]
    hints = [hint for hint, _ in calls]
    assert hints[0] is not None and all(h is None for h in hints[1:]) and len(hints) >= 2


def test_a_waiting_member_does_not_follow_another_peers_state_on_its_version() -> None:
    """A lone commit at v4 while our group's delegate combines on v3: the member stays for its
    group's update (else the update loses the fork vote by the members that left it), and
    goes where its delegate goes."""
    now, delegate, lone = time.time(), "Dpeer", "Apeer"  # peer ids are base58
    heads = {
        lone: PeerHead(peer_id=lone, version=4, state_hash="cd" * 32, updated=now),
        delegate: PeerHead(peer_id=delegate, version=3, state_hash=HASH, updated=now),
    }
    rnd, calls = member(Box(), heads=heads)
    outcome = StageTwo()._await(rnd, None, delegate, (0, 0), 1.0, 0.0, time.time() + 0.3, None)  # type: ignore[arg-type]
    assert outcome == ("kept", "our group's combined update never came")
    assert rnd.replica.version == 3 and len(calls) >= 2 and rnd.published == []
    heads[delegate] = PeerHead(peer_id=delegate, version=4, state_hash="cd" * 32, updated=now)
    rnd, _ = member(Box(), heads=heads)
    StageTwo()._await(rnd, None, delegate, (0, 0), 1.0, 0.0, time.time() + 0.3, None)  # type: ignore[arg-type]
    assert rnd.replica.version == 4 and rnd.published == [True]


def delegate_round(box: Box | None, dht: dict[str, bytes]) -> tuple[Any, list[int]]:
    reads: list[int] = []

    def read(version: int) -> dict[str, bytes]:
        reads.append(version)
        return dict(dht)

    rnd = SimpleNamespace(
        me=LEADER, notes=lambda: box, certifier=SimpleNamespace(read=read),
        guard=SimpleNamespace(signed_headers=lambda members: {m: b"h" for m in members},
                              allow=lambda p: True),
    )  # fmt: skip
    return rnd, reads


@pytest.fixture
def good_seals_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_material that accepts a group's material only when every seal in it is b"good"."""

    def check(me: str, raw: bytes, rules: Any, allow: Any) -> str:
        seals = json.loads(raw)["seals"]
        if set(seals) != {ME, OTHER} or set(seals.values()) != {"good"}:
            raise ContributionRejected(f"seals {seals}")
        return "material"

    monkeypatch.setattr(stage_two, "check_material", check)


@pytest.mark.usefixtures("good_seals_only")
def test_the_members_notes_give_the_delegate_its_material_without_the_dht() -> None:
    box = Box()
    box.add(ME, Note.SEAL, 3, b"good")
    box.add(OTHER, Note.SEAL, 3, b"good")
    rnd, reads = delegate_round(box, {})
    own = StageTwo()._own_material(rnd, SimpleNamespace(version=3), (LEADER, ME, OTHER), "d")  # type: ignore[arg-type]
    assert own is not None and own[0] == "material"
    assert reads == []


@pytest.mark.usefixtures("good_seals_only")
def test_a_false_note_is_overruled_by_the_dht() -> None:
    box = Box()
    box.add(ME, Note.SEAL, 3, b"good")
    box.add(OTHER, Note.SEAL, 3, b"forged")
    rnd, reads = delegate_round(box, {OTHER: b"good"})
    own = StageTwo()._own_material(rnd, SimpleNamespace(version=3), (LEADER, ME, OTHER), "d")  # type: ignore[arg-type]
    assert own is not None and reads == [3]


@pytest.mark.usefixtures("good_seals_only")
def test_without_notes_the_delegate_reads_the_dht_as_before() -> None:
    rnd, reads = delegate_round(None, {ME: b"good", OTHER: b"good"})
    own = StageTwo()._own_material(rnd, SimpleNamespace(version=3), (LEADER, ME, OTHER), "d")  # type: ignore[arg-type]
    assert own is not None and reads == [3]


def test_the_delegate_tells_its_groups_other_members_the_result_hash() -> None:
    box = Box()
    rnd = SimpleNamespace(me=LEADER, notes=lambda: box)
    result = SimpleNamespace(contributors=[LEADER, ME, OTHER])
    record = SimpleNamespace(base_version=3, result_hash=HASH)
    StageTwo().tell_members(rnd, result, record)  # type: ignore[arg-type]
    assert sorted(box.posted) == [(ME, Note.UPDATE, 3, HASH.encode()),
                                  (OTHER, Note.UPDATE, 3, HASH.encode())]  # fmt: skip


def test_a_combine_waits_for_one_more_groups_all_reduce_bounded_by_the_timeout() -> None:
    late = hierarchy.LATE_SLACK_S
    assert hierarchy.combine_window(10.0, 1.5, 60.0) == pytest.approx(10.0 + 3.0 + late)
    assert hierarchy.combine_window(10.0, 40.0, 60.0) == pytest.approx(70.0)  # the timeout


def test_the_combine_groups_connections_are_never_redialled_while_its_all_reduce_runs() -> None:
    # on a slow link the DHT's pings wait behind the combine's bulk transfer; the rejoiner must
    # not drop the connections it uses (Activity.exchanging), and forgets them once it returns
    seen: list[frozenset[str]] = []

    class Averager:
        def average(self, key: str, *args: Any, admit: Callable[[Group], Any], **kw: Any) -> Any:
            admit(Group(key, b"g", (LEADER, ME, OTHER), (1.0, 1.0, 1.0), (b"", b"", b""),
                        (False, False, False), b"d", LEADER))  # fmt: skip
            seen.append(activity.exchanging)
            raise AllReduceFailed("a member's stream broke")

    activity = Activity()
    rnd = SimpleNamespace(
        me=ME, activity=activity, averager=Averager,
        swarm=SimpleNamespace(group_size=2, allreduce_timeout_s=30.0),
        guard=SimpleNamespace(admitted={}, allow=lambda peer: True,
                              exclude_unproven=lambda excluded, version: None),
    )  # fmt: skip
    result = SimpleNamespace(contributors=[ME], average=[], allreduce_s=1.0)
    rules = SimpleNamespace(version=3)
    with pytest.raises(AllReduceFailed):
        StageTwo()._combine(rnd, "key", rules, result, b"", 5.0)  # type: ignore[arg-type]
    assert seen == [frozenset({LEADER, OTHER})]
    assert activity.exchanging == frozenset()


def test_the_exchange_context_names_a_downloads_donors_until_it_ends_even_when_it_fails() -> None:
    activity = Activity()
    with pytest.raises(RuntimeError), activity.exchange(["d1", "d2"]):
        assert activity.exchanging == {"d1", "d2"}
        raise RuntimeError("the download broke")
    assert activity.exchanging == frozenset()
