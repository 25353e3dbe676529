"""Triton kernels for sampling without sorting the vocabulary: row statistics and the race.

`row_stats` finds, for each row of logits, the threshold t on s = logits / temperature that
top-k, top-p and min-p imply, the row max m and the kept mass z (semantics in
`flashdraft.sampling`), in a fixed number of launches and without a host synchronisation,
so that it runs inside a CUDA graph. Each kernel has a grid (R, C), a program per chunk of
a row; the last program of a row to finish (an atomic counter, reset by that program) does
the row's reduction, so no launch exists only to reduce:

- K1 `_partials_kernel`: each chunk's max and sum of exp(s - chunk max); the last program,
  the row's m and mass Z.
- Levels 0 … L-1 `_level_kernel` (a descent): a token's cell is floor((m - s) · scale),
  monotone in s; a cell of level l is NB cells of level l + 1. Level 0 counts tokens and
  adds up their mass per bin of the whole row; level l only those of the cut cell of level
  l - 1. The last program picks the bin where the cut lies (where the cumulative count
  reaches top_k; else the shallower of where the cumulative mass reaches top_p · Z and of
  min-p's cell) and keeps the count and mass above it. The descent stops (later levels
  return at once) when the cut cell holds at most CAP tokens (with top-k: the cell and
  everything above it).
- `_collect_kernel`: writes the tokens of the cut cell (with top-k, also everything above
  it) to a per-row buffer at slots claimed with an atomic counter, as one int64 each: an
  order-preserving int32 key of s above the token id; the last program sorts them and finds
  t and z (the cut inside the cell, from the mass above it). It flags a row whose
  candidates overflow CAP: more than CAP tokens within one finest cell (1 / (scale / NB^0)
  nats), or a top-k cut below the deepest cell.
- K4b `_exact_kernel`, grid (R): nothing unless the row is flagged; then the exact answer
  by bisection over the 32-bit keys with full passes over the row. Slow, and for rows that
  practically never occur.

Without top-k, top-p or min-p only K1 runs (t = -inf, z = the row's mass).

`race` draws one token per row by the exponential race over the kept tokens, with Philox
random numbers keyed by (seed; token, row, counter, stream): each program takes its chunk's
winner, and the last program of a row the row's.

The kernels of one device share a buffer of counters (zero between launches): launch them
from one stream at a time.
"""
from __future__ import annotations

import math

import torch

from .kernels import INTERPRET, triton

if triton is not None:
    import triton.language as tl

# Bins per level and levels of the descent: the finest cells are 1 / (G · NB^(L-1)) nats.
NUM_BINS = 64
LEVELS = 3
# Bins per nat of level 0, G: top-p and min-p look 32 nats deep (cells of 1/8192 nat), top-k
# 128 nats (1/2048 nat); the deepest bin holds everything beyond, -inf included.
BINS_PER_NAT = 2.0
BINS_PER_NAT_TOP_K = 0.5
# Most candidates the last program sorts (top-k asks for at least 2 · top_k, up to the most).
CAPACITY = 512
MAX_CAPACITY = 4096
# Tokens per program of the row-wise kernels, and per step of their inner loops.
CHUNK = 2048
SUB = 128
RACE_BLOCK = 2048


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on x: on a GPU, or on a CPU through Triton's
    interpreter (TRITON_INTERPRET=1 set before Triton was imported)."""
    return triton is not None and (x.is_cuda or (INTERPRET and x.device.type == "cpu"))


def _require(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the fused sampling kernels need Triton; install it, or pass "
                           "fused=False for the PyTorch reference")
    if not available(x):
        raise RuntimeError(f"the fused sampling kernels run on CUDA tensors, or on CPU tensors "
                           f"with TRITON_INTERPRET=1 set before Triton is imported; got a "
                           f"{x.device.type} tensor. Pass fused=False for the PyTorch reference")


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 [n] of the device's shared counters, zero between launches (each kernel's last
    programs reset theirs). Grown outside graph captures: the first call for a size runs
    eagerly (a graph's warm-up)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        have = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have[:n]


if triton is not None:
    @triton.jit
    def _scaled(logits_ptr, row_stride, r, offs, V, temperature):
        """s = logits / temperature, correctly rounded (as flashdraft.sampling.scaled), -inf
        beyond V; -0.0 made +0.0, so that equal values have equal keys."""
        x = tl.load(logits_ptr + r.to(tl.int64) * row_stride + offs, mask=offs < V,
                    other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temperature)
        return tl.where(s == 0.0, 0.0, s)

    @triton.jit
    def _key(s):
        """An int32 whose signed order is the order of the float32 s."""
        bits = s.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _unkey(key):
        bits = key ^ ((key >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _cell(s, m, scale, NCELL: tl.constexpr):
        """A token's finest cell, floor((m - s) · scale), the deepest holding everything beyond
        (-inf too): monotone in s, so the cells keep the row's order."""
        return tl.floor(tl.minimum((m - s) * scale, NCELL - 1)).to(tl.int32)

    @triton.jit
    def _last(counter_ptr, n):
        """Whether this program is the last of the n sharing the counter to get here; that one
        resets it. The atomic's acquire-release order makes the others' stores visible."""
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == n - 1
        tl.store(counter_ptr, 0, mask=last)
        return last

    @triton.jit
    def _partials_kernel(logits_ptr, row_stride, V, temperature, pmax_ptr, psum_ptr, m_ptr,
                         zrow_ptr, t_ptr, z_ptr, flag_ptr, count_ptr, C, C_PAD: tl.constexpr,
                         CHUNK: tl.constexpr, SUB: tl.constexpr, FILTER: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        start = c * CHUNK
        run_max = tl.full([SUB], float("-inf"), tl.float32)
        run_sum = tl.zeros([SUB], tl.float32)
        for i in range(0, CHUNK, SUB):
            offs = start + i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
            new_max = tl.maximum(run_max, s)
            # Lanes that have seen only -inf keep a zero sum (exp(-inf - -inf) is nan).
            seen = run_max > float("-inf")
            keep = tl.where(seen, run_sum * tl.exp(tl.where(seen, run_max - new_max, 0.0)), 0.0)
            fresh = s > float("-inf")
            run_sum = keep + tl.where(fresh, tl.exp(tl.where(fresh, s - new_max, 0.0)), 0.0)
            run_max = new_max
        cmax = tl.max(run_max, 0)
        seen = run_max > float("-inf")
        csum = tl.sum(tl.where(seen, run_sum * tl.exp(tl.where(seen, run_max - cmax, 0.0)), 0.0), 0)
        tl.store(pmax_ptr + r * C + c, cmax)
        tl.store(psum_ptr + r * C + c, csum)
        if _last(count_ptr + r, C):
            cidx = tl.arange(0, C_PAD)
            maxes = tl.load(pmax_ptr + r * C + cidx, mask=cidx < C, other=float("-inf"))
            sums = tl.load(psum_ptr + r * C + cidx, mask=cidx < C, other=0.0)
            m = tl.max(maxes, 0)
            z = tl.sum(tl.where(cidx < C, sums * tl.exp(maxes - m), 0.0), 0)
            tl.store(m_ptr + r, m)
            tl.store(zrow_ptr + r, z)
            if not FILTER:
                tl.store(t_ptr + r, float("-inf"))
                tl.store(z_ptr + r, z)
                tl.store(flag_ptr + r, 0)

    @triton.jit
    def _level_kernel(logits_ptr, row_stride, V, temperature, m_ptr, zrow_ptr, st_ptr, sm_ptr,
                      hmass_ptr, hcount_ptr, count_ptr, top_k, top_p, log_min_p, scale, C,
                      C_PAD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                      NB: tl.constexpr, LOG: tl.constexpr, LEVELS: tl.constexpr,
                      LEVEL: tl.constexpr, CAP: tl.constexpr, HAS_K: tl.constexpr,
                      HAS_P: tl.constexpr, HAS_MIN: tl.constexpr):
        """One level of the descent. The row's state st [8] (int32): prefix (the cut cell at
        the last level done), levels done, done, whether top-p's cut chose the cell, count
        above the cell, count in it; sm [2] (float32): mass above the cell, mass in it."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        st = st_ptr + r * 8
        sm = sm_ptr + r * 2
        SHIFT: tl.constexpr = LOG * (LEVELS - 1 - LEVEL)
        NCELL: tl.constexpr = 1 << (LOG * LEVELS)
        prefix = 0
        busy = True
        if LEVEL > 0:
            prefix = tl.load(st)
            busy = tl.load(st + 2) == 0
        if busy:
            m = tl.load(m_ptr + r)
            bidx = tl.arange(0, NB)
            mass = tl.zeros([NB], tl.float32)
            count = tl.zeros([NB], tl.int32)
            for i in range(0, CHUNK, SUB):
                offs = c * CHUNK + i + tl.arange(0, SUB)
                s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
                cell = _cell(s, m, scale, NCELL)
                inside = offs < V
                if LEVEL > 0:
                    inside = inside & ((cell >> (SHIFT + LOG)) == prefix)
                onehot = (((cell >> SHIFT) & (NB - 1))[:, None] == bidx[None, :]) & inside[:, None]
                mass += tl.sum(tl.where(onehot, tl.exp(s - m)[:, None], 0.0), 0)
                count += tl.sum(onehot.to(tl.int32), 0)
            out = (r * C + c) * NB + bidx
            tl.store(hmass_ptr + out, mass)
            tl.store(hcount_ptr + out, count)
            if _last(count_ptr + r, C):
                cidx = tl.arange(0, C_PAD)
                at = (r * C + cidx[:, None]) * NB + bidx[None, :]
                chunk_ok = (cidx < C)[:, None]
                mass = tl.sum(tl.load(hmass_ptr + at, mask=chunk_ok, other=0.0), 0)
                count = tl.sum(tl.load(hcount_ptr + at, mask=chunk_ok, other=0), 0)
                count_above = 0
                mass_above = 0.0
                if LEVEL > 0:
                    count_above = tl.load(st + 4)
                    mass_above = tl.load(sm)
                if HAS_K:
                    d = tl.min(tl.where(count_above + tl.cumsum(count, 0) >= top_k, bidx,
                                        NB - 1), 0)
                    p_hit = 0
                else:
                    d_p = NB
                    if HAS_P:
                        thr = top_p * tl.load(zrow_ptr + r)
                        d_p = tl.min(tl.where(mass_above + tl.cumsum(mass, 0) >= thr, bidx, NB),
                                     0)
                    d_min = NB
                    if HAS_MIN:
                        min_cell = _cell(m + log_min_p, m, scale, NCELL)
                        d_min = tl.where((min_cell >> (SHIFT + LOG)) == prefix,
                                         (min_cell >> SHIFT) & (NB - 1), NB)
                    d = tl.minimum(d_p, d_min)
                    p_hit = (d_p <= d_min).to(tl.int32)
                    # No cut inside the cell (top-p's mass short of top_p · Z by rounding):
                    # its deepest bin with mass, kept whole.
                    deepest = tl.max(tl.where(mass > 0, bidx, 0), 0)
                    p_hit = tl.where(d == NB, 1, p_hit)
                    d = tl.where(d == NB, deepest, d)
                count_above += tl.sum(tl.where(bidx < d, count, 0), 0)
                mass_above += tl.sum(tl.where(bidx < d, mass, 0.0), 0)
                cell_n = tl.sum(tl.where(bidx == d, count, 0), 0)
                if HAS_K:
                    fits = count_above + cell_n <= CAP
                else:
                    fits = cell_n <= CAP
                tl.store(st, prefix * NB + d)
                tl.store(st + 1, LEVEL + 1)
                tl.store(st + 2, (fits | (LEVEL == LEVELS - 1)).to(tl.int32))
                tl.store(st + 3, p_hit)
                tl.store(st + 4, count_above)
                tl.store(st + 5, cell_n)
                tl.store(sm, mass_above)
                tl.store(sm + 1, tl.sum(tl.where(bidx == d, mass, 0.0), 0))

    @triton.jit
    def _collect_kernel(logits_ptr, row_stride, V, temperature, m_ptr, zrow_ptr, st_ptr, sm_ptr,
                        ncand_ptr, cand_ptr, count_ptr, t_ptr, z_ptr, flag_ptr, top_k, top_p,
                        log_min_p, scale, C, CHUNK: tl.constexpr, SUB: tl.constexpr,
                        LOG: tl.constexpr, LEVELS: tl.constexpr, CAP: tl.constexpr,
                        HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        NCELL: tl.constexpr = 1 << (LOG * LEVELS)
        st = st_ptr + r * 8
        prefix = tl.load(st)
        shift = LOG * (LEVELS - tl.load(st + 1))
        m = tl.load(m_ptr + r)
        for i in range(0, CHUNK, SUB):
            offs = c * CHUNK + i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
            top = _cell(s, m, scale, NCELL) >> shift
            if HAS_K:  # the cut cell and everything above it
                picked = (top <= prefix) & (offs < V)
            else:  # the cut cell
                picked = (top == prefix) & (offs < V)
            n_picked = tl.sum(picked.to(tl.int32), 0)
            if n_picked > 0:
                base = tl.atomic_add(ncand_ptr + r, n_picked)
                slot = base + tl.cumsum(picked.to(tl.int32), 0) - picked.to(tl.int32)
                packed = (_key(s).to(tl.int64) << 32) | offs.to(tl.int64)
                tl.store(cand_ptr + r.to(tl.int64) * CAP + slot, packed,
                         mask=picked & (slot < CAP))
        if _last(count_ptr + r, C):
            n = tl.atomic_xchg(ncand_ptr + r, 0)
            idx = tl.arange(0, CAP)
            valid = idx < n
            cands = tl.load(cand_ptr + r.to(tl.int64) * CAP + idx, mask=valid,
                             other=-9223372036854775808)
            cands = tl.sort(cands, descending=True)
            sv = tl.where(valid, _unkey((cands >> 32).to(tl.int32)), float("-inf"))
            ev = tl.where(valid, tl.exp(sv - m), 0.0)
            t_min = float("-inf")
            if HAS_MIN:
                t_min = m + log_min_p
            if HAS_K:  # every token at or above the k-th is a candidate
                t_k = tl.max(tl.where(idx == top_k - 1, sv, float("-inf")), 0)
                in_k = valid & (sv >= t_k)
                e_k = tl.where(in_k, ev, 0.0)
                t_p = float("-inf")
                if HAS_P:
                    before = tl.cumsum(e_k, 0) - e_k
                    t_p = tl.min(tl.where(in_k & (before < top_p * tl.sum(e_k, 0)), sv,
                                          float("inf")), 0)
                t = tl.maximum(tl.maximum(t_k, t_p), t_min)
                z = tl.sum(tl.where(valid & (sv >= t), ev, 0.0), 0)
            else:  # the cut cell'sv tokens, below mass_above
                mass_above = tl.load(sm_ptr + r * 2)
                t_p = float("-inf")
                if HAS_P:
                    before = mass_above + tl.cumsum(ev, 0) - ev
                    t_p = tl.min(tl.where(valid & (before < top_p * tl.load(zrow_ptr + r)), sv,
                                          float("inf")), 0)
                    # The cell'sv first token is always kept when top-p'sv cut chose it (the
                    # mass above can pass top_p · Z by rounding only).
                    t_p = tl.where(t_p == float("inf"), tl.max(sv, 0), t_p)
                    t_p = tl.where(tl.load(st + 3) != 0, t_p, float("-inf"))
                t = tl.maximum(t_p, t_min)
                z = mass_above + tl.sum(tl.where(valid & (sv >= t), ev, 0.0), 0)
            tl.store(t_ptr + r, t)
            tl.store(z_ptr + r, z)
            tl.store(flag_ptr + r, (n > CAP).to(tl.int32))

    @triton.jit
    def _count_at_least(logits_ptr, row_stride, V, temperature, kappa, SUB: tl.constexpr):
        total = 0
        for i in range(0, V, SUB):
            offs = i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, tl.program_id(0), offs, V, temperature)
            total += tl.sum(((_key(s) >= kappa) & (offs < V)).to(tl.int32), 0)
        return total

    @triton.jit
    def _mass_above(logits_ptr, row_stride, V, temperature, m, kappa, floor_key,
                    SUB: tl.constexpr):
        """Mass exp(s - m) of the tokens with key > kappa and key >= floor_key."""
        total = 0.0
        for i in range(0, V, SUB):
            offs = i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, tl.program_id(0), offs, V, temperature)
            k = _key(s)
            total += tl.sum(tl.where((k > kappa) & (k >= floor_key) & (offs < V),
                                     tl.exp(s - m), 0.0), 0)
        return total

    @triton.jit
    def _exact_kernel(logits_ptr, row_stride, V, temperature, m_ptr, zrow_ptr, flag_ptr,
                      t_ptr, z_ptr, top_k, top_p, log_min_p, SUB: tl.constexpr,
                      HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN: tl.constexpr):
        r = tl.program_id(0)
        if tl.load(flag_ptr + r) != 0:
            m = tl.load(m_ptr + r)
            z_row = tl.load(zrow_ptr + r)
            key_k = -2147483648
            t_k = float("-inf")
            z_k = z_row
            if HAS_K:
                # The largest key with at least top_k tokens at or above it: the k-th value.
                lo = tl.full([], -2147483648, tl.int64)
                hi = tl.full([], 2147483648, tl.int64)
                for _ in range(32):
                    mid = (lo + hi) >> 1
                    enough = _count_at_least(logits_ptr, row_stride, V, temperature, mid,
                                             SUB) >= top_k
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(enough, hi, mid)
                key_k = lo.to(tl.int32)
                t_k = _unkey(key_k)
                below_all = tl.full([], -2147483649, tl.int64)
                z_k = _mass_above(logits_ptr, row_stride, V, temperature, m, below_all, key_k,
                                  SUB)
            t_p = float("-inf")
            if HAS_P:
                # The smallest kappa with mass(key > kappa) < top_p · Z_k: a token is kept
                # iff its key is >= kappa, and t_p is the smallest such token's value.
                thr = top_p * z_k
                lo = tl.full([], -2147483649, tl.int64)
                hi = tl.full([], 2147483647, tl.int64)
                for _ in range(32):
                    mid = (lo + hi) >> 1
                    short = _mass_above(logits_ptr, row_stride, V, temperature, m, mid, key_k,
                                        SUB) < thr
                    hi = tl.where(short, mid, hi)
                    lo = tl.where(short, lo, mid)
                kappa = tl.maximum(hi, key_k)
                least = tl.full([SUB], float("inf"), tl.float32)
                for i in range(0, V, SUB):
                    offs = i + tl.arange(0, SUB)
                    s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
                    least = tl.minimum(least, tl.where((_key(s) >= kappa) & (offs < V), s,
                                                       float("inf")))
                t_p = tl.min(least, 0)
            t_min = float("-inf")
            if HAS_MIN:
                t_min = m + log_min_p
            t = tl.maximum(tl.maximum(t_k, t_p), t_min)
            z = 0.0
            for i in range(0, V, SUB):
                offs = i + tl.arange(0, SUB)
                s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
                z += tl.sum(tl.where((s >= t) & (offs < V), tl.exp(s - m), 0.0), 0)
            tl.store(t_ptr + r, t)
            tl.store(z_ptr + r, z)

    @triton.jit
    def _race_kernel(logits_ptr, row_stride, R, V, temperature, t_ptr, m_ptr, z_ptr,
                     q_ptr, q_stride, qt_ptr, qm_ptr, qz_ptr, onehot_ptr, rng_ptr, stream,
                     best_ptr, arg_ptr, pbest_ptr, parg_ptr, token_ptr, count_ptr, C,
                     C_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     MODE: tl.constexpr):
        """MODE 0: w = p; 1: w = max(p - q, 0) with q from logits; 2: w = p less one token.
        Modes 1 and 2 also run the race for p (same random numbers) for rows where w = 0.
        A program takes ROWS rows (1 for a large vocabulary) and one chunk of BLOCK tokens;
        the last of a row group's programs writes the rows' tokens."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        inside = (rows < R)[:, None] & (offs < V)[None, :]
        at = rows.to(tl.int64)[:, None] * row_stride + offs[None, :]
        x = tl.load(logits_ptr + at, mask=inside, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temperature)
        t = tl.load(t_ptr + rows, mask=rows < R, other=0.0)[:, None]
        m = tl.load(m_ptr + rows, mask=rows < R, other=0.0)[:, None]
        kept = (s >= t) & inside
        log_p = tl.where(kept, s - m, float("-inf"))  # log p + log z: the same argmax

        seed = tl.load(rng_ptr)
        counter = tl.load(rng_ptr + 1)
        zero = tl.zeros([ROWS, BLOCK], tl.uint32)
        r0, _, _, _ = tl.philox(seed, zero + offs.to(tl.uint32)[None, :],
                                zero + rows.to(tl.uint32)[:, None],
                                zero + counter.to(tl.uint32), zero + stream)
        # 24 bits, offset by half a step: u in (0, 1) exactly, E = -log u in (0, inf).
        u = ((r0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        log_e = tl.log(-tl.log(u))

        if MODE == 0:
            score = log_p - log_e
        elif MODE == 1:
            z = tl.load(z_ptr + rows, mask=rows < R, other=1.0)[:, None]
            qat = rows.to(tl.int64)[:, None] * q_stride + offs[None, :]
            xq = tl.load(q_ptr + qat, mask=inside, other=float("-inf")).to(tl.float32)
            sq = tl.math.div_rn(xq, temperature)
            qt = tl.load(qt_ptr + rows, mask=rows < R, other=0.0)[:, None]
            qm = tl.load(qm_ptr + rows, mask=rows < R, other=0.0)[:, None]
            qz = tl.load(qz_ptr + rows, mask=rows < R, other=1.0)[:, None]
            p = tl.where(kept, tl.exp(tl.where(kept, s - m, 0.0)) / z, 0.0)
            q_kept = (sq >= qt) & inside
            q = tl.where(q_kept, tl.exp(tl.where(q_kept, sq - qm, 0.0)) / qz, 0.0)
            w = p - q
            score = tl.where(w > 0, tl.log(tl.where(w > 0, w, 1.0)), float("-inf")) - log_e
        else:
            skip = tl.load(onehot_ptr + rows, mask=rows < R, other=-1)[:, None]
            score = tl.where(offs[None, :] == skip, float("-inf"), log_p) - log_e
        out = rows * C + c
        tl.store(best_ptr + out, tl.max(score, 1), mask=rows < R)
        tl.store(arg_ptr + out, c * BLOCK + tl.argmax(score, 1), mask=rows < R)
        if MODE != 0:
            pscore = log_p - log_e
            tl.store(pbest_ptr + out, tl.max(pscore, 1), mask=rows < R)
            tl.store(parg_ptr + out, c * BLOCK + tl.argmax(pscore, 1), mask=rows < R)
        if _last(count_ptr + tl.program_id(0), C):
            token, won = _winner(best_ptr, arg_ptr, rows, R, C, C_PAD)
            if MODE != 0:  # rows whose w is all zero draw from p
                p_token, p_won = _winner(pbest_ptr, parg_ptr, rows, R, C, C_PAD)
                token = tl.where(won > float("-inf"), token, p_token)
            tl.store(token_ptr + rows, token.to(tl.int64), mask=rows < R)

    @triton.jit
    def _winner(best_ptr, arg_ptr, rows, R, C, C_PAD: tl.constexpr):
        """Each row's token of the highest score over its chunks (the first chunk on a tie),
        and that score."""
        chunks = tl.arange(0, C_PAD)
        at = rows[:, None] * C + chunks[None, :]
        ok = (rows < R)[:, None] & (chunks < C)[None, :]
        best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
        arg = tl.load(arg_ptr + at, mask=ok, other=0)
        first = tl.argmax(best, 1)
        return tl.sum(tl.where(chunks[None, :] == first[:, None], arg, 0), 1), tl.max(best, 1)


    @triton.jit
    def _uniform_kernel(rng_ptr, stream, out_ptr, n, BLOCK: tl.constexpr):
        """n numbers in (0, 1) from Philox keyed by (seed; index, 2**31 - 1, counter, stream):
        a row word no race uses (races have fewer rows)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        seed = tl.load(rng_ptr)
        counter = tl.load(rng_ptr + 1)
        zero = tl.zeros([BLOCK], tl.uint32)
        r0, _, _, _ = tl.philox(seed, zero + offs.to(tl.uint32),
                                tl.full([BLOCK], 2147483647, tl.uint32),
                                zero + counter.to(tl.uint32), zero + stream)
        u = ((r0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        tl.store(out_ptr + offs, u, mask=offs < n)


def uniform(rng: torch.Tensor, n: int, stream: int = 0, *, block: int = 128) -> torch.Tensor:
    """float32 [n] in (0, 1) keyed by rng (seed, counter) and stream; rng is read only."""
    _require(rng)
    out = torch.empty(n, dtype=torch.float32, device=rng.device)
    if n:
        _uniform_kernel[(triton.cdiv(n, block),)](rng, stream, out, n, BLOCK=block)
    return out


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (checked by flashdraft.sampling) with unit stride along the vocabulary."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


def row_stats(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              min_p: float, *, capacity: int | None = None, bins_per_nat: float | None = None,
              num_bins: int = NUM_BINS, levels: int = LEVELS, chunk: int | None = None,
              sub: int | None = None):
    """(t, m, z, flagged) [R] each for logits [R, V]; arguments already checked (top_k < V).
    flagged: rows the candidates could not settle, answered by the exact kernel.
    capacity, bins_per_nat, chunk, sub: CAPACITY (2 · top_k with top-k, up to MAX_CAPACITY),
    BINS_PER_NAT (BINS_PER_NAT_TOP_K with top-k), CHUNK, SUB, or less for a vocabulary
    smaller than them; num_bins (a power of two) and levels size the descent."""
    _require(logits)
    logits = _rows(logits)
    R, V = logits.shape
    has_k, has_p, has_min = top_k > 0, top_p < 1.0, min_p > 0.0
    filt = has_k or has_p or has_min
    width = max(16, triton.next_power_of_2(V))
    sub = min(SUB, width) if sub is None else sub
    chunk = min(CHUNK, max(sub, width)) if chunk is None else chunk
    if capacity is None:
        capacity = CAPACITY
        if has_k:
            capacity = min(max(capacity, triton.next_power_of_2(2 * top_k)), MAX_CAPACITY)
        capacity = min(capacity, width)
    if bins_per_nat is None:
        bins_per_nat = BINS_PER_NAT_TOP_K if has_k else BINS_PER_NAT
    log_bins = num_bins.bit_length() - 1
    if (capacity & (capacity - 1) or num_bins != 1 << log_bins or chunk % sub
            or not 1 <= levels or log_bins * levels > 30):
        raise ValueError(f"capacity ({capacity}) and num_bins ({num_bins}) must be powers of "
                         f"two, chunk ({chunk}) a multiple of sub ({sub}), and num_bins ** "
                         f"levels ({levels}) at most 2 ** 30")
    C = triton.cdiv(V, chunk)
    C_PAD = triton.next_power_of_2(C)
    dev = logits.device
    temperature = float(temperature)
    log_min_p = math.log(min_p) if has_min else 0.0
    scale = float(bins_per_nat) * num_bins ** (levels - 1)
    f32 = dict(dtype=torch.float32, device=dev)
    pmax, psum = torch.empty(R, C, **f32), torch.empty(R, C, **f32)
    m, zrow, t, z = (torch.empty(R, **f32) for _ in range(4))
    flag = torch.empty(R, dtype=torch.int32, device=dev)
    count, ncand = _counters(dev, 2 * R).view(2, R)
    stride = logits.stride(0)
    _partials_kernel[(R, C)](logits, stride, V, temperature, pmax, psum, m, zrow, t, z, flag,
                             count, C, C_PAD=C_PAD, CHUNK=chunk, SUB=sub, FILTER=filt)
    if not filt:
        return t, m, z, flag
    flags = dict(HAS_K=has_k, HAS_P=has_p, HAS_MIN=has_min)
    rows = dict(CHUNK=chunk, SUB=sub, LOG=log_bins, LEVELS=levels, CAP=capacity)
    state = torch.empty(R, 8, dtype=torch.int32, device=dev)
    state_mass = torch.empty(R, 2, **f32)
    hmass = torch.empty(R, C, num_bins, **f32)
    hcount = torch.empty(R, C, num_bins, dtype=torch.int32, device=dev)
    for level in range(levels):
        _level_kernel[(R, C)](logits, stride, V, temperature, m, zrow, state, state_mass, hmass,
                              hcount, count, top_k, top_p, log_min_p, scale, C, C_PAD=C_PAD,
                              NB=num_bins, LEVEL=level, **rows, **flags)
    cand = torch.empty(R, capacity, dtype=torch.int64, device=dev)
    _collect_kernel[(R, C)](logits, stride, V, temperature, m, zrow, state, state_mass, ncand,
                            cand, count, t, z, flag, top_k, top_p, log_min_p, scale, C, **rows,
                            **flags)
    _exact_kernel[(R,)](logits, stride, V, temperature, m, zrow, flag, t, z, top_k, top_p,
                        log_min_p, SUB=sub, **flags)
    return t, m, z, flag


def race(logits: torch.Tensor, temperature: float, t: torch.Tensor, m: torch.Tensor,
         z: torch.Tensor, rng: torch.Tensor, stream: int = 0, q_logits=None, q_t=None,
         q_m=None, q_z=None, q_onehot=None, *, block: int | None = None,
         rows_per_program: int = 1) -> torch.Tensor:
    """Tokens [R] (int64) by the exponential race; rng is read, not advanced. block:
    RACE_BLOCK, or less for a smaller vocabulary."""
    _require(logits)
    logits = _rows(logits)
    R, V = logits.shape
    block = min(RACE_BLOCK, max(16, triton.next_power_of_2(V))) if block is None else block
    C = triton.cdiv(V, block)
    dev = logits.device
    mode = 0 if q_logits is None and q_onehot is None else 1 if q_logits is not None else 2
    best = torch.empty(R, C, dtype=torch.float32, device=dev)
    arg = torch.empty(R, C, dtype=torch.int32, device=dev)
    pbest, parg = (torch.empty_like(best), torch.empty_like(arg)) if mode else (best, arg)
    tokens = torch.empty(R, dtype=torch.int64, device=dev)
    groups = triton.cdiv(R, rows_per_program)
    # q's rows (mode 1) or stand-ins the kernel does not read, and the one-hot ids (mode 2)
    q_src, q_t, q_m, q_z = (_rows(q_logits), q_t, q_m, q_z) if mode == 1 else (logits, t, m, z)
    q_args = (q_src, q_src.stride(0), q_t, q_m, q_z, q_onehot if mode == 2 else t)
    _race_kernel[(groups, C)](logits, logits.stride(0), R, V, float(temperature), t, m, z,
                              *q_args, rng, stream, best, arg, pbest, parg, tokens,
                              _counters(dev, groups), C, C_PAD=triton.next_power_of_2(C),
                              ROWS=rows_per_program, BLOCK=block, MODE=mode)
    return tokens
