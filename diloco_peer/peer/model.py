"""A Chinchilla-style decoder-only transformer.

Pre-norm RMSNorm blocks, rotary position embeddings, a gated (SwiGLU) MLP, tied input/output
embeddings. Shapes in comments: B batch, T sequence length, C model width, H heads, D head dim.
Presets follow the papers' tables (DiLoCo Table 1, Async Local-SGD Table 6) plus two small
ones for tests and CPU demos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diloco_peer.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    head_dim: int
    mlp_hidden: int
    max_seq_len: int = 2048
    rope_base: float = 10_000.0


# name -> (layers, width, heads, head dim). The paper models use vocab 32k; ours take the
# tokenizer's vocabulary, so parameter counts differ a little from the names at other vocabs.
_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "nano": (3, 96, 4, 24),  # ~0.36M params with the 256-byte vocabulary
    "tiny": (5, 192, 6, 32),  # ~2.3M
    "20m": (6, 256, 4, 64),  # Async Local-SGD Table 6
    "60m": (3, 896, 16, 64),  # DiLoCo Table 1
    "150m": (12, 896, 16, 64),
    "400m": (12, 1536, 12, 128),
}


def model_config(preset: str, vocab_size: int, max_seq_len: int = 2048) -> ModelConfig:
    if preset not in _PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of: {', '.join(_PRESETS)}")
    n_layer, d_model, n_head, head_dim = _PRESETS[preset]
    # SwiGLU hidden width ~ 8/3 C keeps the MLP's parameter count at that of a 4C GELU MLP;
    # rounded to a multiple of 32 for friendlier matmuls.
    hidden = 32 * math.ceil(8 * d_model / 3 / 32)
    return ModelConfig(
        vocab_size=vocab_size,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        head_dim=head_dim,
        mlp_hidden=hidden,
        max_seq_len=max_seq_len,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under autocast: the mean of squares underflows in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles, each (seq_len, head_dim / 2): channel pair j of
    position t turns by t · base^(-2j / head_dim) (RoFormer, arXiv 2104.09864, §3.4.2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each interleaved channel pair (2j, 2j+1) of x (B, H, T, D) by its position's
    angle from `rope_tables` (export_hf.py maps this layout onto transformers' halves)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        inner = cfg.n_head * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.proj = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_head * self.head_dim, dim=-1)
        # (B, T, H*D) -> (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.d_model), GatedMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
        # Buffers, not parameters: derived from the config, so never averaged or checkpointed.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 style: shrink residual-branch outputs so activations do not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """Final normalised hidden states, (B, T) token ids -> (B, T, C)."""
        T = idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ConfigError(f"sequence of {T} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits. Output projection tied to the embedding."""
        return F.linear(self.hidden_states(idx), self.embed.weight)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of a packed batch of shape (B, T + 1)."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def build_model(preset: str, vocab_size: int, seed: int, max_seq_len: int = 2048) -> Transformer:
    """A freshly initialised model; the same (preset, vocab, seed) gives the same weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return Transformer(model_config(preset, vocab_size, max_seq_len))
    finally:
        torch.random.set_rng_state(generator_state)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is bad input."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; choose auto, cpu or cuda")
    return torch.device(name)


def autocast_context(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; a disabled context on CPU (fp32 keeps runs reproducible)."""
    return torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
    )
