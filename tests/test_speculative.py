"""Losslessness end to end: greedy speculative output equals plain greedy output, token for
token."""
import pytest

from flashdraft import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "for i in range(10):\n    print(i)\nfor"]


@pytest.fixture(scope="module")
def target(tiny_models, device):
    return LLM(tiny_models["qwen2"], device=device, dtype="float32")


@pytest.fixture(scope="module")
def plain(target):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.token_ids for o in target.generate(PROMPTS, params, draft=None)]


def check_counts(m):
    # Every pass but the prefill commits its accepted tokens plus one; the prefill commits one.
    assert m.generated_tokens <= 1 + sum(n + 1 for n in m.accepted_per_step) + \
        (m.target_passes - 1 - len(m.accepted_per_step))
    assert m.accepted_tokens == sum(m.accepted_per_step) <= m.drafted_tokens
    assert m.tau == pytest.approx(m.generated_tokens / m.target_passes)


@pytest.mark.parametrize("drafter", ["perfect", "poor", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_plain(target, plain, tiny_models, drafter, k):
    """k drafts at every step (the cost model off: on a CPU it rightly finds that a draft model
    as large as the target never pays), and the output is plain decoding's."""
    name = {"perfect": tiny_models["qwen2"], "poor": tiny_models["qwen2-draft"],
            "ngram": "ngram"}[drafter]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    target.engine.adaptive = False
    try:
        outs = target.generate(PROMPTS, params, draft=name, num_speculative_tokens=k)
    finally:
        target.engine.adaptive = True
    for out, want in zip(outs, plain):
        assert out.token_ids == want
        assert out.finish_reason == "length"
        check_counts(out.metrics)
    if drafter == "perfect":  # everything accepted: k + 1 tokens per pass
        m = outs[0].metrics
        assert m.acceptance_rate == 1.0
        assert m.target_passes == 1 + -(-(40 - 1) // (k + 1))
    if drafter == "poor":
        assert sum(o.metrics.acceptance_rate for o in outs) / len(outs) < 0.5


@pytest.mark.parametrize("drafter", ["poor", "ngram"])
def test_adaptive_speculation_changes_no_token(target, plain, tiny_models, drafter):
    """Where drafts keep failing (a poor draft model, n-gram on a random model), the engine
    decodes stretches plainly; the tokens are plain decoding's either way, also where
    max_tokens or a stop token ends the request inside a plain stretch."""
    name = tiny_models["qwen2-draft"] if drafter == "poor" else "ngram"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    try:
        for adaptive in (True, False):
            target.engine.adaptive = adaptive
            outs = target.generate(PROMPTS, params, draft=name, num_speculative_tokens=4)
            assert [o.token_ids for o in outs] == plain
            for o in outs:
                check_counts(o.metrics)
            plain_tokens = sum(o.metrics.plain_tokens for o in outs)
            assert plain_tokens > 0 if adaptive else plain_tokens == 0
        target.engine.adaptive = True
        want = plain[2]
        for max_tokens in (2, 9, 23):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            out = target.generate(PROMPTS[2], params, draft=name, num_speculative_tokens=4)[0]
            assert out.token_ids == want[:max_tokens] and out.finish_reason == "length"
        for i in (3, 17, 31):
            if want[i] in want[:i]:
                continue
            params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[want[i]])
            out = target.generate(PROMPTS[2], params, draft=name, num_speculative_tokens=4)[0]
            assert out.token_ids == want[:i + 1] and out.finish_reason == "stop"
    finally:
        target.engine.adaptive = True


@pytest.mark.parametrize("drafter", [None, "ngram", "poor"])
def test_decode_time_ends_with_the_last_token_not_with_its_reader(target, tiny_models, drafter):
    """What the caller does with the final step (here: 1 s before closing the stream) is not
    decode time, whichever path produced that step (plain decoding run ahead, a plain stretch
    of adaptive speculation, a speculative step)."""
    from flashdraft.engine import RequestMetrics
    import time
    name = tiny_models["qwen2-draft"] if drafter == "poor" else drafter
    ids = target.encode(PROMPTS[0])[1]
    m = RequestMetrics()
    steps = target.engine.run(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                              target.get_drafter(name) if name else None, 4 if name else 0, m)
    for step in steps:
        if step.finish_reason is not None:
            time.sleep(1.0)
            steps.close()
    assert m.generated_tokens == 20 and m.decode_time_s < 0.9


@pytest.mark.parametrize("k", [3, 8])
def test_max_tokens_and_stop_token_inside_accepted_block(target, plain, tiny_models, k):
    # max_tokens that do not fall on a step boundary
    for max_tokens in (5, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = target.generate(PROMPTS[0], params, draft=tiny_models["qwen2"],
                              num_speculative_tokens=k)[0]
        assert out.token_ids == plain[0][:max_tokens] and out.finish_reason == "length"
    # A stop token that the perfect draft proposes in the middle of a block.
    want = plain[0]
    stop = next(t for i, t in enumerate(want) if i >= 4 and t not in want[:i])
    cut = want.index(stop) + 1
    for draft in (tiny_models["qwen2"], "ngram", None):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
        out = target.generate(PROMPTS[0], params, draft=draft, num_speculative_tokens=k)[0]
        assert out.token_ids == want[:cut]
        assert out.finish_reason == "stop"


def test_stop_string_and_eos(target, plain):
    text = target.tokenizer.decode(plain[1], skip_special_tokens=True)
    stop = text[8:11]
    assert stop and stop in text
    out = target.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                          draft="ngram")[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    # EOS ends generation (and is not stopped on when ignore_eos is set).
    eos_engine = target.engine
    saved = eos_engine.eos_token_ids
    eos_engine.eos_token_ids = (plain[1][6],)
    try:
        out = target.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40))[0]
        assert out.token_ids == plain[1][:plain[1].index(plain[1][6]) + 1]
        assert out.finish_reason == "stop"
    finally:
        eos_engine.eos_token_ids = saved


def test_streaming_text_equals_final_text(target):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    deltas = list(target.stream(PROMPTS[2], params, draft="ngram", num_speculative_tokens=4))
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    assert sum(len(d.token_ids) for d in deltas) == len(deltas[-1].output.token_ids) == 30


def test_text_follows_from_the_tokens_not_from_how_steps_grouped_them(target):
    """A speculative step commits several tokens at once; its text must be plain decoding's,
    one token at a time, also where a step ends in half a character (the tiny tokenizer's
    byte tokens often do) and the request ends there."""
    import random

    from flashdraft.api import Detokenizer

    rng = random.Random(0)
    vocab = target.target.config.vocab_size
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(10)]
        plain = Detokenizer(target.tokenizer)
        one_by_one = "".join(plain.add([t]) for t in ids)
        grouped, i, text = Detokenizer(target.tokenizer), 0, ""
        while i < len(ids):
            n = rng.randint(1, 4)
            text += grouped.add(ids[i:i + n])
            i += n
        assert text == grouped.text == one_by_one == plain.text


def test_sampling_is_reproducible_with_a_seed(target, tiny_models):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=20, seed=123)
    for draft in (None, "ngram", tiny_models["qwen2-draft"]):
        a = target.generate(PROMPTS[0], params, draft=draft)[0].token_ids
        b = target.generate(PROMPTS[0], params, draft=draft)[0].token_ids
        assert a == b and len(a) == 20 or a[-1] in target.engine.eos_token_ids


def test_chat_uses_the_template(target):
    out = target.chat([{"role": "user", "content": "hello"}],
                      SamplingParams(temperature=0, max_tokens=8))[0]
    text = target.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhello<|im_end|>") and text.endswith("assistant\n")


def test_plain_decoding_equals_recomputing_the_whole_sequence(target):
    """The engine's plain loop (one step ahead of the host) against greedy decoding that runs
    the whole sequence through a fresh cache for every token; a stop token ends it early."""
    import torch

    from flashdraft.backends.cuda_graphs import eager_step
    from flashdraft.kv_cache import KVCache
    model, cfg = target.engine.model, target.engine.model.cfg
    _, ids = target.encode(PROMPTS[2])
    want = list(ids)
    with torch.inference_mode():
        for _ in range(10):
            cache = KVCache.for_model(cfg, 1, 64, target.dtype, target.device)
            logits, _ = eager_step(model, torch.tensor([want], device=target.device), 0, cache)
            want.append(int(logits[0, -1].argmax()))
    out = target.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True), draft=None)[0]
    assert out.token_ids == want[len(ids):]
    assert out.metrics.target_passes == out.metrics.generated_tokens == 10
    gen = want[len(ids):]
    first = next(i for i, t in enumerate(gen) if i >= 2 and t not in gen[:i])  # a step in flight
    out = target.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=10,
                                                       stop_token_ids=[gen[first]],
                                                       ignore_eos=True), draft=None)[0]
    assert out.token_ids == gen[:first + 1] and out.finish_reason == "stop"


def test_attention_splits_follow_the_request_not_the_cache_or_k(tmp_path, device):
    """How attention splits the cache fixes the order of its sums: it must come from the request
    alone. A cache grown by an earlier long request, or drafting k more positions, leaves it
    (and so the greedy tokens) as a fresh engine has them."""
    from flashdraft.backends import kernels
    from tests.tiny import build_model

    model = build_model(tmp_path / "long", "qwen2", seed=3, max_positions=8192)
    llm = LLM(str(model), device=device, dtype="bfloat16" if device == "cuda" else "float32")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    fresh = llm.generate(PROMPTS[:1], params, draft=None)[0].token_ids
    split = llm.engine.cache.split_len
    assert split == kernels.split_length(len(llm.tokenizer.encode(PROMPTS[0])) + 30)
    llm.engine.ensure_capacity(8192)  # as an earlier request of the whole context would
    assert kernels.split_length(llm.engine.cache.max_len) != split or not kernels.available()
    assert llm.generate(PROMPTS[:1], params, draft=None)[0].token_ids == fresh
    assert llm.engine.cache.split_len == split
    spec = llm.generate(PROMPTS[:1], params, draft="ngram", num_speculative_tokens=8)
    assert spec[0].token_ids == fresh and llm.engine.cache.split_len == split


def test_draft_model_reads_the_prompt_once_at_the_start(target, plain, tiny_models,
                                                        monkeypatch):
    """The draft model's prefill runs when the request begins (timed with the target's), so
    every proposal feeds it one or two tokens: the shapes its CUDA graphs replay. A proposal
    that fed the whole prompt ran eagerly, with compilation for new lengths, inside decoding."""
    from flashdraft.drafters import draft_model

    drafter = target.get_drafter(tiny_models["qwen2"])
    prefilled, fed = [], []  # prompt lengths prefilled; tokens of each eager proposal forward
    prefill, eager = draft_model.prefill, draft_model.eager_step
    monkeypatch.setattr(draft_model, "prefill", lambda model, tokens, *a, **kw:
                        prefilled.append(len(tokens)) or prefill(model, tokens, *a, **kw))
    monkeypatch.setattr(draft_model, "eager_step", lambda model, tokens, *a, **kw:
                        fed.append(tokens.shape[1]) or eager(model, tokens, *a, **kw))
    graphed = drafter.runner.stats.replays if drafter.runner else 0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # a draft every step (after a plain stretch the cost model chooses, the next proposal
    # feeds the stretch's tokens: more than two, by design)
    target.engine.adaptive = False
    try:
        out = target.generate(PROMPTS[0], params, draft=tiny_models["qwen2"],
                              num_speculative_tokens=4)[0]
    finally:
        target.engine.adaptive = True
    assert out.token_ids == plain[0]
    assert prefilled == [out.metrics.prompt_tokens]
    if drafter.runner is None:
        assert fed and set(fed) <= {1, 2}
    else:  # on a GPU the prefill and every proposal step are graph replays
        assert fed == []
        assert drafter.runner.stats.replays - graphed == out.metrics.drafted_tokens + 1
