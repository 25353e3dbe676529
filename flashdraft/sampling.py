"""From logits to probabilities (temperature, top-k, top-p) and sampling without host syncs.

The same transformation is applied to the target's logits (p) and the draft's (q) before the
acceptance rule, so that the rule preserves the distribution the user asked for.
"""
from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """logits [..., vocab] -> probabilities [..., vocab] (float32). temperature must be > 0."""
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before
        # it is still short of top_p (so the most likely token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] -> [...] (int64), on the device.

    The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is distributed as p, and needs
    neither a cumulative sum nor a host round trip.
    """
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)
