"""Configuration: the model's shape, the engine's settings, and per-request sampling.

All three are frozen dataclasses checked in ``__post_init__``; a bad value is refused
with a message that names it and says what to do instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5")
# The layer types of a Qwen3.5 hybrid decoder (flashdraft.hybrid); config.json's model types
# that name one (the multimodal checkpoint, its text model)
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")
HYBRID_MODEL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_5" (the hybrid: flashdraft.hybrid)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3: {"rope_type": "llama3", "factor", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3.5's hybrid decoder (arch "qwen3_5"): each layer's type (HYBRID_LAYER_TYPES), the
    # Gated DeltaNet layers' heads and their short convolution, rope on the first
    # partial_rotary_factor of each head's dimensions, and the full attention's sigmoid gate
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"model architecture {self.arch!r} is not supported; "
                             f"flashdraft runs {', '.join(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must give an "
                             f"even number of rotary dimensions of head_dim={self.head_dim}")
        if self.arch == "qwen3_5":
            _check_hybrid(self)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions rope turns (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face ``config.json`` dictionary (a multimodal checkpoint's: its
        text_config, the vision tower left out)."""
        d = _text_config(d)
        arch = HYBRID_MODEL_TYPES.get(d.get("model_type"), d.get("model_type"))
        if arch not in SUPPORTED_ARCHS:
            moe = " (of the MoE models only the dense qwen3_5 runs)" if "moe" in str(arch) else ""
            raise ValueError(f"model_type {arch!r} in config.json is not supported{moe}; "
                             f"flashdraft runs {', '.join(SUPPORTED_ARCHS)}")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        # transformers 5 folds rope_theta into rope_parameters.
        params = d.get("rope_parameters")
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_5"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            **(_hybrid_fields(d, params or {}) if arch == "qwen3_5" else {}),
        )


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text model: its text_config, with the outer file's token ids
    where it has none, and the outer file's tie_word_embeddings (the whole model's)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d
    merged = {**{k: d[k] for k in ("eos_token_id", "bos_token_id") if k in d}, **text}
    if "tie_word_embeddings" in d:
        merged["tie_word_embeddings"] = d["tie_word_embeddings"]
    merged.setdefault("model_type", d.get("model_type"))
    return merged


def _hybrid_fields(d: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The hybrid's fields of ModelConfig from a qwen3_5 config.json (transformers' defaults
    where it is silent: a full-attention layer every 4th, a quarter of each head rotated)."""
    layers = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        every = d.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(layers)]
    return dict(
        layer_types=tuple(types),
        linear_num_key_heads=d.get("linear_num_key_heads", 16),
        linear_num_value_heads=d.get("linear_num_value_heads", 32),
        linear_key_head_dim=d.get("linear_key_head_dim", 128),
        linear_value_head_dim=d.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             d.get("partial_rotary_factor", 0.25))),
        attn_output_gate=bool(d.get("attn_output_gate", True)),
    )


def _check_hybrid(cfg: ModelConfig) -> None:
    """A user's error for a qwen3_5 configuration that the hybrid decoder cannot run."""
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"layer_types lists {len(cfg.layer_types)} layers for "
                         f"num_hidden_layers={cfg.num_layers}; give one type per layer")
    for i, kind in enumerate(cfg.layer_types):
        if kind not in HYBRID_LAYER_TYPES:
            raise ValueError(f"layer {i} has layer type {kind!r}, which flashdraft does not run; "
                             f"a qwen3_5 layer is one of {', '.join(HYBRID_LAYER_TYPES)}")
    heads = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
             cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    if "linear_attention" in cfg.layer_types and min(heads) < 1:
        raise ValueError(f"the linear attention layers need linear_num_key_heads, "
                         f"linear_num_value_heads, linear_key_head_dim, linear_value_head_dim "
                         f"and linear_conv_kernel_dim >= 1, got {heads}")
    if cfg.linear_num_key_heads and cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={cfg.linear_num_value_heads} is not a multiple "
                         f"of linear_num_key_heads={cfg.linear_num_key_heads}")
    if not cfg.attn_output_gate:
        raise ValueError("attn_output_gate=false: flashdraft runs Qwen3.5's full attention with "
                         "its sigmoid output gate only (the released checkpoints have it)")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, named as in vLLM. temperature=0 is greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # keep tokens with p >= min_p · max p; 0: off
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be a whole number >= 1, or 0 / -1 to turn it off; "
                             f"got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 turns it off), got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a whole number >= 1, got {self.max_tokens!r}")
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


KERNEL_BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class KernelConfig:
    """How the model's steps run on the GPU; the defaults are the fastest measured.

    Passed explicitly from `LLM(...)` or the CLI down to the model and its layers
    (`Transformer.kernels`), never read from the environment."""
    # "triton": the fused kernels (flashdraft.backends.kernels) wherever CUDA and Triton are
    # present; "torch": PyTorch ops everywhere (for comparisons and debugging: slower, and
    # greedy speculation then need not return plain decoding's tokens bit for bit)
    backend: str = "triton"
    # programmatic dependent launch between consecutive kernels on Hopper and later GPUs
    pdl: bool = True
    # the product kernel's launch parameters: None, the package's measured table with the
    # user's (`flashdraft tune`) over it; "off", the rule of the weight's shape; or a JSON file
    tuned_table: str | None = None
    # the Triton kernels on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1
    # set before Triton is imported): for tests
    interpret: bool = False

    def __post_init__(self):
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel backend {self.backend!r} is not one of "
                             f"{', '.join(KERNEL_BACKENDS)}")
        if self.tuned_table is not None and not isinstance(self.tuned_table, str):
            raise ValueError(f"tuned_table must be a path, 'off' or None, "
                             f"got {self.tuned_table!r}")


# how greedy one-token steps run: CUDA graphs of the model's kernels, or flashdraft.backends.megakernel
# ("auto": a draft model's through the megakernel where it runs, plain decoding's on the graphs)
DECODE_KERNELS = ("auto", "graph", "megakernel")


def check_decode_kernel(value: str, name: str = "decode_kernel") -> None:
    """A user's error for a decode kernel that is not one of DECODE_KERNELS (`name`: the
    setting's name in the message, e.g. the CLI flag)."""
    if value not in DECODE_KERNELS:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(DECODE_KERNELS)}")


MAX_TREE_WIDTH = 8  # candidates a depth of a token tree
# tree_widths="auto": the node budget (spine and leaves) under which the cost model shapes the
# trees; at most MAX_TREE_BUDGET (the fused attention kernel's bit sets: 63 nodes, the root
# included)
AUTO_TREE_BUDGET, MAX_TREE_BUDGET = 16, 62
# num_speculative_tokens="auto": the bound the cost model chooses k under (a draft model's
# chains past it rarely pay: each drafted token costs a draft step)
AUTO_SPECULATIVE_TOKENS = 8


def speculative_tokens(value, name: str = "num_speculative_tokens") -> int:
    """The most tokens a step drafts: a whole number 1 … 64, or "auto"."""
    if value == "auto":
        return AUTO_SPECULATIVE_TOKENS
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
        raise ValueError(f"{name} must be a whole number between 1 and 64, or auto (the cost "
                         f"model chooses k up to {AUTO_SPECULATIVE_TOKENS}), got {value!r}")
    return value


def check_tree_widths(widths, name: str = "tree_widths") -> tuple[int, ...]:
    """Token trees' candidates a depth as a tuple, or a user's error naming the value."""
    try:
        widths = tuple(widths)
    except TypeError:
        widths = None
    if (widths is None or len(widths) > 64
            or any(not isinstance(w, int) or not 1 <= w <= MAX_TREE_WIDTH for w in widths)):
        raise ValueError(f"{name} must be whole numbers between 1 and {MAX_TREE_WIDTH}, one a "
                         f"draft position (at most 64), e.g. 3,2,2 (three candidates for the "
                         f"first token, two for the next two, one after), got {widths!r}")
    return widths


def check_tree_budget(budget, name: str = "tree_budget") -> int:
    """A token tree's node budget (0: none), or a user's error naming the value."""
    if (not isinstance(budget, int) or isinstance(budget, bool)
            or not (budget == 0 or 2 <= budget <= MAX_TREE_BUDGET)):
        raise ValueError(f"{name} must be a whole number of tree nodes between 2 and "
                         f"{MAX_TREE_BUDGET} (the spine and its leaves; 0: none), got {budget!r}")
    return budget


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` was asked for; flags of the CLI map 1:1 onto these fields."""
    model: str
    draft: str | None = None  # None or a drafter spec (drafters.registry): "ngram", "model:PATH", ...
    # the most tokens a step drafts (the cost model chooses fewer, or plain decoding, where that
    # is faster); "auto": AUTO_SPECULATIVE_TOKENS
    num_speculative_tokens: int | str = "auto"
    ngram_sizes: tuple[int, ...] = (4, 3, 2)  # tried longest first
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None: bf16 on CUDA, fp32 on CPU
    device: str | None = None  # "cpu" | "cuda" | "cuda:N"; None: cuda when present
    max_model_len: int | None = None  # None: the model's own context length
    cuda_graphs: bool = True  # replay decode / verify / draft steps as CUDA graphs (CUDA only)
    compile: bool = False  # torch.compile the forward before capturing it (slow to start)
    quantization: str | None = None  # None | "int8" | "int4": weight-only, applied at load
    # the draft model's: None or "none" (full precision), "int8", "int4"; "auto": the target's
    draft_quantization: str | None = "auto"
    # decode plainly while drafting does not pay (the cost model (flashdraft.scheduling)); False: every
    # step drafts up to num_speculative_tokens
    adaptive_speculation: bool = True
    # greedy one-token steps of plain decoding and of a draft model: "graph" (CUDA graphs of the
    # model's kernels), "megakernel" (one persistent kernel a token; flashdraft.backends.megakernel), or
    # "auto": a draft model's through the megakernel where it can run (drafts only propose, so
    # the output is the same), plain decoding's on the graphs (the reference)
    decode_kernel: str = "auto"
    # how the target's and the draft model's steps run on the GPU (KernelConfig)
    kernels: KernelConfig = KernelConfig()
    # token trees: candidates a draft position (the drafter's best and its next best tokens,
    # verified in one pass), e.g. (3, 2, 2); positions past the list: one. (): chains.
    # "auto": the cost model chooses them under a budget of AUTO_TREE_BUDGET nodes
    tree_widths: tuple[int, ...] | str = ()
    # the most nodes (spine and leaves) of a token tree whose widths the cost model chooses
    # each step, among a few shapes (flashdraft.scheduling.tree_shapes); 0: tree_widths' trees
    tree_budget: int = 0
    # keep the cost model's step costs (the plain step, each drafter's step lines; not
    # acceptance) in the cache directory's step_costs.json, per GPU, model and settings, so that
    # the next engine of the same setup starts from them (flashdraft.scheduling.StepCostCache);
    # None: on where the device is CUDA (CPU timings are too noisy to be worth keeping)
    step_cost_cache: bool | None = None
    # GPUs one model is spread over (flashdraft.parallel: one process each, started by torchrun;
    # every rank runs the same steps, so the cost model's timing-driven choices are off)
    tensor_parallel: int = 1

    def __post_init__(self):
        _check_tensor_parallel(self)
        object.__setattr__(self, "num_speculative_tokens",
                           speculative_tokens(self.num_speculative_tokens))
        if self.dtype not in (None, "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype {self.dtype!r} is not one of float32, bfloat16, float16")
        sizes = tuple(sorted(set(self.ngram_sizes), reverse=True))
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"ngram_sizes must be whole numbers >= 1, got {self.ngram_sizes!r}")
        object.__setattr__(self, "ngram_sizes", sizes)
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization {self.quantization!r} is not one of int8, int4 "
                             f"(weight-only; leave it unset for none)")
        if self.draft_quantization not in (None, "none", "auto", "int8", "int4"):
            raise ValueError(f"draft_quantization {self.draft_quantization!r} is not one of "
                             f"int8, int4, none, auto (auto: as the target's)")
        check_decode_kernel(self.decode_kernel)
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels must be a KernelConfig, got {self.kernels!r}")
        if self.tree_widths == "auto":
            object.__setattr__(self, "tree_widths", ())
            object.__setattr__(self, "tree_budget", self.tree_budget or AUTO_TREE_BUDGET)
        object.__setattr__(self, "tree_widths", check_tree_widths(self.tree_widths))
        check_tree_budget(self.tree_budget)
        if self.tree_budget and any(w > 1 for w in self.tree_widths):
            raise ValueError(f"tree_budget={self.tree_budget} lets the cost model choose the "
                             f"trees' widths, and tree_widths={list(self.tree_widths)} fixes "
                             f"them: give one of the two (tree_widths auto: a budget of "
                             f"{AUTO_TREE_BUDGET} nodes)")
        if self.step_cost_cache is not None and not isinstance(self.step_cost_cache, bool):
            raise ValueError(f"step_cost_cache must be True, False or None (on for CUDA), "
                             f"got {self.step_cost_cache!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")

    @property
    def draft_quant(self) -> str | None:
        """The draft model's weight-only quantization: None, "int8" or "int4"."""
        if self.draft_quantization == "auto":
            return self.quantization
        return None if self.draft_quantization in (None, "none") else self.draft_quantization


def _check_tensor_parallel(cfg: EngineConfig) -> None:
    """A user's error for tensor_parallel and the settings it does not run with."""
    n = cfg.tensor_parallel
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel must be a whole number >= 1 (GPUs), got {n!r}")
    if n == 1:
        return
    if cfg.quantization is not None:
        raise ValueError(f"tensor_parallel={n} shards full-precision weights; "
                         f"quantization={cfg.quantization!r} cannot be sharded yet")
    if cfg.decode_kernel == "megakernel":
        raise ValueError(f"tensor_parallel={n}: the decode megakernel runs a whole model on one "
                         f"GPU; use decode_kernel auto or graph")
    if cfg.draft is not None and cfg.adaptive_speculation:
        raise ValueError(f"tensor_parallel={n} with a drafter: the cost model chooses k from "
                         f"each rank's own timings, and every rank must run the same steps; "
                         f"pass --no-adaptive-speculation (adaptive_speculation=False)")
