"""`flashdraft tune`: the launches it may write, the table it merges them into, and how the
kernels read that table over the shipped one."""
import json

import pytest
import torch

from flashdraft.backends import kernels
from flashdraft.backends import tune
from flashdraft.config import ModelConfig

CUDA = torch.cuda.is_available()


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """A shipped table and a model cache of this test's; the kernels' table caches cleared."""
    shipped = tmp_path / "shipped.json"
    monkeypatch.setattr(kernels, "SHIPPED_TABLE", str(shipped))
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    kernels.tuned_table.cache_clear(), kernels.skinny_config.cache_clear()
    yield shipped
    kernels.tuned_table.cache_clear(), kernels.skinny_config.cache_clear()


@pytest.mark.parametrize("n,k,gated", [(2048, 1536, False), (8960, 1536, True),
                                       (1536, 8960, False), (151936, 896, False),
                                       (96, 900, False), (40, 64, False)])
def test_every_candidate_is_a_launch_the_kernels_accept(n, k, gated):
    """Whatever the sweep picks, the table will load: each candidate covers the weight's K
    tiles exactly and prefetches no more tiles than a program has."""
    found = list(tune.candidates(n, k, gated))
    assert found and len(found) == len(set(found))
    for c in found:
        kernels.check_entry(kernels.table_key(n, k, gated), c)


def _swept(best, best_us, default_us):
    return {"best": kernels.SkinnyConfig(*best), "best_us": best_us, "default_us": default_us}


def test_merge_writes_winners_and_the_user_table_wins_over_the_shipped(tables):
    gpu = kernels.device_name()
    tables.write_text(json.dumps({gpu: {"96x2048": [64, 128, 16, 1, 1, 4, 3],
                                        "1100x256": [16, 256, 1, 1, 1, 4, 3]}}))
    assert kernels.skinny_config(96, 2048, False, None) == (64, 128, 16, 1, 1, 4, 3)
    written = tune.merge(kernels.user_table(), {
        "96x2048": _swept((32, 256, 4, 2, 2, 4, 2), 1.0, 2.0),  # twice as fast: in
        "1100x256": _swept((32, 256, 1, 1, 1, 4, 2), 0.995, 1.0),  # within 1 %: out
        "40x16": _swept((16, 16, 1, 1, 1, 4, 3), 1.0, None),  # current not timed: in
    }, gpu)
    assert set(written) == {"96x2048", "40x16"}
    # a second sweep adds to the table and leaves the other entries
    tune.merge(kernels.user_table(), {"64x64": _swept((64, 64, 1, 1, 1, 4, 3), 1.0, 2.0)}, gpu)
    user = json.loads(kernels.user_table().read_text())[gpu]
    assert set(user) == {"96x2048", "40x16", "64x64"}
    assert kernels.skinny_config(96, 2048, False, None) == (32, 256, 4, 2, 2, 4, 2)
    assert kernels.skinny_config(1100, 256, False, None) == (16, 256, 1, 1, 1, 4, 3)
    assert kernels.skinny_config(2048, 2048, False, None) == kernels.skinny_config(2048, 2048)
    # what the user's table held before a merge it cannot read: a message, no overwrite
    kernels.user_table().write_text("[1, 2")
    with pytest.raises(SystemExit, match="not a table of launches"):
        tune.merge(kernels.user_table(), {}, gpu)
    assert kernels.user_table().read_text() == "[1, 2"


@pytest.mark.skipif(CUDA, reason="checks the message without CUDA")
def test_tune_without_cuda_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs CUDA"):
        tune.run_tune(None, "qwen2.5-1.5b", 10, None)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not kernels.available(), reason="needs a CUDA GPU and Triton")
def test_a_short_sweep_writes_launches_that_compute_the_products(tables):
    """A sweep of a small model's matrices on the GPU: the winners merge into the user's table,
    the kernels load them, and products under them match the reference, batch-invariant."""
    cfg = ModelConfig("qwen2", 4096, 256, 704, 1, 4, 2, 64, qkv_bias=True)
    swept = tune.sweep(cfg, 4.0, log=lambda s: None)
    assert set(swept) == {"512x256", "256x256", "1408x256", "256x704", "4096x256"}
    tune.merge(kernels.user_table(), {k: {**e, "default_us": None} for k, e in swept.items()},
               kernels.device_name())
    for key, e in swept.items():
        n, k = e["matrix"][:2]
        assert kernels.skinny_config(n, k, False, None) == e["best"]
        layer = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
        x = torch.randn(1, 9, k, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            full, one = kernels.linear(x, layer), kernels.linear(x[:, 4:5], layer)
        ref = kernels.linear_reference(x.float(), layer.weight.float(), None)
        assert (full.float() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max().item()), key
        assert torch.equal(one[:, 0], full[:, 4]), key
