"""Dequantization of GGML block formats in plain torch, so it runs wherever the bytes are
(CPU at load time, or a CUDA tensor).

Each format stores a tensor's rows as blocks of `block_size` weights in `type_size` bytes.
The layouts follow ggml-quants.c; `gguf.quants` (numpy) is the reference in the tests.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# Weights dequantized per chunk, which bounds the temporaries whatever the tensor's size. On
# CPU a few MB of them stay in cache from one pass to the next (1M runs ~1.5x faster than
# 16M); on a GPU big chunks amortise the kernel launches (an H200 does ~50G weights/s at 16M,
# ~4G/s at 1M).
CHUNK_WEIGHTS_CPU = 1 << 20
CHUNK_WEIGHTS_GPU = 1 << 24


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian half floats -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., m] uint8 -> [n, ..., 2, m]: low nibbles of all m bytes, then the high ones."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """[n, ..., m] uint8 -> [n, ..., 8 // width, m]: fields of `width` bits, lowest first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


# Byte -> its 8 bits, lowest first. Q5_0 / Q5_1 keep one bit per weight in 4 bytes; unpacking
# them by table lookup rather than by shifting rows only 4 bytes wide makes Q5_0 ~2x faster.
_BYTE_BITS = ((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1).to(torch.uint8)


def _q5_weights(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: high bits [n, 4] (bit i for weight i) and nibbles [n, 16] -> q [n, 32]."""
    high = _BYTE_BITS.to(qh.device)[qh.long()].view(-1, 32)
    return _nibbles(qs).view(-1, 32) | (high << 4)


# Each function below dequantizes blocks `b` [n, type_size] (uint8) into `out`
# [n, block_size] (float32). Integer parts stay integers until the last multiply, which
# converts them on the fly and rounds exactly where ggml's reference does.

def _q8_0(b: torch.Tensor, out: torch.Tensor):
    torch.mul(b[:, 2:].view(torch.int8), _f16(b[:, :2]), out=out)


def _q4_0(b: torch.Tensor, out: torch.Tensor):
    q = _nibbles(b[:, 2:]).view(-1, 32).view(torch.int8) - 8
    torch.mul(q, _f16(b[:, :2]), out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor):
    torch.mul(_nibbles(b[:, 4:]).view(-1, 32), _f16(b[:, :2]), out=out)
    out.add_(_f16(b[:, 2:4]))


def _q5_0(b: torch.Tensor, out: torch.Tensor):
    q = _q5_weights(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
    torch.mul(q, _f16(b[:, :2]), out=out)


def _q5_1(b: torch.Tensor, out: torch.Tensor):
    torch.mul(_q5_weights(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), out=out)
    out.add_(_f16(b[:, 2:4]))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes [n, 12] -> 6-bit scales and mins of the 8 sub-blocks, [n, 8] each.

    Sub-blocks 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7 take 4 low bits from a nibble of bytes 8-11 and 2 high bits from the
    top of bytes 0-3 / 4-7.
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_affine(b: torch.Tensor, q: torch.Tensor, out: torch.Tensor):
    """Q4_K / Q5_K: weight = d * scale * q - dmin * min, per sub-block of 32. q: [n, 8, 32]."""
    scales, mins = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * scales).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(b[:, 2:4]) * mins).unsqueeze(-1)
    out = out.view(-1, 8, 32)
    torch.mul(q, d, out=out)
    out.sub_(dm)


def _q4_k(b: torch.Tensor, out: torch.Tensor):
    # 128 bytes of nibbles in 4 runs of 32: each run holds sub-block 2i (low) and 2i+1 (high).
    _k_affine(b, _nibbles(b[:, 16:].reshape(-1, 4, 32)).view(-1, 8, 32), out)


def _q5_k(b: torch.Tensor, out: torch.Tensor):
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).view(-1, 8, 32)
    high = _bits(b[:, 16:48], 1)  # [n, 8, 32]: bit i of byte j is weight j of sub-block i
    _k_affine(b, low | (high << 4), out)


def _q6_k(b: torch.Tensor, out: torch.Tensor):
    # Two halves of 128 weights; each half takes 64 bytes of low nibbles and 32 bytes of
    # 2-bit high parts, in runs of 32 weights.
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).view(-1, 2, 4, 32)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 2)  # [n, 2, 4, 32]
    q = (low | (high << 4)).view(-1, 16, 16).view(torch.int8) - 32
    scales = b[:, 192:208].view(torch.int8)  # [n, 16], one per 16 weights
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)  # [n, 16, 1]
    torch.mul(q, d, out=out.view(-1, 16, 16))


_BLOCK_DEQUANT = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
_FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = tuple(_FLOAT_TYPES) + tuple(_BLOCK_DEQUANT)


def dequantize(raw: np.ndarray | torch.Tensor, qtype: Q | int,
               shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes of one GGML tensor -> a new float32 tensor of `shape` (torch order), on raw's device.

    raw: uint8, the tensor's bytes in file order (any shape, contiguous).
    """
    qtype = Q(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGML type {qtype.name} is not supported; supported: "
                         f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
    raw = torch.as_tensor(raw).reshape(-1)
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize takes the tensor's bytes as uint8, got {raw.dtype}")
    n = int(np.prod(shape))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n % block_size or raw.numel() != n // block_size * type_size:
        raise ValueError(f"{raw.numel()} bytes do not hold a {qtype.name} tensor of shape "
                         f"{tuple(shape)} ({n // block_size * type_size} bytes)")
    if qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[qtype]).to(torch.float32, copy=True).reshape(shape)
    blocks = raw.view(-1, type_size)
    out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32, device=raw.device)
    chunk = CHUNK_WEIGHTS_CPU if raw.device.type == "cpu" else CHUNK_WEIGHTS_GPU
    step = max(1, chunk // block_size)
    fn = _BLOCK_DEQUANT[qtype]
    for i in range(0, blocks.shape[0], step):
        fn(blocks[i:i + step], out[i:i + step])
    return out.reshape(shape)
