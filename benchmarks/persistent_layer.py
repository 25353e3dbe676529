"""How close to its weight bytes can one persistent kernel run a decoder layer's products?

A question to answer before building it into the model (issue 5's decode targets). On the H200
a decode step of the 1.5B shape takes ~50 µs a layer against ~22 µs of weight bytes: each of a
layer's ~8 kernels loses a few µs to its start and its tail (benchmarks/NOTES-gpu.md, sessions 3
and 9). Here one kernel, one program per multiprocessor, runs every layer, with a grid-wide
barrier (an atomic counter, release/acquire) between a layer's phases instead of kernel
boundaries, and each program loads its first weight tile of the next phase before it waits:

  1. x1 = r + Σ down partials (the last layer's); RMSNorm; qkv = W_qkv x1   (K-split partials)
  2. o = W_o q, q = Σ qkv partials[:, :q_dim]  (attention left out: o reads q itself)
  3. x2 = x1 + Σ o partials (program 0 stores it: the next layer's r); RMSNorm;
     act = SiLU(W_gate x2) · (W_up x2)
  4. down = W_down act                                                  (K-split partials)

Every program computes the norms' statistics itself from the whole row (a few KB from the L2),
so no phase waits for a norm. Work items are (16 output rows, a slice of K) pairs; the K split
is chosen per product so that the items fall evenly on the programs. Partials are float32 and
added in a fixed order: the result does not depend on timing.

Against it, in the same process: the same layers through flashdraft's kernels as they ran
before the norms were folded into the products (session 12): rms_norm, the skinny products,
silu_mul, captured as one CUDA graph with programmatic dependent launch.
Both leave attention out, so the figures are a layer's products, norms and activation only.
Random weights: speed only.

    PYTHONPATH=. python3 benchmarks/persistent_layer.py --shape qwen2.5-1.5b --out DIR
"""
from __future__ import annotations

import argparse
import json
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.backends import kernels  # noqa: E402
from flashdraft.tools.shapes import get_shape  # noqa: E402

INTERPRETED = kernels.INTERPRET  # Triton's interpreter runs programs one after another

# A barrier gives up after this many polls (~0.2 s): were the programs not all resident at once,
# the kernel would end with wrong results (`barrier_gave_up`) instead of hanging the GPU.
MAX_SPINS = tl.constexpr(1 << 18)


@triton.jit
def _barrier(bar_ptr, target, ON: tl.constexpr):
    # ON False: no waiting at all (wrong results; the streaming alone, for --no-barriers).
    # Every program adds one, then polls until all NP programs of this phase have: stores
    # before the release are visible to loads after the acquire (loads of other programs'
    # results also bypass L1: cache_modifier ".cg").
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if ON:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < MAX_SPINS):
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
    tl.debug_barrier()


@triton.jit
def _coords(j, pid, NP: tl.constexpr, KS: tl.constexpr, TPI: tl.constexpr,
            K_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # tile j of this program: its item pid + NP * (j // TPI) = (row block, K slice), tile
    # j % TPI within the slice
    item = pid + NP * (j // TPI)
    t = j % TPI
    kc = item % KS
    offs_n = (item // KS) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = kc * K_CHUNK + t * BLOCK_K
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    k_hi = kc * K_CHUNK + K_CHUNK
    return offs_n, offs_k, k_hi, kc, t


@triton.jit
def _w_tile(w_ptr, offs_n, offs_k, k_hi, N: tl.constexpr, K: tl.constexpr, live):
    k_hi = tl.where(live, tl.minimum(k_hi, K), 0)  # nothing loaded past the last tile
    ok = (offs_n < N)[:, None] & (offs_k < k_hi)[None, :]
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=ok, other=0.0)


@triton.jit
def _n_tiles(pid, N: tl.constexpr, KS: tl.constexpr, TPI: tl.constexpr, BLOCK_N: tl.constexpr,
             NP: tl.constexpr):
    items = tl.cdiv(N, BLOCK_N) * KS
    return tl.cdiv(tl.maximum(items - pid, 0), NP) * TPI


@triton.jit
def _first_tiles(w_ptr, pid, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                 TPI: tl.constexpr, K_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NP: tl.constexpr, GATED: tl.constexpr):
    # a phase's first weight tile (and its up rows' when GATED), loaded before the barrier
    live = _n_tiles(pid, N, KS, TPI, BLOCK_N, NP) > 0
    offs_n, offs_k, k_hi, kc, t = _coords(0, pid, NP, KS, TPI, K_CHUNK, BLOCK_N, BLOCK_K)
    w = _w_tile(w_ptr, offs_n, offs_k, k_hi, N, K, live)
    u = w
    if GATED:
        u = _w_tile(w_ptr + N * K, offs_n, offs_k, k_hi, N, K, live)
    return w, u


@triton.jit
def _x_tile(offs_k, K: tl.constexpr, base_ptr, HAS_BASE: tl.constexpr, pa_ptr, NA: tl.constexpr,
            SA: tl.constexpr, pb_ptr, NB: tl.constexpr, SB: tl.constexpr, nw_ptr,
            HAS_NORM: tl.constexpr, inv):
    # the phase's input at columns offs_k: base + Σ partials a + Σ partials b (float32, in that
    # order), scaled by inv · the norm's weight when HAS_NORM
    ok = offs_k < K
    x = tl.zeros(offs_k.shape, dtype=tl.float32)
    if HAS_BASE:
        x += tl.load(base_ptr + offs_k, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    for s in tl.static_range(NA):
        x += tl.load(pa_ptr + s * SA + offs_k, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(NB):
        x += tl.load(pb_ptr + s * SB + offs_k, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_NORM:
        x = x * inv * tl.load(nw_ptr + offs_k, mask=ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _inv_rms(K: tl.constexpr, base_ptr, pa_ptr, NA: tl.constexpr, pb_ptr, NB: tl.constexpr, eps,
             BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        x = _x_tile(k0 + tl.arange(0, BLOCK), K, base_ptr, True, pa_ptr, NA, K, pb_ptr, NB, K,
                    base_ptr, False, 1.0)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _phase(w_ptr, w, u, pid, N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
           TPI: tl.constexpr, K_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, NP: tl.constexpr, GATED: tl.constexpr,
           base_ptr, HAS_BASE: tl.constexpr, pa_ptr, NA: tl.constexpr, SA: tl.constexpr,
           pb_ptr, NB: tl.constexpr, SB: tl.constexpr, nw_ptr, HAS_NORM: tl.constexpr, inv,
           out_ptr):
    # This program's tiles, the next one's load issued before the current one's arithmetic
    # (w, u: the first, loaded before the barrier). Plain: float32 partials out[kc, n];
    # GATED (KS = 1): out[n] = SiLU(gate) · up in out's dtype.
    n_tiles = _n_tiles(pid, N, KS, TPI, BLOCK_N, NP)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(n_tiles):
        offs_n, offs_k, k_hi, kc, t = _coords(j, pid, NP, KS, TPI, K_CHUNK, BLOCK_N, BLOCK_K)
        nn, nk, nhi, _, _ = _coords(j + 1, pid, NP, KS, TPI, K_CHUNK, BLOCK_N, BLOCK_K)
        w_next = _w_tile(w_ptr, nn, nk, nhi, N, K, j + 1 < n_tiles)
        u_next = w_next
        if GATED:
            u_next = _w_tile(w_ptr + N * K, nn, nk, nhi, N, K, j + 1 < n_tiles)
        x = _x_tile(offs_k, K, base_ptr, HAS_BASE, pa_ptr, NA, SA, pb_ptr, NB, SB, nw_ptr,
                    HAS_NORM, inv)
        x = tl.where(offs_k < k_hi, x, 0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            acc_u += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        done = (offs_n * 0 + t) == TPI - 1  # the slice's last tile: its sums are complete
        if GATED:
            act = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(out_ptr + offs_n, act.to(out_ptr.dtype.element_ty),
                     mask=(offs_n < N) & done)
        else:
            tl.store(out_ptr + kc * N + offs_n, acc, mask=(offs_n < N) & done)
        acc = tl.where(done, 0.0, acc)
        acc_u = tl.where(done, 0.0, acc_u)
        w = w_next
        u = u_next


@triton.jit
def _layers_kernel(r_ptr, dpart, qpart, opart, act, bar_ptr, w_qkv, w_o, w_gu, w_d, nw1, nw2,
                   eps, n_layers,
                   H: tl.constexpr, QN: tl.constexpr, QD: tl.constexpr, INTER: tl.constexpr,
                   KS_Q: tl.constexpr, TPI_Q: tl.constexpr, KC_Q: tl.constexpr,
                   KS_O: tl.constexpr, TPI_O: tl.constexpr, KC_O: tl.constexpr,
                   TPI_G: tl.constexpr, KC_G: tl.constexpr, BN_G: tl.constexpr,
                   KS_D: tl.constexpr, TPI_D: tl.constexpr, KC_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NP: tl.constexpr,
                   BARRIERS: tl.constexpr = True):
    # r [2, H] bf16 (the residual stream, double-buffered by layer parity); dpart [KS_D, H],
    # qpart [KS_Q, QN], opart [KS_O, H] float32; act [INTER] bf16; bar: one int32 counter
    # (zero at launch); weights stacked by layer.
    pid = tl.program_id(0)
    wq = w_qkv
    w, u = _first_tiles(wq, pid, QN, H, KS_Q, TPI_Q, KC_Q, BLOCK_N, BLOCK_K, NP, False)
    for layer in range(n_layers):
        lay = tl.full([], layer, tl.int64)
        wq = w_qkv + lay * QN * H
        wo = w_o + lay * H * QD
        wg = w_gu + lay * 2 * INTER * H
        wd = w_d + lay * H * INTER
        r_in = r_ptr + (layer % 2) * H
        r_out = r_ptr + ((layer + 1) % 2) * H
        base = layer * 4 * NP
        # 1. qkv of RMSNorm(r + Σ down partials)
        inv1 = _inv_rms(H, r_in, dpart, KS_D, dpart, 0, eps, BLOCK_K)
        _phase(wq, w, u, pid, QN, H, KS_Q, TPI_Q, KC_Q, BLOCK_N, BLOCK_K, NP, False,
               r_in, True, dpart, KS_D, H, dpart, 0, H, nw1 + lay * H, True, inv1, qpart)
        w, u = _first_tiles(wo, pid, H, QD, KS_O, TPI_O, KC_O, BLOCK_N, BLOCK_K, NP, False)
        _barrier(bar_ptr, base + NP, BARRIERS)
        # 2. o of q (Σ qkv partials, the first QD columns)
        _phase(wo, w, u, pid, H, QD, KS_O, TPI_O, KC_O, BLOCK_N, BLOCK_K, NP, False,
               qpart, False, qpart, KS_Q, QN, qpart, 0, QN, nw1, False, 1.0, opart)
        w, u = _first_tiles(wg, pid, INTER, H, 1, TPI_G, KC_G, BN_G, BLOCK_K, NP, True)
        _barrier(bar_ptr, base + 2 * NP, BARRIERS)
        # 3. SiLU(gate) · up of RMSNorm(x2), x2 = r + Σ down partials + Σ o partials
        inv2 = _inv_rms(H, r_in, dpart, KS_D, opart, KS_O, eps, BLOCK_K)
        if pid == 0:
            for k0 in tl.static_range(0, H, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x2 = _x_tile(cols, H, r_in, True, dpart, KS_D, H, opart, KS_O, H, nw2, False, 1.0)
                tl.store(r_out + cols, x2.to(r_out.dtype.element_ty), mask=cols < H)
        _phase(wg, w, u, pid, INTER, H, 1, TPI_G, KC_G, BN_G, BLOCK_K, NP, True,
               r_in, True, dpart, KS_D, H, opart, KS_O, H, nw2 + lay * H, True, inv2, act)
        w, u = _first_tiles(wd, pid, H, INTER, KS_D, TPI_D, KC_D, BLOCK_N, BLOCK_K, NP, False)
        _barrier(bar_ptr, base + 3 * NP, BARRIERS)
        # 4. down of act
        _phase(wd, w, u, pid, H, INTER, KS_D, TPI_D, KC_D, BLOCK_N, BLOCK_K, NP, False,
               act, True, act, 0, H, act, 0, H, nw1, False, 1.0, dpart)
        nq = tl.full([], tl.minimum(layer + 1, n_layers - 1), tl.int64)
        w, u = _first_tiles(w_qkv + nq * QN * H, pid, QN, H, KS_Q, TPI_Q, KC_Q, BLOCK_N,
                            BLOCK_K, NP, False)
        _barrier(bar_ptr, base + 4 * NP, BARRIERS)


def _balance(items: int, programs: int) -> float:
    """Mean work of a program over the most any program gets."""
    return items / (programs * -(-items // programs))


def split_for(n: int, k: int, programs: int, block_n: int, block_k: int, max_split: int = 8):
    """(K slices, tiles a slice, slice length): the split whose items fall most evenly on the
    programs (the fewest slices among equals)."""
    best = None
    for ks in range(1, max_split + 1):
        balance = _balance(-(-n // block_n) * ks, programs)
        if best is None or balance > best[0] + 0.02:
            best = (balance, ks)
    ks = best[1]
    chunk = -(-k // ks)
    return ks, -(-chunk // block_k), chunk


class PersistentLayers:
    """The weights of `layers` layers of a shape and the launch of the persistent kernel."""

    def __init__(self, h: int, q_dim: int, qkv_n: int, inter: int, layers: int, device,
                 programs: int, block_n: int = 16, block_k: int = 512, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)
        self.h, self.q_dim, self.qkv_n, self.inter, self.layers = h, q_dim, qkv_n, inter, layers
        self.w_qkv = rand(layers, qkv_n, h, scale=h ** -0.5)
        self.w_o = rand(layers, h, q_dim, scale=q_dim ** -0.5)
        self.w_gu = rand(layers, 2 * inter, h, scale=h ** -0.5)
        self.w_d = rand(layers, h, inter, scale=inter ** -0.5)
        self.nw1 = 1 + rand(layers, h, scale=0.1)
        self.nw2 = 1 + rand(layers, h, scale=0.1)
        self.eps = 1e-6
        self.device, self.programs = device, programs
        self.barriers = True  # False: no phase waits for the last (wrong results, speed only)
        self.r = torch.zeros(2, h, dtype=torch.bfloat16, device=device)
        self.act = torch.zeros(inter, dtype=torch.bfloat16, device=device)
        self.bar = torch.zeros(1, dtype=torch.int32, device=device)
        self.configure(block_n, block_k)

    def configure(self, block_n: int, block_k: int, num_warps: int = 8) -> None:
        """Tile sizes, and from them each product's K split and the partials' buffers."""
        h, programs = self.h, self.programs
        self.block_n, self.block_k, self.num_warps = block_n, block_k, num_warps
        self.q = split_for(self.qkv_n, h, programs, block_n, block_k)
        self.o = split_for(h, self.q_dim, programs, block_n, block_k)
        self.d = split_for(h, self.inter, programs, block_n, block_k)
        # gate/up: no K split (SiLU · up needs whole sums); 16 or 8 rows an item
        gate = max((16, 8), key=lambda bn: _balance(-(-self.inter // bn), programs)
                   + (bn == 16) * 0.02)
        self.g = (1, -(-h // block_k), h, gate)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.dpart = torch.zeros(self.d[0], h, **f32)
        self.qpart = torch.zeros(self.q[0], self.qkv_n, **f32)
        self.opart = torch.zeros(self.o[0], h, **f32)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.w_qkv, self.w_o, self.w_gu, self.w_d))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x [h] through every layer; returns the residual stream after the last."""
        self.r[0].copy_(x)
        self.dpart.zero_()
        self.bar.zero_()
        _layers_kernel[(self.programs,)](
            self.r, self.dpart, self.qpart, self.opart, self.act, self.bar, self.w_qkv, self.w_o,
            self.w_gu, self.w_d, self.nw1, self.nw2, self.eps, self.layers,
            H=self.h, QN=self.qkv_n, QD=self.q_dim, INTER=self.inter,
            KS_Q=self.q[0], TPI_Q=self.q[1], KC_Q=self.q[2],
            KS_O=self.o[0], TPI_O=self.o[1], KC_O=self.o[2],
            TPI_G=self.g[1], KC_G=self.g[2], BN_G=self.g[3],
            KS_D=self.d[0], TPI_D=self.d[1], KC_D=self.d[2],
            BLOCK_N=self.block_n, BLOCK_K=self.block_k, NP=self.programs,
            BARRIERS=self.barriers, num_warps=self.num_warps)
        return self.r[self.layers % 2].float() + self.dpart.sum(0)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic in float32 PyTorch (the residual stream and act rounded to bf16
        where the kernel stores them)."""
        r, d = x.float(), torch.zeros(self.h, device=x.device)

        def norm(v, w):
            return v * torch.rsqrt(v.pow(2).mean() + self.eps) * w.float()
        for i in range(self.layers):
            x1 = r + d
            qkv = self.w_qkv[i].float() @ norm(x1, self.nw1[i])
            x2 = x1 + self.w_o[i].float() @ qkv[:self.q_dim]
            gu = self.w_gu[i].float() @ norm(x2, self.nw2[i])
            act = (torch.nn.functional.silu(gu[:self.inter]) * gu[self.inter:]).bfloat16().float()
            r, d = x2.bfloat16().float(), self.w_d[i].float() @ act
        return r + d


def library_layers(p: PersistentLayers):
    """The same layers through flashdraft's kernels (norm + residual add, products, SiLU · up),
    as the model runs them; returns a function of x [1, 1, h]."""
    def linear(w):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device,
                              dtype=w.dtype)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        return lin
    layers = [(linear(p.w_qkv[i]), linear(p.w_o[i]), linear(p.w_gu[i]), linear(p.w_d[i]),
               p.nw1[i], p.nw2[i]) for i in range(p.layers)]

    def run(x):
        residual, delta = x.clone(), None
        for qkv_l, o_l, gu_l, d_l, nw1, nw2 in layers:
            h = kernels.rms_norm(residual if delta is None else delta, nw1, p.eps,
                                 None if delta is None else residual)
            qkv = kernels.linear(h, qkv_l)
            o = kernels.linear(qkv[..., :p.q_dim], o_l)
            h2 = kernels.rms_norm(o, nw2, p.eps, residual)
            delta = kernels.linear(kernels.silu_mul(kernels.linear(h2, gu_l)), d_l)
        return residual + delta
    return run


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["qwen2.5-1.5b", "qwen3-8b"])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    ap.add_argument("--tiles", nargs="+", default=[(16, 512, 8), (16, 1024, 8), (32, 512, 8)],
                    type=lambda v: tuple(int(x) for x in v.split("x")),
                    help="weight tiles of the persistent kernel: ROWSxCOLSxWARPS ...")
    ap.add_argument("--out", default="persistent-out")
    args = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"gpu": torch.cuda.get_device_name(), "programs": programs, "shapes": {}}
    for name in args.shape:
        cfg = get_shape(name)
        q_dim = cfg.num_heads * cfg.head_dim
        qkv_n = q_dim + 2 * cfg.num_kv_heads * cfg.head_dim
        p = PersistentLayers(cfg.hidden_size, q_dim, qkv_n, cfg.intermediate_size, cfg.num_layers,
                             "cuda", programs)
        x = torch.randn(cfg.hidden_size, device="cuda").bfloat16()
        want = p.reference(x)
        ideal_us = p.weight_bytes() / args.bandwidth * 1e6 / cfg.num_layers
        row = {"layers": cfg.num_layers,
               "weight_mb_per_layer": p.weight_bytes() / cfg.num_layers / 1e6,
               "ideal_us_per_layer": ideal_us, "persistent": []}
        lib = library_layers(p)
        lib_x = x.view(1, 1, -1)
        row["library_rel_error"] = float((lib(lib_x).float().view(-1) - want).norm() / want.norm())
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            lib(lib_x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            lib(lib_x)
        row["library_us_per_layer"] = time_ms(graph.replay) * 1e3 / cfg.num_layers
        print(f"{name}: {row['weight_mb_per_layer']:.1f} MB a layer, their time at "
              f"{args.bandwidth / 1e12:.2f} TB/s {ideal_us:.1f} us; flashdraft's kernels "
              f"{row['library_us_per_layer']:.1f} us/layer "
              f"({100 * ideal_us / row['library_us_per_layer']:.0f}%, rel. error "
              f"{row['library_rel_error']:.1e})", flush=True)
        del graph
        for block_n, block_k, warps in args.tiles:
            p.configure(block_n, block_k, warps)
            got = p.run(x)
            err = float((got - want).norm() / want.norm())
            stuck = int(p.bar.item()) != 4 * cfg.num_layers * programs
            us = time_ms(functools.partial(p.run, x)) * 1e3 / cfg.num_layers
            run = {"block_n": block_n, "block_k": block_k, "num_warps": warps,
                   "us_per_layer": us, "rel_error": err, "barrier_gave_up": stuck,
                   "splits": {"qkv": p.q, "o": p.o, "gate_up": p.g, "down": p.d}}
            p.barriers = False
            run["us_per_layer_without_barriers"] = (time_ms(functools.partial(p.run, x)) * 1e3
                                                    / cfg.num_layers)
            p.barriers = True
            row["persistent"].append(run)
            print(f"  persistent, tiles {block_n}x{block_k}, {warps} warps: {us:.1f} us/layer "
                  f"({100 * ideal_us / us:.0f}%; without the barriers' waits, wrong results: "
                  f"{run['us_per_layer_without_barriers']:.1f}), rel. error {err:.1e}"
                  f"{', A BARRIER GAVE UP' if stuck else ''}; splits {run['splits']}", flush=True)
        results["shapes"][name] = row
        del p, lib
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "persistent_layer.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
