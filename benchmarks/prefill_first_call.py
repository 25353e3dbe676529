"""What a prompt length's first prefill costs beyond its later ones (GPU, random weights).

A server meets new prompt lengths all the time: whatever an attention backend prepares per new
shape (or per cache layout: a longer request makes a larger cache) lands in that request's
TTFT. For each prefill path (`model.CAUSAL_PREFILL`: SDPA with its own causal mask, or with an
explicit boolean mask; `model.PREFILL_SDPA_BACKENDS`: ours, or any SDPA backend) this times, for
lengths that path has not seen: the first prefill, the same again, and the same length once more
into a cache of another size (another layout), plus which attention kernels the path runs; then
the engine's prefill as graphs per padded length (`cuda_graphs.prefill`); then where a repeated
eager prefill's time goes (wall against GPU busy time, the costliest host ops, the same prefill
in PyTorch ops only and as one replayed CUDA graph).

    PYTHONPATH=. python3 benchmarks/prefill_first_call.py --shape qwen2.5-1.5b --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends import kernels  # noqa: E402
from flashdraft import model as model_module  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.tools.shapes import build_random_model, get_shape  # noqa: E402


def wall_ms(fn) -> float:
    """Wall time of fn() in ms, from an idle GPU until the GPU is done."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def prefill_ms(model, cache, tokens: torch.Tensor) -> float:
    n = tokens.shape[1]
    return wall_ms(lambda: model(tokens, torch.arange(n, device="cuda")[None], cache, kv_len=n,
                                 last_only=True))


def attention_kernels(model, cache, tokens: torch.Tensor) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_ms(model, cache, tokens)
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(n[:120] for n in names if any(w in n.lower() for w in
                                                ("attn", "fmha", "flash", "cudnn", "sdpa",
                                                 "softmax", "attention")))


def where_time_goes(model, cache, tokens: torch.Tensor) -> dict:
    """A repeated prefill (the default path) under torch.profiler: its wall time against the
    GPU's busy time and kernel count (what launching costs), and the host ops that take the
    most time of their own."""
    from torch.profiler import ProfilerActivity, profile
    wall = _median_wall(model, cache, tokens, contextlib.nullcontext)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_ms(model, cache, tokens)
    gpu = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    return {"tokens": tokens.shape[1], "wall_ms": wall, "kernels": len(gpu),
            "gpu_busy_ms": sum(e.device_time for e in gpu) / 1e3,
            "host_self_ms": [(a.key[:60], a.count, a.self_cpu_time_total / 1e3) for a in host],
            "torch_ops_ms": _median_wall(model, cache, tokens, kernels.disabled),
            "graph_replay_ms": _graph_replay_ms(model, cache, tokens)}


def _graph_replay_ms(model, cache, tokens: torch.Tensor) -> float | str:
    try:
        return _graph_replay(model, cache, tokens)
    except RuntimeError as e:  # a capture failure is a finding, not a reason to lose the rest
        torch.cuda.synchronize()
        return f"capture failed: {str(e)[:200]}"


def _median_wall(model, cache, tokens: torch.Tensor, context) -> float:
    with context():
        for _ in range(2):
            prefill_ms(model, cache, tokens)
        return statistics.median(prefill_ms(model, cache, tokens) for _ in range(5))


def _graph_replay(model, cache, tokens: torch.Tensor) -> float:
    """The same prefill captured as one CUDA graph (StepRunner's, at the prompt's own length,
    unpadded) and replayed: the time without the host's launches."""
    from flashdraft.backends.cuda_graphs import StepRunner

    n = tokens.shape[1]
    runner = StepRunner(model, "cuda")
    runner.prefill(tokens, n, cache)  # captures
    return statistics.median(wall_ms(lambda: runner.prefill(tokens, n, cache)) for _ in range(7))


def graph_prefills(model, cache, vocab: int, lengths: int) -> dict:
    """The engine's prefill (`cuda_graphs.prefill`: padded to `prefill_length`, one CUDA graph
    per padded length): new lengths of 150-217 tokens (one padded length, 256), the first (which
    captures that length's graph the first time) and again; and 200 tokens, again."""
    from flashdraft.backends.cuda_graphs import StepRunner, prefill

    runner = StepRunner(model, "cuda")

    def ms(n: int) -> float:
        prompt = torch.randint(0, vocab, (n,)).tolist()
        return wall_ms(lambda: prefill(model, prompt, cache, (), runner, "cuda"))
    rows = [{"tokens": n, "first_ms": ms(n), "again_ms": ms(n)}
            for n in range(150, 150 + 9 * lengths, 9)]
    summary = {k: statistics.median(r[k] for r in rows[1:]) for k in ("first_ms", "again_ms")}
    summary["capture_ms"] = rows[0]["first_ms"]
    summary["200_tokens_ms"] = statistics.median(ms(200) for _ in range(5))
    print(f"graph prefill (padded to 256): the first length {summary['capture_ms']:.1f} ms "
          f"(capture), later new lengths median {summary['first_ms']:.1f} ms, again "
          f"{summary['again_ms']:.1f} ms; 200 tokens {summary['200_tokens_ms']:.2f} ms", flush=True)
    return {"rows": rows, "median": summary, "captures": runner.stats.captures}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--lengths", type=int, default=8, help="new lengths per path")
    ap.add_argument("--out", default="prefill-out")
    args = ap.parse_args()
    if not 1 <= args.lengths <= 30:
        raise SystemExit(f"--lengths must be 1..30 (each path's lengths fit the 256 cache), "
                         f"got {args.lengths}")
    cfg = get_shape(args.shape)
    model = build_random_model(cfg, torch.bfloat16, "cuda")
    caches = {size: KVCache.for_model(cfg, 1, size, torch.bfloat16, "cuda") for size in (256, 512)}
    result = {"shape": args.shape, "gpu": torch.cuda.get_device_name(), "paths": {}}
    default = model_module.PREFILL_SDPA_BACKENDS
    paths = {"mask, any backend": (False, None), "causal, any backend": (True, None),
             "mask (default backends)": (False, default), "causal (default)": (True, default)}
    for p, (name, (causal, backends)) in enumerate(paths.items()):
        model_module.CAUSAL_PREFILL = causal
        model_module.PREFILL_SDPA_BACKENDS = backends
        warm = torch.randint(0, cfg.vocab_size, (1, 100), device="cuda")
        for cache in caches.values():  # the path's one-time costs (compilation, workspaces)
            prefill_ms(model, cache, warm)
        rows = []
        for i in range(args.lengths):
            n = 120 + p * 30 + i  # lengths no path has seen (< 256, the smaller cache)
            tokens = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
            first = prefill_ms(model, caches[512], tokens)
            again = prefill_ms(model, caches[512], tokens)
            other_cache = prefill_ms(model, caches[256], tokens)
            rows.append({"tokens": n, "first_ms": first, "again_ms": again,
                         "other_cache_ms": other_cache})
        kernels = attention_kernels(model, caches[512], warm)
        summary = {k: statistics.median(r[k] for r in rows)
                   for k in ("first_ms", "again_ms", "other_cache_ms")}
        result["paths"][name] = {"rows": rows, "median": summary, "attention_kernels": kernels}
        print(f"{args.shape} {name}: median first {summary['first_ms']:.1f} ms, again "
              f"{summary['again_ms']:.1f} ms, first into another cache size "
              f"{summary['other_cache_ms']:.1f} ms; kernels: {kernels}", flush=True)
    model_module.CAUSAL_PREFILL, model_module.PREFILL_SDPA_BACKENDS = True, default
    result["paths"]["graphs"] = graph_prefills(model, caches[512], cfg.vocab_size, args.lengths)
    tokens = torch.randint(0, cfg.vocab_size, (1, 200), device="cuda")
    result["where_time_goes"] = w = where_time_goes(model, caches[512], tokens)
    print(f"{args.shape} default path, {w['tokens']} tokens again: wall {w['wall_ms']:.1f} ms, "
          f"GPU busy {w['gpu_busy_ms']:.1f} ms in {w['kernels']} kernels; host ops (self ms): "
          + ", ".join(f"{k} x{c} {ms:.1f}" for k, c, ms in w["host_self_ms"])
          + f"; the same in PyTorch ops only {w['torch_ops_ms']:.1f} ms, as one CUDA graph "
          f"replayed {w['graph_replay_ms']} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_first_call.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
