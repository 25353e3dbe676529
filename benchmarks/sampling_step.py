"""What sampling adds to a step, on the GPU: the posts the engine runs inside its graphs.

Times, as CUDA graphs of the post alone on random logits of a real vocabulary (no model):
greedy verification (`greedy_result`), a plain sampled token (`SampledPick`) and sampled
verification against a draft's logits and one-hot drafts (`SampledVerify`) with the fused
kernels, for k = 3, 5, 8 drafts; and, launched eagerly, the sorting PyTorch reference
(`probs_from_logits`, `verify_sampled`: what sampled steps ran before the fused path). The model's
step (~1.7 ms for the 1.5B example on an H100) is what these add to.

    python benchmarks/sampling_step.py --vocab 151936 --out results/sampling-step.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashdraft.sampling import SampledPick, make_rng, probs_from_logits, sample
from flashdraft.verify import SampledVerify, greedy_result, verify_sampled


def graph_us(fn, *args, repeats: int = 200) -> float:
    """Microseconds per replay of fn(*args) captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def kernel_table(fn, *args, repeats: int = 20) -> str:
    """The GPU kernels of fn(*args)'s graph by time per replay (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / repeats, e.count // repeats)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return "\n".join(f"    {us:7.1f} us  x{n}  {name[:70]}" for name, us, n in rows)


def eager_us(fn, repeats: int = 50) -> float:
    """Microseconds per call of fn() launched from Python, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--rows", choices=["flat", "peaked"], default="flat",
                    help="flat: randn x 3 (top-p keeps tens of thousands of tokens); peaked: "
                         "one token 12 nats above randn x 3 rows, as at most positions of code")
    ap.add_argument("--profile", action="store_true",
                    help="also print each post's kernels by GPU time (torch.profiler)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampling_step.py times CUDA graphs: it needs a GPU")
    dev = torch.device("cuda")
    filt = (args.temperature, args.top_k, args.top_p, 0.0)  # min_p 0
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, tables = {}, {}
    for k in (0, 3, 5, 8):
        logits = torch.randn(1, k + 1, args.vocab, device=dev, generator=gen) * 3
        if args.rows == "peaked":
            logits[0, :, 7] = logits.amax(-1)[0] + 12
        tokens = torch.randint(0, args.vocab, (1, k + 1), device=dev, generator=gen)
        q_logits = torch.randn(k, args.vocab, device=dev, generator=gen) * 3
        rng = make_rng(0, dev)
        if k == 0:
            pick = SampledPick(*filt, rng, fused=True)
            rows["plain token, fused (graph)"] = graph_us(pick, tokens, logits)
            if args.profile:
                tables["plain token"] = kernel_table(pick, tokens, logits)
            rows["plain token, sorting reference (eager)"] = eager_us(
                lambda: sample(probs_from_logits(logits[0], *filt)))
            continue
        rows[f"k={k} greedy verification (graph)"] = graph_us(greedy_result, tokens, logits)
        for with_q in (True, False):
            post = SampledVerify(*filt, rng, fused=True, vocab=args.vocab, with_q=with_q,
                                 capacity=k)
            if with_q:
                post.load(q_logits)
            name = f"k={k} sampled verification, {'q' if with_q else 'one-hot'}, fused"
            rows[f"{name} (graph)"] = graph_us(post, tokens, logits)
            if args.profile and k == 5:
                tables[name] = kernel_table(post, tokens, logits)
        q = probs_from_logits(q_logits[None], *filt)
        rows[f"k={k} sampled verification, q, sorting reference (eager)"] = eager_us(
            lambda: verify_sampled(tokens[:, 1:], q, probs_from_logits(logits, *filt)))
    width = max(map(len, rows))
    print(f"{torch.cuda.get_device_name()}, vocab {args.vocab}, T {args.temperature}, "
          f"top-k {args.top_k}, top-p {args.top_p}, {args.rows} rows: microseconds per replay")
    for key, us in rows.items():
        print(f"  {key:<{width}}  {us:8.1f}")
    for key, table in tables.items():
        print(f"  kernels of {key}:\n{table}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                              "args": vars(args), "us": rows,
                                              "kernels": tables}, indent=1))


if __name__ == "__main__":
    main()
