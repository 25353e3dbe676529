// Weight-only int4 product for up to 32 rows, y = x @ W^T + bias, on the tensor cores
// (mma.sync m16n8k16, bfloat16 in, float32 accumulate). Compiled at run time by NVRTC
// (flashdraft/mma.py); no headers, so it builds wherever torch's CUDA build does.
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
// Weight of code q in a group with scale s and zero z: (q - 8) * s + z.
//
// Work: grid (P, S). Split s of K (gps groups, the last shorter) is blockIdx.y; the block
// stages x over that range in shared memory once, with each row's sum over each group. Its
// warps are persistent: warp w of block b takes the 16-feature tiles b * WARPS + w, then every
// P * WARPS-th, and streams (tile, group) units through its own ring of D shared-memory stages
// (cp.async), so its weight loads stay in flight while it computes. A unit's codes become the
// A operand with one lop3 per pair of weights (the bfloat16 pair 128 + q); its sums d go to a
// fresh accumulator, and the group's scale and zero are applied in float32:
//     sum_k x (q - 8) s + z = s d + (z - 136 s) sum_k x.
// Sums: a tile's groups in order, then the splits in order by the warp that finishes a tile
// last (float32 slices, a counter per tile). All of it is fixed by the weight's shape (P only
// decides which warp does a tile, not how), and an mma column is computed from its own B
// column alone, so 1 to 32 rows get bit-identical results: batch invariance, which speculative
// decoding needs to return exactly the tokens of plain decoding.

typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(8) u32x2 { u32 x, y; };
struct __align__(8) f32x2 { float x, y; };

#ifndef NB
#define NB 1  // row blocks of 8: rows <= 8 * NB
#endif
#ifndef WARPS
#define WARPS 4  // warps a block
#endif
#ifndef D
#define D 8  // stages of a warp's ring
#endif
#define UNIT_W 1024  // bytes of codes a (tile, group) unit
#define UNIT 1088  // ... and its 8 scale/zero pairs

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void copy16(u32 dst, const void* src) {  // global -> shared, async
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ float load_cg(const float* p) {  // past L1: other warps' slices
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// (q - 8) * s + z for nibbles 0 and 4 of q, a bfloat16 pair rounded once (int4_dequant).
__device__ __forceinline__ u32 dequant(u32 q, u32 s2, u32 z2) {
    u32 v, d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(v) : "r"(q), "r"(0x000f000fu), "r"(0x43004300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3f803f80u), "r"(0xc308c308u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(d), "r"(s2), "r"(z2));
    return v;
}

// Nibbles 0 and 4 of q as the bfloat16 pair 128 + nibble: (q & 0x000f000f) | 0x43004300.
__device__ __forceinline__ u32 biased(u32 q) {
    u32 v;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(v) : "r"(q), "r"(0x000f000fu), "r"(0x43004300u));
    return v;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 to_bf16(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ float lo_f32(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f32(u32 v) { return __uint_as_float(v & 0xffff0000u); }

extern "C" __global__ void __launch_bounds__(WARPS * 32)
int4_mma(const u32x4* __restrict__ w, const u32x2* __restrict__ sz, const u16* __restrict__ x,
         const u16* __restrict__ bias, u16* __restrict__ y, float* __restrict__ parts,
         int* __restrict__ counters, int rows, int n, int k, int ldx, int ldy, int gps,
         int has_bias) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int groups = k >> 7, tiles = n >> 4, splits = gridDim.y;
    const int g0 = blockIdx.y * gps, ng = min(gps, groups - g0);
    // Shared memory: x [8 NB][stride] bf16 | sums [gps][8 NB] f32 | rings [WARPS][D][UNIT].
    // Row stride = 64 bytes more than a multiple of 128: a quarter-warp's loads hit distinct banks.
    const int stride = (gps << 7) + 32;
    u16* xs = (u16*)smem;
    float* sums = (float*)(smem + NB * 8 * stride * 2);
    unsigned char* ring = smem + NB * 8 * stride * 2 + gps * NB * 8 * 4 + warp * D * UNIT;

    // This warp's tiles: first, first + step, ...; its units (tile, group) in that order, the
    // next one to issue at (issue_tile, issue_group), unit u in stage u % D.
    const int first = blockIdx.x * WARPS + warp, step = gridDim.x * WARPS;
    const int units = first < tiles ? ((tiles - 1 - first) / step + 1) * ng : 0;
    // Pointers run along the units (a tile's groups, then a jump to the next tile's).
    const size_t unit0 = (size_t)first * groups + g0, jump = (size_t)step * groups - ng;
    const u32x4* wp = w + unit0 * 64 + lane;
    const u32x2* sp = sz + unit0 * 8 + 2 * lane;  // lanes 0-3: 16 bytes each
    const u32 stage0 = smem_addr(ring) + lane * 16;
    int issued = 0, issue_group = 0;
    auto issue = [&]() {  // the next unit's codes and scales into its stage
        if (issued < units) {
            const u32 st = stage0 + (issued % D) * UNIT;
            copy16(st, wp);
            copy16(st + 512, wp + 32);
            if (lane < 4) copy16(st + UNIT_W, sp);
            wp += 64, sp += 8;
            if (++issue_group == ng) issue_group = 0, wp += jump * 64, sp += jump * 8;
        }
        ++issued;
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // The weights do not depend on the previous kernel: start loading them before waiting.
#pragma unroll
    for (int u = 0; u < D - 1; ++u) issue();
    asm volatile("griddepcontrol.wait;" ::: "memory");

    // x over this split into shared memory (zeros past `rows`), then each row's group sums
    // (one warp a sum, in a fixed tree).
    const int chunks = ng << 4;  // 16-byte chunks of a row
    for (int i = threadIdx.x; i < NB * 8 * chunks; i += WARPS * 32) {
        const int r = i / chunks, c = i - r * chunks;
        u32x4 v = {0u, 0u, 0u, 0u};
        if (r < rows) v = *(const u32x4*)(x + (size_t)r * ldx + (g0 << 7) + c * 8);
        *(u32x4*)(xs + r * stride + c * 8) = v;
    }
    __syncthreads();
    for (int p = warp; p < NB * 8 * ng; p += WARPS) {
        const int r = p / ng, gi = p - r * ng;
        const u32x2 v = *(const u32x2*)(xs + r * stride + (gi << 7) + lane * 4);
        float s = (lo_f32(v.x) + hi_f32(v.x)) + (lo_f32(v.y) + hi_f32(v.y));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) sums[gi * NB * 8 + r] = s;
    }
    __syncthreads();

    float acc[NB][4];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
    // This lane's places: its x chunks, its 16 bytes of a stage, its scale pair, its row sums.
    const u16* x_lane = xs + g * stride + 8 * t;
    const unsigned char* codes_lane = ring + lane * 16;
    const unsigned char* scales_lane = ring + UNIT_W + g * 8;
    const float* sums_lane = sums + 2 * t;
    int tile = first, gi = 0;  // unit u's
    for (int u = 0; u < units; ++u) {
        __syncwarp();  // every lane is done with stage (u - 1) % D, which the next issue refills
        issue();
        asm volatile("cp.async.wait_group %0;" ::"n"(D - 1) : "memory");
        __syncwarp();  // the scales other lanes copied are visible
        const int stage = (u % D) * UNIT;
        const u16* xg = x_lane + (gi << 7);
        float d[NB][4];
#pragma unroll
        for (int b = 0; b < NB; ++b) d[b][0] = d[b][1] = d[b][2] = d[b][3] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32x4 q4 = *(const u32x4*)(codes_lane + stage + h * 512);
            const u32 qs[4] = {q4.x, q4.y, q4.z, q4.w};
            u32x4 xa[NB], xb[NB];
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                xa[b] = *(const u32x4*)(xg + b * 8 * stride + 64 * h);
                xb[b] = *(const u32x4*)(xg + b * 8 * stride + 64 * h + 32);
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const u32 q = qs[jj];
                const u32 a0 = biased(q), a1 = biased(q >> 4), a2 = biased(q >> 8),
                          a3 = biased(q >> 12);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const u32x4 c = jj < 2 ? xa[b] : xb[b];
                    mma(d[b], a0, a1, a2, a3, (jj & 1) ? c.z : c.x, (jj & 1) ? c.w : c.y);
                }
            }
        }
        // Fragment c of row block b: feature g + 8 (c >> 1), row 8 b + 2 t + (c & 1).
        const u32x2 sc = *(const u32x2*)(scales_lane + stage);
        const float s0 = lo_f32(sc.x), s1 = lo_f32(sc.y);
        const float c0 = fmaf(-136.f, s0, hi_f32(sc.x)), c1 = fmaf(-136.f, s1, hi_f32(sc.y));
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const f32x2 sx = *(const f32x2*)(sums_lane + gi * NB * 8 + b * 8);
            acc[b][0] = fmaf(c0, sx.x, fmaf(s0, d[b][0], acc[b][0]));
            acc[b][1] = fmaf(c0, sx.y, fmaf(s0, d[b][1], acc[b][1]));
            acc[b][2] = fmaf(c1, sx.x, fmaf(s1, d[b][2], acc[b][2]));
            acc[b][3] = fmaf(c1, sx.y, fmaf(s1, d[b][3], acc[b][3]));
        }
        if (++gi < ng) continue;

        // The tile's last group: its sums out, to y or to this split's slice.
        gi = 0;
        const int done = tile;
        tile += step;
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = b * 8 + 2 * t + (c & 1), f = done * 16 + g + 8 * (c >> 1);
                if (row < rows) {
                    if (splits == 1)
                        y[(size_t)row * ldy + f] =
                            to_bf16(acc[b][c] + (has_bias ? lo_f32(bias[f]) : 0.f));
                    else
                        parts[((size_t)blockIdx.y * rows + row) * n + f] = acc[b][c];
                }
                acc[b][c] = 0.f;
            }
        if (splits == 1) continue;
        // The warp that finishes a tile last adds the splits' slices in order.
        __threadfence();
        __syncwarp();
        int last = 0;
        if (lane == 0) last = atomicAdd(&counters[done], 1) == splits - 1;
        if (!__shfl_sync(0xffffffffu, last, 0)) continue;
        __threadfence();
        for (int i = lane; i < rows * 16; i += 32) {
            const int row = i >> 4, f = done * 16 + (i & 15);
            const float* p = parts + (size_t)row * n + f;
            const size_t slice = (size_t)rows * n;
            float s = 0.f;
            for (int sp = 0; sp < splits; sp += 8) {  // eight loads in flight, added in order
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = sp + j < splits ? load_cg(p + (sp + j) * slice) : 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) s += v[j];
            }
            y[(size_t)row * ldy + f] = to_bf16(s + (has_bias ? lo_f32(bias[f]) : 0.f));
        }
        if (lane == 0) counters[done] = 0;
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
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
