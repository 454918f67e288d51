"""The protocol simulator (swarm_sim/): virtual-time rounds of many peers with the swarm's own
rules. Exact timings where the model allows them, the failure modes the real swarm shows (a
second group on one base gives up or forks, a crash fails its group, stale δs are dropped), and
the two-stage combination keeping one version per round."""

from __future__ import annotations

import math

import pytest

from diloco_peer.coordinator_free.records import PeerHead
from diloco_peer.errors import ConfigError
from diloco_peer.swarm_sim.engine import Delta, SwarmSim, peer_name, simulate_swarm
from diloco_peer.swarm_sim.hierarchy import delegate
from diloco_peer.swarm_sim.spec import SwarmSimSpec
from diloco_peer.swarm_sim.swarm import GENESIS, Dht, History

EVEN = dict(heterogeneity="none", jitter=0.0, step_s=1.0, inner_steps=50, hours=0.5)
"""Equal devices: 50 s phases."""
EXACT = dict(jitter=0.0)
"""Phases exactly as long as their steps: the mechanism alone."""


def test_one_group_rounds_take_a_phase_plus_the_all_reduce_exactly() -> None:
    spec = SwarmSimSpec(peers=4, group_size=64, **EVEN)
    doc = simulate_swarm(spec)
    # int8 δ of 80 MB: 20 MB; each member moves 2 (n-1)/n of it at 12.5 MB/s, plus the round's
    # overhead and two latencies
    allreduce_s = 2 * 20e6 * 3 / 4 / 12.5e6 + 1.0 + 2 * 0.05
    assert doc["versions"] == math.floor(1800 / (50 + allreduce_s))
    assert doc["forks"] == 0
    assert doc["groups"] == {"failed": 0, "gave_up_to_a_rival": 0, "gave_up_moved_past": 0}
    assert doc["applied_fraction"] == 1.0
    assert doc["phases"]["applied"] == 4 * doc["versions"]
    assert doc["group_size"] == {"mean": 4.0, "max": 4}
    assert doc["bytes_per_peer_version"]["received_models"] == pytest.approx(0.25 * 2 * 3 / 4)
    assert doc["wait_s"]["mean"] == pytest.approx(allreduce_s)


def test_an_applied_versions_cost_is_paid_once_per_version_whatever_the_stages() -> None:
    """`apply_s` (sealing, evaluation) delays each peer's next phase once per version; the
    per-group cost is paid by each stage. Exact for one group; two stages pay apply_s once."""
    one = simulate_swarm(SwarmSimSpec(peers=4, group_size=64, apply_s=10.0, **EVEN))
    allreduce_s = 2 * 20e6 * 3 / 4 / 12.5e6 + 1.0 + 2 * 0.05
    assert one["versions"] == math.floor(1800 / (50 + allreduce_s + 10.0))
    spec = dict(peers=16, group_size=4, hierarchy="two-stage", hours=0.5, **EXACT)
    base = simulate_swarm(SwarmSimSpec(**spec))
    slower = simulate_swarm(SwarmSimSpec(**spec, apply_s=10.0))
    # a version every phase + stages + replay (+ 10 s): between one and two apply_s slower
    per_version = 1800 / base["versions"]
    assert 1800 / (per_version + 10.0) * 0.9 <= slower["versions"] <= base["versions"]
    assert slower["applied_fraction"] == 1.0 and slower["forks"] == 0


def test_a_two_stage_updates_commit_time_delays_only_its_replays() -> None:
    """`commit_s`: a delegate's sealing and head before the other members can replay; one
    group's members all commit themselves and never wait for it."""
    flat = SwarmSimSpec(peers=4, group_size=64, **EVEN)
    slow_commit = SwarmSimSpec(**{**flat.to_dict(), "commit_s": 10.0})
    assert {**simulate_swarm(slow_commit), "config": None} == {
        **simulate_swarm(flat),
        "config": None,
    }
    spec = dict(peers=16, group_size=4, hierarchy="two-stage", hours=0.5, **EXACT)
    base = simulate_swarm(SwarmSimSpec(**spec))
    slower = simulate_swarm(SwarmSimSpec(**spec, commit_s=10.0))
    assert slower["versions"] < base["versions"]
    assert slower["wait_s"]["mean"] > base["wait_s"]["mean"] + 5.0
    assert slower["applied_fraction"] == 1.0 and slower["forks"] == 0


def test_same_seed_same_document_and_another_seed_another() -> None:
    spec = SwarmSimSpec(peers=12, group_size=4, churn_per_hour=2.0, hours=0.3, seed=3)
    assert simulate_swarm(spec) == simulate_swarm(spec)
    assert simulate_swarm(spec) != simulate_swarm(SwarmSimSpec(**{**spec.to_dict(), "seed": 4}))


def test_more_peers_than_one_group_chain_one_group_per_version_and_waste_phases() -> None:
    """One group per version (`hierarchy none`, issue 19's measurement): several groups per
    base, one wins, the others give up (or fork) and contribute their δ again a round late."""
    doc = simulate_swarm(SwarmSimSpec(peers=16, group_size=4, hierarchy="none", hours=0.5, **EXACT))
    # the winners' heads and seals are read together: the swarm moved past the losers' base
    gave_up = doc["groups"]["gave_up_to_a_rival"] + doc["groups"]["gave_up_moved_past"]
    assert gave_up > 0
    assert doc["kept"].get("rival", 0) + doc["kept"]["moved past"] >= 2 * gave_up
    assert doc["phases"]["dropped_stale"] > 0
    assert doc["applied_fraction"] < 0.95
    assert doc["group_size"]["max"] == 4


def test_two_stage_combines_every_group_into_one_version() -> None:
    flat = simulate_swarm(SwarmSimSpec(peers=16, group_size=16, hours=0.5, **EXACT))
    two = simulate_swarm(
        SwarmSimSpec(peers=16, group_size=4, hierarchy="two-stage", hours=0.5, **EXACT)
    )
    assert two["forks"] == 0 and two["groups"]["gave_up_to_a_rival"] == 0
    assert two["groups"]["gave_up_moved_past"] == 0
    assert two["applied_fraction"] == 1.0 and two["phases"]["dropped_stale"] == 0
    assert two["group_size"]["max"] == 16  # every member of the four groups in each version
    assert two["versions"] >= 0.8 * flat["versions"]
    # the stage-one all-reduce plus one replayed update, fewer than 3 models
    assert two["bytes_per_peer_version"]["received_models"] < 3


def test_two_stage_with_fewer_peers_than_a_group_is_todays_protocol() -> None:
    base = SwarmSimSpec(peers=6, group_size=8, **EVEN)
    two = SwarmSimSpec(**{**base.to_dict(), "hierarchy": "two-stage"})
    assert simulate_swarm(base) == {**simulate_swarm(two), "config": simulate_swarm(base)["config"]}


def test_crashes_fail_their_group_and_lose_only_their_own_phases() -> None:
    spec = SwarmSimSpec(peers=8, group_size=8, churn_per_hour=6.0, hours=1.0, seed=1)
    doc = simulate_swarm(spec)
    assert doc["peers"]["crashed"] > 0 and doc["peers"]["at_end"] == 8
    assert doc["peers"]["ever"] == 8 + doc["peers"]["crashed"]
    assert doc["groups"]["failed"] > 0
    assert doc["kept"]["all-reduce failed: a member crashed"] > 0
    assert doc["catch_ups"]["download"] > doc["peers"]["crashed"] / 2  # joiners fetch the state
    assert doc["phases"]["lost"] > 0
    assert doc["applied_fraction"] > 0.8


def test_an_all_reduce_slower_than_its_timeout_never_commits() -> None:
    doc = simulate_swarm(SwarmSimSpec(peers=4, bandwidth_mbit=1.0, allreduce_timeout_s=60, **EVEN))
    assert doc["versions"] == 0 and doc["groups"]["failed"] > 0
    assert doc["kept"]["all-reduce failed: too slow"] > 0
    assert doc["phases"]["applied"] == 0


def test_a_lone_peer_applies_its_own_delta_every_phase() -> None:
    doc = simulate_swarm(SwarmSimSpec(peers=1, protocol="async", **EVEN))
    assert doc["group_size"] == {"mean": 1.0, "max": 1}
    assert doc["versions"] == doc["phases"]["applied"] == doc["phases"]["finished"]


def test_async_dylu_peers_finish_together_and_group() -> None:
    spec = SwarmSimSpec(peers=4, protocol="async", heterogeneity="very", hours=0.5, **EXACT)
    doc = simulate_swarm(spec)
    assert doc["group_size"]["mean"] > 3.5  # DyLU: the phases of unequal devices end together
    assert doc["applied_fraction"] == 1.0
    assert doc["wait_s"]["p90"] < 10


def test_history_counts_a_second_commit_on_one_base_as_a_fork() -> None:
    h = History()
    a = h.commit(GENESIS, ("A", "C"), (1, 4), now=10.0)
    assert not h.rival(GENESIS, now=10.5, dht_delay=1.0)  # the seal is not readable yet
    assert h.rival(GENESIS, now=11.0, dht_delay=1.0)
    b = h.commit(GENESIS, ("B",), (2,), now=10.5)
    c = h.commit(a, ("A",), (3,), now=20.0)
    assert h.forks == 1 and a != b
    assert not h.rival(a, now=30.0, dht_delay=1.0)  # a lone commit is one key's word, no claim
    assert h.descends(c, a) and h.descends(c, GENESIS) and not h.descends(c, b)
    assert [v.phases for v in h.chain(c)] == [(1, 4), (3,)]


def test_dht_heads_arrive_late_and_a_crashed_peers_head_outlives_it_by_the_ttl() -> None:
    dht = Dht(delay=2.0, ttl=60.0)
    head = PeerHead(peer_id=peer_name(1), version=0, state_hash=GENESIS, updated=1.0)
    dht.publish(head, now=1.0)
    assert dht.advance(2.9) == {}
    assert dht.advance(3.0) == {peer_name(1): head}
    dht.crashed(peer_name(1), now=10.0)
    assert peer_name(1) in dht.advance(69.9)
    assert dht.advance(70.0) == {}


def test_every_member_names_the_same_delegate() -> None:
    sim = SwarmSim(SwarmSimSpec(peers=4))
    members = tuple(sim.new_peer() for _ in range(4))
    chosen = delegate(members, "b" * 64)
    assert delegate(members[::-1], "b" * 64) is chosen
    assert {delegate(members, f"{i:064x}").id for i in range(32)} == {m.id for m in members}


@pytest.mark.parametrize(
    "field, value",
    [("peers", 0), ("protocol", "gossip"), ("hierarchy", "tree"), ("group_size", 1),
     ("hours", math.nan), ("churn_per_hour", -1.0), ("compression", "int4"),
     ("bandwidth_spread", 0.5), ("grace_share", 2.0), ("peers", True), ("jitter", -0.1),
     ("apply_s", -1.0), ("commit_s", math.inf)],
)  # fmt: skip
def test_bad_settings_are_config_errors(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SwarmSimSpec(**{field: value})  # type: ignore[arg-type]


def test_two_stage_closes_its_groups_once_nobody_at_the_base_is_training() -> None:
    """The last stage-one group (the slowest devices) closes when its last member arrives, not
    at the sync timeout: a round lasts the slowest phase, two all-reduces and one replay."""
    spec = SwarmSimSpec(peers=100, group_size=16, hierarchy="two-stage", hours=0.3, **EXACT)
    doc = simulate_swarm(spec)
    slowest_phase = 50 * (5.74 / 1.0) ** 0.25  # `slight`: the slowest device of the profile
    assert doc["applied_fraction"] == 1.0 and doc["forks"] == 0
    assert doc["wait_s"]["max"] < slowest_phase - 50 + 30  # never a whole timeout more
    assert doc["versions"] >= int(1080 / (slowest_phase + 20))


def test_jittered_phases_make_a_sync_round_wait_for_its_slowest_peer_or_split() -> None:
    """With phases that vary, sync's slowest peers arrive after the first group's search timed
    out (slight heterogeneity: the slowest device's phase is 27 s longer, the timeout 30 s):
    groups split, and the late one gives its version up. The mechanism, measured: one group
    of 16 every round without jitter, smaller groups and rival give-ups with it."""
    exact = simulate_swarm(SwarmSimSpec(peers=16, group_size=16, hours=0.5, **EXACT))
    jittered = simulate_swarm(SwarmSimSpec(peers=16, group_size=16, hours=0.5, jitter=0.05))
    gave_up = {k: d["groups"]["gave_up_to_a_rival"] + d["groups"]["gave_up_moved_past"]
               for k, d in (("exact", exact), ("jittered", jittered))}  # fmt: skip
    assert exact["group_size"]["mean"] == 16 and gave_up["exact"] == 0
    assert jittered["group_size"]["mean"] < 16 and gave_up["jittered"] > 0


def _at(sim: SwarmSim, p, state: str) -> None:
    """`p` holds `state`, and the others read it from now on."""
    p.version, p.state = sim.history.states[state].version, state
    sim.publish(p)


def _swarm_at_v1() -> tuple[SwarmSim, list, str]:
    """Six peers that all hold version 1 (past the genesis, where one key's head is followed)."""
    sim = SwarmSim(SwarmSimSpec(peers=8, protocol="async", dht_delay_s=0.0))
    peers = [sim.new_peer() for _ in range(6)]
    base = sim.history.commit(GENESIS, tuple(p.id for p in peers), (0,), now=0.0)
    for p in peers:
        _at(sim, p, base)
    return sim, peers, base


def _lone_commit_beside_a_group(holders: int, first_member: int) -> tuple:
    """`_swarm_at_v1`, then peers[0] commits v2 alone and `holders` peers (itself first) hold
    it; the group `peers[first_member:]` holds δs of its own, still at v1."""
    sim, peers, base = _swarm_at_v1()
    lone = sim.history.commit(base, (peers[0].id,), (1,), now=0.0)
    for p in peers[:holders]:
        _at(sim, p, lone)
    group = tuple(peers[first_member:])
    for i, m in enumerate(group):
        m.mine = Delta((10 + i,), 1)
    return sim, peers, base, lone, group


def test_a_group_gives_its_version_up_to_a_lone_commit_a_quorum_followed_once() -> None:
    """Round._moved_past in the simulator: a lone commit is no claim, but once a quorum of live
    peers holds it, a group still on the old base keeps its δs instead of forking; the same
    state a second time is passed over (a made-up head costs one round)."""
    # the lone committer and three peers that followed it
    sim, peers, base, lone, group = _lone_commit_beside_a_group(holders=4, first_member=4)
    sim.commit(group, base, rivals_matter=True)
    assert sim.history.forks == 0 and sim.tally.moved_past_groups == 1
    assert sim.tally.kept_why["moved past"] == 2 and all(m.state == base for m in group)
    assert all(m.pending == Delta((10 + i,), 1) for i, m in enumerate(group))
    for m in group:  # the next round, still at the old base: now it commits
        m.mine, m.pending = m.pending, None
    sim.commit(group, base, rivals_matter=True)
    assert sim.history.forks == 1 and all(m.version == 2 and m.state != lone for m in group)


def test_a_lone_commit_nobody_followed_does_not_stop_a_group() -> None:
    # one key's head moves nobody
    sim, peers, base, lone, group = _lone_commit_beside_a_group(holders=1, first_member=4)
    sim.commit(group, base, rivals_matter=True)
    assert sim.tally.moved_past_groups == 0 and sim.tally.rival_groups == 0
    assert all(m.version == 2 for m in group)


def test_a_larger_group_commits_beside_a_smaller_ones_version_and_wins_the_fork() -> None:
    """SwarmView.moved_past's size rule in the simulator: a lone commit and one follower (2
    peers) at v2 do not stop a group of 4 on v1; the fork it makes is one the 4 win."""
    sim, peers, base, lone, group = _lone_commit_beside_a_group(holders=2, first_member=2)
    sim.commit(group, base, rivals_matter=True)
    assert sim.tally.moved_past_groups == 0 and sim.history.forks == 1
    assert all(m.version == 2 and m.state != lone for m in group)
    choice = sim.view(peers[0]).choose_head()
    assert choice is not None and choice.lost_fork  # the pair's branch lost the vote


def test_a_search_nobody_joined_stops_once_a_quorum_moved_past_its_state() -> None:
    """GroupAverager's `give_up` in the simulator: a sync peer searching alone at v1 while four
    peers hold v2 stops at its next poll and keeps its δ, instead of waiting out the sync
    timeout; while only one key's head is past v1, it searches on."""
    sim = SwarmSim(SwarmSimSpec(peers=8, dht_delay_s=0.0, hierarchy="none"))
    peers = [sim.new_peer() for _ in range(6)]
    base = sim.history.commit(GENESIS, tuple(p.id for p in peers), (0,), now=0.0)
    for p in peers:
        _at(sim, p, base)
    late = peers[5]
    late.mine = Delta((10,), 1)
    sim.contribute(late)
    (forming,) = sim.lobbies[base]
    assert forming.members == [late.id] and forming.deadline == sim.spec.sync_timeout_s
    ahead = sim.history.commit(base, (peers[0].id,), (1,), now=0.0)
    _at(sim, peers[0], ahead)
    sim.give_up(forming)  # one key's head: the search goes on
    assert not forming.closed and late.mine is not None
    for p in peers[1:4]:
        _at(sim, p, ahead)
    sim.give_up(forming)
    assert forming.closed and sim.tally.kept_why["no group"] == 1
    assert late.mine is None and late.pending == Delta((10,), 1)
