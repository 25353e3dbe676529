"""Quality cost of weight-only int8 / int4: logit error and perplexity against the unquantized
model on a fixed text (issue 5, item 4). Runs on a CPU (reference path) or a GPU (kernels).

    PYTHONPATH=. python3 benchmarks/quant_quality.py example:qwen2.5-coder-1.5b [--dtype bfloat16]

Each mode loads the model afresh (quantization is in place) and scores the same tokens twice:
in one prefill pass (more rows than the kernels take: the dequantized weight through cuBLAS)
and in steps of --chunk tokens through the KV cache (the decode/verify kernels); figures:
relative logit error ‖q − ref‖ / ‖ref‖, max abs error, top-1 agreement, and the perplexity
of the text under both models.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.api import DTYPES  # noqa: E402
from flashdraft.kv_cache import KVCache  # noqa: E402
from flashdraft.loading import load_model  # noqa: E402
from flashdraft.backends.quant import quality_report, quantize_model  # noqa: E402

TEXT = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list in linear time."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Speculative decoding lets a small, fast model guess the next few tokens of a large one. The
large model then checks every guess in a single forward pass and keeps the longest prefix it
agrees with, plus one token of its own, so the output is exactly what it would have written
alone. Because reading the weights dominates the cost of a decoding step, checking sixteen
guesses costs little more than producing one token.
'''


@torch.inference_mode()
def score(model, cfg, ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    # ids [1, T] -> logits [1, T, vocab] (one prefill pass, or steps of `chunk` tokens)
    t = ids.shape[1]
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    cache = KVCache.for_model(cfg, 1, t, dtype, ids.device)
    out = []
    for start in range(0, t, chunk or t):
        end = min(t, start + (chunk or t))
        pos = torch.arange(start, end, device=ids.device).unsqueeze(0)
        logits, _ = model(ids[:, start:end], pos, cache, kv_len=end)
        out.append(logits)
    return torch.cat(out, dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="int8,int4",
                    help="MODE or MODE-BACKEND (reference, triton, mma), e.g. int4-mma")
    ap.add_argument("--chunk", type=int, default=16,
                    help="tokens a step for the second scoring (0: prefill only)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--fold-norms", action="store_true",
                    help="also quantize each mode with the norm weights folded into the "
                         "products first (Transformer.fold_norms), as a quantized model would "
                         "have to be to drop its norm kernels; the reference stays unfolded")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    # Quantized as load_model(quantization=...) quantizes: the checkpoint's own weights, the
    # norms not folded into them (load_model folds unquantized models only); the reference
    # unfolded too, so that it is the function the quantized models approximate.
    ref = load_model(args.model, dtype, device, fold_norms=False)
    ids = torch.tensor([ref.tokenizer.encode(TEXT)], device=device)
    ref_logits = score(ref.model, ref.config, ids)
    results = {"model": args.model, "dtype": str(dtype), "device": str(device),
               "tokens": ids.shape[1], "modes": {}}
    if args.chunk:  # the floor: the unquantized model's steps against its own prefill
        results["modes"][f"none ({args.chunk}-token steps)"] = quality_report(
            ref_logits, score(ref.model, ref.config, ids, args.chunk), ids)
    del ref
    runs = [(mode, False) for mode in args.modes.split(",")]
    runs += [(mode, True) for mode in args.modes.split(",") if args.fold_norms]
    for mode, fold in runs:
        loaded = load_model(args.model, dtype, device, fold_norms=False)
        if fold:
            # quantize_model refuses folded norms (the result is not what a quantized load
            # gives): this experiment wants exactly that result, whose norms are ones
            loaded.model.fold_norms()
            loaded.model.norms_folded = False
        quantize_model(loaded.model, *mode.split("-", 1))  # "int4" or "int4-mma" (backend)
        name = mode + (" folded" if fold else "")
        results["modes"][name] = quality_report(ref_logits, score(loaded.model, loaded.config, ids),
                                                ids)
        if args.chunk:
            results["modes"][f"{name} ({args.chunk}-token steps)"] = quality_report(
                ref_logits, score(loaded.model, loaded.config, ids, args.chunk), ids)
        del loaded
    print(f"{args.model} ({results['dtype']}, {results['device']}), {results['tokens']} tokens "
          f"of a fixed text:")
    for mode, r in results["modes"].items():
        print(f"  {mode}: logit rel. error {r['logit_rel_error']:.4f}, max abs "
              f"{r['logit_max_abs_error']:.3f}, top-1 agreement {100 * r['top1_agreement']:.1f}%, "
              f"perplexity {r['ppl_quantized']:.3f} vs {r['ppl_reference']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
