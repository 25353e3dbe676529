"""The gated delta rule of one DeltaNet layer's step, on the GPU: the PyTorch token loop against
the step kernel.

Times, with CUDA events, `GatedDeltaNet.rule` for one layer at a shape (default Qwen3.5-27B:
16 key heads, 48 value heads, d_k = d_v = 128) on random inputs laid out as the layer hands
them over (views of a bfloat16 projection), for steps of T = 1, 4, 8, 16 tokens that keep every
state in a ring of 16 slots: under `KernelConfig(backend="torch")` (the L2 norms, the heads'
repeat and `delta_rule_recurrent`, a few launches per token) and under the default (one
`deltanet_kernels.delta_rule_step`), and the kernel at each BLOCK_V (columns of S per
program) beside `block_v`'s choice. Both write every token's state, so the kernel's floor is
that traffic: T × v_heads × d_k × d_v × 4 bytes (3 MB a token at the default shape).

    python benchmarks/deltanet_step.py --out results/deltanet-step.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashdraft.backends import deltanet_kernels
from flashdraft.config import KernelConfig
from flashdraft.hybrid import GatedDeltaNet, StepSlots

STEPS = 16  # the ring's slots: a verification of up to 15 drafts
LENGTHS = (1, 4, 8, 16)
BLOCKS = (16, 32, 64)


def event_us(fn, repeats: int = 100) -> float:
    """Microseconds per call of fn() between CUDA events, as a CUDA graph of `repeats` calls
    (as the engine replays a step: eager launches from Python would time the launches)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):  # compilation, the allocator
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def step_inputs(args, t: int, dev: torch.device):
    """q, k, v of a step as views of one [batch, t, conv_dim] bfloat16 tensor, g and β
    [batch, v_heads, t] float32, as `GatedDeltaNet.forward` computes them."""
    gen = torch.Generator(device=dev).manual_seed(t)
    key_dim, value_dim = args.k_heads * args.dk, args.v_heads * args.dv
    mixed = torch.randn(args.batch, t, 2 * key_dim + value_dim, device=dev, generator=gen)
    q, k, v = mixed.to(torch.bfloat16).split([key_dim, key_dim, value_dim], dim=-1)

    def heads(y, d):
        return y.reshape(args.batch, t, -1, d).transpose(1, 2)

    g = -torch.rand(args.batch, args.v_heads, t, device=dev, generator=gen)
    beta = torch.rand(args.batch, args.v_heads, t, device=dev, generator=gen)
    return heads(q, args.dk), heads(k, args.dk), heads(v, args.dv), g, beta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=48)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("deltanet_step.py times the step kernel against the PyTorch loop with "
                         "CUDA events: it needs a GPU (the CPU path is the PyTorch loop only)")
    dev = torch.device("cuda")
    ring = torch.zeros(args.batch, STEPS, args.v_heads, args.dk, args.dv, device=dev)
    torch_kc, triton_kc = KernelConfig(backend="torch"), KernelConfig()
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    rows: dict[str, dict[str, float]] = {}
    for t in LENGTHS:
        q, k, v, g, beta = step_inputs(args, t, dev)
        # a step from position STEPS: reads slot STEPS - 1, writes slots 0 … t - 1
        slots = StepSlots(kept=True, read=torch.full((1,), STEPS - 1, device=dev),
                          write=torch.arange(t, device=dev), window=empty,
                          window_valid=empty.bool(), conv_rows=empty, conv_write=empty, real=None)
        row = {"torch loop": event_us(
                   lambda: GatedDeltaNet.rule(q, k, v, g, beta, ring, slots, torch_kc)),
               "kernel": event_us(
                   lambda: GatedDeltaNet.rule(q, k, v, g, beta, ring, slots, triton_kc))}
        for block in BLOCKS:
            row[f"kernel, BLOCK_V={block}"] = event_us(
                lambda: deltanet_kernels.delta_rule_step(q, k, v, g, beta, ring, slots.read,
                                                         slots.write, args.dk ** -0.5,
                                                         block=block, kc=triton_kc))
        row["speedup"] = row["torch loop"] / row["kernel"]
        # the traffic the kernel cannot avoid: its floor is writing these at full bandwidth
        row["state MB written"] = t * args.batch * args.v_heads * args.dk * args.dv * 4 / 1e6
        rows[f"T={t}"] = row
    report = {"device": torch.cuda.get_device_name(), "args": vars(args),
              "block_v": deltanet_kernels.block_v(args.dv, args.batch * args.v_heads),
              "us": rows}
    print(f"{report['device']}, batch {args.batch}, {args.k_heads} key / {args.v_heads} value "
          f"heads, d_k {args.dk}, d_v {args.dv}: microseconds per layer step (block_v's "
          f"choice: {report['block_v']}), the speedup, and the MB of states written")
    names = list(rows[f"T={LENGTHS[0]}"])
    print("  " + " ".join(f"{n:>22}" for n in ["T"] + names))
    for key, row in rows.items():
        print("  " + " ".join([f"{key:>22}"] + [f"{row[n]:22.1f}" for n in names]))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
