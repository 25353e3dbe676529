"""The drafter protocol as the engine drives it: every committed token reaches the drafter, in
order; a draft model's cache follows the committed tokens; hidden states cover exactly the
committed positions; and the registry that maps specs to drafters."""
import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.backends.cuda_graphs import eager_step
from flashdraft.drafters import (Draft, DraftModelDrafter, DrafterSpec, NgramDrafter,
                                 parse_drafter_spec)
from flashdraft.drafters.base import DraftContext
from flashdraft.engine import RequestMetrics
from flashdraft.kv_cache import KVCache

PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "for i in range(10):\n    print(i)\nfor"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_models, device):
    return LLM(tiny_models["qwen2"], device=device, dtype="float32")


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in target.generate(PROMPTS, GREEDY, draft=None)]


def run(target, prompt_ids, drafter, k, params=GREEDY):
    """The engine's generated tokens and metrics for one prompt."""
    m = RequestMetrics()
    tokens = [t for s in target.engine.run(prompt_ids, params, drafter, k, m) for t in s.token_ids]
    return tokens, m


class Recording:
    """Wraps a drafter; records what the engine tells it and checks each context against it."""

    def __init__(self, inner):
        self.inner, self.hidden_layers = inner, inner.hidden_layers
        self.prompt, self.commits, self.proposals = None, [], 0
        for optional in ("can_propose", "ensure_capacity"):  # what the engine asks for if present
            if hasattr(inner, optional):
                setattr(self, optional, getattr(inner, optional))

    def begin(self, prompt):
        assert self.prompt is None and not self.commits
        self.prompt = list(prompt)
        self.inner.begin(prompt)

    def propose(self, ctx, k):
        # The engine's context is the prompt and everything committed so far, nothing else.
        assert ctx.tokens == self.prompt + [t for c in self.commits for t in c]
        self.proposals += 1
        return self.inner.propose(ctx, k)

    def commit(self, tokens):
        assert self.prompt is not None and tokens
        self.commits.append(list(tokens))
        self.inner.commit(tokens)


@pytest.mark.parametrize("drafter", ["ngram", "poor", "perfect"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_drafter_is_told_every_committed_token_in_order(target, plain, tiny_models, drafter,
                                                        adaptive):
    """The concatenation of all commit() calls is the generated sequence: the first token after
    the prefill alone, then each step's tokens, plain stretches' included."""
    spec = {"ngram": "ngram", "poor": tiny_models["qwen2-draft"],
            "perfect": tiny_models["qwen2"]}[drafter]
    inner = target.get_drafter(spec)
    target.engine.adaptive = adaptive
    plain_tokens = drafted_steps = 0
    try:
        for prompt, want in zip(PROMPTS, plain):
            ids = target.encode(prompt)[1]
            rec = Recording(inner)
            tokens, m = run(target, ids, rec, 4)
            assert tokens == want
            assert rec.prompt == ids
            assert rec.commits[0] == [want[0]]
            assert [t for c in rec.commits for t in c] == tokens
            assert len(rec.commits) == m.target_passes  # one commit per target pass
            assert rec.proposals >= len(m.drafted_per_step)
            plain_tokens += m.plain_tokens
            drafted_steps += len(m.drafted_per_step)
    finally:
        target.engine.adaptive = True
    assert drafted_steps > 0  # speculative steps were exercised
    if adaptive and drafter != "perfect":
        assert plain_tokens > 0  # and plain stretches
    # A stop token ends the request inside a step: the drafter is told the tokens up to it.
    want = plain[2]
    stop = next(t for i, t in enumerate(want) if i >= 5 and t not in want[:i])
    rec = Recording(inner)
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    tokens, _ = run(target, target.encode(PROMPTS[2])[1], rec, 4, params)
    assert tokens == want[:want.index(stop) + 1]
    assert [t for c in rec.commits for t in c] == tokens


def draft_model_continuation(model, tokens, k):
    """Greedy: the k tokens the draft model gives after `tokens`, from a fresh cache."""
    cache = KVCache.for_model(model.cfg, 1, len(tokens) + k + 1, torch.float32,
                              next(model.parameters()).device)
    seq = list(tokens)
    for _ in range(k):
        logits, _ = eager_step(model, torch.tensor([seq], device=cache.kv.device), 0, cache)
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(tokens):]


@pytest.mark.parametrize("drafter", ["poor", "perfect"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_model_proposes_as_if_from_scratch(target, plain, tiny_models, drafter, adaptive):
    """Whatever the engine committed (rejections, full acceptance, plain stretches), the draft
    model's cached prefix is right: each proposal is what it would draft from a fresh cache."""
    inner = target.get_drafter(tiny_models["qwen2-draft" if drafter == "poor" else "qwen2"])
    checked = []

    class Checking(Recording):
        def propose(self, ctx, k):
            draft = super().propose(ctx, k)
            got = draft.tokens[0].tolist()
            assert got == draft_model_continuation(self.inner.model, ctx.tokens, k)
            checked.append(k)
            return draft

    target.engine.adaptive = adaptive
    try:
        with torch.inference_mode():
            for prompt, want in zip(PROMPTS, plain):
                rec = Checking(inner)
                tokens, m = run(target, target.encode(prompt)[1], rec, 3)
                assert tokens == want
    finally:
        target.engine.adaptive = True
    assert len(checked) > (0 if adaptive else 10)  # the cost model may choose plain stretches


def test_draft_model_keeps_the_cache_the_committed_tokens_match(tiny_models):
    """commit(tokens) against the last proposal d_1 … d_k: with the first m committed tokens
    equal to d_1 … d_m, the cache keeps context + min(m, k - 1) positions; tokens committed
    with no proposal (plain decoding) leave it as it is."""
    from flashdraft.loading import load_model
    dev = torch.device("cpu")
    draft = load_model(tiny_models["qwen2-draft"], torch.float32, dev)
    d = DraftModelDrafter(draft.model, dev, torch.float32, draft.config.vocab_size)
    d.ensure_capacity(64)
    seq = [5, 9, 17, 33]
    params = SamplingParams(temperature=0)
    with torch.inference_mode():
        d.begin(seq)
        d.commit([40])
        seq.append(40)
        assert (d.n_cached, d.length) == (4, 5)
        for m, k in [(2, 4), (4, 4), (0, 3), (3, 3), (1, 1)]:
            drafted = d.propose(DraftContext(list(seq), params, None), k).tokens[0].tolist()
            assert len(drafted) == k
            committed = drafted[:m] + ([(drafted[m] + 1) % 300] if m < k else [7])
            context = len(seq)
            d.commit(committed)
            seq += committed
            assert d.n_cached == context + min(m, k - 1) and d.length == len(seq)
            d.commit([11, 12])  # plain decoding: no proposal to compare with
            seq += [11, 12]
            assert d.n_cached == context + min(m, k - 1) and d.length == len(seq)


class Scripted:
    """Proposes the plain output with one token broken at a rotating place (or nothing every
    fifth step), so that verification keeps 0 … k drafts; records the hidden states given."""

    def __init__(self, want, n_prompt, hidden_layers, device):
        self.want, self.n_prompt, self.hidden_layers = want, n_prompt, hidden_layers
        self.device, self.seen, self.commits = device, [], []

    def begin(self, prompt):
        pass

    def propose(self, ctx, k):
        self.seen.append((len(ctx.tokens), [h.clone() for h in ctx.hidden]))
        step = len(self.seen)
        g = len(ctx.tokens) - self.n_prompt
        tokens = list(self.want[g:g + k])
        if step % 5 == 0:
            tokens = []
        elif step % (k + 1) < len(tokens):
            tokens[step % (k + 1)] = (tokens[step % (k + 1)] + 1) % 300
        return Draft(torch.tensor([tokens], dtype=torch.long, device=self.device).view(1, -1))

    def commit(self, tokens):
        self.commits.append(list(tokens))


@pytest.mark.parametrize("k", [1, 3])
def test_hidden_states_are_those_of_the_committed_positions(target, plain, k):
    """Each proposal gets [1, n_new, hidden] per requested layer: the prompt's rows first, then
    the committed count of the step before (accepted + 1); together they are the target's
    states at every cached position, as a forward over the whole sequence computes them."""
    layers = (0, target.target.config.num_layers)
    ids = target.encode(PROMPTS[1])[1]
    d = Scripted(plain[1], len(ids), layers, target.device)
    tokens, m = run(target, ids, d, k)
    assert tokens == plain[1]
    assert 0 in m.accepted_per_step and k in m.accepted_per_step  # both extremes were verified
    assert len(d.seen) > 5
    for i, (length, hidden) in enumerate(d.seen):
        assert len(hidden) == len(layers)
        new = len(ids) if i == 0 else len(d.commits[i])  # commits[0]: the prefill's token
        assert all(h.shape == (1, new, target.target.config.hidden_size) for h in hidden)
    last = d.seen[-1][0]
    seq = ids + tokens
    cache = KVCache.for_model(target.target.config, 1, len(seq), torch.float32, target.device)
    with torch.inference_mode():
        _, full = eager_step(target.engine.model, torch.tensor([seq[:last - 1]],
                                                               device=target.device),
                             0, cache, layers)
    for j in range(len(layers)):
        got = torch.cat([hidden[j] for _, hidden in d.seen], dim=1)
        assert got.shape[1] == last - 1
        torch.testing.assert_close(got, full[j], atol=1e-4, rtol=1e-4)


def test_no_hidden_layers_are_computed_for_a_drafter_that_asks_none(target, plain, monkeypatch):
    """The engine asks the target for no layers (prefill, verification, plain steps) and hands
    the drafter an empty list; asking for a layer is what changes that."""
    from flashdraft import engine
    asked = []  # hidden_layers of each target pass
    real_prefill, real_step = engine.prefill, engine.eager_step

    def prefill(model, tokens, cache, hidden_layers=(), *args, **kwargs):
        asked.append(tuple(hidden_layers))
        return real_prefill(model, tokens, cache, hidden_layers, *args, **kwargs)

    def step(model, tokens, start, cache, hidden_layers=(), *args, **kwargs):
        asked.append(tuple(hidden_layers))
        return real_step(model, tokens, start, cache, hidden_layers, *args, **kwargs)
    monkeypatch.setattr(engine, "prefill", prefill)
    monkeypatch.setattr(engine, "eager_step", step)
    ids = target.encode(PROMPTS[0])[1]
    d = Scripted(plain[0], len(ids), (), target.device)
    assert run(target, ids, d, 3)[0] == plain[0]
    assert asked and all(layers == () for layers in asked)
    assert d.seen and all(hidden == [] for _, hidden in d.seen)
    asked.clear()
    d = Scripted(plain[0], len(ids), (1,), target.device)
    assert run(target, ids, d, 3)[0] == plain[0]
    assert asked and all(layers == (1,) for layers in asked)  # the control


# -- the registry ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, want", [
    ("ngram", DrafterSpec("ngram", "")),
    ("ngram:3,2", DrafterSpec("ngram", "3,2")),
    ("model:org/draft", DrafterSpec("model", "org/draft")),
    ("org/draft", DrafterSpec("model", "org/draft")),  # a bare path: a draft model, as before
    ("./models/x:y/z", DrafterSpec("model", "./models/x:y/z")),
    ("example:qwen2.5-coder-0.5b", DrafterSpec("model", "example:qwen2.5-coder-0.5b")),
    ("model:example:qwen2.5-coder-0.5b", DrafterSpec("model", "example:qwen2.5-coder-0.5b")),
    ("C:\\models\\draft", DrafterSpec("model", "C:\\models\\draft")),
    ("dflash:org/block", DrafterSpec("dflash", "org/block")),
])
def test_specs_parse(spec, want):
    assert parse_drafter_spec(spec) == want
    assert want.model == (None if want.kind == "ngram" else want.arg)


@pytest.mark.parametrize("spec, words", [
    ("eagle:org/head", ["'eagle'", "'eagle:org/head'", "ngram", "model:PATH", "dflash:PATH"]),
    ("model:", ["'model:'", "model:PATH"]),
    ("ngram:", ["'ngram:'", "ngram:4,3,2"]),
    ("ngram:0,2", ["'ngram:0,2'", "'0,2'"]),
    ("ngram:four", ["'ngram:four'", "whole numbers"]),
    ("", ["''", "ngram"]),
])
def test_bad_specs_say_what_was_wrong(spec, words):
    with pytest.raises(ValueError) as err:
        parse_drafter_spec(spec)
    for w in words:
        assert w in str(err.value)


def test_registry_makes_each_kind(target, tiny_models):
    d = target.get_drafter("ngram")
    assert isinstance(d, NgramDrafter) and d.sizes == target.config.ngram_sizes
    d = target.get_drafter("ngram:2,5")
    assert isinstance(d, NgramDrafter) and d.sizes == (5, 2)
    for spec in (tiny_models["qwen2-draft"], "model:" + tiny_models["qwen2-draft"]):
        d = target.get_drafter(spec)
        assert isinstance(d, DraftModelDrafter) and d.model.cfg.num_layers == 1
    with pytest.raises(ValueError, match="no dflash_config"):  # a draft model, not a DFlash one
        target.get_drafter("dflash:" + tiny_models["qwen2-draft"])
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        LLM(tiny_models["qwen2"], draft="medusa:heads", device="cpu", dtype="float32")
