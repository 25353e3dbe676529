"""The fused sampling kernels (flashdraft.backends.sampling_kernels) against the sort-based
reference (flashdraft.sampling), on the CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1) or on the GPU. Small capacities and few bins make the descent's deeper
levels and the exact (bisection) path run too."""
import pytest
import torch

from flashdraft import sampling as S
from flashdraft.backends import sampling_kernels as K

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not CUDA and not K.INTERPRET,
                                reason="the fused kernels need a GPU or Triton's interpreter")
# Small sizes: the interpreter's cost is per program and per operation.
KW = dict(capacity=64, num_bins=32, chunk=256, sub=256)


def check_stats(logits, temperature, top_k, top_p, min_p, **kw):
    got = S.row_stats(logits, temperature, top_k, top_p, min_p, fused=True, **{**KW, **kw})
    want = S.row_stats_reference(logits, temperature, top_k, top_p, min_p)
    args = (temperature, top_k, top_p, min_p)
    assert torch.equal(got.m, want.m), args
    assert torch.equal(got.t, want.t), (args, got.t, want.t)
    torch.testing.assert_close(got.z, want.z, rtol=1e-5, atol=0, msg=lambda m: f"{args}: {m}")
    s = S.scaled(logits, temperature)
    assert torch.equal(s >= got.t[:, None], s >= want.t[:, None]), args


@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
def test_row_stats_random_rows(top_k):
    g = torch.Generator().manual_seed(top_k)
    scale = torch.tensor([0.3, 1.0, 3.0, 6.0])[:, None]
    logits = (torch.randn(4, 700, generator=g) * scale).to(DEV)
    for i, (top_p, min_p) in enumerate([(1.0, 0.0), (0.9, 0.0), (0.5, 0.0), (1.0, 0.05),
                                        (0.9, 0.05), (0.5, 0.05)]):
        check_stats(logits, (0.5, 1.0, 1.5)[i % 3], top_k, top_p, min_p)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (3, 0.5)])
def test_each_rows_stats_are_its_own(top_k, top_p):
    """A row's stats do not depend on the rows beside it (so p's and q's rows are found in one
    pass, `SampledVerify.stats_pq`): rows alone, in pairs and all at once, bit for bit."""
    g = torch.Generator().manual_seed(top_k)
    scale = torch.tensor([0.3, 1.0, 3.0, 6.0, 0.01])[:, None]
    logits = (torch.randn(5, 700, generator=g) * scale).to(DEV)
    whole = S.row_stats(logits, 0.8, top_k, top_p, fused=True, **KW)
    for rows in ([0], [1, 2], [3, 4], [4, 0, 2]):
        part = S.row_stats(logits[rows], 0.8, top_k, top_p, fused=True, **KW)
        for got, want in zip(part, whole):
            assert torch.equal(got, want[rows]), rows


def adversarial_rows():
    """Rows that make the cut hard: each a [V] float32 tensor with its name."""
    v = 600
    one = torch.full((v,), -5.0)
    one[17] = 20.0  # all the mass on one token; the rest a flat floor
    ties_p = torch.full((v,), -8.0)
    ties_p[:3] = 2.0  # three tied tokens of ~1/3 each: top_p 0.5 cuts through them
    ties_p[3:9] = 1.0
    ties_k = torch.linspace(3.0, -3.0, v)
    ties_k[:4] = 4.0
    ties_k[4:12] = 3.5  # top_k 5 or 12 lands inside or at the end of the tie
    flat = torch.zeros(v)  # every token a candidate: past any capacity
    g = torch.Generator().manual_seed(3)
    bf16 = (torch.randn(v, generator=g) * 2).bfloat16().float()  # many exact ties
    near_flat = torch.randn(v, generator=g) * 0.05
    return {"one": one, "ties_p": ties_p, "ties_k": ties_k, "flat": flat, "bf16": bf16,
            "near_flat": near_flat}


@pytest.mark.parametrize("params", [(1.0, 0, 0.5, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 12, 0.9, 0.0),
                                    (0.7, 1, 1.0, 0.0), (1.3, 0, 0.9, 0.05), (1.0, 50, 0.5, 0.05),
                                    (1.0, 0, 1.0, 0.05), (1.0, 0, 0.95, 0.0)])
def test_row_stats_adversarial_rows(params):
    rows = adversarial_rows()
    logits = torch.stack(list(rows.values())).to(DEV)
    check_stats(logits, *params)


def test_flat_row_takes_the_exact_path_and_large_capacity_does_not():
    logits = torch.stack([torch.zeros(600), torch.randn(600) * 4]).to(DEV)
    *_, flagged = K.row_stats(logits, 1.0, 5, 0.9, 0.0, **KW)
    assert flagged.tolist() == [1, 0]
    check_stats(logits, 1.0, 5, 0.9, 0.0)
    check_stats(logits, 1.0, 50, 0.9, 0.0, capacity=1024)
    check_stats(logits, 1.0, 0, 1.0, 0.0)  # nothing to cut: t = -inf, z = the row's mass


@pytest.mark.parametrize("params", [(1.0, 0, 0.95, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.02),
                                    (1.0, 0, 0.9, 0.05), (1.0, 20, 0.95, 0.0), (1.0, 50, 1.0, 0.0)])
def test_wide_flat_and_peaked_rows_settle_without_the_exact_path(params):
    """Rows whose cut cell holds many more tokens than the capacity (a flat row of 6,000
    tokens) or lies far below the max (a peaked row: one token 40 nats above the rest) are
    settled by the descent's deeper levels, not by the exact kernel."""
    g = torch.Generator().manual_seed(9)
    flat = torch.randn(6000, generator=g) * 0.2
    peaked = torch.randn(6000, generator=g) * 2.0
    peaked[123] = 45.0
    wide = torch.randn(6000, generator=g) * 3.0
    logits = torch.stack([flat, peaked, wide]).to(DEV)
    kw = dict(capacity=64, num_bins=32, chunk=512, sub=512)
    *_, flagged = K.row_stats(logits, *params, **kw)
    assert flagged.tolist() == [0, 0, 0], params
    check_stats(logits, *params, **kw)


def test_ties_share_one_fate():
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 0.0, -1.0] * 50]).to(DEV)
    got = S.row_stats(logits, 1.0, 1, 1.0, 0.0, fused=True, **KW)
    assert (logits >= got.t[:, None]).sum().item() == 150  # top_k 1 keeps every tied max
    p = S.probs_from_logits(logits, 1.0, top_p=0.2)
    assert torch.equal(p > 0, logits == 2.0)


def test_probs_from_logits_matches_plain_softmax_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 300, generator=g) * 2
    p = S.probs_from_logits(logits, 0.8, top_k=20, top_p=0.9, min_p=0.02)
    assert p.shape == logits.shape
    torch.testing.assert_close(p.sum(-1), torch.ones(3, 2))
    s = logits / 0.8
    kth = s.topk(20, -1).values[..., -1:]
    assert torch.all((p > 0) <= (s >= kth))
    assert torch.all((p > 0) <= (s.softmax(-1) >= 0.02 * s.softmax(-1).amax(-1, keepdim=True)))
    torch.testing.assert_close(S.probs_from_logits(logits, 0.8), s.softmax(-1))


@pytest.mark.parametrize("bad, message", [(dict(temperature=0.0), "temperature"),
                                          (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
                                          (dict(min_p=1.0), "min_p")])
def test_bad_params_are_refused(bad, message):
    args = {**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **bad}
    with pytest.raises(ValueError, match=message):
        S.row_stats(torch.zeros(1, 8), fused=False, **args)


N_DRAWS = 20000
RACE_KW = dict(block=64, rows_per_program=1024)


def draw(logits_row, temperature, params, rng, q_row=None, n=N_DRAWS):
    """n draws in one call: n copies of the row, each its own Philox stream."""
    logits = logits_row.expand(n, -1).contiguous()
    stats = S.row_stats(logits[:1], temperature, *params, fused=True, **KW)
    stats = S.RowStats(*(x.expand(n).contiguous() for x in stats))
    kw = {}
    if q_row is not None:
        q = q_row.expand(n, -1).contiguous()
        q_stats = S.row_stats_reference(q[:1], temperature, *params)
        kw = dict(q_logits=q, q_stats=S.RowStats(*(x.expand(n).contiguous() for x in q_stats)))
    tokens = S.race(logits, temperature, stats, rng, fused=True, **kw, **RACE_KW)
    return tokens, stats


def chi_square_p(counts, expected):
    from scipy.stats import chisquare
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the kept set was drawn"
    e = expected[keep].double()
    return chisquare(counts[keep].double().numpy(), (e / e.sum() * counts.sum()).numpy()).pvalue


@pytest.mark.parametrize("with_q", [False, True])
def test_race_draws_the_right_distribution(with_q):
    g = torch.Generator().manual_seed(11)
    v, temperature, params = 40, 0.9, (20, 0.95, 0.01)
    logits = torch.randn(v, generator=g) * 1.5
    q_logits = (logits + torch.randn(v, generator=g)).to(DEV) if with_q else None
    logits = logits.to(DEV)
    rng = S.make_rng(1234, DEV)
    tokens, stats = draw(logits, temperature, params, rng, q_logits)
    p = S.probs_from_stats(logits[None], temperature, S.RowStats(*(x[:1] for x in stats)))[0]
    if with_q:
        q = S.probs_from_logits(q_logits, temperature, *params)
        w = (p - q).clamp_min(0)
    else:
        w = p
    counts = torch.bincount(tokens.cpu(), minlength=v)
    p_right = chi_square_p(counts, w.cpu())
    # The test's power: moving 10% of the most likely token's mass elsewhere is rejected.
    wrong = w.cpu().clone()
    top = wrong.argmax()
    wrong[top] *= 0.9
    print(f"chi-square p: right {p_right:.3g}, slightly wrong {chi_square_p(counts, wrong):.3g}")
    assert p_right > 1e-3
    assert chi_square_p(counts, wrong) < 1e-3


def test_race_rng_same_seed_same_tokens_and_counter_advances():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(256, 100, generator=g) * 2).to(DEV)
    stats = S.row_stats(logits, 1.0, fused=True, **KW)
    a, b = S.make_rng(7, DEV), S.make_rng(7, DEV)
    first = S.race(logits, 1.0, stats, a, fused=True, **RACE_KW)
    assert a.tolist() == [7, 1]
    assert torch.equal(first, S.race(logits, 1.0, stats, b, fused=True, **RACE_KW))
    second = S.race(logits, 1.0, stats, a, fused=True, **RACE_KW)
    assert a.tolist() == [7, 2]
    assert (first != second).float().mean() > 0.5
    other_stream = S.race(logits, 1.0, stats, S.make_rng(7, DEV), fused=True, stream=1,
                          **RACE_KW)
    assert (first != other_stream).float().mean() > 0.5


def test_race_onehot_q_and_fallback():
    logits = torch.tensor([[5.0, 4.0, -9.0, -9.0]] * 200).to(DEV)
    stats = S.row_stats(logits, 1.0, 0, 1.0, 0.0, fused=True, **KW)
    rng = S.make_rng(0, DEV)
    drafted = torch.zeros(200, dtype=torch.int64, device=DEV)
    tokens = S.race(logits, 1.0, stats, rng, fused=True, q_onehot=drafted, **RACE_KW)
    assert torch.all(tokens != 0)  # the drafted token is removed from the residual
    # q = p: w = 0 everywhere, so the row draws from p
    tokens = S.race(logits, 1.0, stats, rng, fused=True, q_logits=logits, q_stats=stats,
                    **RACE_KW)
    assert set(tokens.tolist()) <= {0, 1, 2, 3} and (tokens == 0).sum() > 100
    ref = S.race(logits, 1.0, stats, rng, fused=False, q_onehot=drafted)
    assert torch.all(ref != 0) and rng.tolist() == [0, 3]
