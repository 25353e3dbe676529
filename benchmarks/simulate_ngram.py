"""Replay greedy n-gram speculative decoding offline from `flashdraft bench` results.

    python benchmarks/simulate_ngram.py RESULTS.json[.gz] [...] --gguf TARGET.gguf \
        [--fit file|pooled] [--json OUT]

Greedy decoding makes the output of every configuration the same known sequence, and the
n-gram drafter reads only the committed tokens, so each speculative step can be replayed
without a model: rebuild the prompt ids as the bench did (tokenizer and chat template from the
GGUF; no weights are loaded), then mirror `Engine.run`'s loop: draft with
`flashdraft.drafters.ngram.lookup`, accept the longest prefix that agrees with the recorded
output, commit it and the target's bonus token.

1. Validation: the replayed drafted / accepted lengths and target passes of every n-gram
   request must equal the measured ones (for runs with AdaptiveSpeculation, with its policy
   replayed, the plain tokens too).
2. `flashdraft.engine.AdaptiveSpeculation`: the same replay with the policy deciding when to
   decode plainly (run ahead) instead, as the engine drives it; with its defaults and a grid of
   its constants (MISSES, FIRST, LONGEST).
3. Speed: a MODEL, not a measurement. Decode time is fitted (least squares over the measured
   n-gram requests) as A per step that drafted nothing, B + C*d per step that drafted d tokens;
   a run-ahead plain token costs P, the median TPOT of the file's plain decoding. Speedups are
   median over prompts of (generated - 1) / decode time, over plain decoding's measured median
   tokens/s in the same file (the bench's definition), for measured and modeled alike. The
   model ignores what switching between plain and speculative decoding costs (the first plain
   step of a stretch cannot overlap the last speculative step's host sync, nor the lookup
   that finds no draft).
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashdraft.tools.bench import load_prompts, table as table_lines
from flashdraft.drafters.ngram import NgramDrafter, lookup
from flashdraft.engine import AdaptiveSpeculation
from flashdraft.loading import read_model

GRID = {"MISSES": (1, 2, 3), "FIRST": (2, 4, 8), "LONGEST": (16, 64)}
DEFAULTS = (AdaptiveSpeculation.MISSES, AdaptiveSpeculation.FIRST, AdaptiveSpeculation.LONGEST)


# -- prompts ---------------------------------------------------------------------------------

def load_tokenizer(gguf: str):
    """The target's tokenizer, its context length and stop ids, as the engine has them
    (`loading.read_model`; lazy: no weight is dequantized)."""
    config, _, tokenizer, _ = read_model(gguf, lazy=True)
    return tokenizer, config.max_position_embeddings, set(config.eos_token_ids)


def prompt_ids(tokenizer, prompt) -> list[int]:
    """As bench.prompt_ids does through LLM.chat_prompt_ids / LLM.encode."""
    if prompt.messages:
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt.text)


def rebuild_prompts(results: dict, tokenizer) -> list[list[int]]:
    s = results["settings"]
    prompts = load_prompts(s["prompts"], s["raw_prompts"], s["num_prompts"])
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    for p, x, rec in zip(prompts, ids, results["prompts"], strict=True):
        if p.id != rec["id"] or len(x) != rec["prompt_tokens"]:
            sys.exit(f"prompt {rec['index']}: rebuilt {p.id} with {len(x)} tokens, the bench "
                     f"had {rec['id']} with {rec['prompt_tokens']}")
    return ids


# -- replay ----------------------------------------------------------------------------------

@dataclass
class Trace:
    """One request's decode: the speculative loop's steps and the run-ahead plain tokens."""
    generated: int
    # (drafted, accepted) of each step of the speculative loop; drafted 0: a plain step in it
    steps: list[tuple[int, int]] = field(default_factory=list)
    plain: int = 0
    open_end: bool = False  # the last step's draft ran past a stop token: its n is a lower bound

    @property
    def passes(self) -> int:
        return 1 + len(self.steps) + self.plain

    @property
    def drafted_per_step(self) -> list[int]:
        return [d for d, _ in self.steps if d]

    @property
    def accepted_per_step(self) -> list[int]:
        return [n for d, n in self.steps if d]


def label(path: str) -> str:
    """A results file's name with its folder (bench/results.json.gz, chatbench/...)."""
    return "/".join(Path(path).parts[-2:])


def common_prefix(draft, ref) -> int:
    n = 0
    while n < min(len(draft), len(ref)) and draft[n] == ref[n]:
        n += 1
    return n


def replay(prompt: list[int], out: list[int], k: int, sizes: tuple[int, ...], max_new: int,
           policy: AdaptiveSpeculation | None = None) -> Trace:
    """Engine.run's speculative loop over the recorded greedy output `out`; with `policy`, as
    the engine drives AdaptiveSpeculation (plain tokens run ahead while policy.plain)."""
    tokens, g, trace = list(prompt) + [out[0]], 1, Trace(len(out))
    while g < len(out):  # `out` ends where the request finished (stop token or max_new)
        if policy is not None and policy.plain:
            tokens.append(out[g])
            g += 1
            trace.plain += 1
            if g < len(out) and policy.resume(tokens):  # the step ahead's token, then draft
                tokens.append(out[g])
                g += 1
                trace.plain += 1
            continue
        budget = min(k, max_new - g - 1)
        draft = lookup(np.asarray(tokens, dtype=np.int64), sizes, budget) if budget > 0 else []
        if policy is not None and len(draft) == 0:
            policy.after_step(0, 0)  # the engine decodes this token plainly, no step here
            continue
        n = common_prefix(draft, out[g:])
        new = out[g:g + n + 1]  # accepted + bonus, cut where the request ended
        trace.open_end = n == len(out) - g < len(draft)
        trace.steps.append((len(draft), n))
        tokens += new
        g += len(new)
        if policy is not None:
            policy.after_step(len(draft), n)
    return trace


def policy_class(misses: int, first: int, longest: int) -> type[AdaptiveSpeculation]:
    return type("Policy", (AdaptiveSpeculation,),
                {"MISSES": misses, "FIRST": first, "LONGEST": longest})


def replay_adaptive(req, k, sizes, consts) -> Trace:
    policy = policy_class(*consts)(NgramDrafter(sizes, torch.device("cpu")))
    return replay(req.prompt, req.out, k, sizes, req.max_new, policy)


# -- the bench results -----------------------------------------------------------------------

@dataclass
class Request:
    prompt: list[int]
    out: list[int]
    max_new: int
    metrics: dict


def requests_of(results: dict, prompts, context: int, stop: set[int],
                adaptive: bool = False) -> dict[int, list[Request]]:
    """{k: requests} of the n-gram configurations that drafted at every step (results from
    before AdaptiveSpeculation carry no flag: all of them), or with `adaptive` of those that
    ran it, with their recorded outputs checked against how Engine.run ends a request."""
    s = results["settings"]
    max_model_len = s["max_model_len"] or context
    by_k = {}
    for c in results["configurations"]:
        if c["drafter"] != "ngram" or c.get("adaptive", False) != adaptive:
            continue
        reqs = []
        for r in c["requests"]:
            prompt, out = prompts[r["index"]], r["token_ids"]
            max_new = min(s["max_tokens"], max_model_len - len(prompt))
            stops = [i for i, t in enumerate(out) if t in stop]
            ends_ok = (stops == [len(out) - 1] if r["finish_reason"] == "stop"
                       else not stops and len(out) == max_new)
            if not ends_ok or len(out) != r["metrics"]["generated_tokens"]:
                sys.exit(f"{c['name']} prompt {r['index']}: the output does not end as "
                         f"finish_reason {r['finish_reason']!r} says")
            reqs.append(Request(prompt, out, max_new, r["metrics"]))
        by_k[c["k"]] = reqs
    return by_k


def validate(name: str, by_k: dict[int, list[Request]], sizes,
             adaptive: bool = False) -> tuple[list[str], int, int]:
    """Replay every request (with `adaptive`, under AdaptiveSpeculation's defaults, its plain
    tokens compared too); returns (mismatches, requests, open-ended last steps that agreed as
    far as the recorded output shows)."""
    bad, checked, open_ends = [], 0, 0
    for k, reqs in by_k.items():
        for i, req in enumerate(reqs):
            t = (replay_adaptive(req, k, sizes, DEFAULTS) if adaptive
                 else replay(req.prompt, req.out, k, sizes, req.max_new))
            m = req.metrics
            got = (t.drafted_per_step, t.accepted_per_step, t.passes)
            want = (m["drafted_per_step"], m["accepted_per_step"], m["target_passes"])
            if adaptive and t.plain != m["plain_tokens"]:
                bad.append(f"{name} k={k} adaptive prompt {i}: plain tokens replayed "
                           f"{t.plain}, measured {m['plain_tokens']}")
                checked += 1
                continue
            checked += 1
            if got == want:
                continue
            if (t.open_end and got[0] == want[0] and got[2] == want[2]
                    and got[1][:-1] == want[1][:-1] and got[1][-1] <= want[1][-1]):
                open_ends += 1  # accepted past the stop token: unknowable from the output
                continue
            steps_got, steps_want = list(zip(*got[:2])), list(zip(*want[:2]))
            j = common_prefix(steps_got, steps_want)
            bad.append(f"{name} k={k}{' adaptive' if adaptive else ''} prompt {i}: target "
                       f"passes replayed {got[2]}, measured "
                       f"{want[2]}; (drafted, accepted) from drafting step {j}: replayed "
                       f"{steps_got[j:j + 3]}, measured {steps_want[j:j + 3]}")
    return bad, checked, open_ends


# -- timing model ----------------------------------------------------------------------------

def features(drafted_per_step: list[int], steps: int) -> list[float]:
    """[steps that drafted nothing, steps that drafted, drafted tokens] of a request's
    decode (`steps` = target passes - 1, run-ahead plain tokens excluded)."""
    return [steps - len(drafted_per_step), len(drafted_per_step), sum(drafted_per_step)]


def measured_features(req: Request) -> list[float]:
    m = req.metrics
    return features(m["drafted_per_step"], m["target_passes"] - 1)


def fit(reqs: list[Request]) -> np.ndarray:
    """(A, B, C) seconds: least squares of decode_time_s over the requests."""
    x = np.array([measured_features(r) for r in reqs])
    y = np.array([r.metrics["decode_time_s"] for r in reqs])
    return np.linalg.lstsq(x, y, rcond=None)[0]


def modeled_time(trace: Trace, abc: np.ndarray, p: float) -> float:
    return float(np.dot(features(trace.drafted_per_step, len(trace.steps)), abc)) + p * trace.plain


def median_rate(pairs) -> float:
    """Median over requests of (generated - 1) / decode time."""
    return statistics.median((g - 1) / t for g, t in pairs)


# -- report ----------------------------------------------------------------------------------

def table(head: list[str], rows: list[list]) -> str:
    return "\n".join(table_lines(head, [[str(v) for v in r] for r in rows]))


def simulate_file(path: str, results: dict, by_k, abc, p: float, plain_rate: float) -> dict:
    sizes = tuple(sorted(results["settings"]["ngram_sizes"], reverse=True))
    rows, grid = [], {}
    for k, reqs in sorted(by_k.items()):
        fixed = [replay(r.prompt, r.out, k, sizes, r.max_new) for r in reqs]
        adaptive = [replay_adaptive(r, k, sizes, DEFAULTS) for r in reqs]
        gen = sum(t.generated for t in fixed)
        measured = ((r.metrics["generated_tokens"], r.metrics["decode_time_s"]) for r in reqs)
        row = {
            "k": k,
            "measured_speedup": median_rate(measured) / plain_rate,
            "modeled_fixed_speedup": median_rate((t.generated, modeled_time(t, abc, p))
                                                 for t in fixed) / plain_rate,
            "modeled_adaptive_speedup": median_rate((t.generated, modeled_time(t, abc, p))
                                                    for t in adaptive) / plain_rate,
            "tau_fixed": gen / sum(t.passes for t in fixed),
            "tau_adaptive": gen / sum(t.passes for t in adaptive),
            "adaptive_plain_tokens": sum(t.plain for t in adaptive),
            "adaptive_plain_share": sum(t.plain for t in adaptive) / gen,
            "adaptive_passes": sum(t.passes for t in adaptive),
            "adaptive_accepted": sum(sum(t.accepted_per_step) for t in adaptive),
            "adaptive_steps_by_drafted": dict(sorted(
                (d, sum(1 for t in adaptive for s, _ in t.steps if s == d))
                for d in {s for t in adaptive for s, _ in t.steps})),
            "fixed_passes": sum(t.passes for t in fixed),
            "fixed_empty_steps": sum(1 for t in fixed for d, _ in t.steps if d == 0),
            "generated": gen,
        }
        rows.append(row)
        for consts in itertools.product(*GRID.values()):
            traces = [replay_adaptive(r, k, sizes, consts) for r in reqs]
            grid.setdefault(consts, {})[k] = median_rate(
                (t.generated, modeled_time(t, abc, p)) for t in traces) / plain_rate
    return {"file": path, "rows": rows, "grid": grid}


def print_file(sim: dict) -> None:
    print(f"\n### {sim['file']}\n")
    print(table(["k", "measured ×", "modeled fixed ×", "modeled adaptive ×", "plain share",
                 "τ fixed", "τ adaptive", "passes fixed → adaptive",
                 "empty drafts fixed → adaptive"],
                [[r["k"], f"{r['measured_speedup']:.2f}", f"{r['modeled_fixed_speedup']:.2f}",
                  f"{r['modeled_adaptive_speedup']:.2f}", f"{r['adaptive_plain_share']:.0%}",
                  f"{r['tau_fixed']:.2f}", f"{r['tau_adaptive']:.2f}",
                  f"{r['fixed_passes']} → {r['adaptive_passes']}",
                  f"{r['fixed_empty_steps']} → {r['adaptive_steps_by_drafted'].get(0, 0)}"]
                 for r in sim["rows"]]))
    ks = [r["k"] for r in sim["rows"]]
    print("\nPolicy grid, modeled adaptive speedup × by k (* = the defaults):\n")
    print(table(["MISSES", "FIRST", "LONGEST", *[f"k={k}" for k in ks]],
                [[*consts[:2], f"{consts[2]}{' *' if consts == DEFAULTS else ''}",
                  *[f"{by_k[k]:.3f}" for k in ks]] for consts, by_k in sim["grid"].items()]))
    (consts, k), best = max((((c, k), v) for c, by_k in sim["grid"].items()
                             for k, v in by_k.items()), key=lambda x: x[1])
    fixed = max(sim["rows"], key=lambda r: r["modeled_fixed_speedup"])
    print(f"\nbest: MISSES={consts[0]} FIRST={consts[1]} LONGEST={consts[2]} k={k}: "
          f"{best:.3f}× (defaults at that k: {sim['grid'][DEFAULTS][k]:.3f}×; best fixed k "
          f"modeled: k={fixed['k']} {fixed['modeled_fixed_speedup']:.3f}×)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of `flashdraft bench`")
    ap.add_argument("--gguf", required=True, help="the target's GGUF (for its tokenizer)")
    ap.add_argument("--fit", choices=("file", "pooled"), default="file",
                    help="timing model for the speedups: fitted per file (default) or pooled")
    ap.add_argument("--json", help="write everything to this file")
    args = ap.parse_args()

    tokenizer, context, stop = load_tokenizer(args.gguf)
    files, adaptive_runs = {}, {}
    for path in args.results:
        raw = Path(path).read_bytes()
        results = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
        prompts = rebuild_prompts(results, tokenizer)
        files[path] = (results, requests_of(results, prompts, context, stop))
        adaptive_runs[path] = requests_of(results, prompts, context, stop, adaptive=True)
        if not files[path][1]:
            sys.exit(f"{path}: no n-gram configuration that drafted at every step, which the "
                     f"timing model is fitted on (bench --adaptive-speculation off or both)")

    print("## n-gram replay: validation against the measured steps\n")
    rows, mismatches = [], []
    for path, (results, by_k) in files.items():
        sizes = tuple(sorted(results["settings"]["ngram_sizes"], reverse=True))
        for adaptive, runs in ((False, by_k), (True, adaptive_runs[path])):
            if not runs:
                continue
            bad, checked, open_ends = validate(label(path), runs, sizes, adaptive)
            mismatches += bad
            rows.append([label(path), "adaptive" if adaptive else "every step", checked,
                         checked - len(bad) - open_ends, open_ends, len(bad)])
    print(table(["file", "drafting", "requests", "exact",
                 "agree up to a draft past the stop token", "mismatches"], rows))
    for line in mismatches:
        print(f"- MISMATCH {line}")

    fits = {path: fit([r for reqs in by_k.values() for r in reqs])
            for path, (_, by_k) in files.items()}
    fits["pooled"] = fit([r for _, by_k in files.values() for reqs in by_k.values()
                          for r in reqs])
    plain = {}
    for path, (results, _) in files.items():
        reqs = next(c for c in results["configurations"] if c["drafter"] is None)["requests"]
        plain[path] = (statistics.median(r["metrics"]["tpot_s"] for r in reqs),
                       statistics.median(r["metrics"]["decode_tokens_per_s"] for r in reqs))

    print("\n## Timing model (fitted: a model, not a measurement)\n")
    print("decode time = A·(steps that drafted nothing) + Σ over drafting steps (B + C·d); "
          "P = plain decoding's median TPOT (a run-ahead plain token)\n")
    print(table(["fit", "A ms", "B ms", "C ms/token", "P ms (plain TPOT)"],
                [[label(f) if f != "pooled" else "pooled", *[f"{v * 1e3:.3f}" for v in abc],
                  f"{plain[f][0] * 1e3:.3f}" if f in plain else "—"]
                 for f, abc in fits.items()]))
    print("\nresiduals: Σ modeled / Σ measured decode time − 1, per configuration\n")
    rows = []
    for path, (_, by_k) in files.items():
        for k, reqs in sorted(by_k.items()):
            x = np.array([measured_features(r) for r in reqs])
            t = sum(r.metrics["decode_time_s"] for r in reqs)
            rows.append([label(path), k, f"{t * 1e3:.1f}",
                         *[f"{x.dot(fits[f]).sum() / t - 1:+.1%}" for f in (path, "pooled")]])
    print(table(["file", "k", "measured ms", "file fit", "pooled fit"], rows))

    print(f"\n## Speedups over plain decoding ({args.fit} fit)\n")
    print("× = median over prompts of (generated − 1) / decode time, over plain decoding's "
          "measured median tokens/s in the same file; adaptive = AdaptiveSpeculation with "
          f"MISSES={DEFAULTS[0]} FIRST={DEFAULTS[1]} LONGEST={DEFAULTS[2]}; plain share = "
          "run-ahead plain tokens / generated; τ = generated / target passes")
    sims = []
    for path, (results, by_k) in files.items():
        abc = fits[path if args.fit == "file" else "pooled"]
        sims.append(simulate_file(path, results, by_k, abc, plain[path][0], plain[path][1]))
        print_file(sims[-1])

    if args.json:
        out = {"mismatches": mismatches,
               "fits_s": {f: dict(zip("ABC", map(float, abc))) for f, abc in fits.items()},
               "plain": {f: {"P_s": v[0], "median_tokens_per_s": v[1]} for f, v in plain.items()},
               "fit_used": args.fit,
               "files": [{**s, "grid": [{"MISSES": c[0], "FIRST": c[1], "LONGEST": c[2],
                                         "speedup_by_k": v} for c, v in s["grid"].items()]}
                         for s in sims]}
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    if mismatches:
        sys.exit(f"{len(mismatches)} requests do not replay exactly")


if __name__ == "__main__":
    main()
