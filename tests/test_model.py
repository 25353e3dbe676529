"""Our logits against transformers' on the same tiny checkpoints (fp32)."""
import pytest
import torch
import transformers

from flashdraft import LLM
from flashdraft.kv_cache import KVCache

ARCHS = ["llama", "qwen2", "qwen3", "llama3-scaled", "qwen2-tied"]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_models, arch, device):
    path = tiny_models[arch]
    llm = LLM(path, device=device, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    # Long enough that the scaled rope differs from the plain one (original context 32).
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)
    assert len(ids) > 40
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        want = ref(x).logits
        cache = KVCache.for_model(llm.target.config, 1, 128, torch.float32, device)
        n = len(ids) - 6
        # Prefill all but the last 6 tokens, then decode them one at a time through the cache,
        # then once more re-verify 3 positions (overwriting, as after a rejected draft).
        got, _ = llm.target.model(x[:, :n], torch.arange(n, device=device)[None], cache)
        assert rel_err(got, want[:, :n]) <= 1e-4
        for i in range(n, len(ids)):
            step, _ = llm.target.model(x[:, i:i + 1], torch.tensor([[i]], device=device), cache)
            assert rel_err(step, want[:, i:i + 1]) <= 1e-4
        again, _ = llm.target.model(x[:, n:n + 3], torch.arange(n, n + 3, device=device)[None],
                                    cache)
        assert rel_err(again, want[:, n:n + 3]) <= 1e-4


def test_long_steps_from_zero_and_after_a_prefix_match_transformers(tiny_models, device):
    """More than SMALL_T tokens go through SDPA: from position 0 with its own causal mask,
    after cached positions with the explicit mask."""
    from flashdraft import model as model_module

    path = tiny_models["qwen3"]
    llm = LLM(path, device=device, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    ids = llm.tokenizer.encode("for i in range(10):\n    print(i * i)\n" * 8)
    assert len(ids) > 2 * model_module.SMALL_T + 10
    x = torch.tensor([ids], device=device)
    n = model_module.SMALL_T + 3
    with torch.no_grad():
        want = ref(x).logits
        cache = KVCache.for_model(llm.target.config, 1, 256, torch.float32, device)
        first, _ = llm.target.model(x[:, :n], torch.arange(n, device=device)[None], cache)
        rest, _ = llm.target.model(x[:, n:], torch.arange(n, len(ids), device=device)[None], cache)
    assert rel_err(first, want[:, :n]) <= 1e-4
    assert rel_err(rest, want[:, n:]) <= 1e-4


def test_hidden_states_match_transformers(tiny_models, device):
    path = tiny_models["qwen3"]
    llm = LLM(path, device=device, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    ids = torch.tensor([llm.tokenizer.encode("hello world, how are you")], device=device)
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True).hidden_states
        cache = KVCache.for_model(llm.target.config, 1, 64, torch.float32, device)
        pos = torch.arange(ids.shape[1], device=device)[None]
        _, hidden = llm.target.model(ids, pos, cache, hidden_layers=(0, 1))
        _, none = llm.target.model(ids, pos, cache)
    assert none == []
    assert rel_err(hidden[0], want[0]) <= 1e-5
    assert rel_err(hidden[1], want[1]) <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_plain_greedy_equals_transformers_generate(tiny_models, arch, device):
    from flashdraft import SamplingParams

    path = tiny_models[arch]
    llm = LLM(path, device=device, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    for prompt in ["def add(a, b):", "The quick brown fox"]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        ids = torch.tensor([out.prompt_token_ids], device=device)
        want = ref.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24,
                            attention_mask=torch.ones_like(ids))
        assert out.token_ids == want[0, ids.shape[1]:].tolist()
        assert out.finish_reason == "length"


def test_folding_the_norms_keeps_the_logits():
    """Transformer.fold_norms moves each block's norm weights into the product after the norm:
    the same function (float32: the same logits to rounding), with those norms' weights ones."""
    from flashdraft.config import ModelConfig
    from flashdraft.model import Transformer

    # intermediate 2050: w_gate_up has 4100 rows, more than fold_norms' slice of 4096
    cfg = ModelConfig(arch="qwen2", vocab_size=90, hidden_size=64, intermediate_size=2050,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        p.data.normal_(1.0, 0.5) if name.endswith("norm.weight") else p.data.normal_(0, 0.2)
    tokens, pos = torch.randint(0, 90, (1, 12)), torch.arange(12)[None]
    run = lambda: model(tokens, pos, KVCache.for_model(cfg, 1, 16, torch.float32, "cpu"))[0]
    with torch.no_grad():
        before = run()
        model.fold_norms()
        after = run()
    assert model.norms_folded
    assert all(torch.equal(b.attn_norm.weight, torch.ones(64)) for b in model.layers)
    assert not torch.equal(model.norm.weight, torch.ones(64))  # the final norm stays
    assert rel_err(after, before) <= 1e-5
