"""benchmarks/simulate_ngram.py replays what the engine did: a bench run's n-gram requests,
drafting at every step and under AdaptiveSpeculation, step for step (so the model built on
the replay describes the engine as it is, and a change to the loop shows here)."""
import contextlib
import io
import json
import sys
from pathlib import Path

from flashdraft import LLM, cli
from flashdraft.tools.bench import load_prompts, prompt_ids
from tests.test_bench import PROMPTS, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import simulate_ngram as sim  # noqa: E402


def test_the_replay_matches_a_bench_run_step_for_step(tiny_models, tmp_path):
    target = tiny_models["qwen2"]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    argv = ["bench", "--model", target, "--draft", "ngram", "--num-speculative-tokens", "2,4",
            "--adaptive-speculation", "both", "--prompts", str(prompts), "--max-tokens", "40",
            "--output", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32",
            "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(argv)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    llm = LLM(target, device="cpu", dtype="float32")
    ids = [prompt_ids(llm, p) for p in load_prompts(str(prompts))]
    stop = set(llm.engine.eos_token_ids)
    sizes = tuple(sorted(results["settings"]["ngram_sizes"], reverse=True))
    for adaptive in (False, True):
        runs = sim.requests_of(results, ids, llm.max_model_len, stop, adaptive)
        assert sorted(runs) == [2, 4] and all(len(r) == len(PROMPTS) for r in runs.values())
        bad, checked, _ = sim.validate("tiny", runs, sizes, adaptive)
        assert bad == [] and checked == 2 * len(PROMPTS)
        drafted = sum(len(r.metrics["drafted_per_step"]) for rs in runs.values() for r in rs)
        plain = sum(r.metrics["plain_tokens"] for rs in runs.values() for r in rs)
        assert drafted > 0 and (plain > 0 if adaptive else plain == 0)
