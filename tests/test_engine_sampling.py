"""End to end at T > 0: the engine with a draft model samples from the target's distribution.

A vocabulary of 8 tokens keeps the joint distribution of two generated tokens small enough
to compute exactly and to test with chi-square; tokens 2 and 3 of each output come from a
speculative step (drafted by another random model, with its own q), token 1 from the prefill.
"""
import pytest
import torch
from scipy import stats

from flashdraft.config import ModelConfig, SamplingParams
from flashdraft.drafters import DraftModelDrafter
from flashdraft.engine import Engine
from flashdraft.kv_cache import KVCache
from flashdraft.model import Transformer
from flashdraft.sampling import probs_from_logits

V = 8
PROMPT = [1, 5, 2]


def tiny(seed, layers=1):
    cfg = ModelConfig(arch="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
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


@pytest.mark.parametrize("temperature, top_k, top_p, n", [(1.0, 0, 1.0, 3000), (0.8, 5, 0.9, 4000)])
def test_engine_samples_from_the_target(temperature, top_k, top_p, n):
    target, draft = tiny(0, layers=2), tiny(1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3,
                            seed=0, ignore_eos=True)
    engine = Engine(target, torch.device("cpu"), torch.float32, 64, ())
    drafter = DraftModelDrafter(draft, torch.device("cpu"), torch.float32, V)
    counts = torch.zeros(V * V, dtype=torch.float64)
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": i})
        steps = list(engine.run(PROMPT, p, drafter, k=2))
        tokens = [t for s in steps for t in s.token_ids]
        counts[tokens[1] * V + tokens[2]] += 1
    expected = exact_marginal(target, params).flatten() * n
    assert counts[expected == 0].sum() == 0
    keep = expected > 5
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:  # pool the rare cells into one
        obs = torch.cat([obs, counts[~keep].sum()[None]])
        exp = torch.cat([exp, expected[~keep].sum()[None]])
    exp = exp / exp.sum() * obs.sum()
    assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
