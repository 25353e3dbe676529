"""The decode megakernel (flashdraft.backends.megakernel) against the model's CUDA-graph step,
in one process, random weights (speed only), 512 positions in the cache (--context).

For each shape: the copy bandwidth and the bytes a step reads (the roofline), the graph step
(t1, and plain decoding's tokens/s with one host read a step), then for each megakernel variant
its step time (back-to-back launches timed with events), its decode loop with one launch and
one host read a step, the same loop read a step behind (as the engine runs it), and the
largest logit difference from the graph step at the same position. A variant is the ring
(SLOTSxBYTES) and options joined by "+": `trace` (the per-op timeline of one more step,
DecodeMegakernel.timeline), `bulk` (one producer warp's bulk copies instead of 4 warps'
cp.async), `prod:N`, `cw:N` (consumer warps), `ldgsts`, `D:NAME=V` (a compile-time setting of
decode_mk.cu, e.g. D:LLX=1), and the probes `nowait` (no op waits for
the one before: wrong output, the most that faster dependencies could give) and `nocompute`.

    python3 benchmarks/megakernel_step.py --out DIR \
        [--shapes qwen2.5-1.5b qwen3-32b:int4] [--context 512 4096] \
        [--variants 8x24576+trace 8x24576+bulk 8x24576+nowait]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends.cuda_graphs import StepRunner  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.backends.megakernel import DecodeMegakernel  # noqa: E402
from flashdraft.tools.shapes import (decode_loop, time_steps, build_random_model,  # noqa: E402
                               get_shape, measure_copy_bandwidth, megakernel_decode,
                               megakernel_step_time, step_bytes)

CONTEXT = 512  # cached positions before the step (--context)
# decode_mk.cu's defines that the shape, the ring and the variant's other options set; the
# report's `settings` are the rest (the defaults' and the variant's D:NAME=V)
SHAPE_DEFINES = {"H", "INTER", "NQ", "NKV", "HD", "NL", "VOCAB", "QKV_BIAS", "QK_NORM", "NS",
                 "SLOT", "NCW", "NOWAIT", "NOCOMPUTE", "LDGSTS", "NPROD", "Q4", "TRACE"}


def parse_variant(v: str) -> dict:
    ring, *opts = v.split("+")
    # "default" (or nothing before the first "+"): the shape's default ring
    out = {"ring": None if ring in ("", "default") else ring, "probe": ""}
    probes = []
    for o in opts:
        if o.startswith("prod:"):
            out["producers"] = int(o[5:])
        elif o.startswith("cw:"):  # consumer warps
            out["consumer_warps"] = int(o[3:])
        elif o.startswith("D:"):
            name, value = o[2:].split("=")
            out.setdefault("defines", {})[name] = int(value)
        elif o == "trace":
            out.setdefault("defines", {})["TRACE"] = 1
        elif o == "ldgsts":
            out["ldgsts"] = True
        elif o == "bulk":  # one producer warp, one bulk copy a chunk
            out["ldgsts"], out["producers"] = False, 1
        elif o in ("nowait", "nocompute"):
            probes.append(o)
        else:
            raise SystemExit(f"variant option {o!r}: prod:N, cw:N, D:NAME=V, trace, ldgsts, bulk, "
                             "nowait or nocompute")
    out["probe"] = ",".join(probes)
    return out


@torch.inference_mode()
def run_shape(shape: str, variants: list[str], bandwidth: float, context: int = CONTEXT) -> dict:
    name, _, quant = shape.partition(":")  # "qwen3-32b:int4": weights in int4 (mma layout)
    cfg = get_shape(name)
    model = build_random_model(cfg, torch.bfloat16, "cuda", quant=quant or None)
    cache = KVCache.for_model(cfg, 1, context + 512, torch.bfloat16, "cuda")
    cache.kv.normal_()
    need = step_bytes(model, cfg, context, 1, torch.bfloat16)["bytes"]
    roof = bandwidth / need
    runner = StepRunner(model, "cuda")
    t1 = time_steps(runner, cache, 1, context, cfg.vocab_size, 30)
    tps = decode_loop(runner, cache, context, cfg.vocab_size, 128)
    out = {"shape": shape, "context": context, "bytes_per_step": need, "roofline_tok_s": roof,
           "graph": {"t1_ms": t1 * 1e3, "roofline_t1": need / bandwidth / t1, "decode_tok_s": tps,
                     "roofline_decode": tps / roof}, "megakernel": {}}
    print(f"{shape} at {context}: roofline {roof:.0f} tok/s; graph t1 {t1 * 1e3:.3f} ms "
          f"({need / bandwidth / t1:.1%}), decode {tps:.1f} tok/s ({tps / roof:.1%})", flush=True)
    token = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    ref, _ = runner(token, context, cache)
    ref = ref[0, -1].float()
    first = None  # the first variant's logits: whether each later one gives them bit for bit
    for v in variants:
        opts = parse_variant(v)
        try:
            mk = DecodeMegakernel(model, cache, **opts)
            logits, _ = mk.step(token.view(1), torch.tensor([context], device="cuda"))
            torch.cuda.synchronize()
            mk.check()
            err = (logits - ref).abs().max().item()
            same = None if first is None else torch.equal(logits, first)
            if first is None:
                first = logits.clone()
            t = megakernel_step_time(mk)
            mk.check()
            d = megakernel_decode(mk, context) if not opts["probe"] else None
            d_ahead = megakernel_decode(mk, context, ahead=True) if not opts["probe"] else None
            mk.check()
            timeline = None
            if mk.trace is not None:  # one more step at the same position, traced
                mk.trace.zero_()
                mk.step(token.view(1), torch.tensor([context], device="cuda"))
                torch.cuda.synchronize()
                mk.check()
                timeline = mk.timeline()
        except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
            out["megakernel"][v] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {v}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        r = {"t1_ms": t * 1e3, "roofline_t1": need / bandwidth / t, "decode_tok_s": d,
             "roofline_decode": d / roof if d else None, "decode_ahead_tok_s": d_ahead,
             "max_logit_diff": err, "same_logits_as_first": same,
             "ref_logit_absmax": ref.abs().max().item(), "ring": mk.ring,
             "settings": {k: v for k, v in mk.defines.items() if k not in SHAPE_DEFINES}}
        if timeline:
            r["timeline_us"] = timeline
        out["megakernel"][v] = r
        print(f"  {v} ({mk.ring}, {r['settings']}): t1 {t * 1e3:.3f} ms ({r['roofline_t1']:.1%})"
              + (f", decode {d:.1f} tok/s ({d / roof:.1%}), {d_ahead:.1f} a step behind"
                 if d else "")
              + f"; max |logit diff| {err:.4f} (|logit| max {r['ref_logit_absmax']:.3f})"
              + ("" if same is None else f"; logits {'=' if same else '!='} the first variant's"),
              flush=True)
        if timeline:
            print(f"    step {timeline['step_us']:.1f} us; a layer, us: " + "; ".join(
                f"{k} " + " ".join(f"{n}={x:.2f}" if isinstance(x, float) else f"{n}={x}"
                                  for n, x in timeline[k].items())
                for k in ("qkv", "att", "o", "gu", "down", "head")), flush=True)
        del mk
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-0.5b"])
    ap.add_argument("--context", type=int, nargs="+", default=[CONTEXT],
                    help="cached positions before the step; each shape runs at each")
    ap.add_argument("--variants", nargs="+",
                    default=["8x24576+trace", "8x24576", "8x24576+bulk"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results = {"copy_bandwidth": bandwidth, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shapes": []}
    for shape in args.shapes:
        for context in args.context:
            results["shapes"].append(run_shape(shape, args.variants, bandwidth, context))
        (args.out / "megakernel_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
