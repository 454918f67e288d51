"""`export --format hf`: the global model as a Hugging Face transformers `LlamaForCausalLM`
folder, and `load_hf`, which reads one back (safetensors only, no pickle).

Why our model maps exactly onto Llama (see model.py): pre-norm RMSNorm (same formula, eps
1e-6, normalised in fp32), SwiGLU MLP (`silu(gate) * up`), no biases, tied embeddings, full
multi-head attention scaled by 1/sqrt(head_dim), rotary positions with the original base. The
one difference is the rotary channel layout: ours rotates interleaved pairs (2j, 2j+1), HF's
`rotate_half` rotates split halves (j, j + D/2). Permuting the q and k rows of every head by
[0, 2, 4, ..., 1, 3, 5, ...] turns one into the other; q·k is unchanged because q and k get
the same permutation, and v / the output projection are not rotated, so they stay as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from diloco_peer.errors import BadInput, ConfigError, DilocoError
from diloco_peer.peer.export_source import (
    EXPORT_FORMAT,
    ExportSource,
    model_description,
    norm_eps,
    source_doc,
)
from diloco_peer.peer.model import Transformer

SIDECAR_FILE = "diloco_peer.json"  # beside an hf export: where its weights came from
_HF_INSTALL = "pip install 'diloco-peer[hf]'"


def require_transformers() -> Any:
    """The transformers module, or BadInput naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise BadInput(
            f"--format hf needs the transformers package: {_HF_INSTALL}, "
            "or use --format safetensors"
        ) from None
    return transformers


def check_llama_compatible(model: Transformer) -> None:
    """ConfigError naming what Llama cannot express, if anything. The logit check after the
    export catches what this structural check cannot see (e.g. a changed activation)."""
    cfg = model.cfg
    reasons = []
    if cfg.head_dim % 2:
        reasons.append(f"rotary positions need an even head_dim, the model has {cfg.head_dim}")
    biases = [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    if biases:
        reasons.append(f"it has biases ({', '.join(biases[:3])}, ...), the mapping carries none")
    try:
        norm_eps(model)
    except ConfigError as e:
        reasons.append(f"{e}; Llama has a single rms_norm_eps")
    if reasons:
        raise ConfigError(
            "this model cannot be represented exactly as a transformers LlamaForCausalLM: "
            + "; ".join(reasons)
            + ". Use --format safetensors."
        )


def llama_config_kwargs(model: Transformer) -> dict[str, Any]:
    """LlamaConfig arguments describing `model` exactly."""
    cfg = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,  # full multi-head attention, no grouped KV
        "head_dim": cfg.head_dim,  # explicit: d_model need not equal n_head * head_dim
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": norm_eps(model),
        "rope_theta": cfg.rope_base,  # transformers 5 folds it into rope_parameters
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        # The run's tokenizers have no BOS/EOS/PAD; Llama's defaults (1, 2) would be wrong.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _check_rope(config: Any, base: float) -> None:
    """The config as transformers understood it must give our plain rotary frequencies."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = getattr(config, "rope_scaling", None) or {}  # transformers 4: scaling lives here
    rope_type = params.get("rope_type", scaling.get("rope_type", "default"))
    if theta != base or rope_type != "default":
        raise ConfigError(
            f"this transformers version configures rotary embeddings as {rope_type!r} with base "
            f"{theta}, the model needs 'default' with base {base}; use --format safetensors"
        )


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order taking our interleaved rotary pairs (2j, 2j+1) to HF's halves (j, j + D/2)."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under LlamaForCausalLM names, q/k rows permuted for `rotate_half`."""
    cfg = model.cfg
    H, D, C, F = cfg.n_head, cfg.head_dim, cfg.d_model, cfg.mlp_hidden
    perm = rope_permutation(D)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}

    def rope_rows(w: torch.Tensor) -> torch.Tensor:
        # (H*D, C) -> (H, D, C), reorder each head's rows, back to (H*D, C)
        return w.view(H, D, C)[:, perm, :].reshape(H * D, C).contiguous()

    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"]  # tied; save_pretrained stores it once
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[src + "attn.qkv.weight"].split(H * D, dim=0)  # each (H*D, C)
        gate, up = sd[src + "mlp.gate_up.weight"].split(F, dim=0)  # each (F, C)
        out |= {
            dst + "input_layernorm.weight": sd[src + "norm1.weight"],
            dst + "self_attn.q_proj.weight": rope_rows(q),
            dst + "self_attn.k_proj.weight": rope_rows(k),
            dst + "self_attn.v_proj.weight": v.contiguous(),
            dst + "self_attn.o_proj.weight": sd[src + "attn.proj.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "norm2.weight"],
            dst + "mlp.gate_proj.weight": gate.contiguous(),
            dst + "mlp.up_proj.weight": up.contiguous(),
            dst + "mlp.down_proj.weight": sd[src + "mlp.down.weight"],
        }
    return out


def write_hf(source: ExportSource, folder: Path) -> None:
    """Write a transformers LlamaForCausalLM folder and its sidecar into `folder`."""
    transformers = require_transformers()
    model = source.model
    check_llama_compatible(model)
    config = transformers.LlamaConfig(**llama_config_kwargs(model))
    _check_rope(config, model.cfg.rope_base)
    with torch.random.fork_rng(devices=[]):  # its random init must not move the caller's RNG
        hf = transformers.LlamaForCausalLM(config).to(torch.float32)
    weights = llama_state_dict(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise DilocoError(
            f"Llama weight mapping is incomplete: missing {missing}, unexpected {unexpected}"
        )
    hf.tie_weights()
    hf.save_pretrained(folder, safe_serialization=True)
    sidecar = {
        "format": EXPORT_FORMAT,
        "preset": source.run.model,
        "model": model_description(model),
        "run": source.run.to_dict(),
        "source": source_doc(source),
        "note": "q_proj/k_proj rows are permuted per head from diloco-peer's interleaved "
        "rotary layout to transformers' rotate_half layout; logits are unchanged",
    }
    (folder / SIDECAR_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")


def load_hf(folder: str | Path) -> Any:
    """An hf export as a transformers LlamaForCausalLM in fp32 (safetensors only, no pickle)."""
    transformers = require_transformers()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(folder), use_safetensors=True, **{dtype_kw: torch.float32}
    )
    return model.eval()
