"""The dense decoder: Llama 3, Qwen2 / Qwen2.5 and Qwen3 in one file, read top to bottom.

The three differ in three places only: Qwen2 has biases on q/k/v, Qwen3 normalises each head
of q and k (RMSNorm) before rope, Llama 3 rescales the rope frequencies. Weights use our own
fused names (`wqkv`, `w_gate_up`); `flashdraft.loading` maps checkpoints onto them.

`forward(tokens, positions, cache)` writes the new keys and values into the preallocated
cache at `positions` and attends over every cached position <= the query's own. Because the
mask comes from positions alone, entries left behind by rejected drafts sit beyond the
committed length and are never read; rolling back is moving a length.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama 3's long-context rescaling if present."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor,
                               torch.where(wavelen < high_wavelen, inv_freq, mid))
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; cos, sin: [batch, 1, seq, head_dim / 2]
    # Half-split ("neox") layout, as in the Hugging Face checkpoints.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.split = (q_dim, kv_dim, kv_dim)

    def forward(self, x, cos, sin, positions, mask, cache: KVCache, layer: int, kv_len: int):
        # x: [batch, seq, hidden]; positions: [batch, seq]; mask: [batch, 1, seq, kv_len] bool
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.write(layer, positions, k, v, kv_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, mask, cache, layer, kv_len):
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, mask, cache, layer, kv_len)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                kv_len: int | None = None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False):
        """Run `tokens` at `positions` through the model, writing their keys/values to `cache`.

        tokens, positions: [batch, seq] (int64). kv_len: how many cache positions attention may
        read (an upper bound on positions + 1; a static value keeps shapes fixed for CUDA graphs).
        hidden_layers: indices of layers whose outputs are returned as well (0 = the
        embeddings, i = the output of layer i). last_only: compute logits for the last position
        only (prefill).
        Returns logits [batch, seq or 1, vocab] (float32) and a list of hidden states
        [batch, seq, hidden], one per requested layer (empty when none are requested).
        """
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [batch, seq, head_dim / 2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        key_pos = torch.arange(kv_len, device=tokens.device)
        mask = (key_pos <= positions.unsqueeze(-1)).unsqueeze(1)  # [batch, 1, seq, kv_len]
        x = self.embed(tokens)
        hidden = [x] if 0 in hidden_layers else []
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, positions, mask, cache, i, kv_len)
            if i + 1 in hidden_layers:
                hidden.append(x)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float(), hidden
