"""Where a decode step's time goes on the GPU, and what the kernels buy (random weights).

Per SHAPE or SHAPE:QUANT (QUANT int8, int4, int4-triton, int4-mma; flashdraft.tools.shapes):
  official  `run_shape_bench`, the figures of `flashdraft bench --random-weights`
  compare   decode under each KernelConfig of CONFIGS (torch, default, no-pdl), a fresh random
            model and StepRunner each, in turn --repeats times: t1, t16, plain decoding's
            tokens/s and roofline fraction; a torch.profiler kernel table of the default's step
  products  cuBLAS against the skinny kernel at the model's launch, per matrix (unquantized
            specs; 1 and 16 rows, µs in a graph of 20 calls, weights read from DRAM)
On request: --sweep S (tune.sweep, `flashdraft tune`'s measurement, S seconds a shape), then
--sweep-apply (decoding with the winners as a tuned table against the default) and/or
--sweep-write JSON (tune.merge); --quant-products S (the Triton int4/int8 kernel per matrix,
with a launch sweep of S seconds); --mma-products default|sweep (the int4 tensor-core kernel
per matrix for 1-32 rows beside the Triton one and cuBLAS; sweep: MMA_SWEEP's launches too).
Random weights measure speed only. Results: OUT/profile.json and a table at the end.

    python3 benchmarks/profile_step.py --out DIR qwen2.5-1.5b qwen3-8b:int4
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends import kernels, mma, quant, tune  # noqa: E402
from flashdraft.backends.cuda_graphs import StepRunner  # noqa: E402
from flashdraft.backends.tune import dram_ring, graph_us, matrices  # noqa: E402
from flashdraft.config import KernelConfig  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.tools.shapes import (SHAPES, build_random_model, decode_loop,  # noqa: E402
                                     format_shape_bench, get_shape, measure_copy_bandwidth,
                                     run_shape_bench, step_bytes, time_steps)

QUANTS = ("int8", "int4", "int4-triton", "int4-mma")
CONFIGS = {"torch": KernelConfig(backend="torch"), "default": KernelConfig(),
           "no-pdl": KernelConfig(pdl=False)}
DECODE_STEPS = 128
# (16-feature tiles a block, warps along K, groups a split): launch shapes of mma.config
MMA_SWEEP = ((4, 2, 8), (4, 1, 4), (4, 1, 8), (4, 1, 12), (4, 1, 16), (4, 1, 20), (4, 1, 24),
             (4, 2, 24), (2, 1, 12), (2, 1, 16), (2, 1, 20), (8, 1, 16), (8, 1, 20))


def kernel_table(runner, cache, context: int, vocab: int, steps: int = 10) -> dict:
    """The CUDA kernels of one replayed decode step (torch.profiler, averaged over `steps`):
    the 25 costliest by name, and the first layers' and the output head's in launch order.
    Under programmatic dependent launch a kernel's time includes its wait for the one before."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, vocab, (1, 1), device="cuda")
    for _ in range(3):
        runner(tokens, context, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner(tokens, context, cache)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and e.device_time > 0), key=lambda e: e.time_range.start)
    per = defaultdict(lambda: [0, 0.0])
    for e in events:
        per[e.name[:90]][0] += 1
        per[e.name[:90]][1] += e.device_time
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in per.items()), key=lambda r: -r[2])
    per_step, sequence = len(events) // steps, []
    if per_step * steps == len(events):
        for i in list(range(min(per_step, 24))) + list(range(max(24, per_step - 4), per_step)):
            us = sum(events[s * per_step + i].device_time for s in range(steps)) / steps
            sequence.append((i, events[i].name[:40], us))
    return {"kernels_per_step": sum(r[1] for r in rows),
            "busy_us_per_step": sum(r[2] for r in rows), "rows": rows[:25], "sequence": sequence}


@torch.inference_mode()
def decode(shape: str, quant_mode: str | None, context: int, bandwidth: float,
           kc: KernelConfig, profiled: bool = False) -> dict:
    """A fresh random model of the shape under kc, its StepRunner and a filled cache: t1, t16
    (graph replays), plain decoding's tokens/s over DECODE_STEPS steps, its roofline fraction;
    with `profiled`, the kernel table of one decode step."""
    cfg = get_shape(shape)
    model = build_random_model(cfg, torch.bfloat16, "cuda", quant=quant_mode, kernel_config=kc)
    cache = KVCache.for_model(cfg, 1, -(-(context + DECODE_STEPS + 48) // 256) * 256,
                              torch.bfloat16, "cuda")
    cache.kv.normal_()
    need = step_bytes(model, cfg, context, 1, torch.bfloat16)["bytes"]
    runner = StepRunner(model, "cuda")
    t1 = time_steps(runner, cache, 1, context, cfg.vocab_size, 30)
    t16 = time_steps(runner, cache, 16, context, cfg.vocab_size, 30)
    tps = decode_loop(runner, cache, context, cfg.vocab_size, DECODE_STEPS)
    row = {"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3, "decode_tokens_per_s": tps,
           "roofline_fraction": tps * need / bandwidth, "step_fraction": need / t1 / bandwidth}
    if profiled:
        row["profile"] = kernel_table(runner, cache, context, cfg.vocab_size)
    del runner, cache, model
    torch.cuda.empty_cache()
    return row


def in_turn(shape: str, quant_mode: str | None, context: int, bandwidth: float,
            configs: dict[str, KernelConfig], repeats: int) -> dict:
    """decode() under each of `configs`, in turn `repeats` times (drift between rounds shows
    as the spread of one label's rows); the default profiled in the first round."""
    out = {label: [] for label in configs}
    for rep in range(repeats):
        for label, kc in configs.items():
            row = decode(shape, quant_mode, context, bandwidth, kc,
                         profiled=rep == 0 and label == "default")
            out[label].append(row)
            print(f"  {shape}:{quant_mode or 'bf16'} {label}: t1 {row['t1_ms']:.3f} ms, t16 "
                  f"{row['t16_ms']:.3f} ms, decode {row['decode_tokens_per_s']:.1f} tok/s = "
                  f"{100 * row['roofline_fraction']:.1f}%", flush=True)
            p = row.get("profile", {})
            for name, calls, us in p.get("rows", [])[:10]:
                print(f"      {us:8.1f} us {calls:6.1f}x  {name}")
    return out


def one_layer(shape: str) -> dict:
    """The distinct bf16 weights of a one-layer random model of the shape, by (n, k, gated)
    as the model runs them (tune.matrices)."""
    cfg = dataclasses.replace(get_shape(shape), num_layers=1)
    return matrices(build_random_model(cfg, torch.bfloat16, "cuda", fold_norms=False))


@torch.inference_mode()
def products(shape: str) -> dict:
    """cuBLAS (with silu_mul after a gated product) against the skinny kernel at the model's
    launch (the tuned table's, else the shape rule), 1 and 16 rows, weights from DRAM."""
    out = {}
    for (n, k, gated), w in one_layer(shape).items():
        ring, c = dram_ring(w), kernels.skinny_config(n, k, gated, None)
        key = kernels.table_key(n, k, gated)
        xs = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        cublas = lambda x: torch.nn.functional.linear(x, next(ring)[0])  # noqa: E731
        ref = (lambda x: kernels.silu_mul(cublas(x))) if gated else cublas
        ours = lambda x: kernels.skinny_linear(x, next(ring)[0], None, gated, c)  # noqa: E731
        row = {"cublas": graph_us(lambda: ref(xs[:1])), "skinny": graph_us(lambda: ours(xs[:1])),
               "cublas_16rows": graph_us(lambda: ref(xs[:16])),
               "skinny_16rows": graph_us(lambda: ours(xs[:16])), "config": c,
               "tuned": key in kernels.tuned_table(kernels.device_name(), None)}
        row.update({f"{m}_TBps": w.numel() * 2 / row[m] / 1e6 for m in ("cublas", "skinny")})
        out[key] = row
        print(f"  {shape} {key:>18s} cuBLAS {row['cublas']:6.1f} us ({row['cublas_TBps']:.2f} "
              f"TB/s)  skinny {row['skinny']:6.1f} us ({row['skinny_TBps']:.2f}; "
              f"{'tuned' if row['tuned'] else 'rule'} {tuple(c)}); 16 rows "
              f"{row['cublas_16rows']:.1f} / {row['skinny_16rows']:.1f} us", flush=True)
    torch.cuda.empty_cache()
    return out


def sweep_table(swept: dict, out: Path, shape: str) -> str:
    """A tuned table file: the one the default reads (shipped + user) with each swept matrix
    at its sweep's best, for KernelConfig(tuned_table=...)."""
    gpu = kernels.device_name()
    table = {**kernels.tuned_table(gpu, None), **{key: e["best"] for key, e in swept.items()}}
    path = out / f"sweep-{shape}.json"
    path.write_text(tune.format_table({gpu: dict(sorted(table.items()))}))
    return str(path)


def quantized(x: torch.Tensor, parts: tuple, n: int, c=None) -> torch.Tensor:
    """kernels.quant_linear over a quantized weight's parts: (qweight, scale[, zero])."""
    return kernels.quant_linear(x, parts[0], parts[1], parts[2] if len(parts) > 2 else None,
                                None, n, c)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def weights(shape: str):
    """A bf16 nn.Linear for each distinct weight shape of a one-layer model of the shape."""
    for w in {tuple(w.shape): w for w in one_layer(shape).values()}.values():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda",
                              dtype=torch.bfloat16)
        lin.weight.data = w
        yield lin


@torch.inference_mode()
def quant_products(shape: str, budget_s: float) -> dict:
    """kernels.quant_linear (int4 and int8) on each matrix: µs at quant_config's launch for 1
    and 16 rows, TB/s, error against the dequantized weight in float64, and the fastest of a
    sweep of column block × warps × programs at one row (budget_s seconds a matrix and mode);
    cuBLAS bf16 beside them."""
    result = {}
    for lin in weights(shape):
        n, k = lin.weight.shape
        xs = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        bf16 = dram_ring(lin.weight)
        row = {"bf16": graph_us(lambda: torch.nn.functional.linear(xs[:1], next(bf16)[0]))}
        for mode in ("int4", "int8"):
            layer = quant.QuantLinear(lin, mode, "triton")
            parts = (layer.qweight, layer.scale) + ((layer.zero,) if mode == "int4" else ())
            ring = dram_ring(*parts)
            run = lambda x, c: quantized(x, next(ring), n, c)  # noqa: E731
            rule = kernels.quant_config(n, k)
            ref = xs.double() @ layer.dequantized().double().t()
            nbytes = sum(t.numel() * t.element_size() for t in parts)
            row[mode] = graph_us(lambda: run(xs[:1], rule))
            row.update({f"{mode}_16rows": graph_us(lambda: run(xs[:16], rule)),
                        f"{mode}_TBps": nbytes / row[mode] / 1e6, f"{mode}_config": rule,
                        f"{mode}_rel_error": rel_error(run(xs, rule), ref)})
            began, timed = time.perf_counter(), []
            for (block_n, warps), programs in itertools.product(
                    ((128, 4), (256, 4), (256, 8), (128, 8)), (256, 512)):
                if time.perf_counter() - began > budget_s:
                    break
                c = kernels.quant_config(n, k, block_n, programs)._replace(num_warps=warps)
                try:
                    timed.append((graph_us(lambda: run(xs[:1], c)), c))
                except Exception as e:  # resources the compiler refuses
                    print(f"    {tuple(c)}: {type(e).__name__}", flush=True)
            row[f"{mode}_sweep"] = sorted(timed, key=lambda r: r[0])[:6]
        result[f"{n}x{k}"] = row
        print(f"  quant {shape} {n:>6d}x{k:<6d} bf16 {row['bf16']:6.1f} us | int4 "
              f"{row['int4']:6.1f} / {row['int4_16rows']:.1f} us ({row['int4_TBps']:.2f} TB/s, "
              f"err {row['int4_rel_error']:.1e}) | int8 {row['int8']:6.1f} / "
              f"{row['int8_16rows']:.1f} us ({row['int8_TBps']:.2f} TB/s) | best int4 "
              f"{row['int4_sweep'][:2]} int8 {row['int8_sweep'][:2]}", flush=True)
        torch.cuda.empty_cache()
    return result


@torch.inference_mode()
def mma_products(shape: str, sweep: bool) -> dict:
    """mma.linear on each matrix: µs for 1, 4, 16 and 32 rows at mma.config's launch, TB/s at
    one row, error against the dequantized weight; the Triton int4 kernel and cuBLAS bf16 for
    1 and 16 rows beside it; with sweep, 1 and 16 rows under each launch shape of MMA_SWEEP."""
    limit = mma.shared_limit(torch.cuda.current_device())
    result = {}
    for lin in weights(shape):
        n, k = lin.weight.shape
        xs = torch.randn(32, k, dtype=torch.bfloat16, device="cuda")
        bf16 = dram_ring(lin.weight)
        cublas = lambda x: torch.nn.functional.linear(x, next(bf16)[0])  # noqa: E731
        layer = quant.QuantLinear(lin, "int4", "mma")
        ring = dram_ring(layer.qweight, layer.scale)
        run = lambda x, c=None: mma.linear(x, *next(ring), None, n, c)  # noqa: E731
        tri = quant.QuantLinear(lin, "int4", "triton")
        tring = dram_ring(tri.qweight, tri.scale, tri.zero)
        triton_int4 = lambda x: quantized(x, next(tring), n)  # noqa: E731
        nbytes = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scale))
        ref = xs.double() @ layer.dequantized().double().t()
        row = {"rel_error": rel_error(mma.linear(xs, layer.qweight, layer.scale, None, n), ref),
               "config": dataclasses.asdict(mma.config(n, k, shared_limit=limit))}
        for m in (1, 4, 16, 32):
            row[f"mma_{m}rows"] = graph_us(lambda: run(xs[:m]))
        for m in (1, 16):
            row[f"triton_{m}rows"] = graph_us(lambda: triton_int4(xs[:m]))
            row[f"bf16_{m}rows"] = graph_us(lambda: cublas(xs[:m]))
        row["mma_TBps"] = nbytes / row["mma_1rows"] / 1e6
        if sweep:
            timed = []
            for tn, wk, gps in MMA_SWEEP:
                try:
                    c = mma.config(n, k, tn, wk, gps, shared_limit=limit)
                    timed.append((graph_us(lambda: run(xs[:1], c)),
                                  graph_us(lambda: run(xs[:16], c)), (tn, wk, gps, c.splits)))
                except Exception as e:  # shared memory or registers the launch refuses
                    timed.append((float("inf"), float("inf"),
                                  f"{(tn, wk, gps)}: {type(e).__name__}: {str(e)[:200]}"))
            row["sweep"] = sorted(timed, key=lambda r: r[0])
        result[f"{n}x{k}"] = row
        print(f"  mma {shape} {n:>6d}x{k:<6d} 1 row {row['mma_1rows']:6.1f} us "
              f"({row['mma_TBps']:.2f} TB/s) 4 {row['mma_4rows']:.1f} 16 {row['mma_16rows']:.1f} "
              f"32 {row['mma_32rows']:.1f} err {row['rel_error']:.1e} | triton "
              f"{row['triton_1rows']:.1f} / {row['triton_16rows']:.1f} bf16 "
              f"{row['bf16_1rows']:.1f} / {row['bf16_16rows']:.1f} | {row['config']}"
              + (f" | sweep {row['sweep'][:4]}" if sweep else ""), flush=True)
        torch.cuda.empty_cache()
    return result


def summary(results: dict) -> str:
    """One line a spec and configuration: medians over the rounds, decode against the default."""
    lines = [f"{'spec':22s} {'config':12s} {'t1 ms':>7s} {'t16 ms':>7s} {'tok/s':>8s} "
             f"{'roofline':>8s} {'vs default':>10s}"]
    for spec, r in results["shapes"].items():
        for runs in (r.get("compare", {}), r.get("sweep_apply", {})):
            med = {label: [statistics.median(row[key] for row in rows) for key in
                           ("t1_ms", "t16_ms", "decode_tokens_per_s", "roofline_fraction")]
                   for label, rows in runs.items()}
            for label, (t1, t16, tps, roof) in med.items():
                lines.append(f"{spec:22s} {label:12s} {t1:7.3f} {t16:7.3f} {tps:8.1f} "
                             f"{100 * roof:7.1f}% {tps / med['default'][2]:9.3f}x")
    return "\n".join(lines)


def parse_spec(spec: str) -> tuple[str, str | None]:
    shape, _, quant_mode = spec.partition(":")
    if shape not in SHAPES or (quant_mode and quant_mode not in QUANTS):
        raise SystemExit(f"error: {spec!r}: write SHAPE or SHAPE:QUANT with SHAPE one of "
                         f"{', '.join(SHAPES)} and QUANT one of {', '.join(QUANTS)}")
    return shape, quant_mode or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("shapes", nargs="+", help=f"SHAPE or SHAPE:QUANT ({', '.join(QUANTS)})")
    ap.add_argument("--out", type=Path, default=Path("results/profile"))
    ap.add_argument("--context", type=int, default=512, help="cached positions before a step")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of compare and --sweep-apply")
    ap.add_argument("--no-official", action="store_true", help="skip run_shape_bench")
    ap.add_argument("--no-compare", action="store_true", help="skip compare and products")
    ap.add_argument("--sweep", type=float, default=0.0, metavar="S")
    ap.add_argument("--sweep-match", default="", metavar="TEXT",
                    help="sweep only matrices whose table key (e.g. '8960x1536 gated') holds TEXT")
    ap.add_argument("--sweep-apply", action="store_true")
    ap.add_argument("--sweep-write", type=Path, default=None, metavar="JSON",
                    help="merge the winners into this tuned table where they beat the current "
                         "launch by over 1 %%")
    ap.add_argument("--quant-products", type=float, default=0.0, metavar="S")
    ap.add_argument("--mma-products", choices=["default", "sweep"], default=None)
    args = ap.parse_args()
    specs = [(spec, *parse_spec(spec)) for spec in args.shapes]
    if not torch.cuda.is_available():
        raise SystemExit("error: profile_step.py measures GPU kernels and needs CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_copy_bandwidth("cuda")
    gpu = torch.cuda.get_device_name()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {gpu}", flush=True)
    results = {"command": sys.argv, "gpu": gpu, "torch": torch.__version__,
               "copy_bandwidth_Bps": bandwidth,
               "configs": {k: dataclasses.asdict(c) for k, c in CONFIGS.items()}, "shapes": {}}
    for spec, shape, quant_mode in specs:
        began, r = time.perf_counter(), {}
        results["shapes"][spec] = r
        if not args.no_official:
            r["official"] = run_shape_bench(shape, "bfloat16", quant_mode, "cuda",
                                            context=args.context, bandwidth=bandwidth)
            print(format_shape_bench(r["official"]), flush=True)
        if not args.no_compare:
            r["compare"] = in_turn(shape, quant_mode, args.context, bandwidth, CONFIGS,
                                   args.repeats)
            if not quant_mode:
                r["products_us"] = products(shape)
        if args.sweep and quant_mode:
            print(f"  --sweep tunes bf16 products only: skipped for {spec}", flush=True)
        elif args.sweep:
            r["sweep"] = tune.sweep(get_shape(shape), args.sweep, args.sweep_match, label=shape,
                                    log=lambda s: print(s, flush=True))
            if args.sweep_apply and r["sweep"]:
                table = sweep_table(r["sweep"], args.out, shape)
                r["sweep_apply"] = in_turn(
                    shape, None, args.context, bandwidth,
                    {"default": KernelConfig(), "sweep best": KernelConfig(tuned_table=table)},
                    args.repeats)
            if args.sweep_write:
                written = tune.merge(args.sweep_write, r["sweep"], kernels.device_name())
                r["sweep_written"] = written
                print(f"  wrote {len(written)} entries to {args.sweep_write}: {written}",
                      flush=True)
        if args.quant_products:
            r["quant_products"] = quant_products(shape, args.quant_products)
        if args.mma_products:
            r["mma_products"] = mma_products(shape, args.mma_products == "sweep")
        r["seconds"] = time.perf_counter() - began
        (args.out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()
    print(summary(results))


if __name__ == "__main__":
    main()
