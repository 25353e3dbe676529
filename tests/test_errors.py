"""Errors a user can act on: a draft of another tokenizer, a prompt longer than the context."""
import pytest

from flashdraft import LLM, SamplingParams
from flashdraft.config import AUTO_SPECULATIVE_TOKENS, EngineConfig
from tests.tiny import build_model, build_tokenizer


def test_draft_with_another_tokenizer_is_refused(tiny_models, tmp_path):
    other = build_model(tmp_path / "other", "qwen2", seed=2)
    build_tokenizer(other, vocab_size=300)  # a different vocabulary, same architecture
    with pytest.raises(ValueError) as e:
        LLM(tiny_models["qwen2"], draft=str(other), device="cpu")
    msg = str(e.value)
    assert "does not share the target's tokenizer" in msg
    assert str(other) in msg and tiny_models["qwen2"] in msg
    assert "384 tokens" in msg and "300" in msg


def test_over_long_prompt_is_refused_with_the_numbers(tiny_models):
    llm = LLM(tiny_models["qwen2"], device="cpu", max_model_len=16)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    n = len(llm.tokenizer.encode(prompt))
    with pytest.raises(ValueError, match=f"the prompt has {n} tokens but max_model_len is 16"):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    # A prompt that fits generates up to the end of the context, then stops with "length".
    out = llm.generate("def add", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 16
    assert out.finish_reason == "length"


def test_missing_model_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="Looked in"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(FileNotFoundError, match="Hugging Face cache"):
        LLM("some-org/some-model-that-is-not-here", device="cpu")


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"), (dict(stop=[""]), "stop")])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_settings(tiny_models):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_models["qwen2"], device="cpu", draft="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="or auto"):
        EngineConfig(model="m", num_speculative_tokens="many")
    assert EngineConfig(model="m").num_speculative_tokens == AUTO_SPECULATIVE_TOKENS
    assert EngineConfig(model="m", num_speculative_tokens="3").num_speculative_tokens == 3
    with pytest.raises(ValueError, match="max_model_len=100000 is beyond"):
        LLM(tiny_models["qwen2"], device="cpu", max_model_len=100000)
