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

Token trees (`tree.SpineTree`, where the engine has tree widths or a node budget and the
drafter builds them) are one more choice a step: a tree of k spine tokens with m_i leaves at
depth i gives E_tree(k) = 1 + Σ_{i ≤ k} Π_{j < i} α_j · (α_i + (1 - α_i) · β_i(m_i)), with
β_i(m) the chance that one of depth i's m leaves is kept where its spine token was not (0 for
m = 0). The leaves are the drafter's next best tokens, and a next best token is rarely the
target's as often as the one before it: β_i(m) = min(1, β_i · (1 + r + … + r^(m-1))), r =
LEAF_DECAY, with β_i the first leaf's chance, which each tree step's outcome at depth i
estimates (kept or not, over 1 + r + … of its leaves, so that steps of any width add to one
estimate). A tree step costs s_tree(k, L) = s(k) + c + d · L for L leaves: a line through the
tree steps' wall times over their chain's, against L (before the first, NODE_COST plain steps a
leaf). Both are measured like the chain's, so a tree that does not pay for its extra nodes is
dropped for the chain, and a chain that keeps missing by one token takes the tree.

With fixed widths (`--tree-widths 3,2,2`) each k has one tree. With a node budget
(`--tree-widths auto`, `--tree-budget N`: spine and leaves together at most N nodes) the planner
also chooses the widths, among few shapes: CUDA graphs are captured per shape, and a shape that
runs once is a capture lost. For each k the candidates are the AUTO_TREE_PROFILES (one
alternative to the first token; most of the budget at the first depths, where a spine of low
acceptance breaks; a middle one; one alternative at every depth, for a spine that breaks late),
each trimmed from its deepest depth to fit the budget: at most four trees a k, beside its chain,
and the best E / s of them all (plain decoding included) is taken. Where no planner chooses
(adaptive speculation off, a drafter that reads the target's hidden states) the first profile,
the middle one, is verified.

Estimates of cost and acceptance are kept per engine and drafter (`CostModel`): the same
model on the same GPU costs the same for every request, and for every engine of the same setup.
So the step costs (p and each drafter's chain and tree lines; never acceptance, which follows
the text) are kept across engines in a JSON file of the cache directory (`StepCostCache`,
`EngineConfig.step_cost_cache`), one entry per setup: the GPU kind, the target (its source
and weight bytes), dtype, quantization and kernel settings, and for each drafter its spec and
model. A new engine of a known setup starts from those lines instead of the weight-bytes guess
(and without a first plain stretch to measure p), at the weight of RESTORED_WEIGHT samples, so
that this run's own steps take over within a few dozen. The file is written off the hot path:
after a request once SAVE_EVERY timings have come in since the last write, and when the engine
closes; a temporary file renamed over the old one, so a reader never sees half of it; a file
that cannot be read or makes no sense is ignored with one warning, and replaced at the next save.

A seeded sampled request must give the same tokens every time, and at T > 0 its tokens
depend on which steps were speculative. Its planner is untimed: step costs are the guess
from weight bytes (in plain steps), acceptance starts from the prior and follows the
request's own drafts, so its choices follow from its tokens alone. Greedy output never
depends on the choices, so greedy requests are always timed. A request's `SpeculationPlanner`
asks it for k before each step and tells it what each step took. (An untimed planner reads
no measurement at all, restored or not: persisted costs never enter its choices.)

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

import json
import math
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .tree import spine_leaves

# How fast old observations fade: per step for acceptance (a request's, the drafter's), per
# sample for the step-time fits.
REQUEST_DECAY, DRAFTER_DECAY, TIME_DECAY = 0.7, 0.95, 0.98
PRIOR_ACCEPTANCE = 0.6  # before a drafter's first step
DEFAULT_COST_HINT = 0.02  # a drafter's cost a token over the target's, where it states none
FIRST_STRETCH, LONGEST_STRETCH = 4, 64
PRIOR_LEAF = 0.3  # a depth's first leaf's β before its first tree step
LEAF_DECAY = 0.5  # each next best alternative at a depth is kept this much as often as the last
# Trees a node budget chooses among (as tree widths: candidates a depth), the first where no
# planner chooses: a middle one, one alternative to the first token, most of the budget where a
# spine of low acceptance breaks, one alternative at every depth for a spine that breaks late.
AUTO_TREE_PROFILES = ((3, 2, 2, 2), (2,), (4, 3), (2,) * 64)
NODE_COST = 0.01  # a leaf's verification cost in plain steps, before tree steps are timed
# A plain step this many times the estimate is a one-off (a graph captured, the host busy),
# unless OUTLIER_RUN of them come in a row: then the estimate itself is wrong (a saved one
# from a machine that was less busy) and they are taken.
OUTLIER, OUTLIER_RUN = 4.0, 4
# The step-cost cache (StepCostCache): timings between writes, the weight in samples that a
# saved line starts with, the setups a file keeps (the least recently saved go first).
SAVE_EVERY, RESTORED_WEIGHT, SAVED_SETUPS = 64, 8.0, 64
STEP_COST_FORMAT = 2  # the file's version; a file of another version is started afresh


class Ema:
    """An exponentially weighted mean; None until the first sample."""

    def __init__(self, decay: float, value: float | None = None, weight: float = 0.0):
        self.decay, self.value, self.weight = decay, value, weight

    def add(self, x: float) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.value = x if self.value is None else self.value + (x - self.value) / self.weight

    def state(self) -> list[float]:
        return [self.value, self.weight]

    def restore(self, state) -> None:
        """The mean `state()` gave, at most RESTORED_WEIGHT samples' worth."""
        value, weight = _numbers(state, 2)
        if not value > 0 or not weight > 0:
            raise ValueError(f"a mean of {state!r}: a time and a weight > 0 expected")
        self.value, self.weight = value, min(weight, RESTORED_WEIGHT)


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

    def state(self) -> list[float]:
        return [self.w, self.x, self.y, self.xx, self.xy]

    def restore(self, state) -> None:
        """The sums `state()` gave, scaled down to at most RESTORED_WEIGHT samples (the same
        line, which this run's samples then move faster)."""
        w, *sums = _numbers(state, 5)
        if not w > 0:
            raise ValueError(f"a line fit of {state!r}: a weight > 0 expected")
        scale = min(1.0, RESTORED_WEIGHT / w)
        self.w = w * scale
        self.x, self.y, self.xx, self.xy = (v * scale for v in sums)

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


def _numbers(state, n: int) -> list[float]:
    """n finite numbers from a saved list, or a ValueError saying what was there."""
    if (not isinstance(state, list) or len(state) != n
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       and math.isfinite(v) for v in state)):
        raise ValueError(f"{n} finite numbers expected, got {state!r}")
    return [float(v) for v in state]


@dataclass
class DrafterCosts:
    """What one drafter's steps cost and keep, on one engine."""
    cost_hint: float  # its cost a drafted token, over the target's plain step
    steps: LineFit = field(default_factory=LineFit)  # step seconds against k
    acceptance: list[Ema] = field(default_factory=list)  # α_j, j = 1 …
    # a tree step's seconds over its chain's (s(k)), against its leaves
    tree_steps: LineFit = field(default_factory=LineFit)
    leaf: list[Ema] = field(default_factory=list)  # β_j, j = 1 …: of a depth's first leaf


def weight_bytes(module) -> int:
    """Bytes of a model's weights (parameters and buffers: quantized weights are buffers)."""
    return sum(t.numel() * t.element_size()
               for t in (*module.parameters(), *module.buffers()))


def device_kind(device) -> str:
    """The GPU's name (its step costs are the GPU's), or "cpu"."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def step_cost_path() -> Path:
    """The step-cost cache's file in the flashdraft cache directory (read at call time)."""
    from .loading.examples import cache_dir

    return cache_dir() / "step_costs.json"


class StepCostCache:
    """One engine setup's step costs in the JSON file that all setups share:

        {"format": STEP_COST_FORMAT, "setups": {KEY: {"saved": unix time, "plain": [mean, weight],
                                       "drafters": {DRAFTER KEY: {"steps": [5 sums],
                                                                  "tree_steps": [5 sums]}}}}}

    KEY and DRAFTER KEY are the JSON (sorted keys) of what identifies the setup and the
    drafter (`LLM` says which settings). Nothing here raises: a file that cannot be read or
    written costs one warning and the measurements start (or stay) fresh."""

    def __init__(self, key: dict, path: Path | str | None = None):
        """path: None: `step_cost_path()`, found when first read."""
        self.key = json.dumps(key, sort_keys=True)
        self._path = Path(path) if path is not None else None
        self._warned = False

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = step_cost_path()
        return self._path

    def _warn(self, what: str, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"the step-cost cache {self.path} {what} ({error}); the cost model "
                          f"measures this run's steps afresh", stacklevel=3)

    def _read(self) -> dict:
        """The file's setups; {} where there is no file (quietly) or no usable one (a warning)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._warn("cannot be read", e)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("setups"), dict):
                raise ValueError("no 'setups' object")
        except ValueError as e:
            self._warn("is not a step-cost file and is ignored", e)
            return {}
        return data["setups"] if data.get("format") == STEP_COST_FORMAT else {}

    def load(self) -> dict:
        """This setup's entry, {} where none is saved (or none is usable)."""
        entry = self._read().get(self.key, {})
        if not isinstance(entry, dict):
            self._warn("holds no usable entry for this setup", ValueError(repr(entry)[:80]))
            return {}
        return entry

    def save(self, plain: list[float] | None, drafters: dict[str, dict]) -> None:
        """Merge this setup's measurements into the file (each drafter's fits over what was
        saved of it before) and write it whole: a temporary file renamed over the old one."""
        setups = self._read()
        old = setups.get(self.key)
        entry = dict(old) if isinstance(old, dict) else {}
        saved = entry.get("drafters")
        saved = dict(saved) if isinstance(saved, dict) else {}
        for name, fits in drafters.items():
            before = saved.get(name)
            saved[name] = {**(before if isinstance(before, dict) else {}), **fits}
        entry.update(saved=time.time(), drafters=saved)
        if plain is not None:
            entry["plain"] = plain
        setups[self.key] = entry
        recent = sorted(setups, key=lambda k: _saved_at(setups[k]), reverse=True)
        data = {"format": STEP_COST_FORMAT,
                "setups": {k: setups[k] for k in recent[:SAVED_SETUPS]}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".step_costs.",
                                       suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            self._warn("cannot be written", e)


def _saved_at(entry) -> float:
    t = entry.get("saved") if isinstance(entry, dict) else None
    return t if isinstance(t, (int, float)) else 0.0


class CostModel:
    """One engine's measurements: the plain step, and each drafter's steps and acceptance.
    target: the engine's model, against whose weights a draft model's cost is first guessed
    (a decode step streams the weights once). cache: where its step costs are kept across
    engines of the same setup (None: nowhere); a drafter's are kept once it is `identify`-ed."""

    def __init__(self, target=None, cache: StepCostCache | None = None):
        self.plain = Ema(TIME_DECAY)  # seconds a plain token
        self.drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.target_bytes = weight_bytes(target) if target is not None else None
        self.cache = cache
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> key
        self.unsaved = 0  # timings since the last save
        self._outliers = 0  # plain steps left out in a row
        self.saved = cache.load() if cache is not None else {}
        if "plain" in self.saved:
            self._restore(self.plain, self.saved["plain"])

    def _restore(self, estimate, state) -> None:
        try:
            estimate.restore(state)
        except ValueError as e:
            self.cache._warn("holds a value that is not a measurement", e)

    def identify(self, drafter, key: dict) -> None:
        """What identifies the drafter across engines (its spec, its model): its step costs
        are restored from the cache and saved to it under this key."""
        self.names[drafter] = json.dumps(key, sort_keys=True)
        if drafter in self.drafters:  # measured before it had a name: restore what is unseen
            self._restore_drafter(self.drafters[drafter], self.names[drafter])

    def _restore_drafter(self, costs: "DrafterCosts", name: str) -> None:
        saved = self.saved.get("drafters", {})
        fits = saved.get(name) if isinstance(saved, dict) else None
        if not isinstance(fits, dict):
            return
        for field_name in ("steps", "tree_steps"):
            fit = getattr(costs, field_name)
            if field_name in fits and not fit.seen:
                self._restore(fit, fits[field_name])

    def of(self, drafter) -> DrafterCosts:
        if drafter not in self.drafters:
            hint = getattr(drafter, "cost_hint", None)
            model = getattr(drafter, "model", None)
            if hint is None and model is not None and self.target_bytes:
                hint = weight_bytes(model) / self.target_bytes
            costs = DrafterCosts(DEFAULT_COST_HINT if hint is None else hint)
            if drafter in self.names:
                self._restore_drafter(costs, self.names[drafter])
            self.drafters[drafter] = costs
        return self.drafters[drafter]

    def add_plain(self, seconds: float) -> None:
        # A step far above the estimate is a one-off (a graph captured, the host busy), unless
        # they keep coming.
        if self.plain.value is not None and seconds >= OUTLIER * self.plain.value:
            self._outliers += 1
            if self._outliers < OUTLIER_RUN:
                return
        self._outliers = 0
        self.plain.add(seconds)
        self.unsaved += 1

    def add_step(self, costs: DrafterCosts, k: int, seconds: float,
                 leaves: tuple[int, ...] | None = None) -> None:
        """A speculative step's wall time: a chain of k drafts, or (leaves: a depth's leaves) a
        tree of k spine tokens, timed over its chain (once there is a plain step to guess the
        chain from)."""
        if leaves is None:
            costs.steps.add(k, seconds)
        elif self.plain.value is not None:
            costs.tree_steps.add(sum(leaves), seconds - self.step_time(costs, k))
        else:
            return
        self.unsaved += 1

    def save(self) -> None:
        """Write the step costs to the cache, if it has one and anything new came in."""
        if self.cache is None or not self.unsaved:
            return
        drafters = {}
        for drafter, name in self.names.items():
            costs = self.drafters.get(drafter)
            if costs is not None:
                fits = {f: getattr(costs, f).state() for f in ("steps", "tree_steps")
                        if getattr(costs, f).seen}
                if fits:
                    drafters[name] = fits
        self.cache.save(self.plain.state() if self.plain.value is not None else None, drafters)
        self.unsaved = 0

    def save_if_due(self) -> None:
        """save() once SAVE_EVERY timings have come in since the last (between requests)."""
        if self.unsaved >= SAVE_EVERY:
            self.save()

    def step_time(self, costs: DrafterCosts, k: int, timed: bool = True, leaves: int = 0) -> float:
        """s(k) in seconds of a chain, or s_tree(k, leaves) of a tree with `leaves` leaves;
        timed=False: the guess below, in plain steps (no measurement)."""
        p = self.plain.value if timed else 1.0
        if not timed or not costs.steps.seen:  # a guess: the target's step, wider, and k drafted tokens
            chain = p * (1.1 + (costs.cost_hint + 0.02) * k)
        else:
            a, b = costs.steps.line(costs.cost_hint * p)
            chain = a + b * k
        if not leaves:
            return chain
        c, d = self.leaf_line(costs, timed)
        return chain + c + d * leaves

    def leaf_line(self, costs: DrafterCosts, timed: bool = True) -> tuple[float, float]:
        """(c, d): a tree of L leaves costs c + d · L seconds over its chain (timed=False, or
        before tree steps are timed: NODE_COST plain steps a leaf)."""
        p = self.plain.value if timed else 1.0
        if timed and costs.tree_steps.seen:
            return costs.tree_steps.line(p * NODE_COST)
        return 0.0, p * NODE_COST


def path_odds(alphas: list[float], k: int) -> tuple[list[float], list[float]]:
    """(kept, missed) at depths i = 1 … k: kept[i - 1] = Π_{j ≤ i} α_j, the chance that d_i is
    accepted; missed[i - 1] = Π_{j < i} α_j · (1 - α_i), that d_i is the first rejected (the
    last α stands for the depths past alphas; the prior, for all where there is none)."""
    kept, missed, run = [], [], 1.0
    for i in range(k):
        a = alphas[i] if i < len(alphas) else (alphas[-1] if alphas else PRIOR_ACCEPTANCE)
        missed.append(run * (1 - a))
        run *= a
        kept.append(run)
    return kept, missed


def expected_tokens(alphas: list[float], k: int, betas: list[float] | None = None) -> float:
    """E(k) = 1 + Σ_{i ≤ k} Π_{j ≤ i} α_j (the bonus or recovered token included); with betas
    (a tree's β_i, 0 where depth i has no leaves), E_tree(k): a leaf kept at depth i ends the
    path there, one token more than the spine's i - 1."""
    kept, missed = path_odds(alphas, k)
    return 1.0 + sum(kept) + sum(m * b for m, b in zip(missed, betas or ()))


def leaf_share(leaves: int) -> float:
    """1 + r + … + r^(leaves - 1): a depth's leaves' chance of a keep over its first leaf's."""
    return (1 - LEAF_DECAY ** leaves) / (1 - LEAF_DECAY)


def leaf_keep(first: float, leaves: int) -> float:
    """β(m): the chance that one of a depth's m leaves is kept (its spine token rejected), where
    the first is kept with chance `first`."""
    return min(1.0, first * leaf_share(leaves)) if leaves else 0.0


@lru_cache(maxsize=None)
def tree_shapes(widths: tuple[int, ...], budget: int, k: int) -> tuple[tuple[int, ...], ...]:
    """The leaves at depths 1 … k of each tree a step of k spine tokens may verify: with a
    node budget (budget > 0), the AUTO_TREE_PROFILES trimmed from their deepest depths to at most
    `budget` nodes (spine and leaves), the first profile's first; else widths' tree (none where
    widths make a chain)."""
    if not budget:
        leaves = spine_leaves(widths, k)
        return (leaves,) if any(leaves) else ()
    shapes = []
    for profile in AUTO_TREE_PROFILES:
        leaves = list(spine_leaves(profile, k))
        depth = k - 1
        while k + sum(leaves) > budget and depth >= 0:
            if leaves[depth]:
                leaves[depth] -= 1
            else:
                depth -= 1
        if any(leaves) and tuple(leaves) not in shapes:
            shapes.append(tuple(leaves))
    return tuple(shapes)


def most_tree_nodes(widths: tuple[int, ...], budget: int, k: int) -> int:
    """The most draft tokens one step of at most k spine tokens verifies as a tree (spine and
    leaves, `tree_shapes`); 0 where no step is a tree."""
    return max((j + sum(leaves) for j in range(1, k + 1)
                for leaves in tree_shapes(widths, budget, j)), default=0)


def best_k(alphas: list[float], step_time, plain_s: float, k_max: int
           ) -> tuple[int, float, float]:
    """(k, E(k), its rate in tokens/s) maximising E(k) / step_time(k) over 1 … k_max, or
    (0, 1, 1 / plain_s) where plain decoding is at least as fast."""
    best, e = (0, 1.0, 1.0 / plain_s), 1.0
    for k, kept in enumerate(path_odds(alphas, k_max)[0], 1):
        e += kept  # E(k)
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

    def __init__(self, model: CostModel, drafter, timed: bool = True, trees=None):
        """trees: where steps may be trees, trees(k) -> the leaves at depths 1 … k of each tree
        of k spine tokens to choose among (`tree_shapes` of the engine's widths or budget)."""
        self.model, self.costs, self.timed = model, model.of(drafter), timed
        self.trees = trees
        self.leaves: tuple[int, ...] | None = None  # the step chosen last's tree (None: a chain)
        self.betas = ([Ema(REQUEST_DECAY, b.value, 1.0) for b in self.costs.leaf]
                      if timed else [])
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
    def tree(self) -> bool:
        """Whether the step chosen last is a tree."""
        return self.leaves is not None


    @property
    def _plain_s(self) -> float:
        return self.model.plain.value if self.timed else 1.0

    def choose(self, k_max: int) -> int:
        """k for the next step (>= 1; plain decoding is chosen by after_step's stretches)."""
        # A probe after a plain stretch drafts too: the best k as if plain were not an option.
        k, self.predicted, self.leaves = self._best(k_max, float("inf"))
        return k

    def _best(self, k_max: int, plain_s: float) -> tuple[int, float, tuple[int, ...] | None]:
        """(k, E, the tree's leaves a depth or None for a chain) of the fastest step of at most
        k_max drafts, chain or tree; k = 0: plain decoding (at plain_s a token) is at least as
        fast."""
        alphas = self.acceptance()
        k, e, rate = best_k(alphas, self._step_time, plain_s, k_max)
        tree = None
        if self.trees is None:
            return k, e, tree
        # E_tree and s_tree of each candidate from per-depth terms found once (every step
        # weighs up to four trees a k): E(j) plus, at each depth with leaves, the chance that
        # its spine token is the first rejected times β(m); s(j) plus the leaves' line.
        kept, missed = path_odds(alphas, k_max)
        first = [PRIOR_LEAF if b.value is None else b.value for b in self.betas]
        first += [PRIOR_LEAF] * (k_max - len(first))
        gains = {}  # (depth, leaves) -> that depth's part of E_tree
        c, d = self.model.leaf_line(self.costs, self.timed)
        chain_e = 1.0
        for j in range(1, k_max + 1):
            chain_e += kept[j - 1]
            chain_s = self._step_time(j)
            for leaves in self.trees(j):
                e_j, n = chain_e, 0
                for i, m in enumerate(leaves):
                    if m:
                        g = gains.get((i, m))
                        if g is None:
                            g = gains[i, m] = missed[i] * leaf_keep(first[i], m)
                        e_j, n = e_j + g, n + m
                r = e_j / (chain_s + c + d * n)
                if r > rate:
                    k, e, rate, tree = j, e_j, r, leaves
        return k, e, tree

    def after_step(self, drafted: int, accepted: int, seconds: float,
                   leaf: bool | None = None, leaves: tuple[int, ...] | None = None) -> None:
        """drafted: k (a tree's spine); accepted: the path's length; leaf: for a tree step,
        whether the path ended in a leaf (None: a chain); leaves: that tree's leaves a depth
        (None: the tree chosen last, or the first of trees(drafted))."""
        if drafted == 0:  # nothing to draft: a plain token, then ask the drafter again
            self.stretch = 1
            return
        if leaf is not None and leaves is None:
            leaves = self.leaves
            if leaves is None or len(leaves) != drafted:
                leaves = next(iter(self.trees(drafted) if self.trees else ()), (0,) * drafted)
        self.model.add_step(self.costs, drafted, seconds, None if leaf is None else leaves)
        spine = accepted - 1 if leaf else accepted  # the spine tokens kept
        if leaf is not None and spine < drafted and leaves[spine]:
            # depth spine + 1 had leaves and its spine token was rejected: was a leaf kept?
            # (counted over the depth's leaves' share: an estimate of its first leaf's β)
            kept = (1.0 if leaf else 0.0) / leaf_share(leaves[spine])
            for betas, decay in ((self.betas, REQUEST_DECAY), (self.costs.leaf, DRAFTER_DECAY)):
                while len(betas) <= spine:
                    betas.append(Ema(decay))
                betas[spine].add(kept)
        for j in range(min(drafted, spine + 1)):  # positions that were tested
            kept = 1.0 if j < spine else 0.0
            if len(self.alphas) <= j:
                self.alphas.append(Ema(REQUEST_DECAY))
            if len(self.costs.acceptance) <= j:
                self.costs.acceptance.append(Ema(DRAFTER_DECAY))
            self.alphas[j].add(kept)
            self.costs.acceptance[j].add(kept)
        k, _, _ = self._best(max(drafted, len(self.alphas)), self._plain_s)
        # A step that beat plain decoding itself is trusted over the estimates: drafting goes
        # on (and the estimates catch up) where the text has turned predictable.
        guess = self.model.step_time(self.costs, drafted, False,
                                     0 if leaf is None else sum(leaves))
        paid = (accepted + 1) * self._plain_s >= (seconds if self.timed else guess)
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
