"""Several drafters, one proposal a step: the one expected to give the most tokens per second.

A step with a proposal of m tokens from drafter i is expected to give E_i(m) = 1 + Σ_{j ≤ m}
Π_{l ≤ j} α_{i,l} tokens (`scheduling.expected_tokens`) and to cost, in plain steps, about
1.1 + (c_i + 0.02) · m: the verification, and c_i a drafted token (a draft model: its weight
bytes over the target's, as a decode step streams them once; n-gram lookup: nothing). Each step
the cheap drafters propose first (n-gram lookup costs a search of the host's token list); a
drafter with a cost proposes only where its expected rate beats theirs. α_{i,l} are running
per-position acceptances of each drafter's own proposals, learnt from the committed tokens as
every drafter learns them (`commit`): the first tokens that equal its proposal were accepted.

Every drafter sees every committed token, so a draft model whose proposals were not used for a
while catches up (feeds the tokens since its last proposal) when it is used again.

The engine's cost model (`scheduling`) chooses k and plain decoding for this drafter as a whole;
this chooses whose proposal fills the step.
"""
from __future__ import annotations

import torch

from ..scheduling import PRIOR_ACCEPTANCE, Ema, expected_tokens
from .base import Draft, DraftContext

DECAY = 0.8  # of a drafter's per-position acceptance, per step it drafted


class BestOfDrafters:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, drafters: list, costs: list[float]):
        """drafters: without hidden_layers (a drafter that reads the target's hidden states must
        see every pass); costs: each one's cost a drafted token, over the target's step."""
        if len(drafters) < 2 or len(costs) != len(drafters):
            raise ValueError("a combination takes two or more drafters, with a cost each")
        for d in drafters:
            if d.hidden_layers:
                raise ValueError(f"{type(d).__name__} reads the target's hidden states at every "
                                 f"step and cannot share steps with other drafters; use it alone")
        order = sorted(range(len(drafters)), key=lambda i: costs[i])  # the cheap ones first
        self.drafters = [drafters[i] for i in order]
        self.costs = [float(costs[i]) for i in order]
        self.alphas = [[] for _ in self.drafters]  # [drafter][position]: Ema
        self.chosen: list[int] = []  # the drafter of each proposal of the request
        self._proposal: tuple[int, torch.Tensor] | None = None  # (drafter, its tokens [1, m])
        models = [getattr(d, "model", None) for d in self.drafters]
        self.model = next((m for m in models if m is not None), None)  # the costly one's
        self.cost_hint = max(self.costs)

    @property
    def builds_trees(self) -> bool:
        return any(getattr(d, "builds_trees", False) for d in self.drafters)

    def ensure_capacity(self, max_len: int, steps: int = 1) -> None:
        for d in self.drafters:
            if hasattr(d, "ensure_capacity"):
                d.ensure_capacity(max_len, steps)

    def begin(self, prompt: list[int]) -> None:
        for d in self.drafters:
            d.begin(prompt)
        self.chosen, self._proposal = [], None

    def can_propose(self, tokens: list[int]) -> bool:
        return any(getattr(d, "can_propose", lambda t: True)(tokens) for d in self.drafters)

    def rate(self, i: int, m: int) -> float:
        """Drafter i's expected tokens per plain step for a proposal of m tokens."""
        alphas = [a.value for a in self.alphas[i]] or [PRIOR_ACCEPTANCE]
        return expected_tokens(alphas, m) / (1.1 + (self.costs[i] + 0.02) * m)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        best, empty = None, None  # (rate, drafter, draft); an empty draft
        for i, d in enumerate(self.drafters):
            if best is not None and self.rate(i, k) <= best[0]:
                continue  # even k tokens from it would not beat what is in hand
            draft = d.propose(ctx, k)
            m = draft.tree.k if draft.tree is not None else draft.tokens.shape[1]
            if m == 0:
                empty = draft
            elif best is None or self.rate(i, m) > best[0]:
                best = (self.rate(i, m), i, draft)
        if best is None:
            return empty
        _, i, draft = best
        spine = draft.tokens[:, :draft.tree.k] if draft.tree is not None else draft.tokens
        self._proposal = (i, spine)
        self.chosen.append(i)
        return draft

    def commit(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.commit(tokens)
        proposal, self._proposal = self._proposal, None
        if proposal is None:
            return
        i, spine = proposal
        drafted = spine[0].tolist()  # the step's one synchronisation has passed it
        m = 0
        while m < min(len(tokens), len(drafted)) and tokens[m] == drafted[m]:
            m += 1
        for j in range(min(len(drafted), m + 1)):  # positions that were tested
            if len(self.alphas[i]) <= j:
                self.alphas[i].append(Ema(DECAY))
            self.alphas[i][j].add(1.0 if j < m else 0.0)

