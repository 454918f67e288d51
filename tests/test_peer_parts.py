"""Parts of a peer without a network: the heartbeat, the fault plan, the δ ledger, the lifecycle
every background part shares."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from diloco_peer.errors import ConfigError, PartStopped
from diloco_peer.lifecycle import BackgroundPart, ready_now
from diloco_peer.peer.chaos import Chaos
from diloco_peer.peer.delta import Contribution, Ledger
from diloco_peer.peer.faults import FaultPlan
from diloco_peer.peer.heads import Heartbeat


def wait_until(condition, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.mark.timeout(30)
def test_the_heartbeat_survives_any_exception_and_stops_on_shutdown() -> None:
    beats: list[float] = []

    def publish() -> None:
        beats.append(time.monotonic())
        if len(beats) % 2:  # every other beat fails, and not with a DilocoError
            raise RuntimeError("the DHT process is gone")

    heartbeat = Heartbeat(publish, threading.Event(), period_s=0.01)
    heartbeat.start()
    heartbeat.wait_until_ready(1.0)
    assert wait_until(lambda: len(beats) >= 6)
    assert heartbeat.failures >= 3
    heartbeat.shutdown()
    heartbeat.shutdown()  # idempotent
    after = len(beats)
    time.sleep(0.1)
    assert len(beats) == after
    assert not any(t.name == "heartbeat" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(30)
def test_a_paused_peer_sends_no_heartbeat() -> None:
    beats: list[int] = []
    paused = threading.Event()
    paused.set()
    heartbeat = Heartbeat(lambda: beats.append(1), paused, period_s=0.01)
    heartbeat.start()
    time.sleep(0.1)
    assert beats == []
    paused.clear()
    assert wait_until(lambda: len(beats) >= 2)
    heartbeat.shutdown()


@pytest.mark.timeout(30)
def test_a_head_asked_for_is_stored_at_once_and_the_caller_does_not_wait() -> None:
    stored: list[float] = []
    gate = threading.Event()

    def publish() -> None:  # a DHT store that takes a while, as behind a busy link
        gate.wait(5.0)
        stored.append(time.monotonic())

    wake = threading.Event()
    heartbeat = Heartbeat(publish, threading.Event(), period_s=60.0, wake=wake)
    heartbeat.start()
    heartbeat.wait_until_ready(1.0)
    t0 = time.monotonic()
    wake.set()  # HeadChannel.publish_soon: what the training thread calls
    assert time.monotonic() - t0 < 0.05
    time.sleep(0.1)
    wake.set()  # asked again while the first store is under way: one more store, not lost
    gate.set()
    assert wait_until(lambda: len(stored) >= 2)
    assert stored[-1] - t0 < 5.0  # long before the 60 s beat
    time.sleep(0.2)
    assert len(stored) == 2  # nothing asked since: no store until the next beat
    t1 = time.monotonic()
    heartbeat.shutdown()
    assert time.monotonic() - t1 < 2.0  # out of its 60 s wait at once
    assert not any(t.name == "heartbeat" and t.is_alive() for t in threading.enumerate())


class Slow(BackgroundPart):
    def __init__(self) -> None:
        super().__init__()
        self.ended = 0
        self.gate = threading.Event()

    def _begin(self):  # noqa: ANN202
        import concurrent.futures

        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        threading.Thread(target=lambda: (self.gate.wait(), future.set_result(None))).start()
        return future

    def _end(self) -> None:
        self.ended += 1


def test_the_lifecycle_is_start_once_ready_with_a_timeout_and_idempotent_shutdown() -> None:
    part = Slow()
    with pytest.raises(RuntimeError, match="start"):
        part.wait_until_ready(0.1)  # not started
    part.start()
    with pytest.raises(RuntimeError, match="started once"):
        part.start()
    with pytest.raises(TimeoutError, match="not ready within"):
        part.wait_until_ready(0.05)
    part.gate.set()
    part.wait_until_ready(5.0)
    part.shutdown()
    part.shutdown()
    assert part.ended == 1 and part.stopped
    never = Slow()
    never.shutdown()  # safe before start: nothing to end
    assert never.ended == 0
    with pytest.raises(RuntimeError):
        never.start()


def test_a_part_cancelled_before_it_was_ready_says_so() -> None:
    import concurrent.futures

    class Cancelled(BackgroundPart):
        def _begin(self) -> concurrent.futures.Future[None]:
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            future.cancel()
            return future

        def _end(self) -> None:
            pass

    part = Cancelled()
    part.start()
    with pytest.raises(PartStopped):
        part.wait_until_ready(1.0)
    ready = Cancelled()
    ready._begin = ready_now  # type: ignore[method-assign]
    ready.start()
    ready.wait_until_ready(0.1)


def test_the_fault_plan_parses_flags_and_refuses_bad_ones() -> None:
    plan = FaultPlan.parse(["kill-in-group=2", "alone-rounds=1"], "scale=5")
    assert plan == FaultPlan(kill_in_group=2, alone_rounds=1, chaos=Chaos("scale", 5.0))
    assert FaultPlan.parse() == FaultPlan()
    assert FaultPlan().group_hook() is None
    for bad in (["nope=1"], ["kill-in-group"], ["kill-in-group=x"], ["alone-rounds=-1"]):
        with pytest.raises(ConfigError):
            FaultPlan.parse(bad)


def test_alone_rounds_hide_the_others_only_once_trained_and_for_n_rounds() -> None:
    plan = FaultPlan(alone_rounds=2)
    assert not plan.hides_others(0, started_training=False)  # waits for expected peers first
    assert plan.hides_others(0, started_training=True)
    assert plan.hides_others(1, started_training=True)
    assert not plan.hides_others(2, started_training=True)
    assert not FaultPlan().hides_others(0, started_training=True)


def delta(value: float, base: int, shard: int, steps: int) -> Contribution:
    return Contribution([torch.full((2,), value)], base, {shard: steps * 4}, steps)


def test_the_ledger_merges_pending_and_recontributes_only_the_lost_version() -> None:
    ledger = Ledger()
    fresh = delta(1.0, 5, 0, 10)
    assert ledger.take(fresh) is fresh
    ledger.add(delta(2.0, 3, 1, 5))  # a δ kept from a failed group
    merged = ledger.take(fresh)
    assert merged.delta[0].tolist() == [3.0, 3.0] and merged.base_version == 3
    assert merged.shard_samples == {1: 20, 0: 40} and merged.steps == 15
    assert ledger.pending is None
    ledger.last_own = (6, fresh)
    assert ledger.owns(6) and not ledger.owns(5)
    assert not ledger.recontribute(5)  # another version lost: not ours
    assert ledger.recontribute(6)
    assert ledger.pending is fresh and ledger.last_own is None
    assert not ledger.recontribute(6)  # only once
    assert not ledger.owns(6)


def run_interleaved(threads: list[threading.Thread]) -> None:
    """Start `threads` and wait for them, switching between them as often as the interpreter
    can (races show within a few hundred iterations)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.timeout(60)
def test_the_ban_list_holds_under_four_threads() -> None:
    """The network loop and the round ban, the heartbeat, the metrics and the headers read: no
    read sees a half-changed list, no ban is lost."""
    from diloco_peer.averaging.marks import BanList

    bans = BanList(ban_rounds=1_000_000)
    errors: list[BaseException] = []
    per_thread = 2_000

    def writer(tag: str) -> None:
        for i in range(per_thread):
            bans.ban(f"{tag}{i}", "norm above bound", version=i)

    def reader() -> None:
        try:
            for i in range(0, per_thread, 10):
                bans.active(i)
                bans.for_header(i)
                _ = bans.total
        except BaseException as e:  # dictionary changed size during iteration, ...
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in ("A", "B")]
    run_interleaved(threads + [threading.Thread(target=reader) for _ in range(2)])
    assert errors == []
    assert bans.total == 2 * per_thread
    assert len(bans.active(0)) == 2 * per_thread


def test_signals_stop_pause_and_resume_the_peer() -> None:
    """SIGTERM and Ctrl+C stop at a safe point, SIGUSR1 pauses, SIGUSR2 resumes (`join`)."""
    import os
    import signal

    from diloco_peer.peer.signals import install_signal_handlers

    class Peer:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def request_stop(self) -> None:
            self.calls.append("stop")

        def request_pause(self) -> None:
            self.calls.append("pause")

        def request_resume(self) -> None:
            self.calls.append("resume")

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    before = {s: signal.getsignal(s) for s in signals}
    peer = Peer()
    try:
        install_signal_handlers(peer)
        for n, s in enumerate((signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)):
            os.kill(os.getpid(), s)
            assert wait_until(lambda n=n: len(peer.calls) == n + 1)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert peer.calls == ["pause", "resume", "stop", "stop"]


class FromDonor:
    """Catch-up's downloads, answered by another replica in this process."""

    def __init__(self, donor: object) -> None:
        self.donor = donor
        self.calls: list[str] = []

    def update(self, donor: str, base_version: int) -> bytes:
        from diloco_peer.coordinator_free.state_transfer import StateTransferFailed
        from diloco_peer.errors import TransferFailure

        self.calls.append("update")
        data = self.donor.updates.get(base_version)  # type: ignore[attr-defined]
        if data is None:
            raise StateTransferFailed("no such update", kind=TransferFailure.REFUSED)
        return data

    def state(self, donor: str):  # noqa: ANN201
        self.calls.append("state")
        return self.donor.blob  # type: ignore[attr-defined]

    state_multi = state


@pytest.mark.timeout(60)
def test_a_replica_keeps_only_the_updates_a_replay_can_ask_for() -> None:
    """Nesterov's state is θ and its momentum: a peer 2 versions behind replays (also from a
    donor that committed once more meanwhile), one 3 behind downloads the state. So the log
    holds 3 updates, not L = 16, and its bytes stay flat however long the run."""
    from diloco_peer.averaging.outer import build_outer_optimizer
    from diloco_peer.averaging.state import ReplicatedState
    from diloco_peer.coordinator_free.swarm_view import HeadChoice
    from diloco_peer.coordinator_free.update_log import UpdateLog
    from diloco_peer.peer.catch_up import CatchUp
    from diloco_peer.peer.replica import Replica

    shapes = [(64, 64), (64,)]  # 16.6 kB per update, well above the state's header

    def replica() -> Replica:
        theta = [torch.full(s, 0.5) for s in shapes]
        outer = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
        r = Replica(ReplicatedState(theta, outer, num_shards=2, manifest_digest="m" * 64),
                    UpdateLog(16))  # fmt: skip
        r.snapshot()
        return r

    def commit(r: Replica, version: int) -> None:
        r.commit([torch.full(s, 0.01 * (version + 1)) for s in shapes], ["A"], {0: 8}, {})

    donor, two_behind, three_behind = replica(), replica(), replica()
    assert donor.updates.capacity == 2  # version 0 holds θ alone: replay horizon 1
    sizes = []
    for v in range(20):  # the same updates on all three, until each stops
        commit(donor, v)
        sizes.append(donor.updates.nbytes())
        assert donor.updates.capacity == 3 and len(donor.updates) == min(v + 1, 3)
        if v < 18:
            commit(two_behind, v)
        if v < 17:
            commit(three_behind, v)
    assert len(set(sizes[2:])) == 1  # flat
    assert (donor.version, two_behind.version, three_behind.version) == (20, 18, 17)
    choice = HeadChoice(20, donor.published_hash, ("A",), lost_fork=False)
    downloads = FromDonor(donor)
    moved = CatchUp(three_behind, downloads, me="C", keep_updates=16, verify=lambda r: None).run(
        choice
    )
    assert moved is not None and moved.method == "download" and downloads.calls == ["state"]
    assert three_behind.published_hash == choice.state_hash
    commit(donor, 20)  # the donor moves on between our reading its head and the replay
    assert (donor.updates.oldest(), donor.updates.newest()) == (18, 20)
    downloads = FromDonor(donor)
    moved = CatchUp(two_behind, downloads, me="B", keep_updates=16, verify=lambda r: None).run(
        choice
    )
    assert moved is not None and moved.method == "replay" and downloads.calls == ["update"] * 2
    assert two_behind.published_hash == choice.state_hash and two_behind.version == 20


@pytest.mark.timeout(60)
def test_the_head_book_holds_under_the_threads_that_share_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The round thread and the training thread (a phase's extension, an overlapped round)
    both read the swarm's view, which merges each DHT read into the book, while the round
    marks peers absent and the rejoiner reads every head: no reader may see a half-changed
    book (dictionary changed size during iteration, a head without its receipt time)."""
    from diloco_peer.averaging.outer import build_outer_optimizer
    from diloco_peer.averaging.state import ReplicatedState
    from diloco_peer.coordinator_free import records
    from diloco_peer.identity import Identity
    from diloco_peer.peer.heads import Activity, Facts, HeadChannel
    from diloco_peer.peer.replica import Replica, UpdateLog
    from diloco_peer.peer.telemetry import Counters

    reads = iter(range(1, 10**9))
    digits = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"

    def name(n: int, i: int) -> str:  # a peer id hivemind's alphabet allows
        text = ""
        while n:
            n, d = divmod(n, len(digits))
            text = digits[d] + text
        return f"Peer{text}x{digits[i]}"

    def read_heads(dht: object, run: str, **kwargs: object) -> dict[str, records.PeerHead]:
        # every read brings new peers and departures of older ones: the book grows and shrinks
        n, now = next(reads), time.time()
        heads = {name(n, i): records.PeerHead(peer_id=name(n, i), version=n,
                                                  state_hash="ab" * 32, updated=now)
                 for i in range(8)}  # fmt: skip
        if n > 2:
            gone = name(n - 2, 0)
            heads[gone] = records.PeerHead(peer_id=gone, version=n, state_hash="ab" * 32,
                                           updated=0.0)  # fmt: skip
        return heads

    monkeypatch.setattr(records, "read_heads", read_heads)
    me = Identity.generate()
    state = ReplicatedState([torch.zeros(2)], build_outer_optimizer("sgd", lr=1.0), 2, "m" * 64)
    facts = Facts(speed=lambda: 1.0, batch_size=4, client_mode=lambda: False,
                  bans=lambda: None, resources=lambda: {})  # fmt: skip
    channel = HeadChannel(
        lambda: object(), me, "run1", allow=lambda p: True,  # type: ignore[arg-type,return-value]
        replica=Replica(state, UpdateLog(4)), counters=Counters(), activity=Activity(),
        facts=facts, faults=FaultPlan(),
    )  # fmt: skip
    errors: list[BaseException] = []
    per_thread = 300

    def guarded(work: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                for i in range(per_thread):
                    work(i)
            except BaseException as e:
                errors.append(e)

        return run

    def absent(i: int) -> None:
        channel.mark_absent([name(i + 1, 1), name(i + 1, 2)], present=(), now=time.time())

    def rejoiner(i: int) -> None:
        for peer, head in channel.seen().items():
            assert head.peer_id == peer
        channel.in_flight([0, 0], oldest_version=0)
        _ = channel.departed_version

    work = [lambda i: channel.view(), lambda i: channel.view(), absent, rejoiner]
    run_interleaved([threading.Thread(target=guarded(w)) for w in work])
    assert errors == []
    view = channel.view()
    assert len(view.heads) >= 8 and channel.departed_version > 0


@pytest.mark.timeout(10)
def test_a_head_published_during_a_commit_names_the_published_state() -> None:
    """Between a group's `prepare` and `publish` the state is one version ahead of the snapshot
    the state server hands out: a head (the heartbeat's, on its own thread) or a swarm view made
    then names the published version with its hash, never the new version with the old hash
    (a state nobody holds, which a peer that had committed the new version took for a fork it
    lost, and went back a version: netlab, a healed partition)."""
    from diloco_peer.averaging.outer import build_outer_optimizer
    from diloco_peer.averaging.state import ReplicatedState
    from diloco_peer.identity import Identity
    from diloco_peer.peer.heads import Activity, Facts, HeadChannel
    from diloco_peer.peer.replica import Replica, UpdateLog
    from diloco_peer.peer.telemetry import Counters

    state = ReplicatedState([torch.zeros(2)], build_outer_optimizer("sgd", lr=1.0), 2, "m" * 64)
    replica = Replica(state, UpdateLog(4))
    replica.snapshot()
    facts = Facts(speed=lambda: 1.0, batch_size=4, client_mode=lambda: False,
                  bans=lambda: None, resources=lambda: {})  # fmt: skip
    channel = HeadChannel(
        lambda: None, Identity.generate(), "run1", allow=lambda p: True, replica=replica,
        counters=Counters(), activity=Activity(), facts=facts, faults=FaultPlan(),
    )  # fmt: skip
    before = (0, replica.published_hash)
    record = replica.prepare([torch.ones(2)], ["a"], {0: 4}, {})
    assert replica.version == 1 and state.hash() != before[1]  # applied, not yet published
    head, view = channel.head(), channel.view()
    assert (head.version, head.state_hash) == before == (view.version, view.state_hash)
    replica.publish(record)
    head, view = channel.head(), channel.view()
    assert (head.version, head.state_hash) == (1, state.hash()) == (view.version, view.state_hash)
