"""The weight-only formats, defined once in PyTorch: int8 per output channel, int4 in groups
of 128 inputs (`quant`'s docstring describes the layouts). Every kernel that reads them is
tested against these definitions."""
from __future__ import annotations

import torch

GROUP = 128


# Weights are quantized in slices of rows of at most this many elements: each row is quantized
# on its own, so slicing changes no bit, and the float32 temporaries stay small (a 27B model's
# 2.5 GB output head would otherwise need ~15 GB of them on the GPU it is loaded onto).
_CHUNK_ELEMENTS = 1 << 26


def _by_rows(fn, w: torch.Tensor, dims: tuple[int, ...]):
    """fn(w) computed on slices of w's rows, the results of each joined along `dims` (one
    per output of fn: the dimension that runs over w's rows)."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1]))
    if w.shape[0] <= rows:
        return fn(w)
    parts = [fn(w[i:i + rows]) for i in range(0, w.shape[0], rows)]
    return tuple(torch.cat(p, dim=d) for p, d in zip(zip(*parts), dims))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> q [out, in] int8, scale [out] float32."""
    return _by_rows(_quantize_int8, w, (0, 0))


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    if w.shape[1] % GROUP:
        raise ValueError(f"int4 needs input features in multiples of {GROUP}, got {w.shape[1]}")
    return _by_rows(_quantize_int4, w, (1, 1, 1))


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_f, in_f = w.shape
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


