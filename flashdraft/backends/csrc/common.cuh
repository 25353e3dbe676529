// What both kernels (int4_mma.cu, decode_mk.cu) take from one place: their integer types and
// bfloat16 helpers, the int4 codes' conversion and the tensor-core product. NVRTC compiles one
// string with no headers: flashdraft.mma.cuda_source puts this file in front of each kernel.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
struct __align__(16) u32x4 { u32 x, y, z, w; };

// bfloat16 pairs: the low and the high half of a word as float32; float32 to bfloat16, rounded
__device__ __forceinline__ float lo_f32(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f32(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u16 to_bf16(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// SiLU(gate) * up in float32, rounded once.
__device__ __forceinline__ u16 silu_mul(float gate, float up) {
    return to_bf16(gate / (1.f + __expf(-gate)) * up);
}

// Nibbles 0 and 4 of q as the bfloat16 pair 128 + nibble: (q & 0x000f000f) | 0x43004300.
__device__ __forceinline__ u32 biased(u32 q) {
    u32 v;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(v) : "r"(q), "r"(0x000f000fu), "r"(0x43004300u));
    return v;
}

// c += A B on the tensor cores: mma.sync m16n8k16, bfloat16 A (4 words) and B (2), float32 c
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A float32 written by another block: past L1, from the L2 ("memory": no load or store moves across it)
__device__ __forceinline__ float ld_cgf(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
