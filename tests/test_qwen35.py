"""The Qwen3.5 hybrid decoder (flashdraft.hybrid) against transformers' qwen3_5 classes, its
recurrent state's rollback, and the engine's losslessness over it (fp32, tiny random models)."""
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from scipy import stats

from flashdraft import LLM, SamplingParams
from flashdraft.config import ModelConfig
from flashdraft.drafters import Draft, DraftModelDrafter
from flashdraft.engine import Engine, RequestMetrics
from flashdraft.hybrid import HybridTransformer, delta_rule_chunked, delta_rule_recurrent
from flashdraft.loading import load_model
from flashdraft.model import Transformer
from flashdraft.sampling import probs_from_logits
from tests.tiny import build_dflash_drafter, build_model, build_qwen35

pytestmark = pytest.mark.usefixtures("one_thread")

LIN, FULL = "linear_attention", "full_attention"
K = 4  # drafts verified per step in the logits tests


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    paths = {
        "hybrid": build_qwen35(root / "hybrid", seed=1),
        "attention-first": build_qwen35(root / "attention-first", seed=2, tie=True,
                                        layer_types=(FULL, LIN, LIN, FULL, LIN)),
        "multimodal": build_qwen35(root / "multimodal", seed=3, multimodal=True,
                                   layer_types=(LIN, FULL, LIN)),
        # small layer weights: the next token depends mostly on the last one, so that a draft
        # model sharing the embeddings is right often, but not always
        "engine": build_qwen35(root / "engine", seed=4, layer_std=0.04),
    }
    draft = build_model(root / "draft", "qwen2", seed=7, layers=1, layer_std=0.03,
                        tokenizer_from=paths["engine"])
    target, weights = load_file(paths["engine"] / "model.safetensors"), load_file(
        draft / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = target[name]
    weights["model.norm.weight"] = 1 + target["model.norm.weight"]  # ours scales by w
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    paths["draft"] = draft
    # a hybrid draft model of the same embeddings: its rollbacks go back into its own states
    hybrid_draft = build_qwen35(root / "hybrid-draft", seed=5, layer_std=0.03,
                                layer_types=(LIN, FULL), tokenizer_from=paths["engine"])
    weights = load_file(hybrid_draft / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        weights[name] = target[name]
    save_file(weights, hybrid_draft / "model.safetensors", metadata={"format": "pt"})
    paths["hybrid-draft"] = hybrid_draft
    return {k: str(v) for k, v in paths.items()}


def reference(path):
    cls = (transformers.Qwen3_5ForConditionalGeneration if "multimodal" in path
           else transformers.AutoModelForCausalLM)
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["hybrid", "attention-first", "multimodal"])
@pytest.mark.parametrize("prompt_len", [5, 70])
def test_logits_match_transformers(checkpoints, name, prompt_len):
    """A prefill (5 tokens: token by token; 70: the chunked rule and SDPA), 32 decode steps, a
    verification of K drafts of which 2 are kept and the one after it from there, then a
    long step after the prefix (chunked from a state, SDPA with a mask): every logit within
    1e-4 of transformers' over the whole sequence at once."""
    model = load_model(checkpoints[name], torch.float32, "cpu").model
    torch.manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt_len + 32 + 2 * (K + 1) + 40))
    with torch.no_grad():
        want = reference(checkpoints[name])(ids).logits
        cache = model.new_cache(1, 256, torch.float32, "cpu", steps=K + 1)

        def step(start, t):
            got, _ = model(ids[:, start:start + t], torch.arange(start, start + t)[None], cache)
            assert rel_err(got, want[:, start:start + t]) <= 1e-4, (start, t)

        step(0, prompt_len)
        for i in range(prompt_len, prompt_len + 32):
            step(i, 1)
        v = prompt_len + 32
        step(v, K + 1)
        cache.commit(v + 3)  # last + 2 accepted drafts
        step(v + 3, K + 1)
        step(v + 3 + K + 1, 40)


def test_hidden_states_match_transformers(checkpoints):
    """The layers' outputs a DFlash drafter reads (0: the embeddings, i: layer i's)."""
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        want = reference(checkpoints["hybrid"])(ids, output_hidden_states=True).hidden_states
        cache = model.new_cache(1, 64, torch.float32, "cpu")
        _, hidden = model(ids, torch.arange(12)[None], cache, hidden_layers=(0, 1, 3))
    for got, i in zip(hidden, (0, 1, 3)):
        assert rel_err(got, want[i]) <= 1e-5


def test_int8_loads_through_the_quantized_path(checkpoints):
    """Each product quantized as it loads (the hybrid's names, module by module); the tiny
    DeltaNet heads (d_k = 8, L2-normalised) make int8's error larger than at real shapes."""
    from flashdraft.backends.quant import QuantLinear

    full = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu", quantization="int8").model
    assert isinstance(model.layers[0].deltanet.w_in, QuantLinear)
    assert isinstance(model.layers[3].attn.wqkv, QuantLinear)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        got, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 64, torch.float32, "cpu"))
        want, _ = full(ids, torch.arange(12)[None], full.new_cache(1, 64, torch.float32, "cpu"))
    assert rel_err(got, want) <= 0.2


def test_chunked_rule_equals_the_recurrent_one():
    torch.manual_seed(0)
    b, h, t, dk, dv = 2, 3, 150, 8, 12  # t: two whole chunks and a part
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk), dim=-1)
    v, g = torch.randn(b, h, t, dv), -torch.rand(b, h, t)
    beta, state = torch.rand(b, h, t), torch.randn(b, h, dk, dv)
    want, want_state = delta_rule_recurrent(q, k, v, g, beta, state)
    got, got_state = delta_rule_chunked(q, k, v, g, beta, state)
    assert rel_err(got, want) <= 1e-5 and rel_err(got_state, want_state) <= 1e-5


@pytest.mark.parametrize("n", [0, 2, K])
def test_rollback_equals_plain_decoding(checkpoints, n):
    """Verifying [last, d_1 … d_K] and committing n drafts leaves the state of decoding last,
    d_1 … d_n one at a time: the recurrent state and the conv inputs in the slots of those
    positions, and the next step's logits."""
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    torch.manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 30))
    p = 20  # the prompt; ids[p] is `last`, ids[p + 1 …] the drafts
    caches = [model.new_cache(1, 64, torch.float32, "cpu", steps=K + 1) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :p], torch.arange(p)[None], cache)
        verified, plain = caches
        model(ids[:, p:p + K + 1], torch.arange(p, p + K + 1)[None], verified)
        verified.commit(p + n + 1)
        for i in range(p, p + n + 1):
            model(ids[:, i:i + 1], torch.tensor([[i]]), plain)
        last = p + n  # the last committed position
        slot = last % verified.steps
        assert rel_err(verified.state[:, :, slot], plain.state[:, :, slot]) <= 1e-5
        window = [(last - j) % verified.conv_slots
                  for j in range(model.cfg.linear_conv_kernel_dim - 1)]
        assert rel_err(verified.conv[:, :, window], plain.conv[:, :, window]) <= 1e-5
        nxt = torch.tensor([[7]])
        a, _ = model(nxt, torch.tensor([[last + 1]]), verified)
        b, _ = model(nxt, torch.tensor([[last + 1]]), plain)
    assert rel_err(a, b) <= 1e-5


def test_a_step_without_its_state_is_refused(checkpoints):
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    cache = model.new_cache(1, 64, torch.float32, "cpu", steps=3)
    ids = torch.randint(0, 100, (1, 20))
    with torch.no_grad():
        model(ids[:, :10], torch.arange(10)[None], cache)  # longer than steps: its last state only
        with pytest.raises(ValueError, match="after position 8"):
            model(ids[:, 9:10], torch.tensor([[9]]), cache)
        with pytest.raises(ValueError, match="cannot commit a length of 9"):
            cache.commit(9)
        model(ids[:, 10:13], torch.arange(10, 13)[None], cache)
        cache.commit(11)  # into the last step: kept
        with pytest.raises(ValueError, match="after position 11"):
            model(ids[:, 12:13], torch.tensor([[12]]), cache)  # past the committed length


# -- token trees: a chain with leaves beside it ------------------------------------------------

TREES = {"one leaf": (3, (1, 0, 0)), "leaves at every depth": (4, (2, 1, 1, 3)),
         "a leaf beside the root only": (1, (3,)), "no leaves": (3, (0, 0, 0))}


def tree_step(model, ids, p: int, k: int, leaves):
    """A cache holding the prompt ids[:p] and one verification over [ids[p], d_1 … d_k, the
    leaves] (draft tokens from ids after p): (the cache, the pass's tokens [1, T], the tree,
    its logits)."""
    from flashdraft.tree import spine_tree

    tree = spine_tree(k, leaves, "cpu")
    tokens = ids[:, p:p + 1 + tree.size]
    # a ring of one slot a chain token: the leaves' states are never in it
    cache = model.new_cache(1, 64, torch.float32, "cpu", steps=k + 1, tree_nodes=tree.size + 1)
    model(ids[:, :p], torch.arange(p)[None], cache)
    logits, _ = model(tokens, torch.arange(p, p + tree.size + 1)[None], cache, tree=tree.mask)
    return cache, tokens, tree, logits


def causal(model, ids, p: int, path_tokens: torch.Tensor):
    """A cache of ids[:p] then path_tokens [1, n] decoded as a chain from p: (cache, logits)."""
    cache = model.new_cache(1, 64, torch.float32, "cpu", steps=path_tokens.shape[1] + 1)
    model(ids[:, :p], torch.arange(p)[None], cache)
    logits, _ = model(path_tokens, torch.arange(p, p + path_tokens.shape[1])[None], cache)
    return cache, logits


@pytest.mark.parametrize("shape", list(TREES))
@torch.no_grad()
def test_every_tree_node_equals_its_path_decoded_causally(checkpoints, shape):
    """Each node of a verification over a chain with leaves (the root, the spine, then the
    leaves depth by depth) has the logits of its path from the root decoded as a chain."""
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    k, leaves = TREES[shape]
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    p = 12
    _, tokens, tree, logits = tree_step(model, ids, p, k, leaves)
    parents = tree.mask.parents
    for node in range(tree.size + 1):
        path, i = [], node
        while i >= 0:
            path.append(i)
            i = parents[i]
        _, want = causal(model, ids, p, tokens[:, path[::-1]])
        assert rel_err(logits[:, node], want[:, -1]) <= 1e-5, node


@pytest.mark.parametrize("n, leaf", [(0, 0), (0, 1), (1, 0), (2, 1), (3, 0), (2, -1), (4, -1)])
@torch.no_grad()
def test_a_tree_compacted_to_its_accepted_path_decodes_as_that_path(checkpoints, n, leaf):
    """Committing n spine tokens and then (leaf >= 0) the leaf-th leaf beside d_{n+1}, as the
    engine does (`compact`, then `commit`): the recurrent states, conv inputs and keys the next
    steps read are those of decoding that path, and so are their logits."""
    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    k, leaves = 4, (2, 1, 2, 1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    p = 12
    cache, tokens, tree, _ = tree_step(model, ids, p, k, leaves)
    offset = 1 + k + sum(leaves[:n]) + leaf  # the leaf's row in the pass
    rows = list(range(1 + n)) + ([offset] if leaf >= 0 else [])
    if leaf >= 0:
        assert tree.mask.parents[offset] == n  # beside d_{n+1}: a child of d_n (or the root)
        cache.compact(p + 1 + n, [offset - 1 - n])
    cache.commit(p + len(rows))
    ref, _ = causal(model, ids, p, tokens[:, rows])
    last = p + len(rows) - 1
    slot = last % cache.steps
    assert rel_err(cache.state[:, :, slot], ref.state[:, :, last % ref.steps]) <= 1e-5
    for j in range(model.cfg.linear_conv_kernel_dim - 1):
        assert rel_err(cache.conv[:, :, (last - j) % cache.conv_slots],
                       ref.conv[:, :, (last - j) % ref.conv_slots]) <= 1e-5
    torch.testing.assert_close(cache.k[:, :, :, :last + 1], ref.k[:, :, :, :last + 1])
    nxt = torch.tensor([[7, 3]])
    a, _ = model(nxt, torch.tensor([[last + 1, last + 2]]), cache)
    b, _ = model(nxt, torch.tensor([[last + 1, last + 2]]), ref)
    assert rel_err(a, b) <= 1e-5


def test_a_tree_the_hybrid_cannot_follow_is_refused(checkpoints):
    from flashdraft.tree import TreeMask

    model = load_model(checkpoints["hybrid"], torch.float32, "cpu").model
    cache = model.new_cache(1, 64, torch.float32, "cpu", steps=8, tree_nodes=8)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        model(ids[:, :8], torch.arange(8)[None], cache)
        bad = TreeMask.from_parents([-1, 0, 1, 1, 3])  # a child of a leaf: two paths
        with pytest.raises(ValueError, match="a chain and leaves beside it"):
            model(ids[:, 8:13], torch.arange(8, 13)[None], cache, tree=bad)
        with pytest.raises(ValueError, match="steps >= 6 and tree_nodes >= 6"):
            small = model.new_cache(1, 64, torch.float32, "cpu", steps=3)
            model(ids[:, 8:14], torch.arange(8, 14)[None], small,
                  tree=TreeMask.from_parents([-1, 0, 1, 2, 3, 4]))


# -- the engine over a hybrid target ------------------------------------------------------------

PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "for i in range(10):\n    print(i)\nfor"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(checkpoints):
    llm = LLM(checkpoints["engine"], device="cpu", dtype="float32")
    llm.engine.adaptive = False  # k drafts at every step
    return llm


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in target.generate(PROMPTS, GREEDY, draft=None)]


def test_plain_greedy_equals_transformers_generate(checkpoints, target, plain):
    ref = reference(checkpoints["engine"])
    for prompt, want in zip(PROMPTS, plain):
        ids = torch.tensor([target.tokenizer.encode(prompt)])
        out = ref.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == want


class ScriptedDrafter:
    """Drafts the plain output's next k tokens with the one at index `wrong` changed: every
    step of a verification accepts exactly `wrong` drafts (all, where fewer are drafted)."""
    hidden_layers = ()

    def __init__(self, sequences: dict[int, list[int]], wrong: int, vocab: int):
        self.sequences, self.wrong, self.vocab = sequences, wrong, vocab

    def begin(self, prompt):
        self.sequence = self.sequences[len(prompt)]

    def propose(self, ctx, k):
        draft = self.sequence[len(ctx.tokens):len(ctx.tokens) + k]
        if self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 1) % self.vocab
        return Draft(torch.tensor([draft]))

    def commit(self, tokens):
        pass


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_constructed_rejections_change_no_token(target, plain, k, where):
    wrong = {"first": 0, "middle": k // 2, "last": k - 1}[where]
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    sequences = {len(p): p + want for p, want in zip(prompts, plain)}
    assert len(sequences) == len(prompts)
    drafter = ScriptedDrafter(sequences, wrong, target.target.config.vocab_size)
    for prompt, want in zip(prompts, plain):
        metrics = RequestMetrics()
        steps = list(target.engine.run(prompt, GREEDY, drafter, k, metrics))
        assert [t for s in steps for t in s.token_ids] == want
        assert metrics.accepted_per_step == [wrong if d > wrong else d
                                             for d in metrics.drafted_per_step]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_plain(checkpoints, target, plain, k):
    """A draft model (a Qwen2 of the same embeddings: often right, not always) and n-gram."""
    for draft in (checkpoints["draft"], "ngram"):
        outs = target.generate(PROMPTS, GREEDY, draft=draft, num_speculative_tokens=k)
        assert [o.token_ids for o in outs] == plain
    accepted = [n for o in target.generate(PROMPTS, GREEDY, draft=checkpoints["draft"],
                                           num_speculative_tokens=k)
                for n in o.metrics.accepted_per_step]
    assert 0 in accepted and k in accepted  # rejections and whole acceptances
    if k > 2:
        assert any(0 < n < k for n in accepted)


@pytest.mark.parametrize("k", [2, 5])
def test_a_hybrid_draft_model_changes_no_token(checkpoints, target, plain, k):
    """A Qwen3.5 hybrid as the draft model: each rejection rolls its recurrent states back."""
    outs = target.generate(PROMPTS, GREEDY, draft=checkpoints["hybrid-draft"],
                           num_speculative_tokens=k)
    assert [o.token_ids for o in outs] == plain
    accepted = [n for o in outs for n in o.metrics.accepted_per_step]
    assert any(n < k for n in accepted)  # some drafts were rejected


@pytest.mark.parametrize("widths, budget", [((3, 2, 2), 0), ((), 12)])
def test_token_trees_over_the_hybrid_change_no_token(checkpoints, target, plain, widths, budget):
    """Trees of the draft models' spines and next best tokens (fixed widths, and the cost
    model's under a node budget), verified by the hybrid: plain decoding's tokens, with leaves
    accepted where the spine missed (a leaf's state then put in place)."""
    engine = target.engine
    engine.tree_widths, engine.tree_budget, engine.adaptive = widths, budget, bool(budget)
    try:
        for draft in (checkpoints["draft"], checkpoints["hybrid-draft"]):
            outs = target.generate(PROMPTS, GREEDY, draft=draft, num_speculative_tokens=4)
            assert [o.token_ids for o in outs] == plain
            if not budget:
                assert sum(o.metrics.leaf_steps for o in outs) > 0
    finally:
        engine.tree_widths, engine.tree_budget, engine.adaptive = (), 0, False


def test_dflash_over_the_hybrid_target_changes_no_token(checkpoints, target, plain, tmp_path):
    """A (random) DFlash drafter reading the hybrid's hidden states from each verification."""
    drafter = build_dflash_drafter(tmp_path / "dflash", checkpoints["engine"],
                                   target_layer_ids=(1, 2), block_size=4)
    outs = target.generate(PROMPTS, GREEDY, draft=f"dflash:{drafter}", num_speculative_tokens=3)
    assert [o.token_ids for o in outs] == plain
    target.engine.tree_widths = (3, 2)  # and as trees of its block's next best tokens
    try:
        outs = target.generate(PROMPTS, GREEDY, draft=f"dflash:{drafter}",
                               num_speculative_tokens=3)
    finally:
        target.engine.tree_widths = ()
    assert [o.token_ids for o in outs] == plain


# -- T > 0: the engine samples from the hybrid target's distribution -----------------------------

V = 8
SAMPLED_PROMPT = [1, 5, 2]


def tiny_pair():
    """A hybrid target and a dense draft model of 8 tokens, random weights."""
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    cfg = ModelConfig(arch="qwen3_5", num_layers=2, layer_types=(LIN, FULL),
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, partial_rotary_factor=0.5, attn_output_gate=True,
                      qk_norm=True, **common)
    models = []
    for seed, model in ((0, HybridTransformer(cfg)),
                        (1, Transformer(ModelConfig(arch="qwen2", num_layers=1, **common)))):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-1.0, 0.5)
                elif p.dim() >= 2:
                    p.normal_(0, 0.6)
                else:
                    p.uniform_(-0.2, 0.2)
        models.append(model.eval())
    return models


def exact_joint(model, params):
    """P(token 2, token 3) under plain sampling from the target: [V, V], from the next-token
    distributions after the prompt and each continuation of it by one and two tokens (one
    batched pass each)."""
    def next_probs(continuations):  # [n, c] -> [n, V]
        seqs = torch.cat([torch.tensor(SAMPLED_PROMPT).expand(len(continuations), -1),
                          continuations], dim=1)
        cache = model.new_cache(len(seqs), 16, torch.float32, "cpu")
        logits, _ = model(seqs, torch.arange(seqs.shape[1]).expand(len(seqs), -1), cache)
        return probs_from_logits(logits[:, -1], params.temperature, params.top_k,
                                 params.top_p).double()

    one = torch.arange(V).view(V, 1)
    two = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # rows (t1, t2)
    with torch.no_grad():
        p1 = next_probs(one[:0].view(1, 0))[0]  # [V]
        p2 = next_probs(one)  # [t1, t2]
        p3 = next_probs(two).view(V, V, V)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


@pytest.mark.parametrize("widths", [(), (3, 2)])
def test_sampled_speculation_samples_from_the_target(widths):
    """Tokens 2 and 3 come from one speculative step of k = 2 (the draft model's own q; as a
    chain, and as a tree with the draft model's next best tokens beside each draft), over 2000
    seeds; chi-square against the exact joint distribution."""
    target, draft = tiny_pair()
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    engine = Engine(target, torch.device("cpu"), torch.float32, 64, (), adaptive=False,
                    tree_widths=widths)
    drafter = DraftModelDrafter(draft, torch.device("cpu"), torch.float32, V)
    counts = torch.zeros(V * V, dtype=torch.float64)
    n, leaf_steps = 2000, 0
    for seed in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        metrics = RequestMetrics()
        tokens = [t for s in engine.run(SAMPLED_PROMPT, p, drafter, 2, metrics)
                  for t in s.token_ids]
        counts[tokens[1] * V + tokens[2]] += 1
        leaf_steps += metrics.leaf_steps
    if widths:  # the leaves took part: some steps' accepted paths ended in one
        assert leaf_steps > 0.05 * n
    expected = exact_joint(target, params).flatten() * n
    keep = expected > 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert stats.chisquare(obs.numpy(), (exp / exp.sum() * n).numpy()).pvalue > 1e-3


# -- bad input ----------------------------------------------------------------------------------

def edited_copy(src, dst, config=None, drop=()):
    shutil.copytree(src, dst)
    if config is not None:
        d = json.loads((dst / "config.json").read_text())
        config(d)
        (dst / "config.json").write_text(json.dumps(d))
    if drop:
        weights = load_file(dst / "model.safetensors")
        for name in drop:
            del weights[name]
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_an_unsupported_layer_type_is_refused(checkpoints, tmp_path):
    def sliding(d):
        d["layer_types"][1] = "sliding_attention"

    path = edited_copy(checkpoints["hybrid"], tmp_path / "m", config=sliding)
    with pytest.raises(ValueError, match="layer 1 has layer type 'sliding_attention'"):
        load_model(path, torch.float32, "cpu")


def test_a_missing_tensor_is_named(checkpoints, tmp_path):
    name = "model.language_model.layers.2.linear_attn.A_log"
    path = edited_copy(checkpoints["multimodal"], tmp_path / "m", drop=[name])
    with pytest.raises(ValueError, match=f"no tensor '{name}' \\(layer 2 is a linear_attention"):
        load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(model_type="qwen3_5_moe"), "MoE"),
    (lambda d: d["layer_types"].pop(), "layer_types lists 3 layers for num_hidden_layers=4"),
    (lambda d: d.update(attn_output_gate=False), "attn_output_gate"),
])
def test_a_config_the_hybrid_cannot_run_is_refused(checkpoints, edit, message):
    d = json.loads(open(f"{checkpoints['hybrid']}/config.json").read())
    edit(d)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(d)


def test_a_multimodal_config_reads_its_text_model(checkpoints):
    cfg = ModelConfig.from_hf(json.loads(open(f"{checkpoints['multimodal']}/config.json").read()))
    assert cfg.arch == "qwen3_5" and cfg.layer_types == (LIN, FULL, LIN)
    assert cfg.rotary_dim == 8 and cfg.linear_num_value_heads == 4
