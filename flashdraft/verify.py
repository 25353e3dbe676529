"""The acceptance rule: which drafted tokens the target keeps, and the one token it adds.

Notation, fixed across the project: p = target probabilities, q = draft probabilities,
k = number of drafted tokens. The target has scored `[last token, d_1 … d_k]` in one pass, so
it holds k + 1 distributions: p_1 … p_k for the drafted positions and p_{k+1} after them.

Outputs:
- num_accepted n: the length of the accepted prefix d_1 … d_n (0 <= n <= k);
- next token: the *recovered* token, drawn from norm(max(p_{n+1} - q_{n+1}, 0)), when d_{n+1}
  was rejected; the *bonus* token, drawn from p_{k+1}, when all k were accepted.

`SampledVerify` is the same rule as a step's `post`: p and q built from logits and RowStats
(no sort), the accept test, the residual's draw at the first rejected position, all on the
device and inside the step's CUDA graph. `verify_sampled` is its PyTorch statement, from
probabilities, kept as the reference.

At temperature 0 the rule is prefix matching against the target's argmax, and the next token
is the argmax at position n + 1. Everything stays on the device: the caller reads n (and the
tokens) back in one transfer per step.
"""
from __future__ import annotations

import torch

from .sampling import RowStats, SampledPick, prob_at, race, sample, uniform


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor):
    """draft: [batch, k] token ids; target_logits: [batch, k+1, vocab].
    Returns num_accepted [batch] and next_token [batch] (int64)."""
    best = target_logits.argmax(-1)  # [batch, k+1]
    k = draft.shape[1]
    num_accepted = (draft == best[:, :k]).int().cumprod(-1).sum(-1).long()
    next_token = best.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, next_token


def greedy_result(tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a step over tokens [1, k+1] = [last token, d_1 … d_k] (k >= 1),
    packed for one transfer: int64 [k + 2] = [num_accepted, next token, d_1 … d_k]. A function
    of tensors only, so that it runs inside the step's CUDA graph."""
    num_accepted, next_token = verify_greedy(tokens[:, 1:], target_logits)
    return torch.cat([num_accepted, next_token, tokens[0, 1:]])


def verify_sampled(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                   generator: torch.Generator | None = None):
    """Lossless rejection sampling.

    draft: [batch, k] token ids, drawn from q.
    q: [batch, k, vocab] draft probabilities, or None for a drafter without probabilities
       (n-gram lookup, argmax drafts): a one-hot q, under which d_i is accepted with
       probability p_i(d_i) and the residual is p_i with d_i removed.
    p: [batch, k+1, vocab] target probabilities (after temperature / top-k / top-p).
    Returns num_accepted [batch] and next_token [batch] (int64).
    """
    batch, k = draft.shape
    rows = torch.arange(batch, device=p.device)
    p_draft = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    q_draft = (torch.ones_like(p_draft) if q is None
               else q.gather(-1, draft.unsqueeze(-1)).squeeze(-1))
    # Accept d_i with probability min(1, p/q): u * q < p for u ~ U[0, 1). The strict '<' never
    # accepts a token the target gives zero mass, and always accepts when q = 0 < p.
    u = torch.rand(p_draft.shape, device=p.device, generator=generator)
    accepted = u * q_draft < p_draft  # [batch, k]
    num_accepted = accepted.int().cumprod(-1).sum(-1).long()  # [batch]

    # Only the distribution at position n + 1 is needed: gather it instead of building k.
    p_next = p[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < k  # [batch]; False: all accepted, draw the bonus from p_{k+1}
    if q is None:
        q_next = torch.zeros_like(p_next)
        if k:
            d_next = draft.gather(1, num_accepted.clamp(max=k - 1).unsqueeze(1))  # [batch, 1]
            q_next.scatter_(1, d_next, rejected.unsqueeze(1).to(q_next.dtype))
    else:
        q_pad = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)  # [batch, k+1, vocab]
        q_next = q_pad[rows, num_accepted]
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # mass = 0 only when p_{n+1} = q_{n+1}, where a rejection has probability 0: fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return num_accepted, sample(residual, generator)


# Streams of one step's random numbers: the acceptance tests' and the race's (SampledPick's 0).
ACCEPT_STREAM = 1


class SampledVerify(SampledPick):
    """Sampled verification of a step over tokens [1, k+1] = [last token, d_1 … d_k] as the
    step's `post`, packed like `greedy_result`: int64 [k + 2] = [n, next token, d_1 … d_k].

    q: the draft's logits, loaded into this object's buffer [capacity, V] before the step
    (`load`), with with_q=True; else the drafts are one-hot (n-gram lookup). The target's and
    the draft's rows get the same temperature / top-k / top-p / min-p. One RNG state for the
    step (`state`): the k acceptance numbers and the race of the next token share its
    counter, which the race advances."""

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float,
                 state: torch.Tensor, *, fused: bool, vocab: int, with_q: bool,
                 capacity: int = 0):
        super().__init__(temperature, top_k, top_p, min_p, state, fused=fused, vocab=vocab)
        self.q = (torch.zeros(capacity, vocab, dtype=torch.float32, device=state.device)
                  if with_q else None)

    def load(self, q_logits: torch.Tensor) -> None:
        """The draft's logits [k, V] (any float dtype) into the buffer the step reads."""
        if self.q is None or q_logits.shape[0] > self.q.shape[0]:
            raise ValueError(f"this verifier holds {0 if self.q is None else self.q.shape[0]} "
                             f"rows of q, not {q_logits.shape[0]}")
        self.q[:q_logits.shape[0]].copy_(self.fit(q_logits), non_blocking=True)

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        drafts = tokens[0, 1:]  # [k]
        k = drafts.shape[0]
        rows = self.fit(logits[0])  # [k + 1, V]
        p_stats = self.stats(rows)
        p_d = prob_at(rows[:k], drafts, self.temperature, RowStats(*(x[:k] for x in p_stats)))
        if self.q is not None:
            q_rows = self.q[:k]
            q_stats = self.stats(q_rows)
            q_d = prob_at(q_rows, drafts, self.temperature, q_stats)
        else:
            q_d = torch.ones_like(p_d)
        # Accept d_i with probability min(1, p/q), as verify_sampled does.
        u = uniform(self.state, k, fused=self.fused, stream=ACCEPT_STREAM)
        n = (u * q_d < p_d).int().cumprod(0).sum().long().view(1)  # [1]
        row = rows.index_select(0, n)  # [1, V]: p_{n+1}
        stats = RowStats(*(x.index_select(0, n) for x in p_stats))
        rejected = n < k
        at = n.clamp(max=k - 1)  # the rejected draft's row (any, when all were accepted)
        if self.q is not None:  # w = max(p - q, 0); q = 0 (t = inf) for the bonus token
            q_at = RowStats(*(x.index_select(0, at) for x in q_stats))
            q_at = q_at._replace(t=torch.where(rejected, q_at.t, float("inf")))
            token = race(row, self.temperature, stats, self.state, fused=self.fused,
                         q_logits=q_rows.index_select(0, at), q_stats=q_at)
        else:  # w = p less the rejected draft; nothing removed for the bonus token
            skip = torch.where(rejected, drafts.index_select(0, at), -1)
            token = race(row, self.temperature, stats, self.state, fused=self.fused,
                         q_onehot=skip)
        return torch.cat([n, token, drafts])
