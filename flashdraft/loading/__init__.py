"""Load a model from whatever the user names: a HF directory, a hub id, a .gguf file, or an alias."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer, rope_frequencies
from .hf import load_tokenizer, read_hf, resolve_hf, to_ours


# Tokens that end a turn in the common chat formats. llama.cpp stops on any of them that a
# GGUF vocabulary holds (its "end of generation" set), whatever the file's single eos id says;
# a GGUF user expects the same here. (A HF directory says it in generation_config.json.)
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                     "<end_of_turn>", "<|end_of_text|>")


@dataclass
class Loaded:
    config: ModelConfig
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerFast
    source: str  # the file or directory the weights came from


def load_model(ref: str, dtype: torch.dtype, device: torch.device) -> Loaded:
    from ..models import resolve

    ref = resolve(ref)
    if str(ref).endswith(".gguf"):
        from .gguf import load_gguf

        hf_config, state, tokenizer = load_gguf(ref, dtype, device)
        source = str(Path(ref).resolve())
        vocab = tokenizer.get_vocab()
        hf_config["generation_eos_token_id"] = [vocab[t] for t in END_OF_GENERATION if t in vocab]
    else:
        path = resolve_hf(ref)
        hf_config, state = read_hf(path, dtype)
        tokenizer = load_tokenizer(path)
        source = str(path)
    config = ModelConfig.from_hf(hf_config)
    eos = set(config.eos_token_ids)
    extra = hf_config.get("generation_eos_token_id")
    eos.update(extra if isinstance(extra, list) else [] if extra is None else [extra])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    config = ModelConfig(**{**config.__dict__, "eos_token_ids": tuple(sorted(eos))})
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(to_ours(state, config.num_layers), assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_frequencies(config)
    model = model.to(device).eval()
    return Loaded(config, model, tokenizer, source)
