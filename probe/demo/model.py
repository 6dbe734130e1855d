"""A LLaMA-style decoder in plain torch: RMSNorm, rotary attention, SwiGLU MLP.

Small enough to train on a CPU in seconds at the default size; the same code
builds the LLaMA2-7B-shaped block the benchmarks use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 172
    num_layers: int = 2
    num_heads: int = 4
    max_seq_len: int = 64
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as LLaMA does, whatever the activation dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) pairs of channels by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos[: x.shape[-2]].to(x.dtype)
    sin = sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        cos, sin = rotary_tables(config)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        n, d = self.config.num_heads, self.config.head_dim
        q = self.q_proj(x).view(b, s, n, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, n, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, n, d).transpose(1, 2)
        q = apply_rotary(q, self.cos, self.sin)
        k = apply_rotary(k, self.cos, self.sin)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        # A finite fill (as HF models use) keeps -inf out of the op log, so the
        # first non-finite op of a run is a real fault, not the causal mask.
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        attn = F.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (attn @ v).transpose(1, 2).reshape(b, s, h)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy on a (batch, seq + 1) batch of token ids."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def synthetic_batch(config: LlamaConfig, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
