"""`flashdraft tune`: the product kernel's launch parameters, measured on this GPU.

Products of up to 32 rows (decode, verification, draft steps) run `kernels.skinny_kernel`,
launched by a rule of the weight's shape unless the tuned table names the launch measured
fastest for that shape on this GPU model (`KernelConfig.tuned_table`). The package ships a table
for the H200; `flashdraft tune --model M` measures the matrices of M on the GPU at hand and
merges the winners into the user's table (`kernels.user_table()`, in the model cache),
which `kernels` reads over the shipped one.

Each matrix, as the model runs it, is timed at one row (20 back-to-back calls in one CUDA
graph, weights read from DRAM, not from L2) under the rule's launch and a grid of tiles, K
splits, prefetched tiles and warps; the five best then under other pipeline depths and warp
counts. A launch enters the table where it beats the current one by more than 1 %. The choice
stays a function of the weight's shape only, so decoding and verification keep computing the
same bits for a token (the engine's losslessness does not depend on it). The time is split
evenly between the matrices; new launches compile first (~0.3-1 s each). Weight-only int8 /
int4 products run other kernels and are not tuned here.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

from . import kernels

MARGIN = 0.01  # a launch enters the table where it is this much faster (repeats differ ~0.1 %)


def graph_us(fn) -> float:
    """µs per call of fn: 20 back-to-back calls in one graph, median of 20 replays."""
    from ..tools.shapes import graph_replay_us

    return graph_replay_us(fn, calls=20, repeats=20, warmup=1)


def dram_ring(*tensors: torch.Tensor):
    """An endless cycle over the tuple of tensors (a weight, or a quantized weight's parts) and
    enough copies of it (>= 256 MB in all) that each call of a timed product reads its weight
    from DRAM, not from the 50 MB L2 (where a single small weight stays between calls and times
    up to 2x faster than in the model)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    copies = [tensors] + [tuple(t.clone() for t in tensors)
                          for _ in range(min(63, -(-(256 << 20) // size) - 1))]
    return itertools.cycle(copies)


def matrices(model) -> dict:
    """Distinct plain-Linear weights of the model by (n, k, gated), as the model runs them:
    gated for the MLP's gate and up product where `kernels.gated_for` says (n = its output
    width, half the weight's rows)."""
    mats = {}
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear:
            gated = name.endswith("w_gate_up") and kernels.gated_for(mod.weight.shape[0] // 2)
            rows, k = mod.weight.shape
            mats.setdefault((rows // 2 if gated else rows, k, gated), mod.weight)
    return mats


def candidates(n: int, k: int, gated: bool):
    """Launches of the skinny kernel over an [n, k] weight to try: tiles × K splits to ~132,
    264 or 528 programs × 1, 2 or 4 tiles prefetched (within the registers), 4 or 8 warps."""
    cdiv = lambda a, b: -(-a // b)
    seen = set()
    for block_n, block_k, warps in ((64, 128, 4), (64, 128, 8), (64, 256, 4), (64, 256, 8),
                                    (32, 256, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8),
                                    (32, 128, 4), (64, 64, 4), (16, 256, 4), (16, 512, 4),
                                    (32, 512, 4)):
        if block_k > max(16, 1 << (k - 1).bit_length()):
            continue
        n_blocks = cdiv(n, block_n) * (2 if gated else 1)
        k_tiles = cdiv(k, block_k)
        for target in (132, 264, 528):
            split = max(1, min(k_tiles, round(target / n_blocks)))
            k_steps = cdiv(k_tiles, split)
            split = cdiv(k_tiles, k_steps)
            for pre in (1, 2, 4):
                if pre > k_steps or pre * block_n * block_k > 4 * 8192:  # registers
                    continue
                c = kernels.SkinnyConfig(block_n, block_k, k_steps, split, pre, warps)
                if c not in seen:
                    seen.add(c)
                    yield c


@torch.inference_mode()
def sweep(cfg, budget_s: float, match: str = "", label: str = "", log=print) -> dict:
    """Launch parameters of the skinny kernel for each matrix of a model of config cfg (one
    layer of random bf16 weights on the GPU), by kernels.table_key, holding only those whose
    key contains `match`: per matrix the best launch, its µs and TB/s at one row, the current
    launch's (the tuned table's where it has one) and both at 16 rows."""
    from ..tools.shapes import build_random_model

    model = build_random_model(dataclasses.replace(cfg, num_layers=1), torch.bfloat16, "cuda")
    result = {}
    mats = {m: w for m, w in matrices(model).items() if match in kernels.table_key(*m)}
    for (n, k, gated), w in mats.items():
        began, budget = time.perf_counter(), budget_s / len(mats)
        x1 = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        x16 = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
        ring = dram_ring(w)
        run = lambda x, c: kernels.skinny_linear(x, next(ring)[0], None, gated, c)
        timed = []
        default = kernels.skinny_config(n, k, gated, None)
        for c in [default, *candidates(n, k, gated)]:
            if time.perf_counter() - began > budget:
                break
            try:
                timed.append((graph_us(lambda: run(x1, c)), c))
            except Exception as e:  # a launch the compiler refuses (resources)
                log(f"    {c}: {type(e).__name__}")
        timed.sort(key=lambda r: r[0])
        tried = {c for _, c in timed}
        for us, c in timed[:5]:  # the best under other pipeline depths and warp counts
            for c2 in [c._replace(num_stages=stages) for stages in (2, 3, 4, 5)] + \
                    [c._replace(num_warps=12 - c.num_warps)]:
                if c2 in tried or time.perf_counter() - began > 1.6 * budget:
                    continue
                tried.add(c2)
                try:
                    timed.append((graph_us(lambda: run(x1, c2)), c2))
                except Exception:
                    pass
        timed.sort(key=lambda r: r[0])
        if not timed:
            continue
        best = timed[0][1]
        key = kernels.table_key(n, k, gated)
        entry = {"matrix": (n, k, gated), "best": best, "best_us": timed[0][0],
                 "best_TBps": w.numel() * w.element_size() / timed[0][0] / 1e6,
                 "default": default, "top": [(us, c) for us, c in timed[:8]]}
        entry["default_us"] = next((us for us, c in timed if c == default), None)
        entry["best_us_16rows"] = graph_us(lambda: run(x16, best))
        entry["default_us_16rows"] = (None if entry["default_us"] is None
                                      else graph_us(lambda: run(x16, default)))
        result[key] = entry
        log(f"  sweep {label} {key:>18s}: best {entry['best_us']:6.1f} us "
            f"({entry['best_TBps']:.2f} TB/s) {tuple(best)}; current {entry['default_us']} us "
            f"{tuple(default)}; 16 rows {entry['best_us_16rows']:.1f} / "
            f"{entry['default_us_16rows']} us")
    return result


def format_table(table: dict) -> str:
    """The tuned table as JSON, one matrix a line."""
    gpus = ",\n".join(f" {json.dumps(gpu)}: {{\n" + ",\n".join(
        f"  {json.dumps(key)}: {json.dumps(list(c))}" for key, c in entries.items()) + "\n }"
        for gpu, entries in table.items())
    return "{\n" + gpus + "\n}\n"


def merge(path: Path, swept: dict, gpu: str, margin: float = MARGIN) -> dict:
    """Merge a sweep's winners into the tuned table at path under the GPU model `gpu`: a
    matrix's best launch goes in where it beat the current one by more than `margin`; other
    entries stay. Returns what was written."""
    path = Path(path)
    table = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
            assert isinstance(table, dict) and all(isinstance(v, dict) for v in table.values())
        except (ValueError, AssertionError, OSError):
            raise SystemExit(f"error: {path} is not a table of launches; move it away (or "
                             f"give --output another file) and tune again") from None
    mine = table.setdefault(gpu, {})
    written = {}
    for key, e in swept.items():
        if e["default_us"] is None or e["best_us"] < (1 - margin) * e["default_us"]:
            mine[key] = written[key] = list(e["best"])
    table[gpu] = dict(sorted(mine.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    # every flashdraft process reads this file: replace it whole, never half-written
    part = path.with_name(path.name + ".part")
    part.write_text(format_table(table))
    part.replace(path)
    kernels.tuned_table.cache_clear()  # this process uses the new launches from here on
    kernels.skinny_config.cache_clear()
    return written


def run_tune(model: str | None, shape: str | None, seconds: float, output: str | None) -> None:
    """`flashdraft tune`: sweep the matrices of a model (its config only: no weights are read)
    or of a synthetic shape, and merge the winners into the user's table (or `output`)."""
    if not torch.cuda.is_available():
        raise SystemExit("error: flashdraft tune times the GPU's product kernel and needs CUDA; "
                         "on a CPU there is nothing to tune")
    if not kernels.available():
        raise SystemExit("error: flashdraft tune needs Triton (pip install triton)")
    if (model is None) == (shape is None):
        raise SystemExit("error: name what to tune: --model M (a path, hub id or alias) or "
                         "--shape NAME")
    if seconds <= 0:
        raise SystemExit(f"error: --seconds must be > 0, got {seconds}")
    if model is not None:
        from ..loading import load_config

        cfg, label = load_config(model), model
    else:
        from ..tools.shapes import get_shape

        cfg, label = get_shape(shape), shape
    path = Path(output) if output else kernels.user_table()
    gpu = kernels.device_name()
    print(f"tuning {label} on {gpu}: {seconds:g} s over its matrices", flush=True)
    swept = sweep(cfg, seconds, label=label, log=lambda s: print(s, flush=True))
    written = merge(path, swept, gpu)
    print(f"wrote {len(written)} launch(es) to {path}"
          + ("" if written else " (the current launches were already the fastest)"))
    if written and output is None:
        print("flashdraft reads them from there from the next start (--tuned-table names "
              "another file, or off)")
