"""Tensor parallelism (flashdraft.parallel) at TP = 2 against TP = 1: two CPU processes, gloo.
The engine, `flashdraft bench` (rank 0 reports) and `flashdraft serve` (rank 0 serves, rank 1
follows its steps); torchrun's launch checked before anything loads.

NCCL on GPUs takes the same code path; only the backend differs."""
import contextlib
import datetime
import io
import json
import os
import re
import signal
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft import LLM, SamplingParams, cli
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


def _check_engine(rank: int, paths: list[str]) -> None:
    tp = TensorParallel.join(WORLD, "cpu")
    assert (tp.rank, tp.world_size) == (rank, WORLD)
    for path in paths:
        _check_logits(path, tp)
    _check_generation(paths[0], rank)


def _rank(rank: int, port: int, check, args: tuple) -> None:
    """One rank of WORLD: check(rank, *args) in the process group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        check(rank, *args)
        dist.barrier()  # both ranks done before either tears its group down
    finally:
        dist.destroy_process_group()
    # Out without the interpreter's teardown, where gloo's threads can abort a finished rank
    # ("terminate called without an active exception"): the checks above have all passed.
    sys.stdout.flush()
    os._exit(0)


def test_tensor_parallel_matches_one_process(tiny_models):
    """qwen2 (q/k/v biases sliced with their rows) and qwen3 (per-head q/k norms)."""
    mp.spawn(_rank, args=(_free_port(), _check_engine,
                          ([tiny_models["qwen2"], tiny_models["qwen3"]],)),
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


# -- bench -------------------------------------------------------------------------------------

def _bench_settings(path: str, root, ranks: int):
    from flashdraft.tools.bench import BenchSettings

    return BenchSettings(model=path, drafts=("ngram",), num_speculative_tokens=(3,),
                         prompts=str(root / "prompts.jsonl"), max_tokens=12, warmup=0, device="cpu",
                         dtype="float32", adaptive_speculation=(False,), progress=False,
                         output=str(root / f"out-{ranks}"), tensor_parallel=ranks)


def _tokens(results: dict) -> dict:
    return {c["name"]: [r["token_ids"] for r in c["requests"]] for c in results["configurations"]}


def _check_bench(rank: int, path: str, root, want: dict) -> None:
    from flashdraft.tools.bench import run_bench

    printed = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):
        results = run_bench(_bench_settings(path, root, WORLD), out=printed)
    assert _tokens(results) == want, rank  # every rank ran every configuration alike
    if rank == 0:
        written = json.loads((root / f"out-{WORLD}" / "results.json").read_text())
        assert _tokens(written) == want
        assert written["environment"]["tensor_parallel"] == {"ranks": WORLD, "backend": "gloo"}
        assert "× 2 (tensor parallel)" in printed.getvalue()
    else:
        assert results["environment"] is None and printed.getvalue() == ""


def test_bench_at_two_ranks_reports_one_process_tokens(tiny_models, tmp_path):
    """Rank 0 prints and writes the results, with the same tokens as one process's run."""
    from flashdraft.tools.bench import run_bench

    path = tiny_models["qwen2"]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n"
                                            + json.dumps({"prompt": "The quick brown fox"}) + "\n")
    with contextlib.redirect_stderr(io.StringIO()):
        single = run_bench(_bench_settings(path, tmp_path, 1), out=io.StringIO())
    assert single["environment"]["tensor_parallel"] == {"ranks": 1, "backend": None}
    want = _tokens(single)
    assert set(want) == {"plain", "ngram k=3 every step"}
    mp.spawn(_rank, args=(_free_port(), _check_bench, (path, tmp_path, want)), nprocs=WORLD,
             join=True)


# -- serve -------------------------------------------------------------------------------------

MAX_LEN = 256
FAILS = 13  # a request of this max_tokens fails in the engine, on every rank alike


def _serve(rank: int, path: str, port: int) -> None:
    from flashdraft.serving.server import ServerSettings, serve

    llm = LLM(path, device="cpu", dtype="float32", tensor_parallel=WORLD, max_model_len=MAX_LEN)
    stream = llm.stream

    def failing(prompt, params, **kwargs):  # the second step of a FAILS request raises
        for i, delta in enumerate(stream(prompt, params, **kwargs)):
            if params.max_tokens == FAILS and i == 1:
                raise RuntimeError("the engine failed")
            yield delta

    llm.stream = failing
    serve(llm, ServerSettings(served_model_name="tiny"), port=port, log_level="critical")


def _post(client, body: dict) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    return r.status_code, r.json()


def test_serve_at_two_ranks(tiny_models):
    """Rank 0 serves and rank 1 follows: greedy answers equal one process's server, before and
    after a request refused before it starts, one that fails in the engine and a stream its
    client left; Ctrl-C (which a terminal sends to both) shuts both down cleanly."""
    httpx = pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from flashdraft.serving.server import ServerSettings, create_app

    path, port = tiny_models["qwen2"], _free_port()
    procs = mp.start_processes(_rank, args=(_free_port(), _serve, (path, port)), nprocs=WORLD,
                               join=False, start_method="spawn")
    bodies = [{"prompt": PROMPT, "max_tokens": 16}, {"prompt": "The quick", "max_tokens": 9}]
    single = LLM(path, device="cpu", dtype="float32", max_model_len=MAX_LEN)
    with TestClient(create_app(single, ServerSettings(served_model_name="tiny"))) as local:
        want = [_post(local, b) for b in bodies]
    assert all(code == 200 and answer["choices"][0]["text"] for code, answer in want)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert procs.processes[0].is_alive() and time.monotonic() < deadline
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=30) as client:
            texts = lambda answers: [(c, a["choices"][0]["text"]) for c, a in answers]
            assert texts([_post(client, bodies[0])]) == texts(want[:1])
            code, answer = _post(client, {"prompt": "x", "max_tokens": MAX_LEN})  # refused
            assert code == 400 and answer["error"]["param"] == "max_tokens"
            code, answer = _post(client, {"prompt": PROMPT, "max_tokens": FAILS})
            assert code == 500 and "the engine failed" in answer["error"]["message"]
            with client.stream("POST", "/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": MAX_LEN - 64, "stream": True,
                                     "ignore_eos": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # its client leaves after the first chunk
            assert texts([_post(client, b) for b in bodies]) == texts(want)
            # the stream ended a few steps in, of 192 (rank 0's metrics), and rank 1 with it,
            # or the answers after it would not have come
            assert 'finished_total{finish_reason="cancelled"} 1.0' in client.get("/metrics").text
        for p in reversed(procs.processes):  # rank 1 waits for rank 0's word to leave
            os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while not procs.join(1):  # True once every rank is gone, False after each exit or 1 s
            assert time.monotonic() < deadline, "the ranks did not shut down"
        assert [p.exitcode for p in procs.processes] == [0, 0]
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()


# -- the launch --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, world, message", [
    (["bench", "--model", "M", "--tensor-parallel", "2"], None,
     r"torchrun --nproc-per-node 2 -m flashdraft.cli bench --model M --tensor-parallel 2"),
    (["serve", "--model", "M", "--tensor-parallel", "2"], "4",
     r"torchrun started 4 processes: torchrun --nproc-per-node 2 -m flashdraft.cli serve"),
    (["serve", "--model", "M"], "2", r"--tensor-parallel is 1.* pass --tensor-parallel 2"),
    (["serve", "--model", "M", "--draft", "ngram", "--tensor-parallel", "2"], "2",
     "pass --no-adaptive-speculation"),
    (["bench", "--model", "M", "--draft", "ngram", "--tensor-parallel", "2"], "2",
     "pass --adaptive-speculation off"),
    (["bench", "--model", "M", "--peer", "transformers", "--tensor-parallel", "2"], "2",
     "leave --peer out"),
    (["bench", "--random-weights", "--shape", "qwen3-8b", "--tensor-parallel", "2"], "2",
     "leave --tensor-parallel out"),
])
def test_launch_errors_name_the_fix(argv, world, message, monkeypatch, capsys):
    """Refused before any model loads (M is no model), with what to run instead."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert re.search(message, str(e.value)), str(e.value)
    assert not dist.is_initialized()
