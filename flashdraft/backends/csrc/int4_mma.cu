// Weight-only int4 product for up to 32 rows, y = x @ W^T + bias (or, GATED, SiLU(gate) * up
// of it, the MLP's first product and its activation in one kernel), on the tensor cores
// (mma.sync m16n8k16, bfloat16 in, float32 accumulate). Compiled at run time by NVRTC
// (flashdraft/mma.py) after csrc/common.cuh; no headers, so it builds wherever torch's CUDA
// build does.
//
// Why not Triton: Triton chooses the register layout of a dot operand itself, so packed int4
// tiles go through shared memory and are re-packed two bytes at a time (3.7-3.9 instructions
// a weight, the whole issue budget at full bandwidth). Here the weights are shuffled once at
// load time into the A operand's register layout (as Marlin does): each thread loads 32
// weights with one 16-byte load and turns them into A fragments with no re-packing.
//
// Layout (built by mma.pack_int4 from the int4 format of flashdraft.quant):
//   w  [n/16][groups][2 halves][32 lanes] x 16 bytes: lane (g = lane/4, t = lane%4) holds
//      for each of four 16x16 tiles jj one 32-bit word whose nibbles are, in order
//      n0..n7 = W[g][k0] W[g+8][k0] W[g][k2] W[g+8][k2] W[g][k1] W[g+8][k1] W[g][k3] W[g+8][k3]
//      (features relative to the 16-feature tile), so that one lop3 on (word >> 4i) yields the
//      bfloat16 pair of fragment register i. The inputs k0..k3 of (lane, half h, tile jj):
//      k0 + e = 8 * (8h + t + 4 * (jj >> 1)) + 4 * (jj & 1) + e within the group of 128,
//      chosen so that the same lane's x values are two contiguous 16-byte chunks per half
//      (and, with the 64-byte row padding of the x tile, conflict-free shared-memory loads).
//   sz [n/16][groups][8] x (scale | zero << 16, for feature g and g + 8), bfloat16 pairs.
// The weight of code q in a group with scale s and zero z is (q - 8) s + z. With FOLD (the
// default) a code becomes its operand with one lop3 a pair of weights (the bfloat16 pair
// 128 + q), a group's products go to a fresh accumulator d, x's group sums come from one more
// mma with an all-ones A, and the group is added in float32 as s d + (z - 136 s) sum x: about
// half the instructions a weight of the alternative (FOLD=0: each weight dequantized in full in
// two fma.rn.bf16x2, every group summed into one accumulator), which rounds each weight to
// bfloat16 where FOLD uses the exact quantized weight.
//
// Each warp's first GMAX groups of weights are loaded into registers before the wait for the
// previous kernel (griddepcontrol: programmatic dependent launch, set up by mma._launch; sm_90
// and newer).
//
// Work: block = TN tiles of 16 features x WK warps along K. Split s of the K range (gps
// groups) is gridDim.y; warp wk takes groups wk, wk + WK, ... of it into GMAX register slots,
// the first GMAX before the wait for the previous kernel. With STREAM, a warp may have more
// groups than slots: each slot is loaded again with the warp's group GMAX further on as soon as
// its group is multiplied, which keeps GMAX loads in flight a warp to the end of a long split
// (one block's fixed costs, staging x and adding up, then serve more weight bytes). Sums: a
// warp's groups in order (mma accumulate), then the WK warps in order (shared memory), then the
// splits in order by the last block to finish (float32 slices, a counter per block column).
// All of it is fixed by the weight's shape, and a row's result never depends on the other rows
// (an mma column is computed from its own B column), so 1 to 32 rows get bit-identical results:
// batch invariance, which speculative decoding needs to return exactly the tokens of plain
// decoding.

struct __align__(8) u32x2 { u32 x, y; };

#ifndef NB
#define NB 1  // row blocks of 8: rows <= 8 * NB
#endif
#ifndef TN
#define TN 4  // 16-feature tiles per block
#endif
#ifndef WK
#define WK 2  // warps along K per tile
#endif
#define WARPS (TN * WK)
#ifndef FOLD
#define FOLD 1  // 1: scale and zero applied per group in float32; 0: per weight in bf16 FMAs
#endif
#ifndef GATED
#define GATED 0  // 1: y = SiLU(gate) * up, features g and g + 8 of each tile being a gate and an up
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // resident blocks a multiprocessor the register budget must allow
#endif
#define ONES 0x3f803f80u  // the bfloat16 pair (1, 1)
#ifndef GMAX
#define GMAX 4  // register slots a warp (mma.py: GMAX one-shot, STREAM_SLOTS streamed)
#endif
#ifndef STREAM
#define STREAM 0  // 0: at most GMAX groups a warp, all loaded up front; 1: any number, streamed
#endif
#ifndef PROBE
#define PROBE 0  // measurement only, wrong output: 1 the weights loaded but not multiplied (no
                 // conversion, x not read, no mma)
#endif

__device__ __forceinline__ u32x4 load_stream(const u32x4* p) {
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32x2 load_pair(const u32x2* p) {
    u32x2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Nibbles 0 and 4 of q as (q - 8) * s + z, a bfloat16 pair (low half from nibble 0).
__device__ __forceinline__ u32 dequant(u32 q, u32 s2, u32 z2) {
    u32 v = biased(q), d;
    // 1 * v - 136 = q - 8, exact
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3f803f80u), "r"(0xc308c308u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(d), "r"(s2), "r"(z2));
    return v;
}

// The sums of the float32 slices p[0], p[slice], ... and of q's, each in order, all of a batch
// of eight slices in flight (P = 2: both; P = 1: p's only).
template <int P>
__device__ __forceinline__ void sum_slices(const float* p, const float* q, int splits,
                                           size_t slice, float* out) {
    float s[P] = {};
    for (int sp = 0; sp < splits; sp += 8) {
        float v[P][8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int i = 0; i < P; ++i)
                v[i][j] = sp + j < splits ? ld_cgf((i ? q : p) + (sp + j) * slice) : 0.f;
#pragma unroll
        for (int i = 0; i < P; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) s[i] += v[i][j];
    }
#pragma unroll
    for (int i = 0; i < P; ++i) out[i] = s[i];
}

__device__ __forceinline__ float with_bias(float v, const u16* bias, int f, int has_bias) {
    return has_bias ? v + lo_f32(bias[f]) : v;
}

struct Args {
    const u32x4* __restrict__ w;
    const u32x2* __restrict__ sz;
    const u16* __restrict__ x;
    const u16* __restrict__ bias;
    u16* __restrict__ y;
    float* __restrict__ parts;
    int* __restrict__ counters;
    int rows, n, k, ldx, ldy, gps, has_bias;
};

// A warp's register slots: GMAX groups of its tile (16-byte halves and scale pairs).
struct Weights {
    u32x4 wa[GMAX], wb[GMAX];
    u32x2 sc[GMAX];
};

// Group gr of this warp's tile into one slot.
__device__ __forceinline__ void load_group(u32x4& wa, u32x4& wb, u32x2& sc, const Args& a,
                                           int tile, int gr) {
    const int lane = threadIdx.x & 31;
    const size_t at = (size_t)tile * (a.k >> 7) + gr;
    wa = load_stream(a.w + at * 64 + lane);
    wb = load_stream(a.w + at * 64 + 32 + lane);
    sc = load_pair(a.sz + at * 8 + (lane >> 2));
}

// Block (column bx, split by)'s first GMAX groups of this warp into its slots.
__device__ __forceinline__ void load_weights(Weights& W, const Args& a, int bx, int by) {
    const int warp = threadIdx.x >> 5;
    const int tile = bx * TN + warp % TN, wk = warp / TN, groups = a.k >> 7;
    const int g0 = by * a.gps, g1 = min(g0 + a.gps, groups);
    if (tile >= (a.n >> 4)) return;
#pragma unroll
    for (int i = 0; i < GMAX; ++i) {
        const int gr = g0 + wk + i * WK;
        if (gr < g1) load_group(W.wa[i], W.wb[i], W.sc[i], a, tile, gr);
    }
}

// Block (column bx, split by) of `splits`, the first of its weights in W: stage x, multiply
// (streaming the rest of the split's weights through W), add the warps along K, then write y or
// this split's slice (and, last to finish its column, add the slices).
__device__ __forceinline__ void product(Weights& W, const Args& a, int bx, int by,
                                        int splits, unsigned char* smem, int* is_last) {
    const int rows = a.rows, n = a.n, gps = a.gps, has_bias = a.has_bias;
    const u16* __restrict__ bias = a.bias;
    u16* __restrict__ y = a.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = bx * TN + warp % TN, wk = warp / TN;
    const int groups = a.k >> 7;
    const int g0 = by * gps, g1 = min(g0 + gps, groups);
    const bool live = tile < (n >> 4);
    // x's rows over this split's inputs into shared memory (rows past `rows` are read as zeros
    // below). Row stride = 64 bytes more than a multiple of 128, so the lanes of a quarter-warp
    // hit distinct banks.
    const int stride = (gps << 7) + 32;  // bfloat16 elements
    u16* xs = (u16*)smem;
    const int chunks = (g1 - g0) << 4;  // 16-byte chunks of a row
    const int total = rows * chunks;
    for (int i = threadIdx.x; i < total; i += WARPS * 32) {
        const int r = i / chunks, c = i - r * chunks;
        const u32x4 v = *(const u32x4*)(a.x + (size_t)r * a.ldx + (g0 << 7) + c * 8);
        *(u32x4*)(xs + r * stride + c * 8) = v;
    }
    __syncthreads();

    float acc[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
    const int mine = live && g0 + wk < g1 ? (g1 - g0 - wk + WK - 1) / WK : 0;  // the warp's groups
#if STREAM
    for (int base = 0; base < mine; base += GMAX) {
#else
    {  // mine <= GMAX: the slots hold all of them
        const int base = 0;
#endif
#pragma unroll
        for (int i = 0; i < GMAX; ++i) {
            const int j = base + i, gr = g0 + wk + j * WK;  // the warp's group j, in slot i
            if (j >= mine) break;
#if FOLD
            // The group's sums of x (128 + q) and of x, the latter from an mma with all-ones A
            // (its C fragment holds sum x of rows 2t and 2t + 1, as d's does, and its rounding
            // follows d's, which the cancellation in s d + (z - 136 s) sum x needs: sums added
            // up apart measured less exact, and slower, in ).
            float d[NB][4], sx[NB][4];
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c) d[b][c] = sx[b][c] = 0.f;
#else
            const u32 s_lo = __byte_perm(W.sc[i].x, 0, 0x1010);
            const u32 z_lo = __byte_perm(W.sc[i].x, 0, 0x3232);
            const u32 s_hi = __byte_perm(W.sc[i].y, 0, 0x1010);
            const u32 z_hi = __byte_perm(W.sc[i].y, 0, 0x3232);
#endif
            const u16* xg = xs + ((gr - g0) << 7);
#if PROBE == 1
            // keeps the loads live, one bit of them into the sums
            acc[0][0] += __uint_as_float((W.wa[i].x ^ W.wa[i].w ^ W.wb[i].y ^ W.wb[i].z ^
                                          W.sc[i].x ^ W.sc[i].y) & 1u);
#pragma unroll
            for (int h = 0; h < 0; ++h) {
#else
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#endif
                const u32x4 q4 = h ? W.wb[i] : W.wa[i];
                const u32 qs[4] = {q4.x, q4.y, q4.z, q4.w};
                u32x4 xa[NB], xb[NB];
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const u16* xr = xg + (b * 8 + g) * stride;
                    xa[b] = xb[b] = u32x4{0u, 0u, 0u, 0u};
                    if (b * 8 + g < rows) {
                        xa[b] = *(const u32x4*)(xr + 8 * (8 * h + t));
                        xb[b] = *(const u32x4*)(xr + 8 * (8 * h + 4 + t));
                    }
                }
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const u32 q = qs[jj];
#if FOLD
                    const u32 a0 = biased(q), a1 = biased(q >> 4), a2 = biased(q >> 8),
                              a3 = biased(q >> 12);
#else
                    const u32 a0 = dequant(q, s_lo, z_lo), a1 = dequant(q >> 4, s_hi, z_hi);
                    const u32 a2 = dequant(q >> 8, s_lo, z_lo), a3 = dequant(q >> 12, s_hi, z_hi);
#endif
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        const u32x4 c = jj < 2 ? xa[b] : xb[b];
                        const u32 b0 = (jj & 1) ? c.z : c.x, b1 = (jj & 1) ? c.w : c.y;
#if FOLD
                        mma16816(d[b], a0, a1, a2, a3, b0, b1);
                        mma16816(sx[b], ONES, ONES, ONES, ONES, b0, b1);
#else
                        mma16816(acc[b], a0, a1, a2, a3, b0, b1);
#endif
                    }
                }
            }
#if FOLD
            // sum_k x (q - 8) s + z = s d + (z - 136 s) sum_k x; c < 2: feature g, else g + 8
            const float s0 = lo_f32(W.sc[i].x), s1 = lo_f32(W.sc[i].y);
            const float c0 = fmaf(-136.f, s0, hi_f32(W.sc[i].x));
            const float c1 = fmaf(-136.f, s1, hi_f32(W.sc[i].y));
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    acc[b][c] = fmaf(c < 2 ? c0 : c1, sx[b][c],
                                     fmaf(c < 2 ? s0 : s1, d[b][c], acc[b][c]));
#endif
#if STREAM
            // the slot's next group: the warp's group j + GMAX
            if (j + GMAX < mine) load_group(W.wa[i], W.wb[i], W.sc[i], a, tile, gr + GMAX * WK);
#endif
        }
    }

    // The WK warps of a tile, added in order by the first.
    float* red = (float*)(smem + rows * stride * 2);  // [WARPS][NB * 4][32]
    if (WK > 1) {
        if (wk > 0) {
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c) red[(warp * NB * 4 + b * 4 + c) * 32 + lane] = acc[b][c];
        }
        __syncthreads();
        if (wk == 0) {
#pragma unroll
            for (int j = 1; j < WK; ++j)
#pragma unroll
                for (int b = 0; b < NB; ++b)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        acc[b][c] += red[((warp + j * TN) * NB * 4 + b * 4 + c) * 32 + lane];
        }
    }

    // Fragment c of row block b: feature g + 8 (c >> 1), row 8 b + 2 t + (c & 1). GATED:
    // features g and g + 8 of a tile are the gate and the up of output column 8 tile + g, so
    // fragments c and c + 2 make one output.
    if (wk == 0 && live) {
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = b * 8 + 2 * t + (c & 1), f = tile * 16 + g + 8 * (c >> 1);
                if (row >= rows) continue;
                if (splits > 1)
                    a.parts[((size_t)by * rows + row) * n + f] = acc[b][c];
#if GATED
                else if (c < 2)
                    y[(size_t)row * a.ldy + tile * 8 + g] =
                        silu_mul(with_bias(acc[b][c], bias, f, has_bias),
                                 with_bias(acc[b][c + 2], bias, f + 8, has_bias));
#else
                else
                    y[(size_t)row * a.ldy + f] = to_bf16(with_bias(acc[b][c], bias, f, has_bias));
#endif
            }
    }
    if (splits == 1) return;

    // The last block of a column adds the splits' slices in order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *is_last = atomicAdd(&a.counters[bx], 1) == splits - 1;
    __syncthreads();
    if (!*is_last) return;
    __threadfence();
    float* __restrict__ parts = a.parts;
    const int f0 = bx * TN * 16, nf = min(TN * 16, n - f0);
    const size_t slice = (size_t)rows * n;
#if GATED
    const int outs = nf >> 1;  // output columns of this block column
    for (int i = threadIdx.x; i < rows * outs; i += WARPS * 32) {
        const int row = i / outs, j = i - row * outs;
        const int f = f0 + ((j >> 3) << 4) + (j & 7);
        const float* p = parts + (size_t)row * n + f;
        float gu[2];
        sum_slices<2>(p, p + 8, splits, slice, gu);
        y[(size_t)row * a.ldy + (f0 >> 1) + j] = silu_mul(with_bias(gu[0], bias, f, has_bias),
                                                          with_bias(gu[1], bias, f + 8, has_bias));
    }
#else
    for (int i = threadIdx.x; i < rows * nf; i += WARPS * 32) {
        const int row = i / nf, f = f0 + i - row * nf;
        float sum;
        sum_slices<1>(parts + (size_t)row * n + f, nullptr, splits, slice, &sum);
        y[(size_t)row * a.ldy + f] = to_bf16(with_bias(sum, bias, f, has_bias));
    }
#endif
    if (threadIdx.x == 0) a.counters[bx] = 0;
}

// Programmatic dependent launch: wait for the previous kernel's writes, then let the next
// kernel launch (it waits for ours in turn). Both are no-ops without the launch attribute.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// One block a (column, split): grid (columns, splits). The weights do not depend on the
// previous kernel: each warp's first GMAX groups are loaded before waiting for it.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) int4_mma(const u32x4* __restrict__ w, const u32x2* __restrict__ sz, const u16* __restrict__ x,
         const u16* __restrict__ bias, u16* __restrict__ y, float* __restrict__ parts,
         int* __restrict__ counters, int rows, int n, int k, int ldx, int ldy, int gps,
         int has_bias) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int is_last;
    const Args a = {w, sz, x, bias, y, parts, counters, rows, n, k, ldx, ldy, gps, has_bias};
    Weights W;
    load_weights(W, a, blockIdx.x, blockIdx.y);
    wait_for_previous_kernel();
    product(W, a, blockIdx.x, blockIdx.y, gridDim.y, smem, &is_last);
}

// The weight of the layout above as a bfloat16 [n, k] matrix, for products of more rows
// (prefill: dequantize once, then cuBLAS). One thread per 16-byte word group; each weight is
// computed by the same `dequant` as in int4_mma.
extern "C" __global__ void __launch_bounds__(256)
int4_dequant(const u32x4* __restrict__ w, const u32x2* __restrict__ sz, u16* __restrict__ out,
             int n, int k) {
    const int groups = k >> 7;
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= (long long)(n >> 4) * groups * 64) return;
    const int lane = (int)(i & 31), h = (int)((i >> 5) & 1);
    const long long at = i >> 6;  // tile * groups + group
    const int gr = (int)(at % groups), tile = (int)(at / groups);
    const int g = lane >> 2, t = lane & 3;
    const u32x4 q4 = w[i];
    const u32x2 sc = sz[at * 8 + g];
    const u32 s_lo = __byte_perm(sc.x, 0, 0x1010), z_lo = __byte_perm(sc.x, 0, 0x3232);
    const u32 s_hi = __byte_perm(sc.y, 0, 0x1010), z_hi = __byte_perm(sc.y, 0, 0x3232);
    const u32 qs[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        const int k0 = (gr << 7) + 8 * (8 * h + t + 4 * (jj >> 1)) + 4 * (jj & 1);
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // register r: feature g + 8 (r & 1), inputs k0 + 2 (r >> 1) + {0, 1}
            const u32 v = (r & 1) ? dequant(qs[jj] >> (4 * r), s_hi, z_hi)
                                  : dequant(qs[jj] >> (4 * r), s_lo, z_lo);
            const int f = tile * 16 + g + 8 * (r & 1);
            *(u32*)(out + (size_t)f * k + k0 + 2 * (r >> 1)) = v;
        }
    }
}
