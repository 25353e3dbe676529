"""Token trees in the engine: a draft model's spine with its next best tokens beside each
position (`tree.SpineTree`), verified in one pass. Greedy tree output is plain decoding's, token
for token; the verifiers' rules are checked on hand-built rows (the statistical test of sampled
trees end to end is in test_engine_sampling.py)."""
import pytest
import torch

from flashdraft import SamplingParams
from flashdraft.config import EngineConfig
from flashdraft.sampling import make_rng
from flashdraft.tree import SpineTree, alternatives, spine_leaves, spine_tree
from flashdraft.verify import SpineTreeGreedy, SpineTreeVerify

# The target and its plain output, as the chains' losslessness tests have them.
from tests.test_speculative import PROMPTS, plain, target  # noqa: E402,F401


def generate(target, draft, k, widths, params, adaptive=False, budget=0):
    engine = target.engine
    engine.adaptive, engine.tree_widths, engine.tree_budget = adaptive, widths, budget
    try:
        return target.generate(PROMPTS, params, draft=draft, num_speculative_tokens=k)
    finally:
        engine.adaptive, engine.tree_widths, engine.tree_budget = True, (), 0


@pytest.mark.parametrize("drafter", ["perfect", "poor"])
@pytest.mark.parametrize("k, widths", [(1, (4,)), (3, (3, 2)), (4, (2, 2, 2, 2)), (6, (5, 1, 3))])
def test_greedy_tree_speculation_equals_plain(target, plain, tiny_models, drafter, k, widths):
    name = tiny_models["qwen2"] if drafter == "perfect" else tiny_models["qwen2-draft"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = generate(target, name, k, widths, params)
    assert [o.token_ids for o in outs] == plain
    for o in outs:
        m = o.metrics
        assert m.accepted_tokens == sum(m.accepted_per_step) <= m.drafted_tokens
        assert all(n <= d for n, d in zip(m.accepted_per_step, m.drafted_per_step))
    if drafter == "perfect":  # the spine is the target's own argmax: no leaf is ever needed
        assert all(o.metrics.acceptance_rate == 1.0 and o.metrics.leaf_steps == 0 for o in outs)


def test_leaves_accept_what_the_spine_missed(target, plain, tiny_models):
    """A poor draft model: the tree keeps more tokens a step than its spine alone (a chain),
    with the same output."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    chain = generate(target, tiny_models["qwen2-draft"], 3, (), params)
    tree = generate(target, tiny_models["qwen2-draft"], 3, (4, 4, 4), params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in chain] == plain
    assert sum(o.metrics.leaf_steps for o in tree) > 0
    assert sum(o.metrics.target_passes for o in tree) < sum(o.metrics.target_passes for o in chain)


def test_the_planner_choosing_tree_chain_or_plain_changes_no_token(target, plain, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for name in (tiny_models["qwen2-draft"], "ngram+" + tiny_models["qwen2-draft"]):
        outs = generate(target, name, 4, (4, 3), params, adaptive=True)
        assert [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("adaptive", [True, False])
def test_trees_shaped_under_a_node_budget_change_no_token(target, plain, tiny_models, adaptive,
                                                          monkeypatch):
    """tree_budget: the planner chooses each step's widths among scheduling.tree_shapes (or,
    without a planner, takes the first); greedy output is plain decoding's."""
    from flashdraft.scheduling import tree_shapes

    drafter = target.get_drafter(tiny_models["qwen2-draft"])
    asked, propose = [], drafter.propose
    monkeypatch.setattr(drafter, "propose",
                        lambda ctx, k: asked.append((k, ctx.tree_widths)) or propose(ctx, k))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = generate(target, tiny_models["qwen2-draft"], 5, (), params, adaptive, budget=9)
    assert [o.token_ids for o in outs] == plain
    for k, widths in asked:  # the drafter is asked for the chain or one of k's shapes
        assert widths == () or tuple(w - 1 for w in widths) in tree_shapes((), 9, k)
    if not adaptive:  # every step the middle profile's tree, trimmed to 9 nodes
        assert {w for k, w in asked if k == 5} == {(3, 2, 2, 1, 1)}


def test_tree_budget_settings():
    from flashdraft.cli import build_parser, tree_widths_from

    cfg = EngineConfig(model="m", tree_widths="auto")
    assert cfg.tree_widths == () and cfg.tree_budget == 16
    assert EngineConfig(model="m", tree_widths="auto", tree_budget=8).tree_budget == 8
    assert EngineConfig(model="m", tree_budget=8).tree_widths == ()
    with pytest.raises(ValueError, match="give one of the two"):
        EngineConfig(model="m", tree_widths=(3, 2), tree_budget=8)
    for bad in (1, 63, -2, True, "8"):
        with pytest.raises(ValueError, match="tree_budget must be"):
            EngineConfig(model="m", tree_budget=bad)
    assert tree_widths_from("auto") == "auto" and tree_widths_from("3,2") == (3, 2)
    args = build_parser().parse_args(["generate", "--model", "m", "--tree-budget", "12", "x"])
    assert args.tree_budget == 12


def test_tree_shapes_and_alternatives():
    tree = spine_tree(3, (2, 0, 1), "cpu")
    assert tree is spine_tree(3, [2, 0, 1], "cpu")  # one object a shape: graphs key on it
    assert SpineTree.parents(3, (2, 0, 1)) == [-1, 0, 1, 2, 0, 0, 2]
    assert tree.size == 6 and tree.leaf_rows.tolist() == [0, 0, 2]
    assert tree.mask.depth.tolist() == [0, 1, 2, 3, 1, 1, 3]
    assert tree.path(2, -1) == [0, 1] and tree.path(0, 4) == [4]
    assert spine_leaves((3, 2), 4) == (2, 1, 0, 0) and spine_leaves((), 2) == (0, 0)
    row = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0]])
    assert alternatives(row, torch.tensor([1]), [2]).tolist() == [3, 2]
    assert alternatives(row, torch.tensor([2]), [2]).tolist() == [1, 3]  # the chosen one skipped
    rows = torch.cat([row, row.flip(1), row])
    assert alternatives(rows, torch.tensor([1, 0, 4]), [1, 0, 3]).tolist() == [3, 1, 3, 2]
    with pytest.raises(ValueError, match="leaf counts"):
        spine_tree(2, (1,), "cpu")
    with pytest.raises(ValueError, match="tree_widths"):
        EngineConfig(model="m", tree_widths=(3, 0))


def rows_for(best):
    """Logits [1, len(best), V] whose row i has its argmax at best[i]."""
    logits = torch.zeros(1, len(best), 6)
    logits[0, torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_tree_verifier():
    tree = spine_tree(3, (2, 1, 0), "cpu")  # nodes: spine 0-2, leaves 3, 4 (depth 1), 5 (depth 2)
    post = SpineTreeGreedy(tree)
    last = 0
    nodes = [1, 2, 3, 4, 5, 1]  # spine 1 2 3; depth-1 leaves 4 5; depth-2 leaf 1
    tokens = torch.tensor([[last] + nodes])
    # rows: root, spine 0-2, leaves 3-5
    cases = [  # (argmax of each pass row, n, leaf, next token)
        ([1, 2, 3, 0, 0, 0, 0], 3, -1, 0),  # the whole spine, bonus from the last spine row
        ([5, 0, 0, 0, 0, 2, 0], 0, 4, 2),  # spine rejected at depth 1, leaf 4 (token 5) kept
        ([1, 1, 0, 0, 0, 0, 3], 1, 5, 3),  # depth 2: leaf 5 (token 1), bonus from its row
        ([1, 0, 0, 0, 0, 0, 0], 1, -1, 0),  # depth 2 rejected, no leaf matches: the argmax
        ([1, 2, 4, 0, 0, 0, 0], 2, -1, 4),  # depth 3 has no leaves
    ]
    for best, n, leaf, nxt in cases:
        out = post(tokens, rows_for(best)).tolist()
        assert out[:3] == [n, leaf, nxt] and out[3:] == nodes, best


def test_sampled_tree_verifier_keeps_the_target_distribution():
    """One depth of leaves, one-hot drafts: over many draws, the first token is distributed as
    p (exact enumeration is the statistical test's job end to end; here, the law of large
    numbers on a hand-built row, and the leaf is kept exactly as often as its mass says)."""
    tree = spine_tree(1, (2,), "cpu")
    logits = torch.log(torch.tensor([[[0.1, 0.4, 0.3, 0.2, 1e-9, 1e-9],
                                      [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]] + [[1.0] * 6] * 2]))
    tokens = torch.tensor([[0, 1, 2, 3]])  # spine token 1, leaves 2 and 3
    rng = make_rng(3)
    post = SpineTreeVerify(tree, 1.0, 0, 1.0, 0.0, rng, fused=False, vocab=6, with_q=False)
    first = torch.zeros(6)
    leaf_kept = 0
    n_draws = 4000
    for _ in range(n_draws):
        n, leaf, nxt = post(tokens, logits).tolist()[:3]
        token = 1 if n == 1 else tokens[0, 1 + leaf].item() if leaf >= 0 else nxt
        first[token] += 1
        leaf_kept += leaf >= 0
    p = torch.softmax(logits[0, 0], -1)
    assert torch.allclose(first / n_draws, p, atol=0.025)
    assert abs(leaf_kept / n_draws - 0.5) < 0.03  # p(2) + p(3): the leaves' whole mass
