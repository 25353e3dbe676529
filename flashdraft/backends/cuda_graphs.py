"""Fixed-shape forward steps captured as CUDA graphs and replayed.

One decode step of a 1.5B model launches hundreds of kernels (~9 a layer with the fused
kernels of `flashdraft.backends.kernels`, ~28 with the PyTorch path); launched one by one from Python
they take several times longer than the GPU needs to stream the weights. A CUDA graph records
the launches of one step once and replays them with one call, so the step costs what its
kernels cost.

A graph fixes every shape and address. Shapes: the number of tokens T of the step, and the
number of cache positions attention reads (kv_len), rounded up to a bucket of `kv_bucket`
positions. The rounding is safe because the model's mask comes from positions alone (a key is
read only if key_pos <= the query's position): positions between the true length and the
bucket's end are masked, whatever they hold. Addresses: tokens and positions are copied into
persistent input buffers before each replay, and the outputs (logits, hidden states) live in
the graph's own buffers, overwritten by the next replay of the same graph. The cache's tensors
are captured by address, so a new cache (a longer request) drops the graphs.

A step may carry work on its outputs into its graph (`post`: greedy or sampled verification,
or a sampled token, whose small kernels would otherwise each be launched from Python between
the step and the one host synchronisation of a speculative step). A post with a `state`
tensor (an RNG state it advances on the device) finds it unchanged by the capture.

Graphs are captured lazily, the first time a (T, kv_len bucket, hidden layers, last_only, post,
token tree) combination is asked for; steps longer than `max_graph_tokens` and every call on a
CPU run eagerly, through exactly the same model code.

Prefill (`prefill`) is a graph too. Launched from Python, a prefill's few hundred kernels cost
five to ten times their GPU time (the 1.5B, 200 tokens on the H200: 12-30 ms of launches,
depending on the host, for ~2.4 ms of work), and that is the request's TTFT. On a GPU a prompt
of t tokens runs padded to `prefill_length(t)` (a power of two up to 256, then a multiple of
256: at most 12 lengths, and no more than a third of the work wasted past 768 tokens, where
prefill starts to be compute-bound), so that a few graphs serve every prompt. Causal attention
keeps the padding out of the real tokens' results, the keys and values it writes past the
prompt sit at positions that every later step overwrites before it reads them (the same
argument as for the kv_len bucket), and the logits are taken at the last real token
(`logits_at`). With graphs off the same padded shape runs eagerly, so both paths compute the
same numbers.

Other fixed-shape steps (a DFlash drafter's block pass) use the same runner through `replay`:
they bring their own persistent inputs and the step as a function of them, and get the same
lazy capture, warm-up, memory pool, cache following and counts.

Optionally the forward is `torch.compile`d first (compile=True) and the compiled step is then
captured like the eager one. It was measured (1.7× on the 1.5B, 131 s of compilation) before
the fused Triton kernels existed, which now do the fusing Inductor did; compiling together
with them has not been measured. Kept off by default.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kv_cache import KVCache


# Prompts up to this many tokens are prefilled padded (`prefill_length`), as CUDA graphs on a
# GPU; longer ones run eagerly at their own length (the launches are small against the work).
PREFILL_GRAPH_MAX = 2048
# Cache positions a graph's attention reads are rounded up to a multiple of this (StepRunner's
# default kv_bucket): one graph serves a stretch of positions.
KV_BUCKET = 256
CATCH_UP_MAX = 64  # the longest catch-up (StepRunner.catch_up) replayed as a graph


def bucketed_kv_len(end: int, bucket: int, max_len: int) -> int:
    """The static kv_len of a step whose keys end at position `end` (exclusive): end rounded up
    to a multiple of `bucket`, at most the cache's max_len."""
    return min(-(-end // bucket) * bucket, max_len)


def eager_step(model, tokens: torch.Tensor, start: int, cache: KVCache,
               hidden_layers: tuple[int, ...] = (), last_only: bool = False, post=None,
               logits_at: torch.Tensor | None = None, tree=None):
    """One forward of tokens [1, T] at positions start … start + T - 1, attending over exactly
    the positions written so far: the path every step takes when it is not a graph replay.
    tree: a token tree's `tree.TreeMask` (its nodes at those cache slots), None: causal.
    Returns what the model returns, and with `post` a third value, post(tokens, logits)."""
    t = tokens.shape[1]
    positions = torch.arange(start, start + t, device=tokens.device).unsqueeze(0)
    logits, hidden = model(tokens, positions, cache, kv_len=start + t,
                           hidden_layers=hidden_layers, last_only=last_only, logits_at=logits_at,
                           tree=tree)
    return (logits, hidden) if post is None else (logits, hidden, post(tokens, logits))


def prefill_length(t: int, cache: KVCache) -> int:
    """The length a prefill of t tokens runs at on a GPU: t rounded up to a power of two (at
    least 16) up to 256, to a multiple of 256 above, at most the cache's length; t itself
    above PREFILL_GRAPH_MAX."""
    if t > PREFILL_GRAPH_MAX:
        return t
    n = max(16, 1 << (t - 1).bit_length()) if t <= 256 else -(-t // 256) * 256
    return max(t, min(n, cache.max_len))


def prefill(model, tokens: list[int], cache: KVCache, hidden_layers: tuple[int, ...] = (),
            runner: "StepRunner | None" = None, device: torch.device | str = "cpu"):
    """The prompt `tokens` at positions 0 … t - 1 into `cache`. Returns the logits of its last
    token [1, 1, vocab] and the requested layers' outputs [1, t, hidden]. On a GPU the prompt
    runs padded to `prefill_length` (the module docstring says why that is exact), replayed as
    a graph by `runner` when it is given and enabled, else eagerly at the same shape."""
    device = torch.device(device)
    t = len(tokens)
    if t == 0:
        raise ValueError("prefill needs at least one token")
    if device.type != "cuda":
        ids = torch.tensor([list(tokens)], device=device)
        return eager_step(model, ids, 0, cache, hidden_layers, last_only=True)
    n = prefill_length(t, cache)
    ids = torch.tensor([list(tokens) + [0] * (n - t)], device=device)
    if runner is not None and runner.enabled and n <= PREFILL_GRAPH_MAX:
        return runner.prefill(ids, t, cache, hidden_layers)
    last = torch.full((1,), t - 1, dtype=torch.long, device=device)
    logits, hidden = eager_step(model, ids, 0, cache, hidden_layers, logits_at=last)
    return logits, [h[:, :t] for h in hidden]


def warm_up(run, keep=(), times: int = 2) -> None:
    """run() `times` times, as before a graph is recorded (compilation, cuBLAS workspaces, the
    allocator), putting the tensors `keep` back as they were after each run: what the step
    advances in place and reads again (an RNG state, the recurrent state slot that a hybrid's
    step reads and overwrites: the cache's `overwritten_inputs`), so that the replay after the
    recording finds its inputs as the eager step would."""
    saved = [x.clone() for x in keep]
    for _ in range(times):
        run()
        for x, before in zip(keep, saved):
            x.copy_(before)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [1, T] int64, the persistent input buffer
    positions: torch.Tensor  # [1, T] int64
    logits: torch.Tensor  # [1, T or 1, vocab] float32, written by each replay
    hidden: list  # of [1, T, hidden], written by each replay
    post: torch.Tensor | None  # post(tokens, logits), written by each replay
    logits_at: torch.Tensor | None = None  # [1] int64: a prefill's last real token, an input


@dataclass
class Recorded:
    """A graph of a step other than the model's own (`StepRunner.replay`)."""
    graph: torch.cuda.CUDAGraph
    inputs: object  # the step's persistent input buffers, filled before each replay
    outputs: object  # what the recorded step returned, rewritten by each replay


@dataclass
class StepRunnerStats:
    captures: int = 0
    capture_s: float = 0.0  # warm-up + capture, compilation included
    replays: int = 0
    eager_calls: int = 0


class StepRunner:
    """Runs model steps of one sequence: replays a CUDA graph where the shape allows, else eager.

    runner = StepRunner(model, device)
    logits, hidden = runner(tokens, start, cache, hidden_layers, last_only)

    tokens: [1, T] int64 on the model's device; they go to positions start … start + T - 1.
    Returns what `Transformer.forward` returns, and with `post` a third value, post(tokens,
    logits) (a function of tensors only, run inside the graph). On the graph path the returned
    tensors are the graph's static outputs: read them (or copy them) before the next call with
    the same shape.
    """

    def __init__(self, model, device: torch.device | str, *, enabled: bool = True,
                 max_graph_tokens: int = 32, kv_bucket: int = KV_BUCKET, compile: bool = False):
        self.model = model
        self.device = torch.device(device)
        self.enabled = bool(enabled) and self.device.type == "cuda"
        if max_graph_tokens < 1 or kv_bucket < 1:
            raise ValueError(f"max_graph_tokens and kv_bucket must be >= 1, got "
                             f"{max_graph_tokens} and {kv_bucket}")
        self.max_graph_tokens = max_graph_tokens
        self.kv_bucket = kv_bucket
        self.compile = bool(compile) and self.enabled
        self._forward = model.forward
        if self.compile:
            # dynamic=True: one compilation serves every T > 1 and every kv_len (sizes of 1 are
            # specialised by the compiler, so decode of one token is a second compilation).
            self._forward = torch.compile(model.forward, dynamic=True, fullgraph=False)
        self._graphs: dict[tuple, _Graph] = {}
        self._cache_id: tuple | None = None
        self._pool = None
        self.stats = StepRunnerStats()

    def reset(self) -> None:
        """Drop every captured graph (and its memory)."""
        self._graphs.clear()
        self._pool = None
        self._cache_id = None

    def kv_len_for(self, end: int, cache: KVCache) -> int:
        """The static kv_len a step ending at position `end` (exclusive) attends over."""
        return bucketed_kv_len(end, self.kv_bucket, cache.max_len)

    def __call__(self, tokens: torch.Tensor, start: int, cache: KVCache,
                 hidden_layers: tuple[int, ...] = (), last_only: bool = False, post=None,
                 tree=None):
        # tokens: [1, T] int64 on self.device; tree: a TreeMask of T nodes, or None (causal)
        t = tokens.shape[1]
        if not self.enabled or t > self.max_graph_tokens or start + t > cache.max_len:
            self.stats.eager_calls += 1
            return eager_step(self.model, tokens, start, cache, hidden_layers, last_only, post,
                              tree=tree)
        self._follow(cache)
        kv_len = self.kv_len_for(start + t, cache)
        key = (t, kv_len, cache.split_len, tuple(hidden_layers), bool(last_only), post, tree)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(tokens, start, cache, kv_len, hidden_layers,
                                                  last_only=last_only, post=post, tree=tree)
        g.tokens.copy_(tokens, non_blocking=True)
        torch.arange(start, start + t, out=g.positions[0])
        g.graph.replay()
        self.stats.replays += 1
        return (g.logits, g.hidden) if post is None else (g.logits, g.hidden, g.post)

    def prefill(self, tokens: torch.Tensor, valid: int, cache: KVCache,
                hidden_layers: tuple[int, ...] = ()):
        """A prefill of tokens [1, n] (padded: the first `valid` are the prompt) at positions
        0 … n - 1, one graph per n: returns the logits of token valid - 1 [1, 1, vocab] and the
        requested layers' outputs for the prompt [1, valid, hidden] (views of the graph's
        buffers, like every replay's outputs)."""
        n = tokens.shape[1]
        if not self.enabled or n > cache.max_len:
            raise ValueError(f"a prefill graph of {n} tokens needs an enabled runner and a cache "
                             f"of >= {n} positions (this one has {cache.max_len})")
        self._follow(cache)
        key = ("prefill", n, cache.split_len, tuple(hidden_layers))
        g = self._graphs.get(key)
        if g is None:
            at = torch.full((1,), valid - 1, dtype=torch.long, device=self.device)
            g = self._graphs[key] = self._capture(tokens, 0, cache, n, hidden_layers,
                                                  logits_at=at)
        g.tokens.copy_(tokens, non_blocking=True)
        g.logits_at.fill_(valid - 1)
        g.graph.replay()
        self.stats.replays += 1
        return g.logits, [h[:, :valid] for h in g.hidden]

    def catch_up(self, tokens: torch.Tensor, start: int, cache: KVCache, post=None):
        """Tokens [1, t] at positions start … start + t - 1 (a drafter feeding what the target
        committed while it was idle), run padded to a power of two up to CATCH_UP_MAX (one
        graph per padded length and kv bucket): returns the logits of the last of them
        [1, 1, vocab] (and post's output, as __call__). The padding's keys and values land in
        the cache positions just past the t, which hold nothing yet (every step writes its
        positions before it reads them), and no real token attends to them (causal). Longer,
        or where the padding would run past the cache, or with graphs off: eager, unpadded."""
        t = tokens.shape[1]
        n = max(4, 1 << (t - 1).bit_length())
        if not self.enabled or n > CATCH_UP_MAX or start + n > cache.max_len:
            self.stats.eager_calls += 1
            return eager_step(self.model, tokens, start, cache, last_only=True, post=post)
        self._follow(cache)
        kv_len = self.kv_len_for(start + n, cache)
        key = ("catch-up", n, kv_len, cache.split_len, post)
        g = self._graphs.get(key)
        if g is None:
            padded = torch.zeros(1, n, dtype=tokens.dtype, device=self.device)
            at = torch.full((1,), t - 1, dtype=torch.long, device=self.device)
            g = self._graphs[key] = self._capture(padded, start, cache, kv_len, post=post,
                                                  logits_at=at)
        g.tokens[:, :t].copy_(tokens, non_blocking=True)  # the padding: whatever was there
        torch.arange(start, start + n, out=g.positions[0])
        g.logits_at.fill_(t - 1)
        g.graph.replay()
        self.stats.replays += 1
        return (g.logits, g.hidden) if post is None else (g.logits, g.hidden, g.post)

    def replay(self, key: tuple, cache: KVCache, build, fill):
        """A fixed-shape step of another kind than the model's (a drafter's pass that writes to
        `cache`) as the graph `key`. The first time `key` is asked for, build() returns (inputs,
        run): the step's persistent input buffers and the step as a function of them (run() ->
        outputs), which is warmed up and recorded. fill(inputs) puts this call's inputs into the
        buffers before every replay, and before the warm-up, which runs the step for real (so
        the step must give the same result run twice on the same inputs). Returns the outputs:
        the graph's buffers, rewritten by the next replay of `key`."""
        if not self.enabled:
            raise ValueError(f"a graph replay needs an enabled runner on a CUDA device, not "
                             f"{self.device}; run the step eagerly instead")
        self._follow(cache)
        g = self._graphs.get(key)
        if g is None:
            inputs, run = build()
            fill(inputs)
            graph, outputs = self._record(run)
            g = self._graphs[key] = Recorded(graph, inputs, outputs)
        else:
            fill(g.inputs)
        g.graph.replay()
        self.stats.replays += 1
        return g.outputs

    def _follow(self, cache: KVCache) -> None:
        # Graphs hold the cache's addresses: they stay valid exactly while those do (every
        # tensor a step reads or writes: a hybrid's rings too, whose slot counts its graphs
        # bake in).
        cache_id = cache.graph_key()
        if self._cache_id != cache_id:
            self.reset()
            self._cache_id = cache_id

    def _capture(self, tokens, start, cache, kv_len, hidden_layers, last_only=False, post=None,
                 logits_at=None, tree=None) -> _Graph:
        t = tokens.shape[1]
        static_tokens = tokens.detach().clone()
        positions = torch.arange(start, start + t, device=self.device).unsqueeze(0)

        def run():
            logits, hidden = self._forward(static_tokens, positions, cache, kv_len=kv_len,
                                           hidden_layers=hidden_layers, last_only=last_only,
                                           logits_at=logits_at, tree=tree)
            return logits, hidden, (post(static_tokens, logits) if post is not None else None)
        # A post's RNG state, which the warm-up advances, is put back (a seed gives the same
        # tokens whether or not a step was captured on the way), and so are the cache slots the
        # step reads and overwrites.
        keep = cache.overwritten_inputs(start, t)
        if getattr(post, "state", None) is not None:
            keep.append(post.state)
        graph, (logits, hidden, post_out) = self._record(run, keep)
        return _Graph(graph, static_tokens, positions, logits, list(hidden), post_out, logits_at)

    def _record(self, run, keep=()):
        """(a CUDA graph of run(), what run() returned in the graph's memory), after two warm-up
        calls on a side stream (`warm_up`). The warm-up writes the same keys and values at the
        same positions as the replay that follows, so it changes nothing the step would not;
        `keep` (tensors the step advances in place: an RNG state, recurrent state slots it
        reads and overwrites) is put back as it was after each call."""
        began = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm_up(run, keep)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = run()
        torch.cuda.synchronize(self.device)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - began
        return graph, outputs
