"""The cost model that chooses k (or plain decoding) per step, with injected costs."""
import json

import pytest

from flashdraft.scheduling import (FIRST_STRETCH, LONGEST_STRETCH, REQUEST_DECAY, CostModel,
                                   Ema, SpeculationPlanner, best_k, expected_tokens, leaf_keep,
                                   leaf_share, most_tree_nodes, tree_shapes)

P = 0.010  # seconds a plain token


def line(a, b):
    return lambda k: a + b * k


@pytest.mark.parametrize("alpha, step, want", [
    # a draft model at a third of the target a token: pays at high acceptance, not at low
    (0.9, line(1.1 * P, P / 3), range(5, 9)),
    (0.85, line(1.1 * P, P / 3), range(3, 7)),
    (0.35, line(1.1 * P, P / 3), [0]),
    # nearly free drafts (n-gram lookup) pay even at modest acceptance, and go long
    (0.5, line(1.05 * P, 0.02 * P), range(3, 7)),
    (0.9, line(1.05 * P, 0.02 * P), [8]),
    # a verification that costs twice a plain step: E(k) < 2 at this acceptance, never pays
    (0.4, line(2.0 * P, 0.0), [0]),
])
def test_best_k_picks_plain_where_speculation_cannot_pay_and_the_right_k_where_it_can(
        alpha, step, want):
    k, e, rate = best_k([alpha] * 8, step, P, 8)
    assert k in want, (k, e, rate)
    # the choice is the best over every k, plain included
    rates = [1 / P] + [expected_tokens([alpha] * 8, j) / step(j) for j in range(1, 9)]
    assert rate == pytest.approx(max(rates))


def test_expected_tokens():
    assert expected_tokens([1.0] * 4, 4) == 5
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.0, 1.0], 2) == 1


class Drafter:
    hidden_layers = ()
    cost_hint = 1 / 3
    answer = True

    def can_propose(self, tokens):
        return self.answer


def drain(planner):
    """Plain tokens until the planner drafts again."""
    n = 1
    while not planner.resume([]):
        n += 1
    return n


def measured(model, drafter, step_s, steps=20, k=5, accepted=5):
    """A planner whose engine has seen plain tokens of P seconds and these steps."""
    for _ in range(10):
        model.add_plain(P)
    planner = SpeculationPlanner(model, drafter)
    for _ in range(steps):
        planner.after_step(k, accepted, step_s)
    return planner


def test_planner_measures_plain_first_then_drafts_while_it_pays():
    model, d = CostModel(), Drafter()
    planner = SpeculationPlanner(model, d)
    assert planner.plain and drain(planner) == FIRST_STRETCH  # nothing measured yet
    for _ in range(8):
        model.add_plain(P)
    # every draft of 5 kept, at 2.8 plain steps a step: 6 tokens for 2.8 -> speculate, long
    for k in (5, 3, 8, 5, 4):
        planner.after_step(k, k, P * (1.1 + k / 3))
    assert not planner.plain and planner.choose(8) >= 6
    assert planner.predicted > 6


def test_planner_goes_plain_when_drafts_are_rejected_and_backs_off_its_probes():
    model, d = CostModel(), Drafter()
    planner = measured(model, d, P * 2.8, steps=3, accepted=5)
    lengths = []
    for _ in range(6):  # every probe keeps nothing
        while not planner.plain:
            planner.after_step(5, 0, P * 2.8)
        lengths.append(drain(planner))
    assert lengths[0] <= FIRST_STRETCH * 2 and lengths[-1] == LONGEST_STRETCH
    assert lengths == sorted(lengths)
    for _ in range(6):  # drafts are kept again: back to short stretches and speculation
        planner.after_step(5, 5, P * 2.8)
    assert not planner.plain and planner.backoff == FIRST_STRETCH


def test_an_outlier_step_does_not_move_the_plain_estimate():
    model = CostModel()
    for _ in range(10):
        model.add_plain(P)
    model.add_plain(50 * P)  # a graph captured on the way
    assert model.plain.value == pytest.approx(P)


def test_empty_draft_takes_plain_tokens_until_the_drafter_can_propose():
    model, d = CostModel(), Drafter()
    planner = measured(model, d, P * 1.2, accepted=5)
    planner.after_step(0, 0, 0.0)  # nothing drafted
    d.answer = False
    assert [planner.resume([]) for _ in range(3)] == [False] * 3 and planner.plain
    d.answer = True
    assert planner.resume([]) and not planner.plain


def test_step_times_fit_a_line_in_k_and_acceptance_is_per_request_and_per_drafter():
    model, d = CostModel(), Drafter()
    planner = measured(model, d, 0.0, steps=0)
    for k in (2, 4, 6, 8) * 3:
        planner.after_step(k, k, P * (1.0 + 0.25 * k))
    costs = model.of(d)
    assert model.step_time(costs, 5) == pytest.approx(P * 2.25)
    assert planner.acceptance()[:4] == pytest.approx([1.0] * 4)
    # a new request of the same drafter starts from what the drafter kept, then follows its
    # own prompt
    second = SpeculationPlanner(model, d)
    assert second.acceptance()[0] > 0.9
    for _ in range(6):
        second.after_step(4, 0, P * 2.0)
    assert second.acceptance()[0] < 0.2 < model.of(d).acceptance[0].value


def test_an_untimed_planner_chooses_from_its_own_drafts_alone(tmp_path):
    """A seeded sampled request: the same accepted counts give the same choices whatever the
    engine measured before (in this run, or restored from the step-cost cache) or the steps'
    wall times."""
    def choices(model, times):
        planner = SpeculationPlanner(model, d, timed=False)
        out = []
        for t, n in zip(times, [5, 4, 0, 0, 5, 3, 0, 0, 0, 1]):
            out.append(planner.choose(8) if not planner.plain else 0)
            if planner.plain:
                drain(planner)
            planner.after_step(out[-1] or 5, n, t)
        return out
    d = Drafter()
    busy = measured(CostModel(), d, P * 9.0, accepted=0).model
    assert choices(CostModel(), [P] * 10) == choices(busy, [P * 5] * 10)
    saved = cached_model(tmp_path / "step_costs.json", drafter=d)
    run_steps(saved, d)
    saved.save()
    restored = cached_model(tmp_path / "step_costs.json", drafter=d)
    assert restored.of(d).steps.seen
    assert choices(CostModel(), [P] * 10) == choices(restored, [P * 5] * 10)


def trees_of(widths=(), budget=0):
    return lambda k: tree_shapes(widths, budget, k)


def test_expected_tokens_of_a_tree():
    # depth 1: spine kept with 0.5, else a leaf with 0.5: 1 + 0.5 + 0.25 (+ depth 2: 0.5 · 0.5)
    assert expected_tokens([0.5, 0.5], 2, [0.5, 0.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert expected_tokens([0.5, 0.5], 2, [0.0, 0.0]) == expected_tokens([0.5, 0.5], 2)


@pytest.mark.parametrize("tree_s, beta, want_tree", [
    (0.0, 0.8, True),  # leaves cost nothing and catch most misses: the tree
    (0.0, 0.0, False),  # leaves never kept: the chain (ties go to it)
    (0.02, 0.5, False),  # a tree step costs two plain steps more: not worth half a token
])
def test_planner_takes_the_tree_where_it_pays(tree_s, beta, want_tree):
    """Measured chain and tree steps (injected times) and acceptance: the planner's choice
    between the chain and the tree of each k follows E / s."""
    model, d = CostModel(), Drafter()
    for _ in range(10):
        model.add_plain(P)
    planner = SpeculationPlanner(model, d, trees=trees_of((3, 3, 3, 3)))
    for i in range(40):  # chain steps of k = 4 and 3 keeping 2, tree steps keeping 2 + a leaf
        k = 4 if i % 2 else 3
        planner.after_step(k, 2, 1.5 * P + 0.1 * P * k)
        leaf = i % 10 < 10 * beta
        planner.after_step(k, 3 if leaf else 2, 1.5 * P + 0.1 * P * k + tree_s, leaf=leaf)
    k = planner.choose(4)
    assert k > 0 and planner.tree == want_tree
    # the depth's two leaves were kept with chance beta: its first leaf's β times 1 + r
    assert leaf_keep(planner.costs.leaf[2].value, 2) == pytest.approx(beta, abs=0.25)


def test_a_tree_step_records_spine_acceptance_and_the_leaf():
    model, d = CostModel(), Drafter()
    model.add_plain(P)
    planner = SpeculationPlanner(model, d, trees=trees_of((2, 2)))
    planner.after_step(3, 2, P, leaf=True)  # spine 1 kept, rejected at depth 2, its leaf kept
    assert [a.value for a in planner.alphas] == [1.0, 0.0]
    assert planner.betas[1].value == 1.0 and len(planner.betas) == 2
    planner.after_step(3, 2, P, leaf=False)  # spine 2 kept, depth 3 has no leaves: no β
    assert planner.betas[1].value == 1.0 and len(planner.costs.leaf) == 2



# -- tree shapes under a node budget ---------------------------------------------------------

def test_tree_shapes_under_a_budget_are_few_and_fit():
    assert tree_shapes((3, 2), 0, 3) == ((2, 1, 0),)  # fixed widths: their one tree
    assert tree_shapes((), 0, 3) == tree_shapes((1, 1), 0, 3) == ()  # chains
    shapes = {k: tree_shapes((), 16, k) for k in range(1, 17)}
    assert shapes[4][0] == (2, 1, 1, 1)  # the middle profile first: where no planner chooses
    assert shapes[1] == ((2,), (1,), (3,)) and shapes[16] == ()  # no room for a leaf
    for k, trees in shapes.items():
        assert len(trees) <= 4 and len(set(trees)) == len(trees)
        assert all(len(t) == k and k + sum(t) <= 16 and any(t) for t in trees)
    assert (1,) * 8 in shapes[8]  # one alternative a depth, 16 nodes
    # each profile trimmed from its deepest depth to 5 nodes; (4, 3)'s trim is (3, 2)'s twin
    assert tree_shapes((), 5, 3) == ((2, 0, 0), (1, 0, 0), (1, 1, 0))
    # the most tokens a step verifies, over every k' <= k (what the caches must hold)
    assert most_tree_nodes((3, 2, 2), 0, 5) == 9 and most_tree_nodes((3, 2), 0, 1) == 3
    assert most_tree_nodes((1,), 0, 5) == most_tree_nodes((), 0, 5) == 0
    assert most_tree_nodes((), 16, 8) == 16 and most_tree_nodes((), 16, 16) == 16
    assert leaf_keep(0.3, 0) == 0 and leaf_keep(0.3, 1) == 0.3
    assert leaf_keep(0.3, 2) == pytest.approx(0.45) and leaf_keep(0.8, 8) == 1.0
    assert leaf_share(3) == pytest.approx(1.75)


def injected(alpha, first_leaf, leaf_s, budget=16, k_max=8):
    """A planner choosing trees under `budget` nodes: plain steps of P, chain steps of
    P (1.1 + k / 10), leaves of leaf_s seconds each, acceptance alpha at every depth and a
    first-leaf β first_leaf at every depth."""
    model, d = CostModel(), Drafter()
    for _ in range(10):
        model.add_plain(P)
    costs = model.of(d)
    for k in range(1, 9):
        model.add_step(costs, k, P * (1.1 + 0.1 * k))
    for leaves in range(1, 9):
        model.add_step(costs, 2, model.step_time(costs, 2) + leaf_s * leaves, leaves=(leaves, 0))
    planner = SpeculationPlanner(model, d, trees=trees_of(budget=budget))
    planner.alphas = [Ema(REQUEST_DECAY, alpha, 1.0) for _ in range(k_max)]
    planner.betas = [Ema(REQUEST_DECAY, first_leaf, 1.0) for _ in range(k_max)]
    k = planner.choose(k_max)
    if planner.leaves is not None:  # its E is E_tree's definition
        betas = [leaf_keep(first_leaf, m) for m in planner.leaves]
        assert planner.predicted == pytest.approx(expected_tokens([alpha] * k_max, k, betas))
    return k, planner.leaves


@pytest.mark.parametrize("alpha, first_leaf, leaf_s, want", [
    # leaves that cost a plain step each cannot pay for what they catch: the chain
    (0.6, 0.4, P, "chain"),
    # leaves never kept: the chain, however cheap (ties go to it)
    (0.6, 0.0, 0.001 * P, "chain"),
    # a spine that is always kept needs no alternatives: the chain
    (1.0, 0.4, 0.001 * P, "chain"),
    # middling acceptance, cheap leaves, often kept: a tree with many leaves
    (0.6, 0.4, 0.001 * P, "many"),
    # low acceptance: the alternatives go where the spine breaks, at the first depths
    (0.3, 0.4, 0.001 * P, "front"),
    # high acceptance and cheap leaves: one alternative at (nearly) every depth
    (0.9, 0.4, 0.001 * P, "spread"),
])
def test_a_node_budget_shapes_the_tree_by_acceptance_and_leaf_cost(alpha, first_leaf, leaf_s,
                                                                    want):
    k, leaves = injected(alpha, first_leaf, leaf_s)
    assert k >= 1
    if want == "chain":
        assert leaves is None
        return
    assert leaves is not None and k + sum(leaves) <= 16
    if want == "many":
        assert sum(leaves) >= 4
    if want == "front":
        assert leaves[0] >= 2 and sum(leaves[2:]) == 0
    if want == "spread":
        assert k >= 6 and sum(1 for m in leaves if m) >= k - 1


def test_dearer_leaves_never_mean_more_of_them():
    counts = []
    for leaf_s in (0.0, 0.002 * P, 0.01 * P, 0.05 * P, 0.2 * P, P):
        _, leaves = injected(0.6, 0.4, leaf_s)
        counts.append(sum(leaves or ()))
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 0


def test_a_tree_step_of_any_width_estimates_the_first_leaf():
    """Steps of two leaves at a depth kept with chance 0.45 (= 0.3 · (1 + r)): the first leaf's
    β comes out near 0.3, and a step of one leaf there is predicted at that."""
    model, d = CostModel(), Drafter()
    model.add_plain(P)
    planner = SpeculationPlanner(model, d, trees=trees_of(budget=16))
    for i in range(200):  # depth 1's spine token always rejected; a leaf kept 9 times in 20
        kept = i * 9 % 20 < 9  # spread over the 20
        planner.after_step(2, 1 if kept else 0, P, leaf=kept, leaves=(2, 0))
    assert planner.costs.leaf[0].value == pytest.approx(0.3, abs=0.05)


# -- step costs kept across engines (StepCostCache) ------------------------------------------

SETUP = {"device": "NVIDIA H100", "model": "/m", "weight_bytes": 10, "dtype": "torch.bfloat16"}


def cached_model(path, setup=SETUP, drafter=None, name="model:/d"):
    from flashdraft.scheduling import StepCostCache

    model = CostModel(cache=StepCostCache(setup, path))
    if drafter is not None:
        model.identify(drafter, {"spec": name})
    return model


def run_steps(model, drafter):
    """Plain tokens of P, chain steps of P (1 + k / 4), tree steps of k leaves P (0.5 + k / 20)
    over their chain's."""
    for _ in range(10):
        model.add_plain(P)
    costs = model.of(drafter)
    for k in (2, 4, 6, 8) * 3:
        model.add_step(costs, k, P * (1.0 + 0.25 * k))
        costs.acceptance.append(Ema(0.9, 1.0))  # acceptance: never kept
    for k in (2, 4, 6, 8) * 3:
        model.add_step(costs, k, P * (1.5 + 0.3 * k), leaves=(1,) * k)


def test_step_costs_round_trip_through_the_cache(tmp_path):
    path, d = tmp_path / "step_costs.json", Drafter()
    first = cached_model(path, drafter=d)
    assert first.plain.value is None  # nothing saved yet
    run_steps(first, d)
    first.save()
    assert path.is_file() and not list(tmp_path.glob(".step_costs.*"))  # renamed into place
    # a second engine of the same setup, with the same drafter (a new object of the same key)
    d2 = Drafter()
    second = cached_model(path, drafter=d2)
    assert second.plain.value == pytest.approx(P)
    costs = second.of(d2)
    assert second.step_time(costs, 5) == pytest.approx(P * 2.25)
    assert second.step_time(costs, 5, leaves=3) == pytest.approx(P * 2.9)
    assert costs.acceptance == [] and costs.steps.w <= 8.0  # fresh samples take over quickly
    # the planner starts speculating at once: p is known
    assert not SpeculationPlanner(second, d2).plain
    # saving again merges: another drafter's entry joins, the first one's stays
    d3 = Drafter()
    second.identify(d3, {"spec": "ngram"})
    second.add_step(second.of(d3), 3, P * 1.2)
    second.save()
    d5 = Drafter()
    assert cached_model(path, drafter=d5).of(d5).steps.seen
    assert set(json.loads(path.read_text())["setups"][second.cache.key]["drafters"]) == {
        '{"spec": "model:/d"}', '{"spec": "ngram"}'}


def test_step_costs_of_another_setup_or_drafter_are_not_reused(tmp_path):
    path, d = tmp_path / "step_costs.json", Drafter()
    model = cached_model(path, drafter=d)
    run_steps(model, d)
    model.save()
    other_gpu = cached_model(path, {**SETUP, "device": "NVIDIA H200"}, d)
    assert other_gpu.plain.value is None and not other_gpu.of(d).steps.seen
    other_drafter = cached_model(path, drafter=d, name="model:/other")
    assert other_drafter.plain.value == pytest.approx(P)  # the same target: its step is known
    assert not other_drafter.of(d).steps.seen
    unnamed = cached_model(path)  # a drafter never identified: not restored
    assert not unnamed.of(d).steps.seen


@pytest.mark.parametrize("text", ["{not json", '{"format": F, "setups": []}',
                                  '{"format": F, "setups": {"%s": {"plain": ["x", 1]}}}'])
def test_a_corrupt_step_cost_file_warns_once_and_starts_afresh(tmp_path, text):
    from flashdraft.scheduling import STEP_COST_FORMAT, StepCostCache

    path, d = tmp_path / "step_costs.json", Drafter()
    key = StepCostCache(SETUP).key
    path.write_text(text.replace("%s", key.replace('"', '\\"'))
                    .replace("F", str(STEP_COST_FORMAT)))
    with pytest.warns(UserWarning, match="step-cost cache") as seen:
        model = cached_model(path, drafter=d)
        run_steps(model, d)
        model.save()  # replaces the bad file
    assert len(seen) == 1 and model.plain.value == pytest.approx(P)
    assert cached_model(path).plain.value == pytest.approx(P)


def test_an_unwritable_cache_warns_and_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    d = Drafter()
    with pytest.warns(UserWarning, match="step-cost cache") as seen:
        model = cached_model(blocker / "step_costs.json", drafter=d)  # its folder is a file
        run_steps(model, d)
        model.save()
        model.add_plain(P)
        model.save()
    assert len(seen) == 1 and model.plain.value == pytest.approx(P)


def test_saves_come_between_requests_once_enough_is_new(tmp_path, monkeypatch):
    from flashdraft import scheduling

    path, d = tmp_path / "step_costs.json", Drafter()
    model = cached_model(path, drafter=d)
    monkeypatch.setattr(scheduling, "SAVE_EVERY", 20)
    for _ in range(19):
        model.add_plain(P)
    model.save_if_due()
    assert not path.exists()
    model.add_plain(P)
    model.save_if_due()
    assert path.exists() and model.unsaved == 0


def test_a_wrong_saved_plain_step_gives_way_to_the_measured_one():
    """A plain step well above the estimate is an outlier, but not when it keeps coming."""
    model = CostModel()
    model.add_plain(P)
    for _ in range(20):
        model.add_plain(10 * P)
    assert model.plain.value > 5 * P


def test_engine_keeps_its_step_costs_for_the_next_engine(tiny_models, tmp_path, monkeypatch):
    """LLM(step_cost_cache=True) saves on close to $FLASHDRAFT_CACHE/step_costs.json, read
    when saved, and a new LLM of the same setup starts from it; the CPU default keeps nothing."""
    from flashdraft import LLM, SamplingParams

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    draft = tiny_models["qwen2-draft"]
    llm = LLM(tiny_models["qwen2"], draft=draft, device="cpu", step_cost_cache=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 2, params)
    llm.close()
    saved = json.loads((tmp_path / "step_costs.json").read_text())
    (key, entry), = saved["setups"].items()
    assert json.loads(key)["device"] == "cpu" and "plain" in entry
    (name, fits), = entry["drafters"].items()
    assert json.loads(name)["spec"] == draft and "steps" in fits
    again = LLM(tiny_models["qwen2"], draft=draft, device="cpu", step_cost_cache=True)
    assert again.engine.costs.plain.value == pytest.approx(entry["plain"][0])
    assert again.engine.costs.of(again.drafter).steps.seen
    LLM(tiny_models["qwen2"], device="cpu").close()  # default on a CPU: off
    assert json.loads((tmp_path / "step_costs.json").read_text()) == saved


def test_the_step_cost_cache_flag():
    from flashdraft.cli import build_parser
    from flashdraft.config import EngineConfig

    parse = build_parser().parse_args
    assert parse(["generate", "--model", "m", "x"]).step_cost_cache is None  # on for CUDA
    assert parse(["serve", "--model", "m", "--no-step-cost-cache"]).step_cost_cache is False
    with pytest.raises(ValueError, match="step_cost_cache"):
        EngineConfig(model="m", step_cost_cache="yes")
