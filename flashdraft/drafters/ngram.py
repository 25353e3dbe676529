"""Prompt lookup: copy what followed the last earlier occurrence of the context's final n-gram.

Free (no model), and strong wherever the output repeats its input: code edits, retrieval,
summaries that quote. Sizes are tried longest first; the most recent match wins, since
nearby text predicts the continuation best.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import Draft, DraftContext


def lookup(tokens: np.ndarray, sizes: tuple[int, ...], k: int) -> np.ndarray:
    """tokens [length] -> up to k continuation tokens (possibly none)."""
    length = len(tokens)
    for n in sizes:
        if length <= n:
            continue
        pattern = tokens[-n:]
        # Windows that start before the final n-gram itself and have something after them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start:start + k]
    return tokens[:0]


class NgramDrafter:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, sizes: tuple[int, ...], device: torch.device):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.device = device

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        found = lookup(np.asarray(ctx.tokens, dtype=np.int64), self.sizes, k)
        return Draft(torch.as_tensor(found, device=self.device).view(1, -1))

    def can_propose(self, tokens: list[int]) -> bool:
        """Whether a proposal from this context would draft anything (a match exists)."""
        return len(lookup(np.asarray(tokens, dtype=np.int64), self.sizes, 1)) > 0

    def commit(self, tokens: list[int]) -> None:
        pass  # it reads everything from ctx.tokens
