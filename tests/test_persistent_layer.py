"""benchmarks/persistent_layer.py, a prototype measured on the GPU: its arithmetic checked on
the CPU (Triton's interpreter, one program, so its grid barriers pass at once)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import persistent_layer as pl  # noqa: E402


def _bf16_truncated(t: torch.Tensor) -> torch.Tensor:
    # the interpreter converts float32 to bfloat16 by truncation, the GPU by rounding
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32)


@pytest.mark.skipif(not pl.INTERPRETED, reason="runs under Triton's interpreter (the CPU suite)")
@torch.inference_mode()
def test_persistent_layers_compute_the_reference_for_any_k_split():
    torch.manual_seed(0)
    h, q_dim, qkv_n, inter = 64, 64, 96, 160
    p = pl.PersistentLayers(h, q_dim, qkv_n, inter, 1, "cpu", programs=1, block_k=32)
    x = torch.randn(h).bfloat16()
    base = p.run(x)
    # one layer, step by step, against the buffers the kernel leaves
    norm = lambda v, w: v * torch.rsqrt(v.pow(2).mean() + p.eps) * w.float()  # noqa: E731
    qkv = p.w_qkv[0].float() @ norm(x.float(), p.nw1[0])
    torch.testing.assert_close(p.qpart.sum(0), qkv, rtol=1e-5, atol=1e-5)
    x2 = x.float() + p.w_o[0].float() @ qkv[:q_dim]
    torch.testing.assert_close(p.opart.sum(0), x2 - x.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(p.r[1].float(), _bf16_truncated(x2))
    gu = p.w_gu[0].float() @ norm(x2, p.nw2[0])
    act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
    torch.testing.assert_close(p.act.float(), _bf16_truncated(act), rtol=0, atol=1e-5)
    torch.testing.assert_close(p.dpart.sum(0), p.w_d[0].float() @ p.act.float(), rtol=1e-5,
                               atol=1e-5)
    # K split into slices (partials added in order) and tiles shorter than a slice: the same
    for q, o, d in [((2, 1, 32), (2, 1, 32), (5, 1, 32)), ((3, 1, 22), (4, 1, 16), (3, 2, 54))]:
        p.q, p.o, p.d = q, o, d
        p.qpart, p.opart = torch.zeros(q[0], qkv_n), torch.zeros(o[0], h)
        p.dpart = torch.zeros(d[0], h)
        torch.testing.assert_close(p.run(x), base, rtol=1e-6, atol=1e-6)
    assert int(p.bar.item()) == 4


@pytest.mark.skipif(not pl.INTERPRETED, reason="runs under Triton's interpreter (the CPU suite)")
@torch.inference_mode()
def test_persistent_layers_over_several_layers_match_the_reference():
    torch.manual_seed(1)
    p = pl.PersistentLayers(48, 32, 64, 72, 3, "cpu", programs=1, block_k=16)
    x = torch.randn(48).bfloat16()
    got, want = p.run(x), p.reference(x)  # the reference rounds where the kernel truncates
    assert float((got - want).norm() / want.norm()) < 3e-2
    assert int(p.bar.item()) == 12


def test_k_splits_spread_items_evenly():
    assert pl.split_for(1536, 1536, 132, 16, 512) == (4, 1, 384)  # 384 items on 132 programs
    assert pl.split_for(2048, 1536, 132, 16, 512)[0] == 1  # 128 items: already even
    ks, tiles, chunk = pl.split_for(1536, 8960, 132, 16, 512)
    assert ks * chunk >= 8960 and tiles * 512 >= chunk
