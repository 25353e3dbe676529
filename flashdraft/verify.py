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

from .sampling import RowStats, SampledPick, prob_at, probs_from_stats, race, sample, uniform


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

    def stats_pq(self, rows: torch.Tensor, q_rows: torch.Tensor | None):
        """RowStats of the target's rows [r, V] and of the draft's [r', V] (None: none), found
        in one pass of the kernels over both: each row's stats are its own, and one descent
        over r + r' rows costs about what one over r rows does (its programs run side by
        side), half of two."""
        if q_rows is None:
            return self.stats(rows), None
        both = self.stats(torch.cat([rows, q_rows]))
        n = rows.shape[0]
        return _take(both, slice(0, n)), _take(both, slice(n, None))

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        drafts = tokens[0, 1:]  # [k]
        k = drafts.shape[0]
        rows = self.fit(logits[0])  # [k + 1, V]
        q_rows = self.q[:k] if self.q is not None else None
        p_stats, q_stats = self.stats_pq(rows, q_rows)
        p_d = prob_at(rows[:k], drafts, self.temperature, RowStats(*(x[:k] for x in p_stats)))
        if self.q is not None:
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


class SpineTreeGreedy:
    """Greedy verification of a `tree.SpineTree` as a step's post: the longest path whose every
    token is the target's argmax after its parent. tokens [1, T + 1] = [last, nodes], logits
    [1, T + 1, V] -> int64 [T + 3] = [n, leaf, next token, nodes]: n spine tokens accepted,
    then the leaf of depth n + 1 that equals the argmax there (its node index; -1: none), and
    the argmax after the path. One object per tree (graphs key on it)."""

    def __init__(self, tree):
        self.tree = tree

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        k, nodes = self.tree.k, tokens[0, 1:]  # [T]
        best = logits[0].argmax(-1)  # [T + 1]
        n = (nodes[:k] == best[:k]).int().cumprod(0).sum().view(1)  # [1]
        hit = nodes[k:] == best.index_select(0, self.tree.leaf_rows)  # [L]: the argmax there
        leaf, row = _first_leaf(self.tree, n, hit)
        return torch.cat([n, leaf, best.index_select(0, row), nodes])


def _first_leaf(tree, n: torch.Tensor, hit: torch.Tensor):
    """Of the leaves at depth n + 1 (tree.leaf_rows == n) that `hit` ([L] bool), the first:
    (its node index, or -1, [1]; the pass row after the path: the leaf's, else n, [1])."""
    hit = hit & (tree.leaf_rows == n)
    if hit.numel() == 0:
        return torch.full_like(n, -1), n
    found = hit.any().view(1)
    first = hit.int().argmax().view(1)  # the first True (0 where none)
    leaf = torch.where(found, tree.k + first, -1)
    return leaf, torch.where(found, 1 + tree.k + first, n)


class SpineTreeVerify(SampledVerify):
    """Sampled verification of a `tree.SpineTree` as a step's post, packed like
    `SpineTreeGreedy`: int64 [T + 3] = [n, leaf, next token, nodes]. Lossless: at each depth
    the spine token d_i is tested as a chain's (min(1, p/q) with q, p(d_i) one-hot); where it
    is rejected, the target's token there is distributed as the residual r = norm(max(p - q,
    0)) (one-hot: p without d_i), and that draw is made by trying the leaves in turn as one-hot
    drafts of r (leaf x accepted with r(x), else removed from r and r renormalised; SpecInfer's
    recursive rule), then, if none is kept, drawing from what is left of r. So every position's
    token keeps the target's distribution, and a kept leaf's own row gives the bonus token.
    The leaves are the drafter's top candidates beside d_i, a function of the draft alone
    (independent of the target's random numbers), as the rule needs."""

    def __init__(self, tree, temperature: float, top_k: int, top_p: float, min_p: float,
                 state: torch.Tensor, *, fused: bool, vocab: int, with_q: bool):
        super().__init__(temperature, top_k, top_p, min_p, state, fused=fused, vocab=vocab,
                         with_q=with_q, capacity=tree.k)
        self.tree = tree

    def __call__(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tree, temp = self.tree, self.temperature
        k, nodes = tree.k, tokens[0, 1:]  # [T]
        spine, leaves = nodes[:k], nodes[k:]  # [k], [L]
        rows = self.fit(logits[0])  # [T + 1, V]
        q_rows = self.q[:k] if self.q is not None else None
        p_stats, q_stats = self.stats_pq(rows, q_rows)
        p_d = prob_at(rows[:k], spine, temp, _take(p_stats, slice(0, k)))
        if q_rows is not None:
            q_d = prob_at(q_rows, spine, temp, q_stats)
        else:
            q_d = torch.ones_like(p_d)
        u = uniform(self.state, k + leaves.numel(), fused=self.fused, stream=ACCEPT_STREAM)
        n = (u[:k] * q_d < p_d).int().cumprod(0).sum().long().view(1)  # [1]
        rejected = n < k
        at = n.clamp(max=k - 1)  # the rejected spine token's row (any, when all were kept)
        row_n = rows.index_select(0, n)  # [1, V]: p_{n+1}
        stats_n = _take(p_stats, n)
        # r at the leaves of depth n + 1 and its whole mass, to try them in turn.
        if q_rows is not None:
            q_at = _take(q_stats, at)
            q_row = q_rows.index_select(0, at)  # [1, V]
            mass = (probs_from_stats(row_n, temp, stats_n)
                    - probs_from_stats(q_row, temp, q_at)).clamp_min(0).sum().view(1)
        else:
            mass = 1 - p_d.index_select(0, at)
        leaf, row = n, n
        if leaves.numel():
            m = leaves.numel()
            r = prob_at(row_n.expand(m, -1), leaves, temp, _expand(stats_n, m))
            if q_rows is not None:
                r = (r - prob_at(q_row.expand(m, -1), leaves, temp, _expand(q_at, m))).clamp_min(0)
            r = torch.where((tree.leaf_rows == n) & rejected, r, 0.0)  # [L]: depth n + 1's only
            left = mass - (r.cumsum(0) - r)  # r's mass when each leaf's turn comes
            leaf, row = _first_leaf(tree, n, u[k:] * left < r)
            # Where no leaf was kept, the draw from r leaves out the leaves that were tried.
            tried = torch.zeros(rows.shape[1], device=rows.device).index_add_(
                0, leaves, (r > 0).float() * (leaf < 0).float())
            row_n = torch.where(tried > 0, float("-inf"), row_n)
        kept_leaf = leaf >= 0
        draw_row = torch.where(kept_leaf, rows.index_select(0, row), row_n)
        draw_stats = _take(p_stats, row)
        use_q = rejected & ~kept_leaf  # the residual's draw; else the bonus, from p as it is
        if q_rows is not None:
            q_use = q_at._replace(t=torch.where(use_q, q_at.t, float("inf")))
            token = race(draw_row, temp, draw_stats, self.state, fused=self.fused,
                         q_logits=q_row, q_stats=q_use)
        else:
            skip = torch.where(use_q, spine.index_select(0, at), -1)
            token = race(draw_row, temp, draw_stats, self.state, fused=self.fused, q_onehot=skip)
        return torch.cat([n, leaf, token, nodes])


def _take(stats: RowStats, rows) -> RowStats:
    """The RowStats of some rows: a slice, or an index tensor."""
    if isinstance(rows, slice):
        return RowStats(*(x[rows] for x in stats))
    return RowStats(*(x.index_select(0, rows) for x in stats))


def _expand(stats: RowStats, m: int) -> RowStats:
    """One row's RowStats repeated for m rows (views)."""
    return RowStats(*(x.expand(m) for x in stats))
