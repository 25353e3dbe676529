"""CUDA-graph steps: the bucketed kv_len they rely on (CPU), eager fallback (CPU), and graph
replay giving exactly the eager engine's greedy output (GPU)."""
from __future__ import annotations

import pytest
import torch

from flashdraft.config import ModelConfig
from flashdraft.backends.cuda_graphs import (PREFILL_GRAPH_MAX, StepRunner, eager_step, prefill,
                                    prefill_length)
from flashdraft.kv_cache import KVCache
from flashdraft.tools.shapes import build_random_model

from .tiny import build_model

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = ModelConfig("qwen3", 300, 64, 160, 2, 4, 2, 16, qk_norm=True)


def _model(device="cpu", dtype=torch.float32, cfg=TINY):
    model = build_random_model(cfg, dtype, device, seed=3)
    with torch.no_grad():  # N(0, 0.02) is near-uniform at this size: sharpen it
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10)
    return model


@torch.inference_mode()
def test_static_kv_len_bucket_matches_the_exact_length():
    """Attention over a rounded-up kv_len reads masked positions only: same logits."""
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (1, 40))
    exact, bucket = KVCache.for_model(TINY, 1, 512, torch.float32, "cpu"), \
        KVCache.for_model(TINY, 1, 512, torch.float32, "cpu")
    bucket.k.normal_()  # garbage beyond the written positions must not matter
    bucket.v.normal_()
    pos = torch.arange(40).unsqueeze(0)
    a, _ = model(tokens, pos, exact, kv_len=40)
    b, _ = model(tokens, pos, bucket, kv_len=256)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    step = torch.randint(0, TINY.vocab_size, (1, 3))
    pos = torch.arange(40, 43).unsqueeze(0)
    a, _ = model(step, pos, exact, kv_len=43)
    b, _ = model(step, pos, bucket, kv_len=256)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_step_runner_on_cpu_is_the_eager_model_bit_for_bit():
    model = _model()
    runner = StepRunner(model, "cpu")
    assert not runner.enabled
    c1 = KVCache.for_model(TINY, 1, 256, torch.float32, "cpu")
    c2 = KVCache.for_model(TINY, 1, 256, torch.float32, "cpu")
    tokens = torch.randint(0, TINY.vocab_size, (1, 7))
    a, ha = runner(tokens, 0, c1, hidden_layers=(0, 2))
    b, hb = model(tokens, torch.arange(7).unsqueeze(0), c2, kv_len=7, hidden_layers=(0, 2))
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ha, hb))
    assert runner.stats.eager_calls == 1 and runner.stats.replays == 0


def test_engine_and_drafter_stay_eager_on_cpu(tmp_path):
    from flashdraft import LLM, SamplingParams
    build_model(tmp_path / "t", "qwen2", seed=0)
    llm = LLM(str(tmp_path / "t"), draft=str(tmp_path / "t"), device="cpu")
    assert llm.engine.runner is None and llm.drafter.runner is None
    out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.token_ids) == 8


def test_prefill_length_rounds_up_to_a_few_lengths_within_the_cache():
    cache = KVCache.for_model(TINY, 1, 768, torch.float32, "cpu")
    assert [prefill_length(t, cache) for t in (1, 16, 17, 33, 200, 256, 257, 600, 768)] == \
        [16, 16, 32, 64, 256, 256, 512, 768, 768]  # powers of two, then multiples of 256
    big = KVCache.for_model(TINY, 1, 2100, torch.float32, "cpu")
    assert [prefill_length(t, big) for t in (769, 1025, 1900, 2048)] == [1024, 1280, 2048, 2048]
    assert len({prefill_length(t, big) for t in range(1, 2049)}) == 12
    big = KVCache.for_model(TINY, 1, PREFILL_GRAPH_MAX + 512, torch.float32, "cpu")
    assert prefill_length(PREFILL_GRAPH_MAX, big) == PREFILL_GRAPH_MAX
    assert prefill_length(PREFILL_GRAPH_MAX + 1, big) == PREFILL_GRAPH_MAX + 1  # eager, unpadded


@torch.inference_mode()
@pytest.mark.parametrize("t", [5, 20, 45])  # the small-step path (<= 32 tokens) and SDPA's
def test_a_padded_prefill_computes_the_prompts_results(t):
    """Padding a prompt (as a GPU prefill does) changes neither the last real token's logits,
    nor the cache at the prompt's positions, nor the decode steps that follow: the padding's
    keys and values lie past the prompt, masked until a step overwrites them."""
    model = _model()
    n = 64
    tokens = torch.randint(1, TINY.vocab_size, (1, t))
    plain, padded = (KVCache.for_model(TINY, 1, 256, torch.float32, "cpu") for _ in range(2))
    a, ha = eager_step(model, tokens, 0, plain, hidden_layers=(0, 1), last_only=True)
    ids = torch.cat([tokens, torch.zeros(1, n - t, dtype=torch.long)], dim=1)
    b, hb = eager_step(model, ids, 0, padded, hidden_layers=(0, 1),
                       logits_at=torch.tensor([t - 1]))
    assert b.shape == a.shape
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for x, y in zip(ha, hb):
        torch.testing.assert_close(y[:, :t], x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.kv[:, :, :, :, :t], plain.kv[:, :, :, :, :t],
                               rtol=1e-5, atol=1e-5)
    assert not torch.equal(padded.kv[:, :, :, :, t:n], plain.kv[:, :, :, :, t:n])  # the padding's
    for start in (t, t + 1):  # a decode step, then a verification of 3, over the padding
        step = torch.randint(0, TINY.vocab_size, (1, 1 if start == t else 3))
        a, _ = eager_step(model, step, start, plain)
        b, _ = eager_step(model, step, start, padded)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_prefill_refuses_an_empty_prompt():
    cache = KVCache.for_model(TINY, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="at least one token"):
        prefill(_model(), [], cache)


@torch.inference_mode()
def test_prefill_on_a_cpu_runs_the_prompt_unpadded():
    model = _model()
    c1, c2 = (KVCache.for_model(TINY, 1, 256, torch.float32, "cpu") for _ in range(2))
    prompt = torch.randint(0, TINY.vocab_size, (7,)).tolist()
    a, ha = prefill(model, prompt, c1, (1,), StepRunner(model, "cpu"), "cpu")
    b, hb = model(torch.tensor([prompt]), torch.arange(7)[None], c2, kv_len=7, hidden_layers=(1,),
                  last_only=True)
    assert torch.equal(a, b) and torch.equal(ha[0], hb[0]) and torch.equal(c1.kv, c2.kv)


@gpu
@needs_cuda
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_match_the_eager_padded_prefill_bit_for_bit(dtype):
    """One graph per padded length serves every prompt that rounds to it; its logits, hidden
    states and cache equal the eager prefill's at the same padded shape exactly (graphs on and
    off give the same tokens), and the real tokens' results match an unpadded prefill."""
    model = _model("cuda", dtype)
    runner = StepRunner(model, "cuda")
    graph_cache, eager_cache, plain_cache = (
        KVCache.for_model(TINY, 1, 512, dtype, "cuda") for _ in range(3))
    for t in (3, 12, 40, 50, 200, 129, 250, 300):
        prompt = torch.randint(0, TINY.vocab_size, (t,)).tolist()
        a, ha = prefill(model, prompt, graph_cache, (1,), runner, "cuda")
        b, hb = prefill(model, prompt, eager_cache, (1,), None, "cuda")
        assert a.shape == b.shape == (1, 1, TINY.vocab_size) and ha[0].shape == hb[0].shape
        assert torch.equal(a, b) and torch.equal(ha[0], hb[0]), t
        n = prefill_length(t, graph_cache)
        assert torch.equal(graph_cache.kv[..., :n, :], eager_cache.kv[..., :n, :]), t
        c, _ = model(torch.tensor([prompt], device="cuda"), torch.arange(t, device="cuda")[None],
                     plain_cache, kv_len=t, last_only=True)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(a, c, rtol=tol, atol=tol)
    # lengths 3, 12 -> 16; 40, 50 -> 64; 200, 129, 250 -> 256; 300 -> 512
    assert runner.stats.captures == 4 and runner.stats.replays == 8


@gpu
@needs_cuda
@torch.inference_mode()
def test_graph_steps_match_eager_steps_on_gpu():
    model = _model("cuda")
    runner = StepRunner(model, "cuda", kv_bucket=64)
    c1 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    c2 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    start = 0
    for t in (5, 1, 1, 3, 4, 1, 17, 2):
        tokens = torch.randint(0, TINY.vocab_size, (1, t), device="cuda")
        a, ha = runner(tokens, start, c1, hidden_layers=(1,))
        pos = torch.arange(start, start + t, device="cuda").unsqueeze(0)
        b, hb = model(tokens, pos, c2, kv_len=start + t, hidden_layers=(1,))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ha[0], hb[0], rtol=1e-4, atol=1e-4)
        start += t
    assert runner.stats.replays == 8 and runner.stats.eager_calls == 0
    # A new cache (new addresses) drops the graphs and captures again.
    c3 = KVCache.for_model(TINY, 1, 512, torch.float32, "cuda")
    runner(torch.zeros(1, 1, dtype=torch.long, device="cuda"), 0, c3)
    assert len(runner._graphs) == 1


@gpu
@needs_cuda
@torch.inference_mode()
def test_a_padded_catch_up_computes_the_real_tokens_results():
    """StepRunner.catch_up: the logits of the last real token and the real tokens' keys and
    values as an unpadded eager step gives them, whatever the padding writes past them; a
    catch-up longer than CATCH_UP_MAX, or whose padding would pass the cache's end, runs eager."""
    from flashdraft.backends.cuda_graphs import CATCH_UP_MAX

    model = _model("cuda")
    runner = StepRunner(model, "cuda", kv_bucket=64)
    c1 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    c2 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    start = 0
    for t in (7, 3, 1, 5, 17, 40, CATCH_UP_MAX + 1, 9):
        tokens = torch.randint(0, TINY.vocab_size, (1, t), device="cuda")
        a, _ = runner.catch_up(tokens, start, c1)
        b, _ = eager_step(model, tokens, start, c2, last_only=True)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        end = start + t
        torch.testing.assert_close(c1.k[:, :, :, :end], c2.k[:, :, :, :end], rtol=1e-4, atol=1e-4)
        start = end
    assert runner.stats.eager_calls == 1  # the one past CATCH_UP_MAX
    c3 = KVCache.for_model(TINY, 1, 64, torch.float32, "cuda")
    runner.catch_up(torch.zeros(1, 5, dtype=torch.long, device="cuda"), 58, c3)  # 58 + 8 > 64
    assert runner.stats.eager_calls == 2


@gpu
@needs_cuda
@torch.inference_mode()
def test_greedy_verification_inside_the_graph_matches_it_after_an_eager_step():
    """The packed greedy result a verification graph computes in its replay ([n, next token,
    drafts]) is what verify_greedy gives on the eager step's logits, for each n."""
    from flashdraft.verify import greedy_result, verify_greedy

    model = _model("cuda")
    runner = StepRunner(model, "cuda", kv_bucket=64)
    c1 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    c2 = KVCache.for_model(TINY, 1, 256, torch.float32, "cuda")
    prompt = torch.randint(0, TINY.vocab_size, (1, 9), device="cuda")
    for cache in (c1, c2):
        model(prompt, torch.arange(9, device="cuda").unsqueeze(0), cache, kv_len=9)
    pos = torch.arange(9, 14, device="cuda").unsqueeze(0)
    seen = set()
    for right in range(5):  # drafts that follow the target's own argmax for `right` tokens
        step = torch.randint(0, TINY.vocab_size, (1, 5), device="cuda")
        for j in range(min(right, 4)):
            step[0, j + 1] = model(step, pos, c2, kv_len=14)[0][0, j].argmax()
        logits_e = model(step, pos, c2, kv_len=14)[0]
        n_e, next_e = verify_greedy(step[:, 1:], logits_e)
        logits_g, _, packed = runner(step, 9, c1, post=greedy_result)
        torch.testing.assert_close(logits_g, logits_e, rtol=1e-4, atol=1e-4)
        assert packed.tolist() == [int(n_e), int(next_e)] + step[0, 1:].tolist()
        seen.add(int(n_e))
    assert len(seen) > 1
    assert runner.stats.captures == 1 and runner.stats.replays == 5


def _generate_both(llm, prompts, params, **kw):
    """Greedy outputs with graphs, then with the eager path of the same LLM."""
    with_graphs = [o.token_ids for o in llm.generate(prompts, params, **kw)]
    runners = llm.engine.runner, getattr(llm.drafter, "runner", None)
    assert runners[0] is not None and runners[0].stats.replays > 0
    llm.engine.runner = None
    if runners[1] is not None:
        llm.drafter.runner = None
    try:
        eager = [o.token_ids for o in llm.generate(prompts, params, **kw)]
    finally:
        llm.engine.runner = runners[0]
        if runners[1] is not None:
            llm.drafter.runner = runners[1]
    return with_graphs, eager


PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Hello, world!"]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft", [None, "model", "ngram"])
def test_llm_greedy_output_is_identical_with_and_without_graphs(tmp_path, dtype, draft):
    from flashdraft import LLM, SamplingParams
    build_model(tmp_path / "t", "qwen3", seed=0)
    build_model(tmp_path / "d", "qwen3", seed=1)
    draft_ref = {None: None, "model": str(tmp_path / "d"), "ngram": "ngram"}[draft]
    llm = LLM(str(tmp_path / "t"), draft=draft_ref, device="cuda", dtype=dtype,
              num_speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for k in (1, 4):
        graphs, eager = _generate_both(llm, PROMPTS, params, num_speculative_tokens=k)
        assert graphs == eager, f"k={k}"
    if draft == "model":
        assert llm.drafter.runner.stats.replays > 0


@gpu
@needs_cuda
def test_speculative_with_graphs_equals_plain_decoding(tmp_path):
    """Losslessness on the graph path: greedy speculative == greedy plain (fp32)."""
    from flashdraft import LLM, SamplingParams
    build_model(tmp_path / "t", "qwen2", seed=0)
    build_model(tmp_path / "d", "qwen2", seed=1)
    llm = LLM(str(tmp_path / "t"), draft=str(tmp_path / "d"), device="cuda", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = [o.token_ids for o in llm.generate(PROMPTS, params)]
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, draft=None)]
    assert spec == plain
