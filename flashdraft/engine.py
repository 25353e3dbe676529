"""The speculative loop: prefill -> propose -> verify -> commit -> stop.

Plain decoding is one target pass per token (`_decode_plainly`). A speculative request
chooses before each step how many tokens to draft, or to decode plainly for a stretch, from
the step costs and acceptance the engine measures as it runs (`scheduling`: k = argmax of
expected tokens per second; never a draft that the measurements say loses to plain).

The sequence invariant: `tokens` is prompt + generated, and the target's cache holds the
keys and values of all of `tokens` but the last, so every verification pass runs over
`[tokens[-1], d_1 … d_k]` at positions len - 1 … len - 1 + k.

A step may verify a token tree instead of a chain (`tree_widths`, or `tree_budget`: a few
shapes of at most that many nodes; `tree.SpineTree`: the drafter's spine with its next best
tokens beside each position) in the same single pass: the target's graph takes the tree's
visibility, the accepted path is the spine's first n tokens and perhaps one leaf, whose keys
and values then move to the slot after the spine's (`KVCache.compact`). The planner chooses
tree (and, with a budget, its shape) or chain each step.

One host synchronisation per speculative step: the accepted count, the next token and the
draft come back together in one transfer. Plain decoding runs one step ahead and never waits
for the GPU: each token is read while the step after it runs.

Plain decoding's steps are CUDA graphs of the model's kernels, or, with
`decode_kernel="megakernel"`, one persistent kernel a token (`flashdraft.backends.megakernel`: Hopper,
Qwen2 / Qwen3 / Llama in bfloat16 or int4) for greedy requests without a drafter. Its tokens
can differ from the graphs' where two logits nearly tie; speculative requests (their plain
stretches included) stay on the graphs, so their output is the graph path's plain decoding. (A
draft model's one-token steps take the megakernel wherever it runs unless decode_kernel="graph":
drafts only propose, so that changes no output.)

Sampling (T > 0) runs on the device and inside the same graphs: a plain step's token is drawn
by its graph (`SampledPick`), and a speculative step's whole acceptance rule — p and q from
logits with temperature / top-k / top-p / min-p and no vocabulary sort, the accept tests, the
residual or bonus draw — is its verification graph's `post` (`SampledVerify`), so a sampled
step costs a greedy one's launches and one host read. The random numbers come from Philox
keyed by one RNG state on the device (seed, counter), reset from the request's seed and
advanced by each step's graph: a seed gives the same output on the same GPU and settings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .backends import kernels
from .config import SamplingParams, check_decode_kernel, check_tree_budget, check_tree_widths
from .backends.cuda_graphs import StepRunner, eager_step, prefill
from .drafters.base import Draft, DraftContext, Drafter
from .kv_cache import KVCache, grow_cache
from .model import Transformer
from .sampling import SampledPick, fused_by_default, make_rng
from .scheduling import (CostModel, SpeculationPlanner, StepCostCache, most_tree_nodes,
                         tree_shapes)
from .verify import SampledVerify, SpineTreeGreedy, SpineTreeVerify, greedy_result


@dataclass
class RequestMetrics:
    """Per-request figures, named as in BENCHMARKS.md."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # prefill included: plain decoding has tau = 1
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)  # n of each speculative step
    drafted_per_step: list[int] = field(default_factory=list)  # k of each speculative step
    # the planner's expected tokens E(k) of each speculative step (achieved: n + 1)
    predicted_per_step: list[float] = field(default_factory=list)
    plain_tokens: int = 0  # from plain steps run ahead (plain decoding: all but the first)
    leaf_steps: int = 0  # tree steps whose accepted path ended in a leaf (an alternative)
    # GPU time (CUDA events; wall time on a CPU) of the speculative steps' drafting and
    # verification, summed over the steps that verified a draft
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    ttft_s: float = 0.0
    decode_time_s: float = 0.0  # from the first generated token to the last
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length: generated tokens / target passes (bonus token included)."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For draft position i, the fraction of steps that drafted it and accepted it."""
        width = max(self.drafted_per_step, default=0)
        out = []
        for i in range(width):
            drafted = sum(1 for k in self.drafted_per_step if k > i)
            accepted = sum(1 for n in self.accepted_per_step if n > i)
            out.append(accepted / drafted if drafted else 0.0)
        return out

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first (= 1 / TPOT)."""
        n = self.generated_tokens - 1
        return n / self.decode_time_s if n > 0 and self.decode_time_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        n = self.generated_tokens - 1
        return self.decode_time_s / n if n > 0 else 0.0

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for name in ("tau", "acceptance_rate", "per_position_acceptance", "decode_tokens_per_s",
                     "tpot_s", "e2e_tokens_per_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class StepOutput:
    """What one step committed: new token ids, the finish reason once finished."""
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_string: str | None = None  # the stop string that ended the request, if any


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Runs one sequence at a time through a target model and an optional drafter."""

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, eos_token_ids: tuple[int, ...], *,
                 cuda_graphs: bool = True, compile: bool = False, adaptive: bool = True,
                 decode_kernel: str = "auto", fused_sampling: bool | None = None,
                 tree_widths: tuple[int, ...] = (), tree_budget: int = 0,
                 step_cost_cache: StepCostCache | None = None):
        """step_cost_cache: where the cost model's step costs are kept across engines of this
        setup (scheduling.StepCostCache; None: this engine measures its own from scratch)."""
        self.model, self.device, self.dtype = model, device, dtype
        self.tree_widths, self.tree_budget = tree_widths, tree_budget
        # Speculation chosen per step by the cost model (scheduling.SpeculationPlanner) for
        # drafters that allow it; False: k drafts at every step.
        self.adaptive = adaptive
        # this engine's measured step costs (started from the cache's) and acceptance
        self.costs = CostModel(model, step_cost_cache)
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache: KVCache | None = None
        # Decode and verification steps replayed as CUDA graphs; None on a CPU (eager).
        # (A model whose steps keep host-side state in its cache declares cuda_graphs = False.)
        self.runner = (StepRunner(model, device, compile=compile)
                       if cuda_graphs and torch.device(device).type == "cuda"
                       and getattr(model, "cuda_graphs", True) else None)
        check_decode_kernel(decode_kernel)
        if decode_kernel == "megakernel":
            from .backends.megakernel import refuse_unsupported
            refuse_unsupported(model, device)
        self.decode_kernel = decode_kernel
        self.megakernel = None  # built with each cache (ensure_capacity)
        # Sampling (T > 0) on the device: each step's token, and a speculative step's whole
        # acceptance rule, inside the step's graph (SampledPick, SampledVerify), keyed by one
        # RNG state that every request resets from its seed. fused: the Triton kernels (no
        # vocabulary sort); else their PyTorch reference (the CPU default).
        self.fused_sampling = (fused_by_default(device) if fused_sampling is None
                               else bool(fused_sampling))
        self.rng = make_rng(0, device)
        self._posts: dict[tuple, SampledPick] = {}  # one per parameter set: graphs key on it

    def close(self) -> None:
        """Save what the cost model measured (where it has a cache); the engine stays usable."""
        self.costs.save()

    @property
    def tree_widths(self) -> tuple[int, ...]:
        """Candidates a depth of the token trees verified where a drafter proposes them
        (DraftContext.tree_widths); () or all 1: chains."""
        return self._tree_widths

    @tree_widths.setter
    def tree_widths(self, widths) -> None:
        widths = check_tree_widths(widths)
        if any(w > 1 for w in widths):
            self._refuse_trees(f"tree_widths {list(widths)}")
        self._tree_widths = widths

    @property
    def tree_budget(self) -> int:
        """The most nodes (spine and leaves) of the token trees whose shapes the cost model
        chooses (scheduling.tree_shapes); 0: the tree_widths' trees, if any."""
        return self._tree_budget

    @tree_budget.setter
    def tree_budget(self, budget) -> None:
        budget = check_tree_budget(budget)
        if budget:
            self._refuse_trees(f"tree_budget {budget}")
        self._tree_budget = budget

    def _refuse_trees(self, asked: str) -> None:
        if not getattr(self.model, "supports_trees", False):
            raise ValueError(f"{asked}: token trees need a target whose forward verifies "
                             f"them (the dense models and the hybrid); "
                             f"{type(self.model).__name__} verifies chains only")

    def ensure_capacity(self, length: int, drafter: Drafter | None = None,
                        steps: int = 1, tree_nodes: int = 0) -> None:
        """Size the caches for a request before it starts; never on the hot path. steps: the
        longest chain the target's cache may roll back into (verifying k drafts: k + 1);
        tree_nodes: the most tokens of a token tree's verification (0: no trees)."""
        # Round up so that similar requests reuse one allocation.
        length = min(-(-length // 256) * 256, self.max_model_len + 64)
        grow_cache(self, length, steps, tree_nodes)
        if self.decode_kernel == "megakernel" and self.megakernel is None:
            from .backends.megakernel import DecodeMegakernel  # compiled once a shape (NVRTC)
            self.megakernel = DecodeMegakernel(self.model, self.cache)
        if drafter is not None and hasattr(drafter, "ensure_capacity"):
            drafter.ensure_capacity(length, steps)

    def _forward(self, tokens: list[int] | torch.Tensor, start: int, hidden_layers, post=None,
                 tree=None):
        """The target's step; with `post`, also post(tokens, logits) (inside the step's graph);
        tree: the TreeMask of a tree's verification pass."""
        ids = torch.as_tensor(tokens, device=self.device).view(1, -1)
        if self.runner is not None:
            return self.runner(ids, start, self.cache, hidden_layers, post=post, tree=tree)
        return eager_step(self.model, ids, start, self.cache, hidden_layers, post=post, tree=tree)

    @torch.inference_mode()
    def run(self, prompt: list[int], params: SamplingParams, drafter: Drafter | None = None,
            k: int = 0, metrics: RequestMetrics | None = None):
        """Generate for one prompt; yields a StepOutput per step, the last with a finish_reason.

        Closing the generator (e.g. a client went away) stops the request between steps.
        metrics: a fresh RequestMetrics to fill (one is made if None).
        """
        metrics = metrics if metrics is not None else RequestMetrics()
        metrics.prompt_tokens = len(prompt)
        max_new = min(params.max_tokens, self.max_model_len - len(prompt))
        if max_new < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens, which leaves no room to "
                             f"generate within max_model_len={self.max_model_len}")
        # A step verifies at most k drafts, or a tree of k spine tokens and their leaves.
        tree = most_tree_nodes(self.tree_widths, self.tree_budget, k) if drafter else 0
        nodes = max(k, tree) if drafter else 0
        self.ensure_capacity(len(prompt) + max_new + nodes + 1, drafter,
                             steps=k + 1 if drafter else 1,
                             tree_nodes=nodes + 1 if tree else 0)
        # How attention cuts the cache into splits fixes how its partial sums are added, so it
        # must follow from the request alone: not from k (speculation must return plain
        # decoding's tokens) nor from the cache's size, which earlier, longer requests set.
        self.cache.split_len = kernels.split_length(len(prompt) + max_new)
        req = _Request(prompt, params, max_new, drafter, k, metrics, self.eos_token_ids,
                       self.device, self.costs if self.adaptive else None, self.tree_widths,
                       self.tree_budget)
        if self.decode_kernel == "megakernel" and drafter is None and params.greedy:
            req.megakernel = self.megakernel

        start = time.perf_counter()
        logits, hidden = prefill(self.model, prompt, self.cache, req.hidden_layers, self.runner,
                                 self.device)
        if not params.greedy:
            self.rng.copy_(make_rng(req.seed))
        first = self._pick(logits, params)
        if drafter is not None:  # its prefill, if it has one, is queued behind the target's
            drafter.begin(prompt)
        step = req.commit([int(first)])  # the one sync of the prefill; the drafter is told
        last = first.view(1, 1)  # [1, 1]: the last committed token, kept on the device
        metrics.ttft_s = time.perf_counter() - start
        decode_start = time.perf_counter()
        ended = None  # when plain decoding read its last token
        try:
            yield step
            while step.finish_reason is None:
                if drafter is None or req.policy is not None and req.policy.plain:
                    step, last, ended = yield from self._decode_plainly(req, last)
                else:
                    out = self._speculate(req, last, hidden)
                    if out is None:  # nothing drafted: plain decoding takes the token
                        continue
                    step, last, hidden = out
                yield step
            if req.megakernel is not None:
                req.megakernel.check()  # a wait that gave up: its tokens are not the model's
        finally:
            _sync(self.device)
            ended = ended or time.perf_counter()
            metrics.decode_time_s = ended - decode_start
            metrics.total_time_s = ended - start
            self.costs.save_if_due()  # between requests, off every step's path

    def _speculate(self, req: "_Request", last: torch.Tensor, hidden: list[torch.Tensor]
                   ) -> tuple[StepOutput, torch.Tensor, list[torch.Tensor]] | None:
        """One speculative step after `last` ([1, 1], the last committed token): draft, verify
        the draft in one target pass, commit. hidden: the target's hidden states at the
        drafter's `hidden_layers` (empty if none) for the positions the last pass committed to
        its cache, each [1, n_new, hidden_size] (DraftContext.hidden). Returns (the step's
        StepOutput, its last token [1, 1] on the device, this pass's hidden states for the
        positions it committed: [1, n + 1, hidden_size] each), or None where the draft is empty
        and the planner hands the token to plain decoding."""
        began = time.perf_counter()
        params = req.params
        # Leave room for the bonus token within the budget and the context.
        budget = min(req.k, req.max_new - req.generated - 1)
        if req.policy is not None and budget > 0:
            budget = req.policy.choose(budget)
        req.timer.mark(0)
        draft = self._propose(req, hidden, budget)
        req.timer.mark(1)
        n_draft = draft.tokens.shape[1]
        if n_draft == 0 and req.policy is not None:
            req.policy.after_step(0, 0, 0.0)  # an empty draft is not verified: decode it plainly
            return None
        position = len(req.tokens) - 1
        if n_draft == 0:  # nothing to verify: a plain decoding step
            logits, hidden = self._forward(last, position, req.hidden_layers)
            next_token = self._pick(logits, params)
            n, new = 0, [int(next_token)]
        else:
            tree = draft.tree
            verify_in = torch.cat([last, draft.tokens], dim=1)  # [1, nodes + 1]
            if params.greedy:  # verified inside the step's graph
                post = greedy_result if tree is None else self._tree_greedy(tree)
            else:  # so is sampled verification, with the draft's q loaded first
                post = self._sampled_post(params, draft.q_logits is not None, n_draft + 1, tree)
                if draft.q_logits is not None:
                    post.load(draft.q_logits[0])
            logits, hidden, packed = self._forward(verify_in, position, req.hidden_layers,
                                                   post=post,
                                                   tree=None if tree is None else tree.mask)
            req.timer.mark(2)
            result = packed.tolist()  # the step's one synchronisation
            drafting, verifying = req.timer.read()
            req.metrics.draft_time_s += drafting
            req.metrics.verify_time_s += verifying
            if tree is None:  # [n, next, drafts]
                n, new, next_token = result[0], result[2:2 + result[0]] + [result[1]], packed[1:2]
            else:  # [n, leaf, next, nodes]
                path = tree.path(result[0], result[1])
                n, new, next_token = len(path), [result[3 + i] for i in path], packed[2:3]
                new.append(result[2])
                n_draft = tree.k
                if result[1] >= 0:  # a leaf ends the path: it moves to the slot after the spine's
                    req.metrics.leaf_steps += 1
                    self.cache.compact(position + 1 + result[0], [result[1] - result[0]])
                    # the rows of last and the path, for a drafter that reads hidden states
                    rows = torch.tensor([0, *(1 + i for i in path)], device=self.device)
                    hidden = [h.index_select(1, rows) for h in hidden]
        # The pass ran over [last, d_1 … d_k]: the rows of last and the n accepted drafts are
        # committed, the rest are rejected drafts' (dropped from the cache: a length moves back).
        # Views: nothing is copied (nor computed, when no layers were requested).
        self.cache.commit(position + n + 1)
        hidden = [h[:, :n + 1] for h in hidden]
        if n_draft:
            m = req.metrics
            m.drafted_tokens += n_draft
            m.accepted_tokens += n
            m.drafted_per_step.append(n_draft)
            m.accepted_per_step.append(n)
            if req.policy is not None:
                m.predicted_per_step.append(round(req.policy.predicted, 3))
        step = req.commit(new)  # the drafter is told which tokens
        if req.policy is not None:
            tree = draft.tree
            req.policy.after_step(n_draft, n, time.perf_counter() - began,
                                  None if tree is None else result[1] >= 0,
                                  None if tree is None else tree.leaves)
        return step, next_token.view(1, 1), hidden

    def _decode_plainly(self, req: "_Request", last: torch.Tensor):
        """Plain decoding from `last` ([1, 1], the last committed token, on the device), one step
        ahead: the step after token n is launched on token n while it is still on the device,
        before the host reads it, so the host's work per token (the read, stop checks, the
        caller's detokenizing) overlaps the GPU's next step. Yields each token's StepOutput but
        the last, which it returns for the caller to yield: (that StepOutput, its token on the
        device, the time it was read if the request finished there, else None). The last is
        where the request finishes (the step ahead is dropped: its cache entry lies past the
        last token, and the capacity has room for it), or the one after the planner
        said to draft again: the step ahead's, read as the next token."""
        cur = self._plain_step(req, last, len(req.tokens) - 1)
        # The interval between tokens is what a plain token costs (its first one in a stretch
        # also waits for the launch): the cost model's plain step, where the graphs run it.
        timed = req.megakernel is None
        read_at = None
        while True:
            ahead = None
            if req.generated + 1 < req.max_new:  # a token may follow cur's
                ahead = self._plain_step(req, cur[0], len(req.tokens))
            token = req.reader.read(cur[1])
            now = time.perf_counter()
            if timed and read_at is not None:
                self.costs.add_plain(now - read_at)
            read_at = now
            step = req.commit([token], plain=True)
            if step.finish_reason is not None:  # the step ahead is not the request's
                return step, cur[0], time.perf_counter()
            yield step
            if req.policy is not None and req.policy.resume(req.tokens):
                step = req.commit([req.reader.read(ahead[1])], plain=True)
                return step, ahead[0], (time.perf_counter() if step.finish_reason else None)
            cur = ahead

    def _plain_step(self, req: "_Request", last: torch.Tensor, position: int):
        """Launch a plain decoding step on `last` ([1, 1] on the device) at `position`: returns
        the next token ([1, 1], on the device) and the request's reader's handle to it. Through
        the megakernel the token is its output buffer, which the step after overwrites; each
        step leaves its token and position as the next one's inputs, so only the first of a
        request sets them."""
        mk = req.megakernel
        if mk is not None:
            if last.data_ptr() != mk.token_out.data_ptr():
                mk.start(last, position)
            mk.launch()
            token = mk.token_out.view(1, 1)
        else:
            if req.params.greedy:
                logits, _ = self._forward(last, position, ())
                token = logits[:, -1].argmax(-1)
            else:  # drawn inside the step's graph
                _, _, token = self._forward(last, position, (), post=self._sampled_post(req.params))
            token = token.view(1, 1)
        return token, req.reader.start(token)

    def _pick(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The token after logits [1, T, vocab]'s last row: [1] on the device."""
        if params.greedy:
            return logits[:, -1].argmax(-1)
        return self._sampled_post(params)(None, logits)

    def _sampled_post(self, params: SamplingParams, with_q: bool | None = None,
                      rows: int = 0, tree=None) -> SampledPick:
        """The post that samples a plain step's token (with_q None), or verifies a sampled
        speculative step of `rows` tokens against a draft with q (with_q) or one-hot drafts,
        a chain or a `tree.SpineTree`. One object per parameter set (and tree), kept: graphs
        are captured per object. A chain's q buffer holds as many rows as a graph step can
        verify, more where a longer step asks; a tree's, its spine."""
        filt = (params.temperature, params.top_k, params.top_p, params.min_p)
        key = (filt, with_q, tree)
        post = self._posts.get(key)
        if post is None or with_q and tree is None and post.q.shape[0] < rows:
            vocab = self.model.cfg.vocab_size
            if with_q is None:
                post = SampledPick(*filt, self.rng, fused=self.fused_sampling, vocab=vocab)
            elif tree is not None:
                post = SpineTreeVerify(tree, *filt, self.rng, fused=self.fused_sampling,
                                       vocab=vocab, with_q=with_q)
            else:
                graph_rows = self.runner.max_graph_tokens if self.runner is not None else 0
                post = SampledVerify(*filt, self.rng, fused=self.fused_sampling, vocab=vocab,
                                     with_q=with_q, capacity=max(rows, graph_rows))
            self._posts[key] = post
        return post

    def _tree_greedy(self, tree) -> SpineTreeGreedy:
        """The greedy post of a tree shape, one object per shape (graphs key on it)."""
        post = self._posts.get(("greedy", tree))
        if post is None:
            post = self._posts[("greedy", tree)] = SpineTreeGreedy(tree)
        return post

    def _propose(self, req: "_Request", hidden: list[torch.Tensor], k: int) -> Draft:
        """The request's drafter's draft of at most k tokens (none where k <= 0)."""
        if k <= 0:
            return Draft(torch.empty(1, 0, dtype=torch.long, device=self.device))
        # The tree the planner chose (None: the chain), or without a planner the first there is.
        if req.policy is not None:
            leaves = req.policy.leaves
        else:
            leaves = next(iter(req.trees(k)), None) if req.trees is not None else None
        widths = () if leaves is None else tuple(m + 1 for m in leaves)
        return req.drafter.propose(DraftContext(req.tokens, req.params, req.seed, hidden,
                                                widths), k)


class _Request:
    """One request's state in `Engine.run`: its committed tokens (prompt + generated), how it
    stops, and what it drafts with."""

    def __init__(self, prompt: list[int], params: SamplingParams, max_new: int,
                 drafter: Drafter | None, k: int, metrics: RequestMetrics,
                 eos_token_ids: tuple[int, ...], device: torch.device,
                 costs: CostModel | None, tree_widths: tuple[int, ...] = (),
                 tree_budget: int = 0):
        self.tokens, self.n_prompt = list(prompt), len(prompt)
        self.params, self.max_new, self.metrics = params, max_new, metrics
        self.stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(eos_token_ids))
        # The seed of the request's RNG state; drawn from torch's generator where the request
        # names none (torch.manual_seed then fixes it too).
        self.seed = (params.seed % 2 ** 63 if params.seed is not None
                     else int(torch.randint(0, 2 ** 62, (1,))))
        self.drafter, self.k = drafter, k
        self.hidden_layers = drafter.hidden_layers if drafter is not None else ()
        # Token trees where the engine verifies them and the drafter builds them: trees(k), the
        # leaves a depth of each tree of k spine tokens, which the planner chooses among and
        # against the chain each step.
        self.trees = None
        if (drafter is not None and getattr(drafter, "builds_trees", False)
                and (tree_budget or any(w > 1 for w in tree_widths))):
            self.trees = lambda k: tree_shapes(tree_widths, tree_budget, k)
        # Drafters that read the target's hidden states need every step to be theirs.
        # A seeded sampled request's choices follow from its tokens alone (reproducible).
        timed = params.greedy or params.seed is None
        self.policy = (SpeculationPlanner(costs, drafter, timed, self.trees)
                       if drafter is not None and costs is not None and not drafter.hidden_layers
                       else None)
        self.reader = TokenReader(device)  # plain decoding's, kept for every stretch
        self.timer = StepTimer(device)  # a speculative step's drafting and verification
        self.megakernel = None  # plain decoding's steps, where the engine uses one

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def commit(self, new: list[int], plain: bool = False) -> StepOutput:
        """Append the tokens of one target pass (up to the first stop token, which ends the
        request there), tell the drafter which they are, and say whether the request finished.
        Every committed token passes here: the first after the prefill, each speculative
        step's, each of plain decoding."""
        for i, t in enumerate(new):
            if t in self.stop_ids:
                new = new[:i + 1]
                break
        self.tokens.extend(new)
        if self.drafter is not None:
            self.drafter.commit(new)
        self.metrics.target_passes += 1
        self.metrics.generated_tokens += len(new)
        self.metrics.plain_tokens += len(new) if plain else 0
        if new and new[-1] in self.stop_ids:
            return StepOutput(new, "stop")
        if self.generated >= self.max_new:
            return StepOutput(new, "length")
        return StepOutput(new)


class StepTimer:
    """Times the parts of a speculative step without a synchronisation of its own: CUDA
    events marked between them, read after the step's one host read has passed them (wall
    time on a CPU, where every step is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = ([torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda
                      else [0.0] * 3)

    def mark(self, i: int) -> None:
        if self.cuda:
            self.marks[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def read(self) -> tuple[float, float]:
        """(seconds from mark 0 to 1, from 1 to 2), once the work before mark 2 is done."""
        a, b, c = self.marks
        if self.cuda:
            return a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3
        return b - a, c - b


class TokenReader:
    """Reads device tokens on the host without waiting for the work queued after them: each
    token is copied to pinned memory as soon as it is computed, with an event behind the copy
    (two buffers in turn: a token is read before the buffer is reused)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.buffers = [torch.empty(1, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self.turn = 0

    def start(self, token: torch.Tensor):
        if not self.cuda:  # the value now, as the copy below keeps it: token's buffer may be
            return int(token)  # written again before the read (the megakernel's token_out)
        buf = self.buffers[self.turn]
        self.turn ^= 1
        buf.copy_(token.view(-1), non_blocking=True)  # on the stream of token's device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(token.device))
        return buf, event

    def read(self, handle) -> int:
        if not self.cuda:
            return int(handle)
        buf, event = handle
        event.synchronize()
        return int(buf[0])
