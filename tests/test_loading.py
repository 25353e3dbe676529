"""Checkpoints as users hold them: sharded safetensors, and hub ids found in the local cache."""
import shutil

import pytest
import torch
import transformers

from flashdraft import LLM


def test_sharded_checkpoint_loads_like_a_single_file(tiny_models, tmp_path):
    src = tiny_models["qwen3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{src}/{f}", sharded / f)
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a = LLM(src, device="cpu").target.model.state_dict()
    b = LLM(str(sharded), device="cpu").target.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hub_id_resolves_from_the_local_cache(tiny_models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen2"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_models["qwen2"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    llm = LLM("tiny-org/tiny-qwen2", device="cpu")
    assert llm.target.source == str(snapshot)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied", "qwen3"])
def test_quantized_while_loading_equals_quantized_after(tiny_models, arch):
    """load_model(quantization=...) quantizes each matrix as it arrives (the device never holds
    the full-precision model); the result is quantize_model's of the model loaded in full
    (int8: the tiny models are too narrow for int4's groups of 128), with its norms not folded
    (a quantized load does not fold them)."""
    from flashdraft.backends import quant
    from flashdraft.loading import load_model

    mode = "int8"
    streamed = load_model(tiny_models[arch], torch.float32, "cpu", mode).model
    unfolded = load_model(tiny_models[arch], torch.float32, "cpu", fold_norms=False).model
    whole = quant.quantize_model(unfolded, mode)
    a, b = dict(streamed.named_buffers()), dict(whole.named_buffers())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    pa, pb = dict(streamed.named_parameters()), dict(whole.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert isinstance(streamed.lm_head, quant.QuantLinear)
    assert not any(p.is_meta for p in streamed.parameters())


def test_unknown_quantization_is_refused_before_loading(tiny_models):
    from flashdraft.loading import load_model

    with pytest.raises(ValueError, match="int4"):
        load_model(tiny_models["qwen2"], torch.float32, "cpu", "int3")


@pytest.mark.parametrize("draft_quantization, expected", [("auto", True), ("none", False),
                                                          ("int8", True)])
def test_draft_model_is_quantized_as_asked(tiny_models, draft_quantization, expected):
    """A draft model takes the target's quantization unless told otherwise; either way greedy
    speculation returns the tokens of plain decoding."""
    from flashdraft import SamplingParams
    from flashdraft.backends import quant

    llm = LLM(tiny_models["qwen2"], draft=tiny_models["qwen2"], device="cpu",
              quantization="int8" if draft_quantization != "int8" else None,
              draft_quantization=draft_quantization)
    drafter = llm.drafter.model
    assert isinstance(drafter.layers[0].mlp.w_gate_up, quant.QuantLinear) == expected
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate(["def add(a, b):"], params, draft=None)[0].token_ids
    assert llm.generate(["def add(a, b):"], params)[0].token_ids == plain


def test_unknown_draft_quantization_is_refused(tiny_models):
    with pytest.raises(ValueError, match="draft_quantization 'int3'"):
        LLM(tiny_models["qwen2"], device="cpu", draft_quantization="int3")
