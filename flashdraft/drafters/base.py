"""The drafter protocol: what proposes tokens for the target to verify.

    drafter.begin(prompt)        a request begins (a draft model fills its cache here)
    drafter.propose(ctx, k)      up to k tokens after ctx.tokens -> Draft
    drafter.commit(tokens)       these tokens were appended to the sequence

The engine tells every drafter every committed token: the first token after the prefill, each
speculative step's accepted drafts plus its recovered or bonus token, and each token of plain
decoding (the adaptive policy's stretches). It never says how many of one drafter's tokens
survived: a drafter that needs that (a draft model, to know how much of its cache is still
right) compares the committed tokens with its own proposal. So several drafters, token trees
and block drafters can share one step, and a drafter whose proposal was not verified at all
simply sees tokens that do not match it. (A tree's accepted path is the spine's first n tokens
and perhaps one leaf beside d_{n+1}: to the drafter, a proposal whose first n tokens held.)

Drafters are made from a spec string by `registry.make_drafter`, the only code that knows
their names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import SamplingParams
from ..tree import SpineTree


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, k] int64, on the target's device; k may be 0
    # [batch, k, target vocab]: the logits the drafts were sampled from, at the request's
    # temperature / top-k / top-p / min-p (so q is these logits under the same rule as p).
    # None: a one-hot q (drafts that were not sampled: n-gram lookup, argmax drafts).
    # With a tree, the spine's rows only ([batch, tree.k, target vocab]).
    q_logits: torch.Tensor | None = None
    # None: the tokens are a chain. A `tree.SpineTree`: they are its nodes (the spine d_1 …
    # d_k, then the leaves depth by depth), and a depth's leaves are distinct from each other
    # and from its spine token.
    tree: SpineTree | None = None


@dataclass
class DraftContext:
    tokens: list[int]  # the committed sequence: prompt + generated; the target's cache holds
                       # all of it but the last token
    params: SamplingParams
    # The request's seed (drawn at random where the request named none): a drafter that
    # samples keys its own RNG state with it (sampling.make_rng), so a seed gives one output.
    seed: int | None
    # The target's hidden states at the positions that entered its cache since the previous
    # proposal: the prompt's before the first, then the rows of the verification pass over
    # [last, d_1 … d_k] whose tokens were committed (with n accepted, its first n + 1 rows).
    # One tensor [batch, n_new, hidden] per layer of the drafter's `hidden_layers`, in
    # ascending layer order (0 = the embeddings, i = the output of layer i); row j is the state
    # at ctx.tokens[len(tokens) - 1 - n_new + j]. Over a request the rows of all proposals
    # cover positions 0 … len(tokens) - 2 once each. Views of the pass's outputs (on a GPU, of
    # a CUDA graph's buffers): valid until the target's next pass; a drafter that keeps them
    # copies them. Empty, and never computed, when the drafter requests no layers.
    hidden: list[torch.Tensor] = field(default_factory=list)
    # Candidates a depth the engine verifies as a tree (`tree.SpineTree`): a drafter may answer
    # with a spine tree of at most tree_widths[i] - 1 leaves at depth i + 1 (none past the
    # list), or with a chain. Empty: chains only.
    tree_widths: tuple[int, ...] = ()


class Drafter(Protocol):
    # Target layers whose outputs the drafter needs in DraftContext.hidden; () for none. A
    # drafter that asks for layers sees every target pass: the engine gives it no plain stretches.
    hidden_layers: tuple[int, ...]

    def begin(self, prompt: list[int]) -> None: ...

    def propose(self, ctx: DraftContext, k: int) -> Draft: ...

    def commit(self, tokens: list[int]) -> None: ...
