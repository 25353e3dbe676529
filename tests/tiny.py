"""Tiny random checkpoints in Hugging Face format, built by the tests themselves.

A byte-level BPE tokenizer of a few hundred tokens with a ChatML template, and Llama / Qwen2 /
Qwen3 models of two layers saved as safetensors, so that our loader, transformers (the
reference) and the engine all read the same files.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "投机解码是一种加速大语言模型推理的方法。",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _tokenizer_into(out: Path, tokenizer_from: str | Path | None):
    """Make `out` and save a tokenizer there: a new tiny one, or the one at tokenizer_from."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        return build_tokenizer(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.save_pretrained(out)
    return tokenizer


def build_model(out: str | Path, arch: str = "qwen2", seed: int = 0, *, layers: int = 2,
                hidden: int = 64, heads: int = 4, kv_heads: int = 2, tie: bool = False,
                rope_scaling: dict | None = None, tokenizer_from: str | Path | None = None,
                dtype=torch.float32, max_positions: int = 512, layer_std: float = 0.12) -> Path:
    """Save a random `arch` model with our tiny tokenizer to `out`; returns `out`. layer_std:
    the spread of the layers' matrices (small: the next token depends mostly on the last one,
    so greedy output soon cycles, text a drafter can learn in seconds)."""
    import transformers

    out = Path(out)
    tokenizer = _tokenizer_into(out, tokenizer_from)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        if rope_scaling:
            rope = {**rope_scaling, "rope_theta": 500000.0}
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 1000000.0})
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=hidden // heads,
                                       rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1000000.0})
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    # Random init gives near-uniform logits; larger weights give peaked, varied distributions,
    # which exercise acceptance and rejection far better.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else layer_std)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:  # norm weights
                p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out


def save_config_json(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def random_dflash(cfg, seed: int = 0, scale: float = 0.12):
    """A DFlashModel of `cfg` (drafters.dflash.DFlashConfig) with random weights, scaled as
    build_model's so that its logits are peaked and varied."""
    from flashdraft.drafters.dflash import DFlashModel

    torch.manual_seed(seed)
    model = DFlashModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
            else:
                p.uniform_(0.8, 1.2)
    return model.eval()


def build_dflash_drafter(out: str | Path, target: str | Path, seed: int = 0, *, layers: int = 1,
                         block_size: int = 4, target_layer_ids: tuple[int, ...] = (0,),
                         mask_token_id: int | None = None, **extra) -> Path:
    """Save a random DFlash drafter for the tiny model at `target` to `out`, in the public
    format (config.json with dflash_config, model.safetensors); returns `out`. extra: the
    optional dflash_config fields (input_embedding_scale, output_multiplier, ...)."""
    from flashdraft.config import ModelConfig
    from flashdraft.drafters.dflash import DFlashConfig, save_dflash

    t = save_config_json(target)
    layers_cfg = ModelConfig.from_hf({**t, "model_type": "qwen3", "num_hidden_layers": layers,
                                      "tie_word_embeddings": False})
    cfg = DFlashConfig(layers=layers_cfg, num_target_layers=t["num_hidden_layers"],
                       target_layer_ids=tuple(target_layer_ids), block_size=block_size,
                       mask_token_id=t["vocab_size"] - 1 if mask_token_id is None
                       else mask_token_id, **extra)
    return save_dflash(random_dflash(cfg, seed), out)


def build_qwen35(out: str | Path, seed: int = 0, *,
                 layer_types: tuple[str, ...] = ("linear_attention", "linear_attention",
                                                 "linear_attention", "full_attention"),
                 hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 tokenizer_from: str | Path | None = None, tie: bool = False,
                 multimodal: bool = False, layer_std: float = 0.12) -> Path:
    """Save a random Qwen3.5 hybrid (transformers' qwen3_5 classes) with our tiny tokenizer to
    `out`; returns `out`. multimodal: as the released checkpoints are, a
    Qwen3_5ForConditionalGeneration (a one-block vision tower, the decoder under
    model.language_model); else a Qwen3_5ForCausalLM."""
    import transformers

    out = Path(out)
    tokenizer = _tokenizer_into(out, tokenizer_from)
    text = transformers.Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
        tie_word_embeddings=tie, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    if multimodal:
        vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64,
                                                  num_heads=2, out_hidden_size=hidden)
        cfg = transformers.Qwen3_5Config(text_config=text.to_dict(),
                                         vision_config=vision.to_dict(), tie_word_embeddings=tie)
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(text)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):  # decays exp(g) spread over (0, 1)
                p.copy_(torch.empty_like(p).uniform_(0.1, 2.0).log())
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # the output norm's plain w
                p.uniform_(0.8, 1.2)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else
                          0.3 if "conv1d" in name else layer_std)
            else:  # the zero-centred norm weights (scales 1 + w)
                p.uniform_(-0.2, 0.2)
    model.save_pretrained(out)
    return out
