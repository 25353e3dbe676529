"""Everything the GPU fast path needs measured, in one run on one GPU (issue 5).

    PYTHONPATH=. python3 benchmarks/gpu_fastpath.py --out $OUT [--budget 540] [--quick]
        [--no-compile]

1. ceilings: device-to-device copy bandwidth, a weight-streaming bf16 GEMV;
2. correctness: graph vs eager greedy tokens on a random model; quantized kernels vs the
   reference (dequantize + matmul) on random inputs;
3. quantized matmul micro-benchmark for 1 … 32 rows (bf16 / int8 Triton / int4 Triton / int4
   tinygemm), and decode attention over the static cache (masked SDPA at several kv_len);
4. synthetic shapes with random weights (flashdraft.tools.shapes): plain decode tokens/s and
   roofline fraction, step cost curve, drafter step — bf16 / int8 / int4, graphs on and off,
   and torch.compile where the budget allows.
Results go to OUT/gpu_fastpath.json (rewritten after every item, so a run cut short keeps what
it measured) and a short table is printed last. Random weights: acceptance is not measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends import quant
from flashdraft.tools import shapes  # noqa: E402
from flashdraft.backends.cuda_graphs import StepRunner  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402

RESULTS: dict = {"items": {}, "errors": {}, "skipped": []}
ONLY: list[str] = []  # --only: run just these items (name prefixes)
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def save(out: Path) -> None:
    RESULTS["elapsed_s"] = elapsed()
    (out / "gpu_fastpath.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def item(name: str, out: Path, budget: float, cost: float):
    """Run the decorated function as one item unless the budget would be exceeded."""
    def wrap(fn):
        if ONLY and not any(name.startswith(o) for o in ONLY):
            return None
        if elapsed() + cost > budget:
            RESULTS["skipped"].append(name)
            print(f"[skip] {name}: {elapsed():.0f}s used of {budget:.0f}s", flush=True)
            return None
        began = time.perf_counter()
        print(f"[run ] {name} at {elapsed():.0f}s", flush=True)
        try:
            RESULTS["items"][name] = fn()
        except Exception as e:  # one failed item must not cost the rest of the run
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"[done] {name} in {time.perf_counter() - began:.1f}s", flush=True)
        save(out)
        return RESULTS["items"].get(name)
    return wrap


def bench_us(fn, reps: int = 50) -> float:
    """Median µs of fn() replayed from a CUDA graph (launch overhead excluded, as in a step)."""
    return shapes.graph_replay_us(fn, calls=10, repeats=reps, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later items are skipped")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats (smoke run)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated item names (prefixes) to run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget
    ONLY[:] = [x.strip() for x in args.only.split(",") if x.strip()]
    dev = torch.device("cuda")
    import triton
    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cuda": torch.version.cuda, "triton": triton.__version__,
                      "command": " ".join(sys.argv)}
    print(RESULTS["env"], flush=True)

    @item("ceilings", out, budget, 10)
    def ceilings():
        bw = shapes.measure_copy_bandwidth(dev)
        w = torch.randn(28672, 8192, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, 8192, device=dev, dtype=torch.bfloat16)
        us = bench_us(lambda: torch.nn.functional.linear(x, w))
        return {"copy_Bps": bw, "gemv_8192x28672_us": us,
                "gemv_Bps": w.numel() * 2 / (us * 1e-6)}
    bandwidth = (ceilings or {}).get("copy_Bps")

    @item("graph_vs_eager_greedy", out, budget, 30)
    def graph_vs_eager():
        """Greedy speculative-style decoding on random models, graph replay vs eager: steps of
        1 token and verification steps of 4 (last token + 3 made-up drafts, prefix-matched,
        cache rolled back by position), 120 tokens. Same tokens on both paths?"""
        res = {}
        for name, dtype in (("qwen3-0.6b", torch.bfloat16), ("qwen2.5-0.5b", torch.float32)):
            cfg = shapes.get_shape(name)
            model = shapes.build_random_model(cfg, dtype, dev, seed=5)
            with torch.no_grad():  # N(0, 0.02) gives flat logits: sharpen them
                model.embed.weight.mul_(20)
            runs = []
            for graphs in (True, False):
                runner = StepRunner(model, dev, enabled=graphs)
                cache = KVCache.for_model(cfg, 1, 512, dtype, dev)
                seq = list(range(100, 140))
                with torch.inference_mode():
                    logits, _ = runner(torch.tensor([seq], device=dev), 0, cache, last_only=True)
                    seq.append(int(logits[0, -1].argmax()))
                    accepted = 0
                    while len(seq) < 160:
                        drafts = ([] if len(seq) % 2
                                  else [(seq[-1] * 7 + i) % 1000 for i in range(3)])
                        if len(seq) % 5 == 0 and drafts:  # sometimes a right first draft
                            drafts[0] = seq[-1]
                        feed = torch.tensor([[seq[-1]] + drafts], device=dev)
                        logits, _ = runner(feed, len(seq) - 1, cache)
                        best = logits[0].argmax(-1).tolist()
                        n = 0
                        while n < len(drafts) and drafts[n] == best[n]:
                            n += 1
                        accepted += n
                        seq += drafts[:n] + [best[n]]
                runs.append(seq)
            res[name] = {"dtype": str(dtype), "identical": runs[0] == runs[1],
                         "first_difference": next((i for i, (a, b) in enumerate(zip(*runs))
                                                   if a != b), None)}
            del model
        return res

    @item("quant_correctness_and_microbench", out, budget, 60)
    def quant_bench():
        rows = (1, 2, 4, 8, 16, 32)
        layer_shapes = [(1536, 17920), (8960, 1536), (4096, 6144), (4096, 24576), (12288, 4096),
                        (25600, 5120)]
        if args.quick:
            layer_shapes = layer_shapes[:4]
        table = []
        try:
            torch._weight_int8pack_mm(torch.randn(1, 128, device=dev, dtype=torch.bfloat16),
                                      torch.zeros(128, 128, device=dev, dtype=torch.int8),
                                      torch.ones(128, device=dev, dtype=torch.bfloat16))
            int8pack = "available on CUDA"
        except Exception as e:
            int8pack = f"not available on CUDA: {type(e).__name__}: {str(e)[:120]}"
        for k, n in layer_shapes:
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            torch.nn.init.normal_(lin.weight, 0, 0.02)
            variants = {"bf16": lambda x: lin(x)}
            if "available" in int8pack:  # torch's built-in weight-only int8 product
                q8, s8 = quant.quantize_int8(lin.weight)
                s8 = s8.to(torch.bfloat16)
                variants["int8-torch"] = lambda x: torch._weight_int8pack_mm(x, q8, s8)
            errors = {}
            for mode, backend in (("int8", "triton"), ("int4", "triton"), ("int4", "mma"),
                                  ("int4", "tinygemm")):
                try:
                    layer = quant.QuantLinear(lin, mode, backend)
                except Exception as e:
                    errors[f"{mode}-{backend}"] = f"{type(e).__name__}: {e}"
                    continue
                wq = layer.dequantized(torch.bfloat16).double()
                for m in (1, 16, 32):
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    ref = x.double() @ wq.t()
                    y = layer(x).double()
                    errors.setdefault(f"{mode}-{backend}", 0.0)
                    rel = ((y - ref).norm() / ref.norm()).item()
                    errors[f"{mode}-{backend}"] = max(errors[f"{mode}-{backend}"], rel) \
                        if rel == rel else float("nan")
                variants[f"{mode}-{backend}"] = layer
            row = {"k": k, "n": n, "max_rel_error_vs_reference": errors, "us": {}, "GBps": {}}
            for name, fn in variants.items():
                nbytes = {"bf16": k * n * 2, "int8-torch": k * n}.get(name) or \
                    quant.weight_bytes(torch.nn.ModuleList([fn]))
                for m in rows:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    try:
                        us = bench_us(lambda: fn(x))
                    except Exception as e:
                        row["us"][f"{name}/{m}"] = f"{type(e).__name__}: {str(e)[:100]}"
                        continue
                    row["us"][f"{name}/{m}"] = us
                    row["GBps"][f"{name}/{m}"] = nbytes / (us * 1e-6) / 1e9
            table.append(row)
            variants.clear()  # the layers' memory, before the next shape
            torch.cuda.empty_cache()
        return {"int8pack_mm": int8pack, "layers": table}

    @item("attention", out, budget, 20)
    def attention():
        """One layer's decode / verification attention over the static cache (8B shape:
        32 q heads, 8 kv heads of 128), boolean position mask as the model builds it."""
        import torch.nn.functional as F
        res = {}
        for kv_len in (768, 4096, 16384):
            k = torch.randn(1, 8, kv_len, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for t in (1, 16):
                q = torch.randn(1, 32, t, 128, device=dev, dtype=torch.bfloat16)
                pos = torch.arange(kv_len - 256 - t, kv_len - 256, device=dev).view(1, t)
                mask = (torch.arange(kv_len, device=dev) <= pos.unsqueeze(-1)).unsqueeze(1)
                us = bench_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                     enable_gqa=True))
                # The query heads of a group folded into the query length: no enable_gqa, so
                # the memory-efficient kernel can take the mask.
                qf = q.view(1, 8, 4 * t, 128)
                mf = mask.repeat(1, 1, 4, 1)
                fold = lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=mf)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                err = ((fold().view_as(ref).float() - ref.float()).norm()
                       / ref.float().norm()).item()
                need = 2 * 8 * (kv_len - 256) * 128 * 2
                res[f"kv{kv_len}/T{t}"] = {"us": us, "GBps_of_needed": need / (us * 1e-6) / 1e9,
                                           "folded_us": bench_us(fold), "folded_rel_error": err}
        return res

    plan = [  # (name, shape, quant, graphs, compile, steps, est. seconds), most wanted first;
        # compiled runs last: compilation took 131 s for the 1.5B shape on an H200.
        ("qwen2.5-1.5b bf16", "qwen2.5-1.5b", None, True, False, shapes.STEP_TOKENS, 10),
        ("qwen3-8b bf16", "qwen3-8b", None, True, False, shapes.STEP_TOKENS, 15),
        ("qwen3-32b int4", "qwen3-32b", "int4", True, False, shapes.STEP_TOKENS, 30),
        ("dense-27b int4", "dense-27b", "int4", True, False, shapes.STEP_TOKENS, 25),
        ("qwen3-8b int4", "qwen3-8b", "int4", True, False, (1, 16), 10),
        ("qwen3-8b int8", "qwen3-8b", "int8", True, False, (1, 16), 10),
        ("qwen2.5-1.5b bf16 eager", "qwen2.5-1.5b", None, False, False, (1, 16), 10),
        ("qwen3-32b bf16", "qwen3-32b", None, True, False, (1, 16), 20),
        ("qwen3-8b int4 hybrid", "qwen3-8b", "int4-hybrid", True, False, (1, 16), 10),
        ("qwen3-32b int4 hybrid", "qwen3-32b", "int4-hybrid", True, False, (1, 16), 25),
        ("qwen2.5-1.5b bf16 compiled", "qwen2.5-1.5b", None, True, True, (1, 16), 140),
        ("qwen3-8b bf16 compiled", "qwen3-8b", None, True, True, (1, 16), 160),
    ]
    if args.quick:
        plan = [p for p in plan if p[0] in ("qwen2.5-1.5b bf16", "qwen3-8b int4")]
    if args.no_compile:
        plan = [p for p in plan if not p[4]]
    for name, shape, q, graphs, comp, steps, cost in plan:
        @item(f"shape {name}", out, budget, cost)
        def run_shape():
            r = shapes.run_shape_bench(shape, "bfloat16", q, "cuda", cuda_graphs=graphs,
                                       compile=comp, step_tokens=steps, bandwidth=bandwidth,
                                       repeats=10 if args.quick else 30,
                                       draft=not comp and graphs)
            print(shapes.format_shape_bench(r), flush=True)
            return r

    save(out)
    print_table()


def print_table() -> None:
    items = RESULTS["items"]
    print("\n==== gpu_fastpath summary (random weights: speed only, acceptance not measured) ====")
    env = RESULTS.get("env", {})
    print(f"{env.get('gpu')} torch {env.get('torch')} triton {env.get('triton')}; "
          f"elapsed {elapsed():.0f}s")
    c = items.get("ceilings")
    if c:
        print(f"copy {c['copy_Bps'] / 1e12:.2f} TB/s; bf16 GEMV 8192x28672: "
              f"{c['gemv_8192x28672_us']:.1f} us = {c['gemv_Bps'] / 1e12:.2f} TB/s")
    g = items.get("graph_vs_eager_greedy")
    if g:
        print("graph vs eager greedy: " + ", ".join(f"{k} {v['dtype']}: "
              f"{'identical' if v['identical'] else 'DIFFER at ' + str(v['first_difference'])}"
              for k, v in g.items()))
    qb = items.get("quant_correctness_and_microbench")
    if qb:
        print(f"_weight_int8pack_mm: {qb['int8pack_mm']}")
        print("quant matmul (us; rows 1/16/32) and max rel. error vs reference:")
        for row in qb["layers"]:
            cells = []
            for name in ("bf16", "int8-torch", "int8-triton", "int4-triton", "int4-tinygemm"):
                t = [row["us"].get(f"{name}/{m}") for m in (1, 16, 32)]
                if all(isinstance(x, float) for x in t):
                    cells.append(f"{name} {t[0]:.1f}/{t[1]:.1f}/{t[2]:.1f}")
            errs = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} ERR"
                             for k, v in row["max_rel_error_vs_reference"].items())
            print(f"  {row['k']}x{row['n']}: " + "; ".join(cells) + f" | {errs}")
    at = items.get("attention")
    if at:
        print("attention 1 layer (8B heads), masked GQA SDPA vs heads folded into T: " + ", ".join(
            f"{k} {v['us']:.1f}/{v.get('folded_us', float('nan')):.1f}us" for k, v in at.items()))
    print(f"{'shape':34s} {'tok/s':>8s} {'roofline':>8s} {'%':>6s} {'t1 ms':>7s} {'t16/t1':>6s} "
          f"{'t32/t1':>6s} {'draft ms':>8s}")
    for name, r in items.items():
        if not name.startswith("shape ") or not r:
            continue
        curve = r["step_curve"]
        t1 = curve.get(1, curve.get("1"))["ms"]
        t16 = curve.get(16, curve.get("16"), ) or {}
        t32 = curve.get(32, curve.get("32")) or {}
        print(f"{name[6:]:34s} {r['decode_tokens_per_s']:8.1f} {r['roofline_tokens_per_s']:8.0f} "
              f"{100 * r['roofline_fraction']:6.1f} {t1:7.3f} "
              f"{(t16.get('ms', float('nan')) / t1):6.2f} "
              f"{(t32.get('ms', float('nan')) / t1):6.2f} "
              f"{r.get('drafter', {}).get('step_ms', float('nan')):8.3f}"
              + (f"  capture+compile {r['capture_s']:.0f}s" if r["compile"] else ""))
    if RESULTS["errors"]:
        print("errors: " + "; ".join(f"{k}: {v[:200]}" for k, v in RESULTS["errors"].items()))
    if RESULTS["skipped"]:
        print("skipped (budget): " + ", ".join(RESULTS["skipped"]))


if __name__ == "__main__":
    main()
