"""`flashdraft train-drafter`: a DFlash drafter for your own target, by self-distillation.

What a drafter must learn is what the target would say next, so the training text is the
target's own: its responses to the prompts you supply (generated here, batched), or, the
cheaper option, the text you supply as it is. Either way each position's label is the
target's argmax there, the token greedy verification accepts.

The frozen target's pass that labels the sequences also gives the hidden states of the layers
the drafter reads; they are kept in the GPU's memory where they fit (else each step computes
them again for its batch). One step: a batch of sequences, and in each sequence blocks are
anchored at random positions a. A block is [token a, MASK × (B - 1)] at positions a … a+B-1;
it sees the context features strictly before a and, bidirectionally, its own rows, exactly
as a drafting step sees them (`drafters.dflash`), and its row j (1 … B-1) is scored against
the label at a + j with cross-entropy weighted by exp(-(j - 1) / γ): the first drafts decide
how many of the rest are ever verified. The target's embedding and LM head are used, and
stay frozen, as at inference.

A held-out share of the sequences gives the progress bar's τ estimate: blocks placed one
after another in each held-out sequence, τ = 1 + the mean number of leading drafts that equal
the labels (greedy speculation with k = B - 1 over the target's own text). The drafter is
saved in the public format (`drafters.dflash.save_dflash`) at every estimate and at the end,
with train_log.json (the settings, the τ-vs-minutes curve, the loss).

The default prompt set, flashdraft/data/train_prompts.jsonl, was written for the project
(its header says so); `--data stdlib` makes thousands more from the docstrings of the Python
standard library that runs the training (`stdlib_prompts`). Neither holds a HumanEval or other
benchmark prompt (tests/test_train_drafter.py checks both).
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import KernelConfig
from ..drafters.dflash import (DFlashConfig, DFlashModel, build_target_layer_ids, save_dflash)
from ..kv_cache import KVCache
from ..model import Transformer
from ..sampling import probs_from_logits, sample

SOURCES = ("generate", "text")
BUILTIN = "builtin"
STDLIB = "stdlib"
# Logit rows (positions × vocabulary, float32) one labelling pass may hold at a time.
LABEL_ROWS = 1 << 27
# Tokens one labelling pass runs through the target (sequences of similar lengths together).
LABEL_TOKENS = 1 << 14


@dataclass(frozen=True)
class TrainSettings:
    target: str  # the target model: a directory, .gguf file, hub id in the cache or alias
    output: str  # the drafter's directory (config.json, model.safetensors, train_log.json)
    data: str = BUILTIN  # "builtin" (the shipped prompts), a .jsonl prompt file, a .txt file,
                         # or a directory of them
    source: str = "generate"  # "generate": the target's responses to the prompts; "text": the
                              # supplied text (prompts included) as it is
    layers: int = 1  # the drafter's decoder layers
    block_size: int = 16  # B: the last token and B - 1 masks; drafts up to B - 1 a step
    minutes: float = 10.0  # the training loop's wall-clock budget (generation not included)
    max_steps: int | None = None  # or stop after this many steps, whichever comes first; the
                                  # learning-rate schedule then follows steps (reproducible)
    gamma: float = 7.0  # γ of the position weights exp(-(j - 1) / γ)
    target_layer_ids: tuple[int, ...] | None = None  # None: the reference's default spread
    mask_token_id: int | None = None  # None: the first embedding row past the tokenizer's
    max_new_tokens: int = 256  # of each generated response
    temperature: float = 0.0  # of the generation (0: greedy); labels are argmax either way
    responses_per_prompt: int = 1
    max_len: int = 1024  # tokens of a training sequence; longer ones are cut
    batch_size: int = 8  # sequences a step
    anchors: int = 16  # blocks per sequence a step
    lr: float = 6e-4
    heldout: float = 0.05  # the share of sequences kept for the τ estimate
    eval_every_s: float = 60.0
    keep_features: bool = True  # the target's features computed once and kept where they fit
                                # (`features_fit`); False: computed again each step
    generation_batch: int = 32  # sequences generated together
    seed: int = 0
    device: str | None = None
    dtype: str | None = None  # the target's; None: bfloat16 on CUDA, float32 on a CPU
    progress: bool = True

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"--source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        for name, low in (("layers", 1), ("block_size", 2), ("max_new_tokens", 1),
                          ("responses_per_prompt", 1), ("batch_size", 1), ("anchors", 1),
                          ("generation_batch", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number >= {low}, "
                                 f"got {value!r}")
        if self.max_steps is not None and not (isinstance(self.max_steps, int)
                                               and self.max_steps >= 1):
            raise ValueError(f"--max-steps must be a whole number >= 1, got {self.max_steps!r}")
        if self.max_len < self.block_size + 1:
            raise ValueError(f"--max-len {self.max_len} leaves no room for a block of "
                             f"{self.block_size} after a token; use at least "
                             f"{self.block_size + 1}")
        for name in ("minutes", "gamma", "lr", "eval_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        if not 0 <= self.heldout < 1:
            raise ValueError(f"--heldout must be in [0, 1), got {self.heldout!r}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if self.responses_per_prompt > 1 and self.temperature == 0:
            raise ValueError(f"--responses-per-prompt {self.responses_per_prompt} at "
                             f"--temperature 0 would repeat one greedy response; sample "
                             f"(e.g. --temperature 0.8) or keep one response per prompt")


@dataclass
class TrainResult:
    output: Path
    sequences: int  # for training (the held-out ones not counted)
    heldout_sequences: int
    steps: int = 0
    train_tokens: int = 0  # sequence tokens through the target and the drafter
    generation_s: float = 0.0  # generating and labelling the data
    train_s: float = 0.0
    loss: float = float("nan")  # the last step's
    tau_curve: list[tuple[float, float]] = field(default_factory=list)  # (minutes, τ estimate)
    drafter: DFlashModel | None = None  # as trained (float32), before saving

    @property
    def tau(self) -> float:
        return self.tau_curve[-1][1] if self.tau_curve else float("nan")


# -- data ------------------------------------------------------------------------------------

def parse_prompts(text: str, name: str) -> list:
    """Prompts from the text of a file `name`: a .txt file is one raw-text prompt; else JSONL
    in the bench's format (`tools.bench.parse_jsonl`), where lines starting with # are notes."""
    from .bench import BenchPrompt, parse_jsonl

    if name.endswith(".txt"):
        return [BenchPrompt(Path(name).stem, text=text)] if text.strip() else []
    lines = ["" if line.startswith("#") else line for line in text.splitlines()]
    return parse_jsonl("\n".join(lines), name)  # notes left blank: line numbers stay right


def load_training_prompts(spec: str) -> list:
    """The prompts `spec` names: "builtin", "stdlib", a .jsonl or .txt file, or a directory of
    them; several joined by commas."""
    if "," in spec:
        return [p for part in spec.split(",") if part for p in load_training_prompts(part)]
    if spec == BUILTIN:
        from importlib.resources import files
        text = files("flashdraft").joinpath("data/train_prompts.jsonl").read_text("utf-8")
        return parse_prompts(text, "train_prompts.jsonl")
    if spec == STDLIB:
        return stdlib_prompts()
    path = Path(spec).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".txt"))
    elif path.is_file() and path.suffix in (".jsonl", ".txt"):
        found = [path]
    else:
        raise FileNotFoundError(f"--data {spec!r} is neither {BUILTIN!r}, {STDLIB!r} nor a "
                                f".jsonl / .txt file or a directory holding them")
    prompts = [x for f in found for x in parse_prompts(f.read_text("utf-8"), str(f))]
    if not prompts:
        raise ValueError(f"--data {spec!r} holds no prompts")
    return prompts


# Ways of asking for a function from its signature and docstring, taken in turn.
STDLIB_ASKS = (
    "Complete this Python function.\n\n```python\n{sig}\n    \"\"\"{doc}\"\"\"\n```",
    "Write a Python function `{name}` that does the following: {doc}",
    "Implement the function below and explain briefly how it works.\n\n```python\n{sig}\n"
    "    \"\"\"{doc}\"\"\"\n```",
    "In Python, write `{sig}` — {doc}",
)
# Skipped: tests and tools whose docstrings are about the standard library's own workings.
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
               "ensurepip", "turtledemo", "pydoc_data", "__pycache__"}
# HumanEval's entry points that the standard library defines too (Python 3.11): not asked for,
# so that no training prompt names a benchmark's function.
STDLIB_SKIP_NAMES = {"add", "compare", "encode", "is_nested", "median", "multiply", "search",
                     "unique"}


def stdlib_prompts() -> list:
    """Coding prompts made from the Python standard library of the interpreter running this,
    so that any machine with Python has thousands of them (origin: CPython's own sources,
    Python Software Foundation License): each public function or method whose docstring says
    enough (40 characters or more) becomes a request for that function from its signature and
    docstring, asked in one of STDLIB_ASKS's ways in turn; duplicates (same name and
    docstring) once. The same Python version gives the same prompts in the same order."""
    import ast
    import sysconfig

    from .bench import BenchPrompt

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1]))
    prompts, seen = [], set()
    for path in files:
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if (node.name.startswith("_") or node.name in STDLIB_SKIP_NAMES or not doc
                    or len(doc) < 40 or (node.name, doc) in seen):
                continue
            seen.add((node.name, doc))
            sig = f"def {node.name}({ast.unparse(node.args)}):"
            ask = STDLIB_ASKS[len(prompts) % len(STDLIB_ASKS)]
            text = ask.format(sig=sig, name=node.name,
                              doc=doc.strip().replace("\n", "\n    " if "```" in ask else "\n"))
            prompts.append(BenchPrompt(f"stdlib-{path.stem}-{node.name}",
                                       messages=[{"role": "user", "content": text}]))
    return prompts


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """A chat through the target's chat template (as the bench sends it), raw text as it is."""
    if prompt.messages is None:
        return tokenizer.encode(prompt.text)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"prompt {prompt.id!r} is a chat, but the target has no chat "
                         f"template; give raw-text prompts ({{\"prompt\": ...}} or .txt)")
    text = tokenizer.apply_chat_template(prompt.messages, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def generate_responses(model: Transformer, prompts: list[list[int]], max_new: int,
                       temperature: float, stop_ids: set[int], batch: int,
                       generator: torch.Generator | None = None) -> list[list[int]]:
    """The target's response to each prompt (ids, stop token included), `batch` prompts at a
    time. The rows of a batch advance in lockstep, one position a step from the shortest
    prompt's end: a row still inside its prompt is fed its prompt's token and ignores the
    prediction. Each position's keys are written before any query reads them (causal), so
    the padding a row carries past its prompt's end in the prefill is never seen."""
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths together
    responses: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(order), batch):
        rows = order[first:first + batch]
        lengths = torch.tensor([len(prompts[i]) for i in rows], device=device)
        lo, hi = int(lengths.min()), int(lengths.max())
        padded = torch.zeros(len(rows), hi, dtype=torch.long, device=device)
        for r, i in enumerate(rows):
            padded[r, :len(prompts[i])] = torch.tensor(prompts[i], device=device)
        cache = KVCache.for_model(model.cfg, len(rows), hi + max_new, dtype, device)
        positions = torch.arange(lo, device=device).expand(len(rows), lo)
        logits, _ = model(padded[:, :lo], positions, cache, kv_len=lo, last_only=True)
        done = [False] * len(rows)
        for pos in range(lo, hi + max_new):
            last = logits[:, -1]
            if temperature > 0:
                predicted = sample(probs_from_logits(last, temperature), generator)
            else:
                predicted = last.argmax(-1)
            in_prompt = pos < lengths
            feed = torch.where(in_prompt, padded[:, min(pos, hi - 1)], predicted)  # [rows]
            for r, (token, prompted) in enumerate(zip(feed.tolist(), in_prompt.tolist())):
                if prompted or done[r]:
                    continue
                out = responses[rows[r]]
                out.append(token)
                done[r] = token in stop_ids or len(out) >= max_new
            if all(done):
                break
            logits, _ = model(feed[:, None], torch.full((len(rows), 1), pos, device=device),
                              cache, kv_len=pos + 1)
    return responses


@torch.no_grad()
def label_sequences(model: Transformer, sequences: list[torch.Tensor],
                    feature_layers: tuple[int, ...] | None = None, rows: int = LABEL_TOKENS
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """(labels, features) of each sequence [T]: labels[p] = the target's argmax after the
    prefix of p tokens (-1 at p = 0, which nothing predicts), on the CPU; with feature_layers
    (`hidden_layers` indices, in the order the drafter concatenates them) each position's
    hidden states of those layers, [T, len · hidden] on the model's device, else None.
    Sequences of similar lengths run together, right-padded (causal: padding changes no
    position before it), about `rows` tokens a pass, and their logits in slices."""
    device = model.embed.weight.device
    last = model.cfg.num_layers
    layers = tuple(sorted(set(feature_layers or ()) | {last}))
    per_slice = max(1, LABEL_ROWS // model.cfg.vocab_size)
    labels: list = [None] * len(sequences)
    features: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    first = 0
    while first < len(order):
        group = [order[first]]
        while (first + len(group) < len(order)
               and (len(group) + 1) * len(sequences[order[first + len(group)]]) <= rows):
            group.append(order[first + len(group)])
        first += len(group)
        t = len(sequences[group[-1]])  # the longest of the group
        tokens = torch.zeros(len(group), t, dtype=torch.long)
        for r, i in enumerate(group):
            tokens[r, :len(sequences[i])] = sequences[i]
        cache = KVCache.for_model(model.cfg, len(group), t, model.embed.weight.dtype, device)
        _, hidden = model(tokens.to(device), torch.arange(t, device=device).expand(len(group), t),
                          cache, kv_len=t, hidden_layers=layers, last_only=True)
        h = hidden[layers.index(last)].flatten(0, 1)  # [rows · T, hidden], before the final norm
        best = torch.cat([model.lm_head(model.norm(h[i:i + per_slice])).argmax(-1)
                          for i in range(0, len(h), per_slice)]).view(len(group), t).cpu()
        for r, i in enumerate(group):
            n = len(sequences[i])
            labels[i] = torch.cat([torch.full((1,), -1, dtype=torch.long), best[r, :n - 1]])
            if feature_layers:
                features[i] = torch.cat([hidden[layers.index(j)][r, :n]
                                         for j in feature_layers], -1).clone()
    return labels, (features if feature_layers else None)


def default_mask_token(model: Transformer, tokenizer) -> int:
    """The first embedding row past the tokenizer's tokens (checkpoints pad their vocabulary,
    and no text ever holds such a row) whose embedding is not zero (a zero mask would leave
    the block's mask rows without a query); else the last row."""
    weight = model.embed.weight
    for i in range(len(tokenizer), weight.shape[0]):
        if weight[i].abs().sum() > 0:
            return i
    return weight.shape[0] - 1


def read_layer_ids(target: Transformer, s: TrainSettings) -> tuple[int, ...]:
    """The 0-based target layers the new drafter reads: --target-layer-ids, else the
    reference's spread."""
    if s.target_layer_ids is not None:
        return tuple(s.target_layer_ids)
    return tuple(build_target_layer_ids(target.cfg.num_layers, s.layers))


def new_drafter(target: Transformer, s: TrainSettings, mask_token_id: int) -> DFlashModel:
    """A drafter of s.layers Qwen3 layers of the target's shapes, initialised as transformers
    initialises Qwen3 (weights N(0, 0.02), norms 1)."""
    c = target.cfg
    layers = replace(c, arch="qwen3", num_layers=s.layers, qk_norm=True, qkv_bias=False,
                     tie_word_embeddings=False)
    ids = read_layer_ids(target, s)
    cfg = DFlashConfig(layers=layers, num_target_layers=c.num_layers, target_layer_ids=ids,
                       block_size=s.block_size, mask_token_id=mask_token_id)
    cfg.check_target(c, "the new drafter")  # e.g. --target-layer-ids out of range
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return model


# -- the training step -----------------------------------------------------------------------

@dataclass
class Batch:
    tokens: torch.Tensor  # [b, T] int64, right-padded
    labels: torch.Tensor  # [b, T] int64: the target's argmax after each prefix; -1: none
    lengths: torch.Tensor  # [b]
    anchors: torch.Tensor  # [b, m]: each block's first position
    features: torch.Tensor | None = None  # [b, T, F]: the target's, where they are kept


def target_features(target: Transformer, drafter: DFlashModel, batch: Batch) -> torch.Tensor:
    """The target layers' outputs that the drafter reads, concatenated in its fc order:
    [b, T, len(target_layer_ids) · hidden], the batch's own where kept, else computed now.
    Padding past a sequence's end changes no position before it (causal)."""
    if batch.features is not None:
        return batch.features
    tokens = batch.tokens
    b, t = tokens.shape
    layers = drafter.cfg.hidden_layers
    cache = KVCache.for_model(target.cfg, b, t, target.embed.weight.dtype, tokens.device)
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    with torch.no_grad():
        _, hidden = target(tokens, positions, cache, kv_len=t, hidden_layers=layers,
                           last_only=True)
    return torch.cat([hidden[layers.index(j + 1)] for j in drafter.cfg.target_layer_ids], -1)


def block_logits(drafter: DFlashModel, target: Transformer, batch: Batch,
                 features: torch.Tensor) -> torch.Tensor:
    """The drafter's logits for every block of the batch: [b, m, B - 1, vocab] (float32), row
    j for position anchor + j + 1. Each block sees the context strictly before its anchor and
    itself, in one pass for all the blocks."""
    cfg = drafter.cfg
    block = cfg.block_size
    b, t = batch.tokens.shape
    m = batch.anchors.shape[1]
    device = batch.tokens.device
    context = drafter.project_context(features)  # [b, T, hidden]
    ids = torch.full((b, m, block), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = batch.tokens.gather(1, batch.anchors)
    x = target.embed(ids.view(b, m * block)) * cfg.input_embedding_scale
    offsets = torch.arange(block, device=device)
    positions = torch.cat([torch.arange(t, device=device).expand(b, t),
                           (batch.anchors[:, :, None] + offsets).view(b, m * block)], dim=1)
    before = torch.arange(t, device=device) < batch.anchors[:, :, None]  # [b, m, T]
    own = torch.arange(m, device=device).repeat_interleave(block)
    visible = torch.cat([before.repeat_interleave(block, dim=1),
                         (own[:, None] == own[None, :]).expand(b, -1, -1)], dim=-1)
    mask = visible[:, None]  # [b, 1, m·B, T + m·B]

    def attend(layer, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])

    out = drafter(x.to(features.dtype), context, positions, attend)
    out = out.view(b, m, block, -1)[:, :, 1:]
    return drafter.logits(out, target.lm_head)


def block_labels(batch: Batch, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [b, m, B - 1] of each block's drafts, whether each lies inside its sequence)."""
    b, t = batch.tokens.shape
    at = batch.anchors[:, :, None] + torch.arange(1, block, device=batch.tokens.device)
    valid = (at < batch.lengths[:, None, None]) & (at < t)
    labels = batch.labels.gather(1, at.clamp(max=t - 1).view(b, -1)).view(at.shape)
    return labels, valid & (labels >= 0)


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                  gamma: float) -> torch.Tensor:
    """Cross-entropy over block positions j = 1 … B-1 weighted by exp(-(j - 1) / γ)."""
    j = torch.arange(logits.shape[2], device=logits.device)
    weights = torch.exp(-j / gamma) * valid
    ce = F.cross_entropy(logits.flatten(0, 2), labels.clamp_min(0).flatten(), reduction="none")
    return (ce.view_as(weights) * weights).sum() / weights.sum().clamp_min(1e-6)


def accepted_lengths(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
                     ) -> torch.Tensor:
    """Leading drafts of each block that equal the labels (greedy acceptance): [b, m]."""
    match = (logits.argmax(-1) == labels) & valid
    return match.int().cumprod(-1).sum(-1)


# -- the loop --------------------------------------------------------------------------------

class Sequences:
    """Token sequences with their labels, where their anchors may go and, where they are kept,
    the target's features of each position (`label_sequences`)."""

    def __init__(self, tokens: list[torch.Tensor], labels: list[torch.Tensor],
                 starts: list[int], device: torch.device,
                 features: list[torch.Tensor] | None = None):
        self.tokens, self.labels, self.starts, self.device = tokens, labels, starts, device
        self.features = features

    def __len__(self):
        return len(self.tokens)

    def batch(self, rows: list[int], anchors: list[list[int]]) -> Batch:
        t = max(len(self.tokens[i]) for i in rows)
        tokens = torch.zeros(len(rows), t, dtype=torch.long)
        labels = torch.full((len(rows), t), -1, dtype=torch.long)
        for r, i in enumerate(rows):
            tokens[r, :len(self.tokens[i])] = self.tokens[i]
            labels[r, :len(self.labels[i])] = self.labels[i]
        lengths = torch.tensor([len(self.tokens[i]) for i in rows])
        features = None
        if self.features is not None:
            f = self.features[rows[0]]
            features = f.new_zeros(len(rows), t, f.shape[-1])
            for r, i in enumerate(rows):
                features[r, :len(self.tokens[i])] = self.features[i]
        return Batch(tokens.to(self.device), labels.to(self.device), lengths.to(self.device),
                     torch.tensor(anchors, dtype=torch.long, device=self.device), features)

    def random_batch(self, size: int, m: int, rng: random.Random) -> Batch:
        """size sequences, m anchors each, drawn uniformly (a block may run past the end: its
        rows there are not scored)."""
        rows = [rng.randrange(len(self)) for _ in range(size)]
        anchors = [[rng.randrange(self.starts[i], len(self.tokens[i]) - 1) for _ in range(m)]
                   for i in rows]
        return self.batch(rows, anchors)

    def eval_batches(self, block: int, m: int):
        """Each sequence's blocks placed one after another from its start (whole blocks only),
        m at a time."""
        for i in range(len(self)):
            starts = list(range(self.starts[i], len(self.tokens[i]) - block + 1, block))
            for first in range(0, len(starts), m):
                chunk = starts[first:first + m]
                yield self.batch([i], [chunk])


@torch.no_grad()
def estimate_tau(drafter: DFlashModel, target: Transformer, data: Sequences, autocast) -> float:
    """1 + the mean accepted length of the held-out blocks (see the module docstring)."""
    total, blocks = 0, 0
    for batch in data.eval_batches(drafter.cfg.block_size, 64):
        with autocast():
            logits = block_logits(drafter, target, batch,
                                  target_features(target, drafter, batch))
        labels, valid = block_labels(batch, drafter.cfg.block_size)
        accepted = accepted_lengths(logits, labels, valid)
        total += int(accepted.sum())
        blocks += accepted.numel()
    return 1.0 + total / blocks if blocks else float("nan")


def build_sequences(target, tokenizer, s: TrainSettings, prompts: list, log) -> tuple[list, list]:
    """(token sequences [T], the first position an anchor may take in each)."""
    ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    if s.source == "text":
        keep = [(torch.tensor(x[:s.max_len]), 1) for x in ids if len(x) >= 3]
    else:
        stop = set(target.cfg.eos_token_ids)  # the loader adds the tokenizer's and the chat's
        generator = torch.Generator(device=target.embed.weight.device).manual_seed(s.seed)
        room = [x[-(s.max_len - 2):] for x in ids]  # a prompt leaves room for a response
        responses = []
        for r in range(s.responses_per_prompt):
            log(f"generating responses ({r + 1}/{s.responses_per_prompt}) to {len(room)} "
                f"prompts, at most {s.max_new_tokens} tokens each ...")
            responses += list(zip(room, generate_responses(
                target, room, s.max_new_tokens, s.temperature, stop, s.generation_batch,
                generator)))
        # A block starts at the first generated token (its context: the prompt), as the
        # first drafting step after a prefill does.
        keep = [(torch.tensor((p + out)[:s.max_len]), len(p)) for p, out in responses
                if len(out) >= 2 and len(p) + 2 <= s.max_len]
    if not keep:
        raise ValueError(f"--data {s.data!r} gave no sequence long enough to train on")
    return [t for t, _ in keep], [start for _, start in keep]


# The share of the GPU's free memory the kept features may take (the rest: the training step).
FEATURE_SHARE = 0.5
FEATURE_BYTES_CPU = 4 << 30


def features_fit(target: Transformer, tokens: list[torch.Tensor], layers: int,
                 device: torch.device, log) -> bool:
    """Whether the target's features of every training position (layers · hidden each) fit in
    memory beside training; where not, they are computed again each step (slower)."""
    need = sum(map(len, tokens)) * layers * target.cfg.hidden_size * target.embed.weight.element_size()
    room = (torch.cuda.mem_get_info(device)[0] * FEATURE_SHARE if device.type == "cuda"
            else FEATURE_BYTES_CPU)
    if need > room:
        log(f"the target's features would take {need / 2**30:.1f} GiB, more than the "
            f"{room / 2**30:.1f} GiB they may; computing them again each step instead")
    return need <= room


def train_drafter(s: TrainSettings, out=None) -> TrainResult:
    """Train a DFlash drafter for s.target as the module docstring says; returns what it did."""
    from tqdm import tqdm

    from ..api import pick_device_dtype
    from ..loading import load_model

    out = out or sys.stderr

    def log(msg):
        print(msg, file=out, flush=True)

    device, dtype = pick_device_dtype(s.device, s.dtype)
    torch.manual_seed(s.seed)
    rng = random.Random(s.seed)
    # PyTorch ops throughout: batches of many rows, and the drafter's pass needs autograd.
    loaded = load_model(s.target, dtype, device, kernel_config=KernelConfig(backend="torch"))
    target = loaded.model.requires_grad_(False)
    started = time.perf_counter()
    prompts = load_training_prompts(s.data)
    tokens, starts = build_sequences(target, loaded.tokenizer, s, prompts, log)
    ids = read_layer_ids(target, s)
    keep = s.keep_features and features_fit(target, tokens, len(ids), device, log)
    log(f"labelling {len(tokens)} sequences ({sum(map(len, tokens))} tokens) with the "
        f"target's argmax{' and keeping its features' if keep else ''} ...")
    labels, features = label_sequences(target, tokens, tuple(j + 1 for j in ids) if keep else None)
    order = list(range(len(tokens)))
    rng.shuffle(order)
    n_held = min(len(order) - 1, math.ceil(s.heldout * len(order))) if s.heldout else 0
    split = {"train": order[n_held:], "held": order[:n_held]}
    train, held = (Sequences([tokens[i] for i in rows], [labels[i] for i in rows],
                             [starts[i] for i in rows], device,
                             [features[i] for i in rows] if features else None)
                   for rows in (split["train"], split["held"]))
    del features
    result = TrainResult(Path(s.output), len(train), len(held),
                         generation_s=time.perf_counter() - started)

    mask = s.mask_token_id if s.mask_token_id is not None else default_mask_token(
        target, loaded.tokenizer)
    drafter = new_drafter(target, s, mask).to(device).train()
    result.drafter = drafter
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=s.lr, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    cuda = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=dtype, enabled=cuda and dtype != torch.float32)

    save_dtype = dtype if cuda else torch.float32
    budget = s.minutes * 60
    log_entries = []

    def evaluate(elapsed):
        result.train_s = elapsed
        if len(held):
            drafter.eval()
            tau = estimate_tau(drafter, target, held, autocast)
            drafter.train()
            result.tau_curve.append((elapsed / 60, tau))
        save_dflash(drafter, result.output, save_dtype)
        write_log(result, s, log_entries, device)

    bar = tqdm(total=round(budget), unit="s", disable=not s.progress, file=out,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s {postfix}")
    begin = last_eval = time.perf_counter()
    elapsed = 0.0
    while elapsed < budget and result.steps != s.max_steps:
        # Warm-up, then cosine decay, by time (the budget is time) or by steps.
        frac = result.steps / s.max_steps if s.max_steps else elapsed / budget
        for group in optimizer.param_groups:
            group["lr"] = s.lr * min(1.0, frac / 0.05 + 0.01) * (
                0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        batch = train.random_batch(s.batch_size, s.anchors, rng)
        with autocast():
            features = target_features(target, drafter, batch)
            logits = block_logits(drafter, target, batch, features)
            labels_, valid = block_labels(batch, s.block_size)
            loss = weighted_loss(logits, labels_, valid, s.gamma)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        result.steps += 1
        result.train_tokens += int(batch.lengths.sum())
        now = time.perf_counter()
        elapsed = now - begin
        result.loss = loss.item()
        log_entries.append({"minutes": elapsed / 60, "loss": result.loss})
        if now - last_eval >= s.eval_every_s:
            evaluate(elapsed)
            last_eval = time.perf_counter()
        bar.update(round(elapsed) - bar.n)
        shown = {"loss": f"{result.loss:.3f}", "tok_s": f"{result.train_tokens / elapsed:.0f}"}
        if result.tau_curve:
            shown["tau"] = f"{result.tau:.2f}"
        bar.set_postfix(shown, refresh=False)
    evaluate(elapsed)
    bar.set_postfix(loss=f"{result.loss:.3f}", tau=f"{result.tau:.2f}")
    bar.close()
    log(f"{result.steps} steps in {elapsed / 60:.1f} min; held-out τ estimate "
        f"{result.tau:.2f}; saved {result.output}")
    passes = result.train_tokens / max(1, sum(len(x) for x in train.tokens))
    if passes > MANY_PASSES:
        log(overfit_hint(passes, s))
    return result


MANY_PASSES = 10  # passes over the training sequences past which a drafter learns them by heart


def overfit_hint(passes: float, s: TrainSettings) -> str:
    """What to do where training went over its data many times (the held-out τ stalls while the
    loss keeps falling): more data, not more minutes."""
    more = max(2 * s.responses_per_prompt, 8)
    return (f"note: training went over its data {passes:.0f} times; the drafter learns these "
            f"sequences rather than the target, and more minutes will not raise τ much. Give it "
            f"more data: "
            f"--responses-per-prompt {more} --temperature 0.8 (with --generation-batch 256 where "
            f"the GPU's memory allows), or --data with prompts of your own")


def write_log(result: TrainResult, s: TrainSettings, losses: list[dict],
              device: torch.device) -> None:
    """train_log.json next to the weights: what was trained on, how, and what it reached."""
    from .bench import device_name, git_commit

    commit, dirty = git_commit()
    log = {"settings": asdict(s), "command": " ".join(sys.argv), "commit": commit,
           "commit_dirty": dirty, "device_name": device_name(device), "torch": torch.__version__,
           "sequences": result.sequences, "heldout_sequences": result.heldout_sequences,
           "steps": result.steps, "train_tokens": result.train_tokens,
           "generation_s": result.generation_s, "train_s": result.train_s,
           "tau_curve": [{"minutes": m, "tau": t} for m, t in result.tau_curve],
           "loss": losses[::max(1, len(losses) // 200)]}
    (result.output / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
