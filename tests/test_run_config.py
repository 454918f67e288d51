"""Run configs: the TOML the demo writes reads back as the same run; async needs a grace; simulate
and the swarm share one preset."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from diloco_peer.cli.sim_cmd import simulate
from diloco_peer.config import RunSpec, SimSpec, SwarmSettings, default_run
from diloco_peer.coordinator_free.manifest import dump_run_config, load_run_config
from diloco_peer.errors import ConfigError
from diloco_peer.peer_spec import PeerSpec


def test_dump_run_config_round_trips(tmp_path: Path) -> None:
    run = RunSpec(model="nano", data='a "quoted" path\\x', schedule_steps=30, outer_lr=1.0)
    swarm = SwarmSettings(protocol="async", expected_peers=4, grace_s=2.5, weighting="samples")
    path = tmp_path / "run.toml"
    path.write_text(dump_run_config(run, swarm))
    assert load_run_config(path) == (run, swarm)


def test_async_needs_a_positive_grace_period() -> None:
    with pytest.raises(ConfigError, match="grace_s"):
        SwarmSettings(protocol="async", grace_s=0.0)
    SwarmSettings(protocol="sync", grace_s=0.0)  # sync never uses it


def test_the_grace_period_is_a_share_of_the_phase_and_never_below_grace_s() -> None:
    swarm = SwarmSettings(protocol="async", grace_s=2.0, grace_share=0.2)
    assert swarm.grace(None) == 2.0  # no speed measured yet
    assert swarm.grace(5.0) == 2.0  # a short phase: grace_s is the floor
    assert swarm.grace(300.0) == pytest.approx(60.0)  # a GPU-sized phase of 5 minutes
    assert SwarmSettings(grace_share=0.0).grace(300.0) == 2.0


@pytest.mark.parametrize("share", [-0.1, 1.0, float("nan"), float("inf")])
def test_a_grace_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="grace_share"):
        SwarmSettings(grace_share=share)


@pytest.mark.parametrize(
    "field, value",
    [
        ("expected_peers", -1),
        ("keep_updates", -1),
        ("eval_every", -2),
        ("start_timeout_s", -1.0),
        ("overlap_keep", 1.5),
        ("overlap_keep", float("nan")),
    ],  # fmt: skip
)
def test_bad_swarm_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        SwarmSettings(**{field: value})


def test_an_unknown_overlap_start_is_refused() -> None:
    with pytest.raises(ConfigError, match="overlap start 'round'; choose one of: phase, group"):
        SwarmSettings(overlap_from="round")  # type: ignore[arg-type]


def test_the_overlapped_rule_left_unset_is_the_measured_one_or_what_fragments_need() -> None:
    swarm = SwarmSettings(overlap=True)
    assert (swarm.overlap_fold, swarm.overlap_keep, swarm.overlap_from) == (None, None, None)
    assert (swarm.fold, swarm.keep, swarm.start_from) == ("mix", 0.5, "group") and swarm.mixes
    # fragments need `rebase`: unset, the rule is the one they can run
    frags = SwarmSettings(overlap=True, fragments=2)
    assert (frags.fold, frags.keep, frags.start_from) == ("rebase", 1.0, "phase")
    assert not frags.mixes
    with pytest.raises(ConfigError, match="overlap_fold 'rebase'"):
        SwarmSettings(overlap=True, fragments=2, overlap_fold="mix")
    # a rule named keeps its own defaults; each part set wins
    rebase = SwarmSettings(overlap=True, overlap_fold="rebase")
    assert (rebase.fold, rebase.keep, rebase.start_from) == ("rebase", 1.0, "phase")
    mixed = SwarmSettings(overlap=True, overlap_keep=0.8, overlap_from="phase")
    assert (mixed.fold, mixed.keep, mixed.start_from) == ("mix", 0.8, "phase")
    assert not SwarmSettings().mixes  # not overlapped: nothing mixes


def test_unset_overlap_fields_round_trip_through_json_and_toml(tmp_path: Path) -> None:
    for swarm in (SwarmSettings(overlap=True),
                  SwarmSettings(overlap=True, overlap_fold="rebase", overlap_keep=0.75,
                                overlap_from="group")):  # fmt: skip
        doc = json.loads(json.dumps(swarm.to_dict()))  # unset: JSON null
        assert SwarmSettings.from_dict(doc) == swarm
        path = tmp_path / "run.toml"
        path.write_text(dump_run_config(RunSpec(), swarm))  # unset: left out (TOML has no null)
        assert load_run_config(path) == (RunSpec(), swarm)
    assert SwarmSettings.from_dict({"overlap_keep": 1}).keep == 1.0  # an int is a fine float
    for bad in ({"overlap_keep": "0.5"}, {"overlap_fold": 1}, {"overlap_from": True},
                {"overlap_keep": True}, {"expected_peers": None}):  # fmt: skip
        with pytest.raises(ConfigError, match="wrong type"):
            SwarmSettings.from_dict(bad)


@pytest.mark.parametrize(
    "field, value",
    [("shard", -2), ("throttle", 0.5), ("throttle", float("inf")), ("until_steps", -1)],
)
def test_bad_peer_flags_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError):
        PeerSpec(**{field: value})


def test_simulate_runs_the_swarms_preset() -> None:
    # Issue 17: one default preset, so that `simulate` predicts what `join` runs. Every run
    # setting simulate's command line has (the model aside: a flag of both) defaults to the
    # built-in run's, and so do the grace settings.
    run, swarm = default_run()
    options = inspect.signature(simulate).parameters
    shared = [f.name for f in dataclasses.fields(RunSpec) if f.name in options]
    assert len(shared) > 15  # the check reaches the settings that count
    for name in shared:
        if name != "model":
            assert options[name].default.default == getattr(run, name), name
    assert options["grace_s"].default.default == swarm.grace_s
    assert options["grace_share"].default.default == swarm.grace_share
    # the overlapped fold (issue 18), in the command and in SimSpec: the swarm's default rule
    for name, rule in (("overlap_fold", "fold"), ("overlap_keep", "keep"),
                       ("overlap_from", "start_from")):  # fmt: skip
        assert options[name].default.default == getattr(swarm, rule), name
        assert getattr(SimSpec(), name) == getattr(swarm, rule), name
    # the schedule's length too: both at 0, each shard's cosine spans SHARD_SCHEDULE_STEPS in a
    # swarm (peer/phase.py) and in the simulator (sim/simulator.py, sim/async_run.py)
    assert options["schedule_steps"].default.default == run.schedule_steps == 0
