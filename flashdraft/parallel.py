"""Tensor parallelism of the dense decoder over torch.distributed, Megatron-style.

Every rank holds a slice of each block and runs the same program on the same inputs (SPMD):

- wqkv column-parallel by heads: the fused output is [q heads | k heads | v heads], and each
  rank keeps its q heads, its kv heads and the v heads of those, so its attention runs on its
  own heads and its KV cache holds only its kv heads;
- w_gate_up column-parallel: [gate | up], each half sliced the same way, so SiLU(gate) · up
  stays local;
- wo and w_down row-parallel: each rank's product over its slice of the input is a partial
  sum; `model.Residual` all-reduces it before it joins the residual stream (two all-reduces
  a layer, the only communication);
- the embedding, the norms and the LM head replicated (a vocabulary-parallel head may
  follow), so after the last all-reduce every rank holds the same logits and picks the same
  tokens: the engine needs no broadcast, and rank 0 speaks for all.

torchrun starts the ranks (`torchrun --nproc-per-node N -m flashdraft.cli generate
--tensor-parallel N ...`); NCCL on CUDA, gloo on CPUs (the tests), one code path.

A front end that only rank 0 has (the HTTP server) keeps the ranks in step with `Lockstep`:
rank 0 announces each request and each of its steps, the others run them as they hear them.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shlex
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .config import KernelConfig
from .model import Transformer

log = logging.getLogger("flashdraft.parallel")


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the tensor-parallel group."""
    world_size: int
    rank: int
    local_rank: int = 0  # its GPU on this host: cuda:{local_rank}
    group: object = None  # the torch.distributed process group; None: the default (world) one

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"tensor parallelism needs world_size >= 1, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of 0 .. {self.world_size - 1}")

    @classmethod
    def join(cls, size: int, device: str | None = None) -> "TensorParallel":
        """This process's rank of `size`: torch.distributed as initialised (by the caller, or
        here from the variables torchrun sets: NCCL for CUDA, gloo for CPUs), with `size`
        processes; else a user's error saying how to launch."""
        launch = (f"launch it with `torchrun --nproc-per-node {size} -m flashdraft.cli generate "
                  f"--tensor-parallel {size} ...` (or initialise torch.distributed with {size} "
                  f"processes before LLM(tensor_parallel={size}))")
        if not dist.is_available():
            raise ValueError(f"tensor_parallel={size} needs torch.distributed, which this "
                             f"PyTorch build lacks")
        cuda = _wants_cuda(device)
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ:  # started by torchrun
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if cuda:
                torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl" if cuda else "gloo")
        if not dist.is_initialized():
            raise ValueError(f"tensor_parallel={size} runs one process per GPU, and "
                             f"torch.distributed is not initialised: {launch}")
        world = dist.get_world_size()
        if world != size:
            raise ValueError(f"tensor_parallel={size}, but torch.distributed has {world} "
                             f"processes: {launch}")
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if cuda:
            torch.cuda.set_device(local_rank)
        return cls(world_size=world, rank=rank, local_rank=local_rank)

    def device(self, device: str | None) -> str:
        """The device this rank runs on for the user's `device`: CUDA's cuda:{local_rank}."""
        if not _wants_cuda(device):
            return "cpu"
        if device not in (None, "cuda", f"cuda:{self.local_rank}"):
            raise ValueError(f"device {device!r}: with tensor parallelism rank {self.rank} runs "
                             f"on cuda:{self.local_rank} (its LOCAL_RANK); pass --device cuda "
                             f"or leave it out")
        return f"cuda:{self.local_rank}"

    def agree_on_seed(self, device) -> None:
        """Seed torch's generator alike on every rank (rank 0's draw), so that requests without
        a seed sample the same tokens everywhere."""
        seed = torch.randint(0, 2 ** 62, (1,)).to(device)
        dist.broadcast(seed, src=0, group=self.group)
        torch.manual_seed(int(seed))

    def leave(self) -> None:
        """End this process's part once every rank is done (a rank that exits while another
        still tears down its connections can abort it)."""
        dist.barrier(group=self.group)
        dist.destroy_process_group()

    @property
    def process_group(self):
        return dist.group.WORLD if self.group is None else self.group


def check_launch(size: int, command: list[str]) -> None:
    """A user's error, before anything loads, where this process is not one of `size` ranks
    started by torchrun; command: the flashdraft command line (sys.argv[1:]), so that the fix
    it names is the user's own command."""
    world = os.environ.get("WORLD_SIZE")  # torchrun's
    started = int(world) if world else 1
    if started == size:
        return
    fix = torchrun_command(size, command)
    if size == 1:
        raise ValueError(f"torchrun started {started} processes, but --tensor-parallel is 1: "
                         f"each would run the whole model (a server would bind its port "
                         f"{started} times); pass --tensor-parallel {started}, or run flashdraft "
                         f"without torchrun")
    if world is None:
        raise ValueError(f"--tensor-parallel {size} runs one process per GPU, started by "
                         f"torchrun: {fix}")
    raise ValueError(f"--tensor-parallel {size}, but torchrun started {started} processes: "
                     f"{fix}")


def torchrun_command(size: int, command: list[str]) -> str:
    """The line that starts flashdraft `command` (its arguments) on `size` ranks."""
    return f"torchrun --nproc-per-node {size} -m flashdraft.cli {shlex.join(command)}"


def _wants_cuda(device: str | None) -> bool:
    return torch.device(device).type == "cuda" if device else torch.cuda.is_available()


def check_divisible(cfg, world_size: int) -> None:
    """A user's error for a model whose kv heads (or MLP width) do not split into world_size
    whole parts."""
    if cfg.num_kv_heads % world_size:
        fits = [n for n in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % n == 0]
        raise ValueError(f"tensor_parallel={world_size} does not divide the model's "
                         f"num_kv_heads={cfg.num_kv_heads}: each rank holds whole kv heads (and "
                         f"their {cfg.num_heads // cfg.num_kv_heads} q heads each); use a "
                         f"tensor_parallel of {', '.join(map(str, fits))}")
    if cfg.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel={world_size} does not divide the model's "
                         f"intermediate_size={cfg.intermediate_size}; use a tensor_parallel "
                         f"that does")


def _parts(width: int, *offsets: int, rank: int, world: int) -> torch.Tensor:
    """The indices of rank's share of each part [offset, offset + width) of a fused dimension."""
    share = width // world
    return torch.cat([torch.arange(o + rank * share, o + (rank + 1) * share) for o in offsets])


def _keep(linear: nn.Module, index: torch.Tensor, dim: int) -> None:
    """Keep only `index` along dim of linear's weight (0: output rows, with the bias; 1: input
    columns), as new storage so the whole weight can be freed."""
    w = linear.weight
    linear.weight = nn.Parameter(w.index_select(dim, index.to(w.device)).contiguous(),
                                 requires_grad=False)
    if dim == 0 and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, index.to(w.device)).contiguous(),
                                   requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape


@torch.no_grad()
def shard(model: Transformer, tp: TensorParallel) -> Transformer:
    """Keep rank tp.rank's slice of `model` (a loaded dense decoder), in place; returns it.
    Its cfg becomes this rank's (num_heads, num_kv_heads, intermediate_size divided by the
    world size), from which its KV cache is made."""
    if type(model) is not Transformer:
        raise ValueError(f"tensor parallelism shards the dense decoder (Llama, Qwen2, Qwen3); "
                         f"{type(model).__name__} is not one yet: run it with tensor_parallel=1")
    cfg, world, rank = model.cfg, tp.world_size, tp.rank
    check_divisible(cfg, world)
    linears = [m for block in model.layers for m in (block.attn.wqkv, block.attn.wo,
                                                     block.mlp.w_gate_up, block.mlp.w_down)]
    if any(type(m) is not nn.Linear for m in linears):
        raise ValueError("tensor parallelism slices full-precision weights; a quantized model "
                         "(--quantization) cannot be sharded yet: leave quantization unset")
    if world == 1:
        return model
    d = cfg.head_dim
    q, kv, inner = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    qkv_rows = torch.cat([_parts(q, 0, rank=rank, world=world),
                          _parts(kv, q, q + kv, rank=rank, world=world)])
    q_cols = _parts(q, 0, rank=rank, world=world)
    mlp_rows = _parts(inner, 0, inner, rank=rank, world=world)
    mlp_cols = _parts(inner, 0, rank=rank, world=world)
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        _keep(attn.wqkv, qkv_rows, 0)
        _keep(attn.wo, q_cols, 1)
        attn.n_heads, attn.n_kv = cfg.num_heads // world, cfg.num_kv_heads // world
        _keep(mlp.w_gate_up, mlp_rows, 0)
        _keep(mlp.w_down, mlp_cols, 1)
    model.cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                                    num_kv_heads=cfg.num_kv_heads // world,
                                    intermediate_size=inner // world)
    model.process_group = tp.process_group
    return model


def load_shard(ref: str, dtype: torch.dtype, device, tp: TensorParallel,
               kernel_config: KernelConfig):
    """The model `ref` names (`loading.load_model`), read on the CPU, cut to this rank's slice
    (`shard`) and moved to device: the device holds the slice only. (Each rank still reads
    the whole checkpoint; reading only its slices may follow.)"""
    from .loading import load_model

    loaded = load_model(ref, dtype, torch.device("cpu"), kernel_config=kernel_config)
    loaded.model = shard(loaded.model, tp).to(device)
    return loaded


START, STEP, STOP = 2, 1, 0  # Lockstep's words: a request follows, run its next step, leave
# A follower waits for the next request as long as the server is idle: far beyond the
# process group's default timeout (30 minutes), which would end an idle server's followers.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class Lockstep:
    """Requests of an api.LLM run on every rank at rank 0's word, for a front end that only
    rank 0 has (the HTTP server): rank 0 `lead`s each request, the other ranks `follow`.

    Every collective call must be matched on every rank, so a follower runs exactly the steps
    rank 0 runs: rank 0 says START (then the prompt's ids and its SamplingParams) before a
    request and STEP before each of its stream's deltas. Rank 0 alone decides when a request
    ends early (its client went away): it just says nothing more about it, and a follower
    closes its stream when it hears the next START or STOP, as rank 0 closed its own. What
    rank 0 refuses before a request starts (a bad body, a full queue) is never announced.
    Tokens need no broadcast: every rank computes the same logits (`shard`).

    The words go over a gloo group of their own, on the CPUs: a follower waits on its host
    without holding a GPU stream, and the model's NCCL collectives are left alone.
    """

    def __init__(self, llm):
        if llm.parallel is None:
            raise ValueError("Lockstep keeps the ranks of a tensor-parallel LLM together; this "
                             "LLM has tensor_parallel=1")
        self.llm, self.rank = llm, llm.parallel.rank
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # every rank calls it
        self._word = torch.zeros(1, dtype=torch.int64)

    def _say(self, word: int) -> None:
        self._word.fill_(word)
        dist.broadcast(self._word, src=0, group=self.group)

    def _hear(self) -> int:
        dist.broadcast(self._word, src=0, group=self.group)
        return int(self._word)

    def lead(self, prompt_ids: list[int], params) -> Iterator:
        """Rank 0: `llm.stream` of one request (its StreamDeltas), each step run on every rank.
        Closing it early ends the request on every rank."""
        self._say(START)
        dist.broadcast_object_list([prompt_ids, params], src=0, group=self.group)
        stream = self.llm.stream({"prompt_token_ids": prompt_ids}, params)
        try:
            while True:
                self._say(STEP)
                delta = next(stream, None)
                if delta is None:
                    return
                yield delta
                if delta.output is not None:
                    return
        finally:
            stream.close()

    def stop(self) -> None:
        """Rank 0: the followers leave `follow`."""
        self._say(STOP)

    def follow(self) -> None:
        """Every rank but 0: run the requests and steps rank 0 announces, until it says STOP.
        A request that fails here fails alike on rank 0, which starts no more of its steps."""
        stream = None
        try:
            while (word := self._hear()) != STOP:
                if word == START:
                    if stream is not None:
                        stream.close()
                    request = [None, None]
                    dist.broadcast_object_list(request, src=0, group=self.group)
                    prompt_ids, params = request
                    stream = self.llm.stream({"prompt_token_ids": prompt_ids}, params)
                elif stream is None:
                    raise RuntimeError(f"rank {self.rank}: rank 0 ran a step of a request that "
                                       f"ended here; the ranks no longer run the same steps")
                else:
                    try:
                        if next(stream, None) is None:
                            stream = None
                    except Exception as e:  # rank 0's request fails alike
                        log.debug("rank %d: the request failed: %s", self.rank, e)
                        stream = None
        finally:
            if stream is not None:
                stream.close()
