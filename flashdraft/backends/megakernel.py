"""A whole decode step of a small dense model in one persistent CUDA kernel (`csrc/decode_mk.cu`).

Measurement first (issue 5: the real 1.5B decodes at ~52 % of its memory roofline, its step
being ~150 kernels whose fixed costs cost as much as its weight bytes). One block a
multiprocessor runs every layer; a producer warp streams the block's rows of every matrix into
a ring of shared memory while the consumer warps wait for the rest of the GPU between ops, so
the weight stream never waits for the activations. `benchmarks/megakernel_step.py` times it
against the model's CUDA-graph step in one process; `tests/test_megakernel.py` checks its
logits and tokens against `Transformer.forward` on the GPU.

Weights: bfloat16 with the block norms folded into the products, or int4 in flashdraft.backends.mma's
layout (every product and the head, `is_int4`; `quantization="int4"` on a Hopper GPU), whose
norms the kernel applies itself (decode_mk.cu's Q4).

In the engine it runs the greedy one-token steps of a draft model wherever it can (the
default, `--decode-kernel auto`: drafts only propose, so the output is the same) and, opted
in (`--decode-kernel megakernel`), those of plain decoding too (requests without a drafter,
`Engine(decode_kernel=...)`); every other step stays on the CUDA graphs. Its reductions are
not the skinny kernel's, so its tokens can differ from the graph path's where two logits
nearly tie, and speculative verification (T > 1) has no megakernel:
speculation reproduces the graph path's plain decoding, not this kernel's.

    mk = DecodeMegakernel(model, cache)      # a folded bf16 Qwen2/Qwen3/Llama model, CUDA,
                                             # or one whose products and head are int4 (mma)
    logits, token = mk.step(token, position)  # int64 tensors [1] on the device, in and out
    mk.start(token, position); mk.launch(); mk.launch()  # chained: each step leaves its token
                                                          # and the next position as inputs
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import mma
from ..kv_cache import KVCache
from ..model import Transformer

SOURCE = Path(__file__).with_name("csrc") / "decode_mk.cu"


class DoesNotFit(ValueError):
    """A kernel configuration that needs more shared memory a block than this GPU allows."""


class _NoRoom(str):
    """unsupported()'s reason when only shared memory is short (the constructor raises
    DoesNotFit for it: a smaller ring or fewer warps would fit)."""

# The ring of shared-memory slots a block is "SLOTSxBYTES" (DecodeMegakernel's `ring`, else
# default_ring, the measured choice for the shape).
CONSUMER_WARPS = 8  # bfloat16 takes rows in chunks of 8 warps
# bfloat16's consumer warps: 8, or 9 for slots of 9 rows (8x27648 on the 1.5B: 12.5 % more ring
# than 8x24576 with 2 chunks still in flight; decode_mk.cu's rows_per_chunk takes 9, 3 or 1)
BF16_WARPS = (CONSUMER_WARPS, 9)
# int4: 12 consumer warps (128 registers a thread); 1-5 % faster a step than 8 warps on the
# 0.5B, 1.5B, 8B and 32B shapes (benchmarks/RESULTS.md)
Q4_CONSUMER_WARPS = 12
# decode_mk.cu's layouts read here: TRACE's times an op (consumer, producer), XO_ROWS
TRACE_CONSUMER, TRACE_PRODUCER = 8, 2
XO_ROWS = 66
RED_ROWS = 64  # decode_mk.cu's default: rows of x a block writes at most (a define may lower it)
# bfloat16's flags by default (default_flags), for hidden sizes up to BF16_LLA_MAX_H: LLA 4, O
# polls attention's output by its flags instead of its counter, and where LLX runs (a warp a
# row) LLA 1 and LLX too: attention polls q/k/v, and QKV, gate/up and the head poll x. Measured
# in one call, each twice (ms a step, LLA 4 against 0): the 1.5B 1.010 / 1.031 at 512 positions
# and 1.128 / 1.157 at 4,096, the 0.5B 0.561 / 0.585 and 0.656 / 0.675; the 8B (hidden 4,096)
# 3.852 / 3.846 at 512 and 4.553 / 4.505 at 4,096, so it keeps the counters. Measured (H100,
# one call, each twice, the same logits bit for bit; LLA 5 and LLX against LLA 4): the 1.5B
# 1.197 / 1.199 against 1.226 / 1.225 at 512 and 1.321 / 1.327 against 1.346 / 1.344 at 4,096,
# the 0.5B 0.555 / 0.550 against 0.585 / 0.590 and 0.653 / 0.639 against 0.675 / 0.677 (LLX
# alone took about half of that on the 1.5B; LLA 7 lost at 4,096); on the H200 the 1.5B 1.002 /
# 1.004 against 1.017 / 1.010 and the 0.5B 0.529 / 0.532 against 0.563 / 0.561 at 512.
BF16_LLA, BF16_LLA_MAX_H, BF16_LLA_LLX = 4, 2048, 5
# bfloat16's attention rounds by default (default_att_ks): BF16_ATT_KS positions a round, not
# decode_mk.cu's 8, on models of BF16_ATT_KS_MIN_KV kv heads or more, whose units are long (at
# most a block a unit: 132 / 8 = 16 units a head, 256 positions a unit at 4,096), so two rounds
# of 8 in flight left attention waiting on the round trip. Measured (H100, one call, ms a
# step): the 8B 5.796 / 5.791 -> 5.523 at 4,096 positions, 5.162 / 5.156 -> 5.137 at 512 (32 in a
# 5-slot ring: 5.967 against 16's 5.975); the 1.5B (2 kv heads, 62 positions a unit) lost,
# 1.225 -> 1.241 at 512 and 1.343 -> 1.365 at 4,096, so it keeps 8.
BF16_ATT_KS, BF16_ATT_KS_MIN_KV = 16, 8
ATT_SPLITS = 64  # decode_mk.cu's: units a kv head whose partials attention's merge space holds
Q4_UNIT, SIDE_MAX = 1088, 256  # Q4: bytes a (tile, group) unit; bias/residual rows a block
HOPPER_SHARED = 227 * 1024 - 1024  # mma.shared_limit on an H100 / H200


def _nops(cfg) -> int:
    """Ops of a step: 5 a layer and the head (decode_mk.cu's NOPS)."""
    return 5 * cfg.num_layers + 1


def _products(model: Transformer) -> list:
    return [lin for block in model.layers for lin in (block.attn.wqkv, block.attn.wo,
                                                      block.mlp.w_gate_up, block.mlp.w_down)]


def is_int4(model: Transformer) -> bool:
    """Whether the model's products and head are int4 in flashdraft.backends.mma's layout (Q4)."""
    return all(getattr(lin, "mode", None) == "int4" and getattr(lin, "backend", None) == "mma"
               for lin in _products(model) + [model.lm_head])


def unsupported(model: Transformer, cache: KVCache | None = None,
                ring: str | None = None, red_rows: int = RED_ROWS) -> str | None:
    """Why the megakernel cannot run this model (and cache, when given), or None when it can
    (red_rows: decode_mk.cu's RED_ROWS, as shared_bytes)."""
    cfg = model.cfg
    device = model.embed.weight.device
    why = mma.unavailable(device, model.embed.weight.dtype)
    if why:
        return why
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "it needs an sm_90 (Hopper) or newer GPU (bulk copies and mbarriers)"
    if cfg.head_dim not in (64, 128):
        return f"head_dim {cfg.head_dim} (the kernel takes 64 or 128)"
    h, inter = cfg.hidden_size, cfg.intermediate_size
    if h % 8 or inter % 8:  # (the q width: heads of 64 or 128)
        return (f"hidden size {h}, intermediate size {inter}: the kernel reads rows in "
                f"16-byte pieces (multiples of 8)")
    q4 = is_int4(model)
    limit = mma.shared_limit(_device_index(device))
    ring = ring or default_ring(cfg, q4, limit=limit)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < cfg.num_kv_heads:  # attention: a block at least a kv head
        return f"{cfg.num_kv_heads} kv heads on {sms} multiprocessors (a block a kv head at least)"
    why = _why_not_int4(model, sms) if q4 else _why_not_bf16(model, _ring(ring)[1])
    if why:
        return why
    need = shared_bytes(cfg, ring, q4=q4, defines={"RED_ROWS": red_rows})
    if need > limit:  # e.g. GPUs of ~100 KB a block
        return _NoRoom(f"it needs {need} bytes of shared memory a block, the GPU allows "
                       f"{limit} (DecodeMegakernel(ring=...): a smaller ring)")
    if cache is not None and (cache.kv.shape[2] != 1 or cache.kv.dtype != torch.bfloat16):
        return "the cache must hold one bfloat16 sequence"
    rows, most = _rows_a_block(cfg.hidden_size, sms), min(red_rows, RED_ROWS)
    if rows > most:
        return (f"hidden size {cfg.hidden_size} over {sms} multiprocessors: {rows} rows a block, "
                f"at most {most}")
    return None


def _why_not_bf16(model: Transformer, slot: int) -> str | None:
    cfg = model.cfg
    for lin in _products(model):
        if type(lin) is not torch.nn.Linear or not lin.weight.is_contiguous():
            return ("every product must be a contiguous bfloat16 nn.Linear, or all of them and "
                    "the head int4 (mma backend)")
    if not model.norms_folded:
        return "the model's block norms must be folded into its products (Transformer.fold_norms)"
    h, inter, qd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    if 2 * max(h, qd, inter) > slot:
        return (f"hidden size {h}, q width {qd}, intermediate size {inter}: a row of each must "
                f"fit a {slot}-byte slot (DecodeMegakernel(ring=...))")
    return None


def _why_not_int4(model: Transformer, sms: int) -> str | None:
    cfg = model.cfg
    if not all(block.mlp.w_gate_up.gated_layout for block in model.layers):
        return ("int4: the MLP's [gate; up] must be stored gated (quant.quantize_linear of "
                "w_gate_up)")
    if any(lin.bias is not None for block in model.layers
           for lin in (block.attn.wo, block.mlp.w_gate_up, block.mlp.w_down, model.lm_head)):
        return "int4: only the q/k/v product may have a bias"
    qkv = cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
    rows = 16 * max(-(-(n // 16) // sms) for n in (qkv, cfg.hidden_size))  # whole tiles
    if rows > SIDE_MAX:
        return f"int4: {rows} rows of a bias or residual a block (at most {SIDE_MAX})"
    return None


def why_not(model: Transformer, device) -> str | None:
    """Why the kernel cannot run `model` on `device` (any device), or None when it can."""
    return (unsupported(model) if torch.device(device).type == "cuda"
            else f"it needs CUDA (device {device})")


def refuse_unsupported(model: Transformer, device, role: str = "this model") -> None:
    """For `--decode-kernel megakernel`: raise a user's error naming why the kernel cannot
    run `model` (`role`: which model, in the message) on `device`."""
    why = why_not(model, device)
    if why:
        raise ValueError(f"--decode-kernel megakernel cannot run {role}: {why}; "
                         f"use --decode-kernel auto (the default) or graph")


def default_warps(q4: bool) -> int:
    """Consumer warps a block unless asked otherwise: Q4_CONSUMER_WARPS for int4, else 8."""
    return Q4_CONSUMER_WARPS if q4 else CONSUMER_WARPS


def default_flags(cfg, ring: str, warps: int = CONSUMER_WARPS) -> dict[str, int]:
    """bfloat16's flagged dependencies (LLA, LLX) beside `ring`, where the caller names none:
    BF16_LLA_LLX and LLX where the hidden size is at most BF16_LLA_MAX_H and LLX runs,
    BF16_LLA alone where it does not, else the counters (LLA 0)."""
    if cfg.hidden_size > BF16_LLA_MAX_H:
        return {"LLA": 0}
    llx = _llx_runs(cfg, _ring(ring)[1], warps)
    return {"LLA": BF16_LLA_LLX, "LLX": 1} if llx else {"LLA": BF16_LLA}


def _llx_runs(cfg, slot: int, warps: int = CONSUMER_WARPS) -> bool:
    """LLX takes a warp a row in QKV, O, gate/up and the head: a row of the hidden size and of
    the query width in a slot for each consumer warp."""
    rows = min(rows_per_chunk(cfg.hidden_size, slot, warps),
               rows_per_chunk(cfg.num_heads * cfg.head_dim, slot, warps))
    return rows >= warps


def default_att_ks(cfg, ring: str, defines: dict[str, int], limit: int = HOPPER_SHARED) -> int:
    """bfloat16's ATT_KS when the caller names none: BF16_ATT_KS on models of
    BF16_ATT_KS_MIN_KV kv heads or more where it fits `limit` beside `ring` and `defines`, else
    0 (decode_mk.cu's 8)."""
    if cfg.num_kv_heads < BF16_ATT_KS_MIN_KV:
        return 0
    fits = shared_bytes(cfg, ring, defines=defines | {"ATT_KS": BF16_ATT_KS}) <= limit
    return BF16_ATT_KS if fits else 0


def default_ring(cfg, q4: bool = False, warps: int | None = None,
                 limit: int = HOPPER_SHARED) -> str:
    """The ring measured best for the shape.

    bfloat16: 8 slots of 24 KB; 6 of 32 KB where a 24 KB slot takes only two
    thirds of its bytes in rows of the hidden size and the step reads 2 GB of weights or more,
    so the weight stream dominates (Qwen3-8B: 3.98 instead of 4.06 ms a step; the
    latency-bound Qwen3-0.6B, whose rows fill a 24 KB slot alike, stays faster with 24 KB
    slots: 0.696 against 0.712 ms). Where a row of the widest matrix does not fit such a slot
    (the 32B's intermediate size 25,600: 51,200 bytes), as many slots of one such row as fit
    `limit` (the 32B: 4x51200).

    int4 (q4): as many slots of (tile, group) units, up to 7, as fit `limit` bytes of shared
    memory (the GPU's: mma.shared_limit; default a Hopper block's) beside the rest, a slot's
    units a multiple of the consumer warps (`warps`, default_warps), so that none idles while
    the slot is held (8 warps: 24 units 8.11 ms a Qwen3-32B step,
    22 units 8.61). 3 units a warp where the step reads 2 GB of int4 weights or more (12 warps: 36 units 7.31-7.39 ms against 24 units 7.70-7.79 on the 32B; 1.985 against
    2.007 ms on the 8B), else 24 units (2 a warp: the 1.5B and smaller keep more slots)."""
    h, qd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kvd, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    weights = 2 * (cfg.num_layers * h * (qd + 2 * kvd + qd + 3 * inter)
                   + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2))
    if q4:
        warps = warps or default_warps(True)
        # int4 bytes: 4 bits and 4 bytes of scale and zero a group of 128 (17 / 64 of bf16's)
        slot = (3 * warps if weights * 17 / 64 >= 2e9 else 24) * Q4_UNIT
        # at most 7: 8 slots of 24 units were slower where they fit (the 0.5B: 0.517 against
        # 0.462 ms a step at 7 with ATT_MIN 8)
        return _most_slots(cfg, slot, 7, limit, q4=True, warps=warps)
    filled = rows_per_chunk(h, 24576) * 2 * h / 24576
    ring = "6x32768" if filled < 0.75 and weights >= 2e9 else "8x24576"
    widest = 2 * max(h, qd, inter)  # bytes of the longest row: a slot holds one at least
    if widest <= _ring(ring)[1]:
        return ring
    # slots of a whole widest row (the 32B's 25,600-wide down rows: 50 KB), as many as fit
    return _most_slots(cfg, -(-widest // 1024) * 1024, 8, limit)


def _most_slots(cfg, slot: int, most: int, limit: int, **kw) -> str:
    """The ring of as many `slot`-byte slots, 2 to `most`, as fit `limit` bytes of shared
    memory beside the rest (shared_bytes; `kw`: its q4 and warps); 2 where none fits (then
    `unsupported` names the shortfall)."""
    fits = [n for n in range(2, most + 1) if shared_bytes(cfg, f"{n}x{slot}", **kw) <= limit]
    return f"{max(fits) if fits else 2}x{slot}"


def default_finish_every(cfg, ring: str, warps: int | None = None,
                         limit: int = HOPPER_SHARED, halves: bool = False) -> int:
    """int4: chunks between two additions of the tiles they ended (decode_mk.cu's
    Q4_FINISH_EVERY; each addition is a barrier of the block's consumer warps), the most of 8,
    6, 3 and 1 whose tile sums fit beside `ring` in `limit` bytes (as default_ring; `halves`:
    with Q4_PARTS's tile). Measured, the 32B at 4x39168: 7.33-7.43 ms a step at 1, 7.14 at
    3, 7.02-7.11 at 6, 6.94-6.98 at 8."""
    return next(m for m in (8, 6, 3, 1)
                if m == 1 or shared_bytes(cfg, ring, q4=True, warps=warps,
                                          defines={"Q4_FINISH_EVERY": m, "Q4_PARTS": halves})
                <= limit)


def splits_tiles_in_halves(cfg, sms: int) -> bool:
    """int4: whether O's and DOWN's tiles (hidden size / 16 of them) leave a remainder over
    `sms` blocks that decode_mk.cu's Q4_PARTS splits in halves (a whole tile a block at least,
    the rest on at most half the blocks), where it runs by default: the 32B's 320 tiles on 132
    blocks, 2 or 3 each without it (6.410 → 6.264 ms a step)."""
    tiles = cfg.hidden_size // 16
    return tiles >= sms and 0 < tiles % sms <= sms // 2


def _rows_a_block(n: int, sms: int) -> int:
    """Rows of an n-row op a block writes at most: decode_mk.cu's rows_of share (with row
    pairs, as LLX, LLA and LLH take them, never fewer than without)."""
    return 2 * -(-(n // 2) // sms)


def xo_rows(cfg, sms: int, defines: dict[str, int]) -> int:
    """decode_mk.cu's XO_ROWS for these settings on `sms` blocks: the most rows a block writes
    with their flags (in pairs: x's with LLX, q/k/v's with LLA 1, h's with LLH), at least the
    kernel's default."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return max([XO_ROWS] + [_rows_a_block(n, sms) for n, on in (
        (cfg.hidden_size, defines.get("LLX", 0)), (qkv, defines.get("LLA", 0) & 1),
        (cfg.intermediate_size, defines.get("LLH", 0))) if on])


def rows_per_chunk(k: int, slot: int, warps: int = CONSUMER_WARPS) -> int:
    """decode_mk.cu's rows_per_chunk: rows of k bfloat16 a slot, the most up to 16 that fit
    and that `warps` consumer warps take evenly (a multiple or a divisor of them: with 8, the
    powers of two; 0: not one row fits)."""
    return next((r for r in range(16, 0, -1)
                 if 2 * k * r <= slot and (r % warps == 0 or warps % r == 0)), 0)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def shared_bytes(cfg, ring: str, q4: bool = False, warps: int | None = None,
                 defines: dict[str, int] | None = None) -> int:
    """Dynamic shared memory a block of the kernel takes: the ring, then decode_mk.cu's Shared
    (mbarriers, sums: DOWN's of RED_ROWS rows; with LLX, LLA or LLH, the rows going out
    (XO_ROWS); with Q4, the tiles' warp sums (Q4_FINISH_EVERY's), one more tile's with
    Q4_PARTS, x's group sums and the side rows), whose attention state (ATT_KS) shares its
    space with Q4's staged x and with LLX's or LLA's polled input. `defines`: the kernel's
    settings that size it, where not the defaults."""
    d = defines or {}
    slots, slot = _ring(ring)
    warps = warps or default_warps(q4)
    h, qd, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    llx, lla = d.get("LLX", 0), d.get("LLA", 0)
    outgoing = llx or lla & 1 or d.get("LLH", 0)  # Shared.xo: flagged rows before they go out
    struct = (16 * slots + 4 * d.get("RED_ROWS", RED_ROWS) * warps + 4 * 3 * warps + 8 * warps
              + 16 + (2 * d.get("XO_ROWS", XO_ROWS) if outgoing else 0))
    attention = _attention_bytes(cfg, q4, warps, d.get("ATT_KS", 0))
    if llx or lla & 4:  # Shared.u.xs: x's or att's bf16, as polled
        attention = max(attention, 2 * (max(h, qd) if lla & 4 else h))
    if q4:
        units = slot // Q4_UNIT
        every = d.get("Q4_FINISH_EVERY", 1)
        tiles = 2 * (every * units // (min(h, qd, inter) // 128)) + 4  # decode_mk.cu's RT
        tiles += int(bool(d.get("Q4_PARTS", 0)))
        struct += (4 * tiles * warps * 16 + 4 * max(h, qd, inter) // 128
                   + 2 * SIDE_MAX + 16)
        attention = max(attention, 2 * max(h, qd, inter))
    return slots * slot + struct + attention + 128


def attention_ks(cfg, q4: bool, att_ks: int = 0) -> int:
    """decode_mk.cu's KS: positions a round of attention's staged keys and values (att_ks:
    ATT_KS; else int4, whose product x shares the space, the most up to 32 that fit beside it;
    else 8)."""
    kmax = max(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    ks = 8
    while ks < 32 and 16 * ks * cfg.head_dim <= (2 * kmax if q4 else 0):
        ks *= 2
    return att_ks or ks


def _attention_bytes(cfg, q4: bool, warps: int, att_ks: int = 0) -> int:
    """decode_mk.cu's AttState: keys and values staged in 2 buffers of KS positions, or the
    merge's loads of up to ATT_SPLITS units' partials, whichever is larger."""
    group, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    wh = _warps_a_head(cfg, warps)
    merge = wh * (4 * group * hd + 16 * ATT_SPLITS) + 8 * wh * group * ATT_SPLITS
    return max(8 * attention_ks(cfg, q4, att_ks) * hd, merge)


def attention_units(cfg, p: int, sms: int, q4: bool = False,
                    warps: int | None = None) -> list[tuple[int, int]]:
    """decode_mk.cu's attention_split at position p: a kv head's units as positions [j0, j1),
    ceil((p + 1) / nsplit) each, at least ATT_MIN (the kernel's default) and at most as many
    units as the merge's space holds; rounded up, the last units may start past p (none)."""
    warps = warps or default_warps(q4)
    group, wh = cfg.num_heads // cfg.num_kv_heads, _warps_a_head(cfg, warps)
    att_min = 8 if 3 * group * wh < 2 * warps else 16
    most = ((_attention_bytes(cfg, q4, warps) // wh - 4 * group * cfg.head_dim)
            // (16 + 8 * group))
    nsplit = max(1, min(sms // cfg.num_kv_heads, most, (p + att_min) // att_min))
    ch = (p + nsplit) // nsplit
    return [(sp * ch, min(p + 1, sp * ch + ch)) for sp in range(nsplit)]


def _warps_a_head(cfg, warps: int) -> int:
    """decode_mk.cu's WH: attention's warps a query head (each its own partial)."""
    group = cfg.num_heads // cfg.num_kv_heads
    return warps // group if group <= warps else 1


def _ring(ring: str) -> tuple[int, int]:
    try:
        slots, slot = (int(v) for v in ring.lower().split("x"))
    except ValueError:
        raise ValueError(f"ring {ring!r}: write SLOTSxBYTES, "
                         f"e.g. 8x24576") from None
    if slots < 2 or slot % 16 or slot < 1024:
        raise ValueError(f"ring {ring!r}: 2 or more slots of a multiple "
                         f"of 16 bytes")
    return slots, slot


class _Args(ctypes.Structure):  # decode_mk.cu's Args, field for field
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "table", "embed", "head", "fnorm", "qknorm", "inv_freq", "kv", "token", "pos", "x",
        "qkv", "att", "hbuf", "part", "logits", "best", "counters", "out_token", "error", "trace",
        "step_count")] + [
        ("max_len", ctypes.c_int), ("eps", ctypes.c_float), ("chain", ctypes.c_int),
        ("head_sz", ctypes.c_void_p), ("xpart", ctypes.c_void_p)]


@functools.cache
def _kernel(defines: tuple[tuple[str, int], ...], device: int):
    options = [f"-D{k}={v}" for k, v in defines]
    try:
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(mma.cuda_source(SOURCE), "decode_step",
                                              nvcc_options=options)
    except Exception as err:
        raise RuntimeError(f"compiling {SOURCE.name} with NVRTC failed: {err}") from err


class DecodeMegakernel:
    """One decode step of `model` (one sequence, one token) as one kernel launch."""

    def __init__(self, model: Transformer, cache: KVCache, ring: str | None = None,
                 probe: str = "", ldgsts: bool = True, producers: int | None = None,
                 defines: dict[str, int] | None = None, consumer_warps: int | None = None):
        """ring: "SLOTSxBYTES" (default: default_ring); probe: "nowait" (measurement
        only, wrong output: no op waits for the one before, the weight stream's own speed;
        "nocompute": the consumers multiply nothing; both: "nowait,nocompute"); ldgsts: the
        producer warps copy with cp.async, 16 bytes a lane (default, measured faster than one
        warp's bulk copies: benchmarks/RESULTS.md), else one bulk copy a chunk;
        producers: producer warps (default 4, at most the ring's slots); defines: more of
        decode_mk.cu's compile-time settings (measurement: TRACE, LLX, PU, ATT_MIN, ...; int4
        takes Q4_FINISH_EVERY from default_finish_every unless they set it); consumer_warps:
        default_warps; for int4 1 to 16 (more warps multiplying, fewer registers a thread: 12
        give 128), for bfloat16 BF16_WARPS (9 for a ring whose slots hold 9 rows)."""
        red_rows = (defines or {}).get("RED_ROWS", RED_ROWS)
        lla = (defines or {}).get("LLA", 0)
        if lla not in range(8):
            raise ValueError(f"LLA {lla!r}: 0 to 7, bits of what carries its writer's flag "
                             f"(1 q/k/v, 2 attention's partials, 4 its output)")
        why = unsupported(model, cache, ring, red_rows)
        if why:
            error = DoesNotFit if isinstance(why, _NoRoom) else ValueError
            raise error(f"the decode megakernel cannot run this model: {why}")
        cfg = model.cfg
        self.model, self.cache, self.cfg = model, cache, cfg
        dev = model.embed.weight.device
        self.device = dev
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.q4 = is_int4(model)
        consumer_warps = consumer_warps or default_warps(self.q4)
        limit = mma.shared_limit(_device_index(dev))
        self.ring = ring or default_ring(cfg, self.q4, consumer_warps, limit)
        if self.q4:
            halves = splits_tiles_in_halves(cfg, self.sms)
            every = default_finish_every(cfg, self.ring, consumer_warps, limit, halves)
            defines = ({"Q4_FINISH_EVERY": every} | ({"Q4_PARTS": 1} if halves else {})
                       | (defines or {}))
        slots, slot = _ring(self.ring)
        if not self.q4:  # flagged dependencies on small models, unless the caller says
            defines = default_flags(cfg, self.ring, consumer_warps) | (defines or {})
            ks = "ATT_KS" not in defines and default_att_ks(cfg, self.ring, defines, limit)
            if ks:  # longer rounds of keys and values on models of many kv heads
                defines["ATT_KS"] = ks
        defines = defines or {}
        llx, lla, llh = bool(defines.get("LLX")), defines.get("LLA", 0), bool(defines.get("LLH"))
        # a producer waits for its slot's use a ring before, which is sound only while its own
        # previous wait (NPROD chunks earlier) covers the use before that: NPROD <= NS
        producers = producers or min(4, slots)
        if not 1 <= producers <= slots:
            raise ValueError(f"producers {producers}: 1 to the ring's {slots} slots "
                             f"({self.ring})")
        probes = set(filter(None, probe.split(",")))
        if probes - {"nowait", "nocompute"}:
            raise ValueError(f"probe {probe!r}: '', or nowait and/or nocompute")
        h, inter = cfg.hidden_size, cfg.intermediate_size
        qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        ptrs = []  # decode_mk.cu's Args.table, a layer at a time (TBL)
        for block in model.layers:
            bias = block.attn.wqkv.bias
            mats = (block.attn.wqkv, block.attn.wo, block.mlp.w_gate_up, block.mlp.w_down)
            w = [m.qweight if self.q4 else m.weight for m in mats]
            ptrs += [w[0].data_ptr(), bias.data_ptr() if bias is not None else 0,
                     w[1].data_ptr(), w[2].data_ptr(), w[3].data_ptr()]
            if self.q4:  # the scales, then the block norms' weights (not folded)
                ptrs += [m.scale.data_ptr() for m in mats]
                ptrs += [block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr()]
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        # x: bf16 rows, or with LLX (defines) 8-byte words of 2 rows and their writer's flag;
        # LLA's bits flag q/k/v (1), the partials (2, a word a float) and att (4) alike, LLH h:
        # a flagged buffer takes twice the values' room
        def room(n: int, flagged) -> int:
            return 2 * n if flagged else n
        self.x = torch.zeros(room(h, llx), **bf16)
        self.step_count = torch.zeros(1, dtype=torch.int32, device=dev)
        # Q4_PARTS: a half tile's 16 sums a pair of blocks, as (value, flag) words; O's and
        # DOWN's, then gate/up's
        self.xpart = torch.zeros(16 * self.sms, dtype=torch.int64, device=dev)
        self.qkv = torch.zeros(room(qd + 2 * kvd, lla & 1), **bf16)
        self.att = torch.zeros(room(qd, lla & 4), **bf16)
        self.hbuf = torch.zeros(room(inter, llh), **bf16)
        group = cfg.num_heads // cfg.num_kv_heads
        parts = (cfg.num_kv_heads * self.sms * _warps_a_head(cfg, consumer_warps) * group
                 * (cfg.head_dim + 2))
        self.part = torch.zeros(room(parts, lla & 2), dtype=torch.float32, device=dev)
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)
        self.best = torch.zeros(2 * self.sms, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(_nops(cfg) + cfg.num_kv_heads, dtype=torch.int32, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)
        # TRACE (measurement): the global timer at each op's wait, start and end, a block
        self.trace = (torch.zeros(self.sms * _nops(cfg) * (TRACE_CONSUMER + TRACE_PRODUCER),
                                  dtype=torch.int64, device=dev)
                      if (defines or {}).get("TRACE") else None)
        self.token_in = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos_in = torch.zeros(1, dtype=torch.int64, device=dev)
        self.token_out = torch.zeros(1, dtype=torch.int64, device=dev)
        self.fnorm = model.norm.weight.detach().to(torch.bfloat16).contiguous()
        # Qwen3's head norms, [layers][q, k][head_dim] (a placeholder without them)
        self.qknorm = (torch.stack([torch.stack([blk.attn.q_norm.weight, blk.attn.k_norm.weight])
                                    for blk in model.layers]).detach().to(**bf16).contiguous()
                       if cfg.qk_norm else torch.zeros(8, **bf16))
        self.inv_freq = model.inv_freq.float().contiguous()
        if llx and not _llx_runs(cfg, slot, consumer_warps):
            raise ValueError(f"LLX: hidden size {h} / q width {qd}: LLX takes a warp a row, "
                             f"{consumer_warps} rows of them in a {slot}-byte slot")
        if llx or lla & 1 or llh:
            defines = {"XO_ROWS": xo_rows(cfg, self.sms, defines)} | defines
        defines = (("H", h), ("INTER", inter), ("NQ", cfg.num_heads), ("NKV", cfg.num_kv_heads),
                   ("HD", cfg.head_dim), ("NL", cfg.num_layers), ("VOCAB", cfg.vocab_size),
                   ("QKV_BIAS", int(cfg.qkv_bias)), ("QK_NORM", int(cfg.qk_norm)),
                   ("NS", slots), ("SLOT", slot),
                   ("NCW", consumer_warps),
                   ("NOWAIT", int("nowait" in probes)), ("NOCOMPUTE", int("nocompute" in probes)),
                   ("LDGSTS", int(ldgsts)), ("NPROD", producers), ("Q4", int(self.q4))
                   ) + tuple(sorted((defines or {}).items()))
        self.defines = dict(defines)  # decode_mk.cu's settings as compiled
        self.producers = producers
        if self.q4 and (llx or lla or llh or not ldgsts):
            raise ValueError("int4 weights: the producers copy with cp.async (ldgsts), "
                             "no LLX, LLA or LLH")
        if not (1 <= consumer_warps <= 16 if self.q4 else consumer_warps in BF16_WARPS):
            raise ValueError(f"consumer_warps {consumer_warps}: bfloat16 takes "
                             f"{' or '.join(map(str, BF16_WARPS))}, int4 1 to 16")
        self.consumer_warps = consumer_warps
        # RED_ROWS (measurement; unsupported() checks it): DOWN's rows a block as decode_mk.cu
        # holds them; fewer make room (the 1.5B's 12 leave room for a 9th slot of 24 KB)
        self.shared = shared_bytes(cfg, self.ring, self.q4, consumer_warps, self.defines)
        if self.shared > limit:  # the flags' rows (unsupported() checks the rest)
            raise DoesNotFit(f"the megakernel needs {self.shared} bytes of shared memory a "
                             f"block, the GPU allows {limit}: use a smaller ring (ring=...) "
                             f"or fewer consumer warps")
        self.fn = _kernel(defines, self.fn_device)
        mma.allow_shared(self.fn, self.shared)
        head = model.lm_head.qweight if self.q4 else model.lm_head.weight
        self.args = _Args(
            self.table.data_ptr(), model.embed.weight.data_ptr(), head.data_ptr(),
            self.fnorm.data_ptr(), self.qknorm.data_ptr(), self.inv_freq.data_ptr(),
            cache.kv.data_ptr(),
            self.token_in.data_ptr(), self.pos_in.data_ptr(), self.x.data_ptr(),
            self.qkv.data_ptr(), self.att.data_ptr(), self.hbuf.data_ptr(), self.part.data_ptr(),
            self.logits.data_ptr(), self.best.data_ptr(), self.counters.data_ptr(),
            self.token_out.data_ptr(), self.error.data_ptr(),
            self.trace.data_ptr() if self.trace is not None else 0, self.step_count.data_ptr(),
            cache.max_len,
            float(cfg.rms_norm_eps), 0, model.lm_head.scale.data_ptr() if self.q4 else 0,
            self.xpart.data_ptr())

    @property
    def fn_device(self) -> int:
        return _device_index(self.device)

    def launch(self) -> None:
        """One step on the current stream, reading token_in and pos_in, writing logits and
        token_out (and, chained since `start`, leaving token_out and pos_in + 1 in token_in and
        pos_in). Capturable in a CUDA graph: every address is fixed."""
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(self.args), ctypes.c_void_p))
        config = mma.Launch((ctypes.c_uint * 3)(self.sms, 1, 1),
                             (ctypes.c_uint * 3)(32 * (self.consumer_warps + self.producers), 1, 1),
                             self.shared,
                             torch.cuda.current_stream(self.device).cuda_stream, None, 0)
        err = mma.launch_kernel_ex()(ctypes.byref(config), self.fn.func, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")

    def start(self, token: torch.Tensor, position: int) -> None:
        """Chain the steps from here: the next step's inputs are `token` (one int64 on the
        device) at `position`, and each step leaves its own token and the next position as the
        inputs of the one after (`chain`), so `launch()` needs nothing else. Positions stop at
        the cache's last (its caller keeps within it)."""
        if not 0 <= position < self.cache.max_len:
            raise ValueError(f"position {position} is outside the cache's {self.cache.max_len}")
        self.token_in.copy_(token.reshape(1))
        self.pos_in.fill_(position)
        self.args.chain = 1

    def step(self, token: torch.Tensor,
             position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [vocab] float32 and the greedy token [1] int64 of `token` ([1] int64) at
        `position` ([1] int64), its key and value written into the cache. The tensors returned
        are this object's buffers, overwritten by the next step. A position on the device is
        not checked (that would wait for the GPU): its caller keeps it within the cache."""
        if position.numel() != 1 or token.numel() != 1:
            raise ValueError("the megakernel decodes one token of one sequence a step")
        if not position.is_cuda and not 0 <= int(position) < self.cache.max_len:
            raise ValueError(f"position {int(position)} is outside the cache's "
                             f"{self.cache.max_len}")
        self.args.chain = 0
        self.token_in.copy_(token.reshape(1))
        self.pos_in.copy_(position.reshape(1))
        self.launch()
        return self.logits, self.token_out

    def timeline(self) -> dict:
        """TRACE: where the last step's time went, in microseconds, averaged over layers (and
        blocks where it says so). For each op kind: `wait` (a block's wait for the op before,
        mean), `latency` (the last block's end of the op before to the first block's end of
        the wait), `to_first` (end of the wait to the first weight chunk in shared memory;
        int4: `stage_load` and `stage`, from the wait's end until x is loaded and staged),
        `run` (first chunk to the op's end), `spread` (the op's last end minus its first end
        over blocks), `producer_lead` (the producer's first copy of the op before the block's
        wait ended: positive when the ring was ahead). Plus the step's span."""
        if self.trace is None:
            raise ValueError("timeline() needs the kernel built with TRACE=1 (defines)")
        nops, g = _nops(self.cfg), self.sms
        t = self.trace.double().cpu()
        cons = t[: g * nops * TRACE_CONSUMER].view(g, nops, TRACE_CONSUMER)
        prod = t[g * nops * TRACE_CONSUMER:].view(g, nops, TRACE_PRODUCER)
        recorded = cons > 0
        t0 = cons[recorded].min()
        cons = cons - t0
        prod = prod - t0
        kinds = ["qkv", "att", "o", "gu", "down"]
        out = {"step_us": (cons[:, -1, 3].max() / 1e3).item()}
        for op in range(6):
            js = [5 * layer + op for layer in range(self.cfg.num_layers) if 5 * layer + op > 0] \
                if op < 5 else [nops - 1]
            name = kinds[op] if op < 5 else "head"
            c = cons[:, js]  # [blocks, layers, TRACE_CONSUMER]
            prev_end = cons[:, [j - 1 for j in js], 3].max(0).values
            r = {"wait": (c[:, :, 1] - c[:, :, 0]).mean().item() / 1e3,
                 "latency": (c[:, :, 1].min(0).values - prev_end).mean().item() / 1e3,
                 "spread": (c[:, :, 3].max(0).values
                            - c[:, :, 3].min(0).values).mean().item() / 1e3,
                 "end_to_end": (c[:, :, 3].max(0).values - prev_end).mean().item() / 1e3}
            if op != 1:
                r["to_first"] = (c[:, :, 2] - c[:, :, 1]).mean().item() / 1e3
                for part, k in (("stage", 4), ("stage_load", 5)):  # int4: x staged, loaded
                    m = recorded[:, js, k]
                    if m.any():
                        r[part] = ((c[:, :, k] - c[:, :, 1])[m]).mean().item() / 1e3
                r["run"] = (c[:, :, 3] - c[:, :, 2]).mean().item() / 1e3
                p = prod[:, js]
                r["producer_lead"] = (c[:, :, 1] - p[:, :, 0]).mean().item() / 1e3
                r["producer_span"] = (p[:, :, 1] - p[:, :, 0]).mean().item() / 1e3
            else:
                has = recorded[:, js, 2]
                r["units"] = int(has[:, 0].sum())
                r["unit_run"] = ((c[:, :, 2] - c[:, :, 1])[has]).mean().item() / 1e3
                # a unit's parts: its loads, its products, the wait for every unit of its kv
                # head (counter), the merge's loads (merge_ml) and sums (merge_acc)
                rec = recorded[:, js]
                for part, k0, k1 in (("unit_loads", 1, 4), ("unit_math", 4, 2),
                                     ("counter", 2, 5), ("merge_ml", 5, 6), ("merge_acc", 6, 7)):
                    m = rec[:, :, k0] & rec[:, :, k1]
                    r[part] = (((c[:, :, k1] - c[:, :, k0])[m]).mean().item() / 1e3
                               if m.any() else None)
                m = rec[:, :, 2]  # the slowest unit of a layer: its partials written after ...
                last = torch.where(m, c[:, :, 2], torch.full_like(c[:, :, 2], -1e18)).max(0).values
                r["last_unit_after"] = (last - prev_end).mean().item() / 1e3
            out[name] = r
        return out

    def check(self) -> None:
        """Raise if a wait between ops gave up (the blocks were not all resident at once)."""
        code = int(self.error.item())
        if code:
            self.error.zero_()
            self.counters.zero_()
            raise RuntimeError(f"the decode megakernel's wait for op {code - 1} gave up: its "
                               f"blocks were not all resident (another kernel sharing the GPU?)")
