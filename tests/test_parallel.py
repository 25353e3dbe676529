"""Tensor parallelism (flashdraft.parallel) at TP = 2 against TP = 1: two CPU processes, gloo.

NCCL on GPUs takes the same code path; only the backend differs."""
import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft import LLM, SamplingParams
from flashdraft.config import EngineConfig
from flashdraft.loading import load_model
from flashdraft.parallel import TensorParallel, shard

WORLD = 2
PROMPT = "def add(a, b):\n    return a + b\n" * 3  # > SMALL_T tokens: the SDPA prefill too


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_logits(path: str, tp: TensorParallel) -> None:
    """Prefill and a 5-token step of the sharded model give the whole model's logits; the
    rank's cache holds its kv heads only."""
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    full = loaded.model
    part = shard(load_model(path, torch.float32, torch.device("cpu")).model, tp)
    assert part.cfg.num_kv_heads == full.cfg.num_kv_heads // WORLD
    caches = [m.new_cache(1, 128, torch.float32, "cpu") for m in (full, part)]
    assert caches[1].kv.shape[3] == full.cfg.num_kv_heads // WORLD
    ids = loaded.tokenizer.encode(PROMPT)
    x = torch.tensor([ids])
    n = len(ids) - 5
    with torch.inference_mode():
        for start, stop in ((0, n), (n, len(ids))):
            positions = torch.arange(start, stop)[None]
            want, got = (m(x[:, start:stop], positions, c)[0]
                         for m, c in zip((full, part), caches))
            assert rel_err(got, want) <= 1e-5, (path, start, rel_err(got, want))


def _check_generation(path: str, rank: int) -> None:
    """Greedy output at TP = 2, plain and speculative, equals one process's plain output, on
    every rank; unseeded sampling agrees across ranks."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    single = LLM(path, device="cpu", dtype="float32").generate(PROMPT, greedy)[0].token_ids
    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel=WORLD, draft="ngram",
              num_speculative_tokens=4, adaptive_speculation=False)
    assert llm.target.model.process_group is not None and llm.rank == rank
    plain = llm.generate(PROMPT, greedy, draft=None)[0].token_ids
    spec = llm.generate(PROMPT, greedy)[0]
    assert plain == single, (rank, plain, single)
    assert spec.token_ids == single, (rank, spec.token_ids, single)
    assert spec.metrics.drafted_tokens > 0
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12), draft=None)
    seen = [None] * WORLD
    dist.all_gather_object(seen, (sampled[0].token_ids, spec.token_ids))
    assert seen[0] == seen[1]


def _rank(rank: int, port: int, paths: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        tp = TensorParallel.join(WORLD, "cpu")
        assert (tp.rank, tp.world_size) == (rank, WORLD)
        for path in paths:
            _check_logits(path, tp)
        _check_generation(paths[0], rank)
        dist.barrier()  # both ranks done before either tears its group down
    finally:
        dist.destroy_process_group()
    # Out without the interpreter's teardown, where gloo's threads can abort a finished rank
    # ("terminate called without an active exception"): the checks above have all passed.
    sys.stdout.flush()
    os._exit(0)


def test_tensor_parallel_matches_one_process(tiny_models):
    """qwen2 (q/k/v biases sliced with their rows) and qwen3 (per-head q/k norms)."""
    mp.spawn(_rank, args=(_free_port(), [tiny_models["qwen2"], tiny_models["qwen3"]]),
             nprocs=WORLD, join=True)


def test_kv_heads_that_do_not_divide_are_refused(tiny_models):
    model = load_model(tiny_models["qwen2"], torch.float32, torch.device("cpu")).model
    with pytest.raises(ValueError, match=r"tensor_parallel=4 .* num_kv_heads=2.* 1, 2"):
        shard(model, TensorParallel(world_size=4, rank=0))
    assert model.process_group is None and model.cfg.num_kv_heads == 2  # left whole


def test_tensor_parallel_needs_torch_distributed(tiny_models, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        LLM(tiny_models["qwen2"], device="cpu", dtype="float32", tensor_parallel=2)


def test_tensor_parallel_settings_are_checked():
    with pytest.raises(ValueError, match="no-adaptive-speculation"):
        EngineConfig(model="m", draft="ngram", tensor_parallel=2)
    with pytest.raises(ValueError, match="megakernel"):
        EngineConfig(model="m", tensor_parallel=2, decode_kernel="megakernel")
    with pytest.raises(ValueError, match="whole number"):
        EngineConfig(model="m", tensor_parallel=0)
