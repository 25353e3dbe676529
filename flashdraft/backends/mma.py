"""int4 weight-only products on the tensor cores, in CUDA compiled at run time (NVRTC).

`csrc/int4_mma.cu` holds the kernels and the layout; this module packs flashdraft.backends.quant's int4
format into that layout (once, at load), compiles the kernels on first use (torch's NVRTC
wrapper: no compiler, headers or build step beyond torch's CUDA build) and launches them.

- `pack_int4(packed, scale, zero)` -> (qweight, scales): the weights shuffled into the mma A
  operand's register layout, [n/16, groups, 2, 32, 4] int32, and each group's scale and zero
  beside each other, [n/16, groups, 8, 2] int32 (two bfloat16 each).
- `linear(x2, qweight, scales, bias, n)`: x2 [rows <= MAX_ROWS, k] bfloat16 @ W^T + bias,
  batch-invariant (see the .cu file's header); the compile-time constants below are the
  fastest measured.
- `dequantize(qweight, scales, n, k)`: W [n, k] bfloat16 (for prefill through cuBLAS).
- `linear(..., gated=True)`: SiLU(gate) · up of the MLP's [gate; up] product in the same kernel,
  its rows stored in `gate_up_order` (each tile's output features pair a gate with its up).
- `unpack_int4(qweight)`: the codes [n, k] back, in PyTorch (reference, tests).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernels
from ..config import KernelConfig
from . import formats
from .formats import GROUP

MAX_ROWS = 32  # rows of x in blocks of 8: 1, 2 or 4 blocks
TN = 4  # 16-feature tiles a block
GMAX = 4  # groups a warp holds in registers, all loaded before the wait for the previous kernel
WK = 2  # warps along K a tile where a split's groups all fit in its warps' registers (one-shot)
# Streamed splits: one warp a tile (STREAM_WK) takes a split of up to SPLIT_GROUPS groups (0: no
# streamed splits) through STREAM_SLOTS register slots (each loaded again as soon as its group is
# multiplied), with launch bounds for STREAM_RESIDENT blocks a multiprocessor for one row block.
# The launch rule (`config`) takes them wherever they still give TARGET_BLOCKS blocks: on the
# 32B int4 shape that made a layer's products 9 % faster than one-shot splits (H200). x's rows
# over a split are staged in shared memory, which bounds a split's length.
STREAM_WK = 1
SPLIT_GROUPS = 16
STREAM_SLOTS = 8
STREAM_RESIDENT = 2
# Each group's scale and zero are applied to its float32 sums (the .cu file's FOLD): the codes
# become operands with one lop3 a pair, half the instructions of dequantizing every weight.
# Resident blocks a multiprocessor that the one-row-block kernel's registers must allow (launch
# bounds; 4 spills a few bytes and was the fastest decode, 3 % over 1). Kernels for more rows
# keep 1 (4 spilled heavily: 2x slower for 32 rows). Registers change no result.
DECODE_RESIDENT = 4
# An MLP's [gate; up] layer is stored for the gated kernel (SiLU · up in the product's epilogue,
# one kernel fewer a layer).
CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "int4_mma.cu"


def cuda_source(path: Path) -> str:
    """A kernel's source as NVRTC compiles it: csrc/common.cuh (the helpers both kernels
    share), then the kernel's file. NVRTC takes one string and no headers."""
    return (CSRC / "common.cuh").read_text() + path.read_text()


# Splits of K chosen so that a product has at least this many blocks (two per SM on an H200).
TARGET_BLOCKS = 264


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
def _kernel(name: str, device: int, row_blocks: int = 1, tn: int = TN, wk: int = WK,
            gmax: int = GMAX, gated: bool = False, min_blocks: int = 1, stream: bool = False):
    """The compiled kernel, loaded into `device`'s context (a module belongs to one)."""
    source = cuda_source(SOURCE)
    options = [f"-DNB={row_blocks}", f"-DTN={tn}", f"-DWK={wk}", f"-DGMAX={gmax}",
               f"-DMIN_BLOCKS={min_blocks}", f"-DGATED={int(gated)}", f"-DSTREAM={int(stream)}"]
    try:
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(source, name, nvcc_options=options)
    except Exception as err:  # NVRTC's log says what failed
        raise RuntimeError(f"compiling {SOURCE.name}:{name} with NVRTC failed: {err}; "
                           f"use the 'triton' quantization backend") from err


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


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
    """flashdraft.backends.quant's int4 (packed [k/2, n] uint8, scale and zero [k/128, n] bf16) ->
    (qweight [n/16, k/128, 2, 32, 4] int32, scales [n/16, k/128, 8, 2] int32)."""
    q = formats.unpack_int4(packed)  # [n, k]
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


@functools.cache
def gate_up_order(n: int, device=None, inverse: bool = False) -> torch.Tensor:
    """Rows of a [gate; up] weight ([n, k], n / 2 gate rows first) in the gated kernel's order:
    tile j (16 rows) holds gate rows 8j .. 8j + 7, then up rows 8j .. 8j + 7 (the rows that
    make output columns 8j .. 8j + 7); weight[gate_up_order(n)] is the stored weight. inverse:
    the stored position of each row (stored[gate_up_order(n, inverse=True)] = weight)."""
    if n % 16:
        raise ValueError(f"the gated layout needs 2 x a multiple of 8 rows, got {n}")
    i = torch.arange(n, device=device)
    if inverse:
        j, up = i % (n // 2), i >= n // 2
        return 16 * (j // 8) + j % 8 + 8 * up
    tile, r = i // 16, i % 16
    return torch.where(r < 8, 8 * tile + r, n // 2 + 8 * tile + r - 8)


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
    groups_per_split: int  # a warp takes ceil(groups_per_split / wk) of them
    splits: int
    blocks_n: int  # blocks along n, tn tiles each
    tn: int  # 16-feature tiles a block
    wk: int  # warps along K a tile

    def __post_init__(self):
        if min(self.groups_per_split, self.splits, self.blocks_n, self.tn, self.wk) < 1:
            raise ValueError(f"{self}: every field is 1 or more")
        if self.tn * self.wk > 32:
            raise ValueError(f"{self}: tn * wk warps a block is at most 32 (1,024 threads)")


def _shared_bytes(rows: int, cfg: MmaConfig) -> int:
    """Dynamic shared memory of a launch: x's rows over a split, then the warps' sums."""
    nb = _row_blocks(rows)
    return rows * (cfg.groups_per_split * GROUP + 32) * 2 + cfg.tn * cfg.wk * nb * 4 * 32 * 4


# A block's dynamic shared memory on sm_90, 227 KB, less 1 KB for the static (sm_80: 163 KB, sm_86
# and sm_89: 99 KB; `linear` passes the GPU's own through shared_limit).
SHARED_LIMIT = 226 * 1024


@functools.cache
def shared_limit(device: int) -> int:
    """The dynamic shared memory a block of ours may opt in to on `device` (the kernel's static
    shared memory is a few bytes; 1 KB is kept for it)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024) - 1024


@functools.cache  # one per weight shape: the decode path asks on every call
def config(n: int, k: int, tn: int | None = None, wk: int | None = None,
           groups_per_split: int = 0, shared_limit: int = SHARED_LIMIT) -> MmaConfig:
    """Launch shape from the weight's shape and the GPU's shared memory alone (batch
    invariance): a streamed split of SPLIT_GROUPS or half that many groups with STREAM_WK warps
    a tile where that gives TARGET_BLOCKS blocks, else the longest one-shot split of WK warps
    that does (or the shortest); only splits whose x of MAX_ROWS rows fits in shared_limit bytes.
    tn defaults to TN; wk, given, restricts the rule to one-shot splits of wk warps, and
    groups_per_split, given, overrides the rule (with WK warps unless wk says). The module's
    settings are read once per shape: call config.cache_clear() after changing them."""
    tn = tn or TN
    groups, blocks_n = k // GROUP, -(-n // (16 * tn))

    def fits(gps: int, wk: int) -> bool:
        cfg = MmaConfig(gps, -(-groups // gps), blocks_n, tn, wk)
        return blocks_n * cfg.splits >= TARGET_BLOCKS and (
            _shared_bytes(MAX_ROWS, cfg) <= shared_limit)

    gps = groups_per_split
    if not gps and wk is None:  # streamed, where long splits still give enough blocks
        gps = next((min(g, groups) for g in (SPLIT_GROUPS, SPLIT_GROUPS // 2)
                    if g > STREAM_WK * GMAX and fits(min(g, groups), STREAM_WK)), 0)
        wk = STREAM_WK if gps else None
    wk = wk or WK
    if not gps:  # one-shot
        gps = next((g for g in (wk * GMAX, wk * GMAX // 2) if fits(g, wk)), wk)
    if gps < 1:
        raise ValueError(f"groups_per_split={gps}: a split holds one group or more")
    cfg = MmaConfig(gps, -(-groups // gps), blocks_n, tn, wk)
    if _shared_bytes(MAX_ROWS, cfg) > shared_limit:
        raise ValueError(f"groups_per_split={gps}: {MAX_ROWS} rows of x over a split must fit in "
                         f"{shared_limit} bytes of shared memory; use a shorter split")
    return cfg


def _row_blocks(rows: int) -> int:
    return 1 if rows <= 8 else 2 if rows <= 16 else 4


def check_packed(qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                  bias: torch.Tensor | None = None) -> None:
    """The kernels index the packed weight (pack_int4's layout) and the bias by n and k alone:
    a mismatch would read past them, so it is refused here."""
    tiles, groups = n // 16, k // GROUP
    ok = (n % 16 == 0 and k % GROUP == 0
          and tuple(qweight.shape) == (tiles, groups, 2, 32, 4)
          and tuple(scales.shape) == (tiles, groups, 8, 2)
          and all(t.dtype == torch.int32 and t.is_contiguous() for t in (qweight, scales))
          and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()
                                and bias.numel() == n)))
    if not ok:
        raise ValueError(
            f"an int4 mma weight of {n} x {k} needs qweight [{tiles}, {groups}, 2, 32, 4] and "
            f"scales [{tiles}, {groups}, 8, 2] (int32, contiguous: pack_int4's) and a bias of "
            f"{n} contiguous bfloat16 or none; got qweight {list(qweight.shape)} "
            f"{qweight.dtype}, scales {list(scales.shape)} {scales.dtype}, bias "
            f"{None if bias is None else (list(bias.shape), bias.dtype)}")


def linear(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None, n: int, cfg: MmaConfig | None = None,
           gated: bool = False, kc: KernelConfig = kernels.DEFAULT) -> torch.Tensor:
    """x2 [rows, k] bfloat16 (rows <= MAX_ROWS) @ W^T + bias -> [rows, n] bfloat16; gated
    (W and bias in `gate_up_order`): SiLU(gate) · up of that, [rows, n / 2]."""
    rows, k = x2.shape
    if rows > MAX_ROWS or x2.dtype != torch.bfloat16:
        raise ValueError(f"the int4 mma kernel takes up to {MAX_ROWS} bfloat16 rows, "
                         f"got {rows} of {x2.dtype}")
    check_packed(qweight, scales, n, k, bias)
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # rows read in 16-byte chunks
    cfg = cfg or config(n, k, shared_limit=shared_limit(_device_index(x2)))
    nb = _row_blocks(rows)
    out = torch.empty(rows, n // 2 if gated else n, dtype=x2.dtype, device=x2.device)
    if cfg.splits > 1:
        parts = torch.empty(cfg.splits * rows * n, dtype=torch.float32, device=x2.device)
        counters = kernels.tile_counters(x2.device, cfg.blocks_n)
    else:
        parts, counters = out, out
    shared = _shared_bytes(rows, cfg)
    threads, device = cfg.tn * cfg.wk * 32, _device_index(x2)
    per_warp = -(-cfg.groups_per_split // cfg.wk)
    stream = per_warp > GMAX  # else one-shot: the slots hold all of a warp's groups
    resident = (STREAM_RESIDENT if stream else DECODE_RESIDENT) if nb == 1 else 1
    fn = _kernel("int4_mma", device, nb, cfg.tn, cfg.wk, STREAM_SLOTS if stream else per_warp,
                 gated, resident, stream)
    allow_shared(fn, shared)
    _launch(fn, (cfg.blocks_n, cfg.splits, 1), (threads, 1, 1), shared,
            [qweight, scales, x2, bias if bias is not None else x2, out, parts, counters,
             rows, n, k, x2.stride(0), out.stride(0), cfg.groups_per_split,
             int(bias is not None)],
            "launch_pdl" in kernels.pdl_options(x2, kc), device)
    return out


class _Attribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class Launch(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_...


@functools.cache
def launch_kernel_ex():
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def _launch(fn, grid, block, shared: int, args: list, pdl: bool, device: int) -> None:
    """fn on the current stream through cuLaunchKernelEx, with programmatic dependent launch
    when pdl (the kernel then overlaps its weight loads with the previous kernel's tail, as the
    Triton kernels do); tensors pass as pointers, ints as int, floats as float."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
              else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(
        *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = Launch((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared,
                     torch.cuda.current_stream(device).cuda_stream,
                     ctypes.pointer(attribute) if pdl else None, int(pdl))
    if device == torch.cuda.current_device():
        err = launch_kernel_ex()(ctypes.byref(config), fn.func, pointers, None)
    else:  # the driver launches in the current context: the tensors' device's
        with torch.cuda.device(device):
            err = launch_kernel_ex()(ctypes.byref(config), fn.func, pointers, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")


def allow_shared(fn, nbytes: int) -> None:
    """Raise the kernel's dynamic shared-memory limit to nbytes where it is past 48 KB."""
    if nbytes >= 48 * 1024 and nbytes > getattr(fn, "_max_shared_mem_bytes", 0):
        fn.set_shared_memory_config(nbytes)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [n, k] bfloat16, each weight as the product kernel computes it."""
    check_packed(qweight, scales, n, k)
    out = torch.empty(n, k, dtype=torch.bfloat16, device=qweight.device)
    words = qweight.numel() // 4
    fn = _kernel("int4_dequant", _device_index(qweight))
    _launch(fn, (-(-words // 256), 1, 1), (256, 1, 1), 0, [qweight, scales, out, n, k], False,
            _device_index(qweight))
    return out
