"""`flashdraft demo` on tiny models in place of the example pair: plain, the draft model, n-gram
and a DFlash drafter in one table, and a --dflash that is no drafter refused before any model
loads."""
import contextlib
import io
import json

import pytest

from flashdraft import cli
from flashdraft.tools import demo
from flashdraft.tools.demo import DemoSettings, run_demo
from tests.tiny import build_dflash_drafter, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    target = build_model(root / "target", "qwen3", seed=1, layers=4)
    draft = build_model(root / "draft", "qwen3", seed=2, layers=1, tokenizer_from=target)
    dflash = build_dflash_drafter(root / "dflash", target, seed=3, block_size=4,
                                  target_layer_ids=(1,))
    return {"target": str(target), "draft": str(draft), "dflash": str(dflash)}


@pytest.fixture
def tiny_pair(models, monkeypatch):
    monkeypatch.setattr(demo, "TARGET", models["target"])
    monkeypatch.setattr(demo, "DRAFT", models["draft"])
    return models


def test_the_demo_runs_a_dflash_drafter_next_to_the_draft_model(tiny_pair, tmp_path):
    argv = ["demo", "--dflash", tiny_pair["dflash"], "--device", "cpu", "--dtype", "float32",
            "--num-humaneval", "0", "--max-tokens", "12", "--num-speculative-tokens", "2",
            "--output", str(tmp_path)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        cli.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    entries = {e["name"]: e for e in results["configurations"]}
    # DFlash drafts its whole block (3 masks), not the draft model's k.
    assert list(entries) == ["plain", "draft 0.5B k=2", "ngram k=2", "dflash k=3"]
    dflash = entries["dflash k=3"]
    assert dflash["drafter"] == "dflash:" + tiny_pair["dflash"]
    s = dflash["summary"]
    assert s["identical_to_plain"] == s["compared_with_plain"] == len(results["prompts"])
    assert all(max(r["metrics"]["drafted_per_step"]) == 3 for r in dflash["requests"])
    table = stdout.getvalue()
    assert "dflash k=3 tok/s" in table and "draft 0.5B k=2 tok/s" in table


def test_a_dflash_that_is_no_drafter_is_refused_before_the_models_load(tiny_pair, tmp_path):
    def refusal(ref):
        with pytest.raises(ValueError) as err:
            run_demo(DemoSettings(dflash=ref, device="cpu", num_humaneval=0))
        return str(err.value)

    missing = str(tmp_path / "nowhere")
    msg = refusal(missing)
    assert f"--dflash {missing!r}" in msg and "train-drafter" in msg
    msg = refusal("dflash:" + tiny_pair["target"])  # a plain model: no dflash_config
    assert f"--dflash {tiny_pair['target']!r}" in msg and "no dflash_config" in msg
    with pytest.raises(ValueError, match="--dflash 'dflash:' names no drafter.*train-drafter"):
        DemoSettings(dflash="dflash:")
