"""Qwen3.5 checkpoints' tensor names onto the hybrid decoder's (`flashdraft.hybrid`).

A text-only checkpoint names its decoder `model.*`; a multimodal one (the released Qwen3.5
models) `model.language_model.*`, next to a vision tower (`model.visual.*`) and, in some, a
multi-token prediction head (`mtp.*`), neither of which is read.
"""
from __future__ import annotations

from ..config import ModelConfig

MULTIMODAL_PREFIX = "model.language_model."


def hybrid_sources(names, cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter names -> the checkpoint tensors (of `names`) each is made of, joined along
    rows where there are several (q/k/v; the DeltaNet's qkv/z/b/a; gate/up). A tensor that
    the configuration needs and `names` lacks is an error that names it and its layer."""
    prefix = (MULTIMODAL_PREFIX if any(n.startswith(MULTIMODAL_PREFIX) for n in names)
              else "model.")
    embed = prefix + "embed_tokens.weight"
    out = {"embed.weight": [embed], "norm.weight": [prefix + "norm.weight"],
           "lm_head.weight": ["lm_head.weight" if "lm_head.weight" in names else embed]}
    for i, kind in enumerate(cfg.layer_types):
        hf, us = f"{prefix}layers.{i}.", f"layers.{i}."
        if kind == "linear_attention":
            a, d = hf + "linear_attn.", us + "deltanet."
            out[d + "w_in.weight"] = [a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
            out[d + "conv"] = [a + "conv1d.weight"]
            out[d + "A_log"] = [a + "A_log"]
            out[d + "dt_bias"] = [a + "dt_bias"]
            out[d + "norm_weight"] = [a + "norm.weight"]
            out[d + "w_out.weight"] = [a + "out_proj.weight"]
        else:
            a, d = hf + "self_attn.", us + "attn."
            out[d + "wqkv.weight"] = [a + f"{x}_proj.weight" for x in "qkv"]
            if cfg.qkv_bias:
                out[d + "wqkv.bias"] = [a + f"{x}_proj.bias" for x in "qkv"]
                out[d + "wo.bias"] = [a + "o_proj.bias"]
            out[d + "wo.weight"] = [a + "o_proj.weight"]
            out[d + "q_norm.weight"] = [a + "q_norm.weight"]
            out[d + "k_norm.weight"] = [a + "k_norm.weight"]
        out[us + "mlp.w_gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        out[us + "mlp.w_down.weight"] = [hf + "mlp.down_proj.weight"]
        out[us + "attn_norm.weight"] = [hf + "input_layernorm.weight"]
        out[us + "mlp_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    for ours, src in out.items():
        for name in src:
            if name not in names:
                where = (f" (layer {ours.split('.')[1]} is a "
                         f"{cfg.layer_types[int(ours.split('.')[1])]} layer in layer_types)"
                         if ours.startswith("layers.") else "")
                raise ValueError(f"the checkpoint has no tensor {name!r}{where}: it does not "
                                 f"match its config.json; check that the files are complete")
    return out
