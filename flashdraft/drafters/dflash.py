"""DFlash: a block-diffusion drafter that fills a whole block of drafts in one pass.

A DFlash drafter is a few Qwen3 decoder layers that read the target's own hidden states. Its
context is not tokens but features: the target's outputs of layers `target_layer_ids` at
every committed position, concatenated, projected by `fc` and normalised by `hidden_norm`.
They enter every drafter layer as extra keys and values (the layer's k/v projections and
k_norm applied to them, rope at their own positions), kept in the drafter's own cache. The
block `[last committed token, MASK × k]` is embedded with the target's embedding and attends
bidirectionally within itself and to all the context before it; the drafter's final norm
goes through the target's LM head, and position i of the block proposes draft i (1 … k). So
k drafts cost one pass of a 1–5-layer model over k + 1 rows, where a draft model costs k
passes.

The format is the public one (`dflash` 0.1.0 on the package index, `dflash/model.py`,
`DFlashDraftModel`: the reference the tests compare with): a directory of `config.json`, with
Qwen3 decoder fields plus `num_target_layers` and `dflash_config` {`block_size`,
`mask_token_id`, `target_layer_ids`, optionally `input_embedding_scale`, `output_multiplier`,
`final_logit_softcapping`}, and safetensors named `layers.*` (Qwen3 decoder layers), `norm`,
`fc` and `hidden_norm`. It has no embedding or LM head of its own. The later "DFlash2"
variant (dynamic convolutions and a candidate selector) is refused with a message.

Layer numbering: DFlash's `target_layer_ids` j means the output of decoder layer j counted
from 0, Hugging Face's hidden_states[j + 1], which is our `hidden_layers` index j + 1 (0 = the
embeddings, i = the output of layer i). The reference reads the last layer's output after
the target's final norm (Hugging Face's last hidden state), which our target does not
return; a drafter that asks for it is refused (public ones stop three layers short of it).

Rollback: the drafter's cache holds the context features of the committed positions and
nothing else that counts. Each proposal first writes the rows the engine newly committed
(DraftContext.hidden), then the block's keys and values after them; the next proposal
writes its context over the block's slots, so a rejected block is forgotten by not moving
the context length (the reference crops its cache to the same length).

On a GPU the block pass (the layers and the target's LM head on the block's rows) is a CUDA
graph replay: launched one by one, its few dozen small kernels would cost more than they
compute. A graph fixes shapes, so the step's new rows (at most block_size: the accepted drafts
and one more) are padded to block_size, the start position and the number of new rows are
device tensors from which the positions, the cache slots and a mask of the visible keys
follow, and attention reads a bucket of the cache as the target's graphs do; one graph serves
each (k, kv bucket). The prompt's rows, more than a block, take the eager pass at their own
shape, which is also the reference the fixed shape is tested against (on a CPU, where the
fixed shape runs eagerly).

At T > 0 the drafts are sampled from q, the drafter's logits under the request's
temperature / top-k / top-p / min-p, each position independently (as the reference does),
and returned with those logits for the acceptance rule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.cuda_graphs import KV_BUCKET, StepRunner, bucketed_kv_len
from ..config import ModelConfig
from ..kv_cache import KVCache
from ..loading.hf import our_sources, read_hf
from ..model import Block, RMSNorm, Transformer, rope_cos_sin, rope_frequencies
from ..sampling import fused_by_default, make_rng, race, row_stats
from ..tree import alternatives, spine_leaves, spine_tree
from .base import Draft, DraftContext

# The drafter's own RNG state draws on a stream apart from the target's draws.
DFLASH_STREAM = 2
# Keys of dflash_config that only the DFlash2 variant has.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default `target_layer_ids` (0-based layer outputs) for a config
    without them: one layer in the middle, or layers spread from 1 to num_target_layers - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1))
                 for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    layers: ModelConfig  # the drafter's own decoder layers (Qwen3 layers, whatever the target)
    num_target_layers: int  # decoder layers of the target it was trained for
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose outputs it reads, in fc order
    block_size: int  # B, the trained block: the last token and B - 1 masks
    mask_token_id: int
    input_embedding_scale: float = 1.0  # the target's embedding of the block is scaled by it
    output_multiplier: float = 1.0  # and the logits
    final_logit_softcapping: float | None = None  # logits -> c · tanh(logits / c)

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} in dflash_config: a block holds the "
                             f"last token and at least one mask, so it must be >= 2")
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids is empty: the drafter reads at "
                             "least one target layer")
        if not (0 <= self.mask_token_id < self.layers.vocab_size):
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary "
                             f"of {self.layers.vocab_size} tokens")

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers to ask for, in our numbering (ascending, as DraftContext has them)."""
        return tuple(sorted({j + 1 for j in self.target_layer_ids}))

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "DFlashConfig":
        """From a DFlash drafter's config.json dictionary (source names it in errors)."""
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise ValueError(f"{source} has no dflash_config, so it is not a DFlash drafter "
                             f"(a draft model of the target's tokenizer loads as model:PATH)")
        dflash2 = [key for key in _DFLASH2_KEYS if key in dc]
        if dflash2:
            raise ValueError(f"{source} is a DFlash2 drafter (dflash_config has {dflash2}): "
                             f"its dynamic convolutions and candidate selector are not "
                             f"supported yet; flashdraft runs DFlash drafters without them")
        layer_types = set(d.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"} or d.get("use_sliding_window") or d.get("is_causal"):
            raise ValueError(f"{source}: layer_types {sorted(layer_types)}, use_sliding_window="
                             f"{d.get('use_sliding_window')}, is_causal={d.get('is_causal')}: "
                             f"only non-causal full-attention DFlash drafters are supported")
        if "num_target_layers" not in d:
            raise ValueError(f"{source} has no num_target_layers (the target's number of "
                             f"decoder layers the drafter was trained for)")

        def value(name, default=None):  # dflash_config first, then the top level (reference)
            return dc.get(name, d.get(name, default))

        if value("mask_token_id") is None:
            raise ValueError(f"{source}: dflash_config has no mask_token_id")
        layers = ModelConfig.from_hf({**d, "model_type": "qwen3", "tie_word_embeddings": False})
        ids = value("target_layer_ids")
        ids = (build_target_layer_ids(d["num_target_layers"], layers.num_layers)
               if ids is None else tuple(int(j) for j in ids))
        softcap = value("final_logit_softcapping")
        return cls(layers=layers, num_target_layers=int(d["num_target_layers"]),
                   target_layer_ids=ids, block_size=int(value("block_size", 16)),
                   mask_token_id=int(value("mask_token_id")),
                   input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                   output_multiplier=float(value("output_multiplier", 1.0)),
                   final_logit_softcapping=(float(softcap) if softcap is not None
                                            and float(softcap) > 0 else None))

    def to_hf(self) -> dict:
        """The config.json dictionary of the public format (what from_hf and the reference read)."""
        c = self.layers
        rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
        extra = {}
        if self.input_embedding_scale != 1.0:
            extra["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            extra["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            extra["final_logit_softcapping"] = self.final_logit_softcapping
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": rope,
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": c.qkv_bias, "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids), **extra},
        }

    def check_target(self, target: ModelConfig, source: str = "the DFlash drafter") -> None:
        """Refuse a target this drafter was not made for, naming what differs."""
        fix = ("use a DFlash drafter trained for this target (or train one: flashdraft "
               "train-drafter)")
        if target.hidden_size != self.layers.hidden_size:
            raise ValueError(f"{source} reads hidden states of size {self.layers.hidden_size}, "
                             f"but the target's are {target.hidden_size}; {fix}")
        if target.vocab_size != self.layers.vocab_size:
            raise ValueError(f"{source} was made for a vocabulary of {self.layers.vocab_size} "
                             f"tokens, but the target has {target.vocab_size}; {fix}")
        if target.num_layers != self.num_target_layers:
            raise ValueError(f"{source} was trained on a target of {self.num_target_layers} "
                             f"layers (num_target_layers), but the target has "
                             f"{target.num_layers}; {fix}")
        bad = [j for j in self.target_layer_ids if not 0 <= j < target.num_layers - 1]
        if bad:
            raise ValueError(f"{source}: target_layer_ids {list(self.target_layer_ids)} has "
                             f"{bad} outside 0 … {target.num_layers - 2} (the target has "
                             f"{target.num_layers} layers; the last one's output is read after "
                             f"the final norm in the reference, which flashdraft does not "
                             f"return); {fix}")


def _norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm in plain PyTorch: the drafter trains through it (the model's fused kernels have
    no backward), its weight in x's dtype (under autocast, float32 weights meet bfloat16 x)."""
    return F.rms_norm(x, module.weight.shape, module.weight.to(x.dtype), module.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, t, head_dim] by cos, sin [b, t, head_dim / 2] (half-split, as the
    checkpoints and `model.rope_cos_sin` have it)."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class DFlashModel(nn.Module):
    """The drafter's weights and its pass. Each layer is a `model.Block` used as a container of
    the Qwen3 layer's weights in our fused layout (wqkv, w_gate_up), so the checkpoint names
    map as the target's do; its pass differs from the target's (extra keys and values from the
    context, no causal mask), so it is written out here in plain PyTorch, which also trains."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.layers
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", rope_frequencies(c), persistent=False)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [b, n, len(target_layer_ids) · hidden] (the target layers' outputs,
        concatenated in target_layer_ids order) -> the context rows [b, n, hidden]."""
        return _norm(self.hidden_norm, self.fc(features))

    def forward(self, x: torch.Tensor, context: torch.Tensor, positions: torch.Tensor,
                attend) -> torch.Tensor:
        """The drafter's layers over block rows x [b, t, hidden] (embeddings) with the context
        rows [b, c, hidden] (project_context) as extra keys and values. positions [b, c + t]:
        the rope positions of the context rows, then of the block rows. attend(layer, q
        [b, heads, t, d], k [b, kv_heads, c + t, d], v) -> [b, heads, t, d] says who sees
        whom (the cache at inference, a mask in training). Returns the final norm's output
        [b, t, hidden]."""
        c = self.cfg.layers
        b, t, _ = x.shape
        q_dim = c.num_heads * c.head_dim
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            h = _norm(layer.attn_norm, x)
            w, bias = attn.wqkv.weight, attn.wqkv.bias
            q = F.linear(h, w[:q_dim], None if bias is None else bias[:q_dim])
            kv = F.linear(torch.cat([context, h], dim=1), w[q_dim:],
                          None if bias is None else bias[q_dim:])
            q = _norm(attn.q_norm, q.view(b, t, c.num_heads, c.head_dim)).transpose(1, 2)
            k, v = kv.view(b, -1, 2, c.num_kv_heads, c.head_dim).unbind(2)
            k = _norm(attn.k_norm, k).transpose(1, 2)
            q = _rope(q, cos[:, -t:], sin[:, -t:])
            k = _rope(k, cos, sin)
            out = attend(i, q, k, v.transpose(1, 2))  # [b, heads, t, head_dim]
            x = x + attn.wo(out.transpose(1, 2).reshape(b, t, q_dim))
            gate, up = layer.mlp.w_gate_up(_norm(layer.mlp_norm, x)).chunk(2, dim=-1)
            x = x + layer.mlp.w_down(F.silu(gate) * up)
        return _norm(self.norm, x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The forward's output [b, t, hidden] -> logits [b, t, vocab] (float32) through the
        target's LM head, with the config's output multiplier and softcap."""
        logits = lm_head(hidden).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None else logits


def read_dflash_config(path: str | Path) -> DFlashConfig:
    path = Path(path).expanduser()
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path} holds no config.json; a DFlash drafter is a directory "
                                f"of config.json (with dflash_config) and *.safetensors")
    return DFlashConfig.from_hf(json.loads(config.read_text()), str(config))


def _public_names(cfg: DFlashConfig) -> dict[str, list[str]]:
    """Our parameter names -> the public checkpoint's tensors each is made of (joined along
    rows: q/k/v, gate/up): the target's mapping (`loading.hf.our_sources`) for the layers."""
    n = cfg.layers.num_layers
    names = {f"model.layers.{i}.self_attn.{x}_norm.weight" for i in range(n) for x in "qk"}
    if cfg.layers.qkv_bias:
        names |= {f"model.layers.{i}.self_attn.q_proj.bias" for i in range(n)}
    out = {ours: [s.removeprefix("model.") for s in src]
           for ours, src in our_sources(names, n).items() if ours.startswith("layers.")}
    out.update({name: [name] for name in ("norm.weight", "fc.weight", "hidden_norm.weight")})
    return out


def load_dflash(path: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DFlashModel:
    """A DFlash drafter directory (public format, or one `save_dflash` wrote) as a DFlashModel."""
    path = Path(path).expanduser()
    cfg = read_dflash_config(path)
    _, state = read_hf(path, dtype)
    state = {name.removeprefix("model."): t for name, t in state.items()}
    sources = _public_names(cfg)
    missing = sorted({s for src in sources.values() for s in src} - set(state))
    unknown = sorted(set(state) - {s for src in sources.values() for s in src})
    if missing or unknown:
        raise ValueError(f"{path} is not a DFlash drafter of {cfg.layers.num_layers} layers as "
                         f"its config.json describes: missing tensors {missing[:5]}, unexpected "
                         f"tensors {unknown[:5]} (DFlash2 and other variants are not supported)")
    with torch.device("meta"):
        model = DFlashModel(cfg)
    model.load_state_dict({ours: torch.cat([state[s] for s in src]) if len(src) > 1
                           else state[src[0]] for ours, src in sources.items()},
                          assign=True, strict=True)
    model.inv_freq = rope_frequencies(cfg.layers)
    return model.to(device).eval()


def save_dflash(model: DFlashModel, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a DFlash drafter directory in the public format, its tensors in dtype
    (None: as they are); returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.cfg.layers
    dtype = dtype or next(model.parameters()).dtype
    ours = {name: t.to(dtype) for name, t in model.state_dict().items()}
    sizes = {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
             "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": c.intermediate_size,
             "up_proj": c.intermediate_size}
    state = {}
    for name, src in _public_names(model.cfg).items():
        tensor = ours[name].detach().cpu().contiguous()
        if len(src) == 1:
            state[src[0]] = tensor
            continue
        parts = tensor.split([sizes[s.split(".")[-2]] for s in src])
        state.update({s: p.contiguous() for s, p in zip(src, parts)})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = model.cfg.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return path


@dataclass
class _BlockInputs:
    """The persistent inputs of the fixed-shape block pass (`DFlashDrafter.padded_block_logits`),
    one set per graph."""
    # [1, rows, len(target_layer_ids) · hidden] in fc's order; rows n_new … are padding
    features: torch.Tensor
    tokens: torch.Tensor  # [1, t] int64: the last committed token, then t - 1 masks
    start: torch.Tensor  # [1] int64: the position of the first new context row
    n_new: torch.Tensor  # [1] int64: how many rows of features are new context


def block_slots(start: torch.Tensor, n_new: torch.Tensor, rows: int, t: int) -> torch.Tensor:
    """The cache slots (= rope positions) of the fixed-shape pass's rows [rows + t] int64: the
    n_new new context rows at start …, the padding rows of the context after the block, then
    the block's t rows right after the new ones. start, n_new: [1] int64 device tensors, so that
    a graph's slots follow them. The slots are distinct (one index_copy_ writes every row: a
    GPU does not order duplicate writes), none of the padding rows' is below the visible length
    start + n_new + t, and all lie below start + rows + t."""
    row = torch.arange(rows, device=start.device)
    block_start = start + n_new  # [1]
    context = torch.where(row < n_new, start + row, block_start + t + row - n_new)
    return torch.cat([context, block_start + torch.arange(t, device=start.device)])


def _cache_attention(cache: KVCache, layer: int, q: torch.Tensor, kv_len: int,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The block's queries q [1, heads, t, head_dim] over the cache's first kv_len positions of
    `layer` (mask [1, 1, 1, kv_len]: the keys it may see; None: all) -> [1, heads, t, head_dim]."""
    keys, values = cache.read(layer, 1, kv_len)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys.shape[1])


class DFlashDrafter:
    """Drafts min(k, block_size - 1) tokens a step with a DFlashModel and the target's
    embedding and LM head (`target`, the engine's model).

    cuda_graphs: None (the default) replays the block pass as CUDA graphs wherever the device
    is CUDA (`padded_block_logits`), True asks for them (refused off CUDA), False runs every
    pass eagerly at its own shape (`eager_block_logits`, the reference)."""
    builds_trees = True  # DraftContext.tree_widths: a SpineTree from the block's logits

    def __init__(self, model: DFlashModel, target: Transformer, device: torch.device | str,
                 dtype: torch.dtype, *, block_size: int | None = None,
                 fused_sampling: bool | None = None, cuda_graphs: bool | None = None,
                 source: str = "the DFlash drafter"):
        cfg = model.cfg
        cfg.check_target(target.cfg, source)
        trained = cfg.block_size
        block_size = trained if block_size is None else block_size
        if not (isinstance(block_size, int) and 2 <= block_size <= trained):
            raise ValueError(f"block_size={block_size!r} for {source}: it must be a whole "
                             f"number from 2 (the last token and one mask) to {trained}, the "
                             f"block it was trained on")
        self.model, self.target = model, target
        self.device, self.dtype = torch.device(device), dtype
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True for {source} on {self.device}: CUDA graphs need "
                             f"a CUDA device; leave cuda_graphs=None (graphs wherever the device "
                             f"is CUDA) or pass False")
        # The block pass replayed as CUDA graphs wherever a step's new rows fit the padded
        # shape; None: every pass eager (a CPU, or graphs switched off).
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner = StepRunner(model, self.device) if use_graphs else None
        self.block_size = block_size
        self.hidden_layers = cfg.hidden_layers
        # DraftContext.hidden comes in ascending layer order; fc reads target_layer_ids' order.
        self._order = [self.hidden_layers.index(j + 1) for j in cfg.target_layer_ids]
        # The drafts' race: the Triton kernels (a GPU's default) or their PyTorch reference.
        self.fused_sampling = (fused_by_default(self.device) if fused_sampling is None
                               else fused_sampling)
        self.rng = make_rng(0, self.device)
        self._seeded = False
        self.cache: KVCache | None = None
        self.n_context = 0  # committed positions whose features the cache holds: 0 … n - 1

    def ensure_capacity(self, max_len: int, steps: int = 1) -> None:
        """Room for a request of max_len positions (the context and a block after it), and for
        the padding rows that the fixed-shape pass writes after its block (at most 2 ·
        block_size slots past the block's start)."""
        self._reserve(max_len + 2 * self.block_size)

    def _reserve(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            old, self.cache = self.cache, KVCache.for_model(self.model.cfg.layers, 1, max_len,
                                                            self.dtype, self.device)
            if old is not None and self.n_context:  # keep what a request has (never in a step)
                self.cache.kv[..., :self.n_context, :] = old.kv[..., :self.n_context, :]

    def _room(self, need: int) -> None:
        """At least `need` slots for a pass the cache was not sized for (ensure_capacity is the
        engine's way), doubling so that few passes copy the context."""
        if self.cache is None or self.cache.max_len < need:
            self._reserve(max(need, 2 * (self.cache.max_len if self.cache else 0)))

    def begin(self, prompt: list[int]) -> None:
        self.n_context = 0
        self._seeded = False

    @torch.inference_mode()
    def block_logits(self, hidden: list[torch.Tensor], last: int, k: int) -> torch.Tensor:
        """Append the committed rows `hidden` (DraftContext.hidden: [1, n_new, hidden] per layer
        of hidden_layers) to the context, then score the block [last, MASK × k] after it:
        logits [1, k, vocab] (float32) of block positions 1 … k. The block is not kept.

        With a runner (CUDA graphs) a pass of at most block_size new rows is a graph replay
        (`padded_block_logits`): every step's, after the prompt's; the rest run eagerly."""
        n_new = hidden[0].shape[1] if hidden else 0
        if self.runner is not None and n_new <= self.block_size:
            return self.padded_block_logits(hidden, last, k)
        return self.eager_block_logits(hidden, last, k)

    def _pass(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              attend) -> torch.Tensor:
        """The block pass: context rows from features [1, n, len(target_layer_ids) · hidden]
        (fc's order), the block tokens [1, t] after them, positions [1, n + t] and attend as
        DFlashModel.forward takes them -> logits [1, t - 1, vocab] of block positions 1 …"""
        context = self.model.project_context(features)  # [1, n, hidden]
        x = (self.target.embed(tokens) * self.model.cfg.input_embedding_scale).to(self.dtype)
        out = self.model(x, context, positions, attend)
        return self.model.logits(out[:, 1:], self.target.lm_head)

    @torch.inference_mode()
    def eager_block_logits(self, hidden: list[torch.Tensor], last: int, k: int) -> torch.Tensor:
        """block_logits at the pass's own shape: the new rows and the block written after the
        context, attention over exactly the positions written (the reference of every path)."""
        n_new = hidden[0].shape[1] if hidden else 0
        start = self.n_context  # the first new context position; the block follows the new rows
        t = k + 1
        kv_len = start + n_new + t
        self._room(kv_len)
        features = torch.cat([hidden[i] for i in self._order], dim=-1).to(self.dtype)
        block = torch.full((1, t), self.model.cfg.mask_token_id, dtype=torch.long,
                           device=self.device)
        block[0, 0] = last
        positions = torch.arange(start, kv_len, device=self.device).unsqueeze(0)
        cache = self.cache

        def attend(layer, q, keys, values):
            # The new context rows and the block into the cache after the committed context;
            # the block sees all of it and itself (no mask).
            cache.kv[layer, 0, :1, :, start:kv_len] = keys
            cache.kv[layer, 1, :1, :, start:kv_len] = values
            return _cache_attention(cache, layer, q, kv_len)

        logits = self._pass(features, block, positions, attend)
        self.n_context = start + n_new
        return logits

    @torch.inference_mode()
    def padded_block_logits(self, hidden: list[torch.Tensor], last: int, k: int) -> torch.Tensor:
        """block_logits at a fixed shape, which one CUDA graph per (k, kv bucket) replays.

        The new rows are padded to block_size (a step commits at most that many: the accepted
        drafts and one more); the positions, the cache slots and the visible length come from
        the start and the number of new rows as device tensors, so no host number of the step
        is baked into the graph; attention reads a bucket of the cache (`bucketed_kv_len`, as
        the target's graphs do) with the positions past the block masked. The padding rows are
        written after the block, where no visible key lies and where the next pass writes
        before it reads. With an enabled runner the pass is a graph replay; without one (or
        with one that is off, as on a CPU) it runs eagerly at the same shape: on a CPU, the
        check of the padding and the mask against eager_block_logits. Returns logits
        [1, k, vocab]; on the graph path the graph's buffer, rewritten by its next replay."""
        n_new = hidden[0].shape[1] if hidden else 0
        rows, t, start = self.block_size, k + 1, self.n_context
        if n_new > rows:
            raise ValueError(f"the fixed-shape block pass takes at most block_size={rows} new "
                             f"context rows, not {n_new}; pass them to block_logits, which "
                             f"runs a pass of more rows eagerly")
        self._room(start + rows + t)
        cache = self.cache
        bucket = self.runner.kv_bucket if self.runner is not None else KV_BUCKET
        kv_len = bucketed_kv_len(start + n_new + t, bucket, cache.max_len)

        def build():
            long = dict(dtype=torch.long, device=self.device)
            inputs = _BlockInputs(
                torch.zeros(1, rows, self.model.fc.in_features, dtype=self.dtype,
                            device=self.device),
                torch.full((1, t), self.model.cfg.mask_token_id, **long),
                torch.zeros(1, **long), torch.zeros(1, **long))
            return inputs, lambda: self._padded_pass(inputs, cache, kv_len)

        def fill(inputs: _BlockInputs) -> None:
            for a, i in enumerate(self._order):  # fc's order, one target layer at a time
                width = hidden[i].shape[-1]
                inputs.features[0, :n_new, a * width:(a + 1) * width].copy_(hidden[i][0])
            inputs.tokens[0, 0] = last
            inputs.start.fill_(start)
            inputs.n_new.fill_(n_new)

        if self.runner is None or not self.runner.enabled:
            inputs, run = build()
            fill(inputs)
            logits = run()
        else:
            logits = self.runner.replay(("dflash", t, rows, kv_len), cache, build, fill)
        self.n_context = start + n_new
        return logits

    def _padded_pass(self, inputs: _BlockInputs, cache: KVCache, kv_len: int) -> torch.Tensor:
        """The pass of padded_block_logits, of device tensors only (what its graph records)."""
        rows, t = inputs.features.shape[1], inputs.tokens.shape[1]
        slots = block_slots(inputs.start, inputs.n_new, rows, t)  # [rows + t]
        end = inputs.start + inputs.n_new + t  # [1]: the visible length
        visible = (torch.arange(kv_len, device=self.device) < end).view(1, 1, 1, -1)

        def attend(layer, q, keys, values):
            cache.kv[layer, 0, 0].index_copy_(1, slots, keys[0])
            cache.kv[layer, 1, 0].index_copy_(1, slots, values[0])
            return _cache_attention(cache, layer, q, kv_len, visible)

        return self._pass(inputs.features, inputs.tokens, slots.unsqueeze(0), attend)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        k = min(k, self.block_size - 1)
        n_new = ctx.hidden[0].shape[1] if ctx.hidden else 0
        if self.n_context + n_new != len(ctx.tokens) - 1:
            raise RuntimeError(
                f"the DFlash drafter holds the features of {self.n_context} positions and was "
                f"given {n_new} more, but the context has {len(ctx.tokens) - 1} positions "
                f"before its last token: it needs the target's hidden states of every "
                f"committed position (DraftContext.hidden), each exactly once")
        if k <= 0:  # the rows still count: the next block follows them
            if n_new:
                self.block_logits(ctx.hidden, ctx.tokens[-1], 1)
            return Draft(torch.empty(1, 0, dtype=torch.long, device=self.device))
        # On the graph path the logits are the graph's buffer: q below is read by the
        # verification (which copies it) before the next proposal replays the graph.
        logits = self.block_logits(ctx.hidden, ctx.tokens[-1], k)  # [1, k, vocab]
        params = ctx.params
        if params.greedy:
            return self._draft(logits.argmax(-1), logits, ctx, sampled=False)
        if not self._seeded:  # the request's first sampled proposal
            self.rng.copy_(make_rng(ctx.seed or 0, self.device))
            self._seeded = True
        rows = logits[0]  # [k, vocab]
        stats = row_stats(rows, params.temperature, params.top_k, params.top_p, params.min_p,
                          fused=self.fused_sampling)
        tokens = race(rows, params.temperature, stats, self.rng, fused=self.fused_sampling,
                      stream=DFLASH_STREAM)
        return self._draft(tokens.view(1, k), logits, ctx, sampled=True)

    def _draft(self, tokens: torch.Tensor, logits: torch.Tensor, ctx: DraftContext, *,
               sampled: bool) -> Draft:
        """tokens [1, k] drafted from the block's logits [1, k, vocab] (q where sampled); where
        the engine verifies trees, with each position's next best tokens beside them (the
        block's rows hold them already: one top-k for the block)."""
        q = logits if sampled else None
        k = tokens.shape[1]
        leaves = [min(m, self.target.cfg.vocab_size - 1) for m in spine_leaves(ctx.tree_widths, k)]
        if not any(leaves):
            return Draft(tokens, q)
        nodes = torch.cat([tokens, alternatives(logits[0], tokens[0], leaves).view(1, -1)], dim=1)
        return Draft(nodes, q, spine_tree(k, leaves, self.device))

    def commit(self, tokens: list[int]) -> None:
        pass  # its context grows from DraftContext.hidden, which holds exactly the committed rows


def make_dflash_drafter(path: str | Path, target: Transformer, device, dtype, *,
                        block_size: int | None = None,
                        cuda_graphs: bool | None = None) -> DFlashDrafter:
    """The DFlash drafter at `path` for `target` (checked against it before its weights load)."""
    path = Path(path).expanduser()
    read_dflash_config(path).check_target(target.cfg, str(path))
    model = load_dflash(path, dtype, device)
    return DFlashDrafter(model, target, device, dtype, block_size=block_size,
                         cuda_graphs=cuda_graphs, source=str(path))
