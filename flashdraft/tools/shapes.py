"""Synthetic shapes of real models, with random weights, for speed measurements on a GPU.

`flashdraft bench --random-weights --shape NAME` measures what a shape costs on the machine:
the step cost curve (one target pass over 1, 2, 4 … 32 tokens with a realistic context in the
cache), one drafter step, and plain decoding's tokens/s as a fraction of the memory roofline
(bytes one decode step must read, over a device-to-device copy bandwidth measured in the same
run). Random weights measure speed only: acceptance is not measured, and the report says so.

The two numbers of a step over T tokens at context L:
  bytes ≈ weight bytes (matrices; one embedding row a token) + KV bytes of L + T positions
  flops ≈ 2 · matrix parameters · T + 4 · layers · q heads · head_dim · (L + T) · T
A decode step (T = 1) is bound by bytes by a factor of ~100 on an H200 (≈200 flop/byte), and so
is verification up to T ≈ 32 for bf16: that is why checking 16 drafts costs about one step.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..backends import kernels
from ..config import KernelConfig, ModelConfig
from ..backends.cuda_graphs import StepRunner
from ..engine import TokenReader
from ..kv_cache import KVCache
from ..model import Transformer, rope_frequencies

RANDOM_WEIGHTS_NOTE = ("random weights: these figures measure speed only; acceptance (tau, "
                       "acceptance rate) is not measured and means nothing with random weights")

_V = 151936  # the Qwen2.5 / Qwen3 vocabulary
SHAPES: dict[str, ModelConfig] = {
    # Qwen2.5-(Coder-)1.5B, untied output matrix as in the example target.
    "qwen2.5-1.5b": ModelConfig("qwen2", _V, 1536, 8960, 28, 12, 2, 128, qkv_bias=True,
                                rope_theta=1e6, max_position_embeddings=32768),
    "qwen2.5-0.5b": ModelConfig("qwen2", _V, 896, 4864, 24, 14, 2, 64, qkv_bias=True,
                                tie_word_embeddings=True, rope_theta=1e6,
                                max_position_embeddings=32768),
    "qwen3-0.6b": ModelConfig("qwen3", _V, 1024, 3072, 28, 16, 8, 128, qk_norm=True,
                              tie_word_embeddings=True, rope_theta=1e6,
                              max_position_embeddings=40960),
    "qwen3-8b": ModelConfig("qwen3", _V, 4096, 12288, 36, 32, 8, 128, qk_norm=True,
                            rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-32b": ModelConfig("qwen3", _V, 5120, 25600, 64, 64, 8, 128, qk_norm=True,
                             rope_theta=1e6, max_position_embeddings=40960),
    # A 27B-class dense stand-in with Qwen3.5-27B-like widths (hidden 5120, 64 layers, FFN
    # 17408, 24 q / 4 kv heads of 256, vocabulary 248,320). Every layer is modelled as full
    # attention: Qwen3.5's linear-attention layers are not in our model yet. ~24B matrix weights.
    "dense-27b": ModelConfig("qwen3", 248320, 5120, 17408, 64, 24, 4, 256, qk_norm=True,
                             rope_theta=1e7, max_position_embeddings=262144),
}
# The drafter step measured with each target shape (a draft model of the same family).
DRAFT_SHAPES = {"qwen2.5-1.5b": "qwen2.5-0.5b", "qwen3-8b": "qwen3-0.6b",
                "qwen3-32b": "qwen3-0.6b", "dense-27b": "qwen3-0.6b"}
STEP_TOKENS = (1, 2, 4, 8, 16, 32)


def get_shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return SHAPES[name]


@torch.no_grad()
def build_random_model(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0,
                       quant: str | None = None, kernel_config: KernelConfig = kernels.DEFAULT,
                       fold_norms: bool = True) -> Transformer:
    """A Transformer of shape cfg with random weights made directly on `device` (no host copy,
    no float32 detour), optionally quantized ("int8", "int4" or "MODE-BACKEND", e.g.
    "int4-triton"), its norms folded as the loaders fold them (unquantized models). Weights
    are N(0, 0.02), norms 1: never zeros, which can time faster than real data."""
    with torch.device("meta"):
        model = Transformer(cfg, kernel_config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_frequencies(cfg).to(device)
    if fold_norms and not quant:
        model.fold_norms()
    if quant:
        from ..backends.quant import quantize_model
        mode, _, backend = quant.partition("-")
        quantize_model(model, mode, backend or "auto")
    return model.eval()


def measure_copy_bandwidth(device, nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, bytes read + bytes written per second (median of `repeats`)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times)


def step_bytes(model: Transformer, cfg: ModelConfig, context: int, t: int, kv_dtype) -> dict:
    """What a step over t tokens at `context` cached positions must read, and its flops."""
    from ..backends.quant import weight_bytes
    weights = weight_bytes(model)
    kv_elem = torch.tensor([], dtype=kv_dtype).element_size()
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (context + t) * kv_elem
    embed_rows = t * cfg.hidden_size * kv_elem
    params = sum(m.in_features * m.out_features for m in model.modules()
                 if hasattr(m, "in_features") and hasattr(m, "out_features"))
    flops = 2 * params * t + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (context + t) * t
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv + embed_rows,
            "flops": flops}


def graph_replay_us(fn, calls: int = 10, repeats: int = 50, warmup: int = 3) -> float:
    """Median µs per call of fn, `calls` back-to-back calls captured in one CUDA graph (launch
    overhead excluded, as inside a replayed step); warm-up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def time_steps(runner: StepRunner, cache: KVCache, t: int, context: int, vocab: int,
                repeats: int) -> float:
    """Median seconds of one target pass over t tokens at `context`, graph replays included."""
    tokens = torch.randint(0, vocab, (1, t), device=runner.device)
    for _ in range(3):  # capture + warm-up
        runner(tokens, context, cache)
    torch.cuda.synchronize(runner.device)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner(tokens, context, cache)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def decode_loop(runner: StepRunner, cache: KVCache, context: int, vocab: int,
                 steps: int) -> float:
    """Plain greedy decoding as the engine runs it: one pass, argmax, one host read a step.
    Returns tokens/s over `steps` steps after a warm-up."""
    token = torch.randint(0, vocab, (1, 1), device=runner.device)
    for i in range(4):
        logits, _ = runner(token, context + i, cache)
        token = logits[:, -1].argmax(-1, keepdim=True)
        int(token)
    torch.cuda.synchronize(runner.device)
    began = time.perf_counter()
    for i in range(steps):
        logits, _ = runner(token, context + i, cache)
        token = logits[:, -1].argmax(-1, keepdim=True)
        int(token)  # the engine's one host synchronisation per step
    return steps / (time.perf_counter() - began)


def megakernel_step_time(mk, n: int = 200, repeats: int = 5) -> float:
    """Median seconds a step of a DecodeMegakernel over `repeats` runs of n back-to-back
    launches (events), each at the position of its last `step()`."""
    for _ in range(5):
        mk.launch()
    torch.cuda.synchronize(mk.device)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            mk.launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / n)
    return statistics.median(times)


def megakernel_decode(mk, context: int, steps: int = 256, ahead: bool = False) -> float:
    """Tokens/s of greedy decoding through a DecodeMegakernel, each step chained on the one
    before (it leaves its token and the next position as inputs); positions advance from
    `context`. ahead=False: one host read a step, right after its launch (the host waits for
    each step). ahead=True: as the engine's plain decoding (`--decode-kernel megakernel`),
    step n + 1 launched before token n is read through the engine's pinned-copy reader, so the
    GPU runs steps back to back and only the copies and reads stand between them."""
    mk.start(torch.zeros(1, dtype=torch.int64, device=mk.device), context)
    for _ in range(4):
        mk.launch()
        int(mk.token_out)
    mk.start(mk.token_out, context)
    torch.cuda.synchronize(mk.device)
    began = time.perf_counter()
    if ahead:
        reader = TokenReader(mk.device)
        mk.launch()
        pending = reader.start(mk.token_out)
        for _ in range(steps - 1):
            mk.launch()
            following = reader.start(mk.token_out)
            reader.read(pending)
            pending = following
        reader.read(pending)
    else:
        for _ in range(steps):
            mk.launch()
            int(mk.token_out)
    return steps / (time.perf_counter() - began)


def _megakernel_at(model, cache: KVCache, context: int):
    """A DecodeMegakernel for `model` whose launches run at position `context` (one step
    there sets it), as the graph steps it is compared with."""
    from ..backends.megakernel import DecodeMegakernel
    mk = DecodeMegakernel(model, cache)
    dev = model.embed.weight.device
    mk.step(torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([context], device=dev))
    return mk


@torch.inference_mode()
def run_shape_bench(shape: str, dtype: str = "bfloat16", quant: str | None = None,
                    device: str = "cuda", *, context: int = 512,
                    step_tokens: tuple[int, ...] = STEP_TOKENS, cuda_graphs: bool = True,
                    compile: bool = False, draft: bool = True, repeats: int = 30,
                    decode_steps: int = 128, bandwidth: float | None = None,
                    decode_kernel: str = "graph",
                    kernel_config: KernelConfig = kernels.DEFAULT) -> dict:
    """Step cost curve, drafter step and plain-decoding roofline fraction of a synthetic shape.

    quant: None, "int8", "int4", or "MODE-BACKEND" ("int4-triton", "int4-mma", ...).
    decode_kernel "megakernel": plain decoding through the decode megakernel as well (its
    step, its tokens/s and roofline fraction; the step curve stays the graphs'); "auto" or
    "megakernel": the drafter's step through it as well, as the engine runs a draft model's.
    Returns a dict (see format_shape_bench); `bandwidth` (bytes/s) skips measuring it again.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("the random-weight shape benchmark needs a CUDA GPU (device='cuda')")
    torch_dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                   "fp16": torch.float16}[dtype]
    cfg = get_shape(shape)
    if bandwidth is None:
        bandwidth = measure_copy_bandwidth(dev)
    out = {"shape": shape, "config": cfg.__dict__ | {"eos_token_ids": list(cfg.eos_token_ids)},
           "dtype": str(torch_dtype).replace("torch.", ""), "quant": quant or "none",
           "context": context, "cuda_graphs": cuda_graphs, "compile": compile,
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "copy_bandwidth_Bps": bandwidth, "kernels": kernel_config.__dict__,
           "note": RANDOM_WEIGHTS_NOTE}
    began = time.perf_counter()
    model = build_random_model(cfg, torch_dtype, dev, quant=quant, kernel_config=kernel_config)
    torch.cuda.synchronize(dev)
    out["build_s"] = time.perf_counter() - began
    if decode_kernel == "megakernel":  # refused before anything is measured
        from ..backends.megakernel import refuse_unsupported
        refuse_unsupported(model, dev, f"the {shape} shape ({out['dtype']}, quant {out['quant']})")
    max_t = max(step_tokens)
    cache = KVCache.for_model(cfg, 1, -(-(context + decode_steps + max_t + 8) // 256) * 256,
                              torch_dtype, dev)
    cache.k.normal_()
    cache.v.normal_()
    runner = StepRunner(model, dev, enabled=cuda_graphs, compile=compile)
    curve = {}
    for t in step_tokens:
        began = time.perf_counter()
        seconds = time_steps(runner, cache, t, context, cfg.vocab_size, repeats)
        need = step_bytes(model, cfg, context, t, torch_dtype)
        curve[t] = {"ms": seconds * 1e3, "tokens_per_pass_s": t / seconds,
                    "bytes": need["bytes"], "flops": need["flops"],
                    "bandwidth_fraction": need["bytes"] / seconds / bandwidth,
                    "tflops": need["flops"] / seconds / 1e12,
                    "setup_s": time.perf_counter() - began - seconds * repeats}
    out["step_curve"] = curve
    out["capture_s"] = runner.stats.capture_s
    need1 = step_bytes(model, cfg, context, 1, torch_dtype)
    out.update(weight_bytes=need1["weight_bytes"], kv_bytes_per_step=need1["kv_bytes"],
               bytes_per_step=need1["bytes"], flops_per_step=need1["flops"])
    out["roofline_tokens_per_s"] = bandwidth / need1["bytes"]
    out["decode_tokens_per_s"] = decode_loop(runner, cache, context, cfg.vocab_size, decode_steps)
    out["roofline_fraction"] = out["decode_tokens_per_s"] / out["roofline_tokens_per_s"]
    if 1 in curve:
        out["graph_step_roofline_fraction"] = curve[1]["bandwidth_fraction"]
        if 16 in curve:
            out["verify16_over_decode1"] = curve[16]["ms"] / curve[1]["ms"]
    if decode_kernel == "megakernel":
        mk = _megakernel_at(model, cache, context)
        step = megakernel_step_time(mk)
        tps = megakernel_decode(mk, context, decode_steps)
        ahead = megakernel_decode(mk, context, decode_steps, ahead=True)
        mk.check()
        out["megakernel"] = {"ring": mk.ring, "step_ms": step * 1e3,
                             "step_roofline_fraction": need1["bytes"] / step / bandwidth,
                             "decode_tokens_per_s": tps,
                             "roofline_fraction": tps / out["roofline_tokens_per_s"],
                             "decode_ahead_tokens_per_s": ahead}
        if 16 in curve:
            out["megakernel"]["verify16_over_step"] = curve[16]["ms"] / (step * 1e3)
        del mk
    del runner, cache, model
    torch.cuda.empty_cache()
    if draft and shape in DRAFT_SHAPES:
        dname = DRAFT_SHAPES[shape]
        dcfg = get_shape(dname)
        # quantized as the target's, as the engine's draft quantization "auto" does
        dmodel = build_random_model(dcfg, torch_dtype, dev, seed=1, quant=quant)
        dcache = KVCache.for_model(dcfg, 1, -(-(context + 64) // 256) * 256, torch_dtype, dev)
        dcache.k.normal_()
        dcache.v.normal_()
        drunner = StepRunner(dmodel, dev, enabled=cuda_graphs, compile=False)
        out["drafter"] = {"shape": dname, "dtype": out["dtype"], "quant": out["quant"],
                          "step_ms": time_steps(drunner, dcache, 1, context, dcfg.vocab_size,
                                                 repeats) * 1e3}
        if decode_kernel != "graph":  # auto and megakernel run a draft model's steps through it
            from ..backends.megakernel import why_not
            why = why_not(dmodel, dev)
            if why:
                out["drafter"]["megakernel_refused"] = why
            else:
                mk = _megakernel_at(dmodel, dcache, context)
                out["drafter"]["megakernel_step_ms"] = megakernel_step_time(mk) * 1e3
                mk.check()
                del mk
        del drunner, dcache, dmodel
        torch.cuda.empty_cache()
    return out


def format_shape_bench(r: dict) -> str:
    """A short human-readable report of one run_shape_bench result."""
    gb = 1e9
    lines = [f"shape {r['shape']} ({r['dtype']}, quant {r['quant']}, cuda graphs "
             f"{'on' if r['cuda_graphs'] else 'off'}{', compiled' if r['compile'] else ''}) "
             f"on {r['gpu']}, context {r['context']}",
             f"  bytes/decode step {r['bytes_per_step'] / gb:.3f} GB (weights "
             f"{r['weight_bytes'] / gb:.3f}, KV {r['kv_bytes_per_step'] / gb:.4f}); "
             f"flops/step {r['flops_per_step'] / 1e9:.2f} GFLOP; copy bandwidth "
             f"{r['copy_bandwidth_Bps'] / 1e12:.2f} TB/s",
             f"  plain decode {r['decode_tokens_per_s']:.1f} tokens/s = "
             f"{100 * r['roofline_fraction']:.1f}% of the roofline "
             f"({r['roofline_tokens_per_s']:.0f} tokens/s)",
             "  step cost curve:  T   ms     rel.   bandwidth  TFLOP/s"]
    base = r["step_curve"].get(1, next(iter(r["step_curve"].values())))["ms"]
    for t, c in r["step_curve"].items():
        lines.append(f"                  {int(t):2d} {c['ms']:7.3f} {c['ms'] / base:5.2f}x "
                     f"{100 * c['bandwidth_fraction']:6.1f}%  {c['tflops']:7.1f}")
    if "megakernel" in r:
        m = r["megakernel"]
        lines.append(f"  plain decode through the megakernel (ring {m['ring']}): "
                     f"{m['decode_tokens_per_s']:.1f} tokens/s = "
                     f"{100 * m['roofline_fraction']:.1f}% of the roofline"
                     + (f" ({m['decode_ahead_tokens_per_s']:.1f} read a step behind, as the "
                        "engine does)" if "decode_ahead_tokens_per_s" in m else "")
                     + "; its step "
                     f"{m['step_ms']:.3f} ms ({100 * m['step_roofline_fraction']:.1f}%)"
                     + (f"; verifying 16 tokens (graphs) costs {m['verify16_over_step']:.2f}x it"
                        if "verify16_over_step" in m else ""))
    if "drafter" in r:
        d = r["drafter"]
        quant = f", {d['quant']}" if d.get("quant", "none") != "none" else ""
        lines.append(f"  drafter step ({d['shape']}, {d['dtype']}{quant}): {d['step_ms']:.3f} ms"
                     + (f" (graphs); {d['megakernel_step_ms']:.3f} ms through the megakernel"
                        if "megakernel_step_ms" in d else "")
                     + (f"; the megakernel refused it: {d['megakernel_refused']}"
                        if "megakernel_refused" in d else ""))
    lines.append(f"  note: {r['note']}")
    return "\n".join(lines)
