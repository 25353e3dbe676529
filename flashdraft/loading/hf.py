"""Hugging Face checkpoints: a local directory, or a hub id found in the local hub cache.

There is no download here: a model that is not on disk is an error that lists where we
looked. Tensors are renamed onto our fused layout (wqkv, w_gate_up) by `to_ours`, which the
GGUF loader shares.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch


def resolve_hf(ref: str) -> Path:
    """A directory holding config.json: `ref` itself, or the hub cache's snapshot of `ref`."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory but has no config.json; a model "
                                    "directory needs config.json, *.safetensors and tokenizer "
                                    "files")
        return path
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file but not a .gguf file; pass a .gguf file or a "
                                f"model directory (config.json, *.safetensors, tokenizer files)")
    looked = [f"{path} (no such file or directory)"]
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")) and not path.exists():
        from huggingface_hub import constants, snapshot_download
        try:
            return Path(snapshot_download(ref, local_files_only=True))
        except Exception:  # any failure means: not in the cache
            looked.append(f"the Hugging Face cache {constants.HF_HUB_CACHE} (no snapshot of {ref})")
    raise FileNotFoundError(
        f"model {ref!r} was not found. Looked in: " + "; ".join(looked) + ". flashdraft does "
        "not download weights: pass a local directory, a .gguf file, a hub id already in "
        "the Hugging Face cache, or an example alias such as example:qwen2.5-coder-1.5b "
        "(see `flashdraft models list`).")


def read_hf(path: Path, dtype: torch.dtype, lazy: bool = False
            ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json with the generation config's eos, {name: tensor in dtype}); lazy: {name: a
    function that reads that tensor}, so that a loader holds one tensor at a time."""
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors files (other weight formats "
                                f"are not supported; convert them to safetensors)")
    generation = path / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            config["generation_eos_token_id"] = eos
    state = {}
    for f in files:
        handle = safe_open(f, framework="pt")
        for name in handle.keys():
            read = functools.partial(_read, handle, name, dtype)
            state[name] = read if lazy else read()
    return config, state


def _read(handle, name: str, dtype: torch.dtype) -> torch.Tensor:
    return handle.get_tensor(name).to(dtype)


def our_sources(names, num_layers: int) -> dict[str, list[str]]:
    """Our parameter names -> the Hugging Face tensors (of `names`) each is made of; several
    are joined along rows (q/k/v, gate/up)."""
    embed = "model.embed_tokens.weight"
    out = {"embed.weight": [embed], "norm.weight": ["model.norm.weight"],
           "lm_head.weight": ["lm_head.weight" if "lm_head.weight" in names else embed]}
    for i in range(num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        out[us + "attn.wqkv.weight"] = [attn + f"{x}_proj.weight" for x in "qkv"]
        if attn + "q_proj.bias" in names:
            out[us + "attn.wqkv.bias"] = [attn + f"{x}_proj.bias" for x in "qkv"]
        out[us + "attn.wo.weight"] = [attn + "o_proj.weight"]
        for norm in ("q_norm", "k_norm"):
            if attn + norm + ".weight" in names:
                out[us + f"attn.{norm}.weight"] = [attn + norm + ".weight"]
        out[us + "mlp.w_gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        out[us + "mlp.w_down.weight"] = [hf + "mlp.down_proj.weight"]
        out[us + "attn_norm.weight"] = [hf + "input_layernorm.weight"]
        out[us + "mlp_norm.weight"] = [hf + "post_attention_layernorm.weight"]
    return out


def to_ours(state: dict[str, torch.Tensor], num_layers: int,
            sources: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> ours, fusing q/k/v and gate/up (sources: the mapping, if
    not the dense decoder's `our_sources`)."""
    sources = our_sources(state, num_layers) if sources is None else sources
    return {ours: state[src[0]] if len(src) == 1 else torch.cat([state[s] for s in src])
            for ours, src in sources.items()}


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return AutoTokenizer.from_pretrained(path)
