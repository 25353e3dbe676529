"""Several drafters in one request (`ngram+model:PATH`): each step takes the proposal expected
to give the most tokens per second; the output is plain decoding's either way."""
import pytest
import torch

from flashdraft import SamplingParams
from flashdraft.drafters import Draft
from flashdraft.drafters.combined import BestOfDrafters
from flashdraft.drafters.registry import parse_drafter_spec
from flashdraft.scheduling import Ema

from tests.test_speculative import target  # noqa: F401 (the fixture)

REPEATS = ["a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\nd = [1, 2,",
           "def add(a, b):\n    return a + b\ndef add(a, b):"]


@pytest.mark.parametrize("adaptive", [True, False])
def test_combined_greedy_equals_plain_and_uses_both(target, tiny_models, adaptive):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = [o.token_ids for o in target.generate(REPEATS, params, draft=None)]
    spec = "ngram+" + tiny_models["qwen2"]  # the target as its own draft model: all accepted
    target.engine.adaptive = adaptive
    try:
        outs = target.generate(REPEATS, params, draft=spec, num_speculative_tokens=4)
    finally:
        target.engine.adaptive = True
    assert [o.token_ids for o in outs] == plain
    drafter = target.get_drafter(spec)
    assert isinstance(drafter, BestOfDrafters)
    assert [type(d).__name__ for d in drafter.drafters] == ["NgramDrafter", "DraftModelDrafter"]
    if not adaptive:  # every step drafts: a perfect draft model wins where lookup has no match
        assert 1 in drafter.chosen


class Fixed:
    """A drafter that always proposes `tokens` and counts its proposals."""
    hidden_layers = ()
    device = torch.device("cpu")

    def __init__(self, tokens):
        self.tokens, self.proposals = tokens, 0

    def begin(self, prompt):
        pass

    def propose(self, ctx, k):
        self.proposals += 1
        return Draft(torch.tensor([self.tokens[:k]], dtype=torch.long).view(1, -1))

    def commit(self, tokens):
        pass


def primed(alphas):
    out = []
    for a in alphas:
        e = Ema(0.8)
        e.add(a)
        out.append(e)
    return out


@pytest.mark.parametrize("lookup_alpha, model_alpha, want", [
    (0.95, 0.95, "lookup"),  # as good, and free: the costly one is not even asked
    (0.05, 0.9, "model"),  # lookup keeps failing, the model pays for itself
    (0.3, 0.35, "lookup"),  # a little better, not by enough to pay its drafting
])
def test_the_proposal_with_the_best_expected_rate_wins(lookup_alpha, model_alpha, want):
    from flashdraft.drafters.base import DraftContext

    lookup, model = Fixed([7, 8, 9, 10]), Fixed([1, 2, 3, 4])
    best = BestOfDrafters([model, lookup], [0.3, 0.0])  # cheap ones go first
    assert best.drafters == [lookup, model]
    best.alphas = [primed([lookup_alpha] * 4), primed([model_alpha] * 4)]
    ctx = DraftContext([0, 1], SamplingParams(temperature=0), None)
    draft = best.propose(ctx, 4)
    assert draft.tokens.tolist() == [[7, 8, 9, 10] if want == "lookup" else [1, 2, 3, 4]]
    if want == "lookup" and lookup_alpha > 0.9:
        assert model.proposals == 0
    before = [[a.value for a in alphas] for alphas in best.alphas]
    best.commit([7, 8, 5])  # the lookup's first two held, the third not; the model's first not
    after = [[a.value for a in alphas] for alphas in best.alphas]
    if want == "lookup":
        assert after[1] == before[1]
        assert after[0][0] >= before[0][0] and after[0][2] < before[0][2]
        assert after[0][3] == before[0][3]  # not tested: after the first rejected
    else:
        assert after[0] == before[0]
        assert after[1][0] < before[1][0] and after[1][1:] == before[1][1:]


def test_combination_specs():
    s = parse_drafter_spec("ngram:3+model:some/path")
    assert s.kind == "combined" and [p.kind for p in s.parts] == ["ngram", "model"]
    assert s.model == "some/path" and s.builds_trees
    with pytest.raises(ValueError, match="DFlash"):
        parse_drafter_spec("ngram+dflash:some/dir")
    with pytest.raises(ValueError, match="two or more"):
        BestOfDrafters([Fixed([1])], [0.0])
