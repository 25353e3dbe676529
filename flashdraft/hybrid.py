"""The Qwen3.5 / Qwen3.6 hybrid decoder (dense), read top to bottom.

Each layer mixes tokens one of two ways (`cfg.layer_types`; three Gated DeltaNet layers to one
full-attention layer in the released models), then runs the usual SiLU MLP:

- **Gated DeltaNet** (linear attention). One product gives q, k, v (through a short causal
  depthwise convolution of `linear_conv_kernel_dim` taps and SiLU), an output gate z, and the
  per-head β (sigmoid) and decay g = -exp(A_log) · softplus(a + dt_bias). With q and k
  L2-normalised and q scaled by d_k^-1/2, each value head keeps a state S [d_k, d_v]:

      S ← exp(g_t) S;   S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t);   o_t = Sᵀ q_t

  (the gated delta rule), and o goes through an RMSNorm gated by SiLU(z). Key heads serve
  consecutive groups of value heads.
- **Gated attention**: grouped-query attention whose q and k heads are RMS-normalised, rope
  on the first `rotary_dim` dimensions of each head only, and the output multiplied by
  sigmoid of a gate that the q product computes alongside q.

Every RMSNorm but the DeltaNet's output norm scales by 1 + w (zero-centred weights, as in the
checkpoints). The reference is transformers' `qwen3_5` classes; the tests compare logits.

A recurrent state cannot be cut back like a KV cache: a rejected draft's update is mixed into
it. So `HybridCache` keeps the state after each of the last `steps` positions (and the
convolution's inputs a little further back), in slots addressed by position modulo the ring's
size, exactly like the KV cache keeps keys by position: a step starting at position s reads the
state after s - 1 and writes the states after each of its own positions. After a verification
of k + 1 tokens of which n drafts are accepted, the state after the last accepted token is
already in its slot: rolling back moves a length (`HybridCache.commit`), with no copy and no
re-run. Steps longer than `steps` (a prefill) run the chunked form of the rule and keep only
their last position's state.

A token tree (`tree.SpineTree`: a chain of drafts with other candidates beside each) is
verified in one pass too: its chain as above, each leaf one update past its parent's state in
the ring, with the leaf's inputs to the rule and the convolution kept aside (a few vectors a
leaf, not a state). Where the accepted path ends in a leaf, `HybridCache.compact` makes its
state from its parent's and those inputs and puts it in the leaf's slot: one update for all
layers at once.

Memory: the ring holds `steps` states of [v_heads, d_k, d_v] float32 for each DeltaNet layer
(Qwen3.5-27B: 48 layers × 48 × 128 × 128 × 4 bytes = 151 MB a position); `steps` is the
longest verification the engine runs, k + 1.

The PyTorch here is the reference: decode and verification steps loop over their tokens
(`delta_rule_recurrent`), a prefill runs the chunked form (chunks of `CHUNK` tokens). On a GPU
a step whose every state is kept runs the rule in one Triton kernel instead
(`deltanet_kernels.delta_rule_step`: the same states in the same slots). Products go through
`kernels.linear` (the skinny GPU kernel, or a quantized layer's own), the rest is plain
PyTorch.

Steps are CUDA graphs (`cuda_graphs`): every slot a step reads or writes is computed on the
device from its positions tensor (`HybridCache.slots`), so one recorded step of t tokens serves
every position, and a padded prefill masks its padding out of the states on the device too
(`logits_at`). The host's view of which states the rings hold serves only to refuse a step that
would read a state no longer there, where positions are free to read (a CPU cache: `checked`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .backends import deltanet_kernels, kernels
from .config import KernelConfig, ModelConfig
from .kv_cache import KVCache
from .model import (MLP, SMALL_T, attention_mask, grouped_attention, rope_cos_sin,
                    rope_frequencies)
from .tree import TreeMask

# Tokens per chunk of the chunked gated delta rule (prefill), as in the reference
CHUNK = 64


# -- the cache --------------------------------------------------------------------------------

@dataclass
class StepSlots:
    """Where one step of t tokens at positions s … s + t - 1 reads and writes the recurrent layers'
    cache (`HybridCache.slots`): tensors on the cache's device, computed there from the step's
    positions, so that a recorded step reads and writes the right slots at every position."""
    kept: bool  # every position's state is written (t <= steps: a decode or a verification)
    read: torch.Tensor  # [1] int64: the slot of the state after s - 1; -1 at s = 0 (zeros)
    # [t] int64 (kept), else [1]: the slots of the states after each position, or the last real
    write: torch.Tensor
    window: torch.Tensor  # [kernel - 1] int64: the conv slots of positions s - kernel + 1 … s - 1
    window_valid: torch.Tensor  # [kernel - 1] bool: those positions are >= 0
    # [w] int64: the rows of [window, step] whose conv inputs are kept (the last w real
    # positions'; a negative row is a position before the window, whose slot keeps its input) …
    conv_rows: torch.Tensor
    conv_write: torch.Tensor  # [w] int64: … and their conv slots
    real: torch.Tensor | None  # [t] bool: tokens before a padded prefill's padding; None: all
    leaves: "LeafSlots | None" = None  # a token tree's leaves after the step's chain; None: none


@dataclass
class LeafSlots:
    """A token tree's leaves (`HybridCache.tree_slots`): the L rows after a verification's chain
    of c rows (its root and spine), each a child of one chain row. A leaf's state is its
    parent's after one more update; it is not written to the ring, which holds the chain's,
    but its inputs are kept (the cache's leaf stash, at the leaf's slot modulo tree_nodes) so
    that `HybridCache.compact` can put the state of an accepted leaf in its place."""
    chain: int  # c
    parent_slots: torch.Tensor  # [L] int64: the ring slots of the parents' states
    conv_rows: torch.Tensor  # [L, kernel - 1] int64: rows of [window, chain] before each leaf
    stash: torch.Tensor  # [L] int64: where each leaf's inputs are kept


_SPINES: dict = {}  # TreeMask -> (c, the leaves' parent rows [L] on the tree's device)


def spine_of(tree: TreeMask) -> tuple[int, torch.Tensor]:
    """(c, parents [L]) of a tree the hybrid verifies: a chain of c nodes (the root and the
    spine, each the child of the one before) and then L leaves, each a child of a chain node
    (`tree.SpineTree`'s shape), or a user's error naming the parents. Kept per tree, so that the
    tensor exists before a CUDA graph records a step over it."""
    found = _SPINES.get(tree)
    if found is None:
        parents = tree.parents
        c = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
        if any(p < 0 or p >= c for p in parents[c:]):
            raise ValueError(f"the hybrid verifies trees of a chain and leaves beside it (each "
                             f"leaf a child of a chain node), not parents {list(parents)}: a "
                             f"recurrent state follows one path, and a leaf's is one update "
                             f"past its parent's")
        found = _SPINES[tree] = (c, torch.tensor(parents[c:], dtype=torch.int64,
                                                 device=tree.depth.device))
    return found


class HybridCache:
    """The caches of one batch of sequences through a `HybridTransformer`: keys and values of
    the full-attention layers (a `KVCache` addressed by position), and for each DeltaNet layer
    its recurrent state and its convolution's inputs, in rings addressed by position.

    A step may start at any position s whose state (after s - 1) is still in its slot: within
    the last `steps` positions the last step wrote (a prefill longer than that keeps its last
    one only), and not past the length `commit` moved back to; or at 0, a new sequence. Where
    `checked` (a CPU cache, whose positions the host reads for free), the host follows which
    positions those are and refuses a step or a commit outside them: `end` (one past the last
    position the last step wrote, or the length `commit` moved it back to) and `kept_from` (the
    first position whose state is still in its slot). On a GPU nothing is followed: a step's
    positions alone say where it reads, and the engine's invariant keeps them right.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, steps: int = 1, tree_nodes: int = 0):
        kinds = cfg.layer_types
        self.attention_index = {}  # model layer -> its index among the full-attention layers
        self.linear_index = {}  # model layer -> its index among the DeltaNet layers
        for i, kind in enumerate(kinds):
            table = self.attention_index if kind == "full_attention" else self.linear_index
            table[i] = len(table)
        self.kv = KVCache(len(self.attention_index), batch, cfg.num_kv_heads, max_len,
                          cfg.head_dim, dtype, device)
        # [attention layers, batch, kv_heads, max_len, head_dim] each: views, as KVCache's
        self.k, self.v = self.kv.k, self.kv.v
        self.max_len, self.steps = max_len, max(1, steps)
        self.kernel = cfg.linear_conv_kernel_dim
        n_lin = len(self.linear_index)
        v_heads, dk, dv = (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim)
        conv_dim = 2 * cfg.linear_num_key_heads * dk + v_heads * dv
        # [linear layers, batch, steps, v_heads, d_k, d_v]: the state after position p in slot
        # p % steps
        self.state = torch.zeros(n_lin, batch, self.steps, v_heads, dk, dv,
                                 dtype=torch.float32, device=device)
        # [linear layers, batch, conv_slots, conv_dim]: the convolution's input at position p
        # in slot p % conv_slots; kernel - 1 more slots than states, so that the window before
        # any position whose state is kept is still there
        self.conv_slots = self.steps + self.kernel - 1
        self.conv = torch.zeros(n_lin, batch, self.conv_slots, conv_dim, dtype=dtype,
                                device=device)
        # A token tree's leaves' inputs to the rule (k normalised, v, g, β per value head) and
        # to the convolution, at the leaf's slot modulo tree_nodes (`LeafSlots`): a few vectors
        # a leaf, from which `compact` makes an accepted leaf's state. The ring needs a slot
        # for each chain token only, and a tree verifies at most tree_nodes tokens.
        self.tree_nodes = max(1, tree_nodes)
        lead = (n_lin, batch, self.tree_nodes, v_heads)
        self.leaf_k = torch.zeros(*lead, dk, dtype=torch.float32, device=device)
        self.leaf_v = torch.zeros(*lead, dv, dtype=torch.float32, device=device)
        self.leaf_g = torch.zeros(lead, dtype=torch.float32, device=device)
        self.leaf_beta = torch.zeros(lead, dtype=torch.float32, device=device)
        self.leaf_conv = torch.zeros(n_lin, batch, self.tree_nodes, conv_dim, dtype=dtype,
                                     device=device)
        self.checked = torch.device(device).type == "cpu"
        self.end = self.kept_from = 0
        # Positions one attention program reads on the GPU; the engine sets it per request.
        self.split_len = self.kv.split_len

    def graph_key(self) -> tuple:
        """What a CUDA graph of a step over this cache depends on: the addresses and shapes of
        its keys and values and of its rings (a ring's slot count is baked into the step)."""
        return (self.kv.graph_key(), self.state.data_ptr(), tuple(self.state.shape),
                self.conv.data_ptr(), tuple(self.conv.shape))

    def fits(self, max_len: int, steps: int, tree_nodes: int = 0) -> bool:
        """Whether this cache serves sequences of max_len positions verified `steps` at a time
        (chains), or as token trees of up to `tree_nodes` tokens."""
        return (self.max_len >= max_len and self.steps >= steps
                and self.tree_nodes >= tree_nodes)

    def slots(self, positions: torch.Tensor, last: torch.Tensor | None = None) -> StepSlots:
        """Where the step at positions [batch, t] (consecutive, the same in every row) reads and
        writes, computed on their device without a host read. last: 0-dim int64, the step's last
        real token (a padded prefill: the tokens after it change no state); None: its last."""
        row = positions[0]  # [t]
        t, device = row.shape[0], row.device
        start = row[:1]  # [1]
        end = start + (t if last is None else last + 1)  # [1]: past the last real position
        kept = t <= self.steps
        window = start + torch.arange(1 - self.kernel, 0, device=device)  # [kernel - 1]
        # The conv inputs of the last w real positions are kept: the window and the step's
        # own, as many as the ring holds.
        w = min(t + self.kernel - 1, self.conv_slots)
        conv_positions = end - w + torch.arange(w, device=device)  # [w]
        return StepSlots(
            kept=kept, read=torch.where(start > 0, (start - 1) % self.steps, -1),
            write=(row if kept else end - 1) % self.steps,
            window=window % self.conv_slots, window_valid=window >= 0,
            conv_rows=conv_positions - start + self.kernel - 1,
            conv_write=conv_positions % self.conv_slots,
            real=None if last is None else torch.arange(t, device=device) <= last)

    def tree_slots(self, positions: torch.Tensor, tree: TreeMask) -> StepSlots:
        """Where a token tree's verification at slots positions [batch, T] reads and writes: its
        chain (`spine_of`) as a step of c tokens, which keeps every state (c <= steps), and its
        leaves (`LeafSlots`)."""
        c, parents = spine_of(tree)
        if c > self.steps or tree.size > self.tree_nodes:
            raise ValueError(f"a tree of {tree.size} tokens, {c} of them a chain, needs a cache "
                             f"of steps >= {c} and tree_nodes >= {tree.size}; this one has "
                             f"steps={self.steps}, tree_nodes={self.tree_nodes}")
        slots = self.slots(positions[:, :c])
        row = positions[0]
        slots.leaves = LeafSlots(
            chain=c, parent_slots=(row[0] + parents) % self.steps,
            conv_rows=parents[:, None] + torch.arange(1, self.kernel, device=row.device),
            stash=row[c:] % self.tree_nodes)
        return slots

    def compact(self, start: int, path) -> None:
        """After a tree's verification whose accepted path ends in a leaf: the leaf, written at
        slot start + path[0], is the token at position `start` (`KVCache.compact`'s arguments,
        as the engine passes them: the chain before it is in place). Its keys and values move
        there, and its state (its parent's, at start - 1, after the leaf's update, from the
        inputs the pass kept) and its convolution input take that position's slots, in every
        layer at once. An empty path, or a path of the chain alone, changes nothing."""
        path = list(path)
        if not path or path == list(range(len(path))):
            return
        if len(path) != 1 or start < 1:
            raise ValueError(f"the hybrid compacts one leaf after its chain (a path [leaf] from "
                             f"slot >= 1), not path {path} from slot {start}")
        self.kv.compact(start, path)
        j, here = (start + path[0]) % self.tree_nodes, start % self.steps
        self.state[:, :, here] = delta_update(  # [layers, batch, h, d_k, d_v]
            self.state[:, :, (start - 1) % self.steps], self.leaf_k[:, :, j],
            self.leaf_v[:, :, j], self.leaf_g[:, :, j], self.leaf_beta[:, :, j])
        self.conv[:, :, start % self.conv_slots] = self.leaf_conv[:, :, j]

    def overwritten_inputs(self, start: int, t: int) -> list[torch.Tensor]:
        """Views of the slots a step of t tokens from `start` reads and then overwrites, which a
        second run of the same step would read changed (a CUDA graph's warm-up runs each step
        before it is recorded, and puts these back): the state after start - 1 where the step
        writes a whole turn of the ring or more (t >= steps: plain decoding's ring of one slot,
        a verification of `steps` tokens, a chunked step that may land its last state there),
        and the convolution's window before `start` where a step longer than the ring writes
        past it (t > steps). Nothing for a step from 0, which reads no slot."""
        if start == 0:
            return []
        views = [self.state[:, :, (start - 1) % self.steps]] if t >= self.steps else []
        if t > self.steps:
            views += [self.conv[:, :, p % self.conv_slots]
                      for p in range(max(0, start - self.kernel + 1), start)]
        return views

    def begin(self, start: int, t: int, real: int | None = None) -> None:
        """Follows a step of t tokens from position `start` (of which the first `real` are not
        padding; None: all) on the host, where the cache is `checked`: refuses it if the state
        it reads is gone, and notes which states the rings hold after it."""
        if not self.checked:
            return
        if start != 0 and not self.kept_from <= start - 1 < self.end:
            raise ValueError(
                f"a step from position {start} needs the recurrent state after position "
                f"{start - 1}, and the cache holds the states after positions {self.kept_from} "
                f"… {self.end - 1}: a step may start where the last one ended, or go back at "
                f"most {self.steps - 1} positions into it (the cache's steps={self.steps}; a "
                f"prefill keeps its last position's state only)")
        end = start + (t if real is None else real)
        # States of earlier positions survive where this step wrote no slot of theirs (its
        # padding writes slots too).
        older = self.kept_from if start else 0
        self.kept_from = max(older, start + t - self.steps) if t <= self.steps else end - 1
        self.end = end

    def commit(self, length: int) -> None:
        """The sequence is `length` tokens long: positions from `length` on are discarded (the
        rejected drafts of a verification). The state after length - 1 is already in its slot:
        nothing moves; a `checked` cache moves its end back, and refuses a length whose state
        is not kept."""
        if not self.checked or length == self.end:
            return
        if not (length == 0 or self.kept_from <= length - 1 < self.end):
            raise ValueError(f"cannot commit a length of {length}: the cache holds the states "
                             f"after positions {self.kept_from} … {self.end - 1}")
        self.end = length

    def nbytes(self) -> int:
        return self.kv.nbytes() + sum(x.numel() * x.element_size() for x in (
            self.state, self.conv, self.leaf_k, self.leaf_v, self.leaf_g, self.leaf_beta,
            self.leaf_conv))


# -- the gated delta rule ---------------------------------------------------------------------

def delta_update(state, k, v, g, beta):
    """One token's gated delta rule: state [..., d_k, d_v] decayed by exp(g) and corrected
    towards v along k (k [..., d_k], v [..., d_v], g and beta [...]; float32). Returns the new
    state."""
    state = state * g[..., None, None].exp()
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    return state + k[..., None] * delta[..., None, :]


def delta_rule_recurrent(q, k, v, g, beta, state, out_states=None):
    """The gated delta rule token by token. q, k: [batch, heads, t, d_k] (normalised, q scaled);
    v: [batch, heads, t, d_v]; g, beta: [batch, heads, t]; state: [batch, heads, d_k, d_v] (all
    float32). out_states: None, or a function called with (i, the state after token i).
    Returns the outputs [batch, heads, t, d_v] and the final state."""
    out = torch.empty_like(v)
    for i in range(q.shape[2]):
        state = delta_update(state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        out[:, :, i] = (state * q[:, :, i, :, None]).sum(-2)
        if out_states is not None:
            out_states(i, state)
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over chunks of `chunk` tokens (arguments and result as
    `delta_rule_recurrent`'s): within a chunk the t sequential rank-one updates are solved at
    once (the WY / UT form: a unit lower-triangular system), so a prefill costs matrix products
    and one small loop over chunks."""
    b, h, t, dk = k.shape
    pad = -t % chunk
    # Padding has k = v = 0, β = 0 and g = 0: it neither decays nor updates the state.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.view(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.view(b, h, n, chunk), beta.view(b, h, n, chunk)
    cum = g.cumsum(-1)  # log of the decay from the chunk's start through each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: from token j's update to token i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # The rank-one updates of a chunk interact through (I + strictly lower(β k kᵀ ∘ decay));
    # solving it gives each token's corrected value (u) and its read of the chunk's initial
    # state (w).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, chunk, chunk]
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):
        u_c = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ u_c
        state = (state * cum[:, :, c, -1, None, None].exp()
                 + k_to_end[:, :, c].transpose(-1, -2) @ u_c)
    return out.view(b, h, n * chunk, -1)[:, :, :t], state


# -- layers -----------------------------------------------------------------------------------

class CenteredRMSNorm(nn.Module):
    """RMSNorm scaling by 1 + w, computed in float32 (the checkpoints store w around 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm(x) · w · SiLU(z) over the last dimension, in x's dtype (the reference's order of
    roundings: the norm in float32, w applied in x's dtype, the gate in float32)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = cfg.rms_norm_eps
        # [q, k, v (the convolution's inputs); z; b; a] from one product
        self.w_in = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.v_heads,
                              bias=False)
        # [conv_dim, 1, kernel]: depthwise, as F.conv1d and the checkpoints hold it
        self.conv = nn.Parameter(torch.zeros(self.conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.dv))
        self.w_out = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: HybridCache, layer: int, slots: StepSlots,
                kc: KernelConfig) -> torch.Tensor:
        # x: [batch, seq, hidden], the normed stream; returns [batch, seq, hidden]
        b, t, _ = x.shape
        proj = kernels.linear(x, self.w_in, kc)
        mixed, z, beta, a = proj.split([self.conv_dim, self.value_dim, self.v_heads,
                                        self.v_heads], dim=-1)
        lin = cache.linear_index[layer]
        mixed = self._convolve(mixed, cache.conv[lin], slots, cache.leaf_conv[lin])
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)

        def heads(y, d):  # [batch, seq, n * d] -> [batch, n, seq, d] (a view)
            return y.reshape(b, t, -1, d).transpose(1, 2)

        beta = beta.float().sigmoid().transpose(1, 2)  # [batch, v_heads, seq]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).transpose(1, 2)
        if slots.real is not None:  # a padded prefill: with β = g = 0 padding changes no state
            beta, g = beta * slots.real, g * slots.real
        q, k, v = heads(q, self.dk), heads(k, self.dk), heads(v, self.dv)
        leaves = slots.leaves
        c = t if leaves is None else leaves.chain
        out = self.rule(q[:, :, :c], k[:, :, :c], v[:, :, :c], g[:, :, :c], beta[:, :, :c],
                        cache.state[lin], slots, kc)
        if leaves is not None:  # after the chain, whose states the leaves' parents' are
            out = torch.cat([out, self._leaf_rule(q[:, :, c:], k[:, :, c:], v[:, :, c:],
                                                  g[:, :, c:], beta[:, :, c:], cache, lin,
                                                  leaves)], dim=2)
        out = gated_rms_norm(out.transpose(1, 2).to(x.dtype), z.view(b, t, self.v_heads, self.dv),
                             self.norm_weight, self.eps)
        return kernels.linear(out.reshape(b, t, self.value_dim), self.w_out, kc)

    def _convolve(self, mixed: torch.Tensor, ring: torch.Tensor, slots: StepSlots,
                  stash: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution and SiLU of mixed [batch, seq, conv_dim], after the
        inputs of the positions before the step (from `ring` [batch, conv_slots, conv_dim]),
        whose slots then take this step's inputs. A tree's leaves (the rows after its chain)
        each see the chain's inputs before their own, and are kept in `stash` [batch, tree_nodes,
        conv_dim] instead of the ring."""
        leaves = slots.leaves
        chain = mixed if leaves is None else mixed[:, :leaves.chain]
        window = ring[:, slots.window] * slots.window_valid[:, None].to(ring.dtype)
        inputs = torch.cat([window, chain.to(ring.dtype)], dim=1)  # [batch, kernel - 1 + c, C]
        kept = inputs.index_select(1, slots.conv_rows.clamp(min=0))  # [batch, w, C]
        if slots.real is not None:  # rows before the window: positions whose inputs stay
            kept = torch.where((slots.conv_rows >= 0)[:, None], kept,
                               ring.index_select(1, slots.conv_write))
        ring.index_copy_(1, slots.conv_write, kept)
        out = F.conv1d(inputs.transpose(1, 2), self.conv, groups=self.conv_dim).transpose(1, 2)
        if leaves is not None:
            own = mixed[:, leaves.chain:].to(ring.dtype)  # [batch, L, C]
            stash.index_copy_(1, leaves.stash, own)
            taps = torch.cat([inputs[:, leaves.conv_rows], own[:, :, None]], dim=2)
            out = torch.cat([out, (taps * self.conv[:, 0].t()).sum(2)], dim=1)
        return F.silu(out).to(mixed.dtype)

    @staticmethod
    def _leaf_rule(q, k, v, g, beta, cache: HybridCache, lin: int,
                   leaves: LeafSlots) -> torch.Tensor:
        """A tree's leaves through the rule (arguments as `rule`'s, for the L leaf rows): each
        one update past its parent's state, which the chain just wrote to the ring; their
        inputs are kept for `HybridCache.compact`. Returns [batch, v_heads, L, d_v] float32."""
        scale, group = q.shape[-1] ** -0.5, v.shape[1] // k.shape[1]

        def rows(y, repeat=1):  # [batch, heads, L, d] -> [batch, L, heads · repeat, d] float32
            y = y.float()
            return (y.repeat_interleave(repeat, dim=1) if repeat > 1 else y).transpose(1, 2)

        q, k, v = l2_normalize(rows(q, group)) * scale, l2_normalize(rows(k, group)), rows(v)
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [batch, L, v_heads]
        for kept, x in ((cache.leaf_k, k), (cache.leaf_v, v), (cache.leaf_g, g),
                        (cache.leaf_beta, beta)):
            kept[lin].index_copy_(1, leaves.stash, x)
        state = cache.state[lin].index_select(1, leaves.parent_slots)  # [b, L, h, d_k, d_v]
        state = delta_update(state, k, v, g, beta)
        return (state * q[..., None]).sum(-2).transpose(1, 2)

    @staticmethod
    def rule(q, k, v, g, beta, ring: torch.Tensor, slots: StepSlots,
             kc: KernelConfig = kernels.DEFAULT) -> torch.Tensor:
        """The gated delta rule of one step: q, k [batch, k_heads, seq, d_k] and v [batch,
        v_heads, seq, d_v] as the convolution leaves them (any dtype; q and k not normalised
        yet), g, beta [batch, v_heads, seq] float32; the state read from and written to ring
        [batch, steps, v_heads, d_k, d_v] at `slots`. Returns [batch, v_heads, seq, d_v]
        float32. A step that keeps every state runs `deltanet_kernels.delta_rule_step` where
        the kernels serve (the key heads' groups, the norms and q's scale inside it)."""
        scale, group = q.shape[-1] ** -0.5, v.shape[1] // k.shape[1]
        if slots.kept and deltanet_kernels.serves(v, v.shape[2], kc):
            return deltanet_kernels.delta_rule_step(q, k, v, g, beta, ring, slots.read,
                                                    slots.write, scale, kc=kc)

        def per_value_head(y):  # [batch, k_heads, seq, d_k] -> [batch, v_heads, seq, d_k]
            y = y.float()
            return y.repeat_interleave(group, dim=1) if group > 1 else y

        q = l2_normalize(per_value_head(q)) * scale
        k = l2_normalize(per_value_head(k))
        return GatedDeltaNet._delta_rule(q, k, v.float(), g, beta, ring, slots)

    @staticmethod
    def _delta_rule(q, k, v, g, beta, ring: torch.Tensor, slots: StepSlots) -> torch.Tensor:
        """The rule from the state the step reads (ring [batch, steps, v_heads, d_k, d_v]),
        writing the states after its positions (all of them, or the last: `slots.kept`)."""
        state = ring.index_select(1, slots.read.clamp(min=0)).squeeze(1)  # [batch, h, d_k, d_v]
        state = torch.where(slots.read >= 0, state, 0.0)  # a new sequence starts from zeros
        if slots.kept:
            states = []
            out, _ = delta_rule_recurrent(q, k, v, g, beta, state, lambda i, s: states.append(s))
            ring.index_copy_(1, slots.write, torch.stack(states, dim=1))
        else:
            out, state = delta_rule_chunked(q, k, v, g, beta, state)
            ring.index_copy_(1, slots.write, state.unsqueeze(1))
        return out


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope (half-split) on the first 2 · cos.shape[-1] dimensions of x [batch, seq, heads, d];
    cos, sin: [batch, seq, rotary_dim / 2]. The rest pass unchanged."""
    half = cos.shape[-1]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # [q and gate, interleaved by head as the checkpoints' q_proj is; k; v]
        self.wqkv = nn.Linear(cfg.hidden_size, 2 * q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.qkv_bias)
        self.q_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, mask, cache: HybridCache, layer: int, kv_len: int,
                kc: KernelConfig) -> torch.Tensor:
        # x: [batch, seq, hidden], the normed stream; positions: [batch, seq]; cos, sin: [batch,
        # seq, rotary_dim / 2]; mask: as `model.Attention`'s (additive [batch, 1, seq, 1,
        # kv_len] for seq <= SMALL_T, bool [batch, 1, seq, kv_len], or "causal"). Returns
        # [batch, seq, hidden].
        b, t, _ = x.shape
        d, h = self.head_dim, self.n_heads
        qg, k, v = kernels.linear(x, self.wqkv, kc).split(
            [2 * h * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, gate = qg.view(b, t, h, 2 * d).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q), cos, sin)
        k = partial_rope(self.k_norm(k.view(b, t, self.n_kv, d)), cos, sin)
        layer_kv = cache.kv.kv[cache.attention_index[layer]]  # [2, batch, kv_heads, max_len, d]
        rows = torch.arange(b, device=x.device).unsqueeze(1)
        layer_kv[:, rows, :, positions] = torch.stack([k, v.view(b, t, self.n_kv, d)], dim=2)
        keys, values = cache.kv.read(cache.attention_index[layer], b, kv_len)
        if t <= SMALL_T:
            out = grouped_attention(q, keys, values, mask, d ** -0.5)
        else:
            causal = isinstance(mask, str)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                 attn_mask=None if causal else mask,
                                                 is_causal=causal, enable_gqa=h != self.n_kv)
            out = out.transpose(1, 2).reshape(b, t, h * d)
        out = out * torch.sigmoid(gate.reshape(b, t, h * d))
        return kernels.linear(out, self.wo, kc)


class HybridBlock(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(·)); the mixer is a `GatedDeltaNet` or a
    `GatedAttention` by the layer's type."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.attn_norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.deltanet = GatedDeltaNet(cfg)
        else:
            self.attn = GatedAttention(cfg)
        self.mlp_norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, mask, cache, layer, kv_len, slots, kc):
        normed = self.attn_norm(x)
        if self.kind == "linear_attention":
            x = x + self.deltanet(normed, cache, layer, slots, kc)
        else:
            x = x + self.attn(normed, cos, sin, positions, mask, cache, layer, kv_len, kc)
        act = kernels.gated_linear(self.mlp_norm(x), self.mlp.w_gate_up, kc)
        return x + kernels.linear(act, self.mlp.w_down, kc)


class HybridTransformer(nn.Module):
    """The decoder; `forward` has `model.Transformer.forward`'s signature, with a `HybridCache`
    (`new_cache`) for the cache."""

    # A step's slots come from its positions on the device (`HybridCache.slots`): StepRunner
    # records decode, verification and padded prefill steps as CUDA graphs.
    cuda_graphs = True
    # forward(tree=) verifies a chain with leaves beside it (`spine_of`), the trees drafters
    # build; HybridCache.compact moves an accepted leaf into place
    supports_trees = True
    # a padded step's extra positions would advance recurrent states: padding runs only where
    # the step says which rows are real (logits_at)
    pads_freely = False

    def __init__(self, cfg: ModelConfig, kernel_config: KernelConfig = kernels.DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.kernel_config = kernel_config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(cfg, kind) for kind in cfg.layer_types)
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.norms_folded = False

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device,
                  steps: int = 1, tree_nodes: int = 0) -> HybridCache:
        """A cache for `batch` sequences of up to max_len positions, whose steps may be
        rolled back to any position of the last `steps` (a verification of k drafts: k + 1),
        and which verifies token trees of up to `tree_nodes` tokens (0: none)."""
        return HybridCache(self.cfg, batch, max_len, dtype, device, steps, tree_nodes)

    def fold_norms(self) -> None:
        """Nothing is folded: the norms scale by 1 + w in float32, and the products are plain."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HybridCache,
                kv_len: int | None = None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False, logits_at: torch.Tensor | None = None, tree=None):
        """As `Transformer.forward`: tokens, positions [batch, seq] (each row's positions
        consecutive, the same for every row). kv_len: the end of the step's positions, or a
        bound past it (a graph's bucket: attention masks by position); None: read from
        positions. logits_at: int64 [r], the rows whose logits are wanted; rows past the last of
        them are padding (a prefill padded to a fixed length), which a recurrent state cannot
        skip: they run with β = g = 0, changing no state, and their hidden states are not the
        model's. Given kv_len, nothing here reads the device on the host but for a `checked`
        cache (a CPU's): the same call, recorded once, serves a step of its shape at every
        position.
        Returns logits [batch, seq (1 with last_only, r with logits_at), vocab] (float32) and
        the requested layers' outputs [batch, seq, hidden]. tree: a token tree's verification
        pass, as `Transformer.forward` takes it, of a chain (the root and the spine) and leaves
        beside it (`spine_of`: a `tree.SpineTree`'s shape); its chain keeps every state, and
        `HybridCache.compact` puts an accepted leaf's in place."""
        t = tokens.shape[1]
        last = None if logits_at is None else logits_at.max()
        if kv_len is None:
            kv_len = int(positions[0, -1]) + 1
        if tree is not None:
            tree.check(tokens)
        slots = cache.slots(positions, last) if tree is None else cache.tree_slots(positions, tree)
        if cache.checked:  # (a tree's leaves write no slot of the rings)
            cache.begin(int(positions[0, 0]), t if tree is None else slots.leaves.chain,
                        None if last is None else int(last) + 1)
        x = self.embed(tokens)  # [batch, seq, hidden]: the residual stream
        rope = positions if tree is None else tree.rope_positions(positions)
        cos, sin = rope_cos_sin(rope, self.inv_freq, x.dtype)
        mask = attention_mask(positions, kv_len, x.dtype,
                              None if tree is None else tree.visible(positions, kv_len))
        hidden = [x] if 0 in hidden_layers else []
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, positions, mask, cache, i, kv_len, slots, self.kernel_config)
            if i + 1 in hidden_layers:
                hidden.append(x)
        if logits_at is not None:
            x = x.index_select(1, logits_at)
        elif last_only:
            x = x[:, -1:]
        logits = kernels.linear(self.norm(x), self.lm_head, self.kernel_config)
        return logits.float(), hidden

