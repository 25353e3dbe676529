"""Fused Triton kernels for the small work of a decoder layer, each beside the PyTorch it replaces.

On a GPU a decode or verification step is bound by how many kernels a layer runs, not by their
arithmetic: after CUDA graphs removed the launch cost, each kernel still costs ~2 µs, and the
1.5B example spent two thirds of its step outside the four matrix products. These kernels
bring a decode layer down to five: four products and attention, the two norms inside the
products (`add_linear`, `scaled_linear`) and SiLU · up inside the gate/up product
(`gated_for`) or the down product; eight kernels where the norms are not folded (quantized
models):

- `rms_norm(x, weight, eps, residual)`: residual += x, then RMSNorm of the sum, in one pass
  (the residual add of the previous sublayer fused into the norm of the next, as vLLM does).
- `rope_and_cache_write(qkv, cos, sin, positions, cache_layer, ...)`: rope on the q and k heads
  of the fused qkv output (after Qwen3's per-head RMSNorm when given), q rotated in place, the
  rotated keys and the values written to the cache at their positions.
- `attention(q, cache_layer, positions, kv_len, split)`: attention of a few query tokens over
  the static cache (split-K "flash decoding"): every query head of a kv head and every token
  of the step read that kv head's keys and values once; the causal mask comes from positions,
  as in the PyTorch path, so nothing but positions and a length is needed. The last split to
  finish merges the others' results (no second kernel).
- `rope_attention(qkv, ...)`: the two above in one kernel for decode and verification steps:
  q rotated in registers, the step's keys and values written to the cache by the attention
  programs whose split holds them, before they read it.
- `silu_mul(gate_up)`: SiLU(gate) · up.
- `linear(x, module)`: products of up to 32 rows (`skinny_kernel`, tensor cores, K split in a
  fixed way per weight shape, the slices added by the last program of a tile to finish).
  `gated_linear` (SiLU · up inside the gate/up product) is the same kernel with more work in
  it where `gated_for` says (by default MLPs at least 12,288 wide), else `silu_mul` after
  `linear` (or, with the norms folded, inside the down product's input loads: `SiluPending`);
  `norm_linear` is `rms_norm` then `linear`.
- `add_linear(x, module, residual)`: the same kernel adding its product into the residual
  stream in place and leaving each row's sums of squares per column tile; `scaled_linear`:
  the next product, whose weight has the RMSNorm's weight folded in, scaling each row by the
  1 / rms those sums give. The norm then costs no kernel (`model.Residual`).
- `quant_linear(x, ...)`: the same for weight-only int8 / int4 weights, dequantized in
  registers (`skinny_quant_kernel`).

With programmatic dependent launch (Hopper on) each kernel starts while its predecessor
finishes, and the products load their first weight tiles before waiting for it: weights never
depend on the previous kernel, so their transfer overlaps the small kernels' latency.

Every kernel here is batch-invariant: what it computes for one token (one row) does not depend
on how many other tokens the step carries. Decoding one token and verifying k + 1 tokens
therefore give bit-identical logits for the same position, so greedy speculative decoding
returns exactly the tokens of plain decoding, in bfloat16 as in float32, and with weight-only
int8/int4 weights (`quant_linear`: the same kernel dequantizing in registers).

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

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import KernelConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the PyTorch paths serve
    triton = None

# Triton's own switch for its interpreter (read by Triton as it imports).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEFAULT = KernelConfig()


def available() -> bool:
    return triton is not None


def use_triton(x: torch.Tensor, kc: KernelConfig = DEFAULT) -> bool:
    """Whether the fused kernels serve tensors like x under kc: on CUDA where Triton imports
    and kc.backend is "triton"; on a CPU only with kc.interpret, through the interpreter."""
    if triton is None or kc.backend != "triton":
        return False
    if kc.interpret and not INTERPRET:
        raise RuntimeError("KernelConfig(interpret=True) needs TRITON_INTERPRET=1 set before "
                           "Triton is imported")
    return x.is_cuda or kc.interpret


def split_length(max_len: int) -> int:
    """Cache positions one attention program reads, for requests of up to max_len positions:
    fixed per request (never per kv_len, k or cache size: `Engine.run` sets it), so that graph
    replays, eager steps, decoding and verification cut the cache identically. ~32 splits."""
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


def attention_reference(q, cache_layer, positions, kv_len, tree_bits=None):
    # q [b, t, heads, d] -> [b, t, heads * d]; keys/values: cache_layer[:, :b, :, :kv_len];
    # tree_bits [t] int64: a token tree's step (`attention`)
    b, t, heads, d = q.shape
    keys, values = cache_layer[0, :b, :, :kv_len], cache_layer[1, :b, :, :kv_len]
    if tree_bits is None:
        visible = torch.arange(kv_len, device=q.device) <= positions.unsqueeze(-1)  # [b, t, kv]
    else:
        rel = torch.arange(kv_len, device=q.device) - positions[:, :1]  # [b, kv_len]
        in_step = (rel >= 0) & (rel < t)
        bit = (tree_bits.view(1, t, 1) >> rel.clamp(0, t - 1).unsqueeze(1)) & 1
        visible = (rel < 0).unsqueeze(1) | (in_step.unsqueeze(1) & (bit != 0))
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), keys.float(), values.float(),
                                         attn_mask=visible.unsqueeze(1),
                                         enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).reshape(b, t, heads * d).to(q.dtype)


def linear_reference(x, weight, bias=None):
    return F.linear(x, weight, bias)


def scaled_linear_reference(x, ss, eps, module, gated=False, kc=DEFAULT):
    # the norm (its weight folded into module's) from the sums of squares, then the product as
    # `linear` / `gated_linear` run it
    rms = torch.rsqrt(ss.sum(-1) / x.shape[-1] + eps).view(*x.shape[:-1], 1)
    h = (x.float() * rms).to(x.dtype)
    return gated_linear(h, module, kc) if gated else linear(h, module, kc)


def add_linear_reference(x, module, residual, kc=DEFAULT):
    residual.add_(linear(x, module, kc))
    return residual.float().square().sum(-1).view(-1, 1)


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

    # Not specialised on the step's length (t, and the positions' row stride, which is t):
    # Triton would compile another version for each prompt length that is a multiple of 16,
    # a second's stall in the middle of a request.
    @triton.jit(do_not_specialize=["t", "stride_pb"])
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
            w2 = tl.where(is_q, tl.load(qn_ptr + HALF + lo),
                          tl.load(kn_ptr + HALF + lo)).to(tl.float32)
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
    def _normed_rotated(rows, ok, cos_rows, sin_rows, w_ptr, eps, D: tl.constexpr,
                        NORM: tl.constexpr):
        # Heads [R, D] of q or k whose rows start at the pointers `rows` [R, 1] (rows with ok
        # False: zeros): with NORM (Qwen3) RMSNorm over the head with weight w, rounded; then
        # rope (half-split) with cos and sin [R, D / 2] at cos_rows / sin_rows, rounded: the
        # arithmetic of `_rope_cache_kernel`, on whole rows (each element with its partner in
        # the other half).
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, D)
        partner = (d + HALF) % D
        x = tl.load(rows + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        xp = tl.load(rows + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        dt = rows.dtype.element_ty
        if NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = (x * inv * tl.load(w_ptr + d).to(tl.float32)[None, :]).to(dt).to(tl.float32)
            xp = (xp * inv * tl.load(w_ptr + partner).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        c = tl.load(cos_rows + (d % HALF)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_rows + (d % HALF)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        return tl.where(d[None, :] < HALF, x * c - xp * s, x * c + xp * s).to(dt)

    @triton.jit
    def _attention_kernel(q_ptr, cache_ptr, pos_ptr, out_ptr, part_o_ptr, part_ml_ptr, count_ptr,
                          cos_ptr, sin_ptr, qn_ptr, kn_ptr, anc_ptr, eps,
                          t, n_heads, n_kv, n_splits, qk_scale,
                          stride_qb, stride_qt, stride_qh,
                          stride_c2, stride_cb, stride_ch, stride_cn,
                          stride_pb, stride_ob, stride_ot, stride_oh, stride_csb, stride_cst,
                          GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                          T_MAX: tl.constexpr, TREE: tl.constexpr, USE_PDL: tl.constexpr):
        # Program (b * n_kv + kv head, split, row block). Rows are (token, query head of this
        # kv head) pairs: row = token * GROUP + g. With ROPE, q_ptr is the qkv output (q, k
        # and v heads of each token, as they come from the product) and this kernel does
        # `_rope_cache_kernel`'s work first: q heads rotated in registers, and the step's own
        # keys and values (positions p0 .. p0 + t - 1, consecutive) written into the cache by
        # the programs whose split holds them, before they read it. With TREE the step is a
        # token tree's: its tokens sit at cache slots p0 .. p0 + t - 1 (pos_ptr: slots; cos and
        # sin already at each node's depth), and token i sees every slot before p0 and, of the
        # step's, those whose bit is set in anc_ptr[i] (its ancestors and itself).
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
        q_rows = (q_ptr + b * stride_qb + tok[:, None] * stride_qt
                  + (kvh * GROUP + g)[:, None] * stride_qh)
        # Keys beyond the step's last position (positions increase along the step) are never
        # visible: stop there, whatever kv_len. A split past it does no work at all.
        start = split * SPLIT
        last = tl.load(pos_ptr + b * stride_pb + t - 1)
        end = tl.minimum(start + SPLIT, last + 1)
        k_base = cache_ptr + b * stride_cb + kvh * stride_ch
        v_base = k_base + stride_c2
        if ROPE:
            cs = b * stride_csb + tok * stride_cst
            q = _normed_rotated(q_rows, row_ok, cos_ptr + cs[:, None], sin_ptr + cs[:, None],
                                qn_ptr, eps, D, QK_NORM)
            p0 = tl.load(pos_ptr + b * stride_pb)
            if (p0 < start + SPLIT) & (last >= start):  # this step's keys in this split
                j = tl.arange(0, T_MAX)  # token j of the step, at position p0 + j
                at = p0 + j
                new = (j < t) & (at >= start) & (at < start + SPLIT)
                src = q_ptr + b * stride_qb + j[:, None] * stride_qt
                cs_new = b * stride_csb + j * stride_cst
                k_new = _normed_rotated(src + (n_heads + kvh) * stride_qh, new,
                                        cos_ptr + cs_new[:, None], sin_ptr + cs_new[:, None],
                                        kn_ptr, eps, D, QK_NORM)
                v_new = tl.load(src + (n_heads + n_kv + kvh) * stride_qh + d[None, :],
                                mask=new[:, None], other=0.0)
                dst = at[:, None] * stride_cn + d[None, :]
                tl.store(k_base + dst, k_new.to(cache_ptr.dtype.element_ty), mask=new[:, None])
                tl.store(v_base + dst, v_new.to(cache_ptr.dtype.element_ty), mask=new[:, None])
                tl.debug_barrier()  # stored (every row block stores the same bits) before read
        else:
            q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if TREE:
            first = tl.load(pos_ptr + b * stride_pb)
            anc = tl.load(anc_ptr + tok, mask=row_ok, other=0)  # [BLOCK_M] int64 bit sets
        if start < end:
            # A static trip count with no branch inside, so that loads are pipelined; blocks
            # past `end` load nothing (masked) and leave m, l and acc exactly as they were.
            for j in range(0, SPLIT // BLOCK_N):
                cols = start + j * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = cols < end
                k = tl.load(k_base + cols[:, None] * stride_cn + d[None, :],
                            mask=col_ok[:, None], other=0.0, cache_modifier=".cg" if ROPE else "")
                v = tl.load(v_base + cols[:, None] * stride_cn + d[None, :],
                            mask=col_ok[:, None], other=0.0, cache_modifier=".cg" if ROPE else "")
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2
                if TREE:
                    rel = cols - first  # the step's token at that slot, if 0 <= rel < t
                    in_step = (rel >= 0) & (rel < t)
                    shift = tl.where(in_step, rel, 0).to(tl.int64)
                    bit = (anc[:, None] >> shift[None, :]) & 1
                    visible = (((rel < 0)[None, :] | (in_step[None, :] & (bit != 0)))
                               & col_ok[None, :])
                else:
                    visible = (cols[None, :] <= qpos[:, None]) & col_ok[None, :]
                scores = tl.where(visible, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(scores - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        out_ptrs = (out_ptr + b * stride_ob + tok[:, None] * stride_ot
                    + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :])
        if MAX_SPLITS == 1:  # one split: normalise and write the output here
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # Each split stores its partial result; the last split of this (head, row block)
            # to finish merges them all, in split order (a split that saw no visible key adds
            # exact zeros), so no second kernel runs and the result does not depend on the
            # order in which splits finished.
            n_rows = t * GROUP
            base = bh * n_splits * n_rows + rows
            slot = base + split * n_rows
            tl.store(part_o_ptr + slot[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + slot * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_ok)
            tl.debug_barrier()  # every thread's part is stored before the counter moves
            counter = count_ptr + bh * tl.num_programs(2) + rblock
            if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
                m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for s in tl.static_range(MAX_SPLITS):  # the cache's count; n_splits used
                    ok = rows < tl.where(s < n_splits, n_rows, 0)  # rows of a used split
                    m = tl.maximum(m, tl.load(part_ml_ptr + (base + s * n_rows) * 2, mask=ok,
                                              other=float("-inf"), cache_modifier=".cg"))
                num = tl.zeros([BLOCK_M, D], tl.float32)
                den = tl.zeros([BLOCK_M], tl.float32)
                for s in tl.static_range(MAX_SPLITS):
                    ok = rows < tl.where(s < n_splits, n_rows, 0)  # rows of a used split
                    slot = base + s * n_rows
                    m_s = tl.load(part_ml_ptr + slot * 2, mask=ok, other=float("-inf"),
                                  cache_modifier=".cg")
                    l_s = tl.load(part_ml_ptr + slot * 2 + 1, mask=ok, other=0.0,
                                  cache_modifier=".cg")
                    w = tl.where(l_s > 0, tl.exp2(m_s - m), 0.0)
                    num += w[:, None] * tl.load(part_o_ptr + slot[:, None] * D + d[None, :],
                                                mask=ok[:, None], other=0.0, cache_modifier=".cg")
                    den += w * l_s
                out = num / tl.where(den > 0, den, 1.0)[:, None]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.atomic_xchg(counter, 0)  # ready for the next launch

    @triton.jit
    def _row_scale(ss_ptr, offs_m, m_ok, k, eps, TILES: tl.constexpr, BLOCK_M: tl.constexpr):
        # 1 / rms of each row [BLOCK_M] from its sums of squares over TILES column tiles
        # (ss [m, TILES] float32, written by the product before: `_skinny_epilogue`'s
        # ADD_RESIDUAL), added in tile order whatever the layout; ones when TILES is 0.
        r = tl.full([BLOCK_M], 1.0, tl.float32)
        if TILES > 0:
            total = tl.zeros([BLOCK_M], tl.float32)
            for j in tl.static_range(TILES):
                total += tl.load(ss_ptr + offs_m * TILES + j, mask=m_ok, other=0.0)
            r = tl.rsqrt(total / k + eps)
        return r

    @triton.jit
    def _skinny_epilogue(acc, acc_up, r, b_ptr, out_ptr, ss_out_ptr, offs_n, offs_m, n_ok, m_ok,
                         n, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                         SCALED: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M]: the finished sums of this tile; with GATED, acc holds the gate
        # and acc_up the up projection of the same output columns. SCALED: the input rows were
        # the residual stream and the RMSNorm before this product had its weight folded into
        # w, so the norm is each row's 1 / rms, r [BLOCK_M], applied here. ADD_RESIDUAL: out is
        # the residual stream, which takes this product added in place (rounded as the add in
        # `_rms_norm_kernel`), and each row's sum of squares over this tile's columns goes to
        # ss_out [m, column tiles], for the next product's norm.
        dt = out_ptr.dtype.element_ty
        if SCALED:
            acc = acc * r[None, :]
            if GATED:
                acc_up = acc_up * r[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if GATED:
            if HAS_BIAS:
                acc_up += tl.load(b_ptr + n + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            # rounded where the unfused code stores: the product, then SiLU's output
            gate = acc.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            acc = act * acc_up.to(dt).to(tl.float32)
        ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        ok = n_ok[:, None] & m_ok[None, :]
        y = acc.to(dt)
        if ADD_RESIDUAL:
            y = (y.to(tl.float32) + tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)).to(dt)
            yf = y.to(tl.float32)
            tl.store(ss_out_ptr + offs_m * tl.num_programs(0) + tl.program_id(0),
                     tl.sum(yf * yf, axis=0), mask=m_ok)
        tl.store(ptrs, y, mask=ok)

    @triton.jit
    def _x_tile(x_ptr, offs_m, m_ok, offs_k, k_ok, k, stride_xm, SILU_X: tl.constexpr):
        # x's [BLOCK_M, len(offs_k)] tile; SILU_X: x is the MLP's [gate, up] output (each k
        # wide) and the tile SiLU(gate) · up of it, rounded as `_silu_mul_kernel` rounds.
        ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        ok = m_ok[:, None] & k_ok[None, :]
        if SILU_X:
            gate = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(ptrs + k, mask=ok, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            return (act * up).to(x_ptr.dtype.element_ty)
        return tl.load(ptrs, mask=ok, other=0.0)

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, ss_ptr, ss_out_ptr, eps,
                       m, n, k, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, SPLIT: tl.constexpr, K_STEPS: tl.constexpr,
                       PRE_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
                       SCALE_TILES: tl.constexpr = 0, ADD_RESIDUAL: tl.constexpr = False, SILU_X: tl.constexpr = False):
        # out [m, n] = x [m, k] @ w [n, k]^T, as (w @ x^T)^T so that the few rows of x are the
        # narrow side of the tensor-core product. With GATED, w is [2 n, k] (gate rows, then up
        # rows) and out = SiLU(x @ gate^T) * (x @ up^T): the MLP's first product and its
        # activation in one kernel. SCALE_TILES > 0: each row of the product is scaled by the
        # row's 1 / rms from ss [m, SCALE_TILES] (an RMSNorm folded into w, `_row_scale`);
        # ADD_RESIDUAL: out is the residual stream, the product is added into it and ss_out
        # gets the sums of squares of the result (`_skinny_epilogue`). SILU_X: x is [m, 2 k],
        # the MLP's gate and up, and the product's input SiLU(gate) · up of it (`_x_tile`).
        # Program (n block, K slice, row block of BLOCK_M = 16). A row's result depends on that
        # row and the weights alone, never on m: the decode of one token and the verification
        # of k+1 tokens compute each row bit for bit alike.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < n
        m_ok = offs_m < m
        k0 = pid_k * K_STEPS * BLOCK_K
        # Weights do not depend on the kernels before this one: the first PRE_STEPS tiles are
        # loaded before waiting for them (programmatic dependent launch), so that their
        # transfer overlaps the end of the previous kernel.
        offs_p = k0 + tl.arange(0, PRE_STEPS * BLOCK_K)
        p_ok = offs_p < k
        w_rows = w_ptr + offs_n[:, None] * stride_wn
        w_pre = tl.load(w_rows + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        if GATED:
            u_pre = tl.load(w_rows + n * stride_wn + offs_p[None, :],
                            mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        _pdl_wait(USE_PDL)
        x_pre = _x_tile(x_ptr, offs_m, m_ok, offs_p, p_ok, k, stride_xm, SILU_X)
        r = _row_scale(ss_ptr, offs_m, m_ok, k, eps, SCALE_TILES, BLOCK_M)
        acc = tl.dot(w_pre, tl.trans(x_pre), input_precision=PRECISION, out_dtype=tl.float32)
        acc_up = acc
        if GATED:
            acc_up = tl.dot(u_pre, tl.trans(x_pre), input_precision=PRECISION,
                            out_dtype=tl.float32)
        for i in range(PRE_STEPS, K_STEPS):
            offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k
            xk = _x_tile(x_ptr, offs_m, m_ok, offs_k, k_ok, k, stride_xm, SILU_X)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(xk), acc, input_precision=PRECISION)
            if GATED:
                u = tl.load(w_rows + n * stride_wn + offs_k[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = tl.dot(u, tl.trans(xk), acc_up, input_precision=PRECISION)
        _skinny_finish(acc, acc_up, r, b_ptr, out_ptr, ss_out_ptr, part_ptr, count_ptr, offs_n,
                       offs_m, n_ok, m_ok, m, n, stride_om, HAS_BIAS, GATED, SPLIT, SCALE_TILES > 0,
                       ADD_RESIDUAL)

    @triton.jit
    def _quant_tile(w_ptr, offs_n, n_ok, g, k, stride_wn, stride_wk, BITS: tl.constexpr):
        # The stored weights of K group g (128 inputs) for columns offs_n: int4 [BLOCK_N, 64]
        # bytes (inputs i and i + 64 of the group in one byte), int8 [BLOCK_N, 128].
        if BITS == 4:
            offs = tl.arange(0, 64)
            ok = n_ok[:, None] & (g * 128 + offs < k)[None, :]
            return tl.load(w_ptr + (g * 64 + offs)[None, :] * stride_wk
                           + offs_n[:, None] * stride_wn, mask=ok, other=0)
        else:
            offs = g * 128 + tl.arange(0, 128)
            return tl.load(w_ptr + offs[None, :] * stride_wk + offs_n[:, None] * stride_wn,
                           mask=n_ok[:, None] & (offs < k)[None, :], other=0)

    @triton.jit
    def _quant_step(acc, wt, x_ptr, s_ptr, z_ptr, offs_m, m_ok, offs_n, g, n, k, stride_xm,
                    BITS: tl.constexpr, MAGIC: tl.constexpr, SCALED: tl.constexpr,
                    ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, PRECISION: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M] += the products of K group g: weights wt (from _quant_tile)
        # times x's inputs of the group, on tensor cores. int4: w = (q - 8) · s + z per group
        # and column. With MAGIC (0x4300 for bfloat16, 0x6400 for float16) a code becomes a
        # float by a bit-or, q + 128 (bf16) or q + 1024 (fp16) exactly: no integer-to-float
        # conversion. SCALED: each weight is then dequantized in full and the tensor cores sum
        # into acc directly; else the group adds s · Σ x (q - 8) + z · Σ x, applied to the
        # group's [BLOCK_N, BLOCK_M] sums, the offset (136 or 1032) coming off those sums.
        dt = x_ptr.dtype.element_ty
        if BITS == 4:
            offs = g * 128 + tl.arange(0, 64)
            ok = m_ok[:, None] & (offs < k)[None, :]
            rows = x_ptr + offs_m[:, None] * stride_xm
            x_lo = tl.load(rows + offs[None, :], mask=ok, other=0.0)
            x_hi = tl.load(rows + (offs + 64)[None, :], mask=ok, other=0.0)
            offset = 0.0 if MAGIC == 0 else (136.0 if MAGIC == 0x4300 else 1032.0)
            g_ok = offs_n < tl.where(g * 128 < k, n, 0)
            s = tl.load(s_ptr + g * n + offs_n, mask=g_ok, other=0.0)
            z = tl.load(z_ptr + g * n + offs_n, mask=g_ok, other=0.0)
            if SCALED:  # each weight dequantized in full, (q - 8) · s + z
                sb, _ = tl.broadcast(s[:, None], wt)
                zb, _ = tl.broadcast(z[:, None], wt)
            if ASM_LO != "" and SCALED:  # bit-or, subtract and FMA on pairs, in PTX
                lo = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r,r,r,r,r", [wt, sb, zb], dtype=dt,
                                               is_pure=True, pack=4)
                hi = tl.inline_asm_elementwise(ASM_HI, "=r,=r,r,r,r,r,r", [wt, sb, zb], dtype=dt,
                                               is_pure=True, pack=4)
            elif ASM_LO != "":  # the bit-or in PTX, four codes at a time (see _nibble_asm)
                lo = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r", [wt], dtype=dt, is_pure=True,
                                               pack=4)
                hi = tl.inline_asm_elementwise(ASM_HI, "=r,=r,r", [wt], dtype=dt, is_pure=True,
                                               pack=4)
            elif MAGIC:
                w16 = wt.to(tl.uint16)
                lo = ((w16 & 0xF) | MAGIC).to(dt, bitcast=True)
                hi = ((w16 >> 4) | MAGIC).to(dt, bitcast=True)
            else:
                lo = ((wt & 0xF).to(tl.float32) - 8.0).to(dt)
                hi = ((wt >> 4).to(tl.float32) - 8.0).to(dt)
            if SCALED and ASM_LO == "":  # the Triton twin of the PTX above
                sf, zf = sb.to(tl.float32), zb.to(tl.float32)
                lo = ((lo.to(tl.float32) - offset) * sf + zf).to(dt)
                hi = ((hi.to(tl.float32) - offset) * sf + zf).to(dt)
            if SCALED:  # the tensor cores sum straight into acc, chained from group to group
                acc = tl.dot(lo, tl.trans(x_lo), acc, input_precision=PRECISION)
                acc = tl.dot(hi, tl.trans(x_hi), acc, input_precision=PRECISION)
            else:
                d = tl.dot(lo, tl.trans(x_lo), input_precision=PRECISION, out_dtype=tl.float32)
                d = tl.dot(hi, tl.trans(x_hi), d, input_precision=PRECISION)
                xs = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                s, z = s.to(tl.float32), z.to(tl.float32)
                acc += s[:, None] * (d - offset * xs[None, :]) + z[:, None] * xs[None, :]
        else:
            offs = g * 128 + tl.arange(0, 128)
            xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs[None, :],
                         mask=m_ok[:, None] & (offs < k)[None, :], other=0.0)
            acc = tl.dot(wt.to(dt), tl.trans(xk), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def skinny_quant_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
                             m, n, k, stride_xm, stride_wn, stride_wk, stride_om,
                             BITS: tl.constexpr,
                             MAGIC: tl.constexpr, SCALED: tl.constexpr, ASM_LO: tl.constexpr,
                             ASM_HI: tl.constexpr, HAS_BIAS: tl.constexpr,
                             SPLIT: tl.constexpr,
                             K_STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
                             USE_PDL: tl.constexpr):
        # out [m, n] = x [m, k] @ W^T for weight-only int4 / int8 W (flashdraft.backends.quant's formats:
        # w [k/2, n] packed int4 with s, z [k/128, n]; or w [k, n] int8 with s [n]), as
        # `skinny_kernel`: program (n block, K slice, row block), K walked one group of 128 at
        # a time, slices added by the last program of a tile; batch-invariant.
        pid_n = tl.program_id(0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < n
        m_ok = offs_m < m
        g0 = tl.program_id(1) * K_STEPS
        wt = _quant_tile(w_ptr, offs_n, n_ok, g0, k, stride_wn, stride_wk, BITS)  # before the wait
        _pdl_wait(USE_PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc = _quant_step(acc, wt, x_ptr, s_ptr, z_ptr, offs_m, m_ok, offs_n, g0, n, k,
                          stride_xm, BITS, MAGIC, SCALED, ASM_LO, ASM_HI, PRECISION)
        for i in range(1, K_STEPS):
            wt = _quant_tile(w_ptr, offs_n, n_ok, g0 + i, k, stride_wn, stride_wk, BITS)
            acc = _quant_step(acc, wt, x_ptr, s_ptr, z_ptr, offs_m, m_ok, offs_n, g0 + i, n, k,
                              stride_xm, BITS, MAGIC, SCALED, ASM_LO, ASM_HI, PRECISION)
        if BITS == 8:  # the per-column scale, once
            acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        _skinny_finish(acc, acc, acc, b_ptr, out_ptr, out_ptr, part_ptr, count_ptr, offs_n, offs_m,
                       n_ok, m_ok, m, n, stride_om, HAS_BIAS, False, SPLIT, False, False)

    @triton.jit
    def _skinny_finish(acc, acc_up, r, b_ptr, out_ptr, ss_out_ptr, part_ptr, count_ptr, offs_n,
                       offs_m, n_ok, m_ok, m, n, stride_om, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, SPLIT: tl.constexpr, SCALED: tl.constexpr,
                       ADD_RESIDUAL: tl.constexpr):
        # A program's sums over its K slice -> the output (bf16 and quantized products alike).
        if SPLIT == 1:
            _skinny_epilogue(acc, acc_up, r, b_ptr, out_ptr, ss_out_ptr, offs_n, offs_m, n_ok,
                             m_ok, n, stride_om, HAS_BIAS, GATED, SCALED, ADD_RESIDUAL)
        else:
            # K split across SPLIT programs: each stores its float32 slice, and the last of them
            # to finish adds the slices in slice order (so the result does not depend on which
            # finished last) and runs the epilogue.
            width = 2 * n if GATED else n
            part = part_ptr + offs_m[None, :] * width + offs_n[:, None]
            ok = n_ok[:, None] & m_ok[None, :]
            tl.store(part + tl.program_id(1) * m * width, acc, mask=ok)
            if GATED:
                tl.store(part + tl.program_id(1) * m * width + n, acc_up, mask=ok)
            tl.debug_barrier()  # every thread's slice is stored before the counter moves
            tile = count_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT - 1:
                acc = tl.zeros_like(acc)
                acc_up = acc
                for s in tl.static_range(SPLIT):
                    acc += tl.load(part + s * m * width, mask=ok, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(part + s * m * width + n, mask=ok, other=0.0,
                                          cache_modifier=".cg")
                _skinny_epilogue(acc, acc_up, r, b_ptr, out_ptr, ss_out_ptr, offs_n, offs_m, n_ok,
                                 m_ok, n, stride_om, HAS_BIAS, GATED, SCALED, ADD_RESIDUAL)
                tl.atomic_xchg(tile, 0)  # ready for the next launch

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
# H200, ...; KernelConfig.pdl): a kernel is launched while the one before it finishes and
# waits in-kernel for its results, which hides most of the ~1 µs gap between kernels of a
# replayed graph; the products load their first weight tiles before that wait.
_CAPABILITY: dict[int, int] = {}


def pdl_options(x: torch.Tensor, kc: KernelConfig = DEFAULT) -> dict:
    """Launch options (and the kernels' USE_PDL flag) for a kernel on x's device."""
    if not (kc.pdl and x.is_cuda):
        return {"USE_PDL": False}
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _CAPABILITY:
        _CAPABILITY[dev] = torch.cuda.get_device_capability(dev)[0]
    if _CAPABILITY[dev] < 9:
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


# Tile counters of the kernels that finish a split reduction in their last program (products
# with a K split, attention with several cache splits): one zeroed int32 buffer per device,
# each counter put back to zero by the program that finishes its tile. Kernels of a device run
# one after another (one stream, or streams ordered by events), so they can share it.
COUNTERS: dict[torch.device, torch.Tensor] = {}
_N_COUNTERS = 1 << 16


def tile_counters(device: torch.device, needed: int) -> torch.Tensor:
    if needed > _N_COUNTERS:
        raise ValueError(f"{needed} output tiles exceed the {_N_COUNTERS} tile counters")
    buf = COUNTERS.get(device)
    if buf is None:
        buf = COUNTERS[device] = torch.zeros(_N_COUNTERS, dtype=torch.int32, device=device)
    return buf


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """RMSNorm of x, or, given residual, of residual + x, storing that sum into residual."""
    if not use_triton(x, kc):
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
                                     num_warps=4 if n <= 4096 else 8, **pdl_options(x, kc))
    return out.view(x.shape)


def rope_and_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor, cache_layer: torch.Tensor, n_heads: int,
                         n_kv: int, q_norm: torch.Tensor | None = None,
                         k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                         kc: KernelConfig = DEFAULT) -> None:
    """Rope (after per-head RMSNorm when q_norm/k_norm are given) on the q and k heads of
    qkv [b, t, n_heads + 2 n_kv, head_dim], q in place; keys and values into cache_layer
    [2, batch, n_kv, max_len, head_dim] at positions [b, t]. cos, sin: [b, t, head_dim / 2]."""
    if not use_triton(qkv, kc):
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
        N_HEADS=n_heads, N_KV=n_kv, HALF=d // 2, QK_NORM=qk_norm, num_warps=1, **pdl_options(qkv, kc))


def attention(q: torch.Tensor, cache_layer: torch.Tensor, positions: torch.Tensor, kv_len: int,
              split_len: int, kc: KernelConfig = DEFAULT,
              tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [b, t, heads, head_dim] (a view of the qkv output is fine) over
    cache_layer [2, batch, n_kv, max_len, head_dim] up to kv_len, each query seeing the keys at
    positions <= its own; positions [b, t] increase along t (by one). tree_bits [t] int64: the
    step is a token tree's (`tree.TreeMask.bits`): token i sees the slots before the step's
    first and, of the step's, those whose bit is set in tree_bits[i]. Returns [b, t, heads *
    head_dim]."""
    if not use_triton(q, kc):
        return attention_reference(q, cache_layer, positions, kv_len, tree_bits)
    return _attention(q, q.shape[2], cache_layer, positions, kv_len, split_len, kc,
                      tree_bits=tree_bits)


# Rope and the cache write inside the attention kernel (`rope_attention`): one kernel a layer
# fewer for steps of up to ROPE_MAX_T tokens.
ROPE_MAX_T = 32  # tokens a step of the fused kernel may carry (the model's SMALL_T)


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, cache_layer: torch.Tensor, n_heads: int, n_kv: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   kv_len: int, split_len: int, kc: KernelConfig = DEFAULT,
                   tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_and_cache_write` then `attention` of its q heads: for qkv [b, t, n_heads + 2 n_kv,
    head_dim] at positions [b, t], each sequence's positions consecutive (start .. start +
    t - 1, as every step of the engine has them). On the GPU one kernel: the
    q heads are rotated in registers (qkv is left as it is) and the step's keys and values are
    written to the cache by the attention programs that read them. tree_bits: a token tree's
    step, as `attention` takes it (cos and sin then at the nodes' depths)."""
    t = qkv.shape[1]
    if not (use_triton(qkv, kc) and t <= ROPE_MAX_T):
        rope_and_cache_write(qkv, cos, sin, positions, cache_layer, n_heads, n_kv, q_norm,
                             k_norm, eps, kc)
        return attention(qkv[:, :, :n_heads], cache_layer, positions, kv_len, split_len, kc,
                         tree_bits)
    assert qkv.stride(-1) == 1 and qkv.stride(-2) == qkv.shape[-1]
    rope = (cos.contiguous(), sin.contiguous(), q_norm, k_norm, eps)
    return _attention(qkv, n_heads, cache_layer, positions, kv_len, split_len, kc, rope,
                      tree_bits)


def _attention(q: torch.Tensor, heads: int, cache_layer: torch.Tensor, positions: torch.Tensor,
               kv_len: int, split_len: int, kc: KernelConfig,
               rope: tuple | None = None, tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """The attention kernel's launch for q [b, t, >= heads, head_dim] (its first `heads` heads
    attend); rope: (cos, sin, q_norm, k_norm, eps) with q the whole qkv output."""
    b, t, _, d = q.shape
    n_kv = cache_layer.shape[2]
    group = heads // n_kv
    n_rows = t * group
    block_m = 16  # fixed: a row's arithmetic must not depend on how many rows the step has
    n_splits = triton.cdiv(kv_len, split_len)
    # The merge's unrolled bound: a power of two (few compilations), not the cache's length (a
    # cache sized by an earlier long request would make every merge walk hundreds of slots).
    # Unused slots add exact zeros, so the bound changes no result.
    max_splits = triton.next_power_of_2(n_splits)
    positions = positions.contiguous()
    out = torch.empty(b, t, heads, d, dtype=q.dtype, device=q.device)
    grid = (b * n_kv, n_splits, triton.cdiv(n_rows, block_m))
    if max_splits == 1:
        part_o = part_ml = counters = out  # unused
    else:
        part_o = torch.empty(b * n_kv * n_splits * n_rows, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * n_kv * n_splits * n_rows, 2, dtype=torch.float32, device=q.device)
        counters = tile_counters(q.device, grid[0] * grid[2])
    cos, sin, q_norm, k_norm, eps = rope or (q, q, None, None, 0.0)
    _attention_kernel[grid](
        q, cache_layer, positions, out, part_o, part_ml, counters, cos, sin,
        q if q_norm is None else q_norm, q if k_norm is None else k_norm,
        positions if tree_bits is None else tree_bits, eps, t, heads, n_kv,
        n_splits, d ** -0.5 * 1.4426950408889634,  # softmax scale, in log2 units (exp2)
        q.stride(0), q.stride(1), q.stride(2),
        cache_layer.stride(0), cache_layer.stride(1), cache_layer.stride(2), cache_layer.stride(3),
        positions.stride(0), out.stride(0), out.stride(1), out.stride(2), cos.stride(0),
        cos.stride(1), GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=64, SPLIT=split_len,
        MAX_SPLITS=max_splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ROPE=rope is not None, QK_NORM=q_norm is not None, T_MAX=ROPE_MAX_T,
        TREE=tree_bits is not None, num_warps=4,
        **pdl_options(q, kc))
    return out.view(b, t, heads * d)


# Products of up to SKINNY_MAX_ROWS rows (decode, verification, draft steps) go through
# `skinny_kernel`: faster than cuBLAS for so few rows (docs/kernels.md), and batch-invariant,
# which is what makes greedy speculative decoding give exactly the tokens of plain decoding in
# bf16 too.
SKINNY_MAX_ROWS = 32
_SKINNY_PROGRAMS = 256  # ~2 programs per multiprocessor of an H100/H200, splitting K to get there
_PREFETCH_ELEMENTS = 8192  # weight elements a program may load before its PDL wait


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    k_steps: int  # K tiles per program
    split: int  # programs along K (their slices added by the last one to finish)
    pre_steps: int  # K tiles loaded before the PDL wait
    num_warps: int = 4
    num_stages: int = 3


# How the skinny kernel is launched: the launch measured fastest for the weight's shape on this
# GPU model where the tuned table has one (KernelConfig.tuned_table, `flashdraft tune`), else
# 64 x 128 tiles with K split to ~256 programs. SiLU · up is computed inside the gate/up
# product for MLPs at least GATED_MIN_N wide (the 8B's 12,288: decode 1-4 % faster; the
# 1.5B's 8,960 within noise and its 16-token step slower), else inside the down product's
# input loads where the norms are folded (`SiluPending`), else by `silu_mul`.
SHIPPED_TABLE = str(Path(__file__).parent.parent / "data" / "skinny_tuned.json")
GATED_MIN_N = 12288


def gated_for(n: int) -> bool:
    """Whether an MLP's gate/up product of n output features (each of gate and up) computes
    SiLU(gate) · up itself."""
    return n >= GATED_MIN_N


def table_key(n: int, k: int, gated: bool) -> str:
    return f"{n}x{k}{' gated' if gated else ''}"


def check_entry(key: str, c: SkinnyConfig) -> SkinnyConfig:
    """c, if it is a launch that covers the weight of `key` exactly and that the kernel can
    compile (tiles of at least 16 for the tensor cores, powers of two where it takes ranges);
    else ValueError."""
    n, k = (int(v) for v in key.split()[0].split("x"))
    power = lambda v: isinstance(v, int) and v > 0 and v & (v - 1) == 0
    ok = (all(power(v) for v in (c.block_n, c.block_k, c.num_warps, c.pre_steps))
          and c.block_n >= 16 and c.block_k >= 16 and c.num_warps <= 32
          and isinstance(c.k_steps, int) and 1 <= c.pre_steps <= c.k_steps
          and isinstance(c.num_stages, int) and c.num_stages >= 1
          and c.split == triton.cdiv(triton.cdiv(k, c.block_k), c.k_steps))
    if not ok:
        raise ValueError(f"{key}: {tuple(c)} is not a launch of the skinny kernel over [{n}, {k}]")
    return c


def device_name() -> str:
    """The GPU model the tuned table is looked up under ("cpu" without CUDA: Triton's
    interpreter)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def user_table() -> Path:
    """The table `flashdraft tune` writes, read over the shipped one: in the model cache."""
    from ..loading.examples import cache_dir

    return cache_dir() / "skinny_tuned.json"


def _read_table(path: Path, gpu: str, required: bool) -> dict[str, SkinnyConfig]:
    try:
        table = json.loads(path.read_text()).get(gpu, {})
        return {key: check_entry(key, SkinnyConfig(*v)) for key, v in table.items()}
    except FileNotFoundError:
        if required:
            raise ValueError(f"tuned table {str(path)!r}: no such file; name a table written "
                             "by flashdraft tune (--tuned-table), or 'off'")
        return {}
    except (ValueError, TypeError, AttributeError, OSError) as e:
        raise ValueError(f"{path}: not a table of skinny-kernel launches ({e}); write it again "
                         "with flashdraft tune, or pass --tuned-table off") from None


@functools.cache
def tuned_table(gpu: str, table: str | None = None) -> dict[str, SkinnyConfig]:
    """The measured launch parameters for one GPU model, by table_key: with table None the
    shipped table's with the user's (`flashdraft tune`) over them, else only the named file's;
    empty where none has this GPU (the rule applies) or table is "off"."""
    if table == "off":
        return {}
    if table is not None:
        return _read_table(Path(table), gpu, required=True)
    return {**_read_table(Path(SHIPPED_TABLE), gpu, False),
            **_read_table(user_table(), gpu, False)}


@functools.cache
def skinny_config(n: int, k: int, gated: bool = False, table: str | None = "off"
                  ) -> SkinnyConfig:
    """Launch parameters for an [n, k] weight ([2 n, k] gate and up with `gated`): a function
    of the weight's shape (and the GPU model) only, never of the number of rows, so every row
    count runs the same arithmetic. The tuned table's entry (`tuned_table(gpu, table)`) where
    it has one, else 64 × 128 tiles with K split until ~_SKINNY_PROGRAMS programs."""
    found = tuned_table(device_name(), table).get(table_key(n, k, gated))
    if found is not None:
        return found
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    tiles_n = triton.cdiv(n, block_n) * (2 if gated else 1)  # weight tiles across n
    split = max(1, min(k_tiles, _SKINNY_PROGRAMS // tiles_n))
    k_steps = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_steps)
    pre = 1
    while pre * 2 <= k_steps and pre * 2 * block_n * block_k * (2 if gated else 1) <= \
            _PREFETCH_ELEMENTS:
        pre *= 2
    return SkinnyConfig(block_n, block_k, k_steps, split, pre, 4, 4 if k_steps >= 8 else 3)


def _split_buffers(out: torch.Tensor, grid: tuple, split: int, width: int):
    """The float32 K slices [split, rows, width] and tile counters of a product over grid
    (n blocks, split, row blocks); unused (out) without a split."""
    if split == 1:
        return out, out
    parts = torch.empty(split * out.shape[0] * width, dtype=torch.float32, device=out.device)
    return parts, tile_counters(out.device, grid[0] * grid[2])


def skinny_linear(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                  cfg: SkinnyConfig, ss: torch.Tensor | None = None, eps: float = 0.0,
                  residual: torch.Tensor | None = None, silu_x: bool = False,
                  kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """x2 [rows, k] @ w^T through `skinny_kernel` with launch parameters cfg (see there for
    gated). ss [rows, tiles] (float32, from a product with a residual): each row of the product
    scaled by the row's 1 / rms (eps inside the root), the RMSNorm whose weight is folded into w.
    residual [rows, n] (contiguous rows): the product is added into it instead, and the result's
    sums of squares over each column tile, [rows, tiles], are returned. silu_x: x2 is
    [rows, 2 k], an MLP's gate and up, and the product's input SiLU(gate) · up of it."""
    rows, k = x2.shape[0], w.shape[1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = residual if residual is not None else torch.empty(rows, n, dtype=x2.dtype,
                                                             device=x2.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split, triton.cdiv(rows, 16))
    parts, counters = _split_buffers(out, grid, cfg.split, 2 * n if gated else n)
    ss_out = (torch.empty(rows, grid[0], dtype=torch.float32, device=x2.device)
              if residual is not None else out)
    skinny_kernel[grid](
        x2, w, bias if bias is not None else w, out, parts, counters,
        ss if ss is not None else out, ss_out, eps, rows, n, k, x2.stride(0),
        w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        GATED=gated, SPLIT=cfg.split, K_STEPS=cfg.k_steps,
        PRE_STEPS=cfg.pre_steps, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_M=16, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        SCALE_TILES=0 if ss is None else ss.shape[1], ADD_RESIDUAL=residual is not None,
        SILU_X=silu_x, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x2, kc))
    return ss_out if residual is not None else out


# Weight-only int4 / int8 products of up to QUANT_MAX_ROWS rows (the formats of
# flashdraft.backends.formats): `skinny_quant_kernel`, launched like the bf16 products but with
# the K tile fixed to a group of 128 and wider column blocks (an int4 tile of 64 × 128 is only
# 4 KB): 256 columns, 4 warps, ~256 programs, measured fastest on an H200 (docs/kernels.md).
QUANT_MAX_ROWS = 64
QUANT_BLOCK_N = 256
QUANT_WARPS = 4
_MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}


@functools.cache
def _nibble_asm(magic: int, high: bool, scaled: bool = False) -> str:
    """PTX: four uint8 codes (one 32-bit register) -> four 16-bit floats magic | nibble (two
    registers); a byte permute and one logic op make two floats (Marlin's trick). scaled: then
    (that - 136) · s + z for bfloat16, s and z given as two registers each, on pairs (exact up
    to the FMA's one rounding)."""
    shift = "shr.b32 r, $2, 4;" if high else "mov.b32 r, $2;"
    m = f"0x{magic:04X}{magic:04X}"
    code = (f"{shift} prmt.b32 a, r, 0, 0x4140; prmt.b32 b, r, 0, 0x4342; "
            f"lop3.b32 a, a, 0x000F000F, {m}, 0xEA; lop3.b32 b, b, 0x000F000F, {m}, 0xEA; ")
    if not scaled:
        return "{ .reg .b32 r, a, b; " + code + "mov.b32 $0, a; mov.b32 $1, b; }"
    if magic != 0x4300:  # s and z are stored bf16: the pairs' FMAs need the model's dtype
        raise ValueError("the scaled PTX conversion is for bfloat16 models only")
    return ("{ .reg .b32 r, a, b, one, off; " + code + "mov.b32 one, 0x3F803F80; "
            "mov.b32 off, 0xC308C308; fma.rn.bf16x2 a, a, one, off; "  # 128 + q - 136
            "fma.rn.bf16x2 b, b, one, off; fma.rn.bf16x2 $0, a, $3, $5; "
            "fma.rn.bf16x2 $1, b, $4, $6; }")


@functools.cache
def quant_config(n: int, k: int, block_n: int = 0, programs: int = 0) -> SkinnyConfig:
    """Launch parameters of `skinny_quant_kernel` for an [n, k] weight (int4: k a multiple of
    128): a function of the shape only, as `skinny_config`."""
    block_n = block_n or QUANT_BLOCK_N
    groups, tiles_n = triton.cdiv(k, 128), triton.cdiv(n, block_n)
    split = max(1, min(groups, (programs or _SKINNY_PROGRAMS) // tiles_n))
    k_steps = triton.cdiv(groups, split)
    split = triton.cdiv(groups, k_steps)
    return SkinnyConfig(block_n, 128, k_steps, split, 1, QUANT_WARPS, 4 if k_steps >= 8 else 3)


def quant_linear(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, bias: torch.Tensor | None, n: int,
                 cfg: SkinnyConfig | None = None, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """x2 [rows, k] (contiguous rows) @ W^T + bias for a weight-only quantized W: int4 when
    zero is given (qweight [k/2, n] uint8, scale and zero [k/128, n]), else int8 (qweight
    [k, n] int8, scale [n]; either may be a transposed view of an [n, k] tensor).
    int4 codes become 16-bit floats by a bit-or (four at a time, in inline PTX; Triton ops
    under the interpreter, bit for bit the same). In bfloat16 each weight is then dequantized
    in full, (q - 8) · s + z, in paired FMAs, so that the tensor cores sum every group into one
    accumulator; float16 (whose FMAs cannot take the bf16 scales) applies scale and zero to
    each group's sums; float32 converts integers."""
    rows, k = x2.shape
    bits = 4 if zero is not None else 8
    magic_bits = _MAGIC.get(x2.dtype, 0) if bits == 4 else 0
    scaled = x2.dtype == torch.bfloat16 and bits == 4
    asm = bool(magic_bits) and not INTERPRET
    cfg = cfg or quant_config(n, k)
    out = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split, triton.cdiv(rows, 16))
    parts, counters = _split_buffers(out, grid, cfg.split, n)
    skinny_quant_kernel[grid](
        x2, qweight, scale, zero if zero is not None else scale,
        bias if bias is not None else scale, out, parts, counters, rows, n, k, x2.stride(0),
        qweight.stride(1), qweight.stride(0), out.stride(0), BITS=bits,
        MAGIC=magic_bits, SCALED=scaled,
        ASM_LO=_nibble_asm(magic_bits, False, scaled) if asm else "",
        ASM_HI=_nibble_asm(magic_bits, True, scaled) if asm else "",
        HAS_BIAS=bias is not None, SPLIT=cfg.split, K_STEPS=cfg.k_steps,
        BLOCK_N=cfg.block_n, BLOCK_M=16,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x2, kc))
    return out


def _skinny_serves(x: torch.Tensor, module: torch.nn.Module, kc: KernelConfig) -> bool:
    rows = x.numel() // x.shape[-1]
    return type(module) is torch.nn.Linear and use_triton(x, kc) and rows <= SKINNY_MAX_ROWS


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(w: torch.Tensor, gated: bool, kc: KernelConfig) -> SkinnyConfig:
    """The skinny kernel's launch parameters for weight w (with gated: a [gate; up] weight).
    The tuned table holds 16-bit launches (float32 tiles need twice the shared memory), so
    float32 takes the shape rule."""
    table = "off" if w.dtype == torch.float32 else kc.tuned_table
    return skinny_config(w.shape[0] // 2 if gated else w.shape[0], w.shape[1], gated, table)


def _gates(w: torch.Tensor) -> bool:
    """Whether the skinny kernel computes SiLU(gate) · up itself for a [gate; up] weight w."""
    return gated_for(w.shape[0] // 2)


def linear(x: torch.Tensor, module: torch.nn.Module, kc: KernelConfig = DEFAULT
           ) -> torch.Tensor:
    """module(x); for a plain nn.Linear and at most SKINNY_MAX_ROWS rows, `skinny_kernel`."""
    if not _skinny_serves(x, module, kc):
        return module(x)
    w = module.weight
    out = skinny_linear(_rows(x), w, module.bias, False, _launch(w, False, kc), kc=kc)
    return out.view(*x.shape[:-1], w.shape[0])


def gated_linear(x: torch.Tensor, module: torch.nn.Module, kc: KernelConfig = DEFAULT
                 ) -> torch.Tensor:
    """SiLU(gate) · up of module(x) = [gate, up] (the MLP's first product and its activation);
    for a plain nn.Linear and at most SKINNY_MAX_ROWS rows, one `skinny_kernel` where
    `gated_for` the width, else `linear` then `silu_mul`; a layer with its own
    (`forward_gated`: quant.QuantLinear) computes it."""
    fused = getattr(module, "forward_gated", None)
    if fused is not None:
        return fused(x)
    if not (_skinny_serves(x, module, kc) and _gates(module.weight)):
        return silu_mul(linear(x, module, kc), kc)
    w = module.weight
    out = skinny_linear(_rows(x), w, module.bias, True, _launch(w, True, kc), kc=kc)
    return out.view(*x.shape[:-1], w.shape[0] // 2)


def norm_linear(delta: torch.Tensor | None, residual: torch.Tensor, norm: torch.nn.Module,
                module: torch.nn.Module, gated: bool = False, kc: KernelConfig = DEFAULT
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the norm and the product that follows them: returns
    (module(norm(residual + delta)), residual + delta), or with `gated` SiLU(gate) · up of that
    product; delta None: no add. norm: an RMSNorm (weight, eps). `rms_norm` adds delta into
    residual in place (one kernel with the norm), then the product."""
    h = rms_norm(residual if delta is None else delta, norm.weight, norm.eps,
                 None if delta is None else residual, kc)
    return (gated_linear(h, module, kc) if gated else linear(h, module, kc)), residual


# SiLU · up of an MLP whose gate/up product does not compute it itself (`gated_for`) computed by
# the down product as it loads its input (`_x_tile`), not by a kernel of its own, where the
# norms are folded (`scaled_linear` hands on a `SiluPending`, `add_linear` takes it): the same
# bits, one kernel a layer fewer (H200: the 1.5B's decode level, the 0.5B's ~1 % faster).


class SiluPending(NamedTuple):
    """SiLU(gate) · up of gate_up [..., 2 n] (gate first), not computed yet: `add_linear`
    computes it inside the down product; `value()` anywhere else."""
    gate_up: torch.Tensor
    kc: KernelConfig = DEFAULT

    def value(self) -> torch.Tensor:
        return silu_mul(self.gate_up, self.kc)


# Each RMSNorm of a decoder block folded into the product after it (its weight into the
# product's, `model.Transformer.fold_norms`), and each residual add into the product before it:
# the norms run no kernel of their own where the skinny kernel serves both products (decode,
# verification, drafting). The loaders fold unquantized models (`loading.load_model`).


def folds_norm(x: torch.Tensor, module: torch.nn.Module, kc: KernelConfig = DEFAULT) -> bool:
    """Whether `scaled_linear` and `add_linear` run as one kernel for x and module (else the
    caller takes `norm_linear`)."""
    return _skinny_serves(x, module, kc)


def scaled_linear(x: torch.Tensor, ss: torch.Tensor, eps: float, module: torch.nn.Module,
                  gated: bool = False, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """module(RMSNorm(x)), or with `gated` SiLU(gate) · up of it, for a module whose weight has
    the norm's weight folded in (so the norm is a scale of each row by 1 / rms, applied to the
    product). ss: the rows' sums of squares of x, [rows, tiles] float32 added along tiles
    (`add_linear`). One `skinny_kernel` where `folds_norm` (then `silu_mul` with gated,
    unless `gated_for` the width)."""
    if not folds_norm(x, module, kc):
        return scaled_linear_reference(x, ss, eps, module, gated, kc)
    w = module.weight
    fused = gated and _gates(w)
    out = skinny_linear(_rows(x), w, module.bias, fused, _launch(w, fused, kc), ss=ss, eps=eps,
                        kc=kc)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return SiluPending(out, kc) if gated and not fused else out


def add_linear(x: torch.Tensor | SiluPending, module: torch.nn.Module,
               residual: torch.Tensor, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """residual += module(x), in place (rounded as the separate add would be); returns the
    sums of squares of residual's rows, [rows, tiles] float32, for `scaled_linear`. One
    `skinny_kernel` where `folds_norm`, which computes a SiluPending x as it loads it."""
    silu = isinstance(x, SiluPending)
    if not (folds_norm(x.gate_up if silu else x, module, kc) and residual.is_contiguous()):
        return add_linear_reference(x.value() if silu else x, module, residual, kc)
    w = module.weight
    return skinny_linear(_rows(x.gate_up if silu else x), w, module.bias, False,
                         _launch(w, False, kc), residual=residual.view(-1, w.shape[0]),
                         silu_x=silu, kc=kc)


def silu_mul(gate_up: torch.Tensor, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """SiLU(gate) · up for gate_up [..., 2 n] (gate first): [..., n]."""
    if not use_triton(gate_up, kc):
        return silu_mul_reference(gate_up)
    n = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, n, x2.stride(0), out.stride(0),
                                                           BLOCK=block, num_warps=4,
                                                           **pdl_options(gate_up, kc))
    return out.view(*gate_up.shape[:-1], n)
