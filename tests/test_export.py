"""`export`: model and peer checkpoints to safetensors and to a transformers Llama, with equal
logits; bad input is one line and exit 2 and leaves an existing folder alone."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import save_file

from diloco_peer.averaging.outer import build_outer_optimizer
from diloco_peer.averaging.state import ReplicatedState
from diloco_peer.cli.main import main
from diloco_peer.config import RunSpec, SwarmSettings
from diloco_peer.coordinator_free.manifest import Manifest
from diloco_peer.errors import BadInput, ConfigError, DilocoError
from diloco_peer.identity import Identity
from diloco_peer.peer import export_hf
from diloco_peer.peer.checkpoint import load_model_checkpoint, save_model_checkpoint
from diloco_peer.peer.export import ExportResult, ExportSpec, export_checkpoint
from diloco_peer.peer.export_hf import SIDECAR_FILE, check_llama_compatible, load_hf
from diloco_peer.peer.export_safetensors import load_exported
from diloco_peer.peer.export_source import PEER_FORMAT
from diloco_peer.peer.model import Transformer, build_model

pytestmark = pytest.mark.usefixtures("single_thread")  # fast and steady on a shared CPU box

# The acceptance bar: exported logits equal ours to 1e-5 of the logit scale (fp32, CPU).
LOGIT_RTOL = 1e-5
SIM = [
    "simulate", "--algo", "single", "--total-steps", "20", "--model", "nano", "--seq-len", "32",
    "--batch-size", "4", "--max-tokens", "200000", "--val-sequences", "8", "--warmup-steps", "5",
    "--threads", "1",
]  # fmt: skip


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> Result:
    """The command line in this process: the same `main` and error contract, no 10 s start."""
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return Result(rc, out, err)


def assert_one_line_error(result: Result, code: int, *fragments: str) -> None:
    lines = result.stderr.splitlines()
    assert result.rc == code, result
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("diloco-peer: error: "), lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def export_to(
    checkpoint: Path, out: Path, fmt: Literal["safetensors", "hf"] = "safetensors"
) -> ExportResult:
    return export_checkpoint(ExportSpec(checkpoint=str(checkpoint), out=str(out), format=fmt))


def perturbed_model(preset: str, seq_len: int, seed: int) -> Transformer:
    """A fresh model with every weight moved off its init, so that e.g. a swapped pair of
    norms (all ones at init) or a wrong q/k row order changes the logits."""
    model = build_model(preset, 256, 0, max_seq_len=seq_len)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def max_logit_diff(ours: Transformer, hf: Any, seeds: range = range(3)) -> tuple[float, float]:
    """(max |hf − ours|, max |ours|) over random batches of full and partial lengths."""
    diff = scale = 0.0
    T = ours.cfg.max_seq_len
    for seed in seeds:
        g = torch.Generator().manual_seed(100 + seed)
        for length in (T, max(1, T // 3)):
            tokens = torch.randint(ours.cfg.vocab_size, (3, length), generator=g)
            with torch.no_grad():
                want = ours(tokens)
                got = hf(input_ids=tokens).logits
            assert got.dtype == torch.float32 and got.shape == want.shape
            diff = max(diff, float((got - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
    return diff, scale


def hf_from_pretrained(folder: Path) -> Any:
    """The export loaded the way a transformers user would: safetensors only, fp32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, use_safetensors=True, dtype=torch.float32)
    return model.eval()


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(parent: Path, name: str) -> list[str]:
    """Temporary folders an export left next to its target."""
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def sim_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `simulate --save` checkpoint of the nano model (20 AdamW steps)."""
    path = tmp_path_factory.mktemp("sim") / "nano.safetensors"
    threads = torch.get_num_threads()
    try:
        main([*SIM, "--save", str(path)])
    finally:
        torch.set_num_threads(threads)
    return path


def write_peer_checkpoint(path: Path, preset: str = "nano") -> tuple[list[torch.Tensor], str]:
    """A peer checkpoint in `SwarmPeer.save_checkpoint`'s layout, with a real signed manifest
    and a real `ReplicatedState` one update past its start. Local replica tensors differ from
    the global ones. Returns (global θ, run name)."""
    run = RunSpec(model=preset, seq_len=32)
    signed = Manifest.create("exp", run, SwarmSettings(), Identity.generate())
    model = perturbed_model(preset, run.seq_len, seed=7)
    state = ReplicatedState(
        [p.detach() for p in model.parameters()],
        build_outer_optimizer("nesterov", lr=0.7, momentum=0.9),
        num_shards=4,
        manifest_digest=signed.digest,
    )
    g = torch.Generator().manual_seed(8)
    state.apply([torch.randn(t.shape, generator=g) * 0.01 for t in state.theta], 2, {1: 64})
    tensors = {f"global.{k}": v.contiguous() for k, v in state.tensors().items()}
    for i, t in enumerate(state.theta):
        tensors[f"local.{i}"] = t + 1.0  # a half-trained replica: must not be exported
    meta = {
        "format": PEER_FORMAT,
        "manifest": signed.digest,
        "manifest_bytes": signed.to_bytes().decode(),
        "peer": "QmTest",
        "rounds_done": "1",
        "streams": "[]",
        "adam": json.dumps({"param_groups": [], "state": {}}),
        **{f"state.{k}": v for k, v in state.metadata().items()},
    }
    save_file(tensors, str(path), metadata=meta)
    return [t.clone() for t in state.theta], "exp"


# ----------------------------------------------------------------------------- hf format


def test_hf_export_of_a_simulated_checkpoint_gives_equal_logits(
    sim_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    result = cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", out, "--format", "hf")
    assert result.rc == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "max logit difference" in result.stdout
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert not leftovers(tmp_path, "hf")

    ckpt = load_model_checkpoint(sim_checkpoint)
    ours = build_model("nano", 256, ckpt.run.seed, max_seq_len=ckpt.run.seq_len)
    ours.load_state_dict(ckpt.tensors)
    diff, scale = max_logit_diff(ours.eval(), hf_from_pretrained(out))
    assert diff <= LOGIT_RTOL * max(1.0, scale), (diff, scale)

    sidecar = json.loads((out / SIDECAR_FILE).read_text())
    assert sidecar["run"] == ckpt.run.to_dict()
    assert sidecar["source"]["sha256"] == hashlib.sha256(sim_checkpoint.read_bytes()).hexdigest()


def test_tiny_preset_maps_onto_llama_names_and_shapes(tmp_path: Path) -> None:
    ours = perturbed_model("tiny", seq_len=48, seed=1)
    run = RunSpec(model="tiny", seq_len=48)
    save_model_checkpoint(tmp_path / "tiny.safetensors", ours, run)
    result = export_to(tmp_path / "tiny.safetensors", tmp_path / "hf", "hf")
    assert result.max_logit_diff is not None

    hf = load_hf(tmp_path / "hf")
    c = hf.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (256, 192, 5)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (6, 6, 32)
    assert c.intermediate_size == ours.cfg.mlp_hidden == 512
    assert (c.hidden_act, c.rms_norm_eps, c.max_position_embeddings) == ("silu", 1e-6, 48)
    assert c.tie_word_embeddings and not c.attention_bias and not c.mlp_bias
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10_000.0}
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    hf_params = dict(hf.named_parameters())
    assert not any(name.endswith(".bias") for name in hf_params)
    sd = ours.state_dict()
    layer = hf.model.layers[2]
    q, k, v = sd["blocks.2.attn.qkv.weight"].split(6 * 32)
    perm = torch.cat((torch.arange(0, 32, 2), torch.arange(1, 32, 2)))
    assert torch.equal(layer.self_attn.q_proj.weight, q.view(6, 32, 192)[:, perm].reshape(-1, 192))
    assert torch.equal(layer.self_attn.k_proj.weight, k.view(6, 32, 192)[:, perm].reshape(-1, 192))
    assert torch.equal(layer.self_attn.v_proj.weight, v)
    gate, up = sd["blocks.2.mlp.gate_up.weight"].split(512)
    assert torch.equal(layer.mlp.gate_proj.weight, gate)
    assert torch.equal(layer.mlp.up_proj.weight, up)
    assert torch.equal(layer.input_layernorm.weight, sd["blocks.2.norm1.weight"])
    assert torch.equal(layer.post_attention_layernorm.weight, sd["blocks.2.norm2.weight"])
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())

    diff, scale = max_logit_diff(ours, hf)
    assert diff <= LOGIT_RTOL * max(1.0, scale), (diff, scale)


def test_a_wrong_mapping_is_refused_not_exported(
    sim_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the rotary row permutation the logits differ: the self-check must catch that
    and leave no folder behind, proving it would catch a model.py change too."""
    monkeypatch.setattr(export_hf, "rope_permutation", lambda head_dim: torch.arange(head_dim))
    with pytest.raises(DilocoError, match="logits differ"):
        export_to(sim_checkpoint, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists() and not leftovers(tmp_path, "hf")


def test_what_llama_cannot_express_is_named() -> None:
    model = build_model("nano", 256, 0, max_seq_len=16)
    check_llama_compatible(model)  # the real architecture is fine
    model.blocks[1].attn.qkv.bias = torch.nn.Parameter(torch.zeros(3 * 96))
    model.blocks[2].norm2.eps = 1e-5
    with pytest.raises(ConfigError) as info:
        check_llama_compatible(model)
    message = str(info.value)
    assert "cannot be represented exactly" in message and "--format safetensors" in message
    assert "blocks.1.attn.qkv.bias" in message and "eps" in message


def test_hf_without_transformers_names_the_extra(
    sim_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(BadInput, match=r"pip install 'diloco-peer\[hf\]'"):
        export_to(sim_checkpoint, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_rebuilds_the_same_model(
    sim_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "st"
    result = cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", out)
    assert result.rc == 0, result.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    config = json.loads((out / "config.json").read_text())
    ckpt = load_model_checkpoint(sim_checkpoint)
    assert config["run"] == ckpt.run.to_dict() and config["preset"] == "nano"
    assert config["source"]["sha256"] == hashlib.sha256(sim_checkpoint.read_bytes()).hexdigest()
    model_doc = config["model"]
    assert (model_doc["vocab_size"], model_doc["n_layer"], model_doc["d_model"]) == (256, 3, 96)
    assert (model_doc["n_head"], model_doc["head_dim"], model_doc["max_seq_len"]) == (4, 24, 32)

    rebuilt, run = load_exported(out)
    assert run == ckpt.run
    ours = build_model("nano", 256, run.seed, max_seq_len=run.seq_len)
    ours.load_state_dict(ckpt.tensors)
    tokens = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(tokens), ours.eval()(tokens))
    # Shared like any new folder, not private like the checkpoint writer's temp files.
    assert (out / "model.safetensors").stat().st_mode & 0o777 == out.stat().st_mode & 0o666
    # The weights file is itself a model checkpoint, so `eval --checkpoint` reads it.
    assert load_model_checkpoint(out / "model.safetensors").run == ckpt.run


def test_overwrite_replaces_a_folder_atomically(
    sim_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    result = cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", out, "--overwrite")
    assert result.rc == 0, result.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not leftovers(tmp_path, "out")
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder needs no --overwrite
    assert cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", empty).rc == 0


# ----------------------------------------------------------------------------- peer checkpoints


def test_peer_checkpoint_exports_the_global_model(tmp_path: Path) -> None:
    path = tmp_path / "exp.peer.safetensors"
    theta, run_name = write_peer_checkpoint(path)
    result = export_to(path, tmp_path / "st")
    assert (result.source.kind, result.source.version, result.source.run_name) == (
        "peer", 1, run_name,
    )  # fmt: skip
    rebuilt, run = load_exported(tmp_path / "st")
    assert run.model == "nano" and run.seq_len == 32
    for p, t in zip(rebuilt.parameters(), theta, strict=True):
        assert torch.equal(p.detach(), t)  # θ_global, not the local replica (θ + 1)
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    assert config["source"]["kind"] == "peer" and config["source"]["version"] == 1

    export_to(path, tmp_path / "hf", "hf")
    diff, scale = max_logit_diff(rebuilt.eval(), hf_from_pretrained(tmp_path / "hf"))
    assert diff <= LOGIT_RTOL * max(1.0, scale), (diff, scale)


def test_peer_format_tag_is_swarm_peers() -> None:
    from diloco_peer.peer.peer_checkpoint import CHECKPOINT_FORMAT

    assert PEER_FORMAT == CHECKPOINT_FORMAT


def test_corrupted_peer_checkpoint_is_detected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "exp.peer.safetensors"
    write_peer_checkpoint(path)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header_len])["global.theta.1"]["data_offsets"]
    data[8 + header_len + begin + 2] ^= 0x40  # one bit of θ_global; the header still parses
    path.write_bytes(bytes(data))
    result = cli(capsys, "export", "--checkpoint", path, "--out", tmp_path / "out")
    assert_one_line_error(result, 2, "corrupted")
    assert not (tmp_path / "out").exists()


@pytest.mark.multipeer
@pytest.mark.timeout(240)
def test_checkpoint_of_a_real_peer_exports_to_llama(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "diloco_peer", "join", "--run", "x", "--host", "127.0.0.1",
           "--model", "nano", "-H", "5", "--max-rounds", "1", "--checkpoint-dir", str(ckpt_dir),
           "--quiet", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:  # the peer's forked DHT and libp2p daemon share its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    path = ckpt_dir / "x.peer.safetensors"
    result = export_to(path, tmp_path / "hf", "hf")
    assert result.source.kind == "peer" and (result.source.version or 0) >= 1
    diff, scale = max_logit_diff(result.source.model.eval(), hf_from_pretrained(tmp_path / "hf"))
    assert diff <= LOGIT_RTOL * max(1.0, scale), (diff, scale)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def full_out(tmp_path: Path) -> Iterator[Path]:
    """A non-empty --out folder whose content must survive every failed export."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = listing(out)
    yield out
    assert listing(out) == before
    assert not leftovers(tmp_path, "out")


def test_non_empty_out_needs_overwrite(
    sim_checkpoint: Path, full_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", full_out)
    assert_one_line_error(result, 2, "not empty", "--overwrite")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "checkpoint not found"),
        (b"not a checkpoint at all", "not a safetensors checkpoint"),
        ("other-format", "not a diloco-peer checkpoint"),
        ("truncated", "corrupted"),
    ],
)
def test_bad_checkpoints_are_one_line_and_exit_2(
    content: bytes | str | None,
    fragment: str,
    sim_checkpoint: Path,
    full_out: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = full_out.parent / "bad.safetensors"
    if content == "other-format":
        save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "something/else"})
    elif content == "truncated":
        path.write_bytes(sim_checkpoint.read_bytes()[:-100])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    result = cli(capsys, "export", "--checkpoint", path, "--out", full_out, "--overwrite")
    assert_one_line_error(result, 2, fragment)


def test_unknown_format_is_one_line_and_exit_2(
    sim_checkpoint: Path, full_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = cli(
        capsys, "export", "--checkpoint", sim_checkpoint, "--out", full_out, "--format", "onnx",
        "--overwrite",
    )  # fmt: skip
    assert_one_line_error(result, 2, "unknown export format 'onnx'")


def test_out_holding_the_checkpoint_is_refused(
    sim_checkpoint: Path, full_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inside = full_out / "keep.txt"  # any file of the folder stands for the checkpoint
    result = cli(capsys, "export", "--checkpoint", inside, "--out", full_out, "--overwrite")
    assert_one_line_error(result, 2, "holds the checkpoint")


def test_out_that_is_a_file_is_refused(
    sim_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    result = cli(capsys, "export", "--checkpoint", sim_checkpoint, "--out", target, "--overwrite")
    assert_one_line_error(result, 2, "not a folder")
    assert target.read_text() == "x"
