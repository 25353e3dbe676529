"""Weight-only quantization of the model's linear layers: int8 per channel, int4 in groups of 128.

Decoding one sequence reads every weight once per step and does two flops per weight, so its
time is bytes of weights over memory bandwidth: int8 halves it against bf16, int4 quarters it
(plus one scale and one zero per 128 weights). Activations stay bf16/fp16; weights are
dequantized inside the matrix product, tile by tile, never materialised.

Formats (one place, shared by every path):
- int8: q [out, in] int8, symmetric per output channel: w ≈ q * scale[out].
- int4: asymmetric per group of 128 inputs, as in gpt-fast / torch's tinygemm:
  w ≈ (q - 8) * scale[g, out] + zero[g, out], q in [0, 15]. Stored packed as uint8
  [in / 2, out]: within each group of 128 inputs, byte i holds input i (low nibble) and input
  i + 64 (high nibble), so a kernel reads both halves of a group with contiguous loads.
  scale and zero are bf16.

Paths, chosen per layer at run time (`QuantLinear.backend`):
- "reference": dequantize the whole weight in PyTorch, then F.linear. Works everywhere (CPU);
  the definition the fast paths are tested against.
- "triton": one Triton kernel for 1 to 32 rows (split over K so that small layers still fill
  the GPU; deterministic: partial sums are added by one reduction, not by atomics).
- "tinygemm" (int4 only): torch's built-in `_weight_int4pack_mm` over its own packing.
- "hybrid" (int4 only): tinygemm for up to HYBRID_MAX_ROWS rows (plain decode), Triton above
  (verification); keeps both packings, so 0.5 byte per weight more memory.
`quantize_model(..., backend="auto")` picks triton on CUDA when Triton imports, else reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 128
MODES = ("int8", "int4")
BACKENDS = ("auto", "reference", "triton", "tinygemm", "hybrid")
# hybrid (int4): tinygemm up to this many rows, Triton above. Measured on an H200: tinygemm is
# ~2x faster for 1-2 rows and 2-4x slower from 8 rows on; the crossover lies at 4-8 rows.
HYBRID_MAX_ROWS = 2

try:  # Triton only where CUDA is present; the reference path everywhere else.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None
if triton is not None:
    from .kernels import _sum_slices_kernel  # the fixed-order sum of K slices


# -- quantize / dequantize (reference definitions) -------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> q [out, in] int8, scale [out] float32."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """q [out, in] int8, scale [out] -> w [out, in] of dtype."""
    return (q.float() * scale[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float (in a multiple of 128) -> packed [in/2, out] uint8,
    scale [in/128, out] bf16, zero [in/128, out] bf16.

    Scales and zeros are bf16 (as in tinygemm): 4 bytes per 128 weights instead of 8, and the
    codes are computed from the rounded values, so dequantization is exactly what was meant.
    """
    out_f, in_f = w.shape
    if in_f % GROUP:
        raise ValueError(f"int4 needs input features in multiples of {GROUP}, got {in_f}")
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [out, groups]
    scale = ((hi - lo) / 15.0).clamp_min(1e-6).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()  # q = 8 sits at the range's middle
    q = torch.round((g - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp_(0, 15)
    q = q.to(torch.uint8).permute(1, 2, 0)  # [groups, 128, out]
    packed = q[:, :GROUP // 2] | (q[:, GROUP // 2:] << 4)  # [groups, 64, out]
    return (packed.reshape(in_f // 2, out_f).contiguous(),
            scale.t().to(torch.bfloat16).contiguous(), zero.t().to(torch.bfloat16).contiguous())


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [in/2, out] uint8 -> q [out, in] uint8 in [0, 15]."""
    half, out_f = packed.shape
    p = packed.reshape(half * 2 // GROUP, GROUP // 2, out_f)
    q = torch.cat([p & 0xF, p >> 4], dim=1)  # [groups, 128, out]
    return q.reshape(half * 2, out_f).t()


def dequantize_int4(packed, scale, zero, dtype) -> torch.Tensor:
    """-> w [out, in] of dtype."""
    q = unpack_int4(packed).float()  # [out, in]
    out_f, in_f = q.shape
    s, z = scale.t().float()[..., None], zero.t().float()[..., None]
    w = (q.reshape(out_f, in_f // GROUP, GROUP) - 8) * s + z
    return w.reshape(out_f, in_f).to(dtype)


# -- the Triton kernel ------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _wo_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
                          stride_xm, stride_wk, stride_os, stride_om,
                          K_STEPS: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # x [M, K]; w int8 [K, N] (BITS 8) or packed uint8 [K/2, N] (BITS 4);
        # out [split, M, N]: program (n, s) sums K blocks s * K_STEPS … (s + 1) * K_STEPS - 1
        # (those past K are masked), stored in out's dtype.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m[:, None] < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, K_STEPS):
            k0 = (pid_k * K_STEPS + i) * BLOCK_K
            k_ok = k0 < K
            if BITS == 8:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_ok & k_ok, other=0.0)
                w = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :],
                            mask=n_ok[None, :] & k_ok, other=0)
                acc += tl.dot(x, w.to(x.dtype))
            else:  # BLOCK_K == GROUP: one scale and zero per column for the whole tile
                offs_h = tl.arange(0, BLOCK_K // 2)
                packed = tl.load(w_ptr + (k0 // 2 + offs_h)[:, None] * stride_wk + offs_n[None, :],
                                 mask=n_ok[None, :] & k_ok, other=0)
                g = k0 // BLOCK_K
                s = tl.load(s_ptr + g * N + offs_n, mask=n_ok & k_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * N + offs_n, mask=n_ok & k_ok, other=0.0).to(tl.float32)
                x_lo = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_h)[None, :],
                               mask=m_ok & k_ok, other=0.0)
                x_hi = tl.load(x_ptr + offs_m[:, None] * stride_xm
                               + (k0 + BLOCK_K // 2 + offs_h)[None, :], mask=m_ok & k_ok,
                               other=0.0)
                w_lo = ((packed & 0xF).to(tl.float32) - 8.0) * s[None, :] + z[None, :]
                w_hi = ((packed >> 4).to(tl.float32) - 8.0) * s[None, :] + z[None, :]
                acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
                acc += tl.dot(x_hi, w_hi.to(x_lo.dtype))
        if BITS == 8:
            acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok & n_ok[None, :])

    @triton.jit
    def _wo_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wk, stride_os,
                        K_STEPS: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        # One row: x [K]; w as in _wo_matmul_kernel; out [split, N]. No tensor cores: products
        # accumulate elementwise in a [BLOCK_K(/2), BLOCK_N] tile, reduced over K once at the
        # end, and the int4 scale and zero are applied once per group and column:
        # sum_k x_k ((q_k - 8) s + z) = s · sum_k x_k q_k + (z - 8 s) · sum_k x_k.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if BITS == 8:
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_K // 2, BLOCK_N), dtype=tl.float32)
        for i in range(0, K_STEPS):
            k0 = (pid_k * K_STEPS + i) * BLOCK_K
            k_ok = k0 < K
            if BITS == 8:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :],
                            mask=n_ok[None, :] & k_ok, other=0)
                acc += x[:, None] * w.to(tl.float32)
            else:
                offs_h = tl.arange(0, BLOCK_K // 2)
                packed = tl.load(w_ptr + (k0 // 2 + offs_h)[:, None] * stride_wk + offs_n[None, :],
                                 mask=n_ok[None, :] & k_ok, other=0)
                g = k0 // BLOCK_K
                s = tl.load(s_ptr + g * N + offs_n, mask=n_ok & k_ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * N + offs_n, mask=n_ok & k_ok, other=0.0).to(tl.float32)
                x_lo = tl.load(x_ptr + k0 + offs_h, mask=k_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + k0 + BLOCK_K // 2 + offs_h, mask=k_ok,
                               other=0.0).to(tl.float32)
                xq = (x_lo[:, None] * (packed & 0xF).to(tl.float32)
                      + x_hi[:, None] * (packed >> 4).to(tl.float32))
                acc += s[None, :] * xq + (z - 8.0 * s)[None, :] * (x_lo + x_hi)[:, None]
        y = tl.sum(acc, axis=0)
        if BITS == 8:
            y = y * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        tl.store(out_ptr + pid_k * stride_os + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


_SMS: dict[int, int] = {}
# Launch parameters of the kernel; benchmarks/gpu_fastpath.py sweeps them on the machine.
TRITON_CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 4,
                 # Modes whose one-row products (plain decode) use the tensor-core-free GEMV
                 # kernel: measured faster for int4 on large layers (4096x24576: 52.7 against
                 # 61.2 us), slower for int8 (83.1 against 46.8 us).
                 "gemv_modes": ("int4",), "gemv_block_n": 128, "gemv_warps": 8}


def triton_matmul(x: torch.Tensor, layer: "QuantLinear", block_n: int | None = None,
                  split: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, gemv: bool | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64) -> [M, N] in x's dtype, through the Triton kernel.

    A decode-sized product has too few output blocks to fill the GPU, so K is split into
    slices (about `programs_per_sm` programs a multiprocessor in all); the float32 partial
    sums are added by a second small kernel in a fixed order, so results are deterministic.
    """
    m, k = x.shape
    if gemv is None:
        gemv = layer.mode in TRITON_CONFIG["gemv_modes"]
    gemv = gemv and m == 1
    block_n = block_n or TRITON_CONFIG["gemv_block_n" if gemv else "block_n"]
    num_warps = num_warps or TRITON_CONFIG["gemv_warps" if gemv else "num_warps"]
    num_stages = num_stages or TRITON_CONFIG["num_stages"]
    n = layer.out_features
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    n_blocks = triton.cdiv(n, block_n)
    steps = k // GROUP
    if split is None:
        dev = x.device.index or 0
        if dev not in _SMS:
            _SMS[dev] = torch.cuda.get_device_properties(x.device).multi_processor_count
        want = TRITON_CONFIG["programs_per_sm"] * _SMS[dev]
        split = max(1, min(triton.cdiv(want, n_blocks), steps // 2))
    k_steps = triton.cdiv(steps, split)
    split = triton.cdiv(steps, k_steps)  # no slice left without work
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    partial = out.unsqueeze(0) if split == 1 else \
        torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    bits = 8 if layer.mode == "int8" else 4
    zero = layer.zero if bits == 4 else layer.scale
    if gemv:
        _wo_gemv_kernel[(n_blocks, split)](
            x, layer.qweight, layer.scale, zero, partial, n, k, layer.qweight.stride(0),
            partial.stride(0), K_STEPS=k_steps, BITS=bits, BLOCK_N=block_n, BLOCK_K=GROUP,
            num_warps=num_warps, num_stages=num_stages)
    else:
        _wo_matmul_kernel[(n_blocks, split)](
            x, layer.qweight, layer.scale, zero, partial, m, n, k,
            x.stride(0), layer.qweight.stride(0), partial.stride(0), partial.stride(1),
            K_STEPS=k_steps, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
            num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        total = m * n
        _sum_slices_kernel[(triton.cdiv(total, 1024),)](partial, partial, out, total, n,
                                                         SPLIT=split, HAS_BIAS=False,
                                                         BLOCK=1024, USE_PDL=False)
    return out


# -- the layer ----------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A drop-in for nn.Linear with weight-only int8 or int4 weights."""

    def __init__(self, linear: nn.Linear, mode: str, backend: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
        if backend not in BACKENDS:
            raise ValueError(f"quantization backend {backend!r} is not one of {', '.join(BACKENDS)}")
        w = linear.weight.detach()
        self.mode, self.in_features, self.out_features = mode, w.shape[1], w.shape[0]
        self.dtype = w.dtype
        if mode == "int4" and self.in_features % GROUP:
            raise ValueError(f"int4 needs input features in multiples of {GROUP}; this layer "
                             f"has {self.in_features}: use int8 for this model")
        with torch.no_grad():
            if mode == "int8":
                q, scale = quantize_int8(w)
                # Stored [in, out] so that a kernel's loads run along out (coalesced).
                self.register_buffer("qweight", q.t().contiguous())  # [in, out] int8
                self.register_buffer("scale", scale)  # [out] float32
                self.zero = None
            else:
                packed, scale, zero = quantize_int4(w)
                self.register_buffer("qweight", packed)  # [in/2, out] uint8
                self.register_buffer("scale", scale)  # [in/128, out] bf16
                self.register_buffer("zero", zero)  # [in/128, out] bf16
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self._tinygemm = None
        if backend == "auto":
            # The kernel walks K in whole blocks of 128.
            fits = triton is not None and w.is_cuda and self.in_features % GROUP == 0
            backend = "triton" if fits else "reference"
        if backend == "triton" and (triton is None or not w.is_cuda or self.in_features % GROUP):
            raise ValueError(f"the triton quantization backend needs CUDA, Triton and input "
                             f"features in multiples of {GROUP} (this layer: {self.in_features}); "
                             f"use backend='reference' or 'auto'")
        if backend in ("tinygemm", "hybrid"):
            if mode != "int4" or not w.is_cuda or (backend == "hybrid" and triton is None):
                raise ValueError(f"the {backend} backend is int4 on CUDA only (hybrid needs "
                                 f"Triton too); use backend='auto'")
            self._tinygemm = _tinygemm_pack(self.qweight, self.scale, self.zero)
        self.backend = backend

    def dequantized(self, dtype=None) -> torch.Tensor:
        """The weight the layer computes with, [out, in]."""
        dtype = dtype or self.dtype
        if self.mode == "int8":
            return dequantize_int8(self.qweight.t(), self.scale, dtype)
        return dequantize_int4(self.qweight, self.scale, self.zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.backend == "reference" or x2.shape[0] > 64:
            # Prefill: compute-bound, so dequantizing the weight once is cheap next to it.
            y = F.linear(x2, self.dequantized(x.dtype))
        elif self.backend == "tinygemm" or (self.backend == "hybrid"
                                            and x2.shape[0] <= HYBRID_MAX_ROWS):
            packed, scales_zeros = self._tinygemm
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), packed, GROUP, scales_zeros)
        else:
            y = triton_matmul(x2.contiguous(), self)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.mode}, backend={self.backend}"


def _tinygemm_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Our int4 format -> torch's `_weight_int4pack_mm` operands (its own tile layout)."""
    q = unpack_int4(packed).to(torch.int32)  # [out, in]
    as_bytes = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [out, in/2], even input high
    tiles = torch.ops.aten._convert_weight_to_int4pack(as_bytes.contiguous(), 8)
    scales_zeros = torch.stack([scale, zero], dim=-1).contiguous()  # [groups, out, 2] bf16
    return tiles, scales_zeros


def quantize_model(model: nn.Module, mode: str, backend: str = "auto",
                   include_lm_head: bool = True) -> nn.Module:
    """Replace the model's nn.Linear layers by QuantLinear, in place; returns the model.

    Run after loading (bf16/fp16 checkpoints, or GGUF dequantized at load). Embeddings and
    norms stay as they are. A tied LM head gets its own quantized copy; the embedding table
    keeps its full-precision weights.
    """
    if mode not in MODES:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
    # Names first, modules one at a time: each full-precision weight is freed as soon as its
    # replacement exists, so the peak is the model plus one layer, not two models.
    targets = [(name.rpartition(".")[0], name.rpartition(".")[2])
               for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and (include_lm_head or name != "lm_head")]
    for parent_name, child_name in targets:
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, QuantLinear(getattr(parent, child_name), mode, backend))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads for the model's matrices (embedding rows excluded: one row a
    token), counting what each layer actually reads: quantized weights with their scales."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            if module.backend == "tinygemm":
                tensors = list(module._tinygemm)
            elif module.backend == "hybrid":  # what a one-row (decode) product reads
                tensors = list(module._tinygemm)
            else:
                tensors = [module.qweight, module.scale] + ([module.zero] if module.zero is not None else [])
            total += sum(t.numel() * t.element_size() for t in tensors)
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        if isinstance(module, (nn.Linear, QuantLinear)) and module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
    return total


@torch.no_grad()
def quality_report(reference_logits: torch.Tensor, quant_logits: torch.Tensor,
                   tokens: torch.Tensor) -> dict:
    """Logit error and perplexity of a quantized model against its unquantized self.

    *_logits: [1, T, vocab] over tokens [1, T]; perplexity scores tokens 1 … T-1.
    """
    ref, q = reference_logits.float(), quant_logits.float()
    rel = ((q - ref).norm() / ref.norm()).item()
    targets = tokens[0, 1:]
    ppl = lambda lg: torch.exp(F.cross_entropy(lg[0, :-1], targets)).item()
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"logit_rel_error": rel, "logit_max_abs_error": (q - ref).abs().max().item(),
            "top1_agreement": agree, "ppl_reference": ppl(ref), "ppl_quantized": ppl(q)}
