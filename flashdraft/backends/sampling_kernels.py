"""Triton kernels for sampling without sorting the vocabulary: row statistics and the race.

`row_stats` finds, for each row of logits, the threshold t on s = logits / temperature that
top-k, top-p and min-p imply, the row max m and the kept mass z (semantics in
`flashdraft.sampling`), in a fixed number of launches and without a host synchronisation,
so that it runs inside a CUDA graph:

- K1 `_partials_kernel`, grid (R, C): each chunk's max and sum of exp(s - chunk max);
  program (r, 0) also zeroes row r's candidate counter.
- K2 `_histogram_kernel`, grid (R, C): with m from the partials, each token falls in the
  bin min(floor((m - s) · G), NB - 1) (G bins per nat, the last bin everything deeper);
  each chunk's mass and count per bin.
- K3 `_collect_kernel`, grid (R, C): from the row's histogram, the cut bin beta (where the
  cumulative count reaches top_k, or the cumulative mass top_p · Z, or min-p's depth), one
  bin deeper as a margin for rounding; every token of a bin <= beta becomes a candidate,
  written to a per-row buffer at a slot claimed with an atomic counter, as one int64: an
  order-preserving int32 key of s above the token id.
- K4 `_select_kernel`, grid (R): sorts the candidates (at most CAP), and finds t_k, Z_k,
  t_p, t_min, t and z among them. Bins are monotone in s, so the candidates are the top of
  the row in order; the kernel flags the row when they may not hold the cut (more than CAP
  of them, fewer than top_k, or less than the top-p mass with no min-p cut to stand in).
- K4b `_exact_kernel`, grid (R): nothing unless the row is flagged; then the exact answer
  by bisection over the 32-bit keys with full passes over the row. Slow, and rare: a flat
  row of many near-equal tokens.

Without top-k, top-p or min-p only K1 and K4 run (t = -inf, z = the row's mass).

`race` draws one token per row by the exponential race over the kept tokens, with Philox
random numbers keyed by (seed; token, row, counter, stream): each program takes its chunk's
winner, and a torch argmax over the chunks picks the row's.
"""
from __future__ import annotations

import math

import torch

from .kernels import INTERPRET, triton

if triton is not None:
    import triton.language as tl

# Bins per nat below the row max, and bins in all (the last one holds everything deeper):
# 64 bins of 1/4 nat reach 15.75 nats, beyond any cut a sampler asks for in practice.
BINS_PER_NAT = 4
NUM_BINS = 64
# Most candidates a row keeps for the sort; more go to the exact (bisection) path.
CAPACITY = 2048
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


if triton is not None:
    @triton.jit
    def _scaled(logits_ptr, row_stride, r, offs, V, temperature):
        """s = logits / temperature (correctly rounded, as PyTorch's division), -inf beyond V."""
        x = tl.load(logits_ptr + r.to(tl.int64) * row_stride + offs, mask=offs < V,
                    other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(x, temperature)

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
    def _bins(s, m, G: tl.constexpr, NB: tl.constexpr):
        depth = tl.minimum((m - s) * G, NB - 1)
        return tl.floor(depth).to(tl.int32)

    @triton.jit
    def _row_max_and_mass(pmax_ptr, psum_ptr, r, C, C_PAD: tl.constexpr):
        """m and Z = sum exp(s - m) of row r from its chunks' partials."""
        cidx = tl.arange(0, C_PAD)
        cmax = tl.load(pmax_ptr + r * C + cidx, mask=cidx < C, other=float("-inf"))
        csum = tl.load(psum_ptr + r * C + cidx, mask=cidx < C, other=0.0)
        m = tl.max(cmax, 0)
        z = tl.sum(tl.where(cidx < C, csum * tl.exp(cmax - m), 0.0), 0)
        return m, z

    @triton.jit
    def _partials_kernel(logits_ptr, row_stride, V, temperature, pmax_ptr, psum_ptr, count_ptr,
                         C, CHUNK: tl.constexpr, SUB: tl.constexpr):
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
        if c == 0:
            tl.store(count_ptr + r, 0)

    @triton.jit
    def _histogram_kernel(logits_ptr, row_stride, V, temperature, pmax_ptr, psum_ptr,
                          hmass_ptr, hcount_ptr, C, C_PAD: tl.constexpr, CHUNK: tl.constexpr,
                          SUB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        m, _ = _row_max_and_mass(pmax_ptr, psum_ptr, r, C, C_PAD)
        bidx = tl.arange(0, NB)
        mass = tl.zeros([NB], tl.float32)
        count = tl.zeros([NB], tl.int32)
        for i in range(0, CHUNK, SUB):
            offs = c * CHUNK + i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
            e = tl.exp(s - m)
            onehot = (_bins(s, m, G, NB)[:, None] == bidx[None, :]) & (offs < V)[:, None]
            mass += tl.sum(tl.where(onehot, e[:, None], 0.0), 0)
            count += tl.sum(onehot.to(tl.int32), 0)
        out = (r * C + c) * NB + bidx
        tl.store(hmass_ptr + out, mass)
        tl.store(hcount_ptr + out, count)

    @triton.jit
    def _collect_kernel(logits_ptr, row_stride, V, temperature, pmax_ptr, psum_ptr,
                        hmass_ptr, hcount_ptr, count_ptr, cand_ptr, beta_ptr,
                        top_k, top_p, bin_min, C, C_PAD: tl.constexpr, CHUNK: tl.constexpr,
                        SUB: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                        CAP: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                        HAS_MIN: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        m, z = _row_max_and_mass(pmax_ptr, psum_ptr, r, C, C_PAD)
        cidx = tl.arange(0, C_PAD)
        bidx = tl.arange(0, NB)
        at = (r * C + cidx[:, None]) * NB + bidx[None, :]
        inside = (cidx < C)[:, None]
        beta = NB - 1
        if HAS_K:
            counts = tl.sum(tl.load(hcount_ptr + at, mask=inside, other=0), 0)
            beta = tl.min(tl.where(tl.cumsum(counts, 0) >= top_k, bidx, NB - 1), 0)
        elif HAS_P:
            mass = tl.sum(tl.load(hmass_ptr + at, mask=inside, other=0.0), 0)
            beta = tl.min(tl.where(tl.cumsum(mass, 0) >= top_p * z, bidx, NB - 1), 0)
        if HAS_MIN and not HAS_K:
            beta = tl.minimum(beta, bin_min)
        beta = tl.minimum(beta + 1, NB - 1)
        if c == 0:
            tl.store(beta_ptr + r, beta)
        for i in range(0, CHUNK, SUB):
            offs = c * CHUNK + i + tl.arange(0, SUB)
            s = _scaled(logits_ptr, row_stride, r, offs, V, temperature)
            picked = (_bins(s, m, G, NB) <= beta) & (offs < V)
            n_picked = tl.sum(picked.to(tl.int32), 0)
            if n_picked > 0:
                base = tl.atomic_add(count_ptr + r, n_picked)
                slot = base + tl.cumsum(picked.to(tl.int32), 0) - picked.to(tl.int32)
                packed = (_key(s).to(tl.int64) << 32) | offs.to(tl.int64)
                tl.store(cand_ptr + r.to(tl.int64) * CAP + slot, packed,
                         mask=picked & (slot < CAP))

    @triton.jit
    def _select_kernel(pmax_ptr, psum_ptr, count_ptr, cand_ptr, beta_ptr, t_ptr, m_ptr, z_ptr,
                       flag_ptr, V, top_k, top_p, log_min_p, bin_min, C, C_PAD: tl.constexpr,
                       CAP: tl.constexpr, FILTER: tl.constexpr, HAS_K: tl.constexpr,
                       HAS_P: tl.constexpr, HAS_MIN: tl.constexpr):
        r = tl.program_id(0)
        m, z_row = _row_max_and_mass(pmax_ptr, psum_ptr, r, C, C_PAD)
        tl.store(m_ptr + r, m)
        if not FILTER:
            tl.store(t_ptr + r, float("-inf"))
            tl.store(z_ptr + r, z_row)
        else:
            n = tl.load(count_ptr + r)
            beta = tl.load(beta_ptr + r)
            idx = tl.arange(0, CAP)
            packed = tl.load(cand_ptr + r.to(tl.int64) * CAP + idx, mask=idx < n,
                             other=-9223372036854775808)
            packed = tl.sort(packed, descending=True)
            valid = idx < n
            s = tl.where(valid, _unkey((packed >> 32).to(tl.int32)), float("-inf"))
            e = tl.where(valid, tl.exp(s - m), 0.0)
            flag = n > CAP
            whole_row = n == V
            # min-p's cut stands in for an uncovered top-p cut when every token at or above
            # it is a candidate: K3's beta went a bin past min-p's depth.
            min_ok = whole_row
            if HAS_MIN:
                min_ok = min_ok | (beta > bin_min)
            t_k = float("-inf")
            in_k = valid
            z_k = z_row
            if HAS_K:
                t_k = tl.max(tl.where(idx == top_k - 1, s, float("-inf")), 0)
                in_k = valid & (s >= t_k)
                z_k = tl.sum(tl.where(in_k, e, 0.0), 0)
                flag = flag | (n < top_k)
            t_p = float("-inf")
            if HAS_P:
                e_k = tl.where(in_k, e, 0.0)
                before = tl.cumsum(e_k, 0) - e_k
                thr = top_p * z_k
                t_p = tl.min(tl.where(in_k & (before < thr), s, float("inf")), 0)
                if not HAS_K:
                    covered = (tl.sum(e_k, 0) >= thr) | whole_row
                    # Uncovered: t_p lies below every candidate, so below min-p's cut.
                    t_p = tl.where(covered, t_p, float("-inf"))
                    flag = flag | ((covered | min_ok) == 0)
            elif not HAS_K:
                flag = flag | (min_ok == 0)
            t_min = float("-inf")
            if HAS_MIN:
                t_min = m + log_min_p
            t = tl.maximum(tl.maximum(t_k, t_p), t_min)
            tl.store(t_ptr + r, t)
            tl.store(z_ptr + r, tl.sum(tl.where(valid & (s >= t), e, 0.0), 0))
            tl.store(flag_ptr + r, flag.to(tl.int32))

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
    def _exact_kernel(logits_ptr, row_stride, V, temperature, pmax_ptr, psum_ptr, flag_ptr,
                      t_ptr, z_ptr, top_k, top_p, log_min_p, C, C_PAD: tl.constexpr,
                      SUB: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                      HAS_MIN: tl.constexpr):
        r = tl.program_id(0)
        if tl.load(flag_ptr + r) != 0:
            m, z_row = _row_max_and_mass(pmax_ptr, psum_ptr, r, C, C_PAD)
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
                     best_ptr, arg_ptr, pbest_ptr, parg_ptr, C, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, MODE: tl.constexpr):
        """MODE 0: w = p; 1: w = max(p - q, 0) with q from logits; 2: w = p less one token.
        Modes 1 and 2 also run the race for p (same random numbers) for rows where w = 0.
        A program takes ROWS rows (1 for a large vocabulary) and one chunk of BLOCK tokens."""
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
              min_p: float, *, capacity: int | None = None, bins_per_nat: int = BINS_PER_NAT,
              num_bins: int = NUM_BINS, chunk: int | None = None, sub: int | None = None):
    """(t, m, z, flagged) [R] each for logits [R, V]; arguments already checked (top_k < V).
    flagged: rows K4 could not settle from its candidates, answered by the exact kernel.
    capacity, chunk, sub: CAPACITY, CHUNK, SUB, or less for a vocabulary smaller than them."""
    _require(logits)
    logits = _rows(logits)
    R, V = logits.shape
    width = max(16, triton.next_power_of_2(V))
    sub = min(SUB, width) if sub is None else sub
    chunk = min(CHUNK, max(sub, width)) if chunk is None else chunk
    capacity = min(CAPACITY, width) if capacity is None else capacity
    dev = logits.device
    if capacity & (capacity - 1) or num_bins & (num_bins - 1) or chunk % sub:
        raise ValueError(f"capacity ({capacity}) and num_bins ({num_bins}) must be powers of "
                         f"two, and chunk ({chunk}) a multiple of sub ({sub})")
    C = triton.cdiv(V, chunk)
    C_PAD = triton.next_power_of_2(C)
    temperature = float(temperature)
    has_k, has_p, has_min = top_k > 0, top_p < 1.0, min_p > 0.0
    filt = has_k or has_p or has_min
    log_min_p = math.log(min_p) if has_min else 0.0
    bin_min = min(int(math.floor(-log_min_p * bins_per_nat)), num_bins - 1)
    f32 = dict(dtype=torch.float32, device=dev)
    pmax = torch.empty(R, C, **f32)
    psum = torch.empty(R, C, **f32)
    count = torch.empty(R, dtype=torch.int32, device=dev)
    t = torch.empty(R, **f32)
    m = torch.empty(R, **f32)
    z = torch.empty(R, **f32)
    flag = torch.zeros(R, dtype=torch.int32, device=dev)
    stride = logits.stride(0)
    _partials_kernel[(R, C)](logits, stride, V, temperature, pmax, psum, count, C,
                             CHUNK=chunk, SUB=sub)
    flags = dict(HAS_K=has_k, HAS_P=has_p, HAS_MIN=has_min)
    if filt:
        hmass = torch.empty(R, C, num_bins, **f32)
        hcount = torch.empty(R, C, num_bins, dtype=torch.int32, device=dev)
        cand = torch.empty(R, capacity, dtype=torch.int64, device=dev)
        beta = torch.empty(R, dtype=torch.int32, device=dev)
        _histogram_kernel[(R, C)](logits, stride, V, temperature, pmax, psum, hmass, hcount, C,
                                  C_PAD=C_PAD, CHUNK=chunk, SUB=sub, G=bins_per_nat,
                                  NB=num_bins)
        _collect_kernel[(R, C)](logits, stride, V, temperature, pmax, psum, hmass, hcount,
                                count, cand, beta, top_k, top_p, bin_min, C, C_PAD=C_PAD,
                                CHUNK=chunk, SUB=sub, G=bins_per_nat, NB=num_bins,
                                CAP=capacity, **flags)
    else:
        cand = beta = count
    _select_kernel[(R,)](pmax, psum, count, cand, beta, t, m, z, flag, V, top_k, top_p,
                         log_min_p, bin_min, C, C_PAD=C_PAD, CAP=capacity, FILTER=filt, **flags)
    if filt:
        _exact_kernel[(R,)](logits, stride, V, temperature, pmax, psum, flag, t, z, top_k,
                            top_p, log_min_p, C, C_PAD=C_PAD, SUB=sub, **flags)
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
    # q's rows (mode 1) or stand-ins the kernel does not read, and the one-hot ids (mode 2)
    q_src, q_t, q_m, q_z = (_rows(q_logits), q_t, q_m, q_z) if mode == 1 else (logits, t, m, z)
    q_args = (q_src, q_src.stride(0), q_t, q_m, q_z, q_onehot if mode == 2 else t)
    grid = (triton.cdiv(R, rows_per_program), C)
    _race_kernel[grid](logits, logits.stride(0), R, V, float(temperature), t, m, z, *q_args,
                       rng, stream, best, arg, pbest, parg, C, ROWS=rows_per_program,
                       BLOCK=block, MODE=mode)
    win = arg.gather(1, best.argmax(1, keepdim=True)).squeeze(1)
    if mode:
        fallback = parg.gather(1, pbest.argmax(1, keepdim=True)).squeeze(1)
        win = torch.where(best.amax(1) > float("-inf"), win, fallback)
    return win.long()
