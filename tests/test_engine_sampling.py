"""End to end at T > 0: the engine with a draft model samples from the target's distribution.

A vocabulary of 8 tokens keeps the joint distribution of two generated tokens small enough
to compute exactly and to test with chi-square; tokens 2 and 3 of each output come from a
speculative step (drafted by another random model, with its own q), token 1 from the prefill.
"""
import pytest
import torch
from scipy import stats

from flashdraft.config import ModelConfig, SamplingParams
from flashdraft.backends import kernels as K
from flashdraft.drafters import Draft, DraftModelDrafter
from flashdraft.engine import Engine
from flashdraft.kv_cache import KVCache
from flashdraft.model import Transformer
from flashdraft.sampling import probs_from_logits

V = 8
PROMPT = [1, 5, 2]


def tiny(seed, layers=1):
    # head_dim 16: the CUDA attention kernels' smallest (tl.dot needs K >= 16)
    cfg = ModelConfig(arch="qwen2", vocab_size=V, hidden_size=64, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64, qkv_bias=True)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.6)
    return model.eval()


def exact_marginal(model, params):
    """P(t2, t3) under plain sampling from the target: [V, V]."""
    def next_probs(seq):
        cache = KVCache.for_model(model.cfg, 1, 16, torch.float32, "cpu")
        logits, _ = model(torch.tensor([seq]), torch.arange(len(seq))[None], cache)
        return probs_from_logits(logits[0, -1], params.temperature, params.top_k,
                                 params.top_p).double()

    joint = torch.zeros(V, V, dtype=torch.float64)
    with torch.no_grad():
        p1 = next_probs(PROMPT)
        for t1 in range(V):
            if p1[t1] == 0:
                continue
            p2 = next_probs(PROMPT + [t1])
            for t2 in range(V):
                if p2[t2] > 0:
                    joint[t2] += p1[t1] * p2[t2] * next_probs(PROMPT + [t1, t2])
    return joint


class FixedDrafter:
    """Drafts 3, 4, … every step, without probabilities (a one-hot q)."""
    hidden_layers = ()

    def __init__(self, device):
        self.device = device

    def begin(self, prompt):
        pass

    def propose(self, ctx, k):
        return Draft(torch.arange(3, 3 + k, device=self.device).view(1, k))

    def commit(self, tokens):
        pass


def engine_counts(params, n, drafter_kind="model", fused=False, device="cpu", tree_widths=()):
    """Counts of (token 2, token 3) over n seeds: [V * V]."""
    device = torch.device(device)
    target, draft = tiny(0, layers=2).to(device), tiny(1).to(device)
    engine = Engine(target, device, torch.float32, 64, (), fused_sampling=fused, adaptive=False,
                    tree_widths=tree_widths)
    drafter = (DraftModelDrafter(draft, device, torch.float32, V, fused_sampling=fused)
               if drafter_kind == "model" else FixedDrafter(device))
    counts = torch.zeros(V * V, dtype=torch.float64)
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        steps = list(engine.run(PROMPT, p, drafter, k=2))
        tokens = [t for s in steps for t in s.token_ids]
        counts[tokens[1] * V + tokens[2]] += 1
    return counts


def chi2_against_target(counts, params):
    """(the chi-square p-value of counts against the target's exact joint distribution, the
    number of counts where the target has no mass)."""
    n = counts.sum()
    expected = exact_marginal(tiny(0, layers=2), params).flatten() * n
    impossible = counts[expected == 0].sum()
    keep = expected > 5
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:  # pool the rare cells into one
        obs = torch.cat([obs, counts[~keep].sum()[None]])
        exp = torch.cat([exp, expected[~keep].sum()[None]])
    exp = exp / exp.sum() * obs.sum()
    return stats.chisquare(obs.numpy(), exp.numpy()).pvalue, impossible


@pytest.mark.parametrize("temperature, top_k, top_p, n", [(1.0, 0, 1.0, 3000), (0.8, 5, 0.9, 4000)])
def test_engine_samples_from_the_target(temperature, top_k, top_p, n):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3,
                            seed=0, ignore_eos=True)
    pvalue, impossible = chi2_against_target(engine_counts(params, n), params)
    assert pvalue > 1e-3 and impossible == 0


@pytest.mark.parametrize("temperature, top_p, widths", [(1.0, 1.0, (4, 4)), (0.7, 0.9, (4, 3))])
def test_tree_speculation_samples_from_the_target(temperature, top_p, widths):
    """Sampled token trees (a draft model's spine with q, its next best tokens as leaves tried
    against the residual): tokens 2 and 3 keep the target's joint distribution, and the test
    tells it from the target's at another temperature (its power)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, seed=0,
                            ignore_eos=True)
    counts = engine_counts(params, 3000, tree_widths=widths)
    pvalue, impossible = chi2_against_target(counts, params)
    assert pvalue > 1e-3 and impossible == 0
    other = SamplingParams(**{**params.__dict__, "temperature": temperature * 0.6})
    pvalue, impossible = chi2_against_target(counts, other)
    assert pvalue < 1e-3 or impossible > 0


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the Triton path end to end takes minutes on the interpreter")
@pytest.mark.parametrize("drafter_kind, min_p, widths", [("model", 0.0, ()), ("fixed", 0.1, ()),
                                                         ("model", 0.0, (4, 4))])
def test_fused_sampling_in_the_engine_samples_from_the_target(drafter_kind, min_p, widths):
    """The Triton path end to end: the draft's tokens drawn by its race, the verification's
    acceptance and residual by SampledVerify, with q from logits (draft model) or one-hot
    (FixedDrafter, as n-gram lookup's). On a CPU the same SampledVerify runs with the PyTorch
    primitives (the test above), and each fused primitive is tested against its reference
    (test_fused_sampling.py)."""
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=min_p, max_tokens=3,
                            seed=0, ignore_eos=True)
    counts = engine_counts(params, 4000, drafter_kind, fused=True, device="cuda",
                           tree_widths=widths)
    pvalue, impossible = chi2_against_target(counts, params)
    assert pvalue > 1e-3 and impossible == 0
    # Power: the same counts do not pass for the target at another temperature.
    pvalue, impossible = chi2_against_target(counts, SamplingParams(**{**params.__dict__,
                                                                     "temperature": 0.6}))
    assert pvalue < 1e-3 or impossible > 0


FUSED = torch.cuda.is_available() or K.INTERPRET


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    not FUSED, reason="the fused kernels need a GPU or TRITON_INTERPRET=1"))])
def test_a_seed_gives_one_output_and_seeds_differ(fused):
    device = torch.device("cuda" if fused and torch.cuda.is_available() else "cpu")
    target, draft = tiny(0, layers=2).to(device), tiny(1).to(device)
    engine = Engine(target, device, torch.float32, 64, (), fused_sampling=fused)
    drafter = DraftModelDrafter(draft, device, torch.float32, V, fused_sampling=fused)

    def run(seed, with_drafter):
        p = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        steps = engine.run(PROMPT, p, drafter if with_drafter else None, k=3)
        return [t for s in steps for t in s.token_ids]
    for with_drafter in (False, True):
        outs = [run(seed, with_drafter) for seed in (7, 7, 8, 7)]
        assert outs[0] == outs[1] == outs[3] and len(outs[0]) == 12
        assert any(run(seed, with_drafter) != outs[0] for seed in (8, 9, 10))
