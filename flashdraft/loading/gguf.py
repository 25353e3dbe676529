"""GGUF files (llama.cpp's format) -> a Hugging Face style config, state dict and tokenizer.

The `gguf` package parses the file; `dequant.py` turns the weights into float tensors; the
tokenizer is rebuilt with the `tokenizers` library from the vocabulary and merges in the
metadata. Everything comes back under Hugging Face names and layouts, so the rest of the
engine loads a GGUF file exactly like a safetensors directory.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
    pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from flashdraft.loading.dequant import SUPPORTED_TYPES, dequantize


class GGUFError(ValueError):
    """A GGUF file flashdraft cannot load; the message names the file, the problem and a way out."""


# general.architecture (llama.cpp's name) -> (config.json's model_type, architectures[0])
_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
          "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen35": ("qwen3_5", "Qwen3_5ForCausalLM")}
# Mixture-of-experts architectures of the same families, refused by name; any other file
# holding expert tensors (`_EXPERT_TENSORS`) or an expert count is refused too.
_MOE_ARCHS = ("qwen2moe", "qwen3moe", "qwen3next", "qwen35moe")
_EXPERT_TENSORS = ("ffn_gate_inp", "_exps", "_shexp")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3 checkpoints carry their rope scaling as per-frequency divisors instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"

# tokenizer.ggml.pre (llama.cpp's name for the pre-tokenizer) -> the split regex of the Hugging
# Face tokenizer (None: GPT-2's own, built into ByteLevel), NFC normalisation, ignore_merges.
_PRE_TOKENIZERS = {
    "gpt-2": (None, False, False),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", False, True),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", True, False),
    # Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words (llama.cpp's
    # LLAMA_VOCAB_PRE_TYPE_QWEN35, which quotes it from the tokenizer.json); NFC as Qwen2's
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", True, False),
}


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", lazy: bool = False
              ) -> tuple[dict, dict[str, torch.Tensor], PreTrainedTokenizerFast]:
    """Read a llama / qwen2 / qwen3 / qwen35 (the Qwen3.5 hybrid) GGUF file; returns
    (hf_config, state_dict, tokenizer).

    hf_config is shaped like the model's config.json; state_dict holds Hugging Face names and
    [out_features, in_features] weights dequantized to `dtype` on `device` (a GPU dequantizes
    far faster: each tensor's bytes are copied there first); tokenizer is rebuilt from the
    metadata. lazy: the state dict's values are functions that dequantize their tensor, so
    that a loader holds one at a time. Raises GGUFError for a file it cannot load.
    """
    path = Path(path)
    reader = _open(path)
    arch = _meta(path, reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    _refuse_moe(path, reader, arch, tensors)
    if arch not in _ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; flashdraft runs "
                        f"{', '.join(_ARCHS)}")
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise GGUFError(
                f"{path}: tensor {t.name} is quantized as {t.tensor_type.name}, which flashdraft "
                f"cannot dequantize; supported types: {supported}. Use a file quantized with "
                f"one of those (e.g. Q4_K_M or Q8_0)")
    config = _config(path, reader, arch, tensors)
    if arch == "qwen35":
        from .gguf_qwen35 import hybrid_layout

        fields, hf_names, transform = hybrid_layout(path, reader, tensors, config)
        config.update(fields)
    else:
        hf_names = {name: _hf_name(path, name) for name in tensors if name != _ROPE_FREQS}
        transform = functools.partial(_dense_transform, arch, config)
    tokenizer = _tokenizer(path, reader, config["max_position_embeddings"])

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        w = dequantize(torch.from_numpy(_raw(t)).to(device), t.tensor_type, _shape(t))
        return transform(hf_names[name], w).to(dtype)

    if lazy:
        return config, {hf_names[name]: functools.partial(load, name) for name in hf_names}, \
            tokenizer
    weights = _map_tensors(load, list(hf_names), device)
    state_dict = {hf_names[name]: weights[name] for name in hf_names}
    return config, state_dict, tokenizer


def _refuse_moe(path: Path, reader: gguf.GGUFReader, arch: str, tensors: dict) -> None:
    """Refuse a mixture-of-experts file, by its architecture, expert count or tensors."""
    experts = next((n for n in tensors if any(e in n for e in _EXPERT_TENSORS)), None)
    count = _meta(path, reader, f"{arch}.expert_count", 0)
    if arch in _MOE_ARCHS or experts or count:
        what = (f"architecture {arch!r}" if arch in _MOE_ARCHS else
                f"tensor {experts!r}" if experts else f"{arch}.expert_count={count}")
        raise GGUFError(f"{path} is a mixture-of-experts model ({what}); MoE is not supported: "
                        f"flashdraft runs the dense {', '.join(_ARCHS)} architectures (of "
                        f"Qwen3.5, the dense qwen35 models)")


def _dense_transform(arch: str, config: dict, hf_name: str, w: torch.Tensor) -> torch.Tensor:
    """A llama / qwen2 / qwen3 tensor as the checkpoint holds it: llama's q / k unpermuted."""
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rope(w, config["num_attention_heads"])
    if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rope(w, config["num_key_value_heads"])
    return w


def _map_tensors(load, names: list[str], device) -> dict[str, torch.Tensor]:
    """{name: load(name)}; on CPU, whole tensors in parallel, one thread each.

    torch's own threading splits every op of every chunk across the cores and makes the
    threads meet after each; on a shared machine one descheduled thread stalls the others.
    Threads that each dequantize their own tensors never wait for one another: on a busy
    2-core box the 1.5B example loaded in 21-23 s this way, 80-140 s the other.
    """
    if torch.device(device).type != "cpu":
        return {name: load(name) for name in names}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # read by each new thread when it first runs an op
    try:
        with ThreadPoolExecutor(threads) as pool:
            return dict(zip(names, pool.map(load, names)))
    finally:
        torch.set_num_threads(threads)


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its buffer once per string of the vocabulary (~300k times for Qwen's);
    on an np.memmap each slice pays numpy's memmap bookkeeping, which took 14 s of a 1.5B
    model's load. A plain view of the same mapping parses in about a third of that.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap):
        self._data = mapped.view(np.ndarray)


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                        f"give a .gguf file or a Hugging Face model directory")
    try:
        # Copy-on-write mapping: torch can wrap the pages without a read-only warning, and
        # nothing is ever written back to the file.
        return _Reader(path, mode="c")
    except Exception as e:  # the reader fails with whatever numpy raises on short data
        raise GGUFError(f"{path} ({path.stat().st_size} bytes) is truncated or corrupted: the "
                        f"GGUF reader failed with {type(e).__name__}: {e}. Download the file "
                        f"again and check its SHA-256") from None


def _meta(path: Path, reader: gguf.GGUFReader, key: str, default=...):
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"{path}: metadata key {key!r} is missing; the file was not written "
                            f"by llama.cpp's converter or is damaged")
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # Print-shortest float32, so 1e-6 reads back as 1e-06 and not 9.999999974752427e-07.
        value = float(str(np.float32(value)))
    return value


def _raw(t) -> np.ndarray:
    """The tensor's bytes in file order, [n_bytes] uint8 (no copy)."""
    return t.data.reshape(-1).view(np.uint8)


def _shape(t) -> tuple[int, ...]:
    return tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dimensions fastest first


def _hf_name(path: Path, name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise GGUFError(f"{path}: unexpected tensor {name!r}; flashdraft knows the llama / qwen2 / "
                    f"qwen3 / qwen35 layouts only, so this file is a variant it cannot run")


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q / k (rotate-half -> interleaved rope pairs).

    w: [n_heads * head_dim, ...]. The converter reorders each head's rows (x0..x_{d/2-1},
    y0..y_{d/2-1}) into (x0, y0, x1, y1, ...); reading them as [head, d/2, 2] and swapping
    the last two axes puts them back.
    """
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]) \
        .transpose(1, 2).reshape(w.shape)


def _config(path: Path, reader: gguf.GGUFReader, arch: str, tensors: dict) -> dict:
    def meta(key, default=...):
        return _meta(path, reader, f"{arch}.{key}", default)

    def shape(name):
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing; the file is incomplete")
        return _shape(tensors[name])

    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    vocab, hidden = shape("token_embd.weight")
    # Any layer's k rows: a hybrid's first layers have no attention, and its q rows hold a gate
    attn_k = next((n for n in tensors if n.endswith(".attn_k.weight")), "blk.0.attn_k.weight")
    model_type, architecture = _ARCHS[arch]
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        # the multi-token prediction layers a converter may append are not the decoder's
        "num_hidden_layers": meta("block_count") - meta("nextn_predict_layers", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta("attention.key_length", None) or shape(attn_k)[0] // kv_heads,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensors),
        "bos_token_id": _meta(path, reader, "tokenizer.ggml.bos_token_id", None),
    }
    config["rope_scaling"] = _rope_scaling(path, reader, arch, tensors, config)
    # llama.cpp stops on any end-of-generation token; Llama 3 instruct models end turns with
    # eot (<|eot_id|>) and tool calls with eom, so the HF configs list them all as eos.
    eos = [_meta(path, reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    return config


def _rope_scaling(path: Path, reader: gguf.GGUFReader, arch: str, tensors: dict,
                  config: dict) -> dict | None:
    kind = _meta(path, reader, f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        raise GGUFError(f"{path}: rope scaling {kind!r} is not supported (flashdraft supports "
                        f"Llama 3's, stored as a rope_freqs tensor)")
    if _ROPE_FREQS not in tensors:
        return None
    t = tensors[_ROPE_FREQS]
    divisors = dequantize(_raw(t), t.tensor_type, _shape(t))  # [head_dim // 2]
    # The converter stores only the divisors; Llama 3.x all use low/high_freq_factor 1 / 4
    # and an original context of 8192, so take those, read the factor off the lowest
    # frequency, and refuse the file if the divisors say otherwise.
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings":
            _meta(path, reader, f"{arch}.rope.scaling.original_context_length", 8192),
    }
    if scaling["factor"] == 1.0:
        return None
    expected = _llama3_rope_divisors(config["rope_theta"], config["head_dim"], scaling)
    if not torch.allclose(divisors, expected, rtol=1e-4):
        raise GGUFError(f"{path}: the rope_freqs tensor does not match Llama 3 rope scaling "
                        f"with factor {scaling['factor']}, low/high_freq_factor 1 / 4 and "
                        f"original context {scaling['original_max_position_embeddings']}; "
                        f"load the model's Hugging Face directory instead")
    return scaling


def _llama3_rope_divisors(theta: float, head_dim: int, s: dict) -> torch.Tensor:
    """What llama.cpp's converter writes to rope_freqs for Llama 3 scaling, [head_dim // 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / freqs
    ctx = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    smooth = (ctx / wavelen - low) / (high - low)
    ramp = 1 / ((1 - smooth) / s["factor"] + smooth)
    out = torch.where(wavelen > ctx / low, torch.tensor(s["factor"]), ramp)
    return torch.where(wavelen < ctx / high, torch.tensor(1.0), out)


def _tokenizer(path: Path, reader: gguf.GGUFReader, max_length: int) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer described by tokenizer.ggml.*, as Hugging Face builds it."""
    def meta(key, default=...):
        return _meta(path, reader, f"tokenizer.ggml.{key}", default)

    kind = meta("model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model is {kind!r}; flashdraft reads byte-level "
                        f"BPE tokenizers ('gpt2': Llama 3, Qwen2/2.5, Qwen3, Qwen3.5) only. Load "
                        f"the model's Hugging Face directory instead")
    pre = meta("pre", None)
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{path}: pre-tokenizer (tokenizer.ggml.pre) {pre!r} is unknown to "
                        f"flashdraft, which knows {', '.join(map(repr, _PRE_TOKENIZERS))}; load "
                        f"the model's Hugging Face directory instead")
    split, nfc, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = meta("tokens")
    types = meta("token_type", [gguf.TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ")) for m in meta("merges")]

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>, ...) are special; user-defined ones (<tool_call>) are plain
    # added tokens. Both are matched whole before pre-tokenization, as in the HF tokenizer.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == gguf.TokenType.USER_DEFINED])

    def token(key):
        i = meta(f"{key}_token_id", None)
        return None if i is None else tokens[i]

    bos = token("bos")
    if meta("add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, meta("bos_token_id"))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("eos"), pad_token=token("padding"),
        unk_token=token("unknown"), model_max_length=max_length,
        chat_template=_meta(path, reader, "tokenizer.chat_template", None))
