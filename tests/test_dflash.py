"""The DFlash drafter: the reference's numbers on the same weights, losslessness in the engine,
the sampled distribution, and errors for drafters that do not fit the target.

The reference is the `dflash` package (0.1.0, `dflash/model.py`), installed without its
dependencies (the Makefile does; they pin datasets, pandas and others that the reference does
not need to run); its tests are skipped where it is missing.
"""
import json
import shutil

import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.backends.cuda_graphs import StepRunner
from flashdraft.config import ModelConfig
from flashdraft.drafters.dflash import (DFlashConfig, DFlashDrafter, block_slots, load_dflash,
                                        read_dflash_config, save_dflash)
from flashdraft.engine import Engine, RequestMetrics
from flashdraft.kv_cache import KVCache
from tests import test_engine_sampling as sampling_test
from tests.tiny import build_dflash_drafter, build_model, build_tokenizer, random_dflash

BLOCK = 4  # the tiny drafters' trained block: the last token and 3 masks
PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "for i in range(10):\n    print(i)\nfor"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 4-layer Qwen3 target and a 2-layer drafter for it reading layers 2 and 0 (in that
    order, so that fc's order differs from the ascending order of DraftContext.hidden)."""
    root = tmp_path_factory.mktemp("dflash")
    target = build_model(root / "target", "qwen3", seed=1, layers=4)
    drafter = build_dflash_drafter(root / "drafter", target, seed=3, layers=2, block_size=BLOCK,
                                   target_layer_ids=(2, 0))
    return {"root": root, "target": str(target), "drafter": str(drafter)}


@pytest.fixture(scope="module")
def llm(files):
    return LLM(files["target"], device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(files):
    """(the reference drafter, the transformers target) on the same files."""
    model_mod = pytest.importorskip(
        "dflash.model", reason="the reference: pip install --no-deps dflash==0.1.0")
    import transformers
    ref, info = model_mod.DFlashDraftModel.from_pretrained(
        files["drafter"], output_loading_info=True, dtype=torch.float32)
    # The files are in the reference's format exactly: every tensor read, none left random.
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    target = transformers.AutoModelForCausalLM.from_pretrained(files["target"],
                                                               dtype=torch.float32)
    return ref.eval(), target.eval()


def our_pass(model, tokens, start, cache, layers):
    device = cache.kv.device
    with torch.inference_mode():
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        return model(torch.tensor([tokens], device=device), positions, cache,
                     hidden_layers=layers)


def test_block_logits_match_the_reference(llm, files, reference):
    """The first block after the prompt, then a block after a verification that kept one of
    three drafts (two rows committed, the reference's cache cropped), equal to fp32 rounding."""
    from dflash.model import _crop_to, _make_cache, extract_context_feature
    ref, hf = reference
    drafter = llm.get_drafter("dflash:" + files["drafter"])
    assert isinstance(drafter, DFlashDrafter) and drafter.hidden_layers == (1, 3)
    model = llm.engine.model
    ids = llm.encode(PROMPTS[0])[1]
    n = len(ids)
    cache = KVCache.for_model(model.cfg, 1, 64, torch.float32, "cpu")
    logits, hidden = our_pass(model, ids, 0, cache, drafter.hidden_layers)
    first = int(logits[0, -1].argmax())
    drafter.begin(ids)
    ours1 = drafter.block_logits(hidden, first, BLOCK - 1)
    drafts = ours1.argmax(-1)[0].tolist()
    # The verification of [first, d1, d2, d3]; one draft kept: two rows, then the target's token.
    logits, hidden = our_pass(model, [first] + drafts, n, cache, drafter.hidden_layers)
    bonus = int(logits[0, 1].argmax())
    ours2 = drafter.block_logits([h[:, :2] for h in hidden], bonus, BLOCK - 1)

    def ref_block(features, last, start, draft_cache):
        block = torch.tensor([[last] + [ref.mask_token_id] * (BLOCK - 1)])
        positions = torch.arange(start - features.shape[1], start + BLOCK)[None]
        out = ref(target_hidden=features, noise_embedding=hf.get_input_embeddings()(block),
                  position_ids=positions, past_key_values=draft_cache, use_cache=True)
        _crop_to(draft_cache, start)
        return ref.compute_logits(out[:, 1:], hf.lm_head)

    with torch.inference_mode():
        draft_cache = _make_cache(ref.config)
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        ref1 = ref_block(extract_context_feature(out.hidden_states, ref.target_layer_ids),
                         first, n, draft_cache)
        out = hf(torch.tensor([ids + [first] + drafts]), output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, ref.target_layer_ids)
        ref2 = ref_block(features[:, n:n + 2], bonus, n + 2, draft_cache)
    torch.testing.assert_close(ours1, ref1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours2, ref2, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ours1, ours2)


def test_a_greedy_run_drafts_and_outputs_as_dflash_generate(llm, files, reference):
    """40 greedy tokens through our engine and through the reference's loop: the same output
    and the same drafts at every step with a full block (the reference drafts one token more
    than the engine's budget at the very end, and a shorter block changes the drafts)."""
    from dflash.model import dflash_generate
    ref, hf = reference
    ids = llm.encode(PROMPTS[2])[1]
    ref_drafts, our_drafts = [], []
    compute_logits = ref.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        ref_drafts.append(logits.argmax(-1)[0].tolist())
        return logits

    ref.compute_logits = recording
    try:
        want = dflash_generate(ref, hf, torch.tensor([ids]), 40, None, block_size=BLOCK)
    finally:
        del ref.compute_logits
    drafter = llm.get_drafter("dflash:" + files["drafter"])
    propose = drafter.propose

    def recording_propose(ctx, k):
        draft = propose(ctx, k)
        our_drafts.append(draft.tokens[0].tolist())
        return draft

    drafter.propose = recording_propose
    try:
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, draft="dflash:" + files["drafter"],
                           num_speculative_tokens=BLOCK - 1)[0]
    finally:
        del drafter.propose
    assert out.token_ids == want[0, len(ids):].tolist()
    full = 0
    while (full < min(len(ref_drafts), len(our_drafts)) and len(ref_drafts[full]) == BLOCK - 1
           and len(our_drafts[full]) == BLOCK - 1):
        full += 1
    assert full >= 5 and our_drafts[:full] == ref_drafts[:full]


@pytest.fixture(scope="module")
def plain(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, draft=None)]


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_greedy_speculative_equals_plain(llm, plain, files, k):
    """k above the block's 3 masks drafts 3."""
    outs = llm.generate(PROMPTS, GREEDY, draft="dflash:" + files["drafter"],
                        num_speculative_tokens=k)
    for out, want in zip(outs, plain):
        assert out.token_ids == want and out.finish_reason == "length"
        m = out.metrics
        assert m.drafted_per_step and max(m.drafted_per_step) == min(k, BLOCK - 1)
        # No plain stretches: only the last token may come from a pass without a draft.
        assert 0 <= m.target_passes - 1 - len(m.drafted_per_step) <= 1


@pytest.mark.parametrize("k, widths", [(3, (3, 2)), (2, (4, 4))])
def test_greedy_tree_speculation_equals_plain(llm, plain, files, k, widths):
    """Token trees from the block's logits (each position's next best tokens beside the
    spine); the target's hidden states of the accepted path, a leaf included, feed the next
    block."""
    llm.engine.tree_widths = widths
    try:
        outs = llm.generate(PROMPTS, GREEDY, draft="dflash:" + files["drafter"],
                            num_speculative_tokens=k)
    finally:
        llm.engine.tree_widths = ()
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.leaf_steps for o in outs) > 0


def test_a_block_smaller_than_trained(llm, plain, files):
    drafter = DFlashDrafter(load_dflash(files["drafter"]), llm.engine.model, "cpu",
                            torch.float32, block_size=2)
    for prompt, want in zip(PROMPTS, plain):
        m = RequestMetrics()
        steps = llm.engine.run(llm.encode(prompt)[1], GREEDY, drafter, BLOCK - 1, m)
        assert [t for s in steps for t in s.token_ids] == want
        assert max(m.drafted_per_step) == 1


def test_saved_drafter_reloads_to_the_same_weights(files, tmp_path):
    model = load_dflash(files["drafter"])
    save_dflash(model, tmp_path / "again")
    again = load_dflash(tmp_path / "again")
    assert again.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_block_size_at_the_top_level_and_default_layer_ids_load(files, tmp_path):
    """Public configs put block_size at the top level, and may leave target_layer_ids to the
    reference's default (build_target_layer_ids)."""
    path = tmp_path / "public"
    shutil.copytree(files["drafter"], path)
    d = json.loads((path / "config.json").read_text())
    d["block_size"] = d["dflash_config"].pop("block_size")
    del d["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(d))
    cfg = read_dflash_config(path)
    assert cfg.block_size == BLOCK and cfg.target_layer_ids == (1, 1)  # 4 target layers, 2 own


# -- the fixed-shape pass (CUDA graphs) -------------------------------------------------------

# (k, kept) per step: a block of k drafts, then a verification that keeps `kept` of them (its
# first kept + 1 rows are committed): partial, none, all, and k changing between steps.
STEPS = [(3, 1), (3, 0), (2, 2), (3, 3), (1, 0), (3, 2), (2, 1)]


def drive(model, ids, layers, passes, steps=STEPS):
    """Block passes fed as the engine feeds them: the prompt's rows, then per step the rows that
    a verification of the first pass's drafts committed. passes: functions (hidden, last, k) ->
    logits [1, k, vocab], each given the same rows. Returns the logits (copies) per step, one
    per pass."""
    cache = KVCache.for_model(model.cfg, 1, 256, torch.float32, model.embed.weight.device)
    logits, hidden = our_pass(model, ids, 0, cache, layers)
    last, position, out = int(logits[0, -1].argmax()), len(ids), []
    for k, kept in steps:
        got = [f(hidden, last, k).clone() for f in passes]  # a graph's buffer: copied
        out.append(got)
        drafts = got[0].argmax(-1)[0].tolist()
        logits, hidden = our_pass(model, [last] + drafts, position, cache, layers)
        hidden = [h[:, :kept + 1] for h in hidden]
        last = int(logits[0, kept].argmax())  # the target's token after the kept drafts
        position += kept + 1
    return out


def fixed_shape(drafter):
    """The drafter with the fixed-shape pass that a GPU replays as graphs, run eagerly (a
    runner that is off: a CPU's)."""
    drafter.runner = StepRunner(drafter.model, "cpu")
    assert not drafter.runner.enabled
    return drafter


@pytest.mark.parametrize("prompt_len", [None, 3])  # the prompt eager (longer than a block) or not
def test_the_fixed_shape_pass_equals_the_eager_pass(llm, files, prompt_len):
    """Padded rows, positions from device tensors, cache slots by index_copy_ and attention over
    a kv bucket with a mask give the eager pass's logits, step after step, through partial
    acceptances (the context length moved back over a rejected block) and changing k."""
    model = llm.engine.model
    eager = DFlashDrafter(load_dflash(files["drafter"]), model, "cpu", torch.float32)
    padded = fixed_shape(DFlashDrafter(load_dflash(files["drafter"]), model, "cpu",
                                       torch.float32))
    ids = llm.encode(PROMPTS[2])[1][:prompt_len]
    assert (len(ids) > BLOCK) == (prompt_len is None)
    padded.ensure_capacity(300)  # longer than the kv bucket of 256: every pass masks keys
    padded.cache.kv.normal_()  # whatever the slots past the context hold must not count
    calls = []
    padded_pass = padded.padded_block_logits

    def counting(hidden, last, k):
        calls.append(hidden[0].shape[1])
        return padded_pass(hidden, last, k)

    padded.padded_block_logits = counting
    for drafter in (eager, padded):
        drafter.begin(ids)
    steps = drive(model, ids, eager.hidden_layers, [eager.block_logits, padded.block_logits])
    for i, (want, got) in enumerate(steps):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    assert padded.n_context == eager.n_context
    # Every step's rows took the fixed shape, the prompt's only where they fit in a block.
    assert calls == ([] if prompt_len is None else [3]) + [kept + 1 for _, kept in STEPS[:-1]]


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_speculative_with_the_fixed_shape_pass_equals_plain(llm, plain, files, k):
    drafter = fixed_shape(DFlashDrafter(load_dflash(files["drafter"]), llm.engine.model, "cpu",
                                        torch.float32))
    for prompt, want in zip(PROMPTS, plain):
        steps = llm.engine.run(llm.encode(prompt)[1], GREEDY, drafter, k)
        assert [t for s in steps for t in s.token_ids] == want


def test_the_fixed_shape_writes_each_row_to_a_slot_of_its_own():
    rows = 4
    for start in (0, 7):
        for n_new in range(rows + 1):
            for t in (2, 4):
                slots = block_slots(torch.tensor([start]), torch.tensor([n_new]), rows, t)
                assert slots.tolist() == (
                    list(range(start, start + n_new))  # the new rows where they belong
                    + list(range(start + n_new + t, start + rows + t))  # padding: past the block
                    + list(range(start + n_new, start + n_new + t)))  # the block after the rows


def test_graph_switches_and_the_fixed_shape_refuse_what_they_cannot_do(llm, files):
    model = llm.engine.model
    with pytest.raises(ValueError, match=r"cuda_graphs=True .* on cpu.*cuda_graphs=None"):
        DFlashDrafter(load_dflash(files["drafter"]), model, "cpu", torch.float32,
                      cuda_graphs=True)
    drafter = DFlashDrafter(load_dflash(files["drafter"]), model, "cpu", torch.float32)
    assert drafter.runner is None  # a CPU: eager
    assert llm.get_drafter("dflash:" + files["drafter"]).runner is None
    rows = [torch.zeros(1, BLOCK + 1, model.cfg.hidden_size) for _ in drafter.hidden_layers]
    with pytest.raises(ValueError, match=f"block_size={BLOCK} new context rows, not {BLOCK + 1}"):
        drafter.padded_block_logits(rows, 0, 2)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
def test_graph_block_logits_equal_the_eager_pass_on_gpu(files):
    """The graph replays give the fixed-shape pass's logits run eagerly (the same kernels) bit
    for bit, and the eager pass's to fp32 rounding, through partial acceptances; the prompt's
    pass stays eager, every later one is a replay, one graph per k."""
    llm = LLM(files["target"], device="cuda", dtype="float32")
    model = llm.engine.model

    def drafter(**kw):
        d = DFlashDrafter(load_dflash(files["drafter"], torch.float32, "cuda"), model, "cuda",
                          torch.float32, **kw)
        d.ensure_capacity(256)
        return d

    graphs, eager, padded = drafter(), drafter(cuda_graphs=False), drafter(cuda_graphs=False)
    assert graphs.runner is not None and graphs.runner.enabled and eager.runner is None
    ids = llm.encode(PROMPTS[2])[1]
    assert len(ids) > BLOCK
    for d in (graphs, eager, padded):
        d.begin(ids)

    def padded_pass(hidden, last, k):
        if hidden[0].shape[1] > BLOCK:  # the prompt
            return padded.eager_block_logits(hidden, last, k)
        return padded.padded_block_logits(hidden, last, k)

    steps = drive(model, ids, graphs.hidden_layers,
                  [graphs.block_logits, eager.block_logits, padded_pass])
    for i, (g, e, p) in enumerate(steps):
        assert torch.equal(g, p), f"step {i}"
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=f"step {i}")
    stats = graphs.runner.stats
    assert stats.replays == len(STEPS) - 1
    assert stats.captures == len({k for k, _ in STEPS[1:]})  # one kv bucket: a graph per k


@gpu
@needs_cuda
def test_greedy_speculative_with_graphs_equals_plain_on_gpu(files):
    """Losslessness on the graph path (fp32), k below and at the block; a seeded sampled run
    through the graphs too."""
    llm = LLM(files["target"], device="cuda", dtype="float32")
    spec = "dflash:" + files["drafter"]
    plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, draft=None)]
    for k in (1, BLOCK - 1):
        outs = llm.generate(PROMPTS, GREEDY, draft=spec, num_speculative_tokens=k)
        assert [o.token_ids for o in outs] == plain, f"k={k}"
        assert max(outs[0].metrics.drafted_per_step) == k
        assert all(o.metrics.draft_time_s > 0 for o in outs)  # the block pass is drafting time
    runner = llm.get_drafter(spec).runner
    assert runner is not None and runner.stats.replays > 0
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=0, ignore_eos=True)
    replays = runner.stats.replays
    outs = llm.generate(PROMPTS, sampled, draft=spec, num_speculative_tokens=BLOCK - 1)
    assert all(len(o.token_ids) == 40 for o in outs) and runner.stats.replays > replays


# -- sampling ---------------------------------------------------------------------------------

def tiny_drafter(target, seed=1):
    """A 1-layer drafter for test_engine_sampling's target (2 layers, 8 tokens), weights
    scaled up as that test's models are, so that q is peaked and far from p."""
    c = target.cfg
    layers = ModelConfig(arch="qwen3", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_layers=1,
                         num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                         head_dim=c.head_dim, qk_norm=True)
    cfg = DFlashConfig(layers=layers, num_target_layers=c.num_layers, target_layer_ids=(0,),
                       block_size=BLOCK, mask_token_id=c.vocab_size - 1)
    return random_dflash(cfg, seed, scale=0.6)


@pytest.mark.parametrize("widths", [(), (3, 2)])
def test_engine_samples_from_the_target_with_a_dflash_drafter(widths):
    """test_engine_sampling's chi-square on (token 2, token 3), drafted two at a time from q,
    as a chain and as a tree."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=3, seed=0,
                            ignore_eos=True)
    target = sampling_test.tiny(0, layers=2)
    engine = Engine(target, torch.device("cpu"), torch.float32, 64, (), adaptive=False,
                    fused_sampling=False, tree_widths=widths)
    drafter = DFlashDrafter(tiny_drafter(target), target, "cpu", torch.float32,
                            fused_sampling=False)
    V = sampling_test.V
    counts = torch.zeros(V * V, dtype=torch.float64)
    accepted = 0
    for i in range(3000):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        steps = list(engine.run(sampling_test.PROMPT, p, drafter, k=2))
        tokens = [t for s in steps for t in s.token_ids]
        counts[tokens[1] * V + tokens[2]] += 1
        accepted += len(steps[1].token_ids) - 1
    # Drafts are kept and rejected: both paths count (a tree's two alternatives cover the
    # target's few top-p tokens here, so one of its candidates is nearly always kept).
    assert 0 < accepted < 3000 if not widths else accepted > 0
    pvalue, impossible = sampling_test.chi2_against_target(counts, params)
    assert pvalue > 1e-3 and impossible == 0


# -- errors -----------------------------------------------------------------------------------

def edited(files, tmp_path, edit):
    """A copy of the drafter with its config.json changed by edit(dict)."""
    path = tmp_path / "edited"
    shutil.copytree(files["drafter"], path)
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    return "dflash:" + str(path)


def refusal(llm, spec):
    with pytest.raises(ValueError) as err:
        llm.get_drafter(spec)
    return str(err.value)


def test_a_drafter_for_another_target_is_refused(llm, files, tmp_path):
    other = build_model(tmp_path / "other", "qwen3", seed=2, layers=4, hidden=32,
                        tokenizer_from=files["target"])
    msg = refusal(llm, "dflash:" + str(build_dflash_drafter(tmp_path / "d32", other)))
    assert "hidden states of size 32" in msg and "64" in msg and "train-drafter" in msg

    def vocab(d):
        d["vocab_size"] = 500
    assert "500" in refusal(llm, edited(files, tmp_path / "v", vocab))

    def layers(d):
        d["num_target_layers"] = 6
    msg = refusal(llm, edited(files, tmp_path / "l", layers))
    assert "6 layers" in msg and "has 4" in msg

    def last_layer(d):
        d["dflash_config"]["target_layer_ids"] = [0, 3]
    msg = refusal(llm, edited(files, tmp_path / "i", last_layer))
    assert "[0, 3]" in msg and "[3]" in msg and "0 … 2" in msg


def test_a_drafter_of_another_tokenizer_is_refused(llm, files, tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(files["drafter"], path)
    build_tokenizer(path, vocab_size=300)
    assert "does not share the target's tokenizer" in refusal(llm, "dflash:" + str(path))


def test_not_a_dflash_drafter_is_refused(llm, files, tmp_path):
    msg = refusal(llm, "dflash:" + files["target"])  # a plain model: no dflash_config
    assert "no dflash_config" in msg and "model:PATH" in msg

    def dflash2(d):
        d["dflash_config"]["conv_kernel_size"] = 4
    assert "DFlash2" in refusal(llm, edited(files, tmp_path / "2", dflash2))

    def causal(d):
        d["layer_types"] = ["sliding_attention", "full_attention"]
    assert "sliding_attention" in refusal(llm, edited(files, tmp_path / "c", causal))

    def no_mask(d):
        del d["dflash_config"]["mask_token_id"]
    assert "mask_token_id" in refusal(llm, edited(files, tmp_path / "m", no_mask))

    def one_layer(d):
        d["num_hidden_layers"] = 1
    msg = refusal(llm, edited(files, tmp_path / "n", one_layer))
    assert "unexpected tensors" in msg and "layers.1." in msg


@pytest.mark.parametrize("block", [0, 1, BLOCK + 1])
def test_a_block_size_outside_the_trained_one_is_refused(llm, files, block):
    with pytest.raises(ValueError) as err:
        DFlashDrafter(load_dflash(files["drafter"]), llm.engine.model, "cpu", torch.float32,
                      block_size=block)
    assert f"block_size={block}" in str(err.value) and f"to {BLOCK}" in str(err.value)


def test_a_trained_block_size_below_two_is_refused(files, tmp_path):
    path = tmp_path / "b"
    edited(files, path, lambda d: d["dflash_config"].update(block_size=0))
    with pytest.raises(ValueError, match="block_size=0 in dflash_config"):
        read_dflash_config(path / "edited")
