"""Choosing, step by step, whether to speculate and how far: a measured cost model.

A speculative step that drafts k tokens costs s(k) seconds and gives E(k) tokens; plain
decoding gives one token every p seconds (its steps run one ahead of the host, so p is the
GPU's step and nothing else). The engine takes k = argmax E(k) / s(k) over 1 … k_max, or
plain decoding (k = 0) when no k beats 1 / p. Everything is measured while it runs:

- p: the interval between plain tokens, over the engine's plain stretches;
- s(k) = a + b · k per drafter: a least-squares line through the wall time of its
  speculative steps (draft, verification and the step's one host read), with old steps
  forgotten slowly. Until two lengths have been seen, b comes from `Drafter.cost_hint`, or a
  draft model's weight bytes over the target's (each step streams them once), or 0.02;
- E(k) = 1 + Σ_{i ≤ k} Π_{j ≤ i} α_j, with α_j the acceptance of draft position j given
  that the ones before it were accepted: running estimates per drafter, and per request
  (started from the drafter's), which follow a prompt's own acceptance within a few steps.

Estimates of cost and acceptance are kept per engine and drafter (`CostModel`): the same
model on the same GPU costs the same for every request.

A seeded sampled request must give the same tokens every time, and at T > 0 its tokens
depend on which steps were speculative. Its planner is untimed: step costs are the guess
from weight bytes (in plain steps), acceptance starts from the prior and follows the
request's own drafts, so its choices follow from its tokens alone. Greedy output never
depends on the choices, so greedy requests are always timed. A request's `SpeculationPlanner`
asks it for k before each step and tells it what each step took.

When plain decoding wins, acceptance is no longer observed, so the planner decodes a stretch
of plain tokens and then probes with one speculative step: 4 tokens at first, doubling up to
64 while the probes keep losing; a step that itself beat plain decoding (n + 1 tokens in less
than n + 1 plain steps) keeps drafting going whatever the estimates say, so they catch up
within a few steps where the text turns predictable. A probe costs at most one step's
loss in 4–64 tokens, which keeps a drafter that never pays within a few percent of plain
decoding. A drafter that has nothing to propose (n-gram lookup without a match) gets plain
tokens until it has (`can_propose`), as before.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

# How fast old observations fade: per step for acceptance (a request's, the drafter's), per
# sample for the step-time fits.
REQUEST_DECAY, DRAFTER_DECAY, TIME_DECAY = 0.7, 0.95, 0.98
PRIOR_ACCEPTANCE = 0.6  # before a drafter's first step
DEFAULT_COST_HINT = 0.02  # a drafter's cost a token over the target's, where it states none
FIRST_STRETCH, LONGEST_STRETCH = 4, 64


class Ema:
    """An exponentially weighted mean; None until the first sample."""

    def __init__(self, decay: float, value: float | None = None, weight: float = 0.0):
        self.decay, self.value, self.weight = decay, value, weight

    def add(self, x: float) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.value = x if self.value is None else self.value + (x - self.value) / self.weight


class LineFit:
    """y ≈ a + b · x by weighted least squares, old samples fading by `decay` each."""

    def __init__(self, decay: float = TIME_DECAY):
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    @property
    def seen(self) -> bool:
        return self.w > 0

    def line(self, slope_prior: float) -> tuple[float, float]:
        """(a, b): the fit where the samples span more than one x; else the line of slope
        slope_prior through their mean."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var > 0.05:
            b = max(0.0, (self.xy / self.w - mx * my) / var)
        else:
            b = slope_prior
        return max(my - b * mx, 0.0), b


@dataclass
class DrafterCosts:
    """What one drafter's steps cost and keep, on one engine."""
    cost_hint: float  # its cost a drafted token, over the target's plain step
    steps: LineFit = field(default_factory=LineFit)  # step seconds against k
    acceptance: list[Ema] = field(default_factory=list)  # α_j, j = 1 …


def weight_bytes(module) -> int:
    """Bytes of a model's weights (parameters and buffers: quantized weights are buffers)."""
    return sum(t.numel() * t.element_size()
               for t in (*module.parameters(), *module.buffers()))


class CostModel:
    """One engine's measurements: the plain step, and each drafter's steps and acceptance.
    target: the engine's model, against whose weights a draft model's cost is first guessed
    (a decode step streams the weights once)."""

    def __init__(self, target=None):
        self.plain = Ema(TIME_DECAY)  # seconds a plain token
        self.drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.target_bytes = weight_bytes(target) if target is not None else None

    def of(self, drafter) -> DrafterCosts:
        if drafter not in self.drafters:
            hint = getattr(drafter, "cost_hint", None)
            model = getattr(drafter, "model", None)
            if hint is None and model is not None and self.target_bytes:
                hint = weight_bytes(model) / self.target_bytes
            self.drafters[drafter] = DrafterCosts(DEFAULT_COST_HINT if hint is None else hint)
        return self.drafters[drafter]

    def add_plain(self, seconds: float) -> None:
        # A step far above the estimate is a one-off (a graph captured, the host busy).
        if self.plain.value is None or seconds < 4 * self.plain.value:
            self.plain.add(seconds)

    def step_time(self, costs: DrafterCosts, k: int, timed: bool = True) -> float:
        """s(k) in seconds; timed=False: the guess below, in plain steps (no measurement)."""
        p = self.plain.value if timed else 1.0
        if not timed or not costs.steps.seen:  # a guess: the target's step, wider, and k drafted tokens
            return p * (1.1 + (costs.cost_hint + 0.02) * k)
        a, b = costs.steps.line(costs.cost_hint * p)
        return a + b * k


def expected_tokens(alphas: list[float], k: int) -> float:
    """E(k) = 1 + Σ_{i ≤ k} Π_{j ≤ i} α_j (the bonus or recovered token included)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[i] if i < len(alphas) else (alphas[-1] if alphas else PRIOR_ACCEPTANCE)
        total += run
    return total


def best_k(alphas: list[float], step_time, plain_s: float, k_max: int
           ) -> tuple[int, float, float]:
    """(k, E(k), its rate in tokens/s) maximising E(k) / step_time(k) over 1 … k_max, or
    (0, 1, 1 / plain_s) where plain decoding is at least as fast."""
    best = (0, 1.0, 1.0 / plain_s)
    for k in range(1, k_max + 1):
        e = expected_tokens(alphas, k)
        rate = e / step_time(k)
        if rate > best[2]:
            best = (k, e, rate)
    return best


class SpeculationPlanner:
    """One request's choice of k before each step, from its engine's CostModel.

    planner.plain                      whether the next tokens are decoded plainly
    planner.choose(k_max) -> k         before a speculative step: how many to draft
    planner.after_step(k, n, seconds)  after it: drafted, accepted, its wall time
    planner.resume(tokens)             after each plain token: draft again from the next?
    """

    def __init__(self, model: CostModel, drafter, timed: bool = True):
        self.model, self.costs, self.timed = model, model.of(drafter), timed
        self.probe = getattr(drafter, "can_propose", None)
        # The request's own acceptance, started from the drafter's (untimed: from the prior,
        # so that nothing from other requests enters its choices).
        self.alphas = ([Ema(REQUEST_DECAY, a.value, 1.0) for a in self.costs.acceptance]
                       if timed else [])
        self.stretch = 0  # plain tokens still to decode before drafting again
        self.backoff = FIRST_STRETCH
        self.predicted = 1.0  # E(k) of the step chosen last
        if timed and model.plain.value is None:  # nothing to compare with: measure plain first
            self.stretch = FIRST_STRETCH

    @property
    def plain(self) -> bool:
        return self.stretch > 0

    def acceptance(self) -> list[float]:
        return [a.value for a in self.alphas]

    def _step_time(self, k: int) -> float:
        return self.model.step_time(self.costs, k, self.timed)

    @property
    def _plain_s(self) -> float:
        return self.model.plain.value if self.timed else 1.0

    def choose(self, k_max: int) -> int:
        """k for the next step (>= 1; plain decoding is chosen by after_step's stretches)."""
        # A probe after a plain stretch drafts too: the best k as if plain were not an option.
        k, self.predicted, _ = best_k(self.acceptance(), self._step_time, float("inf"), k_max)
        return k

    def after_step(self, drafted: int, accepted: int, seconds: float) -> None:
        if drafted == 0:  # nothing to draft: a plain token, then ask the drafter again
            self.stretch = 1
            return
        self.costs.steps.add(drafted, seconds)
        for j in range(min(drafted, accepted + 1)):  # positions that were tested
            kept = 1.0 if j < accepted else 0.0
            if len(self.alphas) <= j:
                self.alphas.append(Ema(REQUEST_DECAY))
            if len(self.costs.acceptance) <= j:
                self.costs.acceptance.append(Ema(DRAFTER_DECAY))
            self.alphas[j].add(kept)
            self.costs.acceptance[j].add(kept)
        k, _, _ = best_k(self.acceptance(), self._step_time, self._plain_s,
                         max(drafted, len(self.alphas)))
        # A step that beat plain decoding itself is trusted over the estimates: drafting goes
        # on (and the estimates catch up) where the text has turned predictable.
        paid = (accepted + 1) * self._plain_s >= (seconds if self.timed else
                                                   self._step_time(drafted))
        if k == 0 and not paid:  # plain, longer each time the probe after loses too
            self.stretch = self.backoff
            self.backoff = min(2 * self.backoff, LONGEST_STRETCH)
        else:
            self.backoff = FIRST_STRETCH

    def resume(self, tokens: list[int]) -> bool:
        self.stretch = max(0, self.stretch - 1)
        if self.stretch == 0 and self.probe is not None and not self.probe(tokens):
            self.stretch = 1  # nothing to draft yet: one more plain token, then ask again
        return self.stretch == 0
