"""The int4 tensor-core kernel (flashdraft.backends.mma): its weight layout on the CPU, through an
emulation of the kernel's fragments; the kernel itself on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flashdraft.backends import kernels
from flashdraft.backends import mma
from flashdraft.backends import quant

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _quantized(n: int, k: int, seed: int = 0, device="cpu"):
    torch.manual_seed(seed)
    w = torch.randn(n, k, device=device)
    return quant.quantize_int4(w)  # packed [k/2, n], scale, zero [k/128, n]


def test_pack_round_trip():
    packed, scale, zero = _quantized(48, 384)
    qweight, scales = mma.pack_int4(packed, scale, zero, chunk=2)  # chunks: 3 tiles in 2 + 1
    assert qweight.shape == (3, 3, 2, 32, 4) and qweight.dtype == torch.int32
    assert scales.shape == (3, 3, 8, 2)
    assert torch.equal(mma.unpack_int4(qweight), quant.unpack_int4(packed))
    s, z = mma.unpack_scales(scales)
    assert torch.equal(s, scale) and torch.equal(z, zero)


def test_a_weight_that_does_not_match_its_shape_is_refused():
    # the kernels index the packed weight by n and k alone (k from x's width): a wider x, a
    # larger n or a bias of another dtype would read past the tensors or misread them
    qweight, scales = mma.pack_int4(*_quantized(48, 384))
    bias = torch.zeros(48, dtype=torch.bfloat16)
    mma.check_packed(qweight, scales, 48, 384, bias)  # pack_int4's own: accepted
    for n, k, b in ((48, 512, bias), (64, 384, None), (48, 320, None),
                    (48, 384, bias.float()), (48, 384, bias[:40])):
        with pytest.raises(ValueError, match=rf"int4 mma weight of {n} x {k} needs qweight"):
            mma.check_packed(qweight, scales, n, k, b)
    with pytest.raises(ValueError, match=r"got qweight \[3, 3, 2, 32, 4\] torch.int64"):
        mma.check_packed(qweight.long(), scales, 48, 384)


def _emulate(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows <= 8, k] @ W^T as int4_mma computes it by default (FOLD), lane by lane, in
    float64: which code meets which input in each m16n8k16 product is read off the kernel's
    fragment code, and a group's sums d of x (128 + q) become s d + (z - 136 s) sum(x) (the
    kernel sums x over a group while staging it)."""
    tiles, groups = qweight.shape[:2]
    rows = x.shape[0]
    s_all, z_all = (t.double() for t in mma.unpack_scales(scales))  # [groups, n]
    xb = torch.zeros(8, x.shape[1], dtype=torch.float64)
    xb[:rows] = x.double()
    y = torch.zeros(8, tiles * 16, dtype=torch.float64)
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    for tile in range(tiles):
        cols = slice(tile * 16, (tile + 1) * 16)
        for gr in range(groups):
            d = torch.zeros(16, 8, dtype=torch.float64)  # [feature, row]
            for h in range(2):
                for jj in range(4):
                    a = torch.zeros(16, 16, dtype=torch.float64)  # [feature, k position]
                    b = torch.zeros(16, 8, dtype=torch.float64)  # [k position, row]
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        word = words[tile, gr, h, lane, jj]
                        for r in range(4):  # register r = biased(word >> 4r): a(2r), a(2r + 1)
                            f, col = g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
                            a[f, col] = 128 + ((word >> (4 * r)) & 0xF)
                            a[f, col + 1] = 128 + ((word >> (4 * r + 16)) & 0xF)
                        base = gr * 128 + 8 * (8 * h + t + (4 if jj >= 2 else 0)) + 4 * (jj & 1)
                        b[2 * t:2 * t + 2, g] = xb[g, base:base + 2]  # b0 b1
                        b[2 * t + 8:2 * t + 10, g] = xb[g, base + 2:base + 4]  # b2 b3
                    d += a @ b
            s, z = s_all[gr, cols, None], z_all[gr, cols, None]
            sums = xb[:, gr * 128:(gr + 1) * 128].sum(1)
            y[:, cols] += (s * d + (z - 136 * s) * sums).t()
    return y[:rows]


def test_layout_pairs_each_weight_with_its_input():
    packed, scale, zero = _quantized(32, 256, seed=1)
    qweight, scales = mma.pack_int4(packed, scale, zero)
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = quant.dequantize_int4(packed, scale, zero, torch.float64)  # exact: no bf16 rounding
    ref = x.double() @ w.t()
    torch.testing.assert_close(_emulate(x, qweight, scales), ref, rtol=1e-9, atol=1e-9)


def test_launch_shape_depends_on_the_weight_alone():
    with pytest.MonkeyPatch.context() as mp:  # the rule's settings, not the environment's
        mp.setattr(mma, "TARGET_BLOCKS", 264)
        mp.setattr(mma, "SPLIT_GROUPS", 16)
        mma.config.cache_clear()  # launch shapes are cached per weight shape
        # 32B gate/up: 2,400 blocks of one warp a tile, each streaming 16 groups
        assert mma.config(51200, 5120) == mma.MmaConfig(16, 3, 800, 4, 1)
        assert mma.config(6144, 4096) == mma.MmaConfig(8, 4, 96, 4, 1)  # 8B qkv: half as long
        assert mma.config(51200, 1024).groups_per_split == 8  # never longer than K
        # too few tiles for streamed splits: one-shot splits of two warps, shorter ones first
        assert mma.config(4096, 4096) == mma.MmaConfig(4, 8, 64, 4, 2)  # 8B o: 512 blocks
        assert mma.config(1536, 1536) == mma.MmaConfig(2, 6, 24, 4, 2)  # the shortest
        # a GPU with 99 KB of shared memory a block: x's 32 rows fit splits of 8 groups
        assert mma.config(51200, 5120, shared_limit=98 * 1024) == mma.MmaConfig(8, 5, 800, 4, 1)
        mp.setattr(mma, "SPLIT_GROUPS", 40)  # too long for 32 rows: half as long
        mma.config.cache_clear()
        assert mma.config(51200, 5120) == mma.MmaConfig(20, 2, 800, 4, 1)
        mp.setattr(mma, "SPLIT_GROUPS", 0)  # no streamed splits
        mma.config.cache_clear()
        assert mma.config(51200, 5120) == mma.MmaConfig(8, 5, 800, 4, 2)
        assert mma.config(1536, 1536).groups_per_split == 2
    mma.config.cache_clear()
    with pytest.raises(ValueError, match="shorter split"):  # x's 32 rows past shared memory
        mma.config(1024, 8192, groups_per_split=64)
    with pytest.raises(ValueError, match="multiples of 16"):
        mma.pack_int4(*_quantized(40, 128))


def test_unavailable_says_why():
    assert "CUDA" in mma.unavailable("cpu", torch.bfloat16)
    layer = quant.QuantLinear(nn.Linear(128, 32), "int4")  # auto on the CPU: the reference
    assert layer.backend == "reference"
    with pytest.raises(ValueError, match="backend='auto'"):
        quant.QuantLinear(nn.Linear(128, 32), "int4", "mma")


@pytest.mark.gpu
@needs_cuda
def test_kernel_matches_the_reference_and_is_batch_invariant():
    torch.manual_seed(4)
    # (k, n): one split, several splits (the last shorter), a partial block column, a bias
    for k, n, bias in ((256, 64, False), (1536, 8960, True), (5120, 1040, True),
                       (4096, 1024, False)):
        lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
        layer = quant.QuantLinear(lin, "int4", "mma")
        w = layer.dequantized()
        packed, scale, zero = quant.quantize_int4(lin.weight.detach())
        # the dequantization kernel computes each weight as the reference does
        assert torch.equal(w, quant.dequantize_int4(packed, scale, zero, torch.bfloat16))
        exact = quant.dequantize_int4(packed, scale, zero, torch.float64)
        x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 2, 7, 8, 9, 16, 17, 32):
            ref = x[:m].double() @ exact.t() + (lin.bias.double() if bias else 0)
            y = layer(x[:m])
            rel = ((y.double() - ref).norm() / ref.norm()).item()
            # FOLD: the output's bf16 rounding (~1e-3); FOLD=0 also rounds each weight
            assert rel < 2e-3, (k, n, m, rel)
            # batch invariance: each row's bits do not depend on the rows beside it
            assert torch.equal(y[:1], layer(x[:1])), (k, n, m)
            assert torch.equal(y[-1:], layer(x[m - 1:m])), (k, n, m)
        assert not kernels.tile_counters(x.device, 1).any()  # counters back to zero
        # prefill: more rows than the kernel takes go through the dequantized weight
        xs = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
        ref = xs.double() @ w.double().t() + (lin.bias.double() if bias else 0)
        assert ((layer(xs).double() - ref).norm() / ref.norm()).item() < 3e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("slots", [4, mma.STREAM_SLOTS])
def test_streamed_splits_match_the_reference_and_are_batch_invariant(monkeypatch, gated, slots):
    """Splits longer than the one-shot kernel's stream each warp's groups through its register
    slots: warps with more groups than slots, not a multiple of them, a shorter last split, a
    single split, two warps a tile; the one-shot launch of the same weight beside them."""
    monkeypatch.setattr(mma, "STREAM_SLOTS", slots)
    torch.manual_seed(7)
    n = 2080  # 130 tiles: a partial block column
    for k, gps, wk in ((5120, 9, 1), (5120, 20, 1), (5120, 23, 1), (5120, 23, 2), (2048, 16, 1)):
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layer = quant.QuantLinear(lin, "int4", "mma", gate_up=gated)
        exact = quant.dequantize_int4(*quant.quantize_int4(lin.weight.detach()), torch.float64)
        x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
        run = lambda rows, cfg: mma.linear(rows, layer.qweight, layer.scale, None,  # noqa: E731
                                           n, cfg, gated)
        one_shot = mma.config(n, k, wk=2, groups_per_split=8)  # 4 groups a warp, all up front
        cfg = mma.config(n, k, wk=wk, groups_per_split=gps)
        assert -(-gps // wk) > mma.GMAX, cfg  # the streamed kernel
        for m in (1, 7, 9, 17, 32):
            ref = x[:m].double() @ exact.t()
            if gated:
                ref = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            y = run(x[:m], cfg)
            rel = ((y.double() - ref).norm() / ref.norm()).item()
            assert rel < 2.5e-3, (k, gps, wk, m, rel)
            torch.testing.assert_close(y, run(x[:m], one_shot), rtol=2e-2, atol=2e-2)
            assert torch.equal(y[:1], run(x[:1], cfg)), (k, gps, wk, m)
            assert torch.equal(y[-1:], run(x[m - 1:m], cfg)), (k, gps, wk, m)
    assert not kernels.tile_counters(x.device, 1).any()


def test_gate_up_order_pairs_each_gate_with_its_up():
    n = 96
    order, inverse = mma.gate_up_order(n), mma.gate_up_order(n, inverse=True)
    assert torch.equal(order[inverse], torch.arange(n))
    # tile j: gate rows 8j..8j+7, then their up rows: output column 8j + i pairs rows i, i + 8
    tiles = order.view(-1, 16)
    assert torch.equal(tiles[:, 8:] - tiles[:, :8], torch.full((n // 16, 8), n // 2))
    with pytest.raises(ValueError, match="gated layout"):
        mma.gate_up_order(40)


def test_gated_layer_without_the_kernel_is_silu_times_up():
    torch.manual_seed(6)
    layer = quant.QuantLinear(nn.Linear(128, 64, bias=False), "int4", gate_up=True)
    assert layer.backend == "reference" and not layer.gated_layout  # no mma on the CPU
    x = torch.randn(3, 128)
    gate, up = layer(x).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.gated_linear(x, layer), expected)


@pytest.mark.gpu
@needs_cuda
def test_gated_kernel_is_silu_times_up_and_batch_invariant():
    torch.manual_seed(5)
    # (k, n = 2 x intermediate): one split; several; several with a partial block column
    for k, n in ((256, 128), (1536, 8960), (5120, 2080)):
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layer = quant.QuantLinear(lin, "int4", "mma", gate_up=True)
        plain = quant.QuantLinear(lin, "int4", "mma")
        assert layer.gated_layout and not plain.gated_layout
        # the same weights, stored in another row order
        assert torch.equal(layer.dequantized(), plain.dequantized())
        exact = quant.dequantize_int4(*quant.quantize_int4(lin.weight.detach()), torch.float64)
        x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 2, 9, 16, 17, 32, 40):  # 40: prefill, through the dequantized weight
            gate_up = x[:m].double() @ exact.t()
            ref = torch.nn.functional.silu(gate_up[:, :n // 2]) * gate_up[:, n // 2:]
            y = kernels.gated_linear(x[:m], layer)
            assert y.shape == (m, n // 2)
            rel = ((y.double() - ref).norm() / ref.norm()).item()
            # the kernel rounds once (~1.7e-3); prefill rounds gate, up and SiLU each (~4.2e-3)
            assert rel < (2.5e-3 if m <= mma.MAX_ROWS else 6e-3), (k, n, m, rel)
            # forward() gives [gate, up] in the layer's own order
            if m <= mma.MAX_ROWS:
                assert torch.equal(layer(x[:m]), plain(x[:m])), (k, n, m)
                assert torch.equal(y[:1], layer.forward_gated(x[:1])), (k, n, m)
                assert torch.equal(y[-1:], layer.forward_gated(x[m - 1:m])), (k, n, m)
            else:
                torch.testing.assert_close(layer(x[:m]), plain(x[:m]))
        assert not kernels.tile_counters(x.device, 1).any()
