"""The decode megakernel (flashdraft.backends.megakernel): logits, tokens and cache writes against
Transformer.forward on the GPU; a clear refusal elsewhere."""
import pytest
import torch

from flashdraft.config import ModelConfig
from flashdraft.kv_cache import KVCache
from flashdraft.tools.shapes import build_random_model, get_shape

# Tiny shapes that take every path of the kernel: head dim 128 and 64; an MLP whose rows are
# split over several warps (4,608 features: 2 rows a 24 KB slot) and one whose are not; Qwen3's
# head norms with rows split over warps in QKV, gate/up and the head (hidden size 4,096: 2 rows
# a 24 KB slot, 4 warps a row; 4 rows a 48 KB slot, 2 warps a row), as the 8B shape's are, and
# in O (q width 2,048: 4 rows a 24 KB slot, 2 warps a row), as Qwen3-0.6B's are. Attention's
# warps a head: 4 (hd128-split-down), 2 (hd64-llama, qwen3-split-rows), and 2 heads a warp
# (hd64-group16: 16 query heads a kv head on 8 warps).
SHAPES = {
    "hd128-split-down": ModelConfig("qwen2", 1000, 256, 4608, 3, 4, 2, 128, qkv_bias=True,
                                    rope_theta=1e6),
    "hd64-llama": ModelConfig("llama", 777, 384, 512, 2, 6, 2, 64, rope_theta=5e5),
    "qwen3-split-rows": ModelConfig("qwen3", 1000, 4096, 1024, 2, 16, 4, 128, qk_norm=True,
                                    rope_theta=1e6),
    "hd64-group16": ModelConfig("llama", 777, 1024, 512, 2, 16, 1, 64, rope_theta=5e5),
}


def test_refused_without_cuda_with_the_reason():
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cpu")
    cache = KVCache.for_model(cfg, 1, 64, torch.bfloat16, "cpu")
    from flashdraft.backends import megakernel
    assert megakernel.unsupported(model, cache) == "it needs CUDA"
    with pytest.raises(ValueError, match="cannot run this model: it needs CUDA"):
        megakernel.DecodeMegakernel(model, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prompt", [5, 100, 700])  # one attention split, several, the most
@pytest.mark.parametrize("ring", ["8x24576", "4x49152", "8x24576+bulk", "8x24576+llx",
                                  "8x24576+llattn", "8x24576+llh", "8x24576+llx+llattn+llh"])
def test_megakernel_matches_the_model(shape, prompt, ring):
    torch.manual_seed(0)
    cfg = SHAPES[shape]
    if shape == "qwen3-split-rows" and "+llx" in ring:
        pytest.skip("LLX takes a warp a row (refused: test_llx_refuses_rows_split_over_warps)")
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():  # sharper logits than N(0, 0.02) gives: fewer near ties
        model.lm_head.weight.mul_(20)
    # bulk: one producer warp's bulk copies; llx: x polled by its flags; llattn: attention's
    # q/k/v, partials and output likewise (LLA); llh: the MLP's h
    ring, _, option = ring.partition("+")
    flags = {"llx": {"LLX": 1}, "llattn": {"LLA": 7}, "llh": {"LLH": 1}}
    opts = (dict(ldgsts=False, producers=1) if option == "bulk" else
            dict(defines={k: v for o in option.split("+") if o for k, v in flags[o].items()}))
    compared = _follow_the_model(model, prompt, lambda cache: built_or_skipped(
        model, cache, ring=ring, **opts))
    # most steps decided the token (hidden size 4,096: each logit sums 4,096 rounded terms, so
    # more near ties fall within the kernel's difference from the model)
    assert compared >= (12 if cfg.hidden_size < 4096 else 8)


# every flag at once (LLX where it runs: a warp a row), then each alone, so that a failure names
# its bit (a wait that gives up ends the step's other polls: a few seconds a failed test)
FLAG_SETS = {"all": {"LLA": 7, "LLH": 1, "LLX": 1}, "lla1": {"LLA": 1}, "lla2": {"LLA": 2},
             "lla4": {"LLA": 4}, "llh": {"LLH": 1}}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prompt,flags", [(5, "all"), (700, "all")]
                         + [(700, bit) for bit in FLAG_SETS if bit != "all"])
def test_flagged_data_gives_the_kernels_logits_bit_for_bit(shape, prompt, flags):
    # flags change how an op learns that its input is there, never a row's arithmetic or its
    # order, so LLA, LLH and LLX reproduce the counters' kernel exactly, step after step (each
    # step's flags differ: a stale word must never pass); 700 positions: several units a head
    flags = dict(FLAG_SETS[flags])
    if shape == "qwen3-split-rows":
        flags.pop("LLX", None)
    counters = {"LLA": 0, "LLX": 0}  # the defaults' flags off
    _same_steps_bit_for_bit(SHAPES[shape], prompt, counters, counters | flags)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("warps", [8, 9])
def test_o_held_in_registers_gives_the_kernels_logits_bit_for_bit(shape, warps):
    # OREG: O's first chunk read into the consumers' registers before attention instead of
    # through the ring; the same rows in the same warps, so the same sums (shapes whose O rows
    # split over warps keep the ring: the same kernel); 9 warps: 27 KB slots of 9 rows
    ring = {"ring": "8x27648", "consumer_warps": 9} if warps == 9 else {}
    _same_steps_bit_for_bit(SHAPES[shape], 700, {}, {"OREG": 1}, **ring)


def built_or_skipped(model, cache, **options):
    """DecodeMegakernel(model, cache, **options), or the test skipped where the configuration
    needs more shared memory than this GPU has (an H100 allows less than an H200)."""
    from flashdraft.backends.megakernel import DecodeMegakernel, DoesNotFit
    try:
        return DecodeMegakernel(model, cache, **options)
    except DoesNotFit as err:
        pytest.skip(str(err))


def _same_steps_bit_for_bit(cfg, prompt: int, want_defines: dict, got_defines: dict,
                            **options) -> None:
    """Six chained steps of two kernels over the same cache: equal logits, tokens, cache
    (options: both kernels' other arguments, the ring and the consumer warps)."""
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    caches = [KVCache.for_model(cfg, 1, 1024, torch.bfloat16, "cuda") for _ in range(2)]
    torch.manual_seed(1)
    cached = torch.randn_like(caches[0].kv)  # the same earlier keys and values in both
    for cache in caches:
        cache.kv.copy_(cached)
    with torch.inference_mode():
        reference = built_or_skipped(model, caches[0], defines=want_defines, **options)
        kernel = built_or_skipped(model, caches[1], defines=got_defines, **options)
        token = torch.tensor([3], device="cuda")
        for step in range(6):
            pos = torch.tensor([prompt + step], device="cuda")
            want, want_token = (t.clone() for t in reference.step(token, pos))
            got, got_token = kernel.step(token, pos)
            torch.cuda.synchronize()
            kernel.check()
            assert torch.equal(got, want) and int(got_token) == int(want_token), step
            token = want_token.clone()
    assert torch.equal(caches[0].kv, caches[1].kv)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,pu", [("hd128-split-down", 4), ("qwen3-split-rows", 4),
                                      ("hd64-group16", 4), ("hd128-split-down", 8),
                                      ("hd64-group16", 2)])
def test_megakernel_staging_keys_in_several_rounds_matches_the_model(shape, pu):
    # units of 64 positions (ATT_MIN) take 8 rounds of 8 staged keys and values, each round
    # asked for while the one before it is scored; PU positions a warp's batch (8, the default;
    # 4 and 2: the lanes' sums of 4 and 2 scores at once)
    from flashdraft.backends.megakernel import DecodeMegakernel
    torch.manual_seed(0)
    model = build_random_model(SHAPES[shape], torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    compared = _follow_the_model(model, 700, lambda cache: DecodeMegakernel(
        model, cache, defines={"ATT_MIN": 64, **({"PU": pu} if pu != 8 else {})}))
    assert compared >= (12 if SHAPES[shape].hidden_size < 4096 else 8)


def _follow_the_model(model, prompt: int, make_kernel, steps: int = 24) -> int:
    """Prefill `prompt` random tokens, then `steps` greedy steps of the model and of the
    kernel (make_kernel(cache)) side by side: logits, tokens and cache writes compared.
    Returns the steps whose token the model's logits decided (top two apart)."""
    cfg = model.cfg
    ref_cache = KVCache.for_model(cfg, 1, 1024, torch.bfloat16, "cuda")
    mk_cache = KVCache.for_model(cfg, 1, 1024, torch.bfloat16, "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")
    positions = torch.arange(prompt, device="cuda")[None]
    with torch.inference_mode():
        logits, _ = model(tokens, positions, ref_cache)
        mk_cache.kv.copy_(ref_cache.kv)
        mk = make_kernel(mk_cache)
        token = logits[0, -1].argmax().view(1)
        compared = 0
        for step in range(steps):
            pos = prompt + step
            ref, _ = model(token.view(1, 1), torch.tensor([[pos]], device="cuda"), ref_cache,
                           kv_len=pos + 1)
            ref = ref[0, -1]
            got, got_token = mk.step(token, torch.tensor([pos], device="cuda"))
            torch.cuda.synchronize()
            mk.check()
            err = (got - ref).abs().max().item()
            assert err <= 0.03 * ref.abs().max().item() + 0.05, (step, err)
            # the kernel's token is the argmax of its own logits (lowest id on ties) ...
            assert int(got_token) == int(got.argmax())
            # ... and the model's wherever the model's top two are apart by more than the error
            top2 = ref.topk(2).values
            if (top2[0] - top2[1]).item() > 2 * err:
                assert int(got_token) == int(ref.argmax()), step
                compared += 1
            # the step's key and value went into the cache where the model put them
            for layer in range(cfg.num_layers):
                a, b = mk_cache.kv[layer, :, 0, :, pos], ref_cache.kv[layer, :, 0, :, pos]
                diff = (a.float() - b.float()).abs().max().item()
                assert diff <= 0.02 * b.abs().max().item() + 0.02
            token = ref.argmax().view(1)
    return compared


# int4 shapes (flashdraft.backends.mma's layout; vocabularies in 16-row tiles): Qwen2's biases with
# an MLP of 22 groups; Qwen3's head norms with 8 query heads a kv head (as the 32B's) and head
# dim 64; a hidden size of 7 groups, fewer than the consumer warps (as the 0.5B's 896).
Q4_SHAPES = {
    "q4-qwen2": ModelConfig("qwen2", 2048, 1024, 2816, 2, 8, 2, 128, qkv_bias=True,
                            rope_theta=1e6),
    "q4-qwen3-group8": ModelConfig("qwen3", 1024, 1024, 2048, 2, 16, 2, 64, qk_norm=True,
                                   rope_theta=1e6),
    "q4-seven-groups": ModelConfig("qwen2", 1024, 896, 1536, 2, 7, 1, 128, qkv_bias=True,
                                   rope_theta=1e6),
}


def _int4_model(cfg, monkeypatch):
    """A random int4 model (mma layout) with norms other than 1, which the kernel applies
    itself (int4 weights keep them unfolded), and sharper logits."""
    from flashdraft.backends.quant import quantize_model
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3, fold_norms=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen, device="cuda"))
        model.lm_head.weight.mul_(20)
    return quantize_model(model, "int4")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(Q4_SHAPES))
@pytest.mark.parametrize("prompt", [5, 100, 700])
@pytest.mark.parametrize("warps", [8, 12])  # 12 consumer warps: int4's default
def test_int4_megakernel_matches_the_model(shape, prompt, warps, monkeypatch):
    from flashdraft.backends.megakernel import is_int4
    torch.manual_seed(0)
    model = _int4_model(Q4_SHAPES[shape], monkeypatch)
    assert is_int4(model)
    built = []

    def make(cache):  # 12 warps by default
        built.append(built_or_skipped(model, cache, consumer_warps=None if warps == 12 else warps))
        return built[-1]
    compared = _follow_the_model(model, prompt, make)
    assert compared >= 12 and built[0].consumer_warps == warps


def _halves_size(sms: int, tiles_a_group: int) -> int:
    """The smallest multiple of 128 whose tiles (`tiles_a_group` a 128) leave a remainder that
    decode_mk.cu's Q4_PARTS splits in halves over `sms` blocks, on a quarter to a half of them
    (as the 32B's 320 tiles on 132: 56 split over 112 blocks)."""
    return next(128 * m for m in range(1, 64 * sms)
                if sms // 4 <= (tiles_a_group * m) % sms <= sms // 2 and tiles_a_group * m >= sms)


def _halves_hidden(sms: int) -> int:  # O's and DOWN's tiles: 16 rows of the hidden size
    return _halves_size(sms, 8)


def _halves_intermediate(sms: int) -> int:  # gate/up's: 2 rows a feature
    return _halves_size(sms, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", [5, 700])
@pytest.mark.parametrize("parts", [1, 3])  # 3: gate/up's tiles too (not yet by default)
def test_int4_megakernel_with_tiles_split_in_halves_matches_the_model(prompt, parts,
                                                                      monkeypatch):
    # O's and DOWN's tiles past an even share (and with bit 2 gate/up's), split in halves over
    # the inputs between a pair of blocks (Q4_PARTS): the owner adds the other's sums, sent
    # with the step's flag, over 24 steps (a stale word from an earlier step or layer would
    # give wrong logits; gate/up's and O's words of a layer carry the same flag, apart in
    # Args.xpart)
    from flashdraft.backends.megakernel import DecodeMegakernel
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h, inter = _halves_hidden(sms), _halves_intermediate(sms) if parts == 3 else 1024
    model = _int4_model(ModelConfig("qwen3", 1024, h, inter, 2, 8, 2, 128, qk_norm=True,
                                    rope_theta=1e6), monkeypatch)
    built = []

    def make(cache):  # Q4_PARTS 1 by default for this shape (splits_tiles_in_halves)
        built.append(DecodeMegakernel(model, cache,
                                      defines={"Q4_PARTS": parts} if parts != 1 else None))
        return built[-1]
    compared = _follow_the_model(model, prompt, make)
    assert compared >= 8 and built[0].defines.get("Q4_PARTS") == parts


def _positions_past_a_unit(cfg, q4: bool, sms: int, below: int) -> list[int]:
    """Positions p < below where a unit of attention starts past p by less than a round of
    staged keys (where (p - j0) / KS, rounded toward zero, made a row of round 0 before the
    fix)."""
    from flashdraft.backends.megakernel import attention_ks, attention_units
    ks = attention_ks(cfg, q4)
    return [p for p in range(below)
            if any(p < j0 < p + ks for j0, _ in attention_units(cfg, p, sms, q4))]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["q4-seven-groups", "qwen3-split-rows"])  # below 1,000
def test_megakernel_where_units_start_past_the_position_matches_the_model(shape, monkeypatch):
    # ceil((p + 1) / nsplit) positions a unit leaves the last units of a head starting past p
    # (the 1.5B on 132 blocks from p = 1,064, its int4 from 1,056, the 0.5B int4 from 528):
    # their step's own key and value row went below their staging buffer, over the int4 tile
    # sums that must stay zero; 24 steps across such positions, int4 and bf16
    from flashdraft.backends.megakernel import DecodeMegakernel
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q4 = shape in Q4_SHAPES
    cfg = Q4_SHAPES[shape] if q4 else SHAPES[shape]
    hits = _positions_past_a_unit(cfg, q4, sms, 1000)
    if not hits:
        pytest.skip(f"no unit starts past its position below 1,000 on {sms} blocks")
    prompt = max(5, hits[0] - 4)
    assert sum(prompt <= p < prompt + 24 for p in hits) >= 3
    if q4:
        model = _int4_model(cfg, monkeypatch)
    else:
        model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
    compared = _follow_the_model(model, prompt, lambda cache: DecodeMegakernel(model, cache))
    assert compared >= 8


def test_attention_units_cover_the_positions_and_some_start_past_them():
    # the Python mirror of decode_mk.cu's attention_split that the test above relies on
    from flashdraft.backends.megakernel import attention_units
    cfg = get_shape("qwen2.5-1.5b")
    for p in (0, 5, 511, 1063, 1064, 4095):
        units = attention_units(cfg, p, 132)
        assert units[0][0] == 0 and all(j1 <= p + 1 for _, j1 in units)
        assert sum(max(0, j1 - j0) for j0, j1 in units) == p + 1  # each position once
    assert len(attention_units(cfg, 4095, 132)) == 66  # 132 blocks, 2 kv heads
    assert _positions_past_a_unit(cfg, False, 132, 1071)[:2] == [1064, 1065]
    assert _positions_past_a_unit(get_shape("qwen2.5-0.5b"), True, 132, 529) == [528]
    assert _positions_past_a_unit(get_shape("qwen2.5-1.5b"), True, 132, 1057) == [1056]


def test_the_halves_hidden_size_leaves_a_remainder_to_split():
    from flashdraft.backends.megakernel import splits_tiles_in_halves
    assert _halves_hidden(132) == 2688  # 168 tiles: 1 each, 36 split in halves on 72 blocks
    assert _halves_intermediate(132) == 1408  # 176 gate/up tiles: 1 each, 44 split
    assert 28 <= (_halves_hidden(114) // 16) % 114 <= 57
    split = [name for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-8b", "qwen3-32b")
             if splits_tiles_in_halves(get_shape(name), 132)]
    assert split == ["qwen3-32b"]  # 320 tiles; 56, 96 and 256 (124 left) do not split


def test_more_consumer_warps_take_more_shared_memory_and_still_fit_the_32b():
    from flashdraft.backends.megakernel import HOPPER_SHARED, shared_bytes
    from flashdraft.tools.shapes import get_shape
    cfg = get_shape("qwen3-32b")
    eight = shared_bytes(cfg, "6x26112", q4=True, warps=8)
    assert eight < shared_bytes(cfg, "6x26112", q4=True) <= HOPPER_SHARED  # int4's 12 warps


def test_default_ring_follows_the_shape():
    from flashdraft.backends import megakernel
    from flashdraft.tools.shapes import get_shape
    # 24 KB slots where rows of the hidden size fill them (1.5B) or the model is small (0.6B);
    # 32 KB slots for the 8B, whose 8 KB rows fill a 24 KB slot to two thirds
    assert megakernel.default_ring(get_shape("qwen2.5-1.5b")) == "8x24576"
    assert megakernel.default_ring(get_shape("qwen3-0.6b")) == "8x24576"
    assert megakernel.default_ring(get_shape("qwen3-8b")) == "6x32768"
    # a slot holds a row of the widest matrix at least: the 32B's down rows (25,600 inputs,
    # 51,200 bytes) in as many slots of 50 KB as fit beside the rest
    big = get_shape("qwen3-32b")
    assert megakernel.default_ring(big) == "4x51200"
    assert megakernel.shared_bytes(big, "4x51200") <= megakernel.HOPPER_SHARED
    assert megakernel.shared_bytes(big, "5x51200") > megakernel.HOPPER_SHARED
    # int4: as many slots as fit beside the rest, up to 7, of 24 units (26,112 bytes: 2 a warp
    # of 12) for small models, of 3 units a warp where the step reads 2 GB of int4 weights or
    # more (the 32B's 51 KB of staged x for its down product leave room for 4 of 36)
    assert megakernel.default_ring(get_shape("qwen2.5-1.5b"), q4=True) == "7x26112"
    assert megakernel.default_ring(get_shape("qwen3-0.6b"), q4=True) == "7x26112"
    assert megakernel.default_ring(get_shape("qwen3-8b"), q4=True) == "5x39168"
    assert megakernel.default_ring(get_shape("qwen3-32b"), q4=True) == "4x39168"
    assert megakernel.default_ring(get_shape("qwen3-32b"), q4=True, warps=8) == "6x26112"
    # more consumer warps take more shared memory, so fewer slots where the ring filled it
    for cfg in (*Q4_SHAPES.values(), get_shape("qwen3-8b"), get_shape("qwen3-32b")):
        for warps in (8, 12, 16):
            ring = megakernel.default_ring(cfg, q4=True, warps=warps)
            assert megakernel.shared_bytes(cfg, ring, q4=True, warps=warps) \
                <= megakernel.HOPPER_SHARED, (cfg, warps)
    # attention's staged keys and values do not grow with the warps: 7 slots (the most) beside
    # them
    assert megakernel.default_ring(Q4_SHAPES["q4-seven-groups"], q4=True, warps=12) == "7x26112"


def test_int4_tiles_are_added_as_rarely_as_shared_memory_allows():
    from flashdraft.backends import megakernel
    from flashdraft.tools.shapes import get_shape
    every = megakernel.default_finish_every
    # the 32B's ring leaves room for 8 chunks' tiles (measured 6.94-6.98 ms a step against
    # 7.33-7.43 at 1); the 8B's ring fills the block, so it keeps 1; the 1.5B's leaves room
    # for 6 since attention's state is its staged keys and values
    assert every(get_shape("qwen3-32b"), "4x39168") == 8
    assert every(get_shape("qwen3-8b"), "5x39168") == 1
    assert every(get_shape("qwen2.5-1.5b"), "7x26112") == 6
    for cfg in (*Q4_SHAPES.values(), get_shape("qwen3-8b"), get_shape("qwen3-32b"),
                get_shape("qwen2.5-0.5b")):
        ring = megakernel.default_ring(cfg, q4=True)
        m = every(cfg, ring)
        need = megakernel.shared_bytes(cfg, ring, q4=True, defines={"Q4_FINISH_EVERY": m})
        assert need <= megakernel.HOPPER_SHARED, (cfg, m)
        larger = [n for n in (8, 6, 3) if n > m]  # the next larger choice would not fit
        if larger:
            assert megakernel.shared_bytes(cfg, ring, q4=True,
                                           defines={"Q4_FINISH_EVERY": larger[-1]}) \
                > megakernel.HOPPER_SHARED, (cfg, m)


def test_int4_ring_and_tile_room_fit_a_gpu_with_less_shared_memory():
    from flashdraft.backends import megakernel
    from flashdraft.tools.shapes import get_shape
    limit = 160 * 1024  # a block's shared memory on a GPU smaller than Hopper's 227 KB
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-8b", "qwen3-32b"):
        cfg = get_shape(name)
        hopper = megakernel.default_ring(cfg, q4=True)
        ring = megakernel.default_ring(cfg, q4=True, limit=limit)
        m = megakernel.default_finish_every(cfg, ring, limit=limit)
        assert megakernel.shared_bytes(cfg, ring, q4=True,
                                       defines={"Q4_FINISH_EVERY": m}) <= limit, name
        assert int(ring.split("x")[0]) < int(hopper.split("x")[0]), (name, ring, hopper)


def test_shared_memory_fits_hopper_for_the_shapes_we_run_and_the_32b_rows():
    from flashdraft.backends.megakernel import HOPPER_SHARED as hopper, shared_bytes
    from flashdraft.tools.shapes import get_shape
    for shape, ring in (("qwen2.5-1.5b", "8x24576"), ("qwen3-8b", "6x32768"),
                        ("qwen3-0.6b", "8x24576")):
        assert 8 * 24576 <= shared_bytes(get_shape(shape), ring) <= hopper, shape
    # the 32B's 51 KB rows need 4 slots of 51,200 bytes: they fit beside attention's 8 KB of
    # staged keys and values (not beside the 32 KB of warp states it once took)
    assert shared_bytes(get_shape("qwen3-32b"), "4x51200") <= hopper
    # a 9th 24 KB slot for the 1.5B fits where DOWN's sums hold the 12 rows a block writes
    # (RED_ROWS 12 on 132 blocks), not the 64 they hold by default; the 32B int4 keeps room
    # for Q4_PARTS's tile beside its 4 slots of 36 units at 8 chunks a tile addition
    cfg = get_shape("qwen2.5-1.5b")
    assert shared_bytes(cfg, "9x24576", defines={"RED_ROWS": 12}) <= hopper \
        < shared_bytes(cfg, "9x24576")
    assert shared_bytes(get_shape("qwen3-32b"), "4x39168", q4=True,
                        defines={"Q4_FINISH_EVERY": 8, "Q4_PARTS": 1}) <= hopper


def test_auto_drafts_on_graphs_where_the_kernel_fails_to_build(monkeypatch):
    from flashdraft.backends import megakernel
    from flashdraft.drafters.draft_model import DraftModelDrafter
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.float32, "cpu")

    def fails(*args, **kwargs):
        raise RuntimeError("compiling decode_mk.cu with NVRTC failed: no sm_999")
    monkeypatch.setattr(megakernel, "DecodeMegakernel", fails)
    for kernel in ("auto", "megakernel"):
        drafter = DraftModelDrafter(model, torch.device("cpu"), torch.float32, cfg.vocab_size)
        drafter.use_megakernel, drafter.decode_kernel = True, kernel  # as on a GPU it passed
        if kernel == "auto":
            with pytest.warns(UserWarning, match="its steps run on the CUDA graphs"):
                drafter.ensure_capacity(64)
            assert not drafter.use_megakernel and drafter.cache is not None
        else:  # asked for by name: the error stands
            with pytest.raises(RuntimeError, match="no sm_999"):
                drafter.ensure_capacity(64)


def test_shape_bench_report_shows_the_megakernel():
    from flashdraft.tools.shapes import format_shape_bench
    curve = {1: {"ms": 4.0, "bandwidth_fraction": 0.85, "tflops": 0.1},
             16: {"ms": 4.6, "bandwidth_fraction": 0.75, "tflops": 1.4}}
    r = {"shape": "qwen3-8b", "dtype": "bfloat16", "quant": "none", "cuda_graphs": True,
         "compile": False, "gpu": "H200", "context": 512, "bytes_per_step": 16.4e9,
         "weight_bytes": 16.4e9, "kv_bytes_per_step": 7e7, "flops_per_step": 1.6e10,
         "copy_bandwidth_Bps": 4.2e12, "decode_tokens_per_s": 238.0, "roofline_fraction": 0.86,
         "roofline_tokens_per_s": 277.0, "step_curve": curve, "note": "random weights",
         "megakernel": {"ring": "6x32768", "step_ms": 3.98, "step_roofline_fraction": 0.907,
                        "decode_tokens_per_s": 249.2, "roofline_fraction": 0.899,
                        "verify16_over_step": 4.6 / 3.98}}
    text = format_shape_bench(r)
    assert ("plain decode through the megakernel (ring 6x32768): 249.2 tokens/s = 89.9% of the "
            "roofline; its step 3.980 ms (90.7%); verifying 16 tokens (graphs) costs 1.16x it"
            in text)
    r["drafter"] = {"shape": "qwen3-0.6b", "dtype": "bfloat16", "step_ms": 0.81,
                    "megakernel_step_ms": 0.7}
    assert ("drafter step (qwen3-0.6b, bfloat16): 0.810 ms (graphs); 0.700 ms through the "
            "megakernel" in format_shape_bench(r))
    r["drafter"] = {"shape": "qwen3-0.6b", "dtype": "bfloat16", "step_ms": 0.81,
                    "megakernel_refused": "int8 weights"}
    assert format_shape_bench(r).endswith("drafter step (qwen3-0.6b, bfloat16): 0.810 ms; the "
                                          "megakernel refused it: int8 weights\n  note: random "
                                          "weights")
    # a quantized target's drafter is quantized as it (the engine's draft quantization "auto")
    r["drafter"] = {"shape": "qwen3-0.6b", "dtype": "bfloat16", "quant": "int4", "step_ms": 0.5,
                    "megakernel_step_ms": 0.4}
    assert ("drafter step (qwen3-0.6b, bfloat16, int4): 0.500 ms (graphs); 0.400 ms through "
            "the megakernel" in format_shape_bench(r))
    r["megakernel"]["decode_ahead_tokens_per_s"] = 251.0
    assert ("249.2 tokens/s = 89.9% of the roofline (251.0 read a step behind, as the engine "
            "does); its step 3.980 ms" in format_shape_bench(r))


class _FakeMegakernel:
    """launch() computes the next token into token_out, as DecodeMegakernel's chained steps."""

    def __init__(self, log):
        self.device, self.token_out, self.log = torch.device("cpu"), torch.zeros(1), log

    def start(self, token, position):
        self.token_out = token.clone()

    def launch(self):
        self.token_out += 1
        self.log.append(("launch", int(self.token_out)))


class _LoggingReader:
    """The engine's reader's calls: start when a token's copy is queued, read when it is read."""

    def __init__(self, log):
        self.log = log

    def start(self, token):
        self.log.append(("start", int(token)))
        return int(token)

    def read(self, handle):
        self.log.append(("read", handle))
        return handle


@pytest.mark.parametrize("ahead", [False, True])
def test_megakernel_decode_reads_a_step_behind_as_the_engine(ahead, monkeypatch):
    from flashdraft.tools import shapes
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(shapes, "TokenReader", lambda device: _LoggingReader(log))
    mk = _FakeMegakernel(log)
    assert shapes.megakernel_decode(mk, 100, steps=4, ahead=ahead) > 0
    timed = log[log.index(("launch", 5)):]  # after the 4 warm-up steps: tokens 5 .. 8
    if ahead:  # step n + 1 launched before token n is read; every token read, in order
        assert timed == [("launch", 5), ("start", 5), ("launch", 6), ("start", 6), ("read", 5),
                         ("launch", 7), ("start", 7), ("read", 6), ("launch", 8), ("start", 8),
                         ("read", 7), ("read", 8)]
    else:  # each step waited for before the next is launched
        assert timed == [("launch", t) for t in (5, 6, 7, 8)]


@pytest.mark.gpu
def test_shape_bench_times_the_drafter_through_the_megakernel_unless_graphs_are_asked():
    from flashdraft.tools.shapes import run_shape_bench
    for kernel in ("auto", "graph"):
        d = run_shape_bench("qwen2.5-1.5b", step_tokens=(1,), repeats=3, decode_steps=8,
                            decode_kernel=kernel)["drafter"]
        assert d["shape"] == "qwen2.5-0.5b" and d["step_ms"] > 0
        if kernel == "auto":  # the 0.5B's step: ~0.5 ms on the graphs, less through the kernel
            assert 0 < d["megakernel_step_ms"] < d["step_ms"]
        else:
            assert "megakernel_step_ms" not in d


@pytest.mark.gpu
def test_shape_bench_runs_the_megakernel_for_bf16_and_int4_and_refuses_it_for_int8():
    from flashdraft.tools.shapes import run_shape_bench
    r = run_shape_bench("qwen2.5-0.5b", step_tokens=(1, 16), draft=False, repeats=3,
                        decode_steps=16, decode_kernel="megakernel")
    m = r["megakernel"]
    assert m["ring"] == "8x24576" and m["decode_tokens_per_s"] > 0
    assert m["decode_ahead_tokens_per_s"] > 0
    # its step at 512 cached positions, as the graph step's: no faster than the roofline
    assert 0 < m["step_roofline_fraction"] < 1
    assert m["roofline_fraction"] == pytest.approx(
        m["decode_tokens_per_s"] / r["roofline_tokens_per_s"])
    assert m["verify16_over_step"] == pytest.approx(r["step_curve"][16]["ms"] / m["step_ms"])
    q4 = run_shape_bench("qwen2.5-0.5b", quant="int4", step_tokens=(1,), draft=False,
                         repeats=3, decode_steps=16, decode_kernel="megakernel")["megakernel"]
    assert q4["ring"] == "7x26112" and 0 < q4["step_roofline_fraction"] < 1
    with pytest.raises(ValueError, match="megakernel cannot run the qwen2.5-0.5b shape .*int8.*"
                                         "contiguous bfloat16 nn.Linear, or all of them and the "
                                         "head int4"):
        run_shape_bench("qwen2.5-0.5b", quant="int8", step_tokens=(1,), draft=False,
                        decode_kernel="megakernel")


@pytest.mark.gpu
def test_llx_refuses_rows_split_over_warps():
    from flashdraft.backends.megakernel import DecodeMegakernel
    cfg = SHAPES["qwen3-split-rows"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    cache = KVCache.for_model(cfg, 1, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="LLX: hidden size 4096 .* a warp a row"):
        DecodeMegakernel(model, cache, defines={"LLX": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("ring", ["3x24576", "5x24576", "9x16384"])
def test_rings_of_few_or_an_odd_number_of_slots_match_the_model(ring):
    # a producer's wait for its slot is sound only while its own previous wait covers the
    # slot's use before the last (NPROD <= NS: with 3 slots and 4 producers, chunk 7 could
    # overwrite slot 1 while chunk 1 was read); and its wait for chunk c - INFLIGHT only where
    # INFLIGHT divides NS (5 slots: 1, 9: 3; with 2 the parity could name the slot's next use)
    from flashdraft.backends.megakernel import DecodeMegakernel
    torch.manual_seed(0)
    model = build_random_model(SHAPES["hd64-llama"], torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    built = []

    def make(cache):
        built.append(built_or_skipped(model, cache, ring=ring))
        return built[-1]
    slots = int(ring.split("x")[0])
    assert _follow_the_model(model, 100, make) >= 12 and built[0].producers == min(4, slots)
    if slots < 4:
        with pytest.raises(ValueError, match=rf"producers 4: 1 to the ring's 3 slots \({ring}\)"):
            DecodeMegakernel(model, built[0].cache, ring=ring, producers=4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_nine_consumer_warps_take_nine_rows_a_slot_and_match_the_model(shape):
    # 27 KB slots hold 9 rows of 1,536 for 9 warps (a warp a row), 3 rows a slot of wider ones
    # (3 warps a row), 1 of the widest (9 warps a row); attention's warps a head from 9
    torch.manual_seed(0)
    cfg = SHAPES[shape]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    compared = _follow_the_model(model, 700, lambda cache: built_or_skipped(
        model, cache, ring="8x27648", consumer_warps=9))
    assert compared >= (12 if cfg.hidden_size < 4096 else 8)


def test_rows_a_chunk_are_shared_evenly_by_the_consumer_warps():
    # decode_mk.cu's rows_per_chunk: the powers of two up to 16 with 8 warps (as before 9 warps
    # were a choice), 9, 3 or 1 with 9; the 1.5B's 9-row ring fits Hopper with RED_ROWS 12 and
    # keeps LLX (a warp a row)
    from flashdraft.backends.megakernel import (HOPPER_SHARED, rows_per_chunk, default_flags,
                                       shared_bytes)
    from flashdraft.tools.shapes import get_shape
    for k in (256, 384, 896, 1024, 1536, 2048, 4096, 4608, 5120, 8960, 12288, 25600):
        for slot in (16384, 24576, 26624, 32768, 49152, 51200):
            power = next((r for r in (16, 8, 4, 2, 1) if 2 * k * r <= slot), 0)
            assert rows_per_chunk(k, slot) == power, (k, slot)
    assert [rows_per_chunk(k, 27648, 9) for k in (1536, 4096, 8960, 896)] == [9, 3, 1, 9]
    cfg = get_shape("qwen2.5-1.5b")
    assert default_flags(cfg, "8x27648", 9) == {"LLA": 5, "LLX": 1}
    flags = {"LLA": 5, "LLX": 1, "RED_ROWS": 12}
    assert shared_bytes(cfg, "8x27648", warps=9, defines=flags) <= HOPPER_SHARED
    assert shared_bytes(cfg, "8x27648", warps=9, defines=flags | {"RED_ROWS": 64}) > HOPPER_SHARED


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", [5, 700])
def test_rows_wider_than_the_usual_slot_take_the_default_ring_and_match_the_model(prompt):
    # down's rows of 13,312 inputs (26,624 bytes) fit no 24 KB slot: the default ring is then
    # made of slots of one such row (as the bf16 32B's 4x51200), here with 8 kv heads, so
    # attention stages 16 positions a round as well
    from flashdraft.backends.megakernel import DecodeMegakernel
    torch.manual_seed(0)
    cfg = ModelConfig("qwen3", 1000, 512, 13312, 2, 8, 8, 64, qk_norm=True, rope_theta=1e6)
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    built = []

    def make(cache):
        built.append(DecodeMegakernel(model, cache))
        return built[-1]
    assert _follow_the_model(model, prompt, make) >= 12
    assert built[0].ring == "8x26624" and built[0].defines["ATT_KS"] == 16


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{"LLA": 0, "LLX": 0}, {"LLA": 7, "LLH": 1}],
                         ids=["counters", "llflags"])
def test_traced_kernel_gives_the_same_step_and_a_timeline(flags):
    from flashdraft.backends.megakernel import DecodeMegakernel
    cfg = SHAPES["hd128-split-down"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=5)
    cache = KVCache.for_model(cfg, 1, 256, torch.bfloat16, "cuda")
    cache.kv.normal_()
    token, pos = torch.tensor([7], device="cuda"), torch.tensor([100], device="cuda")
    with torch.inference_mode():
        plain = DecodeMegakernel(model, cache, defines=flags)
        want = plain.step(token, pos)[0].clone()
        traced = DecodeMegakernel(model, cache, defines={"TRACE": 1, **flags})
        got = traced.step(token, pos)[0]
        torch.cuda.synchronize()
        traced.check()
    assert torch.equal(got, want)  # the timer reads change nothing
    tl = traced.timeline()
    assert tl["step_us"] > 0
    for kind in ("qkv", "att", "o", "gu", "down", "head"):
        assert tl[kind]["wait"] >= 0 and tl[kind]["end_to_end"] > 0, (kind, tl[kind])
    assert tl["att"]["units"] >= 1 and tl["gu"]["run"] > 0
    with pytest.raises(ValueError, match="TRACE=1"):
        plain.timeline()
    with pytest.raises(ValueError, match="position 256 is outside the cache's 256"):
        plain.step(token, torch.tensor([256]))  # a position on the host is checked


def test_flag_settings_are_checked_before_anything_else():
    # LLA is a set of bits; a wrong value is named before the GPU is looked for
    from flashdraft.backends.megakernel import DecodeMegakernel
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cpu")
    cache = KVCache.for_model(cfg, 1, 64, torch.bfloat16, "cpu")
    for bad in (8, -1, "7"):
        with pytest.raises(ValueError, match=f"LLA {bad!r}: 0 to 7"):
            DecodeMegakernel(model, cache, defines={"LLA": bad})


def test_flagged_data_fits_beside_a_ninth_slot():
    # the polled att (LLA 4) shares attention's space and the rows going out with their flags
    # take XO_ROWS: the 1.5B's 9th slot (RED_ROWS 12) still fits with every flag on; h's rows
    # (LLH: 8,960 in pairs on 132 blocks, 68) set XO_ROWS past its default 66
    from flashdraft.backends.megakernel import HOPPER_SHARED, shared_bytes, xo_rows
    from flashdraft.tools.shapes import get_shape
    cfg = get_shape("qwen2.5-1.5b")
    assert xo_rows(cfg, 132, {"LLX": 1, "LLA": 7}) == 66  # 12 rows of x, 16 of q/k/v
    assert xo_rows(cfg, 132, {"LLH": 1}) == 68 and xo_rows(cfg, 132, {"LLA": 6}) == 66
    nine = shared_bytes(cfg, "9x24576", defines={"RED_ROWS": 12})
    for flags in ({"LLA": 7}, {"LLX": 1}, {"LLX": 1, "LLA": 7, "LLH": 1}):
        flags |= {"XO_ROWS": xo_rows(cfg, 132, flags)}
        need = shared_bytes(cfg, "9x24576", defines={"RED_ROWS": 12, **flags})
        assert nine < need <= HOPPER_SHARED, flags
    # att as polled (3 KB) takes none of its own: attention's staged keys and values are larger
    assert shared_bytes(cfg, "8x24576", defines={"LLA": 4}) == shared_bytes(cfg, "8x24576")


def test_bfloat16_takes_flagged_dependencies_on_small_models():
    # LLA 4 won on the 0.5B and the 1.5B and lost 1 % on the 8B at 4,096 positions;
    # LLA 5 and LLX won again on both where LLX runs; the 0.6B's q width (2,048)
    # puts 4 rows in a slot, so it keeps LLA 4 alone
    from flashdraft.backends.megakernel import default_flags, default_ring
    from flashdraft.tools.shapes import get_shape
    flags = {}
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "qwen3-8b", "qwen3-32b"):
        cfg = get_shape(name)
        flags[name] = default_flags(cfg, default_ring(cfg))
    assert flags == {"qwen2.5-0.5b": {"LLA": 5, "LLX": 1}, "qwen2.5-1.5b": {"LLA": 5, "LLX": 1},
                     "qwen3-0.6b": {"LLA": 4}, "qwen3-8b": {"LLA": 0}, "qwen3-32b": {"LLA": 0}}
    assert default_flags(SHAPES["hd128-split-down"], "8x24576") == {"LLA": 5, "LLX": 1}


@pytest.mark.gpu
def test_a_callers_flag_replaces_the_defaults_and_keeps_the_others():
    from flashdraft.backends.megakernel import DecodeMegakernel
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    cache = KVCache.for_model(cfg, 1, 64, torch.bfloat16, "cuda")
    assert {k: DecodeMegakernel(model, cache).defines[k] for k in ("LLA", "LLX")} == \
        {"LLA": 5, "LLX": 1}
    mk = DecodeMegakernel(model, cache, defines={"LLA": 0})
    assert mk.defines["LLA"] == 0 and mk.defines["LLX"] == 1


def test_bfloat16_takes_longer_attention_rounds_on_models_of_many_kv_heads():
    # 16 positions a round won on the 8B at 4,096 positions and lost on the 1.5B
    from flashdraft.backends.megakernel import default_att_ks, default_flags, default_ring, shared_bytes
    from flashdraft.tools.shapes import get_shape
    ks = {}
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-8b", "qwen3-32b"):
        cfg = get_shape(name)
        ring = default_ring(cfg)
        ks[name] = default_att_ks(cfg, ring, default_flags(cfg, ring))
    assert ks == {"qwen2.5-0.5b": 0, "qwen2.5-1.5b": 0, "qwen3-8b": 16, "qwen3-32b": 16}
    # where 16 would not fit beside the ring, the kernel's own 8
    cfg = get_shape("qwen3-8b")
    assert default_att_ks(cfg, "6x32768", {"LLA": 0}, limit=shared_bytes(cfg, "6x32768")) == 0


def test_timeline_reads_a_synthetic_trace():
    """The trace's arithmetic on the CPU: blocks that wait 200 ns, start 300 ns later, end
    400 ns after that; two attention units, block 0's merge timed."""
    from flashdraft.backends.megakernel import TRACE_CONSUMER, TRACE_PRODUCER, DecodeMegakernel
    mk = DecodeMegakernel.__new__(DecodeMegakernel)  # no GPU: only the trace is needed
    mk.cfg, mk.sms = SHAPES["hd128-split-down"], 4
    nops = 5 * mk.cfg.num_layers + 1
    trace = torch.zeros(mk.sms * nops * (TRACE_CONSUMER + TRACE_PRODUCER), dtype=torch.int64)
    cons = trace[: mk.sms * nops * TRACE_CONSUMER].view(mk.sms, nops, TRACE_CONSUMER)
    prod = trace[mk.sms * nops * TRACE_CONSUMER:].view(mk.sms, nops, TRACE_PRODUCER)
    for j in range(nops):
        start = 10**9 + 1000 * j
        cons[:, j, :4] = torch.tensor([start, start + 200, start + 500, start + 900])
        prod[:, j] = torch.tensor([start - 300, start + 100])
        if j % 5 == 1:  # attention: units on blocks 0 and 1, block 0's merge timed
            cons[2:, j, 2] = 0  # no partials written where no unit ran
            cons[:2, j, 4], cons[:2, j, 5] = start + 250, start + 600
            cons[0, j, 6], cons[0, j, 7] = start + 650, start + 700
    mk.trace = trace
    tl = mk.timeline()
    gu = tl["gu"]
    assert gu["wait"] == pytest.approx(0.2) and gu["to_first"] == pytest.approx(0.3)
    assert gu["run"] == pytest.approx(0.4) and gu["producer_lead"] == pytest.approx(0.5)
    assert gu["latency"] == pytest.approx(0.3) and gu["end_to_end"] == pytest.approx(1.0)
    att = tl["att"]
    assert att["units"] == 2 and att["unit_loads"] == pytest.approx(0.05)
    assert att["counter"] == pytest.approx(0.1) and att["merge_acc"] == pytest.approx(0.05)


def test_engine_refuses_the_megakernel_where_it_cannot_run():
    from flashdraft.config import EngineConfig
    from flashdraft.engine import Engine
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="megakernel cannot run this model: it needs CUDA.*"
                                         "--decode-kernel auto"):
        Engine(model, torch.device("cpu"), torch.bfloat16, 64, (), decode_kernel="megakernel")
    with pytest.raises(ValueError,
                       match="decode_kernel 'fast' is not one of auto, graph, megakernel"):
        Engine(model, torch.device("cpu"), torch.bfloat16, 64, (), decode_kernel="fast")
    with pytest.raises(ValueError, match="decode_kernel 'fast'"):
        EngineConfig(model="m", decode_kernel="fast")


def _run(engine, prompt, params, drafter=None, k=0):
    return [t for step in engine.run(prompt, params, drafter, k) for t in step.token_ids]


@pytest.mark.gpu
def test_engine_plain_decoding_through_the_megakernel_follows_the_model():
    """decode_kernel="megakernel": every token of a greedy request is the model's choice given
    the tokens before it (up to near ties: the kernel's reductions are its own), over two
    requests in turn (each starts the kernel's chain at its own prompt), the first of them
    longer than a step of the chain could reach by accident; a speculative request and a
    sampled one on the same engine stay on the graphs and give the graph engine's tokens."""
    from flashdraft.config import SamplingParams
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.engine import Engine
    cfg = SHAPES["hd128-split-down"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():  # sharper logits: fewer near ties
        model.lm_head.weight.mul_(20)
    dev = torch.device("cuda")
    mk_engine = Engine(model, dev, torch.bfloat16, 512, (), decode_kernel="megakernel")
    graph_engine = Engine(model, dev, torch.bfloat16, 512, ())
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (100, 5)]
    with torch.inference_mode():
        for prompt in prompts:
            out = _run(mk_engine, prompt, greedy)
            assert len(out) == 48
            # the model over prompt + output at once: token i is (nearly) the argmax at i - 1
            seq = torch.tensor([prompt + out], device="cuda")
            cache = KVCache.for_model(cfg, 1, 256, torch.bfloat16, "cuda")
            logits, _ = model(seq, torch.arange(seq.shape[1], device="cuda")[None], cache)
            ref = logits[0, len(prompt) - 1:-1].float()
            top = ref.max(-1).values
            chosen = ref.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            tol = 0.06 * ref.abs().max().item() + 0.1
            assert (chosen >= top - tol).all(), (top - chosen).tolist()
            assert (chosen == top).float().mean().item() >= 0.9
        # the graphs' requests on the megakernel's engine
        drafter = NgramDrafter((3, 2), dev)
        spec = _run(mk_engine, prompts[0], greedy, drafter, 4)
        assert spec == _run(graph_engine, prompts[0], greedy)
        sampled = SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True)
        assert _run(mk_engine, prompts[1], sampled) == _run(graph_engine, prompts[1], sampled)


@pytest.mark.gpu
def test_draft_model_steps_through_the_megakernel():
    """A draft model's greedy steps through the megakernel (decode_kernel="megakernel"): the
    output is still the target's plain decoding, token for token, and with the target itself
    as the draft model nearly every draft is kept (a wrong position or a stale token in the
    kernel's chain would have them rejected)."""
    from flashdraft.config import SamplingParams
    from flashdraft.drafters.draft_model import DraftModelDrafter
    from flashdraft.engine import Engine, RequestMetrics
    cfg = SHAPES["hd128-split-down"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    dev = torch.device("cuda")
    engine = Engine(model, dev, torch.bfloat16, 512, ())
    # "auto", the engine's default, takes the kernel where it runs, as "megakernel" does
    drafter = DraftModelDrafter(model, dev, torch.bfloat16, cfg.vocab_size, decode_kernel="auto")
    assert drafter.use_megakernel
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for n in (100, 5):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            metrics = RequestMetrics()
            spec = [t for s in engine.run(prompt, greedy, drafter, 4, metrics) for t in s.token_ids]
            assert spec == _run(engine, prompt, greedy)
            assert drafter.megakernel is not None and metrics.drafted_tokens >= 24
            assert metrics.acceptance_rate >= 0.8, metrics.acceptance_rate


def test_draft_model_refuses_the_megakernel_without_cuda():
    from flashdraft.drafters.draft_model import DraftModelDrafter
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="megakernel cannot run the draft model: it needs CUDA"):
        DraftModelDrafter(model, torch.device("cpu"), torch.bfloat16, cfg.vocab_size,
                          decode_kernel="megakernel")
    # "auto" (the engine's default) takes the graphs / eager steps instead, as does a
    # wider vocabulary
    auto = DraftModelDrafter(model, torch.device("cpu"), torch.bfloat16, cfg.vocab_size,
                             decode_kernel="auto")
    assert not auto.use_megakernel


@pytest.mark.gpu
def test_auto_drafts_on_graphs_where_the_kernel_cannot_run():
    from flashdraft.drafters.draft_model import DraftModelDrafter
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.bfloat16, "cuda")
    dev = torch.device("cuda")
    narrower = cfg.vocab_size - 1  # the draft's logits would need cutting
    assert not DraftModelDrafter(model, dev, torch.bfloat16, narrower).use_megakernel
    assert not DraftModelDrafter(model, dev, torch.bfloat16, narrower,
                                 decode_kernel="auto").use_megakernel
    with pytest.raises(ValueError, match="its 777 logits would need cutting to the target's 776"):
        DraftModelDrafter(model, dev, torch.bfloat16, narrower, decode_kernel="megakernel")
    assert DraftModelDrafter(model, dev, torch.bfloat16, cfg.vocab_size,
                             decode_kernel="auto").use_megakernel
    # --no-cuda-graphs (eager steps, for debugging) keeps auto off the kernel too
    assert not DraftModelDrafter(model, dev, torch.bfloat16, cfg.vocab_size, cuda_graphs=False,
                                 decode_kernel="auto").use_megakernel
    int8 = build_random_model(cfg, torch.bfloat16, "cuda", quant="int8")
    assert not DraftModelDrafter(int8, dev, torch.bfloat16, cfg.vocab_size,
                                 decode_kernel="auto").use_megakernel


@pytest.mark.gpu
def test_auto_drafts_an_int4_model_through_the_kernel(monkeypatch):
    from flashdraft.drafters.draft_model import DraftModelDrafter
    cfg = Q4_SHAPES["q4-qwen3-group8"]
    model = _int4_model(cfg, monkeypatch)
    assert DraftModelDrafter(model, torch.device("cuda"), torch.bfloat16, cfg.vocab_size,
                             decode_kernel="auto").use_megakernel


class _ChainedSteps:
    """DecodeMegakernel's interface and chaining on the CPU, for the engine's wiring: each
    launch is the model's own one-token step on token_in at pos_in, and leaves its token and
    the next position there."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.token_in, self.pos_in, self.token_out = (torch.zeros(1, dtype=torch.long)
                                                      for _ in range(3))
        self.logits = torch.zeros(model.cfg.vocab_size)
        self.starts = self.launches = 0

    def start(self, token, position):
        self.token_in.copy_(token.reshape(1))
        self.pos_in.fill_(position)
        self.starts += 1

    def launch(self):
        p = int(self.pos_in)
        logits, _ = self.model(self.token_in.view(1, 1), torch.tensor([[p]]), self.cache,
                               kv_len=p + 1)
        self.logits.copy_(logits[0, -1])
        self.token_out.copy_(logits[0, -1].argmax().view(1))
        self.token_in.copy_(self.token_out)
        self.pos_in.fill_(p + 1)
        self.launches += 1

    def check(self):
        pass


def test_engine_routes_greedy_plain_steps_through_the_kernel_and_chains_them(monkeypatch):
    """On the CPU, with the kernel stood in for by the model's own step: greedy plain requests
    start the kernel's chain once each at their prompt's end and then only launch, and give
    exactly the engine's plain tokens; speculative and sampled requests never touch it."""
    from flashdraft.backends import megakernel
    from flashdraft.config import SamplingParams
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.engine import Engine
    monkeypatch.setattr(megakernel, "DecodeMegakernel", _ChainedSteps)
    cfg = SHAPES["hd64-llama"]
    model = build_random_model(cfg, torch.float32, "cpu", seed=2)
    cpu = torch.device("cpu")
    plain_engine = Engine(model, cpu, torch.float32, 256, ())
    engine = Engine(model, cpu, torch.float32, 256, ())
    engine.decode_kernel = "megakernel"  # refused on a CPU at construction: the wiring only
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 30)]
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            assert _run(engine, prompt, greedy) == _run(plain_engine, prompt, greedy)
            mk = engine.megakernel
            assert isinstance(mk, _ChainedSteps) and mk.starts == i + 1
            assert mk.launches >= 19 * (i + 1)  # a step a token after the first
        before = (mk.starts, mk.launches)
        drafter = NgramDrafter((2,), cpu)
        spec = _run(engine, prompts[0], greedy, drafter, 3)
        assert spec == _run(plain_engine, prompts[0], greedy)
        sampled = SamplingParams(temperature=0.9, max_tokens=12, seed=3, ignore_eos=True)
        assert _run(engine, prompts[1], sampled) == _run(plain_engine, prompts[1], sampled)
        assert (mk.starts, mk.launches) == before


def _self_drafting(model, device, dtype):
    """A sampled speculative request whose draft model is the target itself, its one-token
    steps through the megakernel (or its stand-in): q = p row for row, so every draft is
    kept exactly when each step's input is the token drawn before it at its position."""
    from flashdraft.config import SamplingParams
    from flashdraft.drafters.draft_model import DraftModelDrafter
    from flashdraft.engine import Engine, RequestMetrics
    engine = Engine(model, device, dtype, 256, (), adaptive=False)  # a draft every step
    drafter = DraftModelDrafter(model, device, dtype, model.cfg.vocab_size,
                                decode_kernel="graph")
    drafter.use_megakernel = True  # built by ensure_capacity, as with decode_kernel="auto"
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=4, ignore_eos=True)
    prompt = torch.randint(0, model.cfg.vocab_size, (12,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    metrics = RequestMetrics()
    with torch.inference_mode():
        out = [t for s in engine.run(prompt, params, drafter, 4, metrics) for t in s.token_ids]
    assert len(out) == 40 and metrics.drafted_tokens >= 16
    return drafter, metrics


def test_draft_models_sampled_steps_feed_the_kernel_the_tokens_drawn(monkeypatch):
    from flashdraft.backends import megakernel
    monkeypatch.setattr(megakernel, "DecodeMegakernel", _ChainedSteps)
    model = build_random_model(SHAPES["hd64-llama"], torch.float32, "cpu", seed=2)
    drafter, metrics = _self_drafting(model, torch.device("cpu"), torch.float32)
    assert drafter.megakernel.launches >= metrics.drafted_tokens - metrics.target_passes
    assert metrics.acceptance_rate == 1.0, metrics.accepted_per_step


@pytest.mark.gpu
def test_draft_models_sampled_steps_through_the_megakernel():
    """The real kernel: its logits are not the graphs' bit for bit, so q is p only nearly."""
    cfg = SHAPES["hd128-split-down"]
    model = build_random_model(cfg, torch.bfloat16, "cuda", seed=3)
    drafter, metrics = _self_drafting(model, torch.device("cuda"), torch.bfloat16)
    assert drafter.megakernel is not None
    assert metrics.acceptance_rate >= 0.8, metrics.accepted_per_step
