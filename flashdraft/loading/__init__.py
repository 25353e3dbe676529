"""Load a model from whatever the user names: a HF directory, a hub id, a .gguf file, or an
alias."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..backends import kernels
from ..config import KernelConfig, ModelConfig
from ..hybrid import HybridTransformer
from ..model import Transformer, rope_frequencies
from .hf import load_tokenizer, our_sources, read_hf, resolve_hf, to_ours
from .qwen35 import hybrid_sources


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


def read_model(ref: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               lazy: bool = False) -> tuple[ModelConfig, dict, object, str]:
    """The model `ref` names, as read from its files: (its config, with every id that ends a
    generation among eos_token_ids; its state dict in the checkpoint's names, each value a
    function that reads the tensor if lazy; its tokenizer; the file or directory read)."""
    from .examples import resolve

    ref = resolve(ref)
    if str(ref).endswith(".gguf"):
        from .gguf import load_gguf

        hf_config, state, tokenizer = load_gguf(ref, dtype, device, lazy=lazy)
        source = str(Path(ref).resolve())
        vocab = tokenizer.get_vocab()
        hf_config["generation_eos_token_id"] = [vocab[t] for t in END_OF_GENERATION if t in vocab]
    else:
        path = resolve_hf(ref)
        hf_config, state = read_hf(path, dtype, lazy=lazy)
        tokenizer = load_tokenizer(path)
        source = str(path)
    config = ModelConfig.from_hf(hf_config)
    eos = set(config.eos_token_ids)
    extra = hf_config.get("generation_eos_token_id")
    eos.update(extra if isinstance(extra, list) else [] if extra is None else [extra])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    config = ModelConfig(**{**config.__dict__, "eos_token_ids": tuple(sorted(eos))})
    return config, state, tokenizer, source


def load_model(ref: str, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None,
               kernel_config: KernelConfig = kernels.DEFAULT, fold_norms: bool = True) -> Loaded:
    """The model `ref` names, in dtype on device; with quantization ("int8", "int4") its
    matrices weight-only quantized as they load (see `_load_quantized`). kernel_config: how
    its steps run (`Transformer.kernel_config`). fold_norms: an unquantized model's RMSNorm
    weights folded into the products after them (`Transformer.fold_norms`; False keeps them,
    e.g. to quantize the model afterwards with `quant.quantize_model`)."""
    if quantization is not None:
        from ..backends.quant import MODES

        if quantization not in MODES:
            raise ValueError(f"quantization {quantization!r} is not one of {', '.join(MODES)}")
    config, state, tokenizer, source = read_model(ref, dtype, device,
                                                  lazy=quantization is not None)
    with torch.device("meta"):
        model = model_class(config)(config, kernel_config)
    if quantization is not None:
        _load_quantized(model, config, state, device, quantization)
    else:
        model.load_state_dict(to_ours(state, config.num_layers, checkpoint_sources(state, config)),
                              assign=True, strict=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        if fold_norms:
            model.fold_norms()
    model.inv_freq = rope_frequencies(config)
    model = model.to(device).eval()
    return Loaded(config, model, tokenizer, source)


def model_class(config: ModelConfig) -> type[Transformer] | type[HybridTransformer]:
    """The decoder that runs `config`'s architecture."""
    return HybridTransformer if config.arch == "qwen3_5" else Transformer


def checkpoint_sources(names, config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter names -> the checkpoint tensors each is made of, for `config`'s decoder."""
    if config.arch == "qwen3_5":
        return hybrid_sources(names, config)
    return our_sources(names, config.num_layers)


def load_config(ref: str) -> ModelConfig:
    """The configuration of the model `ref` names (a path, hub id in the cache, .gguf file or
    alias), without reading its weights."""
    return read_model(ref, lazy=True)[0]


def _load_quantized(model: Transformer, config: ModelConfig, state: dict, device,
                    mode: str) -> None:
    """Fill the meta-device `model` from `state` ({name: function reading the tensor}) one
    module at a time, each matrix quantized (`quant.QuantLinear`) as soon as it is on the
    device: the device never holds more than the quantized model and one matrix in full
    precision, so a model whose full-precision weights would not fit (27B on a 24 GB card)
    loads. A tied output head gets its own quantized copy; the embedding stays as it is. The
    result is `quant.quantize_model(mode)` of the model loaded in full, its norms not folded
    (`Transformer.fold_norms`: unquantized models only)."""
    from ..backends.quant import quantize_linear

    sources = checkpoint_sources(state, config)
    if config.tie_word_embeddings:
        del sources["lm_head.weight"]
    by_module: dict[str, dict[str, list[str]]] = {}
    for name, src in sources.items():
        module, _, param = name.rpartition(".")
        by_module.setdefault(module, {})[param] = src
    for name, params in by_module.items():
        module = model.get_submodule(name)
        for param, src in params.items():
            parts = [state[s]().to(device) for s in src]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
            setattr(module, param, nn.Parameter(tensor, requires_grad=False))
            del parts, tensor
        if type(module) is nn.Linear:
            _replace(model, name, quantize_linear(name, module, mode,
                                                  kernel_config=model.kernel_config))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        _replace(model, "lm_head", quantize_linear("lm_head", model.lm_head, mode,
                                                   kernel_config=model.kernel_config))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint has no tensors for {', '.join(missing[:5])}")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
