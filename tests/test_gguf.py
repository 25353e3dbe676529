"""GGUF loading: dequantization against the `gguf` package's reference, tiny GGUF files
converted from safetensors checkpoints as llama.cpp's converter does it, and bad files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoTokenizer

import flashdraft.loading.dequant as dq
from flashdraft import LLM
from flashdraft.kv_cache import KVCache
from flashdraft.loading.gguf import GGUFError, load_gguf
from tests.tiny import build_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TEXTS = ["Hello, world! How are you today?",
         "def add(a, b):\n    return a + b\n\nprint(add(12345, 678))",
         "投机解码是一种加速大语言模型推理的方法。",
         "<|im_start|>user\nhi there<|im_end|>\n"]


# ---- dequantization ------------------------------------------------------------------------

# Byte offsets of the fp16 scales in a block of the types gguf.quants cannot quantize: random
# bytes there could be NaN, which never compares equal.
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _quantized(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid bytes of a [rows, cols] tensor of `qtype`, as the reader hands them over."""
    if qtype not in K_SCALE_OFFSETS:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(x, qtype).reshape(rows, -1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for o in K_SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, o:o + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", dq.SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(qtype, monkeypatch):
    # Small chunks, and a row count that leaves a partial last chunk, test the chunking too.
    monkeypatch.setattr(dq, "CHUNK_WEIGHTS_CPU", 2048)
    raw = _quantized(qtype, 13, 512, np.random.default_rng(int(qtype)))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    got = dq.dequantize(raw, qtype, (13, 512))
    assert got.dtype == torch.float32 and got.shape == (13, 512)
    assert torch.equal(got, expected)
    assert torch.equal(dq.dequantize(torch.from_numpy(raw), qtype, (13, 512)), expected)


def test_dequantize_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="do not hold a Q8_0 tensor"):
        dq.dequantize(np.zeros(33, np.uint8), Q.Q8_0, (32,))


# ---- tiny GGUF files converted from safetensors checkpoints --------------------------------

def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = cfg["rope_parameters"]
    dim = cfg["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = cfg.get("original_max_position_embeddings", 8192)  # top level, as there
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def finish(w: gguf.GGUFWriter, out: Path) -> Path:
    """Write the file `w` holds to `out`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tokenizer(w: gguf.GGUFWriter, tokenizer_dir: Path, pre: str) -> None:
    """The tokenizer metadata of the byte-level BPE vocabulary in `tokenizer_dir`, as
    convert_hf_to_gguf.py writes it; pre: its tokenizer.ggml.pre."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    added = tokenizer.added_tokens_decoder
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id[i] for i in range(len(by_id))]

    def token_type(i: int) -> gguf.TokenType:
        if i not in added:
            return gguf.TokenType.NORMAL
        return gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([token_type(i) for i in range(len(tokens))])
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(w, quiet=True)


def write_gguf(hf_dir: Path, out: Path, weight_type: Q = Q.F32,
               tokenizer_dir: Path | None = None) -> Path:
    """Convert a tiny HF checkpoint to GGUF the way llama.cpp's convert_hf_to_gguf.py does:
    its tensor names (gguf's own map), llama's q/k permutation, llama 3's rope_freqs, and the
    tokenizer metadata of a byte-level BPE vocabulary (from `tokenizer_dir`, by default the
    checkpoint's own). Matrices are stored as `weight_type`."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    # llama.cpp names the pre-tokenizer by hashing how transformers tokenizes a probe text.
    # transformers loads a qwen2 directory as Qwen2Tokenizer (Qwen2's split regex and NFC),
    # the others as tests/tiny.py saved them (GPT-2's split).
    add_tokenizer(w, tokenizer_dir or hf_dir, "qwen2" if arch == "qwen2" else "gpt-2")

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    for hf_name, t in load_file(hf_dir / "model.safetensors").items():
        x = t.float().numpy()
        if arch == "llama" and "q_proj" in hf_name:
            x = _llama_permute(x, heads)
        elif arch == "llama" and "k_proj" in hf_name:
            x = _llama_permute(x, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if x.ndim == 2 and weight_type != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(x, weight_type), raw_dtype=weight_type)
        else:
            w.add_tensor(name, x)
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors({**cfg, "head_dim": head_dim}))

    return finish(w, out)


CASES = {  # name -> build_model keyword arguments
    "llama": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(arch="qwen2", tie=True),
    "qwen3": dict(arch="qwen3"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF directory, GGUF file converted from it)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for i, (name, kwargs) in enumerate(CASES.items()):
        hf_dir = build_model(root / name, seed=i, **kwargs)
        out[name] = hf_dir, write_gguf(hf_dir, root / f"{name}.gguf")
    return out


@pytest.mark.parametrize("name", CASES)
def test_tensors_equal_the_safetensors_checkpoint(converted, name):
    hf_dir, path = converted[name]
    _, state_dict, _ = load_gguf(path)
    expected = load_file(hf_dir / "model.safetensors")
    assert state_dict.keys() == expected.keys()
    for k, v in expected.items():
        assert state_dict[k].dtype == torch.float32
        assert torch.equal(state_dict[k], v), k


@pytest.mark.parametrize("name", CASES)
def test_config_matches_config_json(converted, name):
    hf_dir, path = converted[name]
    config, _, _ = load_gguf(path)
    hf = json.loads((hf_dir / "config.json").read_text())
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"]
    assert {k: config[k] for k in keys} == {k: hf[k] for k in keys}
    assert config["head_dim"] == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    rope = hf["rope_parameters"]
    assert config["rope_theta"] == rope["rope_theta"]
    if rope["rope_type"] == "default":
        assert config["rope_scaling"] is None
    else:
        assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize("name", CASES)
def test_tokenizer_matches_the_original(converted, name):
    hf_dir, path = converted[name]
    _, _, tokenizer = load_gguf(path)
    original = AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == original.encode(text), text
        assert tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": "Write quicksort in Python."}]
    prompt = original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == prompt
    assert tokenizer.encode(prompt) == original.encode(prompt)
    assert tokenizer.eos_token_id == original.eos_token_id


@pytest.mark.parametrize("name", CASES)
def test_engine_gives_the_same_logits_from_gguf_and_safetensors(converted, name):
    hf_dir, path = converted[name]
    from_hf = LLM(model=str(hf_dir), dtype="float32", device="cpu")
    from_gguf = LLM(model=str(path), dtype="float32", device="cpu")
    ids = from_hf.tokenizer.encode(TEXTS[1] * 2)
    assert from_gguf.tokenizer.encode(TEXTS[1] * 2) == ids
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    logits = []
    with torch.no_grad():
        for llm in (from_hf, from_gguf):
            cache = KVCache.for_model(llm.target.config, 1, len(ids), torch.float32, "cpu")
            logits.append(llm.target.model(tokens, positions, cache)[0])
    assert torch.equal(logits[0], logits[1])


def test_user_defined_tokens_stay_whole(converted, tmp_path):
    hf_dir, _ = converted["llama"]
    original = AutoTokenizer.from_pretrained(hf_dir)
    original.add_tokens(["<tool_call>"])  # added but not special: llama.cpp's USER_DEFINED
    original.save_pretrained(tmp_path / "tokenizer")
    path = write_gguf(hf_dir, tmp_path / "tools.gguf", tokenizer_dir=tmp_path / "tokenizer")
    _, _, tokenizer = load_gguf(path)
    text = '<tool_call>{"name": "add"}<|im_end|>'
    ids = tokenizer.encode(text)
    assert ids == original.encode(text) and ids[0] == len(original) - 1
    assert not tokenizer.added_tokens_decoder[ids[0]].special


def test_quantized_weights_match_the_reference_dequantization(converted, tmp_path):
    hf_dir, _ = converted["qwen3"]
    path = write_gguf(hf_dir, tmp_path / "q8.gguf", weight_type=Q.Q8_0)
    _, state_dict, _ = load_gguf(path, dtype=torch.bfloat16)
    reader = gguf.GGUFReader(path)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embed.tensor_type == Q.Q8_0
    reference = torch.from_numpy(gguf.quants.dequantize(embed.data, Q.Q8_0))
    assert state_dict["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(state_dict["model.embed_tokens.weight"], reference.bfloat16())
    original = load_file(hf_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.allclose(reference, original, atol=0.02)


# ---- bad files ------------------------------------------------------------------------------

def _minimal_gguf(path: Path, arch: str, tensor_type: Q = Q.F32) -> Path:
    w = gguf.GGUFWriter(path, arch)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 256 // block_size * type_size), np.uint8),
                 raw_dtype=tensor_type)
    return finish(w, path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFError, match="model.safetensors is not a GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("damage", ["cut in the tensor data", "cut in the metadata",
                                    "metadata count overwritten"])
def test_truncated_or_corrupted_file(converted, tmp_path, damage):
    data = bytearray(converted["qwen2"][1].read_bytes())
    if damage == "cut in the tensor data":
        data = data[:len(data) // 2]
    elif damage == "cut in the metadata":
        data = data[:1000]  # the tensor data starts after ~10 KB of metadata
    else:
        data[16:24] = (2 ** 40).to_bytes(8, "little")  # after magic, version, tensor count
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="damaged.gguf .* is truncated or corrupted"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = _minimal_gguf(tmp_path / "gemma.gguf", "gemma2")
    with pytest.raises(GGUFError, match="gemma.gguf: architecture 'gemma2' is not supported; "
                                        "flashdraft runs llama, qwen2, qwen3"):
        load_gguf(path)


def test_unsupported_quantization_type(tmp_path):
    path = _minimal_gguf(tmp_path / "q2k.gguf", "qwen2", Q.Q2_K)
    with pytest.raises(GGUFError, match=r"q2k.gguf: tensor blk.0.attn_q.weight is quantized as "
                                        r"Q2_K.*supported types: F32, F16, BF16, Q8_0"):
        load_gguf(path)
