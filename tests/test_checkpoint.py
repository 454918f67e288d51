"""Model checkpoints: round trip, corruption detection, atomic writes; RunSpec as data."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diloco_peer.config import RunSpec, SimSpec
from diloco_peer.errors import CheckpointError, ConfigError
from diloco_peer.peer import checkpoint
from diloco_peer.peer.checkpoint import (
    FORMAT,
    atomic_write,
    load_into_model,
    load_model_checkpoint,
    save_model_checkpoint,
    tensors_digest,
)
from diloco_peer.peer.model import Transformer, build_model

VOCAB = 256


def _model(seed: int = 0, vocab: int = VOCAB) -> Transformer:
    return build_model("nano", vocab, seed=seed, max_seq_len=32)


@pytest.fixture
def saved(tmp_path: Path, small_run: RunSpec) -> Path:
    path = tmp_path / "model.safetensors"
    save_model_checkpoint(path, _model(), small_run, extra={"algo": "sync", "final_ppl": 12.5})
    return path


def _tensor_region_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _write_raw(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def _valid_metadata(run: RunSpec, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        "format": FORMAT,
        "run": json.dumps(run.to_dict()),
        "extra": "{}",
        "sha256": tensors_digest(tensors),
    }


# ----------------------------------------------------------------------------- round trip


def test_round_trip(saved: Path, small_run: RunSpec) -> None:
    ckpt = load_model_checkpoint(saved)
    assert ckpt.run == small_run
    assert ckpt.extra == {"algo": "sync", "final_ppl": 12.5}
    expected = _model().state_dict()
    assert ckpt.tensors.keys() == expected.keys()
    assert all(torch.equal(ckpt.tensors[k], expected[k]) for k in expected)
    other = _model(seed=1)
    load_into_model(other, ckpt, saved)
    assert all(
        torch.equal(a, b) for a, b in zip(other.parameters(), _model().parameters(), strict=True)
    )


def test_save_accepts_a_string_path_and_creates_folders(tmp_path: Path, small_run: RunSpec) -> None:
    path = tmp_path / "a" / "b" / "m.safetensors"
    save_model_checkpoint(str(path), _model(), small_run)
    assert load_model_checkpoint(str(path)).extra == {}
    assert os.listdir(path.parent) == ["m.safetensors"]


def test_digest_sees_names_shapes_dtypes_and_bytes() -> None:
    base = {"a": torch.arange(6, dtype=torch.float32), "b": torch.zeros(0)}
    d = tensors_digest(base)
    assert d == tensors_digest({"b": torch.zeros(0), "a": torch.arange(6, dtype=torch.float32)})
    assert d != tensors_digest({**base, "a": base["a"].view(2, 3)})
    assert d != tensors_digest({**base, "a": base["a"].to(torch.float64)})
    assert d != tensors_digest({"c": base["a"], "b": base["b"]})
    flipped = base["a"].clone()
    flipped[3] = 3.0000002
    assert d != tensors_digest({**base, "a": flipped})


# ----------------------------------------------------------------------------- corruption


def test_flipped_byte_in_tensors_is_detected_and_the_file_left_alone(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    start = _tensor_region_start(saved)
    data[(start + len(data)) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_model_checkpoint(saved)
    assert saved.read_bytes() == bytes(data)


@pytest.mark.parametrize("keep", [4, 100, "half", -1])
def test_truncated_file_is_a_checkpoint_error(saved: Path, keep: int | str) -> None:
    data = saved.read_bytes()
    n = len(data) // 2 if keep == "half" else keep
    assert isinstance(n, int)
    saved.write_bytes(data[:n])
    with pytest.raises(CheckpointError):
        load_model_checkpoint(saved)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        random.Random(0).randbytes(4096),
        b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]",  # a JSON header that is not an object
        b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xfe\xfd\xfc",  # header not UTF-8
        b"\x03\x00\x00\x00\x00\x00\x00\x00{x}",  # header not JSON
        b"\xff" * 8 + b"{}",  # absurd header size
        b"\x02\x00\x00\x00\x00\x00\x00\x00{}",  # no metadata at all
    ],
)
def test_garbage_is_a_checkpoint_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError):
        load_model_checkpoint(path)


def test_missing_file_or_folder_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        load_model_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="not found"):
        load_model_checkpoint(tmp_path)


def test_foreign_safetensors_file_is_rejected(tmp_path: Path) -> None:
    tensors = {"w": torch.ones(3)}
    plain = _write_raw(tmp_path / "plain.safetensors", tensors, {})
    with pytest.raises(CheckpointError, match="not a diloco-peer model checkpoint"):
        load_model_checkpoint(plain)
    other = _write_raw(tmp_path / "other.safetensors", tensors, {"format": "someone-else/v1"})
    with pytest.raises(CheckpointError, match="not a diloco-peer model checkpoint"):
        load_model_checkpoint(other)


@pytest.mark.parametrize(
    "change",
    [
        {"run": "{not json"},
        {"run": "[1, 2]"},
        {"run": json.dumps({"model": "nano", "colour": "red"})},  # unknown field
        {"run": json.dumps({"seq_len": "32"})},  # wrong type
        {"run": json.dumps({"seq_len": -1})},  # right type, invalid value
        {"extra": "{broken"},
        {"extra": "[1]"},  # extra must be an object
        {"sha256": "0" * 64},
    ],
)
def test_malformed_metadata_is_a_checkpoint_error(
    tmp_path: Path, small_run: RunSpec, change: dict[str, str]
) -> None:
    tensors = _model().state_dict()
    metadata = {**_valid_metadata(small_run, tensors), **change}
    path = _write_raw(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(CheckpointError):
        load_model_checkpoint(path)


@pytest.mark.parametrize("key", ["run", "sha256"])
def test_missing_metadata_key_is_a_checkpoint_error(
    tmp_path: Path, small_run: RunSpec, key: str
) -> None:
    tensors = _model().state_dict()
    metadata = _valid_metadata(small_run, tensors)
    del metadata[key]
    path = _write_raw(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(CheckpointError):
        load_model_checkpoint(path)


def test_hand_written_valid_checkpoint_loads(tmp_path: Path, small_run: RunSpec) -> None:
    # The control for the malformed cases above: the same construction, unchanged, is accepted.
    tensors = _model().state_dict()
    path = _write_raw(tmp_path / "ok.safetensors", tensors, _valid_metadata(small_run, tensors))
    assert load_model_checkpoint(path).run == small_run


def test_checkpoint_of_another_model_does_not_load(saved: Path) -> None:
    ckpt = load_model_checkpoint(saved)
    with pytest.raises(CheckpointError, match="do not match"):
        load_into_model(build_model("tiny", VOCAB, seed=0, max_seq_len=32), ckpt, saved)
    with pytest.raises(CheckpointError, match="has shape"):
        load_into_model(_model(vocab=300), ckpt, saved)
    missing = dataclasses.replace(ckpt, tensors=dict(list(ckpt.tensors.items())[1:]))
    with pytest.raises(CheckpointError, match="do not match"):
        load_into_model(_model(), missing, saved)


# ----------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_write_keeps_the_old_file_and_leaves_no_temp_file(
    tmp_path: Path, error: BaseException
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old content")

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"half of the new")
        raise error

    with pytest.raises(type(error)):
        atomic_write(path, write)
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_successful_write_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_save_failing_mid_write_keeps_the_previous_checkpoint(
    saved: Path, small_run: RunSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = saved.read_bytes()

    def broken_save_file(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(before[:50])
        raise OSError("no space left on device")

    monkeypatch.setattr(checkpoint, "save_file", broken_save_file)
    with pytest.raises(OSError, match="no space"):
        save_model_checkpoint(saved, _model(seed=5), small_run)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]
    load_model_checkpoint(saved)


# ----------------------------------------------------------------------------- RunSpec as data


def test_run_spec_round_trips_through_json(small_run: RunSpec) -> None:
    data = json.loads(json.dumps(small_run.to_dict()))
    assert RunSpec.from_dict(data) == small_run
    assert RunSpec.from_dict({}) == RunSpec()
    assert RunSpec.from_dict({"inner_lr": 1}).inner_lr == 1  # an int is a valid float


@pytest.mark.parametrize(
    "data",
    [
        {"colour": "red"},
        {"model": "nano", "unknown_a": 1, "unknown_b": 2},
        {"seq_len": "128"},
        {"seq_len": 12.0},
        {"seq_len": True},
        {"inner_lr": "0.1"},
        {"inner_lr": False},
        {"model": None},
        {"model": 3},
        {"seed": [0]},
    ],
)
def test_run_spec_from_dict_rejects_unknown_fields_and_wrong_types(data: dict) -> None:
    with pytest.raises(ConfigError):
        RunSpec.from_dict(data)


@pytest.mark.parametrize("data", [None, [], "nano", 3])
def test_run_spec_from_dict_rejects_non_objects(data: object) -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        RunSpec.from_dict(data)


@pytest.mark.parametrize(
    "field",
    [
        {"model": "huge"},
        {"seq_len": 0},
        {"batch_size": -1},
        {"inner_lr": 0.0},
        {"outer_optimizer": "lion"},
        {"shards": "random"},
        {"outer_momentum": 1.0},
        {"inner_min_lr_ratio": 0.0},
        {"weight_decay": -0.1},
        {"dn_c": -1.0},
    ],
)
def test_run_spec_rejects_out_of_range_values(field: dict) -> None:
    with pytest.raises(ConfigError):
        RunSpec(**field)


@pytest.mark.parametrize(
    "field",
    [
        {"algo": "nope"},
        {"workers": 0},
        {"total_steps": -1},
        {"heterogeneity": "extreme"},
        {"drop_prob": 1.0},
        {"drop_prob": 0.1, "algo": "async"},
        {"compute_schedule": "doubling", "algo": "dn"},
        {"compute_schedule": "sideways"},
        {"grace_s": -1.0},
    ],
)
def test_sim_spec_rejects_bad_values(field: dict) -> None:
    with pytest.raises(ConfigError):
        SimSpec(**field)
