"""The fused sampling kernels (flashdraft.backends.sampling_kernels) against the sort-based
reference (flashdraft.sampling), on the CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1) or on the GPU. Small capacities and few bins make the exact (bisection)
path run too."""
import pytest
import torch

from flashdraft import sampling as S
from flashdraft.backends import sampling_kernels as K

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not CUDA and not K.INTERPRET,
                                reason="the fused kernels need a GPU or Triton's interpreter")
# Small sizes: the interpreter's cost is per program and per operation.
KW = dict(capacity=64, num_bins=32, chunk=256, sub=256)


def check_stats(logits, temperature, top_k, top_p, min_p, **kw):
    got = S.row_stats(logits, temperature, top_k, top_p, min_p, fused=True, **{**KW, **kw})
    want = S.row_stats_reference(logits, temperature, top_k, top_p, min_p)
    args = (temperature, top_k, top_p, min_p)
    assert torch.equal(got.m, want.m), args
    assert torch.equal(got.t, want.t), (args, got.t, want.t)
    torch.testing.assert_close(got.z, want.z, rtol=1e-5, atol=0, msg=lambda m: f"{args}: {m}")
    s = logits.float() / temperature
    assert torch.equal(s >= got.t[:, None], s >= want.t[:, None]), args


@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
def test_row_stats_random_rows(top_k):
    g = torch.Generator().manual_seed(top_k)
    scale = torch.tensor([0.3, 1.0, 3.0, 6.0])[:, None]
    logits = (torch.randn(4, 700, generator=g) * scale).to(DEV)
    for i, (top_p, min_p) in enumerate([(1.0, 0.0), (0.9, 0.0), (0.5, 0.0), (1.0, 0.05),
                                        (0.9, 0.05), (0.5, 0.05)]):
        check_stats(logits, (0.5, 1.0, 1.5)[i % 3], top_k, top_p, min_p)
