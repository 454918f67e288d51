"""The transformer: sizes of the presets, causality, RoPE, seeding, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diloco_peer.errors import ConfigError
from diloco_peer.peer.model import (
    apply_rope,
    build_model,
    count_parameters,
    model_config,
    resolve_device,
    rope_tables,
)

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 256  # the byte tokenizer's vocabulary


@pytest.mark.parametrize(("preset", "expected"), [("nano", 0.36e6), ("tiny", 2.3e6)])
def test_small_presets_have_the_documented_size(preset: str, expected: float) -> None:
    n = count_parameters(build_model(preset, VOCAB, seed=0, max_seq_len=64))
    assert abs(n - expected) / expected < 0.15, n


def test_nano_parameter_count_is_exact() -> None:
    # embed 256·96 (tied: no separate head) + 3 blocks of [qkv 96·288 + proj 96·96 +
    # gate_up 96·512 + down 256·96 + two norms 2·96] + final norm 96.
    expected = 256 * 96 + 3 * (96 * 288 + 96 * 96 + 96 * 512 + 256 * 96 + 2 * 96) + 96
    assert count_parameters(build_model("nano", VOCAB, seed=0)) == expected


def test_output_projection_is_tied_to_the_embedding() -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=16)
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.hidden_states(idx) @ model.embed.weight.T
        assert torch.allclose(model(idx), expected, atol=1e-6)


def test_unknown_preset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        build_model("huge", VOCAB, seed=0)
    with pytest.raises(ConfigError):
        model_config("", VOCAB)


def test_swiglu_hidden_width_is_a_multiple_of_32_near_8_thirds() -> None:
    for preset, width in [("nano", 96), ("tiny", 192), ("20m", 256), ("60m", 896)]:
        hidden = model_config(preset, VOCAB).mlp_hidden
        assert hidden % 32 == 0
        assert 8 * width / 3 <= hidden < 8 * width / 3 + 32


def test_same_seed_gives_same_weights_and_other_seed_differs() -> None:
    a = build_model("nano", VOCAB, seed=3, max_seq_len=32).state_dict()
    b = build_model("nano", VOCAB, seed=3, max_seq_len=32).state_dict()
    c = build_model("nano", VOCAB, seed=4, max_seq_len=32).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])


def test_build_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model("nano", VOCAB, seed=99, max_seq_len=16)
    assert torch.equal(torch.rand(4), expected)


def test_rope_buffers_are_not_in_the_state_dict() -> None:
    # They are derived from the config; a checkpoint must not carry (or average) them.
    keys = build_model("nano", VOCAB, seed=0, max_seq_len=16).state_dict().keys()
    assert not any("rope" in k for k in keys)


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=32)
    model.eval()
    idx = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert torch.allclose(before[:, :12], after[:, :12], atol=1e-6)
    assert (before[:, 12:] - after[:, 12:]).abs().amax() > 1e-4


def test_prefix_logits_do_not_depend_on_sequence_length() -> None:
    # A sequence shorter than max_seq_len uses the first rows of the RoPE tables, so the logits
    # of a prefix equal the first positions of the longer sequence's logits.
    model = build_model("nano", VOCAB, seed=0, max_seq_len=64)
    model.eval()
    idx = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        prefix = model(idx[:, :7])
    assert full.shape == (3, 40, VOCAB)
    assert prefix.shape == (3, 7, VOCAB)
    assert model.hidden_states(idx[:, :1]).shape == (3, 1, 96)
    assert torch.allclose(prefix, full[:, :7], atol=1e-5)


def test_sequence_longer_than_max_seq_len_is_a_config_error() -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=16)
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly max_seq_len is fine
    with pytest.raises(ConfigError, match="exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim, T = 24, 16
    cos, sin = rope_tables(T, head_dim, 10_000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    # The same q (k) at every position: (1, 1, T, D).
    rq = apply_rope(q.expand(1, 1, T, head_dim), cos, sin)[0, 0]
    rk = apply_rope(k.expand(1, 1, T, head_dim), cos, sin)[0, 0]
    scores = rq @ rk.T  # scores[m, n] = <R_m q, R_n k>
    for offset in (0, 1, 5):
        diagonal = torch.diagonal(scores, offset=-offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4)
    # Rotation keeps norms; position 0 is the identity.
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(T), atol=1e-5)
    assert torch.allclose(rq[0], q, atol=1e-6)
    assert not torch.allclose(rq[1], q, atol=1e-3)


def test_loss_is_shifted_cross_entropy_and_near_uniform_at_init() -> None:
    model = build_model("nano", VOCAB, seed=0, max_seq_len=32)
    batch = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        loss = model.loss(batch)
        logits = model(batch[:, :-1])
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    assert loss.shape == ()
    assert torch.allclose(loss, expected, atol=1e-6)
    # Init std 0.02 keeps logits near zero: the loss starts near log(vocab).
    assert abs(loss.item() - math.log(VOCAB)) < 0.1


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == torch.device(expected_auto)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda")
    else:
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
