"""A small model of the same tokenizer, run autoregressively k times per step.

It keeps its own cache, filled with the prompt when the request begins (prefill work, timed
with the target's prefill), so that every proposal feeds one or two tokens (graphed). After
proposing d_1 … d_k its cache holds the context and
d_1 … d_{k-1} (d_k was sampled, never fed); when the target keeps n of them, the first
len(context) + min(n, k-1) cached positions are still right, and the next proposal feeds
the rest of the committed sequence (one or two tokens) before drafting again.

With `decode_kernel="megakernel"` (or "auto", the engine's default, where the kernel can run
the draft model and CUDA graphs are on), greedy proposals feed one token at a time through
`flashdraft.backends.megakernel` (one kernel a token, each step chained on the one before) wherever a
step feeds one token. The drafts are only proposals, so this changes how fast the target's
output comes, never what it is.
"""
from __future__ import annotations

import warnings

import torch

from ..backends.cuda_graphs import StepRunner, eager_step, prefill
from ..kv_cache import KVCache, grow_cache
from ..model import Transformer
from ..sampling import probs_from_logits, sample
from .base import Draft, DraftContext


class DraftModelDrafter:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype,
                 target_vocab: int, *, cuda_graphs: bool = True, decode_kernel: str = "graph"):
        self.model, self.device, self.dtype = model, device, dtype
        # Each one-token draft step replayed as a CUDA graph; None on a CPU (eager).
        self.runner = (StepRunner(model, device)
                       if cuda_graphs and torch.device(device).type == "cuda" else None)
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
        self._proposed = (0, 0)  # (context length, k) of the last proposal

    def ensure_capacity(self, max_len: int) -> None:
        grow_cache(self, max_len)
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
        self.n_cached = len(prompt)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        if k == 0:
            return Draft(torch.empty(1, 0, dtype=torch.long, device=self.device))
        params = ctx.params
        feed = torch.tensor([ctx.tokens[self.n_cached:]], device=self.device)
        start = self.n_cached
        tokens, probs = [], []
        mk = self.megakernel if params.greedy else None
        chained = False  # the megakernel's steps from here on need no inputs
        for i in range(k):
            if mk is not None and feed.shape[1] == 1:
                if not chained:
                    mk.start(feed, start)
                    chained = True
                mk.launch()
                tokens.append(mk.token_out.clone())  # the next step overwrites token_out
                start += 1
                continue
            # 1 or 2 tokens (graphed): the first of a request feeds the target's first token,
            # later ones what the target added after the kept drafts.
            if self.runner is not None and feed.shape[1] <= 2:
                logits, _ = self.runner(feed, start, self.cache, last_only=True)
            else:
                logits, _ = eager_step(self.model, feed, start, self.cache, last_only=True)
            logits = self._fit_vocab(logits[:, -1])  # [1, target vocab]
            if params.greedy:
                token = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
                token = sample(q, ctx.generator)
                probs.append(q)
            tokens.append(token)
            start += feed.shape[1]
            feed = token.view(1, 1)
        self._proposed = (len(ctx.tokens), k)
        q = torch.stack(probs, dim=1) if probs else None  # [1, k, vocab]
        return Draft(torch.stack(tokens, dim=1), q)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        extra = self.target_vocab - logits.shape[-1]
        if extra < 0:
            return logits[..., :self.target_vocab]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def commit(self, num_accepted: int) -> None:
        context, k = self._proposed
        if k:
            self.n_cached = context + min(num_accepted, k - 1)
