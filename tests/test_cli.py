"""The `diloco-peer` command line, run as a subprocess: JSON output, error contract, save/eval."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_peer.peer.checkpoint import load_model_checkpoint

TIMEOUT_S = 120
# A run that takes a few seconds: nano model, 40 local steps over 4 workers.
TINY = [
    "--model", "nano", "--total-steps", "40", "--inner-steps", "5", "--workers", "4",
    "--seq-len", "32", "--batch-size", "4", "--max-tokens", "200000", "--val-sequences", "8",
    "--warmup-steps", "5", "--threads", "1",
]  # fmt: skip


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str


def cli(*args: str | Path) -> Result:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_peer", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_bad_input(result: Result, *fragments: str) -> None:
    """The error contract: exit code 2, one line on stderr, nothing on stdout, no traceback."""
    lines = result.stderr.splitlines()
    assert result.rc == 2, result
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("diloco-peer: error: "), lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0]


def one_json_doc(result: Result) -> dict[str, Any]:
    assert result.rc == 0, result.stderr
    assert result.stdout.endswith("\n") and result.stdout.count("\n") == 1, result.stdout
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result, Path, Result]:
    """The same tiny sync run twice, each saving its final model."""
    folder = tmp_path_factory.mktemp("cli")
    first, second = folder / "first.safetensors", folder / "second.safetensors"
    a = cli("simulate", *TINY, "--algo", "sync", "--json", "--save", first)
    b = cli("simulate", *TINY, "--algo", "sync", "--json", "--save", second)
    return first, a, second, b


# ----------------------------------------------------------------------------- simulate


def test_simulate_json_is_one_document_with_the_documented_keys(
    saved_runs: tuple[Path, Result, Path, Result],
) -> None:
    _, result, _, _ = saved_runs
    doc = one_json_doc(result)
    assert {"final_ppl", "sim_time", "curve", "cosine_similarity", "config"} <= doc.keys()
    assert math.isfinite(doc["final_ppl"]) and doc["final_ppl"] < doc["initial_ppl"]
    assert doc["sim_time"] > 0 and doc["local_steps"] == 40
    assert doc["curve"] and all(set(p) == {"local_steps", "sim_time", "ppl"} for p in doc["curve"])
    assert doc["curve"][-1]["ppl"] == doc["final_ppl"]
    assert len(doc["cosine_similarity"]) == doc["outer_updates"] == 2
    config = doc["config"]
    assert (config["algo"], config["workers"], config["total_steps"]) == ("sync", 4, 40)
    assert (config["run"]["model"], config["run"]["seq_len"], config["run"]["inner_steps"]) == (
        "nano",
        32,
        5,
    )


def test_simulate_twice_gives_identical_output_and_checkpoints(
    saved_runs: tuple[Path, Result, Path, Result],
) -> None:
    first, a, second, b = saved_runs
    assert one_json_doc(a) == one_json_doc(b)
    assert a.stdout == b.stdout
    # Same tensors and metadata; not the same bytes, because safetensors writes the metadata
    # keys in hash-map order.
    one, two = load_model_checkpoint(first), load_model_checkpoint(second)
    assert (one.run, one.extra) == (two.run, two.extra)
    assert one.tensors.keys() == two.tensors.keys()
    assert all(torch.equal(one.tensors[k], two.tensors[k]) for k in one.tensors)


def test_eval_of_a_saved_model_reproduces_the_final_ppl(
    saved_runs: tuple[Path, Result, Path, Result],
) -> None:
    path, result, _, _ = saved_runs
    doc = one_json_doc(cli("eval", "--checkpoint", path, "--json"))
    assert doc["ppl"] == pytest.approx(one_json_doc(result)["final_ppl"], rel=1e-6)
    assert doc["ppl"] == pytest.approx(math.exp(doc["loss"]))
    assert (doc["model"], doc["val_sequences"], doc["checkpoint"]) == ("nano", 8, str(path))


def test_save_onto_an_existing_file_needs_overwrite(
    saved_runs: tuple[Path, Result, Path, Result], tmp_path: Path
) -> None:
    path, result, _, _ = saved_runs
    before = path.read_bytes()
    assert_bad_input(cli("simulate", *TINY, "--json", "--save", path), "--overwrite")
    assert path.read_bytes() == before
    # With --overwrite, and starting from that very checkpoint: its ppl is the new start.
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(before)
    again = cli(
        "simulate", *TINY, "--algo", "dn", "--json", "--init", copy, "--save", copy, "--overwrite"
    )
    doc = one_json_doc(again)
    assert doc["initial_ppl"] == pytest.approx(one_json_doc(result)["final_ppl"], rel=1e-6)
    assert copy.read_bytes() != before
    evaluated = one_json_doc(cli("eval", "--checkpoint", copy, "--json"))
    assert evaluated["ppl"] == pytest.approx(doc["final_ppl"], rel=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.safetensors"]


def test_simulate_without_json_prints_a_summary(tmp_path: Path) -> None:
    result = cli("simulate", *TINY, "--algo", "single", "--total-steps", "10")
    assert result.rc == 0, result.stderr
    assert result.stdout.startswith("single: ppl ")
    assert "after 10 local steps" in result.stdout


def test_simulate_runs_where_hivemind_is_not_installed() -> None:
    """The simulator needs no network code: the GPU machines the benches borrow have torch but
    not hivemind (bench/paper_tables.py --device cuda)."""
    code = (
        "import runpy, sys; sys.modules['hivemind'] = None; "
        "sys.argv = ['diloco-peer', *sys.argv[1:]]; "
        "runpy.run_module('diloco_peer', run_name='__main__')"
    )
    args = ["simulate", *TINY, "--algo", "sync", "--device", "cpu", "--json"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert math.isfinite(json.loads(proc.stdout)["final_ppl"])


# ----------------------------------------------------------------------------- bad input


BAD_FLAGS = [
    (["simulate", "--model", "huge"], "unknown model preset 'huge'"),
    (["simulate", "--algo", "nope"], "unknown algorithm 'nope'"),
    (["simulate", "--inner-steps", "0"], "inner_steps"),
    (["simulate", "--workers", "0"], "workers"),
    (["simulate", "--total-steps", "-1"], "total_steps"),
    (["simulate", "--heterogeneity", "extreme"], "heterogeneity"),
    (["simulate", "--algo", "async", "--drop-prob", "0.5"], "--drop-prob"),
    (["simulate", "--save", "/nonexistent-folder-xyz/m.safetensors"], "does not exist"),
    (["simulate", "--bogus"], "--bogus"),
    (["simulate", "--workers", "abc"], "--workers"),
    (["simulate", "--algo", "dn-dylu", "--grace-share", "1.5"], "grace_share"),
    (["simulate", "--overlap", "always"], "unknown overlap rule 'always'"),
    (["simulate", "--algo", "async", "--overlap", "eager"], "--overlap needs"),
    (["simulate", "--comm-s", "-3"], "comm_s"),
    (["simulate", "--fragments", "0"], "fragments"),
    (["simulate", "--algo", "dn", "--fragments", "2"], "--fragments is modelled"),
    (["simulate", "--fragments", "4", "--total-steps", "8"], "3 transformer blocks"),
    (["simulate", "--device", "gpu"], "unknown device 'gpu'"),
    (["simulate-swarm", "--peers", "0"], "peers"),
    (["simulate-swarm", "--hierarchy", "tree"], "hierarchy"),
    (["simulate-swarm", "--hours", "nan"], "hours"),
    (["simulate-swarm", "--protocol", "async", "--grace-s", "0"], "grace_s"),
    (["eval"], "checkpoint"),
    # Delayed Nesterov with N = 1 is naive async: a founder must say how many peers
    (["join", "--protocol", "async", "--max-rounds", "1"], "--expected-peers"),
]


@pytest.fixture(scope="module")
def bad_flag_results() -> dict[tuple[str, ...], Result]:
    """Every BAD_FLAGS command, run at once: each is a process of its own, and most of its time
    is imports (about 3 s here), so the cases run side by side rather than one after another."""
    with ThreadPoolExecutor(8) as pool:
        results = pool.map(lambda case: cli(*case[0]), BAD_FLAGS)
        return {tuple(args): result for (args, _), result in zip(BAD_FLAGS, results, strict=True)}


@pytest.mark.parametrize(("args", "fragment"), BAD_FLAGS)
def test_bad_flags_are_one_line_and_exit_2(
    args: list[str], fragment: str, bad_flag_results: dict[tuple[str, ...], Result]
) -> None:
    assert_bad_input(bad_flag_results[tuple(args)], fragment)


def test_simulate_swarm_prints_one_document_and_a_summary_without_json() -> None:
    args = ["simulate-swarm", "--peers", "8", "--group-size", "4", "--hierarchy", "two-stage",
            "--hours", "0.2"]  # fmt: skip
    doc = one_json_doc(cli(*args, "--json"))
    assert doc["config"]["peers"] == 8 and doc["config"]["hierarchy"] == "two-stage"
    assert doc["versions"] > 0 and doc["forks"] == 0
    assert 0 < doc["applied_fraction"] <= 1
    text = cli(*args)
    assert text.rc == 0 and f"{doc['versions']} versions" in text.stdout
    assert "applied share" in text.stdout


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_bad_data_source_is_one_line_and_exit_2(json_flag: list[str], tmp_path: Path) -> None:
    assert_bad_input(cli("simulate", *TINY, "--data", "builtin:nope", *json_flag), "builtin:nope")
    missing = tmp_path / "missing.txt"
    assert_bad_input(cli("simulate", *TINY, "--data", missing, *json_flag), "not found")


def test_bad_init_checkpoint_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    assert_bad_input(cli("simulate", *TINY, "--json", "--init", missing), "not found")


def test_eval_of_a_missing_or_malformed_checkpoint_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nope.safetensors"
    assert_bad_input(cli("eval", "--checkpoint", missing, "--json"), "not found")
    malformed = tmp_path / "junk.safetensors"
    malformed.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}..")
    assert_bad_input(cli("eval", "--checkpoint", malformed), "junk.safetensors")
    assert malformed.read_bytes() == b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}.."


def test_eval_on_another_missing_data_source_is_one_line_and_exit_2(
    saved_runs: tuple[Path, Result, Path, Result], tmp_path: Path
) -> None:
    path, _, _, _ = saved_runs
    result = cli("eval", "--checkpoint", path, "--data", tmp_path / "none.txt", "--json")
    assert_bad_input(result, "not found")
