"""Peak GPU memory of loading a checkpoint with weight-only quantization.

The motivating case is a 27B model in int4 on a 24 GB card: its bf16 weights (54 GB) never fit,
so `load_model(..., quantization=...)` must quantize each matrix as it arrives. This writes a
random bf16 checkpoint of a shape (sharded safetensors, one file a layer, as hubs ship them),
then loads it with each quantization mode and records the peak GPU memory against the
checkpoint's size and the loaded model's resident size, and checks that a forward runs.

    python3 benchmarks/load_memory.py --shape qwen3-8b --dir /root/ckpt --out OUT/load.json
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.loading import load_model  # noqa: E402
from flashdraft.tools.shapes import get_shape  # noqa: E402

GB = 1e9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a dry run, no memory figures)


def hf_tensors(cfg, layer: int | None) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of one layer's tensors (layer None: the rest)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if layer is None:
        out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, h)
        return out
    p = f"model.layers.{layer}."
    out = {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
           p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
           p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
           p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
           p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if cfg.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
        out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    if cfg.qkv_bias:
        for x, n in (("q", q), ("k", kv), ("v", kv)):
            out[p + f"self_attn.{x}_proj.bias"] = (n,)
    return out


def write_checkpoint(shape: str, out: Path) -> int:
    """A random bf16 checkpoint of `shape` in `out` (one safetensors file a layer, an index,
    config.json and a small tokenizer); returns its weight bytes."""
    from safetensors.torch import save_file

    from tests.tiny import build_tokenizer

    cfg = get_shape(shape)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    config = {"model_type": cfg.arch, "architectures": ["Qwen3ForCausalLM"],
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
              "max_position_embeddings": cfg.max_position_embeddings, "eos_token_id": 0,
              "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    index, total = {}, 0
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for layer in [None, *range(cfg.num_layers)]:
        name = f"model-{'rest' if layer is None else f'{layer:03d}'}.safetensors"
        tensors = {}
        for key, shp in hf_tensors(cfg, layer).items():
            t = torch.randn(shp, generator=gen, device=DEVICE, dtype=torch.bfloat16)
            tensors[key] = (t * 0.02 if len(shp) == 2 else t.abs() + 0.5).cpu()
            index[key] = name
            total += t.numel() * 2
        save_file(tensors, out / name, metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return total


def measure(path: Path, mode: str | None) -> dict:
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    before = allocated()
    start = time.perf_counter()
    loaded = load_model(str(path), torch.bfloat16, DEVICE, mode)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda else 0) - before
    resident = allocated() - before
    cache = KVCache.for_model(loaded.config, 1, 64, torch.bfloat16, DEVICE)
    tokens = torch.randint(0, 300, (1, 8), device=DEVICE)
    with torch.inference_mode():
        logits, _ = loaded.model(tokens, torch.arange(8, device=DEVICE)[None], cache)
    finite = bool(torch.isfinite(logits).all())
    # the process's peak resident host memory so far (the first mode's own, later ones' max)
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del loaded, cache, logits
    return {"mode": mode or "bf16", "peak_gb": peak / GB, "resident_gb": resident / GB,
            "peak_over_resident_gb": (peak - resident) / GB, "load_s": seconds,
            "forward_finite": finite, "host_peak_rss_gb_so_far": host_peak / GB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--dir", default="/root/ckpt")
    ap.add_argument("--modes", default="int4,int8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    nbytes = write_checkpoint(args.shape, Path(args.dir))
    result = {"shape": args.shape, "checkpoint_gb": nbytes / GB,
              "write_s": time.perf_counter() - start,
              "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "runs": []}
    print(f"{args.shape}: checkpoint {nbytes / GB:.2f} GB bf16, written in "
          f"{result['write_s']:.0f} s", flush=True)
    for mode in [m for m in args.modes.split(",") if m]:
        row = measure(Path(args.dir), None if mode == "bf16" else mode)
        result["runs"].append(row)
        print(f"  {row['mode']}: peak {row['peak_gb']:.2f} GB, resident {row['resident_gb']:.2f} "
              f"GB (peak - resident {row['peak_over_resident_gb']:.2f} GB), load "
              f"{row['load_s']:.0f} s, forward finite {row['forward_finite']}, host peak RSS "
              f"so far {row['host_peak_rss_gb_so_far']:.2f} GB", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
