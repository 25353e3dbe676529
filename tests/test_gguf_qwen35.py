"""Qwen3.5 hybrid GGUF files (llama.cpp's qwen35): tiny random models converted the way
llama.cpp's converter does it load to the model their safetensors directory loads to, and the
files flashdraft cannot run are refused by name (fp32, CPU)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from safetensors.torch import load_file

from flashdraft.loading import load_config, load_model
from flashdraft.loading.gguf import GGUFError, load_gguf
from tests.test_gguf import add_tokenizer, finish
from tests.tiny import build_qwen35

pytestmark = pytest.mark.usefixtures("one_thread")

LIN, FULL = "linear_attention", "full_attention"


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tiled(t: torch.Tensor, dim: int, k_heads: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads along `dim` from grouped by
    key head to tiled (v0 of every key head, then v1, ...)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, -1, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(shape)


def _converted(name: str, t: torch.Tensor, cfg: dict) -> tuple[str, torch.Tensor]:
    """One checkpoint tensor as llama.cpp's converter writes it (conversion/qwen.py):
    _LinearAttentionVReorderBase.modify_tensors, then Qwen3NextModel.modify_tensors."""
    k, v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if k != v and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:2 * k * dk], _tiled(t[2 * k * dk:], 0, k, dv)])
        elif ".in_proj_z." in name:
            t = _tiled(t, 0, k, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _tiled(t, 0, k, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            t = _tiled(t.unsqueeze(-1), 0, k, 1).squeeze(-1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:2 * k * dk], _tiled(t[2 * k * dk:], 0, k, dv)])
        elif ".out_proj." in name:
            t = _tiled(t, 1, k, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def write_qwen35_gguf(hf_dir: Path, out: Path, *, interval: int | None = None,
                      weight_type: Q = Q.F32, mtp: bool = False, arch: str = "qwen35",
                      drop: tuple[str, ...] = (), rename: dict[str, str] | None = None,
                      extra: tuple[str, ...] = ()) -> Path:
    """Convert a tiny Qwen3.5 checkpoint (text-only) to GGUF as convert_hf_to_gguf.py's
    Qwen3_5TextModel does: the qwen35 tensor names and metadata, the tensors changed as
    `_converted` says. interval: full_attention_interval (the converter's default: the
    config's, else 4); mtp: one multi-token prediction block after the decoder's. drop, rename,
    extra: GGUF tensors left out, renamed, or added (zeros), to damage the file."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers + mtp)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(interval or cfg.get("full_attention_interval", 4))
    rotary = int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"])
    w.add_rope_dimension_count(rotary)
    w.add_rope_dimension_sections([rotary // 2, 0, 0, 0])  # _Qwen35MRopeMixin writes some
    if mtp:
        w.add_nextn_predict_layers(1)
    add_tokenizer(w, hf_dir, "gpt-2")

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, layers + mtp)
    tensors = {}
    for hf_name, t in load_file(hf_dir / "model.safetensors").items():
        hf_name, t = _converted(hf_name, t.float(), cfg)
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = t.numpy()
    if mtp:  # its own block, as Qwen35MtpMixin names it; flashdraft does not run it
        for key in ("nextn.eh_proj.weight", "attn_norm.weight", "attn_q.weight"):
            tensors[f"blk.{layers}.{key}"] = np.zeros((4, 8), np.float32)
    for name in drop:
        del tensors[name]
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    for name in extra:
        tensors[name] = np.zeros((4, 8), np.float32)
    block = GGML_QUANT_SIZES[weight_type][0]
    for name, x in tensors.items():
        # rows shorter than a block (the convolution's taps) stay float, as the converter's do
        if x.ndim == 2 and weight_type != Q.F32 and x.shape[1] % block == 0:
            w.add_tensor(name, gguf.quants.quantize(x, weight_type), raw_dtype=weight_type)
        else:
            w.add_tensor(name, x)
    return finish(w, out)


CASES = {  # name -> (build_qwen35 keyword arguments, write_qwen35_gguf's)
    "hybrid": (dict(seed=1), dict(mtp=True)),
    # a full-attention layer every 2nd, tied embeddings (no output.weight)
    "every-2nd": (dict(seed=2, tie=True, layer_types=(LIN, FULL, LIN, FULL)), dict(interval=2)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF directory, GGUF file converted from it)."""
    root = tmp_path_factory.mktemp("gguf_qwen35")
    out = {}
    for name, (build, write) in CASES.items():
        hf_dir = build_qwen35(root / name, **build)
        out[name] = hf_dir, write_qwen35_gguf(hf_dir, root / f"{name}.gguf", **write)
    return out


@pytest.mark.parametrize("name", CASES)
def test_tensors_equal_the_safetensors_checkpoint(converted, name):
    """Every tensor under its checkpoint name and layout; exactly, but for the values the
    converter computed on (1 + w, -exp(A_log)), which come back within float32's rounding."""
    hf_dir, path = converted[name]
    _, state, _ = load_gguf(path)
    expected = load_file(hf_dir / "model.safetensors")
    assert state.keys() == expected.keys()
    for k, want in expected.items():
        got = state[k]
        assert got.dtype == torch.float32 and got.shape == want.shape, k
        if k.endswith(("A_log", "layernorm.weight", "model.norm.weight", "q_norm.weight",
                       "k_norm.weight")):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), k
        else:
            assert torch.equal(got, want), k


@pytest.mark.parametrize("name", CASES)
def test_config_equals_the_safetensors_checkpoints(converted, name):
    hf_dir, path = converted[name]
    fields = [f.name for f in dataclasses.fields(load_config(str(hf_dir)))
              if f.name != "eos_token_ids"]  # a GGUF adds its vocabulary's end-of-turn tokens
    got, want = load_config(str(path)), load_config(str(hf_dir))
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_the_safetensors_checkpoints(converted, name):
    """A prefill (the chunked rule), decode steps and a verification-sized step: the logits
    of the model loaded from the GGUF file against the one loaded from safetensors."""
    hf_dir, path = converted[name]
    models = [load_model(str(p), torch.float32, "cpu").model for p in (hf_dir, path)]
    torch.manual_seed(0)
    ids = torch.randint(0, models[0].cfg.vocab_size, (1, 70 + 4 + 5))
    logits = []
    with torch.no_grad():
        for model in models:
            cache = model.new_cache(1, 128, torch.float32, "cpu", steps=5)
            steps = [(0, 70)] + [(70 + i, 1) for i in range(4)] + [(74, 5)]
            logits.append(torch.cat([model(ids[:, s:s + t], torch.arange(s, s + t)[None],
                                           cache)[0] for s, t in steps], dim=1))
    # The norms come back exactly as the model uses them (1 + ((1 + w) - 1) rounds to 1 + w);
    # A_log through -exp and log, within float32's rounding.
    assert rel_err(logits[1], logits[0]) <= 1e-6


def test_a_quantized_file_loads_through_the_quantized_path(converted, tmp_path):
    """Q8_0 matrices, each dequantized as it loads (lazy), then int8 weight-only."""
    hf_dir, _ = converted["hybrid"]
    path = write_qwen35_gguf(hf_dir, tmp_path / "q8.gguf", weight_type=Q.Q8_0)
    got = load_model(str(path), torch.float32, "cpu", quantization="int8").model
    want = load_model(str(hf_dir), torch.float32, "cpu").model
    ids = torch.randint(0, want.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        a, _ = got(ids, torch.arange(12)[None], got.new_cache(1, 64, torch.float32, "cpu"))
        b, _ = want(ids, torch.arange(12)[None], want.new_cache(1, 64, torch.float32, "cpu"))
    assert rel_err(a, b) <= 0.2


# ---- files flashdraft cannot run ------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid_dir(converted):
    return converted["hybrid"][0]


def test_a_missing_tensor_is_named(hybrid_dir, tmp_path):
    path = write_qwen35_gguf(hybrid_dir, tmp_path / "m.gguf", drop=("blk.2.ssm_a",))
    with pytest.raises(GGUFError, match=r"m.gguf: tensor 'blk.2.ssm_a' is missing \(layer 2 is "
                                        r"a linear_attention layer"):
        load_gguf(path)


def test_an_unsupported_layer_type_is_refused(hybrid_dir, tmp_path):
    """A layer of another kind of linear attention (Kimi Linear's per-part convolutions)."""
    path = write_qwen35_gguf(hybrid_dir, tmp_path / "m.gguf",
                             rename={"blk.1.ssm_conv1d.weight": "blk.1.ssm_conv1d_q.weight"})
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.ssm_conv1d_q.weight' is of a layer type "
                                        r"flashdraft does not run; a qwen35 layer is one of "
                                        r"full_attention, linear_attention"):
        load_gguf(path)


def test_layers_off_the_interval_are_refused(hybrid_dir, tmp_path):
    """Layer types are the interval's (as llama.cpp reads them); tensors that say otherwise are
    a file flashdraft would run wrongly."""
    path = write_qwen35_gguf(hybrid_dir, tmp_path / "m.gguf", interval=2)
    with pytest.raises(GGUFError, match=r"layer 1 holds linear_attention tensors .*"
                                        r"full_attention_interval=2 makes it a full_attention"):
        load_gguf(path)


@pytest.mark.parametrize("arch, extra, what", [
    ("qwen35moe", (), "architecture 'qwen35moe'"),
    ("qwen3next", (), "architecture 'qwen3next'"),
    ("qwen35", ("blk.0.ffn_gate_exps.weight",), "tensor 'blk.0.ffn_gate_exps.weight'"),
])
def test_a_mixture_of_experts_is_refused(hybrid_dir, tmp_path, arch, extra, what):
    path = write_qwen35_gguf(hybrid_dir, tmp_path / "moe.gguf", arch=arch, extra=extra)
    with pytest.raises(GGUFError, match=f"moe.gguf is a mixture-of-experts model \\({what}\\); "
                                        f"MoE is not supported"):
        load_gguf(path)
