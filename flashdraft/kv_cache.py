"""A preallocated key/value cache addressed by explicit positions.

Nothing is appended or concatenated: a forward pass writes its keys and values at the
positions it is given, and attention reads positions [0, kv_len). Which entries count is
decided by the attention mask (key position <= query position), so the cache itself never
has to forget anything: after a rejected draft the sequence's length (its owner's, on the
host) moves back and the stale entries are overwritten by the next pass.

Keys and values of a layer live in one tensor so that a single write stores both: the model
hands over the key and value heads of its fused qkv projection as they come
(`kernels.rope_and_cache_write`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .backends import kernels


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, 2, batch, num_kv_heads, max_len, head_dim)
        # [layers, 2 (keys, values), batch, kv_heads, max_len, head_dim]
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # Views, not copies: [layers, batch, kv_heads, max_len, head_dim] each.
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.max_len = max_len
        # Positions one attention program reads on the GPU (kernels.attention); the engine sets
        # it per request (from the request's length, not the cache's).
        self.split_len = kernels.split_length(max_len)

    @classmethod
    def for_model(cls, cfg, batch: int, max_len: int, dtype, device) -> "KVCache":
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    def read(self, layer: int, batch: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [batch, kv_heads, kv_len, head_dim] of a layer: views."""
        return self.kv[layer, 0, :batch, :, :kv_len], self.kv[layer, 1, :batch, :, :kv_len]

    def graph_key(self) -> tuple:
        """What a CUDA graph of a step over this cache depends on: its tensors' addresses and
        shapes."""
        return (self.kv.data_ptr(), tuple(self.kv.shape))

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def overwritten_inputs(self, start: int, t: int) -> list[torch.Tensor]:
        """What a step of t tokens from `start` reads and then overwrites (`hybrid.HybridCache`'s
        rings can hold such slots): nothing here, a step writes keys and values it never read,
        so running it twice is running it once."""
        return []

    def fits(self, max_len: int, steps: int = 1, tree_nodes: int = 0) -> bool:
        """Whether this cache serves sequences of max_len positions (rolled back any number of
        positions, trees of any size: `steps` and `tree_nodes` do not matter here)."""
        return self.max_len >= max_len

    def compact(self, start: int, path: Sequence[int]) -> None:
        """Move the keys and values of the accepted tree nodes `path` (node indices, root to
        leaf; node i was written at slot start + i, `tree.TreeMask`) to slots start .. start +
        len(path) - 1, in every layer at once: the cache then holds what decoding that path
        alone would have written there. The gather copies before the scatter writes, so sources
        and targets may overlap."""
        if not path:
            return
        if min(path) < 0 or start + max(path) >= self.max_len:
            raise ValueError(f"path {list(path)} from slot {start} leaves the cache's "
                             f"{self.max_len} slots: node indices are 0 .. T - 1 of the tree")
        src = torch.tensor(path, dtype=torch.int64).to(self.kv.device) + start
        dst = torch.arange(start, start + len(path), device=self.kv.device)
        self.kv.index_copy_(4, dst, self.kv.index_select(4, src))

    def commit(self, length: int) -> None:
        """The sequence is `length` tokens long (after a verification, the rejected drafts are
        dropped). Nothing to do: entries past it are masked by position and overwritten by the
        next step. Called after every verification, as a recurrent model's cache
        (`hybrid.HybridCache.commit`) needs."""


def grow_cache(owner, length: int, steps: int = 1, tree_nodes: int = 0) -> None:
    """Give `owner` (the engine or a draft model: its .model, .dtype, .device, .cache and
    .megakernel) a cache of at least `length` positions, from which a step of up to `steps`
    tokens can be rolled back and token trees of up to `tree_nodes` tokens verified
    (`model.new_cache`). A new cache frees the old one and the
    megakernel bound to it first, so the two never take GPU memory at once."""
    if owner.cache is None or not owner.cache.fits(length, steps, tree_nodes):
        owner.cache = owner.megakernel = None
        owner.cache = owner.model.new_cache(1, length, owner.dtype, owner.device, steps,
                                            tree_nodes)
