"""From logits to probabilities (temperature, top-k, top-p, min-p) and sampling without host syncs.

The same transformation is applied to the target's logits (p) and the draft's (q) before the
acceptance rule, so that the rule preserves the distribution the user asked for.

Semantics, per row of logits [R, V]. s = logits.float() / temperature, m = max s, and each
token has the mass e_x = exp(s_x - m). The kept set is {x : s_x >= t}, t = max(t_k, t_p, t_min):

- top_k > 0 (and < V): t_k = the k-th largest value of s; tokens tied with it are all kept.
  Otherwise t_k = -inf.
- top_p < 1: over the top-k-kept set, of mass Z_k, x is kept iff the mass of the kept tokens
  with s_y > s_x is < top_p · Z_k; t_p = the least s_x so kept. This is the usual rule (sort
  descending, drop a token once the mass before it reaches top_p), except that tied tokens
  share one fate, so the set does not depend on how a sort orders them.
- min_p > 0: t_min = m + log(min_p), i.e. p_x >= min_p · max p.

Then p_x = e_x / z for kept x and 0 otherwise, z = the kept mass. `RowStats` (t, m, z) is all
a row needs: `probs_from_stats` and `race` rebuild p from the logits as they read them.

`row_stats(..., fused=True)` finds them without sorting the vocabulary (Triton,
`backends.sampling_kernels`: a descent through histograms of the row down to a cell of few
enough tokens to sort); `row_stats_reference` sorts. Both give the same t, bit for bit, save
where a cumulative mass lands within rounding of top_p · Z_k.

Sampling is the exponential race: argmax over kept x of log w_x - log E_x, E_x ~ Exp(1), is
distributed as w / sum w, and needs neither a cumulative sum nor a host round trip. The fused
race draws E from Philox keyed by an RNG state on the device, `rng` = int64 [2] = (seed,
counter), which each call advances by one on the device, so a captured CUDA graph draws new
numbers at every replay and the same seed gives the same tokens.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RowStats(NamedTuple):
    """What the kept set and p of each row come down to; all float32, on the logits' device."""
    t: torch.Tensor  # [R] threshold on s: kept iff s >= t
    m: torch.Tensor  # [R] max of s
    z: torch.Tensor  # [R] kept mass, sum of exp(s - m) over s >= t


def check_params(temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0 here (0, greedy, takes the argmax instead), "
                         f"got {temperature!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be a whole number >= 0 (0: off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if not (isinstance(min_p, (int, float)) and 0.0 <= min_p < 1.0):
        raise ValueError(f"min_p must be in [0, 1) (0: off), got {min_p!r}")


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """s = logits.float() / temperature, correctly rounded on every device, as the kernels
    compute it: PyTorch's CUDA division by a Python number multiplies by its reciprocal
    instead, which can differ in the last bit (and then t and m would too)."""
    x = logits.float()
    return x / x.new_full((), float(temperature)) if x.is_cuda else x / temperature


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    return logits


def row_stats_reference(logits: torch.Tensor, temperature: float, top_k: int = 0,
                        top_p: float = 1.0, min_p: float = 0.0) -> RowStats:
    """logits [R, V] -> RowStats, by sorting each row (the definition, in PyTorch)."""
    check_params(temperature, top_k, top_p, min_p)
    s = scaled(_rows(logits), temperature)  # [R, V]
    vocab = s.shape[-1]
    m = s.amax(-1)  # [R]
    neg_inf = torch.full_like(m, float("-inf"))
    t_k = torch.topk(s, top_k, dim=-1).values[:, -1] if 0 < top_k < vocab else neg_inf
    t_p = neg_inf
    if top_p < 1.0:  # the only rule that needs the row in order
        ordered = s.sort(-1, descending=True).values  # [R, V]
        in_k = ordered >= t_k[:, None]
        e_k = torch.where(in_k, torch.exp(ordered - m[:, None]), 0.0)
        before = e_k.cumsum(-1) - e_k
        # Kept positions form a prefix; its least value takes the ties after it along.
        keep = in_k & (before < top_p * e_k.sum(-1, keepdim=True))
        t_p = torch.where(keep, ordered, float("inf")).amin(-1)
    t_min = m + math.log(min_p) if min_p > 0.0 else neg_inf
    t = torch.maximum(torch.maximum(t_k, t_p), t_min)
    z = torch.where(s >= t[:, None], torch.exp(s - m[:, None]), 0.0).sum(-1)
    return RowStats(t, m, z)


def row_stats(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, *, fused: bool, **kernel_args) -> RowStats:
    """logits [R, V] -> RowStats. fused=True: the Triton kernels (CUDA tensors, or CPU tensors
    through Triton's interpreter), no sort and no host synchronisation; kernel_args (capacity,
    bins_per_nat, num_bins, chunk, sub) size them. fused=False: `row_stats_reference`."""
    if not fused:
        return row_stats_reference(logits, temperature, top_k, top_p, min_p)
    check_params(temperature, top_k, top_p, min_p)
    from .backends import sampling_kernels
    vocab = _rows(logits).shape[-1]
    t, m, z, _ = sampling_kernels.row_stats(logits, temperature, top_k if top_k < vocab else 0,
                                            top_p, min_p, **kernel_args)
    return RowStats(t, m, z)


def probs_from_stats(logits: torch.Tensor, temperature: float, stats: RowStats) -> torch.Tensor:
    """logits [R, V] and their RowStats -> p [R, V] (float32)."""
    s = scaled(_rows(logits), temperature)
    e = torch.exp(s - stats.m[:, None])
    return torch.where(s >= stats.t[:, None], e / stats.z[:, None], 0.0)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """logits [..., vocab] -> probabilities [..., vocab] (float32). temperature must be > 0."""
    rows = logits.reshape(-1, logits.shape[-1])
    stats = row_stats_reference(rows, temperature, top_k, top_p, min_p)
    return probs_from_stats(rows, temperature, stats).reshape(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] -> [...] (int64), on the device.

    The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is distributed as p, and needs
    neither a cumulative sum nor a host round trip.
    """
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


def fused_by_default(device: torch.device | str) -> bool:
    """Whether sampling on `device` takes the fused kernels: on a GPU with Triton."""
    from .backends import sampling_kernels
    return torch.device(device).type == "cuda" and sampling_kernels.triton is not None


def make_rng(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh RNG state for `race`: int64 [2] = (seed, counter 0) on the device."""
    if not (isinstance(seed, int) and 0 <= seed < 2 ** 63):
        raise ValueError(f"seed must be a whole number in [0, 2**63), got {seed!r}")
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


def _check_race(logits, stats, rng, q_logits, q_stats, q_onehot):
    rows = _rows(logits).shape[0]
    if rng.dtype != torch.int64 or rng.shape != (2,) or rng.device != logits.device:
        raise ValueError(f"rng must be an int64 tensor [2] (seed, counter) on {logits.device}, "
                         f"as make_rng gives; got {rng.dtype} {tuple(rng.shape)} on {rng.device}")
    if stats.t.shape != (rows,):
        raise ValueError(f"stats must have one entry per row ({rows}), got {tuple(stats.t.shape)}")
    if (q_logits is None) != (q_stats is None):
        raise ValueError("q_logits and q_stats go together: pass both or neither")
    if q_logits is not None and q_onehot is not None:
        raise ValueError("pass q as logits (q_logits, q_stats) or as tokens (q_onehot), not both")
    if q_logits is not None and q_logits.shape != logits.shape:
        raise ValueError(f"q_logits must have the shape of logits {tuple(logits.shape)}, "
                         f"got {tuple(q_logits.shape)}")
    if q_onehot is not None and q_onehot.shape != (rows,):
        raise ValueError(f"q_onehot must be one token id per row ({rows}), "
                         f"got shape {tuple(q_onehot.shape)}")


def race(logits: torch.Tensor, temperature: float, stats: RowStats, rng: torch.Tensor, *,
         fused: bool, q_logits: torch.Tensor | None = None, q_stats: RowStats | None = None,
         q_onehot: torch.Tensor | None = None, stream: int = 0, **kernel_args) -> torch.Tensor:
    """One token per row [R] (int64) drawn from w / sum w, on the device; advances rng.

    logits [R, V] with their RowStats give p. w = p; or, with q (the draft's logits
    q_logits [R, V] and their q_stats, at the same temperature), w = max(p - q, 0); or, with
    q_onehot [R] token ids (a drafter without probabilities), w = p with that token removed.
    A row whose w is all zero draws from p. stream (0 .. 2**32 - 1) tells apart draws that
    share rng within one step. fused=False: the same distribution from torch's generator,
    seeded from rng read on the host (a synchronisation; for tests and CPUs). kernel_args
    (block, rows_per_program) size the fused kernel.
    """
    _check_race(logits, stats, rng, q_logits, q_stats, q_onehot)
    if not (isinstance(stream, int) and 0 <= stream < 2 ** 32):
        raise ValueError(f"stream must be a whole number in [0, 2**32), got {stream!r}")
    if fused:
        from .backends import sampling_kernels
        q = (None, None, None, None) if q_stats is None else (q_logits, *q_stats)
        tokens = sampling_kernels.race(logits, temperature, *stats, rng, stream, *q,
                                       q_onehot=q_onehot, **kernel_args)
    else:
        tokens = _race_reference(logits, temperature, stats, rng, q_logits, q_stats, q_onehot,
                                 stream)
    rng[1:].add_(1)
    return tokens


def _reference_generator(rng: torch.Tensor, stream: int, purpose: int) -> torch.Generator:
    """torch's generator for the PyTorch paths, seeded from rng read on the host (a sync) by
    a mix of integers that is the same in every process (unlike hash())."""
    seed, counter = rng.tolist()
    mixed = (seed * 0x9E3779B97F4A7C15 + counter * 0xBF58476D1CE4E5B9
             + stream * 0x94D049BB133111EB + purpose) % 2 ** 63
    generator = torch.Generator(device=rng.device)
    generator.manual_seed(mixed)
    return generator


def _race_reference(logits, temperature, stats, rng, q_logits, q_stats, q_onehot, stream):
    generator = _reference_generator(rng, stream, 0)
    p = probs_from_stats(logits, temperature, stats)
    if q_stats is not None:
        w = (p - probs_from_stats(q_logits, temperature, q_stats)).clamp_min(0)
    elif q_onehot is not None:  # an id of -1 removes nothing
        ids = torch.arange(p.shape[-1], device=p.device)
        w = torch.where(ids[None, :] == q_onehot.long()[:, None], 0.0, p)
    else:
        w = p
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, p)
    return sample(w, generator)


def uniform(rng: torch.Tensor, n: int, *, fused: bool, stream: int = 0) -> torch.Tensor:
    """n uniform numbers in (0, 1) (float32 [n]) keyed by rng and stream, on rng's device;
    rng is read, not advanced (the step's `race` advances it). fused=False: torch's generator
    seeded from rng read on the host."""
    if not (isinstance(stream, int) and 0 <= stream < 2 ** 32):
        raise ValueError(f"stream must be a whole number in [0, 2**32), got {stream!r}")
    if fused:
        from .backends import sampling_kernels
        return sampling_kernels.uniform(rng, n, stream)
    u = torch.rand(n, device=rng.device, generator=_reference_generator(rng, stream, 1))
    return u.clamp_min(2.0 ** -25)  # (0, 1), as the kernel's


def prob_at(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
            stats: RowStats) -> torch.Tensor:
    """p of one token per row: logits [R, V], tokens [R] -> [R] (float32), from RowStats."""
    s = scaled(logits.gather(1, tokens.long()[:, None]).squeeze(1), temperature)
    return torch.where(s >= stats.t, torch.exp(s - stats.m) / stats.z, 0.0)


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [..., V'] cut or padded with -inf to [..., vocab]: checkpoints of one tokenizer
    pad their embeddings differently (e.g. 151,936 vs 152,064 rows)."""
    extra = vocab - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab]
    return torch.nn.functional.pad(logits, (0, extra), value=float("-inf")) if extra else logits


class SampledPick:
    """A step's `post` that draws the next token from its last row: (tokens, logits
    [1, T, V]) -> [1] int64, on the device, advancing `state` (the RNG state, int64 [2], as
    make_rng gives). A function of tensors only, so that it runs inside the step's CUDA graph;
    graph captures leave `state` as they found it (`StepRunner`). Graphs are keyed by the
    object: keep one per parameter set and state (identity is its equality).

    vocab: the width of the distribution (rows are cut or padded with -inf to it); None: the
    logits' own."""

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float,
                 state: torch.Tensor, *, fused: bool, stream: int = 0, vocab: int | None = None):
        check_params(temperature, top_k, top_p, min_p)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.state, self.fused, self.stream, self.vocab = state, fused, stream, vocab

    def stats(self, rows: torch.Tensor) -> RowStats:
        return row_stats(rows, self.temperature, self.top_k, self.top_p, self.min_p,
                         fused=self.fused)

    def fit(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.vocab is None else fit_vocab(rows, self.vocab)

    def __call__(self, tokens: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        rows = self.fit(logits[0, -1:])  # [1, V]
        return race(rows, self.temperature, self.stats(rows), self.state, fused=self.fused,
                    stream=self.stream)
