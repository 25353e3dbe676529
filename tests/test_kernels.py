"""The fused kernels (flashdraft.backends.kernels) against their PyTorch references.

On a GPU they run compiled, in float32, float16 and bfloat16; without one they run through
Triton's interpreter (conftest sets TRITON_INTERPRET=1), in float32 and float16 (the
interpreter's bfloat16 rounding is not the GPU's, so bfloat16 is checked on the GPU only).
"""
import json

import pytest
import torch

from flashdraft.backends import kernels
from flashdraft.config import KernelConfig, ModelConfig
from flashdraft.kv_cache import KVCache
from flashdraft.model import Transformer

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs Triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# Tolerance: the kernels round where the references round, so the difference is a few ulps
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# The Triton path, also on CPU tensors (interpreter); the PyTorch path, also on CUDA.
KC = KernelConfig(interpret=not CUDA)
TORCH = KernelConfig(backend="torch")


def close(a, b, dtype):
    assert a.shape == b.shape
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    assert err <= TOL[dtype] * max(1.0, scale), f"max error {err} (scale {scale}, {dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=g).to(DEVICE, dtype)
    res = torch.randn(5, 384, generator=g).to(DEVICE, dtype)
    w = torch.randn(384, generator=g).to(DEVICE, dtype)
    r_ref, r_k = res.clone(), res.clone()
    ref = kernels.rms_norm_reference(x, w, 1e-6, r_ref if with_residual else None)
    out = kernels.rms_norm(x, w, 1e-6, r_k if with_residual else None, kc=KC)
    close(out, ref, dtype)
    # the stored sum is the rounded sum, exactly as the unfused add stores it
    assert torch.equal(r_k, r_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_write(dtype, qk_norm):
    g = torch.Generator().manual_seed(1)
    heads, n_kv, d, b, t = 8, 2, 64, 2, 5
    qkv = torch.randn(b, t, heads + 2 * n_kv, d, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]], device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(d // 2).float() * 2 / d)
    freqs = positions.cpu().unsqueeze(-1).float() * inv_freq
    cos, sin = freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    c_ref = torch.full((2, b, n_kv, 32, d), 7.0, dtype=dtype, device=DEVICE)
    c_k = c_ref.clone()
    a, k = qkv.clone(), qkv.clone()
    kernels.rope_and_cache_write_reference(a, cos, sin, positions, c_ref, heads, n_kv, qn, kn, 1e-6)
    kernels.rope_and_cache_write(k, cos, sin, positions, c_k, heads, n_kv, qn, kn, 1e-6, kc=KC)
    close(k[:, :, :heads], a[:, :, :heads], dtype)  # q rotated in place
    close(c_k, c_ref, dtype)  # keys rotated, values as they were, other positions untouched
    assert (c_k[:, :, :, :3] == 7.0).all() and (c_k[:, 0, :, 8:20] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,kv_len,group", [(1, 40, 4), (1, 300, 6), (4, 300, 4), (9, 300, 2),
                                            (16, 520, 8)])
def test_attention_matches_reference_and_ignores_kv_len(dtype, t, kv_len, group):
    g = torch.Generator().manual_seed(2)
    n_kv, d, b, max_len = 2, 64, 2, 640
    cache = torch.randn(2, b, n_kv, max_len, d, generator=g).to(DEVICE, dtype)
    q = torch.randn(b, t, n_kv * group, d, generator=g).to(DEVICE, dtype)
    # the second sequence is 7 positions shorter; what lies beyond a sequence's last position
    # (stale drafts, garbage) must not matter
    ends = torch.tensor([kv_len, kv_len - 7])
    positions = torch.stack([torch.arange(e - t, e) for e in ends]).to(DEVICE)
    cache[:, 1, :, kv_len - 7:] = float("nan")
    cache[:, 0, :, kv_len:] = 1e4
    ref = kernels.attention_reference(q, cache.nan_to_num(0.0), positions, kv_len)
    split = kernels.split_length(max_len)
    assert split == 128
    out = kernels.attention(q, cache, positions, kv_len, split, kc=KC)
    # a graph replay attends over a rounded-up kv_len: bit for bit the same result
    bucketed = kernels.attention(q, cache, positions, max_len, split, kc=KC)
    # and the last token alone (a decode step) gets the same bits as within the step
    last = kernels.attention(q[:, -1:], cache, positions[:, -1:], kv_len, split, kc=KC)
    close(out, ref, dtype)
    assert torch.equal(out, bucketed)
    last_token_gets_its_bits_within_the_step(last, out, dtype)
    counters_are_back_to_zero()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_a_cache_of_one_split(dtype):
    """A cache no longer than one split: the kernel normalises and writes directly."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 1, 2, 96, 32, generator=g).to(DEVICE, dtype)
    q = torch.randn(1, 3, 4, 32, generator=g).to(DEVICE, dtype)
    positions = torch.arange(50, 53, device=DEVICE).unsqueeze(0)
    split = kernels.split_length(96)
    out = kernels.attention(q, cache, positions, 53, split, kc=KC)
    close(out, kernels.attention_reference(q, cache, positions, 53), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,qk_norm", [(1, False), (6, True), (16, False), (32, True)])
def test_rope_attention_is_rope_then_attention(dtype, t, qk_norm):
    """The fused kernel (rope and the cache write inside attention) against the two references:
    same output, same cache; the step's keys straddle a split (positions 125 ..), batch 2 with
    different positions; the last token alone gets the bits it gets within the step."""
    g = torch.Generator().manual_seed(5)
    heads, n_kv, d, b, max_len = 8, 2, 64, 2, 640
    qkv = torch.randn(b, t, heads + 2 * n_kv, d, generator=g).to(DEVICE, dtype)
    cache = torch.randn(2, b, n_kv, max_len, d, generator=g).to(DEVICE, dtype)
    positions = torch.stack([torch.arange(125, 125 + t), torch.arange(300, 300 + t)]).to(DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(d // 2).float() * 2 / d)
    freqs = positions.cpu().unsqueeze(-1).float() * inv_freq
    cos, sin = freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)
    qn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kn = torch.randn(d, generator=g).to(DEVICE, dtype) if qk_norm else None
    kv_len, split = 300 + t, kernels.split_length(max_len)
    c_ref, c_k, c_bucket = cache.clone(), cache.clone(), cache.clone()
    q_ref = qkv.clone()
    kernels.rope_and_cache_write_reference(q_ref, cos, sin, positions, c_ref, heads, n_kv, qn,
                                           kn, 1e-6)
    ref = kernels.attention_reference(q_ref[:, :, :heads], c_ref, positions, kv_len)
    args = (heads, n_kv, qn, kn, 1e-6)
    out = kernels.rope_attention(qkv, cos, sin, positions, c_k, *args, kv_len, split, kc=KC)
    bucketed = kernels.rope_attention(qkv, cos, sin, positions, c_bucket, *args, max_len,
                                      split, kc=KC)
    last = kernels.rope_attention(qkv[:, -1:], cos[:, -1:], sin[:, -1:], positions[:, -1:],
                                  c_k.clone(), *args, kv_len, split, kc=KC)
    close(out, ref, dtype)
    close(c_k, c_ref, dtype)
    assert torch.equal(c_k[:, 0, :, :125], cache[:, 0, :, :125])  # nothing else written
    assert torch.equal(c_k[:, 0, :, 125 + t:], cache[:, 0, :, 125 + t:])
    assert torch.equal(out, bucketed) and torch.equal(c_k, c_bucket)
    last_token_gets_its_bits_within_the_step(last, out, dtype)
    counters_are_back_to_zero()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2 * 1100, generator=g).to(DEVICE, dtype)
    out = kernels.silu_mul(x, kc=KC)
    close(out, kernels.silu_mul_reference(x), dtype)


CFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=128, intermediate_size=192,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=True)


@pytest.mark.parametrize("gated,folded", [(False, False), (True, False), (False, True),
                                          (True, True)])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_model_forward_with_kernels_equals_pytorch_path(monkeypatch, t, gated, folded):
    """The whole model, fused kernels vs the PyTorch path (float32): same logits, same cache,
    same hidden states. t=40 is a prefill (SDPA attention, fused norms, rope and cache write).
    gated: SiLU · up inside the gate/up product (`gated_for`). folded: the norms folded
    into the products (`Transformer.fold_norms`; t <= 32: no norm kernels, `model.Residual`)."""
    monkeypatch.setattr(kernels, "GATED_MIN_N", 0 if gated else 1 << 30)
    torch.manual_seed(0)
    model = Transformer(CFG).to(DEVICE)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    if folded:
        model.fold_norms()
    tokens = torch.randint(0, CFG.vocab_size, (1, t), device=DEVICE)
    positions = torch.arange(10, 10 + t, device=DEVICE).unsqueeze(0)
    results = []
    for use in (False, True):
        cache = KVCache.for_model(CFG, 1, 64, torch.float32, DEVICE)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))
        # (positions 0..9: an earlier prefix)
        model.kernel_config = KC if use else TORCH
        with torch.inference_mode():
            logits, hidden = model(tokens, positions, cache, kv_len=10 + t, hidden_layers=(0, 1, 2))
        results.append((logits, hidden, cache.kv[:, :, :, :, :10 + t]))
    (l0, h0, c0), (l1, h1, c1) = results
    close(l1, l0, torch.float32)
    close(c1, c0, torch.float32)
    for a, b in zip(h1, h0):
        close(a, b, torch.float32)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float16])
def test_silu_inside_the_down_product_changes_no_bit(monkeypatch, dtype):
    """An MLP's SiLU · up computed by the down product as it loads its input (`SiluPending`,
    `_x_tile`) gives the bits the silu_mul kernel gives, decoding and verifying (folded norms,
    an MLP narrower than `gated_for`'s)."""
    torch.manual_seed(0)
    model = Transformer(CFG, KC).to(DEVICE, dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.fold_norms()
    tokens = torch.randint(0, CFG.vocab_size, (1, 6), device=DEVICE)
    fused = []  # the products' silu_x flags: the down products must take the fused path
    real, real_add = kernels.skinny_linear, kernels.add_linear
    monkeypatch.setattr(kernels, "skinny_linear",
                        lambda *a, **kw: fused.append(kw.get("silu_x", False)) or real(*a, **kw))
    out = {}
    for silu_down in (False, True):
        # without: the activation computed by the silu_mul kernel before the down product
        monkeypatch.setattr(kernels, "add_linear", real_add if silu_down else (
            lambda x, module, residual, kc: real_add(
                x.value() if isinstance(x, kernels.SiluPending) else x, module, residual, kc)))
        fused.clear()
        cache = KVCache.for_model(CFG, 1, 64, dtype, DEVICE)
        with torch.inference_mode():
            model(tokens[:, :1], torch.tensor([[0]], device=DEVICE), cache, kv_len=16)
            out[silu_down] = model(tokens[:, 1:], torch.arange(1, 6, device=DEVICE)[None], cache,
                                   kv_len=16)[0]
        assert fused.count(True) == (2 * CFG.num_layers if silu_down else 0)
    assert torch.equal(out[False], out[True])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(100, 256, False), (2048, 1536, True), (40, 900, True),
                                      (6000, 128, False)])
def test_skinny_linear_matches_and_is_batch_invariant(dtype, n, k, bias):
    g = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(k, n, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(1, 20, k, generator=g).to(DEVICE, dtype)
    with torch.inference_mode():
        full = kernels.linear(x, layer, kc=KC)  # 20 rows: two row blocks
        rows = [kernels.linear(x[:, i:i + 1], layer, kc=KC) for i in (0, 7, 19)]
        three = kernels.linear(x[:, 5:8], layer, kc=KC)
    ref = kernels.linear_reference(x.float(), layer.weight.float(),
                                   layer.bias.float() if bias else None)
    close(full, ref, dtype)
    # a row's result is the same bits whatever else is in the product
    for i, r in zip((0, 7, 19), rows):
        assert torch.equal(r[:, 0], full[:, i])
    assert torch.equal(three, full[:, 5:8])
    counters_are_back_to_zero()


def test_skinny_launch_with_a_k_split():
    """K split over programs, the slices added by the last one: the same product,
    batch-invariant."""
    assert kernels.skinny_config(96, 2048, False).split > 1
    g = torch.Generator().manual_seed(9)
    layer = torch.nn.Linear(2048, 96, bias=True).to(DEVICE, torch.float32)
    x = torch.randn(1, 18, 2048, generator=g).to(DEVICE)
    with torch.inference_mode():
        full = kernels.linear(x, layer, kc=KC)
        one = kernels.linear(x[:, 17:], layer, kc=KC)
    close(full, kernels.linear_reference(x, layer.weight, layer.bias), torch.float32)
    assert torch.equal(one[:, 0], full[:, 17])
    counters_are_back_to_zero()


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """A tuned table of this test's (the path returned), caches cleared."""
    path = tmp_path / "skinny.json"
    kernels.tuned_table.cache_clear(), kernels.skinny_config.cache_clear()
    yield path
    kernels.tuned_table.cache_clear(), kernels.skinny_config.cache_clear()


def test_skinny_tuned_table(tuned):
    """A measured launch in the table is the one used for its shape on this GPU model (tests
    on the CPU: "cpu"), the product is right and batch-invariant under it; shapes and GPU
    models the table lacks follow the shape rule."""
    mine = kernels.SkinnyConfig(32, 256, 4, 2, 2, 4, 2)
    tuned.write_text(json.dumps({kernels.device_name(): {"96x2048": list(mine)},
                                 "Some Other GPU": {"1100x256": [16, 256, 1, 1, 1, 4, 3]}}))
    table = str(tuned)
    assert kernels.skinny_config(96, 2048, False, table) == mine
    assert kernels.skinny_config(96, 2048, True, table) == kernels.skinny_config(96, 2048, True)
    assert kernels.skinny_config(1100, 256, False, table) == kernels.skinny_config(1100, 256)
    kc = KernelConfig(interpret=not CUDA, tuned_table=table)
    # the table holds 16-bit launches: float32 weights take the rule
    w16, w32 = (torch.empty(96, 2048, dtype=d) for d in (torch.float16, torch.float32))
    assert kernels._launch(w16, False, kc) == mine
    assert kernels._launch(w32, False, kc) == kernels.skinny_config(96, 2048)
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(2048, 96, bias=True).to(DEVICE, torch.float16)
    x = torch.randn(1, 18, 2048, generator=g).to(DEVICE, torch.float16)
    with torch.inference_mode():
        full = kernels.linear(x, layer, kc=kc)
        one = kernels.linear(x[:, 11:12], layer, kc=kc)
    ref = kernels.linear_reference(x.float(), layer.weight.float(), layer.bias.float())
    close(full, ref, torch.float16)
    assert torch.equal(one[:, 0], full[:, 11])
    counters_are_back_to_zero()


@pytest.mark.parametrize("content,complaint", [
    ({"cpu": {"96x2048": [32, 256, 4, 3, 2, 4, 2]}}, "not a launch of the skinny kernel"),
    ({"cpu": {"96x2048": [32, 256, 4, 2, 8, 4, 2]}}, "not a launch of the skinny kernel"),
    ({"cpu": {"96x2048": [64, 128, 6, 3, 3, 4, 3]}}, "not a launch"),  # 3 tiles prefetched
    ({"cpu": {"96x2048": [8, 256, 4, 2, 1, 4, 2]}}, "not a launch"),  # too narrow for tl.dot
    ({"cpu": {"96x2048": [64, 0, 4, 2, 1, 4, 2]}}, "not a launch"),
    ({"cpu": {"96x2048": [64, 128, 16, 1, 1, 64, 3]}}, "not a launch"),  # 64 warps
    ({"cpu": {"96x2048": [32]}}, "not a table of skinny-kernel launches"),
    ([1, 2], "not a table of skinny-kernel launches"),
    (None, "no such file")])
def test_skinny_tuned_table_refuses_what_it_cannot_run(tuned, content, complaint):
    """A table that does not cover its weights (K tiles not split as stated, more prefetched
    tiles than a program has) or names launches the kernel cannot compile, or is not a table,
    or a named file that is missing: a message that names the file and the fix, not a wrong
    product or a compiler error in the middle of a step."""
    if content is not None:
        tuned.write_text(json.dumps({kernels.device_name(): content["cpu"]}
                                    if isinstance(content, dict) else content))
    with pytest.raises(ValueError, match=complaint):
        kernels.skinny_config(96, 2048, False, str(tuned))


def test_skinny_tuned_table_that_is_a_folder(tuned):
    tuned.mkdir()
    with pytest.raises(ValueError, match="not a table of skinny-kernel launches"):
        kernels.skinny_config(96, 2048, False, str(tuned))


def test_skinny_tuned_table_off():
    assert kernels.tuned_table(kernels.device_name(), "off") == {}


def last_token_gets_its_bits_within_the_step(last, out, dtype):
    """The last token alone (a decode step) against its row of the whole step's output: the
    same bits on the GPU; on the CPU the interpreter's matmul (BLAS) may round a row by its
    place in the tile."""
    if CUDA:
        assert torch.equal(last, out[:, -1:])
    else:
        close(last, out[:, -1:], dtype)


def counters_are_back_to_zero():
    """The last program of a split tile puts its counter back: the next launch starts clean."""
    for buf in kernels.COUNTERS.values():
        assert buf.count_nonzero().item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(96, 2048, False), (1100, 256, True), (40, 900, False)])
def test_gated_linear_is_silu_mul_of_the_product_and_batch_invariant(monkeypatch, dtype, n, k,
                                                                     bias):
    monkeypatch.setattr(kernels, "GATED_MIN_N", 0)  # SiLU · up inside the product at any width
    g = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(k, 2 * n, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2 * n, k, generator=g) * 0.05)
    x = torch.randn(1, 20, k, generator=g).to(DEVICE, dtype)
    with torch.inference_mode():
        full = kernels.gated_linear(x, layer, kc=KC)
        rows = [kernels.gated_linear(x[:, i:i + 1], layer, kc=KC) for i in (0, 19)]
    product = kernels.linear_reference(x.float(), layer.weight.float(),
                                       layer.bias.float() if bias else None).to(dtype)
    close(full, kernels.silu_mul_reference(product), dtype)
    for i, r in zip((0, 19), rows):
        assert torch.equal(r[:, 0], full[:, i])
    counters_are_back_to_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,gated,with_delta", [(96, 2048, False, True), (550, 256, True, True),
                                                  (40, 900, False, False), (200, 384, True, False)])
def test_norm_linear_is_add_norm_product_and_batch_invariant(monkeypatch, dtype, n, k, gated,
                                                             with_delta):
    """Residual add and RMSNorm (one kernel), then the product (SiLU · up inside it with gated),
    against the separate reference steps; the stored sum is exactly the reference's."""
    monkeypatch.setattr(kernels, "GATED_MIN_N", 0)  # at any width (by default 12,288 up)
    from flashdraft.model import RMSNorm
    g = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(k, (2 if gated else 1) * n, bias=True).to(DEVICE, dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.05)
        norm.weight.copy_(1 + 0.1 * torch.randn(k, generator=g))
    residual = torch.randn(1, 20, k, generator=g).to(DEVICE, dtype)
    delta = torch.randn(1, 20, k, generator=g).to(DEVICE, dtype) if with_delta else None
    with torch.inference_mode():
        full, summed = kernels.norm_linear(delta, residual.clone(), norm, layer, gated, kc=KC)
        rows = [kernels.norm_linear(None if delta is None else delta[:, i:i + 1],
                                    residual[:, i:i + 1].clone(), norm, layer, gated, kc=KC)[0]
                for i in (0, 19)]
    r = residual.clone()
    h = kernels.rms_norm_reference(r if delta is None else delta, norm.weight, 1e-6,
                                   None if delta is None else r)
    product = kernels.linear_reference(h.float(), layer.weight.float(), layer.bias.float())
    ref = kernels.silu_mul_reference(product.to(dtype)) if gated else product
    close(full, ref, dtype)
    assert torch.equal(summed, r)
    for i, row in zip((0, 19), rows):
        assert torch.equal(row[:, 0], full[:, i])
    counters_are_back_to_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,gated,bias", [(96, 256, False, True), (200, 224, True, True),
                                            (40, 128, False, False), (72, 384, True, False)])
@pytest.mark.parametrize("fused", [True, False])
def test_add_linear_then_scaled_linear_is_add_norm_product_and_batch_invariant(
        monkeypatch, dtype, n, k, gated, bias, fused):
    """A sublayer's output product added into the residual stream (`add_linear`, which leaves
    the rows' sums of squares), then the next product with the norm's weight folded into it
    (`scaled_linear`): the reference's add, norm and product, with the same stored sum as the
    separate add, each row's bits independent of the other rows. SiLU · up inside the product
    with gated. fused False: the paths where the kernel does not serve (`*_reference`).
    k = 224: the last column tile of the sums of squares part empty."""
    monkeypatch.setattr(kernels, "GATED_MIN_N", 0)
    kc = KC if fused else TORCH
    from flashdraft.model import RMSNorm
    g = torch.Generator().manual_seed(11)
    wo = torch.nn.Linear(160, k, bias=bias).to(DEVICE, dtype)
    layer = torch.nn.Linear(k, (2 if gated else 1) * n, bias=bias).to(DEVICE, dtype)
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        wo.weight.copy_(torch.randn(wo.weight.shape, generator=g) * 0.05)
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.05)
        norm.weight.copy_(1 + 0.1 * torch.randn(k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    folded = torch.nn.Linear(k, layer.out_features, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        folded.weight.copy_((layer.weight.float() * norm.weight.float()).to(dtype))
        if bias:
            folded.bias.copy_(layer.bias)
    x = torch.randn(2, 10, 160, generator=g).to(DEVICE, dtype)  # 20 rows: two row blocks
    residual = torch.randn(2, 10, k, generator=g).to(DEVICE, dtype) * 4

    def run(rows):
        r = residual[:, rows].clone()
        ss = kernels.add_linear(x[:, rows], wo, r, kc=kc)
        return r, ss, kernels.scaled_linear(r, ss, 1e-6, folded, gated, kc=kc)

    with torch.inference_mode():
        assert kernels.folds_norm(x, wo, kc) == fused
        assert kernels.folds_norm(residual, folded, kc) == fused
        summed, ss, full = run(slice(None))
        alone = [run(slice(i, i + 1)) for i in (0, 9)]
        delta = kernels.linear(x, wo, kc=kc)
    assert torch.equal(summed, (residual.float() + delta.float()).to(dtype))
    close(ss.sum(-1), summed.float().square().sum(-1).view(-1), torch.float32)
    with torch.no_grad():
        h = kernels.rms_norm_reference(summed.float(), norm.weight.float(), 1e-6)
        product = kernels.linear_reference(h, layer.weight.float(),
                                           layer.bias.float() if bias else None)
    ref = kernels.silu_mul_reference(product.to(dtype)) if gated else product
    close(full, ref, dtype)
    if fused:  # the kernels are batch-invariant (the CPU's F.linear need not be)
        for i, (r, _, out) in zip((0, 9), alone):
            assert torch.equal(r[:, 0], summed[:, i])
            assert torch.equal(out[:, 0], full[:, i])
    counters_are_back_to_zero()


@pytest.mark.parametrize("gated", [False, True])
def test_folded_model_verifies_as_it_decodes_bit_for_bit(monkeypatch, gated):
    """The losslessness of greedy speculation with the norms inside the products, on the
    kernels (the interpreter without a GPU): a 6-token pass gives each position exactly the
    logits, cache entries and hidden states of decoding them one at a time. Qwen2 biases,
    a tied head, norm weights far from 1."""
    monkeypatch.setattr(kernels, "GATED_MIN_N", 0 if gated else 1 << 30)
    cfg = ModelConfig(arch="qwen2", vocab_size=96, hidden_size=96, intermediate_size=160,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True,
                      tie_word_embeddings=True)
    torch.manual_seed(1)
    model = Transformer(cfg, KC).to(DEVICE)
    for name, p in model.named_parameters():
        p.data.normal_(1.0, 0.3) if name.endswith("norm.weight") else p.data.normal_(0, 0.2)
    model.fold_norms()
    prompt = torch.randint(0, cfg.vocab_size, (1, 7), device=DEVICE)
    step = torch.randint(0, cfg.vocab_size, (1, 6), device=DEVICE)
    caches = [KVCache.for_model(cfg, 1, 32, torch.float32, DEVICE) for _ in range(2)]
    pos = lambda a, b: torch.arange(a, b, device=DEVICE)[None]
    with torch.inference_mode():
        for c in caches:
            model(prompt, pos(0, 7), c, kv_len=7)
        verify, hv = model(step, pos(7, 13), caches[0], kv_len=13, hidden_layers=(1, 2))
        singles = [model(step[:, i:i + 1], pos(7 + i, 8 + i), caches[1], kv_len=8 + i,
                         hidden_layers=(1, 2)) for i in range(6)]
    assert torch.equal(verify, torch.cat([s[0] for s in singles], dim=1))
    for layer in range(2):
        assert torch.equal(hv[layer], torch.cat([s[1][layer] for s in singles], dim=1))
    assert torch.equal(caches[0].kv[:, :, :, :, :13], caches[1].kv[:, :, :, :, :13])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("folded", [False, True])
def test_verify_pass_gives_the_decode_logits_bit_for_bit_in_bf16(folded):
    """What makes greedy speculation lossless in bf16: a pass over k+1 tokens yields, for each
    position, exactly the logits (and cache entries) that decoding them one at a time yields,
    eager or graph-replayed. Random weights: near-uniform logits, so any difference in
    arithmetic would show, and would flip argmaxes."""
    from flashdraft.backends.cuda_graphs import StepRunner, eager_step
    cfg = ModelConfig(arch="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=704,
                      num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg).to("cuda", torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    if folded:  # the norms inside the products (model.Residual), as models load
        model.fold_norms()
    prompt = torch.randint(0, cfg.vocab_size, (1, 300), device="cuda")
    step = torch.randint(0, cfg.vocab_size, (1, 9), device="cuda")
    caches = [KVCache.for_model(cfg, 1, 640, torch.bfloat16, "cuda") for _ in range(3)]
    runner = StepRunner(model, "cuda", kv_bucket=256)
    with torch.inference_mode():
        for c in caches:
            eager_step(model, prompt, 0, c)
        verify = eager_step(model, step, 300, caches[0])[0].clone()
        one_by_one = torch.cat([eager_step(model, step[:, i:i + 1], 300 + i, caches[1])[0]
                                for i in range(9)], dim=1)
        replayed = torch.cat([runner(step[:, i:i + 1], 300 + i, caches[2])[0].clone()
                              for i in range(9)], dim=1)
    assert torch.equal(verify, one_by_one)
    assert torch.equal(replayed, one_by_one)
    assert torch.equal(caches[0].kv[:, :, :, :, :309], caches[1].kv[:, :, :, :, :309])
    assert torch.equal(caches[2].kv[:, :, :, :, :309], caches[1].kv[:, :, :, :, :309])


def test_gated_puts_silu_in_the_product_of_wide_mlps_only():
    """SiLU · up inside the gate/up product from the 8B's width up (measured faster there),
    its own kernel below."""
    assert kernels.gated_for(12288) and kernels.gated_for(25600)
    assert not kernels.gated_for(8960) and not kernels.gated_for(4864)


def test_gated_for_decides_which_gate_up_products_fuse_silu(monkeypatch):
    """gated_linear, scaled_linear and tune.matrices all follow gated_for: the fused product
    (one `skinny_linear` call with gated) for widths at or above GATED_MIN_N, else the plain one."""
    from flashdraft.backends import tune
    calls = []
    real = kernels.skinny_linear
    monkeypatch.setattr(kernels, "skinny_linear",
                        lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    layers = {n: torch.nn.Linear(64, 2 * n, bias=False).to(DEVICE) for n in (32, 48)}
    x = torch.randn(1, 3, 64, device=DEVICE)
    ss = x.reshape(-1, 64).square().sum(-1, keepdim=True)
    for min_n, want in ((48, {32: False, 48: True}), (16, {32: True, 48: True})):
        monkeypatch.setattr(kernels, "GATED_MIN_N", min_n)
        for n, layer in layers.items():
            with torch.inference_mode():
                calls.clear()
                kernels.gated_linear(x, layer, kc=KC)
                kernels.scaled_linear(x, ss, 1e-6, layer, gated=True, kc=KC)
            assert calls == [want[n]] * 2
        model = torch.nn.Module()
        model.w_gate_up = layers[32]
        assert list(tune.matrices(model)) == [(32 if want[32] else 64, 64, want[32])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_trees_step_sees_its_ancestors_only(dtype):
    """The fused kernel with a tree's ancestor bits (rope at depths, keys at the nodes' slots)
    against the reference with the tree's visibility, over a step that straddles a split."""
    from flashdraft.tree import TreeMask

    g = torch.Generator().manual_seed(11)
    parents = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8]
    tree = TreeMask.from_parents(parents, DEVICE)
    t, heads, n_kv, d, max_len = len(parents), 4, 2, 32, 320
    qkv = torch.randn(1, t, heads + 2 * n_kv, d, generator=g).to(DEVICE, dtype)
    cache = torch.randn(2, 1, n_kv, max_len, d, generator=g).to(DEVICE, dtype)
    slots = torch.arange(250, 250 + t, device=DEVICE).unsqueeze(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(d // 2).float() * 2 / d)
    freqs = tree.rope_positions(slots).cpu().unsqueeze(-1).float() * inv_freq
    cos, sin = freqs.cos().to(DEVICE, dtype), freqs.sin().to(DEVICE, dtype)
    kv_len, split = 250 + t, kernels.split_length(max_len)
    c_ref, c_k = cache.clone(), cache.clone()
    q_ref = qkv.clone()
    kernels.rope_and_cache_write_reference(q_ref, cos, sin, slots, c_ref, heads, n_kv, None,
                                           None, 1e-6)
    ref = kernels.attention_reference(q_ref[:, :, :heads], c_ref, slots, kv_len, tree.bits)
    out = kernels.rope_attention(qkv, cos, sin, slots, c_k, heads, n_kv, None, None, 1e-6,
                                 kv_len, split, kc=KC, tree_bits=tree.bits)
    close(out, ref, dtype)
    close(c_k, c_ref, dtype)
    # the reference's visibility is the tree's own
    rel = torch.arange(kv_len, device=DEVICE) - 250
    bit = (tree.bits.view(t, 1) >> rel.clamp(0, t - 1)) & 1
    want = tree.visible(slots, kv_len)[0]
    assert torch.equal((rel < 0) | ((rel >= 0) & (rel < t) & (bit != 0)), want)
    counters_are_back_to_zero()
