"""Weight-only int8 / int4: the reference path on a CPU, the fast kernels against it on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flashdraft.backends import kernels, quant
from flashdraft.config import KernelConfig, ModelConfig
from flashdraft.kv_cache import KVCache
from flashdraft.tools.shapes import build_random_model

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_int4_pack_unpack_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 384)
    packed, scale, zero = quant.quantize_int4(w)
    assert packed.shape == (192, 48) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (3, 48)
    q = quant.unpack_int4(packed)
    assert q.shape == (48, 384) and int(q.max()) <= 15
    # Re-quantizing the dequantized weight gives the same codes.
    again, _, _ = quant.quantize_int4(quant.dequantize_int4(packed, scale, zero, torch.float32))
    assert torch.equal(again, packed)


@pytest.mark.parametrize("mode, bound", [("int8", 0.01), ("int4", 0.12)])
def test_quantization_error_is_bounded(mode, bound):
    torch.manual_seed(1)
    lin = nn.Linear(256, 64, bias=True)
    layer = quant.QuantLinear(lin, mode, "reference")
    w = layer.dequantized(torch.float32)
    assert ((w - lin.weight).norm() / lin.weight.norm()).item() < bound
    x = torch.randn(5, 3, 256)
    y = layer(x)
    assert y.shape == (5, 3, 64)
    # The reference path is exactly F.linear over the dequantized weight.
    torch.testing.assert_close(y, nn.functional.linear(x, w, lin.bias), rtol=0, atol=0)


def test_quantize_model_replaces_every_linear_and_still_runs():
    cfg = ModelConfig("qwen2", 300, 128, 256, 2, 4, 2, 32, qkv_bias=True)
    # quantize_model refuses folded norms
    model = build_random_model(cfg, torch.float32, "cpu", fold_norms=False)
    tokens = torch.randint(0, 300, (1, 9))
    pos = torch.arange(9).unsqueeze(0)
    ref, _ = model(tokens, pos, KVCache.for_model(cfg, 1, 16, torch.float32, "cpu"), kv_len=9)
    quant.quantize_model(model, "int8")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(m.backend == "reference" for m in model.modules()
               if isinstance(m, quant.QuantLinear))
    out, _ = model(tokens, pos, KVCache.for_model(cfg, 1, 16, torch.float32, "cpu"), kv_len=9)
    report = quant.quality_report(ref, out, tokens)
    assert report["logit_rel_error"] < 0.02 and report["top1_agreement"] > 0.8


def test_bad_requests_say_what_to_do():
    with pytest.raises(ValueError, match="multiples of 128"):
        quant.QuantLinear(nn.Linear(100, 8), "int4")
    with pytest.raises(ValueError, match="int8, int4"):
        quant.QuantLinear(nn.Linear(128, 8), "int2")
    with pytest.raises(ValueError, match="backend='reference'"):
        quant.QuantLinear(nn.Linear(128, 8), "int8", "triton")


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("backend, dtype", [("triton", torch.bfloat16), ("triton", torch.float16)])
def test_fast_kernels_match_the_reference(mode, backend, dtype):
    if quant.triton is None:
        pytest.skip("triton is not installed")
    torch.manual_seed(2)
    for k, n in ((512, 384), (1536, 8960), (4096, 1024)):
        lin = nn.Linear(k, n, bias=True, device="cuda", dtype=dtype)
        fast = quant.QuantLinear(lin, mode, backend)
        w = fast.dequantized(dtype)
        for m in (1, 2, 7, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = (x.double() @ w.double().t() + lin.bias.double())
            y = fast(x)
            torch.testing.assert_close(y.isnan().any(), torch.tensor(False, device="cuda"))
            rel = ((y.double() - ref).norm() / ref.norm()).item()
            assert rel < (3e-3 if backend == "triton" else 1e-2), (k, n, m, rel)
            # batch-invariant: row 0 alone gives the same bits
            assert torch.equal(fast(x[:1]), y[:1]), (k, n, m)


@pytest.mark.skipif(quant.triton is None or torch.cuda.is_available() or not kernels.INTERPRET,
                    reason="the CPU run of the Triton kernels needs Triton's interpreter")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_kernel_on_cpu_through_the_interpreter(mode, dtype):
    """The Triton product through Triton's interpreter, against the reference: K in two slices
    added by the last program (the second shorter), a partial column block, two row blocks, a
    bias; int4 codes made floats by the bit-or (float16) or by conversion (float32)."""
    torch.manual_seed(3)
    for k, steps in ((256, 1), (640, 3)):  # 640: 5 groups in slices of 3 and 2
        _check_through_the_interpreter(mode, dtype, k, steps)


def _check_through_the_interpreter(mode, dtype, k, steps):
    layer = quant.QuantLinear(nn.Linear(k, 80, bias=True).to(dtype), mode, "reference",
                              kernel_config=KernelConfig(interpret=True))
    w = layer.dequantized(torch.float32)
    cfg = kernels.quant_config(80, k, block_n=32, programs=6)
    assert cfg.split == 2 and cfg.k_steps == steps
    for m in (1, 5, 17):
        x = torch.randn(m, k).to(dtype)
        ref = x.double() @ w.double().t() + layer.bias.double()
        y = quant.triton_matmul(x, layer, cfg)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-3, m
        # the weight stored [n, k] instead (a transposed view): the same sums
        flipped = layer.qweight.t().contiguous().t()
        parts = (layer.scale, layer.zero, layer.bias, 80, cfg, layer.kernel_config)
        torch.testing.assert_close(kernels.quant_linear(x, flipped, *parts), y, rtol=0, atol=0)
        # batch-invariant: each row alone gives the same bits
        assert torch.equal(quant.triton_matmul(x[:1], layer, cfg), y[:1])
    assert not kernels.tile_counters(x.device, 1).any()  # every tile counter back to zero


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_speculative_decoding_equals_quantized_plain(tmp_path, mode):
    """The quantized products are batch-invariant: greedy speculation returns the tokens of
    plain decoding with the same quantized weights, bf16, graphs on (hidden 128: int4 groups)."""
    from flashdraft import LLM, SamplingParams
    from tests.tiny import build_model
    target = build_model(tmp_path / "target", "qwen2", seed=1, hidden=128)
    draft_model = build_model(tmp_path / "draft", "qwen2", seed=7, layers=1, hidden=128,
                              tokenizer_from=target)
    llm = LLM(str(target), device="cuda", dtype="bfloat16", quantization=mode)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # the last prompt is longer than the int4 kernel's 32 rows: its prefill (a CUDA graph of a
    # padded length) takes the dequantizing path
    prompts = ["def add(a, b):", "The quick brown fox jumps", " ".join(["jumps over"] * 40)]
    plain = [o.token_ids for o in llm.generate(prompts, params, draft=None)]
    assert len(llm.encode(prompts[-1])[1]) > 32
    for draft in ("ngram", str(draft_model), str(target)):
        outs = llm.generate(prompts, params, draft=draft, num_speculative_tokens=4)
        assert [o.token_ids for o in outs] == plain, draft


def test_quantize_model_refuses_a_model_with_folded_norms():
    """Folded norm weights would change what int4/int8 round: the message says how to
    quantize instead."""
    cfg = ModelConfig("qwen2", 300, 128, 256, 2, 4, 2, 32, qkv_bias=True)
    model = build_random_model(cfg, torch.float32, "cpu")
    model.fold_norms()
    with pytest.raises(ValueError, match="fold_norms=False"):
        quant.quantize_model(model, "int8")
