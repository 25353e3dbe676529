"""Checkpoints as users hold them: sharded safetensors, and hub ids found in the local cache."""
import shutil

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
