"""The dense decoder: Llama 3, Qwen2 / Qwen2.5 and Qwen3 in one file, read top to bottom.

The three differ in three places only: Qwen2 has biases on q/k/v, Qwen3 normalises each head
of q and k (RMSNorm) before rope, Llama 3 rescales the rope frequencies. Weights use our own
fused names (`wqkv`, `w_gate_up`); `flashdraft.loading` maps checkpoints onto them.

`forward(tokens, positions, cache)` writes the new keys and values into the preallocated
cache at `positions` and attends over every cached position <= the query's own. Because the
mask comes from positions alone, entries left behind by rejected drafts sit beyond the
committed length and are never read; rolling back is moving a length. A token tree's
verification pass (`tree=`, `flashdraft.tree`) takes its visibility and rope positions from
the tree instead; its accepted path is then moved into place (`KVCache.compact`).
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .backends import kernels
from .config import KernelConfig, ModelConfig
from .kv_cache import KVCache
from .tree import TreeMask

# Up to this many tokens per forward (decode, verification, drafting: the steps CUDA graphs
# replay) attention is `grouped_attention`; longer inputs (prefill) take SDPA.
SMALL_T = 32
# A prefill from position 0 (the whole prompt) attends causally over exactly its own keys: SDPA
# with is_causal and no mask tensor, which the flash kernel takes (it takes no mask tensor).
# SDPA's backends for prefill, in order of preference: not cuDNN's, which builds a plan for
# every new prompt length and cache size (~70-100 ms on the first prefill of each length on an
# H200), and a server meets new lengths all the time.
# None lets torch choose.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH]


class TreeBits(NamedTuple):
    """A token tree's visibility as the fused attention kernel takes it (`TreeMask.bits`)."""
    bits: torch.Tensor  # [T] int64


def attention_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype,
                   visible: torch.Tensor | None = None):
    """The mask the PyTorch attention paths take for queries at positions [batch, seq] over keys
    0 … kv_len - 1. visible: bool [batch, seq, kv_len], the keys each query sees (a tree's);
    None: those at or before its position, and then "causal" for a step from position 0 over
    more than SMALL_T tokens (SDPA's own). Else bool [batch, 1, seq, kv_len] above SMALL_T
    tokens (SDPA), additive [batch, 1, seq, 1, kv_len] up to it (`grouped_attention`)."""
    t = positions.shape[1]
    if visible is None:
        if t > SMALL_T and kv_len == t:
            return "causal"
        visible = torch.arange(kv_len, device=positions.device) <= positions.unsqueeze(-1)
    if t > SMALL_T:
        return visible.unsqueeze(1)
    return torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, :, None]


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (rotary_dim: head_dim, or its rotated part where
    rope is partial), with Llama 3's long-context rescaling if present."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim // 2, dtype=torch.float64) * 2
                                         / dim))
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor,
                               torch.where(wavelen < high_wavelen, inv_freq, mid))
    return inv_freq.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, seq, head_dim / 2] for positions [batch, seq], built once per forward,
    in the model dtype as Hugging Face applies rope. Rope itself (half-split, "neox" layout, as
    in the Hugging Face checkpoints) is `kernels.rope_and_cache_write`."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [batch, seq, head_dim / 2]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                kc: KernelConfig = kernels.DEFAULT) -> torch.Tensor:
        """RMSNorm of x; given residual, of residual + x, which is stored into residual (the
        residual add of the previous sublayer and this norm run as one kernel on the GPU)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, kc)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention for a few query tokens as plain matmuls; returns [batch, seq, heads * head_dim].

    q: [batch, seq, heads, head_dim]; keys, values: [batch, kv_heads, kv_len, head_dim];
    mask: [batch, 1, seq, 1, kv_len], additive (0 or -inf).
    The query heads that share a kv head are stacked as rows of one matrix, so each kv head's
    keys and values are read once for all of them and every token: four kernels in all,
    where SDPA with a mask and enable_gqa falls back to a multi-kernel path on CUDA.
    """
    b, t, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.view(b, t, kv_heads, group, d).transpose(1, 2)  # [batch, kv_heads, seq, group, head_dim]
    scores = q.reshape(b, kv_heads, t * group, d) @ keys.transpose(-1, -2)
    # mask + scale * scores in one op: [batch, kv_heads, seq, group, kv_len]
    scores = torch.add(mask, scores.view(b, kv_heads, t, group, -1), alpha=scale)
    out = scores.softmax(dim=-1).view(b, kv_heads, t * group, -1) @ values
    return out.view(b, kv_heads, t, group, d).transpose(1, 2).reshape(b, t, heads * d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, qkv, cos, sin, positions, mask, cache: KVCache, layer: int, kv_len: int,
                kc: KernelConfig):
        # qkv: [batch, seq, q_dim + 2 kv_dim], the output of wqkv (run with the norm before it,
        # `Block`); positions: [batch, seq]; cos, sin: [batch, seq, head_dim / 2];
        # mask: None where kernels.attention serves (the GPU, seq <= SMALL_T; TreeBits for a
        # token tree's step there), else additive
        # [batch, 1, seq, 1, kv_len] if seq <= SMALL_T (grouped_attention), else bool
        # [batch, 1, seq, kv_len] (SDPA), or "causal": SDPA's own causal mask (a prefill from
        # position 0, kv_len = seq). Returns the attention output [batch, seq, heads *
        # head_dim], before wo (`Block` runs wo with the residual add).
        b, t, _ = qkv.shape
        qkv = qkv.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        rope = (cos, sin, positions, cache.kv[layer], self.n_heads, self.n_kv,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.q_norm.eps if self.q_norm is not None else 0.0)
        if mask is None or isinstance(mask, TreeBits):
            # One kernel on the GPU: (Qwen3's head norms,) rope, the step's keys and values
            # into the cache, attention (a token tree's through its ancestors' bits).
            return kernels.rope_attention(qkv, *rope, kv_len, cache.split_len, kc,
                                          None if mask is None else mask.bits)
        # (Qwen3's head norms,) rope on the q and k heads in place, the keys and values into
        # the cache at their positions (one kernel on the GPU).
        kernels.rope_and_cache_write(qkv, *rope, kc)
        q = qkv[:, :, :self.n_heads]  # [batch, seq, heads, head_dim]
        if t <= SMALL_T:
            keys, values = cache.read(layer, b, kv_len)
            out = grouped_attention(q, keys, values, mask, self.head_dim ** -0.5)
        else:
            keys, values = cache.read(layer, b, kv_len)
            causal = isinstance(mask, str)
            backends = PREFILL_SDPA_BACKENDS
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                     attn_mask=None if causal else mask,
                                                     is_causal=causal,
                                                     enable_gqa=self.n_heads != self.n_kv)
            out = out.transpose(1, 2).reshape(b, t, -1)
        return out


class MLP(nn.Module):
    """The MLP's weights: SiLU(x · gate) · (x · up), then · down (`Block` runs them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Residual:
    """The residual stream between sublayers, each sublayer's output added in one of two ways.

    - With the add before the norm: the output waits in `delta` and the next norm adds it
      (`kernels.norm_linear`: the add and the norm in one kernel, then the product).
    - With the add in the product, which leaves each row's sums of squares in `ss`; the next
      product applies the norm itself: the norm runs no kernel of its own.
      `kernels.add_linear`, then `kernels.scaled_linear` (the norm's weight folded into the
      product's, `Transformer.fold_norms`: a scale of the product's rows), where the model's
      norms are folded and the skinny kernel serves both products (`kernels.folds_norm`):
      decode, verification and drafting steps of unquantized models on the GPU. Else the first
      way (quantized models keep their norm kernels; an int4 model's norms inside the mma
      products measured no faster and were removed).
    """

    def __init__(self, x: torch.Tensor, folded: bool, kc: KernelConfig, group=None):
        self.x = x  # [batch, seq, hidden]: the stream, but for delta
        self.delta: torch.Tensor | None = None  # [batch, seq, hidden]: an output not added yet
        # [batch * seq, tiles] float32: x's rows' sums of squares by column tile, when known
        self.ss: torch.Tensor | None = None
        self.folded = folded  # the model's norm weights are folded into the products after them
        self.kc = kc
        # tensor parallelism's process group (`flashdraft.parallel`): each rank's sublayer
        # output is a partial sum, all-reduced before it joins the stream; None: one device
        self.group = group

    def normed(self, norm: RMSNorm, module: nn.Module, gated: bool = False,
               folded: bool = True) -> torch.Tensor:
        """module(norm(stream)) (gated: SiLU(gate) · up of it, which may come as a
        `kernels.SiluPending` for `add` to hand to the down product); folded: whether the
        model's norm weights were folded into module."""
        if self.ss is not None and folded and self.folded:
            return kernels.scaled_linear(self.x, self.ss, norm.eps, module, gated, self.kc)
        out, self.x = kernels.norm_linear(self.delta, self.x, norm, module, gated, self.kc)
        self.delta = self.ss = None
        return out

    def add(self, x: torch.Tensor | kernels.SiluPending, module: nn.Module) -> None:
        """The sublayer output module(x) into the stream (after `normed`: no delta waits); x
        may be an MLP's activation not computed yet (`kernels.SiluPending`), which the product
        then computes."""
        pending = isinstance(x, kernels.SiluPending)
        if (self.group is None and self.folded
                and kernels.folds_norm(x.gate_up if pending else x, module, self.kc)):
            self.ss = kernels.add_linear(x, module, self.x, self.kc)
        else:
            self.delta = kernels.linear(x.value() if pending else x, module, self.kc)
            if self.group is not None:  # the ranks' partial sums: the output, then its add
                torch.distributed.all_reduce(self.delta, group=self.group)
            self.ss = None

    def value(self) -> torch.Tensor:
        """The stream as a new tensor."""
        return self.x.clone() if self.delta is None else self.x + self.delta

    def rows(self, index: torch.Tensor | slice) -> "Residual":
        """The stream at positions `index` along seq only (int64 indices, or a slice)."""
        pick = ((lambda t: t.index_select(1, index)) if isinstance(index, torch.Tensor)
                else (lambda t: t[:, index]))
        picked = Residual(pick(self.x), self.folded, self.kc, self.group)
        if self.delta is not None:
            picked.delta = pick(self.delta)
        return picked


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(·)), on the residual stream (`Residual`), which takes
    each residual add and norm with a product next to it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, stream: Residual, cos, sin, positions, mask, cache, layer, kv_len) -> None:
        """Advance `stream` (the block's input) through the block, in place."""
        qkv = stream.normed(self.attn_norm, self.attn.wqkv)
        stream.add(self.attn(qkv, cos, sin, positions, mask, cache, layer, kv_len, stream.kc),
                   self.attn.wo)
        act = stream.normed(self.mlp_norm, self.mlp.w_gate_up, gated=True)
        stream.add(act, self.mlp.w_down)


class Transformer(nn.Module):
    supports_trees = True  # forward(tree=): its cache is attention's alone (KVCache.compact)
    # a step may run padded past its real tokens: their keys and values land past them, unread
    pads_freely = True

    def __init__(self, cfg: ModelConfig, kernel_config: KernelConfig = kernels.DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.kernel_config = kernel_config  # how its steps run on the GPU
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.norms_folded = False  # fold_norms
        # set by `parallel.shard`: this rank holds a slice of the heads and of the MLP, and its
        # wo and w_down outputs are partial sums the ranks all-reduce (`Residual`); None: the
        # whole model on one device
        self.process_group = None

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device,
                  steps: int = 1, tree_nodes: int = 0) -> KVCache:
        """A cache for `batch` sequences of up to max_len positions (any step can be rolled
        back, any tree verified: `steps` and `tree_nodes` matter to recurrent models only)."""
        return KVCache.for_model(self.cfg, batch, max_len, dtype, device)

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Fold each block's RMSNorm weights into the product after it (wqkv, w_gate_up:
        W · diag(g), rounded once to the weight's dtype; g then ones), which computes the same
        function and lets those products apply the norm themselves (`Residual`). Unquantized
        models only (the loaders fold unquantized models; quantized ones keep their norms,
        since folding would widen the int4 group scales); the final norm stays (a tied output
        head is the embedding)."""
        pairs = [(norm, linear) for block in self.layers
                 for norm, linear in ((block.attn_norm, block.attn.wqkv),
                                      (block.mlp_norm, block.mlp.w_gate_up))]
        for _, linear in pairs:  # all checked before any is changed
            if type(linear) is not nn.Linear:
                raise ValueError(f"fold_norms folds into nn.Linear weights, and this model's "
                                 f"{type(linear).__name__} ({linear}) is not one: a quantized "
                                 f"model keeps its norms, do not fold it")
        for norm, linear in pairs:
            w, g = linear.weight, norm.weight.float()
            folded = torch.empty_like(w)
            for i in range(0, w.shape[0], 4096):  # float32 a slice at a time: a small peak
                folded[i:i + 4096] = (w[i:i + 4096].float() * g).to(w.dtype)
            linear.weight = nn.Parameter(folded, requires_grad=False)
            norm.weight = nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
        self.norms_folded = True

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                kv_len: int | None = None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False, logits_at: torch.Tensor | None = None,
                tree: TreeMask | None = None):
        """Run `tokens` at `positions` through the model, writing their keys/values to `cache`.

        tokens, positions: [batch, seq] (int64), each sequence's positions consecutive (start,
        start + 1, ...: its keys go to the cache there). kv_len: how many cache positions
        attention may read (an upper bound on positions + 1; a static value keeps shapes fixed
        for CUDA graphs).
        hidden_layers: indices of layers whose outputs are returned as well (0 = the
        embeddings, i = the output of layer i). last_only: compute logits for the last position
        only (prefill). logits_at: int64 [r], compute logits for those indices along seq only (a
        prefill padded to a fixed length: the last real token's; a tensor, so that a CUDA graph
        of that length serves every prompt shorter).
        tree: a token tree's verification pass (`flashdraft.tree`): positions are then the
        cache slots of its nodes (start .. start + seq - 1, seq = tree.size), each node is read
        at rope position start + its depth and attends to slots before start, its ancestors and
        itself (a mask tensor, the plain-PyTorch attention paths); None: the causal pass.
        Returns logits [batch, seq (1 with last_only, r with logits_at), vocab] (float32) and a
        list of hidden states [batch, seq, hidden], one per requested layer (empty when none are
        requested).
        """
        if tree is not None:
            tree.check(tokens)
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        residual = self.embed(tokens)  # the residual stream
        rope_positions = positions if tree is None else tree.rope_positions(positions)
        cos, sin = rope_cos_sin(rope_positions, self.inv_freq, residual.dtype)
        if (tokens.shape[1] <= SMALL_T and kernels.use_triton(residual, self.kernel_config)
                and (tree is None or tree.bits is not None)):
            # kernels.attention needs positions only, and a tree's ancestors as bit sets
            mask = None if tree is None else TreeBits(tree.bits)
        else:
            mask = attention_mask(positions, kv_len, residual.dtype,
                                  None if tree is None else tree.visible(positions, kv_len))
        hidden = [residual.clone()] if 0 in hidden_layers else []
        stream = Residual(residual, self.norms_folded, self.kernel_config, self.process_group)
        for i, block in enumerate(self.layers):
            block(stream, cos, sin, positions, mask, cache, i, kv_len)
            if i + 1 in hidden_layers:
                hidden.append(stream.value())
        if logits_at is not None:
            stream = stream.rows(logits_at)
        elif last_only:
            stream = stream.rows(slice(-1, None))
        logits = stream.normed(self.norm, self.lm_head, folded=False)
        return logits.float(), hidden
