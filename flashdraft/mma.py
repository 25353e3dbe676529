"""int4 weight-only products on the tensor cores, in CUDA compiled at run time (NVRTC).

`csrc/int4_mma.cu` holds the kernels and the layout; this module packs flashdraft.quant's int4
format into that layout (once, at load), compiles the kernels on first use (torch's NVRTC
wrapper: no compiler, headers or build step beyond torch's CUDA build) and launches them.

- `pack_int4(packed, scale, zero)` -> (qweight, scales): the weights shuffled into the mma A
  operand's register layout, [n/16, groups, 2, 32, 4] int32, and each group's scale and zero
  beside each other, [n/16, groups, 8, 2] int32 (two bfloat16 each).
- `linear(x2, qweight, scales, bias, n)`: x2 [rows <= MAX_ROWS, k] bfloat16 @ W^T + bias,
  batch-invariant (see the .cu file's header).
- `dequantize(qweight, scales, n, k)`: W [n, k] bfloat16 (for prefill through cuBLAS).
- `unpack_int4(qweight)`: the codes [n, k] back, in PyTorch (reference, tests).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernels

GROUP = 128
MAX_ROWS = 32  # rows of x in blocks of 8: 1, 2 or 4 blocks
UNIT = 1088  # shared-memory bytes of a (16-feature tile, group) unit: 1 KB codes, 64 B scales
SOURCE = Path(__file__).with_name("csrc") / "int4_mma.cu"


def unavailable(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the mma kernels cannot serve this device and dtype, or None when they can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "it needs CUDA"
    if torch.version.cuda is None:
        return "it needs an NVIDIA GPU (CUDA, not ROCm)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "it needs an sm_80 or newer GPU (bfloat16 mma)"
    if dtype != torch.bfloat16:
        return f"it computes in bfloat16, not {dtype}"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no NVRTC wrapper (torch.cuda._compile_kernel)"
    return None


@functools.cache
def _kernel(name: str, row_blocks: int = 1, warps: int = 4, stages: int = 8):
    source = SOURCE.read_text()
    options = [f"-DNB={row_blocks}", f"-DWARPS={warps}", f"-DD={stages}"]
    try:
        return torch.cuda._compile_kernel(source, name, nvcc_options=options)
    except Exception as err:  # NVRTC's log says what failed
        raise RuntimeError(f"compiling {SOURCE.name}:{name} with NVRTC failed: {err}; "
                           f"use the 'triton' quantization backend") from err


# -- packing ------------------------------------------------------------------------------------

@functools.cache
def _layout(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature, input) within a (16-feature tile, group) of nibble i of word jj of lane of half
    h: two [2, 32, 4, 8] index tensors, as the .cu file's header defines them."""
    h = torch.arange(2).view(2, 1, 1, 1)
    lane = torch.arange(32).view(1, 32, 1, 1)
    jj = torch.arange(4).view(1, 1, 4, 1)
    i = torch.arange(8).view(1, 1, 1, 8)
    g, t = lane // 4, lane % 4
    feature = g + 8 * (i & 1)
    e = (i >> 2) + 2 * ((i >> 1) & 1)
    k = 8 * (8 * h + t + 4 * (jj >> 1)) + 4 * (jj & 1) + e
    return feature.expand(2, 32, 4, 8).to(device), k.expand(2, 32, 4, 8).to(device)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 of the same bits."""
    return (v - ((v >> 31) << 32)).to(torch.int32)


def pack_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """flashdraft.quant's int4 (packed [k/2, n] uint8, scale and zero [k/128, n] bf16) ->
    (qweight [n/16, k/128, 2, 32, 4] int32, scales [n/16, k/128, 8, 2] int32)."""
    from .quant import unpack_int4
    q = unpack_int4(packed)  # [n, k]
    n, k = q.shape
    if n % 16 or k % GROUP:
        raise ValueError(f"the mma layout needs out features in multiples of 16 and in features "
                         f"in multiples of {GROUP}; got {n} x {k}")
    tiles, groups = n // 16, k // GROUP
    feature, kin = _layout(q.device)
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    q4 = q.reshape(tiles, 16, groups, GROUP)
    out = torch.empty(tiles, groups, 2, 32, 4, dtype=torch.int32, device=q.device)
    for t0 in range(0, tiles, chunk):
        nib = q4[t0:t0 + chunk][:, feature, :, kin]  # [2, 32, 4, 8, c, groups]
        nib = nib.permute(4, 5, 0, 1, 2, 3).to(torch.int64)
        out[t0:t0 + chunk] = _as_int32((nib << shifts).sum(-1))
    bits = lambda v: v.view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
    words = _as_int32(bits(scale) | bits(zero) << 16)  # [groups, n]
    scales = words.reshape(groups, tiles, 2, 8).permute(1, 0, 3, 2).contiguous()
    return out, scales


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [n/16, groups, 2, 32, 4] int32 -> codes [n, k] uint8 in [0, 15]."""
    tiles, groups = qweight.shape[:2]
    feature, kin = _layout(qweight.device)
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int32)
    nib = (qweight[..., None] >> shifts) & 0xF  # [tiles, groups, 2, 32, 4, 8]
    q4 = torch.empty(tiles, 16, groups, GROUP, dtype=torch.uint8, device=qweight.device)
    q4[:, feature, :, kin] = nib.permute(2, 3, 4, 5, 0, 1).to(torch.uint8)
    return q4.reshape(tiles * 16, groups * GROUP)


def unpack_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scales [n/16, groups, 8, 2] int32 -> (scale, zero), each [groups, n] bfloat16."""
    tiles, groups = scales.shape[:2]
    words = scales.permute(1, 0, 3, 2).reshape(groups, tiles * 16).to(torch.int64) & 0xFFFFFFFF
    half = lambda v: (v - ((v >> 15) << 16)).to(torch.int16).view(torch.bfloat16)  # noqa: E731
    return half(words & 0xFFFF), half(words >> 16)


# -- launching ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaConfig:
    groups_per_split: int  # groups of 128 inputs a split of K (the last may be shorter)
    splits: int
    warps: int = 4  # a block
    stages: int = 8  # of each warp's ring
    blocks_per_sm: int = 4  # persistent blocks aimed at (shared memory permitting)


def config(n: int, k: int, groups_per_split: int = 8, **launch) -> MmaConfig:
    """Launch shape from the weight's shape alone (batch invariance): K in splits of
    groups_per_split groups, so that a block's x tile stays small for 32 rows."""
    groups = k // GROUP
    gps = min(groups_per_split, groups)
    return MmaConfig(gps, -(-groups // gps), **launch)


def _row_blocks(rows: int) -> int:
    return 1 if rows <= 8 else 2 if rows <= 16 else 4


def linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, n: int, cfg: MmaConfig | None = None) -> torch.Tensor:
    """x2 [rows, k] bfloat16 (rows <= MAX_ROWS) @ W^T + bias -> [rows, n] bfloat16."""
    rows, k = x2.shape
    if rows > MAX_ROWS or x2.dtype != torch.bfloat16:
        raise ValueError(f"the int4 mma kernel takes up to {MAX_ROWS} bfloat16 rows, "
                         f"got {rows} of {x2.dtype}")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()  # rows are read in 16-byte chunks
    cfg = cfg or config(n, k)
    nb = _row_blocks(rows)
    out = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    if cfg.splits > 1:
        parts = torch.empty(cfg.splits * rows * n, dtype=torch.float32, device=x2.device)
        counters = kernels._counters(x2.device, n // 16)
    else:
        parts, counters = out, out
    gps = cfg.groups_per_split
    shared = nb * 8 * (gps * GROUP + 32) * 2 + gps * nb * 8 * 4 + cfg.warps * cfg.stages * UNIT
    fn = _kernel("int4_mma", nb, cfg.warps, cfg.stages)
    _allow_shared(fn, shared)
    fn(grid=(_persistent_blocks(n // 16, cfg, shared, x2.device), cfg.splits, 1),
       block=(cfg.warps * 32, 1, 1),
       args=[qweight, scales, x2, bias if bias is not None else x2, out, parts, counters, rows,
             n, k, x2.stride(0), out.stride(0), gps, int(bias is not None)],
       shared_mem=shared)
    return out


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_blocks(tiles: int, cfg: MmaConfig, shared: int, device) -> int:
    """Blocks along n for each split: about blocks_per_sm a multiprocessor in all, with the
    tiles spread evenly over the warps. Which warp takes a tile changes no result."""
    per_sm = max(1, min(cfg.blocks_per_sm, (227 << 10) // max(shared, 1)))
    blocks = max(1, -(-_multiprocessors(device) * per_sm // cfg.splits))
    blocks = min(blocks, -(-tiles // cfg.warps))
    per_warp = -(-tiles // (blocks * cfg.warps))
    return -(-tiles // (cfg.warps * per_warp))


def _allow_shared(fn, nbytes: int) -> None:
    """Raise the kernel's dynamic shared-memory limit to nbytes where it is past 48 KB."""
    if nbytes >= 48 * 1024 and nbytes > getattr(fn, "_max_shared_mem_bytes", 0):
        fn.set_shared_memory_config(nbytes)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [n, k] bfloat16, each weight as the product kernel computes it."""
    out = torch.empty(n, k, dtype=torch.bfloat16, device=qweight.device)
    words = qweight.numel() // 4
    _kernel("int4_dequant")(grid=(-(-words // 256), 1, 1), block=(256, 1, 1),
                            args=[qweight, scales, out, n, k])
    return out
