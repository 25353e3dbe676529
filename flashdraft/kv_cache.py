"""A preallocated key/value cache addressed by explicit positions.

Nothing is appended or concatenated: a forward pass writes its keys and values at the
positions it is given, and attention reads positions [0, kv_len). Which entries count is
decided by the attention mask (key position <= query position), so the cache itself never
has to forget anything: after a rejected draft, `lengths` moves back and the stale entries
are overwritten by the next pass.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, batch, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        # Committed length of each sequence, kept on the host: the engine knows it anyway.
        self.lengths = [0] * batch
        self._batch_index = torch.arange(batch, device=device).unsqueeze(1)  # [batch, 1]

    @classmethod
    def for_model(cls, cfg, batch: int, max_len: int, dtype, device) -> "KVCache":
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, kv_heads, seq, head_dim] at positions [batch, seq]; return the
        readable part of this layer's cache, [batch, kv_heads, kv_len, head_dim] each."""
        b = positions.shape[0]
        index = (self._batch_index[:b], slice(None), positions)
        # Advanced indices around a slice put the indexed dims first: [batch, seq, heads, dim].
        self.k[layer][index] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][index] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[layer, :b, :, :kv_len], self.v[layer, :b, :, :kv_len]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
