"""The hybrid's steps as CUDA graphs record them: one fixed-shape call per (T, kv_len bucket),
its tokens and positions persistent tensors refilled before each replay, the ring slots derived
from the positions on the device. On a CPU the recorded call is replayed as a plain call and
compared with the eager path (fp32, tiny models); on a GPU the engine with StepRunner's graphs
gives the tokens of the engine without them."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft import LLM, SamplingParams
from flashdraft.backends.cuda_graphs import bucketed_kv_len, eager_step, warm_up
from flashdraft.loading import load_model
from tests.tiny import build_qwen35

pytestmark = pytest.mark.usefixtures("one_thread")

LIN, FULL = "linear_attention", "full_attention"
K = 4  # drafts a verification checks
BUCKET = 16  # kv_len bucket of the recorded steps: most steps read masked positions past the end


class Recorded:
    """A step as StepRunner records it: the same call on the same tensors, warmed up (run twice,
    the slots it reads and overwrites put back) at its first position, then replayed."""

    def __init__(self, model, cache, t: int, kv_len: int, logits_at: torch.Tensor | None = None):
        self.tokens = torch.zeros(1, t, dtype=torch.long)  # [1, T], persistent
        self.positions = torch.zeros(1, t, dtype=torch.long)  # [1, T], persistent
        self.logits_at = logits_at  # [1] int64, persistent (a padded prefill's last real row)
        self.cache, self.warmed = cache, False
        self.run = lambda: model(self.tokens, self.positions, cache, kv_len=kv_len,
                                 logits_at=self.logits_at)

    def replay(self, tokens: torch.Tensor, start: int, last: int | None = None):
        self.tokens.copy_(tokens)
        torch.arange(start, start + tokens.shape[1], out=self.positions[0])
        if last is not None:
            self.logits_at.fill_(last)
        if not self.warmed:
            warm_up(self.run, self.cache.overwritten_inputs(start, tokens.shape[1]))
            self.warmed = True
        return self.run()[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_qwen35(tmp_path_factory.mktemp("hybrid_graphs") / "m", seed=1)
    return load_model(str(path), torch.float32, "cpu").model


def assert_rings_equal(a, b, end: int):
    """The states and conv inputs of the positions before `end` that the rings hold (a padded
    step also writes slots past its real positions, which no step reads)."""
    for ring, slots in ((lambda c: c.state, a.steps), (lambda c: c.conv, a.conv_slots)):
        held = [p % slots for p in range(max(0, end - slots), end)]
        torch.testing.assert_close(ring(a)[:, :, held], ring(b)[:, :, held], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("steps", [1, K + 1, 17])
@torch.no_grad()
def test_recorded_steps_replay_the_eager_path(model, steps):
    """A padded prefill (longer than the ring: the chunked rule; or not: every state kept),
    decode steps, verifications of K + 1 tokens committed to fewer (none, some, all) and the
    steps after them (plain decoding's ring of one slot: decode steps and a longer one): the
    replayed calls' logits and ring states are the eager path's, step for step, though each
    recording's warm-up ran its step twice over slots it reads and overwrites."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 64))
    eager = model.new_cache(1, 64, torch.float32, "cpu", steps=steps)
    graphed = model.new_cache(1, 64, torch.float32, "cpu", steps=steps)
    graphed.checked = False  # as on a GPU: nothing read on the host
    recorded = {}

    def step(start: int, t: int):
        want, _ = eager_step(model, ids[:, start:start + t], start, eager)
        kv_len = bucketed_kv_len(start + t, BUCKET, graphed.max_len)
        key = (t, kv_len)
        if key not in recorded:
            recorded[key] = Recorded(model, graphed, t, kv_len)
        got = recorded[key].replay(ids[:, start:start + t], start)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert_rings_equal(graphed, eager, start + t)

    prompt, padded = 11, 16  # the prompt runs padded, its logits taken at its last token
    want, _ = eager_step(model, ids[:, :prompt], 0, eager, last_only=True)
    prefill = Recorded(model, graphed, padded, padded, torch.zeros(1, dtype=torch.long))
    got = prefill.replay(torch.cat([ids[:, :prompt], torch.zeros(1, padded - prompt,
                                                                  dtype=torch.long)], 1),
                         0, last=prompt - 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_rings_equal(graphed, eager, prompt)

    pos = prompt
    for _ in range(3 if steps > 1 else 8):
        step(pos, 1)
        pos += 1
    if steps == 1:  # and a step longer than the ring (a drafter catching up: chunked)
        step(pos, 3)
        step(pos + 3, 1)
        assert {t for t, _ in recorded} == {1, 3}
        return
    for accepted in (0, 2, K, 1):
        step(pos, K + 1)  # [last, d_1 … d_K] from pos
        pos += accepted + 1
        for cache in (eager, graphed):
            cache.commit(pos)
        step(pos, 1)  # the next step reads the state after the last accepted token
        pos += 1
    assert {t for t, _ in recorded} == {1, K + 1} and len(recorded) < 12  # replays, mostly


@torch.no_grad()
def test_slots_follow_the_positions_alone(model):
    """The slots of a step are the positions' residues: the same for a step at position p as
    for one at p + steps · conv_slots (one ring turn of each), at any p."""
    cache = model.new_cache(1, 64, torch.float32, "cpu", steps=K + 1)
    turn = cache.steps * cache.conv_slots
    for start in (0, 1, 3, 7, 20):
        for t in (1, K + 1):
            a = cache.slots(torch.arange(start, start + t)[None])
            if start:
                b = cache.slots(torch.arange(start + turn, start + turn + t)[None])
                for name in ("read", "write", "window", "conv_write", "conv_rows"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert a.read.item() == (-1 if start == 0 else (start - 1) % cache.steps)
            assert a.write.tolist() == [p % cache.steps for p in range(start, start + t)]


# -- GPU: the engine with graphs gives the engine's tokens without them --------------------------

PROMPTS = ["def add(a, b):", "The quick brown fox jumps"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_engine")
    target = build_qwen35(root / "target", seed=4, layer_std=0.04)
    draft = build_qwen35(root / "draft", seed=5, layer_std=0.03, layer_types=(LIN, FULL),
                         tokenizer_from=target)
    # the draft shares the target's embeddings: often right, not always
    shared, weights = load_file(target / "model.safetensors"), load_file(
        draft / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        weights[name] = shared[name]
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    return str(target), str(draft)


def generate(path, graphs: bool, draft, k: int, widths=()):
    """Greedy tokens of PROMPTS on an engine of its own (its graphs recorded against one cache),
    and how many graph replays its steps took."""
    llm = LLM(path, device="cuda", dtype="float32", cuda_graphs=graphs,
              adaptive_speculation=False, tree_widths=widths)
    outs = llm.generate(PROMPTS, GREEDY, draft=draft, num_speculative_tokens=k or None)
    runner = llm.engine.runner
    return [o.token_ids for o in outs], (runner.stats.replays if runner is not None else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("drafter,k,widths", [(None, 0, ()), ("ngram", 3, ()), ("model", 2, ()),
                                              ("model", 5, ()), ("model", 4, (3, 2, 2))])
def test_graphs_give_the_eager_engines_tokens(engine_models, drafter, k, widths):
    target, draft = engine_models
    draft = draft if drafter == "model" else drafter
    eager, replays = generate(target, False, draft, k, widths)
    assert replays == 0
    graphed, replays = generate(target, True, draft, k, widths)
    assert replays > 0
    assert graphed == eager
