"""The acceptance rule: hand-built edge cases, and a statistical test that it is lossless."""
import pytest
import torch
from scipy import stats

from flashdraft.sampling import probs_from_logits, sample
from flashdraft.verify import verify_greedy, verify_sampled

V = 6


def onehot(i, v=V):
    t = torch.zeros(v)
    t[i] = 1.0
    return t


def test_greedy_prefix_match():
    logits = torch.full((1, 4, V), -5.0)
    for i, t in enumerate([2, 3, 1, 4]):
        logits[0, i, t] = 5.0
    n, nxt = verify_greedy(torch.tensor([[2, 3, 1]]), logits)
    assert (n.item(), nxt.item()) == (3, 4)  # all accepted, bonus = argmax after the block
    n, nxt = verify_greedy(torch.tensor([[2, 5, 1]]), logits)
    assert (n.item(), nxt.item()) == (1, 3)  # second rejected, the target's own token instead
    n, nxt = verify_greedy(torch.tensor([[0, 3, 1]]), logits)
    assert (n.item(), nxt.item()) == (0, 2)
    n, nxt = verify_greedy(torch.empty(1, 0, dtype=torch.long), logits[:, :1])
    assert (n.item(), nxt.item()) == (0, 2)  # k = 0: plain decoding


def test_all_accepted_draws_the_bonus_from_the_last_position():
    p = torch.stack([onehot(2), onehot(3), onehot(5)])[None]  # [1, 3, V]
    q = torch.stack([onehot(2), onehot(3)])[None]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n, nxt = verify_sampled(torch.tensor([[2, 3]]), q, p, g)
        assert (n.item(), nxt.item()) == (2, 5)


def test_first_rejected_recovers_from_the_residual():
    p = torch.stack([torch.tensor([0.0, 0.5, 0.5, 0, 0, 0]), onehot(3), onehot(5)])[None]
    q = torch.stack([torch.tensor([0.0, 0.0, 1.0, 0, 0, 0]), onehot(3)])[None]
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        n, nxt = verify_sampled(torch.tensor([[2, 3]]), q, p, g)
        if n.item() == 0:
            seen.add(nxt.item())  # residual max(p - q, 0) = mass on token 1 only
    assert seen == {1}


def test_token_the_target_rules_out_is_never_accepted():
    p = torch.stack([torch.tensor([0.0, 1.0, 0, 0, 0, 0]), onehot(4)])[None]
    for q in (torch.ones(1, 1, V) / V, None):
        n, nxt = verify_sampled(torch.tensor([[0]]), q, p, torch.Generator().manual_seed(1))
        assert (n.item(), nxt.item()) == (0, 1)


def test_q_zero_where_p_positive_is_always_accepted():
    p = torch.stack([torch.full((V,), 1 / V), onehot(4)])[None]
    q = torch.zeros(1, 1, V)  # a drafter that claims zero mass: min(1, p/0) = 1
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n, nxt = verify_sampled(torch.tensor([[3]]), q, p, g)
        assert (n.item(), nxt.item()) == (1, 4)


def test_one_hot_q_accepts_with_probability_p_and_never_resamples_the_draft():
    probs = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.1, 0.1])
    n_rows = 20000
    p = torch.stack([probs, onehot(0)]).expand(n_rows, 2, V)
    draft = torch.full((n_rows, 1), 1)
    n, nxt = verify_sampled(draft, None, p, torch.Generator().manual_seed(0))
    rate = n.float().mean().item()
    assert abs(rate - 0.3) < 0.02
    assert not (nxt[n == 0] == 1).any()  # the residual excludes the rejected draft


# --- statistical test: the output distribution of the next two tokens is the target's -----

def two_token_samples(p1, p2, q1, q2, n, seed, rule=verify_sampled):
    """Draft d1 ~ q1, d2 ~ q2[d1]; verify; complete to two tokens as the engine would."""
    g = torch.Generator().manual_seed(seed)
    d1 = sample(q1.expand(n, V), g)
    d2 = sample(q2[d1], g)
    draft = torch.stack([d1, d2], 1)
    p = torch.stack([p1.expand(n, V), p2[d1], torch.full((n, V), 1 / V)], 1)  # [n, 3, V]
    q = torch.stack([q1.expand(n, V), q2[d1]], 1)
    acc, nxt = rule(draft, q, p, g)
    x1 = torch.where(acc >= 1, d1, nxt)
    follow = sample(p2[x1], g)  # a rejection at position 1 needs one more plain step
    x2 = torch.where(acc >= 2, d2, torch.where(acc == 1, nxt, follow))
    return x1 * V + x2


def chi2_pvalue(samples, p1, p2):
    expected = (p1[:, None] * p2).double().flatten() * len(samples)
    observed = torch.bincount(samples, minlength=V * V).double()
    keep = expected > 5  # cells the target gives (almost) no mass must stay empty
    assert observed[expected == 0].sum() == 0
    rest_o, rest_e = observed[~keep].sum(), expected[~keep].sum()
    obs = torch.cat([observed[keep], rest_o[None]]) if rest_e > 0 else observed[keep]
    exp = torch.cat([expected[keep], rest_e[None]]) if rest_e > 0 else expected[keep]
    exp = exp / exp.sum() * obs.sum()  # float32 tables: renormalise in float64
    return stats.chisquare(obs.numpy(), exp.numpy()).pvalue


def tables(seed, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits_p1, logits_p2 = torch.randn(V, generator=g) * 2, torch.randn(V, V, generator=g) * 2
    logits_q1, logits_q2 = torch.randn(V, generator=g) * 2, torch.randn(V, V, generator=g) * 2
    f = lambda x: probs_from_logits(x, temperature, top_k, top_p)
    return f(logits_p1), f(logits_p2), f(logits_q1), f(logits_q2)


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.8), (1.3, 3, 0.9)]


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_sampled_distribution_equals_target(temperature, top_k, top_p):
    p1, p2, q1, q2 = tables(11, temperature, top_k, top_p)
    samples = two_token_samples(p1, p2, q1, q2, n=40000, seed=5)
    assert chi2_pvalue(samples, p1, p2) > 1e-3


def test_one_hot_drafts_keep_the_distribution():
    p1, p2, _, _ = tables(3, 1.0, 0, 1.0)
    g = torch.Generator().manual_seed(9)
    n = 40000
    draft = torch.tensor([[2, 4]]).expand(n, 2)  # a deterministic drafter, e.g. n-gram lookup
    p = torch.stack([p1.expand(n, V), p2[torch.full((n,), 2)], torch.full((n, V), 1 / V)], 1)
    acc, nxt = verify_sampled(draft, None, p, g)
    x1 = torch.where(acc >= 1, draft[:, 0], nxt)
    x2 = torch.where(acc >= 2, draft[:, 1], torch.where(acc == 1, nxt, sample(p2[x1], g)))
    assert chi2_pvalue(x1 * V + x2, p1, p2) > 1e-3


def broken_rule(draft, q, p, generator):
    """Accept by min(1, p/q) but resample from p instead of the residual: a classic bug."""
    acc, _ = verify_sampled(draft, q, p, generator)
    rows = torch.arange(len(acc))
    return acc, sample(p[rows, acc], generator)


def test_the_statistical_test_has_power():
    p1, p2, q1, q2 = tables(11, 1.0, 0, 1.0)
    samples = two_token_samples(p1, p2, q1, q2, n=40000, seed=5, rule=broken_rule)
    assert chi2_pvalue(samples, p1, p2) < 1e-6


def test_top_k_top_p_shape_the_distribution():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert (probs_from_logits(logits, 1.0, top_k=2)[0, 2:] == 0).all()
    probs = probs_from_logits(logits, 1.0, top_p=0.7)
    full = logits.softmax(-1)[0]
    assert full[0] < 0.7 < full[0] + full[1]  # so exactly two tokens remain
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum() == pytest.approx(1.0)
    assert probs_from_logits(logits, 1.0, top_p=0.01)[0, 0] == 1.0


FUSED_MODES = [False, pytest.param(True, marks=pytest.mark.skipif(
    not (torch.cuda.is_available() or __import__("flashdraft.backends.kernels",
                                                 fromlist=["INTERPRET"]).INTERPRET),
    reason="the fused kernels need a GPU or TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("fused", FUSED_MODES)
def test_sampled_verify_post_edge_cases(fused):
    """SampledVerify, the acceptance rule as a graph's post, where the outcome is certain: a
    draft the target gives no mass (top-k cuts it) is rejected and never the next token; a
    draft whose q is p is always kept, and all kept gives the bonus token from the last row;
    a one-hot draft of a token with all the target's mass is kept."""
    from flashdraft.sampling import make_rng
    from flashdraft.verify import SampledVerify
    dev = torch.device("cuda" if fused and torch.cuda.is_available() else "cpu")
    logits = torch.randn(1, 4, V, generator=torch.Generator().manual_seed(0)).to(dev)
    logits[0, 0, 2] = 30.0  # d_1 = 2: p = 1 in float32
    logits[0, 1, 5] = -9.0  # d_2 = 5: outside the top 2
    tokens = torch.tensor([[0, 2, 5, 1]], device=dev)
    rng = make_rng(3, dev)
    for seed in range(5):
        rng.copy_(make_rng(seed))
        onehot_post = SampledVerify(1.0, 2, 1.0, 0.0, rng, fused=fused, vocab=V, with_q=False)
        n, nxt, *drafts = onehot_post(tokens, logits).tolist()
        top2 = logits[0, 1].topk(2).indices.tolist()
        assert n == 1 and nxt in top2 and drafts == [2, 5, 1]
        q_post = SampledVerify(1.0, 2, 1.0, 0.0, rng, fused=fused, vocab=V, with_q=True,
                               capacity=3)
        q_post.load(logits[0, :3])
        counter = int(rng[1])
        n, nxt, *_ = q_post(tokens, logits).tolist()
        # d_2 = 5 has p = q = 0 (u · q < p fails): rejected; max(p - q, 0) = 0 there, so the
        # next token comes from p
        assert n == 1 and nxt in top2
        assert int(rng[1]) == counter + 1  # one step, one advance
    same = torch.tensor([[0, 2, 3, 4]], device=dev)  # q = p everywhere: all kept
    for seed in range(5):
        rng.copy_(make_rng(seed))
        wide = SampledVerify(1.0, 0, 1.0, 0.0, rng, fused=fused, vocab=V, with_q=True,
                             capacity=3)
        wide.load(logits[0, :3])
        n, nxt, *_ = wide(same, logits).tolist()
        assert n == 3 and 0 <= nxt < V
