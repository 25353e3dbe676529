"""Where a decode step's time goes, and what each fast-path piece buys (random weights, GPU).

For each shape: the official figures (`run_shape_bench`: step cost curve, roofline fraction,
drafter step) with the default fast path, then the same target under each setting, a fresh
StepRunner each (graphs captured under the setting):
  torch                the PyTorch path (FLASHDRAFT_KERNELS=torch): cuBLAS + PyTorch ops
  fused                flashdraft.backends.kernels for norms, rope + cache write, attention, SiLU·up;
                       cuBLAS products
  fused+skinny         and products of up to 32 rows through kernels.skinny_kernel (norm and
                       SiLU·up fused into them)
  +pdl                 the Triton kernels launched with programmatic dependent launch
  +pdl+prefetch        and the products' first weight tiles loaded before the PDL wait (the
                       default)
  +pdl+early+prefetch  and each kernel letting the next one launch before its own wait
a kernel table of one replayed decode step (torch.profiler) for some of them, and cuBLAS
against the skinny kernel for every matrix shape of the model (µs, each in a graph of 20
back-to-back calls). --sweep S: a launch-parameter sweep of the skinny kernel per matrix, S
seconds a shape, weights from DRAM; with --sweep-apply, then decoding in the model with each
matrix at its sweep's best against the default configs, in turn in one process; with
--sweep-write JSON, the winners merged into a tuned table (kernels.SKINNY_TABLE).

Random weights measure speed only; acceptance is not measured.

    PYTHONPATH=. python3 benchmarks/profile_step.py --out DIR qwen2.5-1.5b qwen3-8b qwen3-32b:int4
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends import kernels
from flashdraft.backends import tune  # noqa: E402
from flashdraft.backends.tune import dram_ring, graph_us, matrices  # noqa: E402
from flashdraft.backends.cuda_graphs import StepRunner  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.tools.shapes import (decode_loop, time_steps, build_random_model,  # noqa: E402
                               format_shape_bench, get_shape, measure_copy_bandwidth,
                               run_shape_bench, step_bytes)

# (fused kernels, skinny products, PDL, PDL early launch, weight prefetch before the PDL wait)
SETTINGS = {"torch": (False, False, False, False, False),
            "fused": (True, False, False, False, False),
            "fused+skinny": (True, True, False, False, False),
            "+pdl": (True, True, True, False, False),
            "+pdl+prefetch": (True, True, True, False, True),
            "+pdl+early+prefetch": (True, True, True, True, True)}
DEFAULT = "+pdl+prefetch"
PROFILED = ("torch", "fused+skinny", DEFAULT)


# In-model variants of the skinny-kernel path (PDL and prefetch on), see kernels.SKINNY_RULE
VARIANTS = {
    "default": dict(SKINNY_RULE="tuned", SPLIT_REDUCE="last", GATED=None),  # GATED auto
    "v1/sum-kernel": dict(SKINNY_RULE="v1", SPLIT_REDUCE="kernel", GATED=False),
    "v1": dict(SKINNY_RULE="v1", SPLIT_REDUCE="last", GATED=False),
    "v1+gated": dict(SKINNY_RULE="v1", SPLIT_REDUCE="last", GATED=True),
    "v2": dict(SKINNY_RULE="v2", SPLIT_REDUCE="last", GATED=False),
    "v2+gated": dict(SKINNY_RULE="v2", SPLIT_REDUCE="last", GATED=True),
}
ENV = {"SKINNY_RULE": "FLASHDRAFT_SKINNY_RULE", "SPLIT_REDUCE": "FLASHDRAFT_SPLIT_REDUCE",
       "GATED": "FLASHDRAFT_GATED"}


def set_variant(name: str) -> None:
    for key, value in VARIANTS[name].items():
        setattr(kernels, key, value)


def target(shape: str, quant: str | None, context: int):
    """A random-weight model of the shape, a filled cache and the bytes a decode step reads."""
    cfg = get_shape(shape)
    model = build_random_model(cfg, torch.bfloat16, "cuda", quant=quant)
    cache = KVCache.for_model(cfg, 1, 1024, torch.bfloat16, "cuda")
    cache.kv.normal_()
    return cfg, model, cache, step_bytes(model, cfg, context, 1, torch.bfloat16)["bytes"]


def time_decode(model, cache, cfg, context: int) -> tuple[StepRunner, float, float, float]:
    """A fresh StepRunner (graphs captured under the current settings) and its t1, t16 (s)
    and plain decoding tokens/s over 128 steps."""
    runner = StepRunner(model, "cuda")
    t1 = time_steps(runner, cache, 1, context, cfg.vocab_size, 30)
    t16 = time_steps(runner, cache, 16, context, cfg.vocab_size, 30)
    return runner, t1, t16, decode_loop(runner, cache, context, cfg.vocab_size, 128)


@torch.inference_mode()
def variants(shape: str, context: int, bandwidth: float) -> dict:
    """Decode (t1, t16, tokens/s over 128 steps) of the model under each variant, default
    setting otherwise; a variant that fails is recorded and skipped."""
    cfg, model, cache, need = target(shape, None, context)
    set_path(DEFAULT)
    saved = {key: getattr(kernels, key) for key in ENV}
    out = {}
    for name in VARIANTS:
        set_variant(name)
        try:
            runner, t1, t16, tps = time_decode(model, cache, cfg, context)
            out[name] = {"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3, "decode_tokens_per_s": tps,
                         "roofline_fraction": tps * need / bandwidth}
            print(f"  variant {shape} {name:16s} t1 {t1 * 1e3:.3f} ms  t16 {t16 * 1e3:.3f} ms  "
                  f"decode {tps:.1f} tok/s = {100 * out[name]['roofline_fraction']:.1f}%",
                  flush=True)
            del runner
        except Exception as e:  # keep measuring the others
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  variant {shape} {name}: {out[name]['error']}", flush=True)
    for key, value in saved.items():
        _set(key, value)
    return out


def _set(key: str, value) -> None:
    if key.startswith("MMA_"):  # the int4 kernel's launch rule; launch shapes are cached
        from flashdraft.backends import mma
        setattr(mma, key[4:], value)
        mma.config.cache_clear()
    else:
        setattr(kernels, key, value)


def set_path(name: str) -> None:
    (kernels._enabled, kernels.SKINNY, kernels.PDL, kernels.EARLY_LAUNCH,
     kernels.PREFETCH) = SETTINGS[name]


def kernel_table(runner, cache, context, vocab, steps: int = 10) -> dict:
    tokens = torch.randint(0, vocab, (1, 1), device="cuda")
    for _ in range(3):
        runner(tokens, context, cache)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner(tokens, context, cache)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and e.device_time > 0), key=lambda e: e.time_range.start)
    for e in events:
        per[e.name[:90]][0] += 1
        per[e.name[:90]][1] += e.device_time
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in per.items()), key=lambda r: -r[2])
    # The step's kernels in launch order, µs averaged over the steps: the first layers' and the
    # output head's kernels one by one (which product costs what).
    per_step = len(events) // steps
    sequence = []
    if per_step * steps == len(events):
        for i in list(range(min(per_step, 24))) + list(range(max(24, per_step - 4), per_step)):
            us = sum(events[s * per_step + i].device_time for s in range(steps)) / steps
            sequence.append((i, events[i].name[:40], us))
    return {"kernels_per_step": sum(r[1] for r in rows),
            "busy_us_per_step": sum(r[2] for r in rows),
            "rows": rows[:25], "sequence": sequence}


@torch.inference_mode()
def compare(shape: str, quant: str | None, context: int, bandwidth: float) -> dict:
    cfg, model, cache, need = target(shape, quant, context)
    out = {"roofline_tokens_per_s": bandwidth / need, "settings": {}}
    for name in SETTINGS:
        set_path(name)
        runner, t1, t16, tps = time_decode(model, cache, cfg, context)
        out["settings"][name] = {"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3, "t16_over_t1": t16 / t1,
                                 "decode_tokens_per_s": tps,
                                 "roofline_fraction": tps / out["roofline_tokens_per_s"],
                                 "step_roofline_fraction": need / t1 / bandwidth}
        if name in PROFILED:
            out["settings"][name]["profile"] = kernel_table(runner, cache, context, cfg.vocab_size)
        del runner
    set_path(DEFAULT)
    out["products_us"] = {}
    for (n, k, gated), w in matrices(model).items():
        ring = dram_ring(w)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        x9 = torch.randn(9, k, dtype=torch.bfloat16, device="cuda")
        if gated:
            ref = lambda x: kernels.silu_mul(torch.nn.functional.linear(x, next(ring)[0]))
        else:
            ref = lambda x: torch.nn.functional.linear(x, next(ring)[0])
        row = {"cublas": graph_us(lambda: ref(x)), "cublas_9rows": graph_us(lambda: ref(x9))}
        for rule in ("v1", "v2"):
            c = kernels.skinny_config(n, k, gated, rule)
            ours = lambda x: kernels.skinny_linear(x, next(ring)[0], None, gated, c)
            row[rule] = graph_us(lambda: ours(x))
            row[rule + "_9rows"] = graph_us(lambda: ours(x9))
            row[rule + "_config"] = c
        nbytes = w.numel() * 2
        row.update({f"{key}_TBps": nbytes / row[key] / 1e6 for key in ("cublas", "v1", "v2")})
        out["products_us"][f"{w.shape[0]}x{k}{' gated' if gated else ''}"] = row
    return out


def sweep(shape: str, budget_s: float, match: str = "") -> dict:
    """flashdraft.backends.tune.sweep over the shape's matrices, default path (PDL, prefetch)."""
    set_path(DEFAULT)
    return tune.sweep(get_shape(shape), budget_s, match, label=shape,
                      log=lambda s: print(s, flush=True))


def sweep_write(path: Path, swept: dict) -> dict:
    """tune.merge into the table at path under this GPU's name, reported."""
    written = tune.merge(path, swept, kernels.device_name())
    print(f"  sweep wrote {len(written)} entries to {path}: {written}", flush=True)
    return written


@torch.inference_mode()
def sweep_apply(shape: str, swept: dict, context: int, bandwidth: float, repeats: int = 2) -> dict:
    """Decoding in the model with every swept matrix at its sweep's best config against the
    default's, in turn `repeats` times in one process (fresh graphs each): micro-benchmarks of
    small products have misled before (NOTES-gpu.md, session 3), the model decides."""
    best = {tuple(e["matrix"]): kernels.SkinnyConfig(*e["best"]) for e in swept.values()}
    rule = kernels.skinny_config

    def patched(n, k, gated=False, rule_name="v2"):
        return best.get((n, k, gated)) or rule(n, k, gated, rule_name)
    set_path(DEFAULT)
    cfg, model, cache, need = target(shape, None, context)
    out = {"default": [], "sweep best": []}
    try:
        for _ in range(repeats):
            for label in out:
                kernels.skinny_config = patched if label == "sweep best" else rule
                _, t1, t16, tps = time_decode(model, cache, cfg, context)
                out[label].append({"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3,
                                   "decode_tokens_per_s": tps,
                                   "roofline_fraction": tps * need / bandwidth})
                print(f"  {shape} {label}: t1 {t1 * 1e3:.3f} ms  t16 {t16 * 1e3:.3f} ms  decode "
                      f"{tps:.1f} tok/s = {100 * tps * need / bandwidth:.1f}%", flush=True)
    finally:
        kernels.skinny_config = rule
    return out


def _one_layer_linears(shape: str):
    """A bf16 nn.Linear for each distinct matrix of a one-layer random model of the shape."""
    cfg = dataclasses.replace(get_shape(shape), num_layers=1)
    model = build_random_model(cfg, torch.bfloat16, "cuda")
    for (_, k, _), w in matrices(model).items():
        lin = torch.nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        lin.weight.data = w
        yield lin


def _quantized(x, parts, rows: int, cfg=None, convert=None):
    """kernels.quant_linear over a quantized weight's parts (qweight, scale[, zero])."""
    return kernels.quant_linear(x, parts[0], parts[1], parts[2] if len(parts) > 2 else None,
                                None, rows, cfg, convert)


def _rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@torch.inference_mode()
def quant_products(shape: str, budget_s: float) -> dict:
    """Weight-only int4 / int8 products for each matrix of the shape (µs per call, graph of 20
    back-to-back calls, weights from DRAM): our kernel at its rule's launch parameters (1 and 16
    rows, int4 also without the bit-or conversion), a sweep of column block, program count,
    warps, weight layout and code conversion (one row, S seconds a matrix), torch's tinygemm
    int4 and cuBLAS bf16; with the error against the dequantized weight in float64 and the
    bytes read."""
    from flashdraft.backends import quant
    set_path(DEFAULT)
    result = {}
    for lin in _one_layer_linears(shape):
        began = time.perf_counter()  # budget_s for each matrix's sweep
        rows, k = lin.weight.shape
        x1 = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        x16 = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        bf16 = dram_ring(lin.weight)
        row = {"bf16": graph_us(lambda: torch.nn.functional.linear(x1, next(bf16)[0]))}
        for mode in ("int4", "int8"):
            layer = quant.QuantLinear(lin, mode, "triton")
            parts = (layer.qweight, layer.scale) + ((layer.zero,) if mode == "int4" else ())
            nbytes = sum(t.numel() * t.element_size() for t in parts)
            ring = dram_ring(*parts)
            run = lambda x, c, conv=None: _quantized(x, next(ring), rows, c, conv)
            rule = kernels.quant_config(rows, k)
            ref = x16.double() @ layer.dequantized().double().t()
            y = _quantized(x16, parts, rows, rule, "ops")
            row[f"{mode}_rel_error"] = _rel_error(y, ref)
            row[f"{mode}_MB"] = nbytes / 1e6
            row[mode] = graph_us(lambda: run(x1, rule))
            row[f"{mode}_16rows"] = graph_us(lambda: run(x16, rule))
            row[f"{mode}_TBps"] = nbytes / row[mode] / 1e6
            row[f"{mode}_config"] = rule
            if mode == "int4":
                row["int4_plain_convert_rel_error"] = _rel_error(
                    _quantized(x16, parts, rows, rule, "plain"), ref)
                row["int4_plain_convert"] = graph_us(lambda: run(x1, rule, "plain"))
                for label, q in (("asm", parts[0]), ("nk_asm", parts[0].t().contiguous().t())):
                    ya = _quantized(x16, (q, *parts[1:]), rows, rule, "asm")
                    row[f"int4_{label}_rel_error"] = _rel_error(ya, ref)
                    row[f"int4_{label}_equals_ops"] = bool(torch.equal(ya, y))
                tg_ring = dram_ring(*quant._tinygemm_pack(*parts))
                tgmm = lambda x: (lambda t: torch.ops.aten._weight_int4pack_mm(
                    x, t[0], quant.GROUP, t[1]))(next(tg_ring))
                row["tinygemm"] = graph_us(lambda: tgmm(x1))
                row["tinygemm_16rows"] = graph_us(lambda: tgmm(x16))
            # the sweep: weights stored [k, n] (as now) or [n, k] (transposed copies), int4
            # codes converted by Triton ops or inline PTX, tile width, warps, program count
            flipped = dram_ring(parts[0].t().contiguous().t(), *parts[1:])
            timed = []
            for layout, conv, (block_n, warps), programs in itertools.product(
                    ("kn", "nk"), ("ops", "asm") if mode == "int4" else ("ops",),
                    ((128, 4), (256, 4), (256, 8), (128, 8)), (256, 512)):
                if time.perf_counter() - began > budget_s:
                    break
                c = kernels.quant_config(rows, k, block_n, programs)._replace(num_warps=warps)
                r = flipped if layout == "nk" else ring
                label = (layout, conv, block_n, warps, programs, c.split)
                try:
                    timed.append((graph_us(lambda: _quantized(x1, next(r), rows, c, conv)), label))
                except Exception as e:  # resources the compiler refuses
                    timed.append((float("inf"), f"{label}: {type(e).__name__}: {str(e)[:200]}"))
            timed.sort(key=lambda r: r[0])
            row[f"{mode}_sweep"] = timed[:6]
        key = f"{rows}x{k}"
        result[key] = row
        best = row["int4_sweep"][:3]
        print(f"  quant {shape} {key:>12s} (from DRAM) bf16 {row['bf16']:6.1f} us | int4 "
              f"{row['int4']:6.1f} us ({row['int4_TBps']:.2f} TB/s, "
              f"err {row['int4_rel_error']:.1e}) "
              f"plain-convert {row['int4_plain_convert']:.1f} tinygemm {row['tinygemm']:.1f} "
              f"(asm err {row['int4_asm_rel_error']:.1e} same {row['int4_asm_equals_ops']}, nk "
              f"{row['int4_nk_asm_rel_error']:.1e}) | "
              f"16 rows int4 {row['int4_16rows']:.1f} tinygemm {row['tinygemm_16rows']:.1f} | "
              f"int8 {row['int8']:.1f} us ({row['int8_TBps']:.2f} TB/s) | best int4 {best} int8 "
              f"{row['int8_sweep'][:2]}",
              flush=True)
        torch.cuda.empty_cache()
    return result


# (tiles a block, warps along K, groups a split, register slots a warp, resident blocks): the
# last two apply where a split is longer than the one-shot kernel's (mma.STREAM_SLOTS and
# mma.STREAM_RESIDENT); None keeps the module's setting.
MMA_SWEEP = ((4, 2, 8, None, None), (4, 1, 4, None, None), (4, 2, 24, 6, 2),
             (4, 1, 8, 8, 2), (4, 1, 16, 8, 2), (4, 1, 16, 6, 2), (4, 1, 16, 12, 2),
             (4, 1, 16, 6, 3), (4, 1, 10, 8, 2), (4, 1, 12, 8, 2), (4, 1, 20, 8, 2),
             (4, 1, 20, 6, 2), (4, 1, 24, 8, 2), (4, 1, 26, 8, 2), (2, 1, 16, 8, 4),
             (2, 1, 20, 8, 4), (8, 1, 16, 6, 2), (8, 1, 20, 8, 1), (4, 1, 20, 12, 2),
             (2, 1, 12, 6, 4))


@torch.inference_mode()
def mma_products(shape: str, sweep: bool, probes: tuple[int, ...] = ()) -> dict:
    """The int4 tensor-core kernel (flashdraft.backends.mma) on each matrix of the shape, weights from
    DRAM: µs for 1, 4, 16 and 32 rows at the default launch shape, error against the
    dequantized weight, TB/s for one row; the Triton int4 kernel, tinygemm and cuBLAS bf16 for
    one and 16 rows beside it; with sweep, one row under each of MMA_SWEEP's launch shapes;
    probes: one and 16 rows at the default launch under each of mma.PROBE's measurement
    variants (wrong output; 1: the weights loaded only)."""
    from flashdraft.backends import mma
    from flashdraft.backends import quant
    set_path(DEFAULT)
    result = {}
    for lin in _one_layer_linears(shape):
        n, k = lin.weight.shape
        xs = torch.randn(32, k, dtype=torch.bfloat16, device="cuda")
        bf16 = dram_ring(lin.weight)
        row = {"bf16": graph_us(lambda: torch.nn.functional.linear(xs[:1], next(bf16)[0])),
               "bf16_16rows": graph_us(lambda: torch.nn.functional.linear(xs[:16], next(bf16)[0]))}
        layer = quant.QuantLinear(lin, "int4", "mma")
        parts = (layer.qweight, layer.scale)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        ring = dram_ring(*parts)
        run = lambda x, c=None: mma.linear(x, *next(ring), None, n, c)  # noqa: E731
        ref = xs.double() @ layer.dequantized().double().t()
        row["rel_error"] = _rel_error(mma.linear(xs, *parts, None, n), ref)
        row["config"] = mma.config(n, k)
        for m in (1, 4, 16, 32):
            row[f"mma_{m}rows"] = graph_us(lambda: run(xs[:m]))
        row["mma_TBps"] = nbytes / row["mma_1rows"] / 1e6
        tri = quant.QuantLinear(lin, "int4", "triton")
        tparts = (tri.qweight, tri.scale, tri.zero)
        tring = dram_ring(*tparts)
        row["triton"] = graph_us(lambda: _quantized(xs[:1], next(tring), n))
        row["triton_16rows"] = graph_us(lambda: _quantized(xs[:16], next(tring), n))
        tg_ring = dram_ring(*quant._tinygemm_pack(*tparts))
        tgmm = lambda x: (lambda t: torch.ops.aten._weight_int4pack_mm(  # noqa: E731
            x, t[0], quant.GROUP, t[1]))(next(tg_ring))
        row["tinygemm"] = graph_us(lambda: tgmm(xs[:1]))
        row["tinygemm_16rows"] = graph_us(lambda: tgmm(xs[:16]))
        if sweep:
            timed = []
            saved = mma.STREAM_SLOTS, mma.STREAM_RESIDENT
            for tn, wk, gps, slots, resident in MMA_SWEEP:
                mma.STREAM_SLOTS, mma.STREAM_RESIDENT = slots or saved[0], resident or saved[1]
                try:
                    c = mma.config(n, k, tn, wk, gps)
                    timed.append((graph_us(lambda: run(xs[:1], c)),
                                  graph_us(lambda: run(xs[:16], c)),
                                  (tn, wk, gps, slots, resident, c.splits)))
                except Exception as e:  # resources the launch refuses
                    timed.append((float("inf"), float("inf"),
                                  f"{(tn, wk, gps, slots, resident)}: {type(e).__name__}: "
                                  f"{str(e)[:200]}"))
            mma.STREAM_SLOTS, mma.STREAM_RESIDENT = saved
            row["sweep"] = sorted(timed, key=lambda r: r[0])
        for probe in probes:
            mma.PROBE = probe
            try:
                row[f"probe{probe}"] = (graph_us(lambda: run(xs[:1])),
                                        graph_us(lambda: run(xs[:16])))
            finally:
                mma.PROBE = 0
        result[f"{n}x{k}"] = row
        print(f"  mma {shape} {n:>6d}x{k:<6d} (from DRAM) 1 row {row['mma_1rows']:6.1f} us "
              f"({row['mma_TBps']:.2f} TB/s) 4 {row['mma_4rows']:.1f} 16 {row['mma_16rows']:.1f} "
              f"32 {row['mma_32rows']:.1f} err {row['rel_error']:.1e} | triton {row['triton']:.1f} "
              f"/ {row['triton_16rows']:.1f} tinygemm {row['tinygemm']:.1f} / "
              f"{row['tinygemm_16rows']:.1f} bf16 {row['bf16']:.1f} / {row['bf16_16rows']:.1f} | "
              f"{row['config']}" + "".join(
                  f" | probe {p}: {row[f'probe{p}'][0]:.1f} / {row[f'probe{p}'][1]:.1f} us "
                  f"({nbytes / row[f'probe{p}'][0] / 1e6:.2f} TB/s)" for p in probes)
              + (f" | sweep {row['sweep'][:4]}" if sweep else ""), flush=True)
        torch.cuda.empty_cache()
    return result


@torch.inference_mode()
def breakdown(shape: str, quant: str | None, context: int, bandwidth: float,
              switches: list[str], repeats: int = 2) -> dict:
    """The default path against each of `switches` toggled, in turn `repeats` times (decode t1,
    t16, tokens/s; a fresh graph each), with kernel tables of one replayed decode step of the
    default and of "nopdl" (under programmatic dependent launch kernel times overlap: a kernel's
    time includes its wait for the one before; without it they are the kernels' own). Switches:
      gated  SiLU · up inside the gate/up product toggled against what kernels.gated_for picks
             for the shape (bf16: kernels.GATED on the same model; int4:
             a second model quantized with mma.GATED toggled, which picks the stored layout)
      early  the Triton kernels let the next kernel launch before their own wait
      rope   rope and the cache write inside attention (kernels.ROPE_ATTENTION) toggled
      split  attention splits twice as long (the cache's split_len: half as many programs,
             each reading twice the positions; none to merge where one split covers kv_len)
      halfsplit  attention splits half as long (twice the programs, down to one 64-position
             block each: the 1.5B's two kv heads at 512 positions run 8 programs by default)
      unfolded  the norms as kernels of their own (kernels.FOLD_NORMS off at run time: the same
             folded weights, each residual add and norm in `rms_norm`, model.Residual)
      nonorm the RMSNorm kernels skipped (their input passed on, the residual add dropped;
             with the norms folded only the first and the final norm are kernels, so this
             means something as "unfolded+nonorm"):
             wrong output, speed only, the most that removing them could give
      noattn attention skipped (rope, cache write and attention: an empty output, no kernel);
             wrong output, speed only, the most that a faster attention could give
      nopdl  no programmatic dependent launch
      silu   SiLU · up inside the down product's input (kernels.SILU_DOWN) toggled (MLPs
             whose gate/up product does not compute it: kernels.gated_for)
      streamN  int4 products with streamed splits of K of up to N groups (mma.SPLIT_GROUPS;
             "stream0": none, session 13's launch rule)
      wkN    int4 products' one-shot splits with N warps along K a tile (mma.WK)
    Switches joined by "+" (e.g. "early+nopdl") are toggled together in one run."""
    from flashdraft.backends import mma
    set_path(DEFAULT)
    saved = {"GATED": kernels.GATED, "EARLY_LAUNCH": kernels.EARLY_LAUNCH, "PDL": kernels.PDL,
             "ROPE_ATTENTION": kernels.ROPE_ATTENTION, "rms_norm": kernels.rms_norm,
             "FOLD_NORMS": kernels.FOLD_NORMS, "MMA_SPLIT_GROUPS": mma.SPLIT_GROUPS,
             "rope_attention": kernels.rope_attention,
             "MMA_WK": mma.WK, "SILU_DOWN": kernels.SILU_DOWN}
    default = target(shape, quant, context)
    split_len = default[2].split_len
    runs = {"default": (default, {})}

    def toggled(switch: str) -> tuple[str, dict]:
        if switch == "gated":
            now = kernels.gated_for(get_shape(shape).intermediate_size)
            return f"gated {not now}", {"GATED": not now}
        if switch == "early":
            return f"early {not saved['EARLY_LAUNCH']}", {"EARLY_LAUNCH": not saved["EARLY_LAUNCH"]}
        if switch == "rope":
            return (f"rope-attention {not saved['ROPE_ATTENTION']}",
                    {"ROPE_ATTENTION": not saved["ROPE_ATTENTION"]})
        if switch == "split":
            return f"split x2 ({2 * split_len})", {"split_len": 2 * split_len}
        if switch == "halfsplit":
            return f"split /2 ({max(64, split_len // 2)})", {"split_len": max(64, split_len // 2)}
        if switch == "unfolded":
            return f"fold-norms {not saved['FOLD_NORMS']}", {"FOLD_NORMS": not saved["FOLD_NORMS"]}
        if switch == "nonorm":
            return ("no norm kernels (wrong output)",
                    {"rms_norm": lambda x, weight, eps, residual=None: x})
        if switch == "noattn":
            def no_attention(qkv, *rope):  # the output's shape, no kernel
                b, t, heads = qkv.shape[0], qkv.shape[1], rope[4]
                return qkv.new_empty(b, t, heads * qkv.shape[-1])
            return "no attention (wrong output)", {"rope_attention": no_attention}
        if switch == "nopdl":
            return "nopdl", {"PDL": False}
        if switch == "silu":
            return (f"silu-in-down {not saved['SILU_DOWN']}",
                    {"SILU_DOWN": not saved["SILU_DOWN"]})
        if switch.startswith("stream") and switch[6:].isdigit():
            groups = int(switch[6:])
            return (f"int4 streamed splits up to {groups} groups" if groups else
                    "no streamed int4 splits"), {"MMA_SPLIT_GROUPS": groups}
        if switch.startswith("wk") and switch[2:].isdigit() and 1 <= int(switch[2:]) <= 4:
            warps = int(switch[2:])
            return f"int4 one-shot splits of {warps} warps", {"MMA_WK": warps}
        raise ValueError(f"unknown switch {switch!r}: use gated, early, rope, split, halfsplit, "
                         f"unfolded, nonorm, noattn, nopdl, silu, streamN, "
                         f"wkN (N 1-4), or several joined by '+'")

    for switch in switches:
        if switch == "gated" and (quant or "").startswith("int4"):
            mma.GATED = not mma.GATED
            runs[f"mma-gated {mma.GATED}"] = (target(shape, quant, context), {})
            mma.GATED = not mma.GATED
            continue
        labels, setting = [], {}
        for part in switch.split("+"):
            label, part_setting = toggled(part)
            labels.append(label)
            setting.update(part_setting)
        runs[" + ".join(labels)] = (default, setting)
    out = {label: [] for label in runs}
    for rep in range(repeats):
        for label, ((cfg, model, cache, need), setting) in runs.items():
            for key, value in saved.items():
                _set(key, setting.get(key, value))
            cache.split_len = setting.get("split_len", split_len)
            runner, t1, t16, tps = time_decode(model, cache, cfg, context)
            row = {"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3, "decode_tokens_per_s": tps,
                   "roofline_fraction": tps * need / bandwidth}
            print(f"  {shape}:{quant} {label}: t1 {t1 * 1e3:.3f} ms  t16 {t16 * 1e3:.3f} ms  "
                  f"decode {tps:.1f} tok/s = {100 * row['roofline_fraction']:.1f}%", flush=True)
            if rep == 0 and label in ("default", "nopdl"):
                row["profile"] = p = kernel_table(runner, cache, context, cfg.vocab_size)
                print(f"    {p['kernels_per_step']:.0f} kernels/step, busy "
                      f"{p['busy_us_per_step']:.0f} us/step:")
                for name, calls, us in p["rows"][:8]:
                    print(f"      {us:8.1f} us {calls:6.1f}x  {name}", flush=True)
                print("    in launch order: " + ", ".join(
                    f"{i}:{name.split('(')[0].split('<')[0][-18:]} {us:.1f}"
                    for i, name, us in p["sequence"]), flush=True)
            out[label].append(row)
            del runner
    for key, value in saved.items():
        _set(key, value)
    default[2].split_len = split_len
    return out



@torch.inference_mode()
def convert_probe(shape: str, converts: list[str]) -> dict:
    """int4 products of each matrix of the shape under each code conversion of
    kernels.quant_linear, at the default launch parameters: µs for 1 and 16 rows (weights from
    DRAM) and the error against the dequantized weight in float64."""
    from flashdraft.backends import quant
    result = {}
    for lin in _one_layer_linears(shape):
        rows, k = lin.weight.shape
        layer = quant.QuantLinear(lin, "int4", "triton")
        parts = (layer.qweight, layer.scale, layer.zero)
        ring = dram_ring(*parts)
        x1 = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        x16 = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        ref = x16.double() @ layer.dequantized().double().t()
        row = {}
        for conv in converts:
            run = lambda x: _quantized(x, next(ring), rows, None, conv)
            try:
                row[conv] = {"us": graph_us(lambda: run(x1)),
                             "us_16rows": graph_us(lambda: run(x16)),
                             "rel_error": _rel_error(_quantized(x16, parts, rows, None, conv), ref)}
            except Exception as e:
                row[conv] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        result[f"{rows}x{k}"] = row
        print(f"  convert {shape} {rows}x{k}: " + "; ".join(
            f"{c} {v['us']:.1f}/{v['us_16rows']:.1f} us err {v['rel_error']:.1e}" if "us" in v
            else f"{c} {v['error']}" for c, v in row.items()), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="SHAPE or SHAPE:QUANT (int4, int8, int4-hybrid)")
    ap.add_argument("--out", default="profile-out")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--no-official", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="measure the skinny-path variants (VARIANTS) in the model first")
    ap.add_argument("--best-env", default=None,
                    help="write the fastest variant of the first shape as shell exports here")
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--quant-products", type=float, default=0.0, metavar="S",
                    help="weight-only int4/int8 products of each matrix, with S seconds a "
                         "matrix for a launch-parameter sweep")
    ap.add_argument("--convert-probe", default="",
                    help="comma-separated int4 code conversions to time on each matrix "
                         "(kernels.quant_linear's convert)")
    ap.add_argument("--mma-products", choices=["default", "sweep"], default=None,
                    help="the int4 tensor-core kernel on each matrix against the others "
                         "(sweep: also under each launch shape of MMA_SWEEP)")
    ap.add_argument("--mma-probe", default="", metavar="P,...",
                    help="with --mma-products, also time mma.PROBE's measurement variants "
                         "(1: the weights loaded only; wrong output)")
    ap.add_argument("--breakdown", default=None, metavar="SWITCHES",
                    help="the default decode path against each comma-separated switch "
                         "toggled (gated, early, rope, split, halfsplit, unfolded, nonorm, "
                         "noattn, nopdl, silu, "
                         "streamN, wkN, or several joined by '+': see breakdown), in turn, with "
                         "kernel tables")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of the breakdown's configurations, in turn")
    ap.add_argument("--sweep", type=float, default=0.0,
                    help="seconds per shape for a launch-parameter sweep of the skinny kernel")
    ap.add_argument("--sweep-apply", action="store_true",
                    help="after --sweep, decode in the model with each matrix at its best "
                         "against the default configs")
    ap.add_argument("--sweep-match", default="", metavar="TEXT",
                    help="sweep only the matrices whose table key (e.g. '1536x8960', "
                         "'8960x1536 gated') holds TEXT")
    ap.add_argument("--sweep-write", type=Path, default=None, metavar="JSON",
                    help="after --sweep, merge each matrix's best config into this tuned table "
                         "(kernels.SKINNY_TABLE) where it beat the default by over 1 %%")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    results = {"copy_bandwidth_Bps": bandwidth, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shapes": {}}
    for spec in args.shapes:
        shape, _, quant = spec.partition(":")
        quant = quant or None
        began = time.perf_counter()
        r = {}
        if args.variants and not quant:
            r["variants"] = variants(shape, args.context, bandwidth)
            ok = {k: v for k, v in r["variants"].items() if "error" not in v}
            if args.best_env and ok and spec == args.shapes[0]:
                best = max(ok, key=lambda k: ok[k]["decode_tokens_per_s"])
                lines = [f"export {ENV[k]}="
                         f"{'auto' if v is None else int(v) if isinstance(v, bool) else v}"
                         for k, v in VARIANTS[best].items()]
                Path(args.best_env).write_text("\n".join(lines) + "\n")
                print(f"  best variant {best}: {'; '.join(lines)}", flush=True)
                set_variant(best)  # for everything measured after this
        if not args.no_official:
            set_path(DEFAULT)
            r["official"] = run_shape_bench(shape, "bfloat16", quant, "cuda", context=args.context,
                                            bandwidth=bandwidth)
            print(format_shape_bench(r["official"]), flush=True)
        if args.breakdown is not None:
            r["breakdown"] = breakdown(shape, quant, args.context, bandwidth,
                                       [w for w in args.breakdown.split(",") if w], args.repeats)
        if args.sweep and not quant:
            r["sweep"] = sweep(shape, args.sweep, args.sweep_match)
            if args.sweep_apply:
                r["sweep_apply"] = sweep_apply(shape, r["sweep"], args.context, bandwidth)
            if args.sweep_write:
                r["sweep_written"] = sweep_write(args.sweep_write, r["sweep"])
        if args.convert_probe:
            r["convert_probe"] = convert_probe(shape, args.convert_probe.split(","))
        if args.mma_products:
            r["mma_products"] = mma_products(shape, args.mma_products == "sweep",
                                             tuple(int(p) for p in args.mma_probe.split(",") if p))
        if args.quant_products:
            r["quant_products"] = quant_products(shape, args.quant_products)
        if args.no_compare:
            results["shapes"][spec] = r
            (out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
            continue
        r["compare"] = compare(shape, quant, args.context, bandwidth)
        for name, s in r["compare"]["settings"].items():
            print(f"  {spec} {name:11s} t1 {s['t1_ms']:.3f} ms  t16 {s['t16_ms']:.3f} ms "
                  f"({s['t16_over_t1']:.2f}x)  decode {s['decode_tokens_per_s']:.1f} tok/s = "
                  f"{100 * s['roofline_fraction']:.1f}% (step alone "
                  f"{100 * s['step_roofline_fraction']:.1f}%)", flush=True)
            if "profile" in s:
                p = s["profile"]
                print(f"    {p['kernels_per_step']:.0f} kernels/step, busy "
                      f"{p['busy_us_per_step']:.0f} us/step; top:")
                for n, c, us in p["rows"][:12]:
                    print(f"      {us:8.1f} us {c:6.1f}x  {n}")
        for mat, p in r["compare"]["products_us"].items():
            print(f"  {spec} {mat:>18s} (from DRAM) cuBLAS {p['cublas']:6.1f} us "
                  f"({p['cublas_TBps']:.2f} TB/s)  v1 {p['v1']:6.1f} us ({p['v1_TBps']:.2f})  "
                  f"v2 {p['v2']:6.1f} us ({p['v2_TBps']:.2f}); 9 rows: cuBLAS "
                  f"{p['cublas_9rows']:.1f} v1 {p['v1_9rows']:.1f} v2 {p['v2_9rows']:.1f} us",
                  flush=True)
        r["seconds"] = time.perf_counter() - began
        results["shapes"][spec] = r
        (out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
