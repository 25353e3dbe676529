"""Qwen3.5 hybrid GGUF files (`general.architecture` "qwen35") -> the Hugging Face names,
layouts and config fields that `qwen35.hybrid_sources` reads.

What llama.cpp writes, as its converter (conversion/qwen.py: Qwen3NextModel,
_LinearAttentionVReorderBase, Qwen3_5TextModel) and its loader (llama-model.cpp, LLM_ARCH_QWEN35)
do it, each undone here:

- Names: gguf-py's QWEN35 tensor map. A DeltaNet layer's in_proj_qkv / in_proj_z / in_proj_b /
  in_proj_a / conv1d / norm / out_proj are attn_qkv / attn_gate / ssm_beta / ssm_alpha /
  ssm_conv1d / ssm_norm / ssm_out; A_log is `ssm_a` (no .weight); dt_bias is renamed
  dt_proj.bias first, so it is `ssm_dt.bias`; post_attention_layernorm is post_attention_norm.
- Values: A_log is stored as -exp(A_log); every RMSNorm weight but the DeltaNet's output norm
  (linear_attn.norm) as 1 + w; conv1d squeezed to [conv_dim, kernel].
- Where linear_num_value_heads > linear_num_key_heads, the value heads are reordered from
  grouped by key head (k0: v0 … v_{r-1}, k1: …) to tiled (v0 of every key head, then v1, …),
  so that ggml broadcasts the key heads: the V rows of in_proj_qkv and of conv1d, the rows of
  in_proj_z, in_proj_a, in_proj_b, the entries of A_log and dt_bias, the columns of out_proj.
- Unchanged: the gated attention's q_proj (q and its gate interleaved by head; llama.cpp
  declares attn_q as 2 · heads · head_dim rows), k / v / o_proj, the MLP.
- Metadata (Qwen3NextModel.set_gguf_parameters): ssm.conv_kernel = linear_conv_kernel_dim,
  ssm.state_size = linear_key_head_dim, ssm.group_count = linear_num_key_heads,
  ssm.time_step_rank = linear_num_value_heads, ssm.inner_size = linear_value_head_dim ·
  linear_num_value_heads, full_attention_interval, rope.dimension_count = head_dim ·
  partial_rotary_factor, attention.key_length = head_dim. Layer i is full attention where
  (i + 1) % full_attention_interval == 0 (4 where the key is absent), as llama.cpp reads it:
  the file cannot say any other layout, so a layer whose tensors disagree is refused.
- Multi-token prediction layers (`nextn_predict_layers`) are the last blocks of block_count;
  they are not read.

Where this reads more than llama.cpp does: the value head dimension is ssm.inner_size /
ssm.time_step_rank (llama.cpp's loader takes ssm.state_size for keys and values alike), and
the rotary share is rope.dimension_count / head_dim, whatever the converter's default (0.25)
for a config that keeps partial_rotary_factor under rope_parameters.

Assumed rather than found in those sources: rope. llama.cpp runs Qwen3.5 with interleaved
M-RoPE (rope.dimension_sections); with text alone every section sees the same position, which
is plain half-split rope over rope.dimension_count dimensions, as `hybrid.partial_rope` does,
so the sections are not read.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import torch

from .gguf import GGUFError, _meta, _shape

# blk.{i}.<key> -> model.layers.{i}.<value>, by the layer type that holds it
_COMMON = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MIXERS = {
    "full_attention": {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                       "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                       "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "linear_attention": {"attn_qkv": "linear_attn.in_proj_qkv",
                         "attn_gate": "linear_attn.in_proj_z",
                         "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                         "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                         "ssm_out": "linear_attn.out_proj", "ssm_a": "linear_attn.A_log",
                         "ssm_dt": "linear_attn.dt_bias"},
}
_LAYER = {**_COMMON, **_MIXERS["full_attention"], **_MIXERS["linear_attention"]}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# The GGUF names whose Hugging Face name takes no .weight / .bias of its own
_BARE = {("ssm_a", ""): "", ("ssm_dt", "bias"): ""}
# Stored as 1 + w (the converter's `norm.weight` rule, linear_attn.norm excepted)
_PLUS_ONE = ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")


def hybrid_layout(path: Path, reader: gguf.GGUFReader, tensors: dict, config: dict
                  ) -> tuple[dict, dict[str, str], "_Transform"]:
    """A qwen35 file's hybrid config fields (to add to `config`, the dense fields read from
    the same file), {GGUF tensor name: Hugging Face name} for the decoder's tensors, and
    transform(hf_name, w) that undoes the converter's change of each. Raises GGUFError for a
    layer that is not one of the two types, or a tensor missing or of neither."""
    def meta(key, default=...):
        return _meta(path, reader, f"qwen35.{key}", default)

    layers = config["num_hidden_layers"]
    interval = meta("full_attention_interval", 4)
    if interval < 1:
        raise GGUFError(f"{path}: qwen35.full_attention_interval is {interval}; it must be >= 1")
    kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
             for i in range(layers)]
    v_heads = meta("ssm.time_step_rank")
    fields = {
        "layer_types": kinds,
        "linear_num_key_heads": meta("ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": meta("ssm.state_size"),
        "linear_value_head_dim": meta("ssm.inner_size") // v_heads,
        "linear_conv_kernel_dim": meta("ssm.conv_kernel"),
        "partial_rotary_factor": meta("rope.dimension_count") / config["head_dim"],
        "attn_output_gate": True,
    }
    names = {}
    for name in tensors:
        hf = _hf_name(path, name, kinds)
        if hf is not None:
            names[name] = hf
    _check_layers(path, tensors, kinds, interval, config, fields)
    return fields, names, _Transform(fields)


def _hf_name(path: Path, name: str, kinds: list[str]) -> str | None:
    """The Hugging Face name of GGUF tensor `name`; None for a multi-token prediction layer's."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) < 3 or not parts[1].isdigit():
        raise GGUFError(f"{path}: unexpected tensor {name!r}; flashdraft knows the qwen35 "
                        f"layout of Qwen3.5 (gated attention and Gated DeltaNet layers) only")
    if int(parts[1]) >= len(kinds):
        return None
    i, key, suffix = int(parts[1]), parts[2], ".".join(parts[3:])
    tail = _BARE.get((key, suffix))
    if tail is None and key not in ("ssm_a", "ssm_dt") and suffix in ("weight", "bias"):
        tail = f".{suffix}"
    if key not in _LAYER or tail is None:
        types = "; ".join(f"{kind}: {', '.join(t)}" for kind, t in _MIXERS.items())
        raise GGUFError(f"{path}: tensor {name!r} is of a layer type flashdraft does not run; a "
                        f"qwen35 layer is one of {', '.join(_MIXERS)} ({types})")
    return f"model.layers.{i}.{_LAYER[key]}{tail}"


def _required(key: str) -> str:
    """blk.{i}.<key> with the suffix that llama.cpp's loader asks for."""
    return {"ssm_a": "ssm_a", "ssm_dt": "ssm_dt.bias"}.get(key, f"{key}.weight")


def _check_layers(path: Path, tensors: dict, kinds: list[str], interval: int, config: dict,
                  fields: dict) -> None:
    """Each layer holds the tensors of its type, and none of the other's."""
    for i, kind in enumerate(kinds):
        other = next(k for k in _MIXERS if k != kind)
        found = sorted(n for n in tensors if n.startswith(f"blk.{i}.")
                       and n.split(".")[2] in _MIXERS[other])
        if found:
            raise GGUFError(
                f"{path}: layer {i} holds {other} tensors ({', '.join(found[:3])}), but "
                f"qwen35.full_attention_interval={interval} makes it a {kind} layer (layer i "
                f"is full attention where (i + 1) % {interval} == 0, as llama.cpp reads the "
                f"file); this file's layers do not follow that pattern, and llama.cpp's "
                f"converter cannot write one that does not")
        for key in (*_COMMON, *_MIXERS[kind]):
            name = f"blk.{i}.{_required(key)}"
            if name not in tensors:
                raise GGUFError(f"{path}: tensor {name!r} is missing (layer {i} is a {kind} "
                                f"layer: qwen35.full_attention_interval={interval}); the file "
                                f"is incomplete")
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    conv = (2 * fields["linear_num_key_heads"] * fields["linear_key_head_dim"]
            + fields["linear_num_value_heads"] * fields["linear_value_head_dim"])
    expected = {  # in the first layer of each type, the shapes that the metadata gives
        "full_attention": ("attn_q.weight", (2 * heads * head_dim, config["hidden_size"]),
                           f"q and its output gate for {heads} heads of {head_dim}; flashdraft "
                           f"runs Qwen3.5's gated attention only"),
        "linear_attention": ("ssm_conv1d.weight", (conv, fields["linear_conv_kernel_dim"]),
                             "as the qwen35.ssm.* metadata gives it"),
    }
    for kind, (key, shape, why) in expected.items():
        if kind in kinds:
            name = f"blk.{kinds.index(kind)}.{key}"
            if _shape(tensors[name]) != shape:
                raise GGUFError(f"{path}: {name} has shape {_shape(tensors[name])}, not {shape} "
                                f"({why})")


class _Transform:
    """transform(hf_name, w): the checkpoint's tensor from the file's (float32)."""

    def __init__(self, fields: dict):
        self.k_heads = fields["linear_num_key_heads"]
        self.group = fields["linear_num_value_heads"] // self.k_heads
        self.key_dim = self.k_heads * fields["linear_key_head_dim"]
        self.dv = fields["linear_value_head_dim"]

    def __call__(self, hf_name: str, w: torch.Tensor) -> torch.Tensor:
        if hf_name.endswith(_PLUS_ONE):
            return w - 1
        if hf_name.endswith("A_log"):
            w = torch.log(-w)
        elif hf_name.endswith("conv1d.weight"):
            w = w.unsqueeze(1)  # [conv_dim, 1, kernel], as F.conv1d takes it
        if self.group == 1 or ".linear_attn." not in hf_name:
            return w
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk, v = w[:2 * self.key_dim], w[2 * self.key_dim:]
            return torch.cat([qk, self._grouped(v, 0, self.dv)])
        if hf_name.endswith("in_proj_z.weight"):
            return self._grouped(w, 0, self.dv)
        if hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return self._grouped(w, 0, 1)
        if hf_name.endswith("out_proj.weight"):
            return self._grouped(w, 1, self.dv)
        return w

    def _grouped(self, w: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """Value heads along `dim` from tiled order ([group, k_heads, head_dim]) back to
        grouped by key head ([k_heads, group, head_dim])."""
        shape = list(w.shape)
        tiled = w.reshape(*shape[:dim], self.group, self.k_heads, head_dim, *shape[dim + 1:])
        return tiled.transpose(dim, dim + 1).reshape(shape)
