"""Registers, spills and shared memory of the int4 kernel's launch variants, on a machine with
no GPU: NVRTC compiles flashdraft/csrc/int4_mma.cu for sm_90 and ptxas reports its resources.

    pip install nvidia-cuda-nvrtc-cu12        # NVRTC alone, no CUDA toolkit
    python benchmarks/nvrtc_check.py [--lib PATH/libnvrtc.so.12] [-D NAME=VALUE ...]

The variants are the ones mma.linear launches (decode, streamed, 16 and 32 rows, gated),
each with the options mma._kernel passes. A register count over 65,536 / (blocks x threads)
costs resident blocks (session 15: 136 registers, 3 blocks a multiprocessor instead of 4)."""
from __future__ import annotations

import argparse
import ctypes
import glob
import re
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "flashdraft" / "backends" / "csrc" / "int4_mma.cu"
COMMON = SOURCE.with_name("common.cuh")  # what NVRTC compiles first (mma.cuda_source)

# name: (NB, TN, WK, GMAX, MIN_BLOCKS, GATED, STREAM), as mma.linear picks them
VARIANTS = {
    "decode one-shot": (1, 4, 2, 4, 4, 0, 0),
    "decode streamed": (1, 4, 1, 8, 2, 0, 1),
    "decode streamed gated": (1, 4, 1, 8, 2, 1, 1),
    "16 rows streamed": (2, 4, 1, 8, 1, 0, 1),
    "32 rows streamed": (4, 4, 1, 8, 1, 0, 1),
    "32 rows one-shot": (4, 4, 2, 4, 1, 0, 0),
}


def _library(path: str | None) -> ctypes.CDLL:
    candidates = [path] if path else sorted(glob.glob(
        str(Path(sys.prefix) / "lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.*")))
    for c in candidates:
        try:
            return ctypes.CDLL(c)
        except OSError:
            pass
    sys.exit("no libnvrtc found: pip install nvidia-cuda-nvrtc-cu12, or pass --lib")


def compile_report(lib: ctypes.CDLL, source: str, options: list[str]) -> str:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"int4_mma.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode(errors="replace")
    if rc:
        raise RuntimeError(f"compile failed ({rc}):\n{text}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default=None, help="path of libnvrtc.so.12")
    ap.add_argument("-D", dest="defines", action="append", default=[],
                    help="more macros for every variant, e.g. -D FOLD=0")
    args = ap.parse_args()
    lib, source = _library(args.lib), COMMON.read_text() + SOURCE.read_text()
    for name, (nb, tn, wk, gmax, min_blocks, gated, stream) in VARIANTS.items():
        options = ["-arch=sm_90", "-Xptxas=-v", f"-DNB={nb}", f"-DTN={tn}", f"-DWK={wk}",
                   f"-DGMAX={gmax}", f"-DMIN_BLOCKS={min_blocks}", f"-DGATED={gated}",
                   f"-DSTREAM={stream}"] + [f"-D{d}" for d in args.defines]
        log = compile_report(lib, source, options)
        # ptxas reports each kernel; keep int4_mma's lines
        block = log[log.find("int4_mma'"):] if "int4_mma'" in log else log
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        smem = re.search(r"(\d+) bytes smem", block)
        threads = tn * wk * 32
        # registers are allocated 8 a thread at a time: 129 cost what 136 do
        fit = 65536 // (-(-int(regs.group(1)) // 8) * 8 * threads) if regs else 0
        print(f"{name:24s} {regs.group(1) if regs else '?':>4s} registers, "
              f"spills {spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'} B, "
              f"smem {smem.group(1) if smem else '?'} B static; {threads} threads: "
              f"{fit} blocks a multiprocessor by registers (bound {min_blocks})")


if __name__ == "__main__":
    main()
