"""The gated delta rule's step kernel (flashdraft.backends.deltanet_kernels) against the
PyTorch reference (hybrid.delta_rule_recurrent) and in the hybrid model, on a GPU compiled and
without one through Triton's interpreter (conftest sets TRITON_INTERPRET=1), in float32."""
import pytest
import torch

from flashdraft.backends import deltanet_kernels, kernels
from flashdraft.config import KernelConfig
from flashdraft.hybrid import HybridTransformer, delta_rule_recurrent, l2_normalize
from flashdraft.loading import load_model
from tests.tiny import build_qwen35

pytestmark = pytest.mark.skipif(
    not kernels.available() or not (torch.cuda.is_available() or kernels.INTERPRET),
    reason="needs Triton, on a GPU or through its interpreter (TRITON_INTERPRET=1)")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KC = KernelConfig(interpret=not CUDA)
TOL = 1e-5


def inputs(b, k_heads, v_heads, t, dk, dv, seed):
    """Random raw q, k [b, k_heads, t, dk], v [b, v_heads, t, dv], decays g < 0 and β in (0, 1)
    [b, v_heads, t], all float32."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, k_heads, t, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, v_heads, t, dv, generator=gen)
    g = -torch.rand(b, v_heads, t, generator=gen) * 2
    beta = torch.rand(b, v_heads, t, generator=gen)
    return [x.to(DEVICE) for x in (q, k, v, g, beta)]


def slots(read, write):
    """The slot tensors delta_rule_step takes: read [1] (None: -1, zeros), write [t]."""
    return (torch.tensor([-1 if read is None else read], device=DEVICE),
            torch.tensor(write, device=DEVICE))


def close(a, b):
    err = (a - b).abs().max().item()
    assert err <= TOL * max(1.0, b.abs().max().item()), f"max error {err}"


def reference(q, k, v, g, beta, state, scale=None):
    """delta_rule_recurrent on value heads, normalising q and k first when scale is given;
    returns the outputs and the state after each token [t, b, v_heads, dk, dv]."""
    group = v.shape[1] // k.shape[1]
    q, k = (x.repeat_interleave(group, dim=1) for x in (q, k))
    if scale is not None:
        q, k = l2_normalize(q) * scale, l2_normalize(k)
    states = []
    out, _ = delta_rule_recurrent(q, k, v, g, beta, state, lambda i, s: states.append(s))
    return out, torch.stack(states)


@pytest.mark.parametrize("b,k_heads,v_heads,t,dk,dv", [
    (1, 1, 1, 1, 16, 16), (2, 3, 3, 17, 16, 32), (1, 2, 4, 5, 32, 16), (2, 2, 6, 1, 32, 32),
    (1, 1, 2, 32, 16, 16), (1, 2, 4, 3, 8, 12)])
@pytest.mark.parametrize("normalize", [False, True])
def test_step_matches_the_recurrent_rule(b, k_heads, v_heads, t, dk, dv, normalize):
    q, k, v, g, beta = inputs(b, k_heads, v_heads, t, dk, dv, seed=t)
    steps, start = 33, 40  # the step starts mid-ring and wraps past its end when t > 5
    write = [(start + i) % steps for i in range(t)]
    read = (start - 1) % steps
    gen = torch.Generator().manual_seed(1)
    ring = torch.randn(b, steps, v_heads, dk, dv, generator=gen).to(DEVICE) * 0.3
    before = ring.clone()
    scale = dk ** -0.5 if normalize else None
    if not normalize:
        group = v_heads // k_heads
        q, k = (l2_normalize(x) for x in (q, k))
        q = q * dk ** -0.5
        # the normalised heads as the layer's PyTorch path hands them over (one per value head)
        q_in, k_in = (x.repeat_interleave(group, dim=1) for x in (q, k))
    else:
        q_in, k_in = q, k
    out = deltanet_kernels.delta_rule_step(q_in, k_in, v, g, beta, ring, *slots(read, write),
                                           scale, kc=KC)
    ref_out, ref_states = reference(q, k, v, g, beta, before[:, read], scale)
    assert out.shape == (b, v_heads, t, dv)
    close(out, ref_out)
    for i, slot in enumerate(write):
        close(ring[:, slot], ref_states[i])
    untouched = [s for s in range(steps) if s not in write]
    assert torch.equal(ring[:, untouched], before[:, untouched])


def test_a_new_sequence_starts_from_zeros_and_a_full_ring_overwrites_its_read_slot():
    b, heads, t, dk, dv = 2, 2, 4, 16, 16
    q, k, v, g, beta = inputs(b, heads, heads, t, dk, dv, seed=3)
    ring = torch.full((b, t, heads, dk, dv), 5.0, device=DEVICE)
    out = deltanet_kernels.delta_rule_step(q, k, v, g, beta, ring,
                                           *slots(None, [2, 3, 0, 1]), dk ** -0.5, kc=KC)
    zeros = torch.zeros(b, heads, dk, dv, device=DEVICE)
    ref_out, ref_states = reference(q, k, v, g, beta, zeros, dk ** -0.5)
    close(out, ref_out)
    close(ring[:, [2, 3, 0, 1]].transpose(0, 1), ref_states)
    # the step as long as the ring: its last state goes to the slot it read, read first
    ring2 = ring.clone()
    out2 = deltanet_kernels.delta_rule_step(q, k, v, g, beta, ring2,
                                            *slots(1, [2, 3, 0, 1]), dk ** -0.5, kc=KC)
    ref_out2, ref_states2 = reference(q, k, v, g, beta, ring[:, 1], dk ** -0.5)
    close(out2, ref_out2)
    close(ring2[:, [2, 3, 0, 1]].transpose(0, 1), ref_states2)


def test_strided_and_half_precision_inputs_are_read_as_they_are():
    # the layer hands over views of its projection, in the model's dtype
    b, heads, t, dk, dv = 1, 2, 3, 16, 16
    q, k, v, g, beta = inputs(b, heads, heads, t, dk, dv, seed=4)
    q, k, v = (x.half() for x in (q, k, v))
    packed = torch.cat([q, k], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
    q_view, k_view = packed[..., :dk], packed[..., dk:]
    ring = torch.zeros(b, 8, heads, dk, dv, device=DEVICE)
    g_view = g.transpose(1, 2).contiguous().transpose(1, 2)
    out = deltanet_kernels.delta_rule_step(q_view, k_view, v, g_view, beta, ring,
                                           *slots(None, [0, 1, 2]), dk ** -0.5, kc=KC)
    ref_out, _ = reference(q.float(), k.float(), v.float(), g, beta,
                           torch.zeros(b, heads, dk, dv, device=DEVICE), dk ** -0.5)
    close(out, ref_out)


@pytest.mark.parametrize("t,read,write,message", [
    (3, [-1], [0, 1], "3 tokens and slots of shape \\(2,\\)"),
    (2, [0, 1], [0, 1], "reads one slot"), (2, [-1], [0.0, 1.0], "write slots must be .* int64"),
    (33, [-1], list(range(33)), "1 … 32")])
def test_bad_slots_are_refused(t, read, write, message):
    q, k, v, g, beta = inputs(1, 1, 1, t, 16, 16, seed=0)
    ring = torch.zeros(1, 40, 1, 16, 16, device=DEVICE)
    read, write = (torch.tensor(x, device=DEVICE) for x in (read, write))
    with pytest.raises(ValueError, match=message):
        deltanet_kernels.delta_rule_step(q, k, v, g, beta, ring, read, write, kc=KC)


def test_the_hybrid_model_decodes_and_verifies_through_the_kernel(tmp_path, monkeypatch):
    """A prefill, a verification of 4 tokens rolled back by 2, and decode steps: the kernel's
    logits and ring states are the PyTorch path's."""
    path = build_qwen35(tmp_path / "hybrid", seed=1)
    launched = []
    step = deltanet_kernels.delta_rule_step
    monkeypatch.setattr(deltanet_kernels, "delta_rule_step",
                        lambda *a, **kw: launched.append(a[1].shape[2]) or step(*a, **kw))
    models = {}
    for name, kc in (("torch", KernelConfig(backend="torch")), ("triton", KC)):
        model = load_model(str(path), torch.float32, DEVICE, kernel_config=kc).model
        assert isinstance(model, HybridTransformer)
        models[name] = model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, models["torch"].cfg.vocab_size, (2, 9), generator=gen).to(DEVICE)
    steps = [(0, 5), (5, 4), (7, 1), (8, 1)]  # (start, tokens): the third rolls back two
    results = {}
    for name, model in models.items():
        cache = model.new_cache(2, 32, torch.float32, DEVICE, steps=4)
        logits = []
        with torch.no_grad():
            for start, n in steps:
                cache.commit(start)
                pos = torch.arange(start, start + n, device=DEVICE).expand(2, n)
                logits.append(model(prompt[:, start:start + n], pos, cache)[0])
        results[name] = logits, cache.state
    # the three steps that keep every state, in each of the three DeltaNet layers; the
    # prefill (longer than the ring) runs the chunked form
    assert launched == [4] * 3 + [1] * 6
    for a, b in zip(results["triton"][0], results["torch"][0]):
        close(a, b)
    close(results["triton"][1], results["torch"][1])
