"""Token trees on the dense model: a node's logits are those of its root-to-node path decoded
causally, and compacting an accepted path leaves the cache as if only that path had been
decoded (fp32, CPU)."""
import random

import pytest
import torch

from flashdraft import model as model_module
from flashdraft.backends import kernels
from flashdraft.config import KernelConfig
from flashdraft.kv_cache import KVCache
from flashdraft.loading import load_model
from flashdraft.tree import TreeMask

PREFIX = 9  # committed tokens before the tree
TOL = dict(rtol=1e-5, atol=1e-5)


def random_parents(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


SHAPES = {
    "one node": [-1],
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [-1] + [0] * 7,
    "forest": [-1, -1, 0, 1, -1, 2, 2, 4],
    "random 12": random_parents(12, 1),
    "random 15": random_parents(15, 2),
}


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def model(request, tiny_models):
    return load_model(tiny_models[request.param], torch.float32, torch.device("cpu")).model


def path_to(parents, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def prefilled(model, prefix: torch.Tensor, max_len: int = 96) -> KVCache:
    cache = model.new_cache(1, max_len, torch.float32, "cpu")
    model(prefix, torch.arange(prefix.shape[1])[None], cache)
    return cache


def decode(model, cache: KVCache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Causal logits [1, seq, vocab] of tokens [1, seq] at start .. start + seq - 1."""
    logits, _ = model(tokens, torch.arange(start, start + tokens.shape[1])[None], cache)
    return logits


def tree_pass(model, parents, seed: int):
    """The prefix, the tree's tokens [1, T], the tree, its logits and its cache."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    prefix = torch.randint(vocab, (1, PREFIX), generator=gen)
    tokens = torch.randint(vocab, (1, len(parents)), generator=gen)
    tree = TreeMask.from_parents(parents)
    cache = prefilled(model, prefix)
    logits, _ = model(tokens, torch.arange(PREFIX, PREFIX + tree.size)[None], cache, tree=tree)
    return prefix, tokens, tree, logits, cache


def test_depth_and_ancestors():
    tree = TreeMask.from_parents([-1, 0, 0, 1, -1, 4])
    assert tree.depth.tolist() == [0, 1, 1, 2, 0, 1]
    assert tree.ancestors[3].tolist() == [True, True, False, True, False, False]
    assert tree.ancestors[5].tolist() == [False, False, False, False, True, True]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_node_equals_its_path_decoded_causally(model, shape):
    parents = SHAPES[shape]
    prefix, tokens, tree, logits, _ = tree_pass(model, parents, seed=len(parents))
    for node in range(tree.size):
        path = path_to(parents, node)
        want = decode(model, prefilled(model, prefix), tokens[:, path], PREFIX)[:, -1]
        torch.testing.assert_close(logits[:, node], want, **TOL)


def test_a_chain_is_the_causal_pass_exactly(model):
    prefix, tokens, _, logits, _ = tree_pass(model, SHAPES["chain"], seed=3)
    assert torch.equal(logits, decode(model, prefilled(model, prefix), tokens, PREFIX))


def test_slots_past_the_tree_are_never_read(model):
    """A static kv_len (CUDA graphs read a fixed bucket) over stale entries past the tree."""
    parents = SHAPES["random 12"]
    prefix, tokens, tree, logits, _ = tree_pass(model, parents, seed=6)
    cache = prefilled(model, prefix)
    cache.kv[..., PREFIX:, :] = 1e3 * torch.randn_like(cache.kv[..., PREFIX:, :])
    again, _ = model(tokens, torch.arange(PREFIX, PREFIX + tree.size)[None], cache,
                     kv_len=cache.max_len, tree=tree)
    torch.testing.assert_close(again, logits, **TOL)


def test_a_tree_longer_than_small_t_goes_through_sdpa(model):
    parents = random_parents(model_module.SMALL_T + 8, 4)
    prefix, tokens, tree, logits, _ = tree_pass(model, parents, seed=4)
    for node in (tree.size - 1, tree.size - 2, max(range(tree.size), key=tree.depth.__getitem__)):
        want = decode(model, prefilled(model, prefix), tokens[:, path_to(parents, node)], PREFIX)
        torch.testing.assert_close(logits[:, node], want[:, -1], **TOL)


@pytest.mark.parametrize("shape", ["chain", "star", "forest", "random 12", "random 15"])
def test_compaction_leaves_the_cache_of_the_accepted_path(model, shape):
    parents = SHAPES[shape]
    rng = random.Random(shape)
    for trial in range(3):
        prefix, tokens, tree, _, cache = tree_pass(model, parents, seed=10 + trial)
        path = tree.check_path(path_to(parents, rng.randrange(tree.size)))
        cache.compact(PREFIX, path)
        n = PREFIX + len(path)
        ref = prefilled(model, prefix)
        decode(model, ref, tokens[:, path], PREFIX)
        torch.testing.assert_close(cache.kv[..., :n, :], ref.kv[..., :n, :], **TOL)
        nxt = torch.tensor([[rng.randrange(model.cfg.vocab_size)]])
        torch.testing.assert_close(decode(model, cache, nxt, n), decode(model, ref, nxt, n),
                                   **TOL)


def test_compacting_an_empty_path_changes_nothing(model):
    _, _, _, _, cache = tree_pass(model, SHAPES["star"], seed=5)
    before = cache.kv.clone()
    cache.compact(PREFIX, [])
    assert torch.equal(cache.kv, before)


@pytest.mark.parametrize("parents, message", [
    ([-1, 1], r"parents\[1\] = 1"),
    ([-1, 0, 3, 1], r"parents\[2\] = 3"),
    ([-2], r"parents\[0\] = -2"),
    ([0], r"parents\[0\] = 0"),
    ([], "parents is empty"),
])
def test_bad_parents_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        TreeMask.from_parents(parents)


def test_one_token_per_node(model):
    tree = TreeMask.from_parents([-1, 0, 0])
    cache = model.new_cache(1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="3 nodes .* but 4 tokens"):
        model(torch.zeros(1, 4, dtype=torch.int64), torch.arange(4)[None], cache, tree=tree)


@pytest.mark.parametrize("path, message", [
    ([1], "node 1 at step 0"),
    ([0, 3], "node 3 at step 1"),
    ([0, 7], "node 7 at step 1"),
])
def test_bad_paths_are_refused(path, message):
    tree = TreeMask.from_parents([-1, 0, 0, 1])
    with pytest.raises(ValueError, match=message):
        tree.check_path(path)


def test_compaction_outside_the_cache_is_refused():
    cache = KVCache(1, 1, 1, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"path \[0, 5\] from slot 4"):
        cache.compact(4, [0, 5])


@pytest.mark.skipif(not kernels.available(), reason="needs Triton")
def test_the_fused_kernels_run_a_tree_as_the_mask_path_does(tiny_models):
    """On a GPU a tree's step takes the fused attention kernel with its ancestors' bits (every
    other kernel as a chain's); here through Triton's interpreter, against the mask path."""
    path = tiny_models["qwen3"]
    plain = load_model(path, torch.float32, torch.device("cpu")).model
    fused = load_model(path, torch.float32, torch.device("cpu"),
                       kernel_config=KernelConfig(interpret=True)).model
    parents = SHAPES["random 12"]
    _, _, _, want, _ = tree_pass(plain, parents, seed=8)
    _, _, _, got, _ = tree_pass(fused, parents, seed=8)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
