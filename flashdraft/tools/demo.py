"""`flashdraft demo`: the main job on the real example pair, in one command.

Loads Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft) from the example cache
(pulling them if needed), then runs plain decoding, the draft model and n-gram lookup (and,
given a DFlash drafter directory for the target, DFlash block drafting) over a few HumanEval
prompts and the seed prompts, and prints per prompt and in total: plain tokens/s, speculative
tokens/s, speedup, τ, acceptance rate and whether the output is identical to plain decoding.
The timing logic is the benchmark's (`flashdraft.tools.bench`).

A DFlash drafter drafts its whole block a step (block_size - 1 tokens: one pass fills it, so
it is not swept over k as the draft model is); `flashdraft train-drafter --target
example:qwen2.5-coder-1.5b --output DIR` makes one for the example target.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

TARGET = "example:qwen2.5-coder-1.5b"
DRAFT = "example:qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class DemoSettings:
    num_speculative_tokens: tuple[int, ...] = (5,)
    num_humaneval: int | None = None  # None: 4 on CUDA, 2 on a CPU
    max_tokens: int | None = None  # None: 128 on CUDA, 48 on a CPU
    device: str | None = None
    dtype: str | None = None
    output: str | None = None  # where results.json / results.md go, if anywhere
    dflash: str | None = None  # a DFlash drafter for the target: a directory or cached hub id

    def __post_init__(self):
        if (not self.num_speculative_tokens
                or any(not 1 <= k <= 64 for k in self.num_speculative_tokens)):
            raise ValueError(f"--num-speculative-tokens takes numbers from 1 to 64, got "
                             f"{self.num_speculative_tokens!r}")
        if self.num_humaneval is not None and self.num_humaneval < 0:
            raise ValueError(f"--num-humaneval must be >= 0, got {self.num_humaneval}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.dflash is not None and not self.dflash.removeprefix("dflash:").strip():
            raise ValueError(f"--dflash {self.dflash!r} names no drafter: give a DFlash drafter "
                             f"directory ({TRAIN_HINT})")


TRAIN_HINT = f"`flashdraft train-drafter --target {TARGET} --output DIR` trains one"


def dflash_drafter(ref: str) -> tuple[str, int]:
    """--dflash's drafter spec and the block it drafts, its directory read before any model
    loads, so that a wrong path fails at once."""
    from ..drafters.dflash import read_dflash_config
    from ..loading.hf import resolve_hf

    ref = ref.removeprefix("dflash:")
    try:
        cfg = read_dflash_config(resolve_hf(ref))
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"--dflash {ref!r}: {str(err).rstrip('.')}. A DFlash drafter for "
                         f"{TARGET} is a directory of config.json (with dflash_config) and "
                         f"*.safetensors; {TRAIN_HINT}.") from None
    return "dflash:" + ref, cfg.block_size - 1


def run_demo(s: DemoSettings, out=None) -> dict:
    from tqdm import tqdm

    from ..api import LLM, pick_device_dtype
    from .bench import (BenchSettings, Configuration, GpuMonitor, load_prompts, prompt_ids,
                        run_configuration, write_json)

    out = out or sys.stdout
    device, _ = pick_device_dtype(s.device, s.dtype)
    gpu = device.type == "cuda"
    n_he = s.num_humaneval if s.num_humaneval is not None else (4 if gpu else 2)
    max_tokens = s.max_tokens or (128 if gpu else 48)
    prompts = (load_prompts("humaneval", num=n_he) if n_he else []) + load_prompts("seed")
    dflash, block_k = dflash_drafter(s.dflash) if s.dflash else (None, 0)
    drafts = (DRAFT, "ngram") + ((dflash,) if dflash else ())
    bench = BenchSettings(model=TARGET, drafts=drafts,
                          num_speculative_tokens=s.num_speculative_tokens,
                          max_tokens=max_tokens, device=s.device, dtype=s.dtype,
                          command=" ".join(sys.argv))
    print(f"loading {' and '.join(d for d in (TARGET, DRAFT, dflash) if d)} on {device} ...",
          file=sys.stderr)
    llm = LLM(TARGET, draft=DRAFT, device=s.device, dtype=s.dtype)
    for d in drafts[1:]:  # loaded (and checked against the target) before anything is timed
        llm.get_drafter(d)
    ids = [prompt_ids(llm, p) for p in prompts]
    configs = [Configuration(None, 0, 0.0, "plain")] + [
        Configuration(d, k, 0.0, label) for d, label in ((DRAFT, "draft 0.5B"), ("ngram", "ngram"))
        for k in s.num_speculative_tokens]
    if dflash:
        configs.append(Configuration(dflash, block_k, 0.0, "dflash"))
    entries: list[dict] = []
    monitor = GpuMonitor(llm.device)
    with tqdm(total=len(configs) * (1 + len(prompts)), unit="request", file=sys.stderr) as bar:
        plain = None
        for cfg in configs:
            entry = run_configuration(bench, llm, cfg, prompts, ids, plain, bar, monitor, entries)
            plain = plain or entry
    print(format_demo(entries, prompts, str(llm.device), str(llm.dtype).replace("torch.", ""),
                      max_tokens), file=out)
    results = {"configurations": entries, "prompts": [p.id for p in prompts],
               "device": str(llm.device), "dtype": str(llm.dtype), "max_tokens": max_tokens}
    if s.output:
        from pathlib import Path

        Path(s.output).mkdir(parents=True, exist_ok=True)
        write_json(results, Path(s.output))
    return results


def format_demo(entries: list[dict], prompts, device: str, dtype: str, max_tokens: int) -> str:
    from .bench import _f

    plain, specs = entries[0], entries[1:]
    lines = [f"\nflashdraft demo — {device}, {dtype}, greedy, {max_tokens} new tokens, "
             f"{len(prompts)} prompts\n"]
    head = "| prompt | plain tok/s | " + " | ".join(
        f"{e['name']} tok/s | speedup | τ | accept | same" for e in specs) + " |"
    lines += [head, "|" + "---|" * (2 + 5 * len(specs))]
    for i, p in enumerate(prompts):
        row = [p.id, f"{plain['requests'][i]['metrics']['decode_tokens_per_s']:.1f}"]
        for e in specs:
            r = e["requests"][i]
            m = r["metrics"]
            row += [f"{m['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}×", f"{m['tau']:.2f}",
                    _f(m["acceptance_rate"], ".0%"), "yes" if r["identical_to_plain"] else "NO"]
        lines.append("| " + " | ".join(row) + " |")
    total = ["**median / total**", f"{plain['summary']['tokens_per_s']['median']:.1f}"]
    for e in specs:
        s = e["summary"]
        total += [f"{s['tokens_per_s']['median']:.1f}", f"{s['speedup']:.2f}×", f"{s['tau']:.2f}",
                  _f(s["acceptance_rate"], ".0%"),  # none where nothing was drafted
                  f"{s['identical_to_plain']}/{s['compared_with_plain']}"]
    lines.append("| " + " | ".join(total) + " |")
    lines.append("\ntokens/s: decode phase, (generated − 1) / time after the first token; "
                 "speedup: over plain decoding of the same target, same prompts, same run; "
                 "τ: tokens per target pass; same: output identical to plain decoding.")
    return "\n".join(lines)
