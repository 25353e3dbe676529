"""Fused Triton kernels for the small work of a decoder layer, each beside the PyTorch it replaces.

On a GPU a decode or verification step is bound by how many kernels a layer runs, not by their
arithmetic: after CUDA graphs removed the launch cost, each kernel still costs ~2 µs, and the
1.5B example spent two thirds of its step outside the four matrix products. These kernels
bring a layer down to four products (plus a fixed-order reduction after narrow ones) and five
small kernels:

- `rms_norm(x, weight, eps, residual)`: residual += x, then RMSNorm of the sum, in one pass
  (the residual add of the previous sublayer fused into the norm of the next, as vLLM does).
- `rope_and_cache_write(qkv, cos, sin, positions, cache_layer, ...)`: rope on the q and k heads
  of the fused qkv output (after Qwen3's per-head RMSNorm when given), q rotated in place, the
  rotated keys and the values written to the cache at their positions.
- `attention(q, cache_layer, positions, kv_len, split)`: attention of a few query tokens over
  the static cache (split-K "flash decoding"): every query head of a kv head and every token
  of the step read that kv head's keys and values once; the causal mask comes from positions,
  as in the PyTorch path, so nothing but positions and a length is needed.
- `silu_mul(gate_up)`: SiLU(gate) · up.
- `linear(x, module)`: products of up to 32 rows (`_skinny_kernel`, tensor cores, K split in a
  fixed way per weight shape).

Every kernel here is batch-invariant: what it computes for one token (one row) does not depend
on how many other tokens the step carries. Decoding one token and verifying k + 1 tokens
therefore give bit-identical logits for the same position, so greedy speculative decoding
returns exactly the tokens of plain decoding, in bfloat16 as in float32. Not so with weight-only
quantization yet: the int8/int4 kernels of `flashdraft.quant` choose their tiling by row count.

Each has a PyTorch twin (`*_reference`, the code the model runs on a CPU) that the tests
compare against, on the GPU and on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Rounding follows the unfused PyTorch code: values are rounded to the model dtype where that
code stores a tensor (the residual sum, the normalised heads, SiLU's output), and accumulate in
float32 in between.

Attention is deterministic and independent of kv_len: the cache is cut into splits of a
length fixed per cache, a split beyond the step's last position does no work and contributes
an exact zero, so an eager step (kv_len = the true length) and a graph replay of the same step
(kv_len rounded up to a bucket) give bit-identical results.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the PyTorch paths serve
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# FLASHDRAFT_KERNELS=torch turns the fused kernels off (for comparisons and debugging).
_enabled = os.environ.get("FLASHDRAFT_KERNELS", "triton") != "torch"
_forced = False


def available() -> bool:
    return triton is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve tensors like x: on CUDA when Triton imports, unless
    turned off; on a CPU only inside `forced()` with the interpreter (tests)."""
    if triton is None or not _enabled:
        return False
    return x.is_cuda or (_forced and INTERPRET)


@contextlib.contextmanager
def disabled():
    """Run the PyTorch paths inside this block, even on CUDA."""
    global _enabled
    old, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = old


@contextlib.contextmanager
def forced():
    """Run the Triton kernels on CPU tensors too (needs TRITON_INTERPRET=1): for tests."""
    global _forced
    if not INTERPRET:
        raise RuntimeError("kernels.forced() needs TRITON_INTERPRET=1 set before Triton is imported")
    old, _forced = _forced, True
    try:
        yield
    finally:
        _forced = old


def split_length(max_len: int) -> int:
    """Cache positions one attention program reads: fixed per cache (never per kv_len), so that
    graph replays and eager steps cut the cache identically. ~32 splits for a full cache."""
    return min(1024, max(128, triton.next_power_of_2(max_len) // 32 if triton else 128))


# ---------------------------------------------------------------------------------------------
# PyTorch references (the CPU path)

def rms_norm_reference(x, weight, eps, residual=None):
    if residual is not None:
        residual.add_(x)
        x = residual
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_and_cache_write_reference(qkv, cos, sin, positions, cache_layer, n_heads, n_kv,
                                   q_norm=None, k_norm=None, eps=1e-6):
    # qkv [b, t, n_heads + 2 n_kv, d], rotated in place; cos, sin [b, t, d / 2];
    # cache_layer [2, batch, n_kv, max_len, d]
    qk = qkv[:, :, :n_heads + n_kv]
    if q_norm is not None:
        qk[:, :, :n_heads] = F.rms_norm(qk[:, :, :n_heads], q_norm.shape, q_norm, eps)
        qk[:, :, n_heads:] = F.rms_norm(qk[:, :, n_heads:], k_norm.shape, k_norm, eps)
    x1, x2 = qk.chunk(2, dim=-1)
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    qk.copy_(rotated)
    b = positions.shape[0]
    kv = qkv[:, :, n_heads:].unflatten(2, (2, n_kv))  # [b, t, 2, n_kv, d]
    batch_index = torch.arange(b, device=qkv.device).unsqueeze(1)
    cache_layer[:, batch_index, :, positions] = kv


def attention_reference(q, cache_layer, positions, kv_len):
    # q [b, t, heads, d] -> [b, t, heads * d]; keys/values: cache_layer[:, :b, :, :kv_len]
    b, t, heads, d = q.shape
    keys, values = cache_layer[0, :b, :, :kv_len], cache_layer[1, :b, :, :kv_len]
    visible = torch.arange(kv_len, device=q.device) <= positions.unsqueeze(-1)  # [b, t, kv_len]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), keys.float(), values.float(),
                                         attn_mask=visible.unsqueeze(1),
                                         enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).reshape(b, t, heads * d).to(q.dtype)


def linear_reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def silu_mul_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _pdl_wait(USE_PDL: tl.constexpr):
        # Programmatic dependent launch (Hopper on): this kernel may have started while the one
        # before it in the stream was finishing. Wait until that one's writes are visible (no
        # load of an activation and no store happens before this point), then let the next
        # kernel start its own launch.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        _pdl_wait(USE_PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            s = (x + r).to(res_ptr.dtype.element_ty)  # stored, so rounded as the add would
            tl.store(res_ptr + row * stride_r + cols, s, mask=ok)
            x = s.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (x * inv * w).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, cache_ptr, qn_ptr, kn_ptr, eps,
                           t, stride_qkv_tok, stride_cs_tok, stride_pb,
                           stride_c2, stride_cb, stride_ch, stride_cn,
                           N_HEADS: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr,
                           QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
        # One program per (token, head) over the q, k and v heads of one token's qkv row;
        # branch-free: q and k heads are rotated, v heads pass through, stores are masked.
        _pdl_wait(USE_PDL)
        tok = tl.program_id(0)  # b * t + i
        head = tl.program_id(1)
        b = tok // t
        i = tok - b * t
        lo = tl.arange(0, HALF)
        row = qkv_ptr + tok * stride_qkv_tok + head * 2 * HALF
        f1 = tl.load(row + lo).to(tl.float32)
        f2 = tl.load(row + HALF + lo).to(tl.float32)
        is_q = head < N_HEADS
        is_qk = head < N_HEADS + N_KV
        if QK_NORM:  # Qwen3: RMSNorm over each q and k head, stored (rounded) before rope
            w1 = tl.where(is_q, tl.load(qn_ptr + lo), tl.load(kn_ptr + lo)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qn_ptr + HALF + lo), tl.load(kn_ptr + HALF + lo)).to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
            n1 = (f1 * inv * w1).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            n2 = (f2 * inv * w2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            f1 = tl.where(is_qk, n1, f1)
            f2 = tl.where(is_qk, n2, f2)
        c = tl.load(cos_ptr + tok * stride_cs_tok + lo).to(tl.float32)
        s = tl.load(sin_ptr + tok * stride_cs_tok + lo).to(tl.float32)
        y1 = tl.where(is_qk, f1 * c - f2 * s, f1).to(qkv_ptr.dtype.element_ty)
        y2 = tl.where(is_qk, f2 * c + f1 * s, f2).to(qkv_ptr.dtype.element_ty)
        q_mask = lo < tl.where(is_q, HALF, 0)  # all of the row for q heads, none otherwise
        tl.store(row + lo, y1, mask=q_mask)
        tl.store(row + HALF + lo, y2, mask=q_mask)
        which = (head - N_HEADS) // N_KV  # 0 keys, 1 values (meaningless for q heads: masked)
        kvh = (head - N_HEADS) - which * N_KV
        pos = tl.load(pos_ptr + b * stride_pb + i)
        dst = cache_ptr + which * stride_c2 + b * stride_cb + kvh * stride_ch + pos * stride_cn
        kv_mask = lo < tl.where(head >= N_HEADS, HALF, 0)
        tl.store(dst + lo, y1.to(cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(dst + HALF + lo, y2.to(cache_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _attention_split_kernel(q_ptr, cache_ptr, pos_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                                t, n_kv, n_splits, qk_scale,
                                stride_qb, stride_qt, stride_qh,
                                stride_c2, stride_cb, stride_ch, stride_cn,
                                stride_pb, stride_ob, stride_ot, stride_oh,
                                GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DIRECT: tl.constexpr,
                                PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
        # Program (b * n_kv + kv head, split, row block). Rows are (token, query head of this
        # kv head) pairs: row = token * GROUP + g.
        _pdl_wait(USE_PDL)
        bh = tl.program_id(0)
        split = tl.program_id(1)
        rblock = tl.program_id(2)
        b = bh // n_kv
        kvh = bh - b * n_kv
        rows = rblock * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        g = rows - tok * GROUP
        row_ok = tok < t
        qpos = tl.load(pos_ptr + b * stride_pb + tok, mask=row_ok, other=-1)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + tok[:, None] * stride_qt
                    + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        # Keys beyond the step's last position (positions increase along the step) are never
        # visible: stop there, whatever kv_len.
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, tl.load(pos_ptr + b * stride_pb + t - 1) + 1)
        k_base = cache_ptr + b * stride_cb + kvh * stride_ch
        v_base = k_base + stride_c2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for j in range(0, SPLIT // BLOCK_N):  # a static trip count; blocks past the end skipped
            n0 = start + j * BLOCK_N
            if n0 < end:
                cols = n0 + tl.arange(0, BLOCK_N)
                col_ok = cols < end
                k = tl.load(k_base + cols[:, None] * stride_cn + d[None, :],
                            mask=col_ok[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2
                visible = (cols[None, :] <= qpos[:, None]) & col_ok[None, :]
                scores = tl.where(visible, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(scores - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + cols[:, None] * stride_cn + d[None, :],
                            mask=col_ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        if DIRECT:  # a single split: normalise and write the output here
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * stride_ob + tok[:, None] * stride_ot
                     + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            n_rows = t * GROUP
            slot = (bh * n_splits + split) * n_rows + rows
            tl.store(part_o_ptr + slot[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + slot * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _attention_combine_kernel(part_o_ptr, part_ml_ptr, out_ptr, t, n_kv, n_splits,
                                  stride_ob, stride_ot, stride_oh,
                                  GROUP: tl.constexpr, D: tl.constexpr, MAX_SPLITS: tl.constexpr,
                                  USE_PDL: tl.constexpr):
        _pdl_wait(USE_PDL)
        # Program (b * n_kv + kv head, row): merge the splits' partial results, in split order;
        # a split that saw no visible key (l = 0) adds exact zeros.
        bh = tl.program_id(0)
        row = tl.program_id(1)
        b = bh // n_kv
        kvh = bh - b * n_kv
        n_rows = t * GROUP
        d = tl.arange(0, D)
        m = tl.full([D], float("-inf"), tl.float32)
        for s in range(0, MAX_SPLITS):  # static trip count (the cache's), n_splits used
            if s < n_splits:
                m = tl.maximum(m, tl.load(part_ml_ptr + ((bh * n_splits + s) * n_rows + row) * 2))
        num = tl.zeros([D], tl.float32)
        den = tl.zeros([D], tl.float32)
        for s in range(0, MAX_SPLITS):
            if s < n_splits:
                slot = (bh * n_splits + s) * n_rows + row
                m_s = tl.load(part_ml_ptr + slot * 2)
                l_s = tl.load(part_ml_ptr + slot * 2 + 1)
                w = tl.where(l_s > 0, tl.exp2(m_s - m), 0.0)
                num += w * tl.load(part_o_ptr + slot * D + d)
                den += w * l_s
        tok = row // GROUP
        g = row - tok * GROUP
        tl.store(out_ptr + b * stride_ob + tok * stride_ot + (kvh * GROUP + g) * stride_oh + d,
                 (num / den).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, m, n, k, stride_xm, stride_wn, stride_os,
                       stride_om, HAS_BIAS: tl.constexpr, K_STEPS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
        # out [split, m, n] = x [m, k] @ w [n, k]^T over the K slice of this program, as
        # (w @ x^T)^T so that the few rows of x are the narrow side of the tensor-core product.
        # Program (n block, K slice, row block of BLOCK_M = 16). A row's result depends on that
        # row and the weights alone, never on m: the decode of one token and the verification
        # of k+1 tokens compute each row bit for bit alike.
        _pdl_wait(USE_PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < n
        m_ok = offs_m < m
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for i in range(0, K_STEPS):
            offs_k = (pid_k * K_STEPS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _sum_slices_kernel(p_ptr, b_ptr, out_ptr, total, n, SPLIT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        # p [SPLIT, m, n] float32 -> out [m, n] (+ bias): the K slices added in a fixed order.
        _pdl_wait(USE_PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, SPLIT):
            acc += tl.load(p_ptr + i * total + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
        _pdl_wait(USE_PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Entry points: Triton where `use_triton` says so, else the reference

# Programmatic dependent launch between consecutive kernels (compute capability 9.0 on: H100,
# H200, ...): a kernel is launched while the one before it finishes and waits in-kernel for
# its results, which hides most of the ~1 µs gap between kernels of a replayed graph.
# FLASHDRAFT_PDL=0 turns it off.
PDL = os.environ.get("FLASHDRAFT_PDL", "1") != "0"
_CAPABILITY: dict[int, int] = {}


def _pdl(x: torch.Tensor) -> dict:
    """Launch options (and the kernels' USE_PDL flag) for a kernel on x's device."""
    if not (PDL and x.is_cuda):
        return {"USE_PDL": False}
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _CAPABILITY:
        _CAPABILITY[dev] = torch.cuda.get_device_capability(dev)[0]
    if _CAPABILITY[dev] < 9:
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x, or, given residual, of residual + x, storing that sum into residual."""
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, residual)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = x2
    if residual is not None:
        r2 = residual.view(-1, n)  # updated in place: must be a contiguous view of residual
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, n, eps, x2.stride(0), r2.stride(0),
                                     out.stride(0), HAS_RESIDUAL=residual is not None,
                                     BLOCK=triton.next_power_of_2(n),
                                     num_warps=4 if n <= 4096 else 8, **_pdl(x))
    return out.view(x.shape)


def rope_and_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor, cache_layer: torch.Tensor, n_heads: int,
                         n_kv: int, q_norm: torch.Tensor | None = None,
                         k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Rope (after per-head RMSNorm when q_norm/k_norm are given) on the q and k heads of
    qkv [b, t, n_heads + 2 n_kv, head_dim], q in place; keys and values into cache_layer
    [2, batch, n_kv, max_len, head_dim] at positions [b, t]. cos, sin: [b, t, head_dim / 2]."""
    if not use_triton(qkv):
        return rope_and_cache_write_reference(qkv, cos, sin, positions, cache_layer, n_heads,
                                              n_kv, q_norm, k_norm, eps)
    b, t, heads, d = qkv.shape
    assert qkv.stride(-1) == 1 and qkv.stride(-2) == d and qkv.stride(0) == t * qkv.stride(1)
    cos, sin = cos.contiguous(), sin.contiguous()
    positions = positions.contiguous()
    qk_norm = q_norm is not None
    _rope_cache_kernel[(b * t, heads)](
        qkv, cos, sin, positions, cache_layer, q_norm if qk_norm else qkv,
        k_norm if qk_norm else qkv, eps, t, qkv.stride(1), cos.stride(1), positions.stride(0),
        cache_layer.stride(0), cache_layer.stride(1), cache_layer.stride(2), cache_layer.stride(3),
        N_HEADS=n_heads, N_KV=n_kv, HALF=d // 2, QK_NORM=qk_norm, num_warps=1, **_pdl(qkv))


def attention(q: torch.Tensor, cache_layer: torch.Tensor, positions: torch.Tensor, kv_len: int,
              split_len: int) -> torch.Tensor:
    """Attention of q [b, t, heads, head_dim] (a view of the qkv output is fine) over
    cache_layer [2, batch, n_kv, max_len, head_dim] up to kv_len, each query seeing the keys at
    positions <= its own; positions [b, t] increase along t. Returns [b, t, heads * head_dim]."""
    if not use_triton(q):
        return attention_reference(q, cache_layer, positions, kv_len)
    b, t, heads, d = q.shape
    n_kv = cache_layer.shape[2]
    group = heads // n_kv
    n_rows = t * group
    block_m = 16  # fixed: a row's arithmetic must not depend on how many rows the step has
    n_splits = triton.cdiv(kv_len, split_len)
    positions = positions.contiguous()
    out = torch.empty(b, t, heads, d, dtype=q.dtype, device=q.device)
    direct = n_splits == 1
    if direct:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty(b * n_kv * n_splits * n_rows, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * n_kv * n_splits * n_rows, 2, dtype=torch.float32, device=q.device)
    grid = (b * n_kv, n_splits, triton.cdiv(n_rows, block_m))
    _attention_split_kernel[grid](
        q, cache_layer, positions, out, part_o, part_ml, t, n_kv, n_splits,
        d ** -0.5 * 1.4426950408889634,  # softmax scale, in log2 units (the kernel uses exp2)
        q.stride(0), q.stride(1), q.stride(2),
        cache_layer.stride(0), cache_layer.stride(1), cache_layer.stride(2), cache_layer.stride(3),
        positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=64, SPLIT=split_len, DIRECT=direct,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **_pdl(q))
    if not direct:
        _attention_combine_kernel[(b * n_kv, n_rows)](
            part_o, part_ml, out, t, n_kv, n_splits, out.stride(0), out.stride(1), out.stride(2),
            GROUP=group, D=d, MAX_SPLITS=triton.cdiv(cache_layer.shape[3], split_len), num_warps=1,
            **_pdl(q))
    return out.view(b, t, heads * d)


# Products of up to SKINNY_MAX_ROWS rows (decode, verification, draft steps) go through
# `_skinny_kernel` when it is on: faster than cuBLAS for so few rows (benchmarks/NOTES-gpu.md),
# and batch-invariant, which is what makes greedy speculative decoding give exactly the tokens
# of plain decoding in bf16 too. FLASHDRAFT_SKINNY=0 turns it off (cuBLAS everywhere).
SKINNY = os.environ.get("FLASHDRAFT_SKINNY", "1") != "0"
SKINNY_MAX_ROWS = 32
_SKINNY_PROGRAMS = 264  # ~2 programs per multiprocessor of an H100/H200 before splitting K


@functools.cache
def skinny_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, k_steps, split) for an [n, k] weight: a function of the weight's
    shape only, never of the number of rows, so every row count runs the same arithmetic."""
    for block_n in (64, 32, 16):
        if triton.cdiv(n, block_n) >= _SKINNY_PROGRAMS:
            break
    block_k = min(8192 // block_n, max(16, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    n_blocks = triton.cdiv(n, block_n)
    split = 1 if n_blocks >= _SKINNY_PROGRAMS else \
        min(k_tiles, triton.cdiv(2 * _SKINNY_PROGRAMS, n_blocks))
    k_steps = triton.cdiv(k_tiles, split)
    return block_n, block_k, k_steps, triton.cdiv(k_tiles, k_steps)


def linear(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """module(x); for a plain nn.Linear and at most SKINNY_MAX_ROWS rows, `_skinny_kernel`."""
    rows = x.numel() // x.shape[-1]
    if (not SKINNY or type(module) is not torch.nn.Linear or not use_triton(x)
            or rows > SKINNY_MAX_ROWS):
        return module(x)
    w, bias = module.weight, module.bias
    n, k = w.shape
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, k_steps, split = skinny_config(n, k)
    parts = out.unsqueeze(0) if split == 1 else \
        torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    pdl = _pdl(x)
    _skinny_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(rows, 16))](
        x2, w, bias if bias is not None else w, parts, rows, n, k, x2.stride(0), w.stride(0),
        parts.stride(0), parts.stride(1), HAS_BIAS=bias is not None and split == 1,
        K_STEPS=k_steps, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
        **pdl)
    if split > 1:
        total = rows * n
        _sum_slices_kernel[(triton.cdiv(total, 1024),)](
            parts, bias if bias is not None else parts, out, total, n, SPLIT=split,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4, **pdl)
    return out.view(*x.shape[:-1], n)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for gate_up [..., 2 n] (gate first): [..., n]."""
    if not use_triton(gate_up):
        return silu_mul_reference(gate_up)
    n = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, x2.stride(0), out.stride(0),
                                                           BLOCK=block, num_warps=4,
                                                           **_pdl(gate_up))
    return out.view(*gate_up.shape[:-1], n)
