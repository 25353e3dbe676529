"""Where a decode step's time goes, and what each fast-path piece buys (random weights, GPU).

For each shape: the official figures (`run_shape_bench`: step cost curve, roofline fraction,
drafter step) with the default fast path, then the same target under three settings, each a
fresh StepRunner (graphs captured under the setting):
  torch        the PyTorch path (FLASHDRAFT_KERNELS=torch): cuBLAS + PyTorch ops
  fused        flashdraft.kernels (fused norm+residual, rope+cache write, split-K attention,
               SiLU·up), cuBLAS products
  fused+skinny as fused, and products of up to 32 rows through kernels._skinny_kernel
  fused+skinny+pdl  as fused+skinny, the Triton kernels launched with programmatic
               dependent launch (the default)
and a kernel table of one replayed decode step (torch.profiler), and cuBLAS against the skinny
kernel for every matrix shape of the model (µs, each in a graph of 20 back-to-back calls).

Random weights measure speed only; acceptance is not measured.

    PYTHONPATH=. python3 benchmarks/profile_step.py --out DIR qwen2.5-1.5b qwen3-8b qwen3-32b:int4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft import kernels  # noqa: E402
from flashdraft.cuda_graphs import StepRunner  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.shapes import (_decode_loop, _time_steps, build_random_model,  # noqa: E402
                               format_shape_bench, get_shape, graph_replay_us,
                               measure_copy_bandwidth, run_shape_bench, step_bytes)

SETTINGS = {"torch": (False, False, False), "fused": (True, False, False),
            "fused+skinny": (True, True, False), "fused+skinny+pdl": (True, True, True)}
DEFAULT = "fused+skinny+pdl"


def set_path(name: str) -> None:
    kernels._enabled, kernels.SKINNY, kernels.PDL = SETTINGS[name]


def graph_us(fn) -> float:
    """µs per call of fn: 20 back-to-back calls in one graph, median of 20 replays."""
    return graph_replay_us(fn, calls=20, repeats=20, warmup=1)


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
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            per[e.name[:90]][0] += 1
            per[e.name[:90]][1] += e.device_time
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in per.items()), key=lambda r: -r[2])
    return {"kernels_per_step": sum(r[1] for r in rows), "busy_us_per_step": sum(r[2] for r in rows),
            "rows": rows[:25]}


@torch.inference_mode()
def compare(shape: str, quant: str | None, context: int, bandwidth: float) -> dict:
    cfg = get_shape(shape)
    model = build_random_model(cfg, torch.bfloat16, "cuda", quant=quant)
    cache = KVCache.for_model(cfg, 1, 1024, torch.bfloat16, "cuda")
    cache.kv.normal_()
    need = step_bytes(model, cfg, context, 1, torch.bfloat16)
    out = {"roofline_tokens_per_s": bandwidth / need["bytes"], "settings": {}}
    for name in SETTINGS:
        set_path(name)
        runner = StepRunner(model, "cuda")
        t1 = _time_steps(runner, cache, 1, context, cfg.vocab_size, 30)
        t16 = _time_steps(runner, cache, 16, context, cfg.vocab_size, 30)
        tps = _decode_loop(runner, cache, context, cfg.vocab_size, 128)
        out["settings"][name] = {"t1_ms": t1 * 1e3, "t16_ms": t16 * 1e3, "t16_over_t1": t16 / t1,
                                 "decode_tokens_per_s": tps,
                                 "roofline_fraction": tps / out["roofline_tokens_per_s"],
                                 "step_roofline_fraction": need["bytes"] / t1 / bandwidth}
        if name in (DEFAULT, "torch"):
            out["settings"][name]["profile"] = kernel_table(runner, cache, context, cfg.vocab_size)
        del runner
    set_path(DEFAULT)
    # products: cuBLAS against the one-row kernel, per distinct plain Linear shape
    mats = {}
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mats.setdefault(tuple(mod.weight.shape), mod)
    out["products_us"] = {}
    for (n, k), mod in mats.items():
        x = torch.randn(1, 1, k, dtype=torch.bfloat16, device="cuda")
        cublas = graph_us(lambda: torch.nn.functional.linear(x, mod.weight, mod.bias))
        gemv = graph_us(lambda: kernels.linear(x, mod))
        x9 = torch.randn(1, 9, k, dtype=torch.bfloat16, device="cuda")
        cublas9 = graph_us(lambda: torch.nn.functional.linear(x9, mod.weight, mod.bias))
        gemv9 = graph_us(lambda: kernels.linear(x9, mod))
        nbytes = mod.weight.numel() * 2
        out["products_us"][f"{n}x{k}"] = {"cublas": cublas, "gemv": gemv, "cublas_9rows": cublas9,
                                          "skinny_9rows": gemv9,
                                          "cublas_TBps": nbytes / cublas / 1e6,
                                          "gemv_TBps": nbytes / gemv / 1e6,
                                          "config": kernels.skinny_config(n, k)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="SHAPE or SHAPE:QUANT (int4, int8, int4-hybrid)")
    ap.add_argument("--out", default="profile-out")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--no-official", action="store_true")
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
        if not args.no_official:
            set_path(DEFAULT)
            r["official"] = run_shape_bench(shape, "bfloat16", quant, "cuda", context=args.context,
                                            bandwidth=bandwidth)
            print(format_shape_bench(r["official"]), flush=True)
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
            print(f"  {spec} {mat:>12s} cuBLAS {p['cublas']:6.1f} us ({p['cublas_TBps']:.2f} TB/s)"
                  f"  skinny {p['gemv']:6.1f} us ({p['gemv_TBps']:.2f} TB/s); 9 rows: cuBLAS "
                  f"{p['cublas_9rows']:.1f} skinny {p['skinny_9rows']:.1f} us; config {p['config']}",
                  flush=True)
        r["seconds"] = time.perf_counter() - began
        results["shapes"][spec] = r
        (out / "profile.json").write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
