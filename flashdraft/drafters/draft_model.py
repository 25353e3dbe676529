"""A small model of the same tokenizer, run autoregressively k times per step.

It keeps its own cache, filled with the prompt when the request begins (prefill work, timed
with the target's prefill), so that every proposal feeds one or two tokens (graphed). After
proposing d_1 … d_k its cache holds the context and d_1 … d_{k-1} (d_k was sampled, never
fed). The tokens committed next are compared with the proposal: where the first m of them
are d_1 … d_m, the first len(context) + min(m, k-1) cached positions are still right, and
the next proposal feeds the rest of the committed sequence (one or two tokens after a
speculative step, more after a plain stretch) before drafting again. After a verification
that kept n drafts, m = n: the recovered token never equals the rejected draft (greedy: it
is the target's argmax, which d_{n+1} was not; sampled: the residual has no mass there).

With `decode_kernel="megakernel"` (or "auto", the engine's default, where the kernel can run
the draft model and CUDA graphs are on), proposals feed one token at a time through
`flashdraft.backends.megakernel` (one kernel a token) wherever a step feeds one token: greedy
steps chained on the one before, sampled ones each given the token drawn from the logits of
the one before (q is those logits, so it is exactly the distribution the draft came from).
The drafts are only proposals, so this changes how fast the target's output comes, never what
it is.

Asked for a tree (DraftContext.tree_widths), it drafts the same spine and puts beside each d_i
the next best tokens of the row d_i came from (`tree.SpineTree`): no extra step, one top-k a
depth.

Sampled drafts are drawn on the device (`SampledPick`, inside the step's graph on the graph
path) from an RNG state of the drafter's own, keyed by the request's seed.
"""
from __future__ import annotations

import warnings

import torch

from ..backends.cuda_graphs import StepRunner, eager_step, prefill
from ..kv_cache import KVCache, grow_cache
from ..model import Transformer
from ..sampling import SampledPick, fit_vocab, fused_by_default, make_rng
from ..tree import alternatives, spine_leaves, spine_tree
from .base import Draft, DraftContext

# The draft's race draws from a stream of its own (its RNG state is its own too).
DRAFT_STREAM = 2


class DraftModelDrafter:
    hidden_layers: tuple[int, ...] = ()
    builds_trees = True  # DraftContext.tree_widths: a SpineTree of its next best tokens

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype,
                 target_vocab: int, *, cuda_graphs: bool = True, decode_kernel: str = "graph",
                 fused_sampling: bool | None = None):
        self.model, self.device, self.dtype = model, device, dtype
        # Sampled drafts: each step's token drawn inside its graph (SampledPick) from an RNG
        # state of the drafter's own, keyed by the request's seed in its first proposal.
        self.fused_sampling = (fused_by_default(device) if fused_sampling is None
                               else fused_sampling)
        self.rng = make_rng(0, device)
        self._picks: dict[tuple, SampledPick] = {}
        self._seeded = False
        # Each one-token draft step replayed as a CUDA graph; None on a CPU (eager).
        self.runner = (StepRunner(model, device)
                       if cuda_graphs and torch.device(device).type == "cuda"
                       and getattr(model, "cuda_graphs", True) else None)
        # A catch-up can run padded where the cache holds keys and values alone (the padding's
        # land past the real tokens, unread): not a recurrent model's states.
        self.pads_freely = getattr(model, "pads_freely", False)
        # Checkpoints of one family pad their embeddings differently (e.g. 151,936 vs 152,064
        # rows for one tokenizer): q is cut or padded to the target's width, and sampled from
        # in that form, so that q is exactly the distribution the drafts came from.
        self.target_vocab = target_vocab
        if decode_kernel == "auto" and not cuda_graphs:  # eager asked for: eager it is
            decode_kernel = "graph"
        why = None  # why the megakernel cannot run the draft model, where it was asked for
        if decode_kernel != "graph":
            from ..backends.megakernel import why_not
            why = why_not(model, device)
            if not why and model.cfg.vocab_size > target_vocab:  # its argmax: a row cut off?
                why = (f"its {model.cfg.vocab_size} logits would need cutting to the target's "
                       f"{target_vocab}")
            if why and decode_kernel == "megakernel":
                raise ValueError(f"--decode-kernel megakernel cannot run the draft model: {why}; "
                                 f"use --decode-kernel graph or auto")
        self.use_megakernel = decode_kernel != "graph" and not why
        self.decode_kernel = decode_kernel
        self.megakernel = None  # built with each cache (ensure_capacity)
        self.cache: KVCache | None = None
        self.n_cached = 0  # positions of the committed sequence that the cache holds correctly
        self.length = 0  # of the committed sequence, as begin() and commit() told it
        # The proposal not yet compared with committed tokens: (the length of the context it
        # followed, its tokens [1, k] on the host, the event after their copy or None on a CPU).
        self._proposal: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None

    def ensure_capacity(self, max_len: int, steps: int = 1) -> None:
        """Room for a request of max_len positions whose proposals of up to steps - 1 tokens
        roll back (a recurrent draft model keeps its states that far back)."""
        grow_cache(self, max_len, steps)
        if self.use_megakernel and self.megakernel is None:
            from ..backends.megakernel import DecodeMegakernel  # compiled once a shape (NVRTC)
            try:
                self.megakernel = DecodeMegakernel(self.model, self.cache)
            except (RuntimeError, ValueError) as err:  # e.g. NVRTC on a GPU it does not know
                if self.decode_kernel != "auto":
                    raise
                warnings.warn(f"the decode megakernel could not be built for the draft model "
                              f"({err}); its steps run on the CUDA graphs", stacklevel=2)
                self.use_megakernel = False

    @torch.inference_mode()
    def begin(self, prompt: list[int]) -> None:
        # The prompt's keys and values (a graph per padded length on a GPU); no logits needed.
        prefill(self.model, prompt, self.cache, (), self.runner, self.device)
        self.n_cached = self.length = len(prompt)
        self._proposal = None
        self._seeded = False

    def _pick(self, params) -> SampledPick:
        key = (params.temperature, params.top_k, params.top_p, params.min_p)
        pick = self._picks.get(key)
        if pick is None:
            pick = self._picks[key] = SampledPick(*key, self.rng, fused=self.fused_sampling,
                                                  stream=DRAFT_STREAM, vocab=self.target_vocab)
        return pick

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        if k == 0:
            return Draft(torch.empty(1, 0, dtype=torch.long, device=self.device))
        params = ctx.params
        feed = torch.tensor([ctx.tokens[self.n_cached:]], device=self.device)
        start = self.n_cached
        tokens, q_rows = [], []
        mk = self.megakernel
        pick = None if params.greedy else self._pick(params)
        if pick is not None and not self._seeded:  # the request's first sampled proposal
            self.rng.copy_(make_rng(ctx.seed or 0))
            self._seeded = True
        chained = False  # the megakernel's steps from here on need no inputs
        # A tree's leaves a depth: the step's next best tokens beside its own (capped by the
        # vocabulary), taken from its row before the next step overwrites it.
        leaves = [min(m, self.target_vocab - 1) for m in spine_leaves(ctx.tree_widths, k)]
        alts = []
        for i in range(k):
            if mk is not None and feed.shape[1] == 1:
                if pick is not None:  # sampled: each step's input is the token drawn
                    mk.start(feed, start)  # from the step before's logits
                    mk.launch()
                    logits = mk.logits.view(1, 1, -1)
                    feed = pick(None, logits).view(1, 1)
                    q_rows.append(pick.fit(logits[:, -1]).clone())
                    tokens.append(feed.view(1))
                    if leaves[i]:
                        alts.append(alternatives(q_rows[-1], feed, leaves[i:i + 1]))
                    start += 1
                    continue
                if not chained:
                    mk.start(feed, start)
                    chained = True
                mk.launch()
                tokens.append(mk.token_out.clone())  # the next step overwrites token_out
                if leaves[i]:
                    row = fit_vocab(mk.logits.view(1, -1), self.target_vocab)
                    alts.append(alternatives(row, tokens[-1], leaves[i:i + 1]))
                start += 1
                continue
            # 1 or 2 tokens (graphed): the first of a request feeds the target's first token,
            # later ones what the target added after the kept drafts.
            # A sampled step draws its token inside its graph (pick), from logits that the
            # next replay overwrites: the row is copied out as q's.
            # More after a plain stretch: one padded graph of the catch-up.
            if self.runner is not None and feed.shape[1] <= 2:
                out = self.runner(feed, start, self.cache, last_only=True, post=pick)
            elif self.runner is not None and self.pads_freely:
                out = self.runner.catch_up(feed, start, self.cache, post=pick)
            else:
                out = eager_step(self.model, feed, start, self.cache, last_only=True, post=pick)
            if pick is None:
                row = fit_vocab(out[0][:, -1], self.target_vocab)  # [1, target vocab]
                token = row.argmax(-1)  # [1]
            else:
                token = out[2]
                row = pick.fit(out[0][:, -1]).clone()  # [1, target vocab]
                q_rows.append(row)
            if leaves[i]:
                alts.append(alternatives(row, token, leaves[i:i + 1]))
            tokens.append(token)
            start += feed.shape[1]
            feed = token.view(1, 1)
        drafted = torch.stack(tokens, dim=1)  # [1, k]: the spine, where there is a tree
        # A copy to the host queued behind the drafts, read in commit(): by then the engine's
        # one synchronisation of the step has passed it, so reading it waits for nothing.
        event = None
        if drafted.is_cuda:
            host = drafted.to("cpu", non_blocking=True)  # pinned, filled when the queue gets there
            event = torch.cuda.Event()
            event.record()
        else:
            host = drafted
        self._proposal = (len(ctx.tokens), host, event)
        q_logits = torch.stack(q_rows, dim=1) if q_rows else None  # [1, k, target vocab]
        if not alts:
            return Draft(drafted, q_logits)
        nodes = torch.cat([drafted, torch.cat(alts).view(1, -1)], dim=1)  # [1, k + leaves]
        return Draft(nodes, q_logits, spine_tree(k, leaves, self.device))

    def commit(self, tokens: list[int]) -> None:
        proposal, self._proposal = self._proposal, None
        if proposal is not None and proposal[0] == self.length:  # tokens follow its context
            context, host, event = proposal
            if event is not None:
                event.synchronize()
            drafted = host[0].tolist()
            m = 0  # committed tokens that are the proposal's
            while m < min(len(tokens), len(drafted)) and tokens[m] == drafted[m]:
                m += 1
            self.n_cached = context + min(m, len(drafted) - 1)
        self.length += len(tokens)
