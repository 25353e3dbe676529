"""The gated delta rule of a decode or verification step in one Triton kernel.

A step of t tokens (1 … 32: a decode, or a verification of k + 1) through a Gated DeltaNet
layer runs, per value head, the recurrence of `flashdraft.hybrid` token by token:

    S ← exp(g_t) S;   S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);   o_t = Sᵀ q_t

The PyTorch reference (`hybrid.delta_rule_recurrent`, the definition) launches a handful of
kernels per token and copies each token's state into the ring; `delta_rule_step` does the whole
step in one launch. Each program owns one (batch row, value head) and a block of BLOCK_V of the
d_v columns of S [d_k, d_v]: the columns of S evolve independently (Sᵀ k and Sᵀ q reduce over
d_k only), so splitting d_v costs only the reloads of the token's q and k, and gives a decode
at batch 1 enough programs for the GPU (`block_v`: 48 heads × 8 blocks of 16 columns at
Qwen3.5-27B). The program keeps
its block of S in registers across the tokens, in float32, reads it once from the ring slot of
the state after the step's first position - 1, and writes the state after each token to that
token's slot, exactly where the PyTorch path writes it (`HybridCache.slots`): rollback and the
chunked prefill find the same states in the same places. The slots arrive as device tensors,
computed there from the step's positions, so that a CUDA graph of the step serves every
position. The read slot is loaded before any slot is written, and each program writes only its
own block, so a step as long as the ring (whose last slot is the one it read) is safe.

Fused, so that the layer hands over the projection's views as they are: the key head of each
value head (value head h reads key head h // group, no repeat_interleave), the conversion of
q, k and v to float32 on load, and with `scale` given the L2 norm of q and k and q's scale
(`hybrid.l2_normalize`, then · scale). β and g arrive computed (a few small kernels per layer,
not per token).

The arithmetic is the reference's in float32 with other orders of summation: outputs and
states agree to ~1e-6 relative, not bit for bit. The kernel is not specialised on t, and reads
the slots from memory: a new step length or ring position compiles nothing in the middle of a
request.
"""
from __future__ import annotations

import torch

from ..config import KernelConfig
from .kernels import DEFAULT, pdl_options, triton, use_triton

if triton is not None:
    import triton.language as tl

    from .kernels import _pdl_wait

# Longest step the kernel serves (a verification of up to 31 drafts); longer steps are
# prefills, which run the chunked form.
MAX_STEP = 32


def serves(x: torch.Tensor, t: int, kc: KernelConfig = DEFAULT) -> bool:
    """Whether `delta_rule_step` runs the kernel for a step of t tokens on tensors like x."""
    return t <= MAX_STEP and use_triton(x, kc)


def block_v(d_v: int, programs: int) -> int:
    """Columns of S per program: 32 (a [128, 32] float32 block is 32 registers a thread at 4
    warps), halved while fewer than ~256 programs would run (a decode at batch 1), never below
    16 nor above d_v rounded up to a power of two."""
    block = min(32, triton.next_power_of_2(d_v))
    while block > 16 and programs * triton.cdiv(d_v, block) < 256:
        block //= 2
    return block


if triton is not None:

    # Not specialised on the step's length (one compiled version for all).
    @triton.jit(do_not_specialize=["t"])
    def _delta_rule_step_kernel(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ring_ptr, read_ptr, write_ptr, out_ptr,
            t, v_heads, scale, eps,
            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
            stride_vb, stride_vh, stride_vt, stride_gb, stride_gh, stride_gt,
            stride_bb, stride_bh, stride_bt, stride_rb, stride_rs, stride_rh, stride_rk,
            stride_ob, stride_oh, stride_ot,
            GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_V: tl.constexpr, NORMALIZE: tl.constexpr,
            USE_PDL: tl.constexpr):
        _pdl_wait(USE_PDL)
        bh = tl.program_id(1)
        b = bh // v_heads
        h = bh - b * v_heads
        kh = h // GROUP
        rk = tl.arange(0, BLOCK_K)
        rv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok_k, ok_v = rk < DK, rv < DV
        ok = ok_k[:, None] & ok_v[None, :]
        cell = rk[:, None] * stride_rk + rv[None, :]  # S[k, v] within a slot's head
        ring = ring_ptr + b.to(tl.int64) * stride_rb + h * stride_rh
        read = tl.load(read_ptr)  # -1: a new sequence, from zeros
        state = tl.load(ring + tl.maximum(read, 0) * stride_rs + cell, mask=ok, other=0.0)
        state = tl.where(read >= 0, state, 0.0)
        q_row = q_ptr + b.to(tl.int64) * stride_qb + kh * stride_qh
        k_row = k_ptr + b.to(tl.int64) * stride_kb + kh * stride_kh
        v_row = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
        out_row = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
        g_row = g_ptr + b * stride_gb + h * stride_gh
        beta_row = beta_ptr + b * stride_bb + h * stride_bh
        for i in range(t):
            q = tl.load(q_row + i * stride_qt + rk, mask=ok_k, other=0.0).to(tl.float32)
            k = tl.load(k_row + i * stride_kt + rk, mask=ok_k, other=0.0).to(tl.float32)
            v = tl.load(v_row + i * stride_vt + rv, mask=ok_v, other=0.0).to(tl.float32)
            if NORMALIZE:
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
                k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
            decay = tl.exp(tl.load(g_row + i * stride_gt).to(tl.float32))
            beta = tl.load(beta_row + i * stride_bt).to(tl.float32)
            state = state * decay
            delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
            state = state + k[:, None] * delta[None, :]
            tl.store(out_row + i * stride_ot + rv, tl.sum(state * q[:, None], axis=0), mask=ok_v)
            tl.store(ring + tl.load(write_ptr + i) * stride_rs + cell, state, mask=ok)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, ring: torch.Tensor, read: torch.Tensor,
                    write: torch.Tensor,
                    scale: float | None = None, eps: float = 1e-6, block: int = 0,
                    kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """The gated delta rule over a step of t <= MAX_STEP tokens, as `hybrid.GatedDeltaNet`
    runs it with every position's state kept (`StepSlots.kept`).

    q, k: [batch, k_heads, t, d_k] (value head h reads key head h // (v_heads / k_heads)); with
    scale None already L2-normalised and q scaled, else normalised here (eps inside the root)
    and q multiplied by scale. v: [batch, v_heads, t, d_v]; g, beta: [batch, v_heads, t]. Any
    dtype, any strides but a unit last one. ring: [batch, steps, v_heads, d_k, d_v] float32
    (contiguous in its last two dimensions): the state is read from slot `read` (int64 [1] on
    the ring's device; -1: zeros, a new sequence) and the state after token i written to slot
    write[i] (int64 [t], distinct slots: `StepSlots.write`). block: columns of S per program
    (0: `block_v`'s choice).
    Returns the outputs [batch, v_heads, t, d_v] float32 (a view of a [batch, t, v_heads, d_v]
    tensor, the layout the output norm reads)."""
    b, k_heads, t, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[-1]
    if not 1 <= t <= MAX_STEP or write.shape != (t,):
        raise ValueError(f"delta_rule_step runs steps of 1 … {MAX_STEP} tokens with a slot "
                         f"for each, got {t} tokens and slots of shape {tuple(write.shape)}; "
                         f"longer steps run hybrid.delta_rule_chunked")
    for name, slots in (("read", read), ("write", write)):
        if slots.dtype != torch.int64 or slots.device != ring.device or not slots.is_contiguous():
            raise ValueError(f"the {name} slots must be a contiguous int64 tensor on the ring's "
                             f"device {ring.device} (HybridCache.slots), got {slots.dtype} on "
                             f"{slots.device}")
    if read.numel() != 1:
        raise ValueError(f"a step reads one slot, got read slots of shape {tuple(read.shape)}")
    if ring.dtype != torch.float32 or ring.stride(-1) != 1 or ring.stride(-2) != dv:
        raise ValueError(f"the ring must be float32 and contiguous in its last two dimensions "
                         f"(HybridCache.state[layer]), got {ring.dtype} with strides "
                         f"{ring.stride()}")
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {k_heads} key heads")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, t, v_heads, dv, dtype=torch.float32, device=v.device)
    block = block or block_v(dv, b * v_heads)
    grid = (triton.cdiv(dv, block), b * v_heads)
    _delta_rule_step_kernel[grid](
        q, k, v, g, beta, ring, read, write, out, t, v_heads, 1.0 if scale is None else scale,
        eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
        ring.stride(0), ring.stride(1), ring.stride(2), ring.stride(3),
        out.stride(0), out.stride(2), out.stride(1),
        GROUP=v_heads // k_heads, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block, NORMALIZE=scale is not None, num_warps=4,
        **pdl_options(v, kc))
    return out.transpose(1, 2)
