// One decode step (one token) of a dense bfloat16 decoder in one persistent kernel: the
// "megakernel" of flashdraft.megakernel. Compiled at run time by NVRTC for one model shape (the
// -D constants below), after csrc/common.cuh (flashdraft.mma.cuda_source); no headers.
//
// Why: a decode step of a small model is ~150 kernels whose fixed costs (ramp before the first
// weight bytes arrive, the tail of the last wave, the dependency round trip) add up to as much
// as the weight bytes themselves (docs/kernels.md). Here one block a
// multiprocessor runs every layer, and the weights never wait for the activations:
//
// - Producer warps stream the block's share of every weight matrix of the step, in the
//   order the step uses them, into a ring of NS shared-memory slots (NPROD warps taking turns
//   a chunk of whole rows, each lane copying 16 bytes at a time with cp.async; or, LDGSTS=0,
//   one bulk copy a chunk; completion counted on an mbarrier a slot). They wait only for a
//   free slot, never for a layer: while the consumers wait for the rest of the GPU (a
//   grid-wide dependency between two products, attention), the ring keeps filling.
// - NCW consumer warps run the ops in order. Before an op they wait until every block has
//   finished the op before (a counter per op: one acquire poll by one thread, then a named
//   barrier); after it they add one to its counter (release). Ops of a layer:
//     QKV   qkv = r · (W_qkv x) + b          r = 1 / rms(x), the norm folded into W_qkv
//     ATT   (Qwen3: RMSNorm of each q and k head,) rope on q and the new k, the new k and v
//           into the cache, attention over 0 .. pos
//           (units of (kv head, split of positions); once every unit of a head has written
//           its partials, each merges a slice of the head group's outputs)
//     O     x += W_o att
//     GU    h = SiLU(r · (W_gate x)) · (r · (W_up x))
//     DOWN  x += W_down h
//   then HEAD: logits = W_head (x / rms(x) · g_final), and each block's best logit; the last
//   block to finish picks the token (ties: the lower id), with `chain` leaves it and the next
//   position as the next step's inputs (the engine launches step after step), and resets the
//   counters.
// - Each output row's dot product is computed by one block: a warp (or, for long rows, NCW / R
//   warps' segments added in a fixed order: by DOWN at its end, by the other ops a chunk at a
//   time) over the row's chunk in shared memory, against x held in registers; the chunking
//   and the split of rows over blocks are fixed by the shape and the block count, so the
//   result does not depend on timing.
//
// Layout assumed (flashdraft.megakernel checks it): row-major bfloat16 matrices [out, in], the
// MLP's [gate; up] as one matrix of 2 I rows, the cache [layers, 2, 1, NKV, max_len, HD].
//
// Q4: every product and the head in int4 instead, in flashdraft.mma's layout (csrc/int4_mma.cu
// describes it): 16-feature tiles x groups of 128 inputs, 1 KB of codes a (tile, group) unit
// in the mma A operand's register order and 64 bytes of its scales and zeros; the MLP's rows
// in the gated order (a tile's features g and g + 8: the gate and the up of output 8 tile + g).
// The block norms are not folded into int4 weights (they would widen the group scales), so an
// op that follows a norm stages x as bf16(x r g), as the model's norm kernel rounds it. A chunk
// is CU consecutive units of the block's tiles (codes, then scales); warp w takes the units
// u = w mod NCW of the op, multiplies them on the tensor cores (mma.m16n8k16, every B column
// x) with int4_mma's FOLD (s d + (z - 136 s) sum x, the group sums of x taken in float32 once
// an op, while x is staged), and adds a tile's units in order; a tile's warps are added in
// warp order every Q4_FINISH_EVERY chunks (a barrier of the consumers each time), or at the
// op's end where the block's tiles all fit Shared.q4red. Q4_PARTS: O's and DOWN's (bit 2:
// gate/up's) tiles past an even share are split in halves between pairs of blocks (q4_share).
// The host runs int4 with NCW 12 (128 registers a thread), a unit's mma in Q4_CHAINS chains,
// tiles added every 8, 6, 3 or 1 chunks (the most that fits). Timings (benchmarks/RESULTS.md):
// faster than the graphs' int4 products on the 1.5B and 8B shapes, 14 % faster on the 32B,
// whose consumers barely keep up with the stream.

#ifndef H
#define H 1536  // hidden size
#endif
#ifndef INTER
#define INTER 8960  // MLP features
#endif
#ifndef NQ
#define NQ 12  // query heads
#endif
#ifndef NKV
#define NKV 2  // key/value heads
#endif
#ifndef HD
#define HD 128  // head dim (64 or 128)
#endif
#ifndef NL
#define NL 28  // layers
#endif
#ifndef VOCAB
#define VOCAB 151936
#endif
#ifndef QKV_BIAS
#define QKV_BIAS 1
#endif
#ifndef QK_NORM
#define QK_NORM 0  // Qwen3: an RMSNorm over each q and k head before rope (Args.qknorm)
#endif
#ifndef NS
#define NS 8  // ring slots
#endif
#ifndef SLOT
#define SLOT 24576  // bytes a slot
#endif
#ifndef NCW
#define NCW 8  // consumer warps
#endif
#ifndef LDGSTS
#define LDGSTS 0  // 1: the producer warp's 32 lanes copy each chunk with cp.async (16 bytes a lane)
#endif
#ifndef NPROD
#define NPROD 1  // producer warps: producer i copies the chunks c with c % NPROD == i
#endif
static_assert(NPROD <= NS, "a producer's wait for its slot assumes its previous wait covers "
              "the slot's use before the last: NPROD at most NS");
#ifndef NOCOMPUTE
#define NOCOMPUTE 0  // measurement only, wrong output: consumers take each chunk, multiply nothing
#endif
#ifndef ACCS
#define ACCS 1  // independent FMA chains a lane a row (shorter latency a chunk)
#endif
#ifndef OREG
#define OREG 0  // bfloat16: each layer's first chunk of O read into the consumers' registers
                // before attention, past the ring (a slot more of gate/up while the chain runs)
#endif
#ifndef FENCES
#define FENCES 0  // 1: a fence.sc on each side of a counter (0: its release/acquire alone, as
                  // CUTLASS's grid barrier: bar.sync, then one thread's red.release / ld.acquire)
#endif
#ifndef LLX
#define LLX 0  // 1: x travels with its writer's flag (each 8-byte word: 2 bf16 and the step/op
               // that wrote them, as NCCL's LL protocol): QKV, GU and HEAD poll x itself instead
               // of a counter and then x, one round trip fewer a dependency
#endif
#ifndef LLA
// Attention's inputs and outputs with their writer's flag, as LLX's x (bits, each one round
// trip fewer a layer where it replaces a counter): 1 q, k and v (QKV's rows in pairs; a unit
// polls its heads' words instead of QKV's counter, blocks without a unit wait for nothing),
// 2 the units' partials (the merge polls them instead of its kv head's counter), 4 the
// attention's output (O polls it instead of attention's counter). bfloat16.
#define LLA 0
#endif
#ifndef LLH
#define LLH 0  // 1: the MLP's h with its writer's flag (GU's rows in pairs): DOWN's lanes poll
               // their pieces of h instead of GU's counter. bfloat16.
#endif
#ifndef LL_BACKOFF
#define LL_BACKOFF 0  // ns a poll of flagged data (LLX, LLA, LLH) sleeps after a round that found
                      // a stale word (0: none): fewer loads on the L2 beside the weight stream
#endif
#define LL_XO (LLX || (LLA & 1) || LLH)  // Shared.xo: a block's rows of x, q/k/v or h going out
#define LL_XS (LLX || (LLA & 4))  // Shared.u.xs: an op's polled input
#ifndef TRACE
#define TRACE 0  // 1: the global timer at each op's wait, start, first chunk and end (Args.trace)
#endif
#ifndef INFLIGHT
// chunks a block's producers have in flight at most (0: every free slot's); bfloat16 2: the
// consumers' own loads queue behind fewer (the 1.5B 1.088-1.099 → 1.069-1.078 ms);
// a ring of an odd number of slots 3 where it divides them, else 1 (see the wait's comment)
#define INFLIGHT (Q4 || NS < 4 ? 0 : NS % 2 == 0 ? 2 : NS % 3 == 0 ? 3 : 1)
#endif
#ifndef NOWAIT
#define NOWAIT 0  // measurement only, wrong output: no op waits for the one before
#endif
#ifndef Q4
#define Q4 0  // 1: int4 weights in flashdraft.mma's layout (see above); 0: bfloat16, norms folded
#endif
#define QD (NQ * HD)
#define KVD (NKV * HD)
#define NQKV (QD + 2 * KVD)
#define GS (NQ / NKV)  // query heads a kv head
#define EPL (HD / 32)  // head elements a lane
#define CT (NCW * 32)  // consumer threads
#define NOPS (5 * NL + 1)
#ifndef RED_ROWS
#define RED_ROWS 64  // rows of x a block's DOWN writes at most (flashdraft.megakernel checks)
#endif
#define SPIN_LIMIT (1u << 22)  // polls before a wait gives up (~seconds; a step waits microseconds)

#ifndef XO_ROWS
#define XO_ROWS 66  // rows of x, q/k/v or h a block writes (flashdraft.megakernel checks it)
#endif
// Args.table a layer: wqkv, bqkv (0: none), wo, w_gate_up, w_down; Q4: then the four products'
// scales (sqkv, so, sgu, sdown) and the two block norms' weights (attn_norm, mlp_norm)
#define TBL (Q4 ? 11 : 5)
#define Q4_UNIT 1088  // bytes a (16-feature tile, 128-input group) unit: codes, scales and zeros
#define CU (SLOT / Q4_UNIT)  // Q4: units a chunk
#define KMAX (H > QD ? (H > INTER ? H : INTER) : (QD > INTER ? QD : INTER))
#define KMIN (H < QD ? (H < INTER ? H : INTER) : (QD < INTER ? QD : INTER))
#ifndef Q4_PARTS
#define Q4_PARTS 0  // Q4: tiles past an even share split in halves (q4_share): bits, 1 O's and
                    // DOWN's, 2 gate/up's
#endif
#ifndef Q4_FINISH_EVERY
#define Q4_FINISH_EVERY 1  // Q4: chunks between two additions of ended tiles (each a block-wide
                           // barrier) where the block's tiles do not all fit Shared.q4red
#endif
// Q4: tiles whose warps' sums wait in Shared.q4red at once: those Q4_FINISH_EVERY chunks end
// (added after them), and those the next chunks' warps may store meanwhile
#define RT (2 * (Q4_FINISH_EVERY * CU / (KMIN / 128)) + 4)
#define SIDE_MAX 256  // Q4: rows of a bias or residual a block takes (flashdraft.megakernel checks)
enum { OP_QKV = 0, OP_ATT = 1, OP_O = 2, OP_GU = 3, OP_DOWN = 4, OP_HEAD = 5 };

struct Args {
    const u64* table;      // [NL][TBL]: see TBL
    const u16* embed;      // [VOCAB][H]
    const u16* head;       // [VOCAB][H]
    const u16* fnorm;      // [H]
    const u16* qknorm;     // QK_NORM: [NL][2][HD], the q and k heads' norm weights
    const float* inv_freq; // [HD / 2]
    u16* kv;               // cache
    long long* token;      // the step's token and position; with chain set, the step leaves
    long long* pos;        // its own token and the next position here (steps chain, no copies)
    u16* x;                // [H] the residual stream
    u16* qkv;              // [NQKV]
    u16* att;              // [QD]
    u16* hbuf;             // [INTER]
    float* part;           // attention partials [NKV][G WH][GS][HD], then [NKV][G WH][GS][2]
    float* logits;         // [VOCAB]
    float* best;           // [G][2]: value, id (as float bits)
    u32* counters;         // [NOPS + NKV], zero between steps
    long long* out_token;
    u32* error;            // set when a wait gave up
    u64* trace;            // TRACE: [G][NOPS][8] consumer times, then [G][NOPS][2] producer's
    u32* step_count;       // LLX, LLA, LLH, Q4_PARTS: steps run so far (flags name the step)
    int max_len;
    float eps;
    int chain;
    const unsigned char* head_sz;  // Q4: the head's scales and zeros (head: its codes)
    u64* xpart;            // Q4_PARTS: a pair's second half-tile sums, (value, flag) words
};

// -- small helpers --------------------------------------------------------------------------------

__device__ __forceinline__ float bf(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ float round_bf16(float v) { return bf(to_bf16(v)); }

__device__ __forceinline__ u32x4 ld_cg4(const void* p) {  // other blocks' outputs: past L1
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ld_cg(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u16 ld_cg16(const u16* p) {
    u16 v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Polls *p until it reaches target (false: SPIN_LIMIT polls went by), one load at a time: every
// block polls the same word, and 2 or 4 loads in flight a block made each wait 0.3-0.7 µs
// longer (the 1.5B bf16 1.089 → 1.151 / 1.243 ms).
__device__ __forceinline__ bool poll_until(const u32* p, u32 target) {
    for (u32 spins = 0; spins < SPIN_LIMIT; spins++)
        if (ld_acquire(p) >= target) return true;
    return false;
}
// An 8-byte word that carries its writer's flag (LLX's x, Q4_PARTS's sums): value v, flag f,
// read past L1 in one access, so a matching flag vouches for the value beside it.
__device__ __forceinline__ void ld_word(const void* p, u32& v, u32& f) {
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(f) : "l"(p));
}
__device__ __forceinline__ u32 atom_add_acq_rel(u32* p) {
    u32 v;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 gtime() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
// TRACE: consumer time k of op j (0 wait began, 1 wait ended, 2 first chunk in / partials
// written, 3 op ended; attention: 4 its loads in, 5 its counter back, 6 the splits' max and
// sum in, 7 merged; Q4 products: 4 x staged, 5 x loaded); producer time k of op j (0 first
// chunk issued, 1 last chunk issued)
#define TR(j, k) do { if (TRACE && threadIdx.x == 0) \
    a.trace[((size_t)blockIdx.x * NOPS + (j)) * 8 + (k)] = gtime(); } while (0)
#define TRP(j, k) do { if (TRACE) a.trace[(size_t)gridDim.x * NOPS * 8 + \
    ((size_t)blockIdx.x * NOPS + (j)) * 2 + (k)] = gtime(); } while (0)
__device__ __forceinline__ void red_release(u32* p) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(p) : "memory");
}
__device__ __forceinline__ void consumer_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(CT) : "memory");
}
// The greedy token's rule, everywhere a best logit is kept: (v, id) replaces the best if its
// logit is larger, or equal with a lower id.
__device__ __forceinline__ void take_best(float& best_v, int& best_i, float v, int id) {
    if (v > best_v || (v == best_v && id < best_i)) { best_v = v; best_i = id; }
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 addr = smem_addr(bar), done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Rows [r0, r1) of an n-row op j for block b of G. The blocks that take one row more than the
// others rotate from op to op, so that no block takes the extra rows of every op.
__device__ __forceinline__ void rows_of(int n, int j, int b, int G, int& r0, int& r1) {
    const bool pairs = j < 5 * NL && ((LLX && (j % 5 == 2 || j % 5 == 4))  // x's writers
                                      || ((LLA & 1) && j % 5 == 0)            // q, k, v's
                                      || (LLH && j % 5 == 3));                // h's
    if (pairs) n /= 2;  // whole 8-byte words (row pairs) a block
    const int base = n / G, rem = n % G;
    const int vb = (b + j * 53) % G;
    r0 = vb * base + min(vb, rem);
    r1 = r0 + base + (vb < rem ? 1 : 0);
    if (pairs) { r0 *= 2; r1 *= 2; }
}

// Q4: a block's tiles of an op of T tiles, NG groups each. With `halves` (Q4_PARTS: q4_halves),
// where some blocks would take a whole tile more than others (T % G tiles past T / G
// each, 2 (T % G) <= G; the 32B's 320 tiles: 2 or 3 a block, down's ends 8 µs apart), those
// tiles are split in halves over the inputs instead: the first 2 (T % G) blocks (rows_of's
// rotation) each take half a tile besides their T / G whole ones. A pair's first block (the
// owner) runs its half last and adds the second's sums, which that block ran first and sent
// as (value, flag) words in Args.xpart: no block waits on the other at the op's end.
struct Share {
    int t0, t1;  // whole tiles [t0, t1)
    int pt;      // the half tile (-1: none), its groups [g0, g1), its pair's index
    int g0, g1, pair;
    bool owner;
};
// Whether Q4_PARTS splits an op's tiles in halves: O or DOWN (o_down), gate/up (gu).
__host__ __device__ constexpr bool q4_halves(bool o_down, bool gu) {
    return ((Q4_PARTS & 1) && o_down) || ((Q4_PARTS & 2) && gu);
}
__device__ __forceinline__ Share q4_share(int T, int NG, int j, int b, int G, bool halves) {
    Share sh;
    sh.pt = -1;
    sh.g0 = sh.g1 = sh.pair = 0;
    sh.owner = false;
    const int base = T / G, rem = T % G;
    if (!halves || base == 0 || rem == 0 || 2 * rem > G) {
        rows_of(T, j, b, G, sh.t0, sh.t1);
        return sh;
    }
    const int vb = (b + j * 53) % G;
    sh.t0 = vb * base;
    sh.t1 = sh.t0 + base;
    if (vb < 2 * rem) {
        sh.pair = vb >> 1;
        sh.owner = (vb & 1) == 0;
        sh.pt = base * G + sh.pair;
        sh.g0 = sh.owner ? 0 : NG / 2;
        sh.g1 = sh.owner ? NG / 2 : NG;
    }
    return sh;
}

// Rows of an op of k inputs a chunk: the most up to 16 that fit a slot and that the consumer
// warps take evenly (a multiple of NCW: rows a warp; a divisor: warps a row). With 8 warps, the
// powers of two; with 9 (a 27 KB slot: 9 rows of 1,536), 9, 3 or 1. One expression, no loop:
// next_chunk asks it of a k known only at run time.
__host__ __device__ constexpr bool rows_even(int r) { return r % NCW == 0 || NCW % r == 0; }
#define RPC_(r, rest) (rows_even(r) && 2 * k * (r) <= SLOT ? (r) : (rest))
__host__ __device__ constexpr int rows_per_chunk(int k) {
    return RPC_(16, RPC_(15, RPC_(14, RPC_(13, RPC_(12, RPC_(11, RPC_(10, RPC_(9, RPC_(8,
           RPC_(7, RPC_(6, RPC_(5, RPC_(4, RPC_(3, RPC_(2, 1)))))))))))))));
}
#undef RPC_
// OREG where O's rows are whole a warp: O's first chunk goes to registers, not to the ring
#define O_HELD (OREG && !Q4 && rows_per_chunk(QD) >= NCW)
static_assert(Q4 || (2 * INTER <= SLOT && 2 * H <= SLOT && 2 * QD <= SLOT),
              "a row must fit a slot");
static_assert(H % 8 == 0 && INTER % 8 == 0 && QD % 8 == 0, "rows are read in 16-byte pieces");
static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
static_assert(INFLIGHT <= NS / 2 && (INFLIGHT == 0 || NS % INFLIGHT == 0),
              "INFLIGHT: at most half the ring's slots, and a divisor of them");

// -- the weight stream: the same sequence of chunks for the producer and the consumers ---------

struct Chunk {
    const unsigned char* src;  // bytes to the slot's start
    const unsigned char* src2;  // Q4: the units' scales, bytes2 of them to the slot's CU KB
    u32 bytes, bytes2;
    int j, first;  // the op's index (5 * layer + ...), whether the chunk is the op's first
};

struct Cursor {  // position in the block's sequence of weight chunks
    int layer, op, i;  // op: 0 QKV, 1 O, 2 GU, 3 DOWN, 4 HEAD; i: chunk within the op
};

// Op `op` of a layer (4: the head): its rows n, inputs k, index j, weights w (Q4: codes) and,
// Q4, scales sz.
__device__ __forceinline__ void op_matrix(const Args& a, int layer, int op, int& n, int& k,
                                          int& j, const unsigned char*& w,
                                          const unsigned char*& sz) {
    const u64* t = a.table + TBL * layer;
    sz = nullptr;
    if (op == 4) {
        n = VOCAB; k = H; j = 5 * NL; w = (const unsigned char*)a.head; sz = a.head_sz;
        return;
    }
    const int col = op == 0 ? 0 : op + 1;  // wqkv, (bqkv,) wo, w_gate_up, w_down
    n = op == 0 ? NQKV : op == 2 ? (Q4 ? 2 * INTER : INTER) : H;
    k = op == 1 ? QD : op == 3 ? INTER : H;
    j = 5 * layer + (op == 0 ? 0 : op + 1);
    w = (const unsigned char*)t[col];
    if (Q4) sz = (const unsigned char*)t[5 + op];
}

__device__ __forceinline__ bool next_chunk(const Args& a, Cursor& c, int b, int G, Chunk& out) {
    while (c.layer <= NL) {
        const int op = c.layer == NL ? 4 : c.op;
        int n, k, j;
        const unsigned char *w, *sz;
        op_matrix(a, c.layer, op, n, k, j, w, sz);
        int total, r = 1, r0, r1, skip = 0;
        Share sh;  // Q4: the block's whole tiles, and (Q4_PARTS) its half tile
        int cw = 0, ca = 0;  // chunks of the whole tiles, of the half
        if (Q4) {  // CU units a chunk of the block's tiles; the half's own chunks
            sh = q4_share(n / 16, k / 128, j, b, G, q4_halves(op == 1 || op == 3, op == 2));
            cw = ((sh.t1 - sh.t0) * (k / 128) + CU - 1) / CU;
            ca = (sh.g1 - sh.g0 + CU - 1) / CU;
            total = cw + ca;
        } else {  // r whole rows a chunk; GU: a chunk of gate rows, then the same of up rows
            r = rows_per_chunk(k);
            rows_of(n, j, b, G, r0, r1);
            const int chunks = (r1 - r0 + r - 1) / r;
            skip = O_HELD && op == 1;  // O's first chunk: the consumers' registers (OREG)
            total = op == 2 ? 2 * chunks : chunks - skip;
        }
        if (c.i < total) {
            if (Q4) {  // the half first, unless the block owns it (then last)
                const int first = sh.owner ? cw : ca;
                const bool half = (c.i < first) != sh.owner;
                const int u = (c.i < first ? c.i : c.i - first) * CU;
                const int units = half ? sh.g1 - sh.g0 : (sh.t1 - sh.t0) * (k / 128);
                const size_t at = half ? (size_t)sh.pt * (k / 128) + sh.g0 + u
                                       : (size_t)sh.t0 * (k / 128) + u;
                const u32 nu = (u32)min(CU, units - u);
                out.src = w + at * 1024;
                out.bytes = nu * 1024;
                out.src2 = sz + at * 64;
                out.bytes2 = nu * 64;
            } else {
                const int ci = (op == 2 ? c.i >> 1 : c.i) + skip;
                const int row = r0 + ci * r + (op == 2 && (c.i & 1) ? INTER : 0);
                const int nr = min(r, r1 - r0 - ci * r);
                out.src = w + (size_t)row * k * 2;
                out.bytes = (u32)(nr * k * 2);
                out.src2 = nullptr;
                out.bytes2 = 0;
            }
            out.j = j;
            out.first = c.i == 0;
            c.i++;
            return true;
        }
        c.i = 0;
        if (op == 4) { c.layer = NL + 1; break; }
        if (++c.op == 4) { c.op = 0; c.layer++; }
    }
    return false;
}

// -- shared memory --------------------------------------------------------------------------------

// Attention's warps: a head of the group a warp, WH warps a head where the group has fewer heads
// than the block has warps, HPW heads a warp where it has more.
constexpr int WH = GS <= NCW ? NCW / GS : 1;
constexpr int HPW = (GS + NCW - 1) / NCW;
// Keys and values staged a round of KS positions at a time, in NB buffers: ATT_KS, else (Q4,
// whose product x shares the space) the most up to 32 that fit beside it, else 8.
#ifndef ATT_KS
#define ATT_KS 0
#endif
constexpr int NB = 2;
__host__ __device__ constexpr int kv_bytes(int ks) { return NB * 2 * ks * HD * 2; }
__host__ __device__ constexpr int att_ks() {
    int ks = 8;
    while (ks < 32 && kv_bytes(2 * ks) <= (Q4 ? 2 * KMAX : 0)) ks *= 2;
    return ATT_KS ? ATT_KS : ks;
}
constexpr int KS = att_ks();
#define ATT_SPLITS 64  // units a kv head the merge's space holds at least (more: longer units)
constexpr int ATT_MERGE = WH * (4 * GS * HD + 16 * ATT_SPLITS) + 8 * WH * GS * ATT_SPLITS;
constexpr int ATT_BYTES = kv_bytes(KS) > ATT_MERGE ? kv_bytes(KS) : ATT_MERGE;

union __align__(16) AttState {  // attention: the staged keys and values, or the merge's loads
    u16 kv[NB][2][KS][HD];
    unsigned char bytes[ATT_BYTES];
};

struct Shared {
    u64 full[NS], empty[NS];
    float red[RED_ROWS][NCW];     // DOWN: segment sums of rows split over warps
    float red_chunk[2][NCW];      // other ops: a chunk's segment sums (alternate chunks)
    float ss[NCW];                // a segment's sum of squares of x (rows split over warps)
#if LL_XO
    u16 xo[XO_ROWS];              // the block's rows of x (O, DOWN), q/k/v or h, before they go out
#endif
    float best_v[NCW];
    int best_i[NCW];
#if Q4
    float q4red[RT + (Q4_PARTS != 0)][NCW][16];  // a tile's sums a warp, until its warps are added
                                          // (Q4_PARTS: the half tile's in the last)
    float sx[KMAX / 128];         // the op's group sums of x (float32, taken while staging x)
    __align__(16) u16 side[SIDE_MAX];  // the block's rows of the bias or the residual
#endif
    // attention's state, (Q4) a product's x, or (LLX, LLA 4) an op's polled input (x or att,
    // bf16 pairs), never two at once: a barrier of the consumers between any two
    union __align__(16) {
        AttState at;
        u16 xq[Q4 ? KMAX : 8];
#if LL_XS
        u32 xs[((LLA & 4) && QD > H ? QD : H) / 2];
#endif
    } u;
};

__device__ __forceinline__ unsigned char* slot_ptr(unsigned char* ring, u32 c) {
    return ring + (size_t)(c % NS) * SLOT;
}

// -- consumers: waits and signals between ops -----------------------------------------------------

__device__ __forceinline__ void wait_op(const Args& a, int j, int G) {
    TR(j + 1, 0);
    if (!NOWAIT && threadIdx.x == 0) {
        if (!poll_until(&a.counters[j], (u32)G)) atomicExch(a.error, 1u + j);
        if (FENCES) __threadfence();
    }
    consumer_sync();
    TR(j + 1, 1);
}

__device__ __forceinline__ void signal_op(const Args& a, int j) {
    consumer_sync();  // every consumer thread's stores are issued
    TR(j, 3);
    if (threadIdx.x == 0) {
        if (FENCES) __threadfence();
        red_release(&a.counters[j]);
    }
}

// -- LLX, LLA, LLH: data with its writer's flag ---------------------------------------------------

// A buffer's writes in a step: x's by O of layer l are write 2 l, by DOWN of layer l 2 l + 1;
// q/k/v's, the partials' and att's (LLA) and h's (LLH), each written once a layer, 2 l. A flag
// names the step and the write (LLX: x's words; LLA: attention's; LLH: h's; Q4_PARTS: the half
// tiles' sums); the step counter only grows (zero in the buffer: never a flag).
__device__ __forceinline__ u32 x_flag(u32 step, int w) {
    return step * (u32)(2 * NL) + (u32)w + 1u;
}
__device__ __forceinline__ void ll_backoff() {
    if (LL_BACKOFF) __nanosleep(LL_BACKOFF);
}

// A flagged buffer of 32-bit values (2 bf16 or a float): value i at u32 2 i, its flag at 2 i + 1,
// so that bf16 element e's word starts at u32 e (e even) and float i's at 2 i.
// N values (1 or 2) at p, each with flag f, in one store.
template <int N>
__device__ __forceinline__ void st_flagged(u32* p, const u32* v, u32 f) {
    if (N == 2)
        asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v[0]), "r"(f), "r"(v[1]), "r"(f) : "memory");
    else
        asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};"
                     :: "l"(p), "r"(v[0]), "r"(f) : "memory");
}
// N values (1 or 2) at p in one load: whether each carried `want`.
template <int N>
__device__ __forceinline__ bool ld_flagged(const u32* p, u32* v, u32 want) {
    u32 f0, f1;
    if (N == 2) {
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[0]), "=r"(f0), "=r"(v[1]), "=r"(f1) : "l"(p));
        return f0 == want && f1 == want;
    }
    ld_word(p, v[0], f0);
    return f0 == want;
}

// A thread's poll of N items of flagged data: each round, load(i) issues the load of every item
// not yet seen with its flag (ok[i] false) and says whether it now is, all before any is
// waited for; until every item is, or SPIN_LIMIT rounds went by (then the error code err: the
// op's index + 1, as a counter's wait gives). Once a wait of the step gave up, a poll gives up
// within ERR_EVERY rounds (a flag that never comes costs one SPIN_LIMIT a step, not one a poll).
#define ERR_EVERY 1024u
template <int N, typename Load>
__device__ __forceinline__ void poll_items(const Args& a, u32 err, bool* ok, Load load) {
    for (u32 spins = 0;; spins++) {
        bool all = true;
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (!ok[i]) ok[i] = load(i);
            all = all && ok[i];
        }
        if (all) break;
        if (spins == SPIN_LIMIT) { atomicExch(a.error, err); break; }
        if (spins % ERR_EVERY == ERR_EVERY - 1 && ld_cg(a.error)) break;
        ll_backoff();
    }
}

// Every consumer thread: the K bf16 of a flagged buffer (x, or att) in 16-byte pieces (2
// words) until each carries `want`, into s.u.xs.
template <int K>
__device__ __forceinline__ void poll_x(const Args& a, Shared& s, const u16* src, u32 want,
                                       int j) {
#if LL_XS
    constexpr int NU = (K / 4 + CT - 1) / CT;
    const u32* xw = (const u32*)src;
    bool ok[NU];
    u32 d[NU][2];
#pragma unroll
    for (int i = 0; i < NU; i++) ok[i] = threadIdx.x + i * CT >= K / 4;
    poll_items<NU>(a, 1u + j, ok, [&](int i) {
        return ld_flagged<2>(xw + 4 * (threadIdx.x + i * CT), d[i], want);
    });
#pragma unroll
    for (int i = 0; i < NU; i++)
        if (threadIdx.x + i * CT < K / 4) {
            s.u.xs[2 * (threadIdx.x + i * CT)] = d[i][0];
            s.u.xs[2 * (threadIdx.x + i * CT) + 1] = d[i][1];
        }
    consumer_sync();
#endif
}

// This lane's NV 16-byte pieces of a flagged bf16 buffer (pieces i0, i0 + 32, ..., below
// end; 4 words and their flags each) into xw, once every word carries `want`.
template <int NV>
__device__ __forceinline__ void poll_pieces(const Args& a, const u32* src, int i0, int end,
                                            u32 want, int j, u32x4* xw) {
    bool ok[2 * NV];  // item i: half i % 2 of piece i / 2
#pragma unroll
    for (int i = 0; i < 2 * NV; i++) ok[i] = i0 + 32 * (i / 2) >= end;
    poll_items<2 * NV>(a, 1u + j, ok, [&](int i) {
        u32 d[2];
        const bool got = ld_flagged<2>(src + 8 * (i0 + 32 * (i / 2)) + 4 * (i % 2), d, want);
        if (i % 2 == 0) { xw[i / 2].x = d[0]; xw[i / 2].y = d[1]; }
        else { xw[i / 2].z = d[0]; xw[i / 2].w = d[1]; }
        return got;
    });
}

// Rows ra and rb of x (either < 0: none), each from its word once that carries `want`.
__device__ __forceinline__ void ll_rows(const Args& a, int ra, int rb, u32 want, int j,
                                        u16& va, u16& vb) {
    const u32* xw = (const u32*)a.x;
    const int r[2] = {ra, rb};
    u32 d[2] = {0u, 0u};
    bool ok[2] = {ra < 0, rb < 0};
    poll_items<2>(a, 1u + j, ok, [&](int i) {
        return ld_flagged<1>(xw + 2 * (r[i] >> 1), &d[i], want);
    });
    va = (u16)(ra & 1 ? d[0] >> 16 : d[0]);
    vb = (u16)(rb & 1 ? d[1] >> 16 : d[1]);
}

// HEAD: each warp's best logit (every lane of a warp holds it) to the block's, into a.best
// (ties: the lower id).
__device__ __forceinline__ void block_best(const Args& a, Shared& s, int b, float best_v,
                                           int best_i) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { s.best_v[warp] = best_v; s.best_i[warp] = best_i; }
    consumer_sync();
    if (threadIdx.x == 0) {
        float bv = s.best_v[0];
        int bi = s.best_i[0];
        for (int w = 1; w < NCW; w++) take_best(bv, bi, s.best_v[w], s.best_i[w]);
        a.best[2 * b] = bv;
        a.best[2 * b + 1] = __int_as_float(bi);
    }
}

// -- consumers: a matrix op -----------------------------------------------------------------------

// An op's input x (QKV at layer 0: the token's embedding row) and its epilogue's other input
// a row (QKV: the bias, nullptr without; O: x of the layer before, at layer 0 the embedding
// row; DOWN: x from O; GU and HEAD: none). tok: the token, read at layer 0 only.
template <int KIND>
__device__ __forceinline__ const u16* op_input(const Args& a, int layer, long long tok) {
    return KIND == OP_O ? a.att : KIND == OP_DOWN ? a.hbuf
         : (layer == 0 && KIND == OP_QKV) ? a.embed + (size_t)tok * H : a.x;
}
template <int KIND>
__device__ __forceinline__ const u16* op_side(const Args& a, int layer, long long tok) {
    return KIND == OP_QKV ? (QKV_BIAS ? (const u16*)a.table[TBL * layer + 1] : nullptr)
         : KIND == OP_O ? (layer == 0 ? a.embed + (size_t)tok * H : a.x)
         : KIND == OP_DOWN ? a.x : nullptr;
}
// An op's bf16 output (HEAD's logits are float: none).
template <int KIND>
__device__ __forceinline__ u16* op_output(const Args& a) {
    return KIND == OP_QKV ? a.qkv : KIND == OP_GU ? a.hbuf : KIND == OP_HEAD ? nullptr : a.x;
}
// Whether an op's rows go out with their writer's flag, through Shared.xo at the op's end: x's
// (LLX: O, DOWN), q/k/v's (LLA 1), h's (LLH).
__host__ __device__ constexpr bool flagged_out(int kind) {
    return (LLX && (kind == OP_O || kind == OP_DOWN)) || ((LLA & 1) && kind == OP_QKV)
        || (LLH && kind == OP_GU);
}
// Row `row` (of the block's rows from r0) of an op's output: into Shared.xo where it goes out
// with its flag, else straight to the output.
template <int KIND>
__device__ __forceinline__ void put_row(const Args& a, Shared& s, int row, int r0, u16 v) {
#if LL_XO
    if (flagged_out(KIND)) { s.xo[row - r0] = v; return; }
#endif
    op_output<KIND>(a)[row] = v;
}

// OREG: this warp's rows of O's first chunk of `layer`, as matrix_op reads them from a slot
// ([row a warp][piece a lane]; zeros past the block's rows), asked for before attention so
// that they land while it runs.
#define O_RPW (rows_per_chunk(QD) >= NCW ? rows_per_chunk(QD) / NCW : 1)
#define O_NV ((QD / 8 + 31) / 32)
__device__ __forceinline__ void hold_rows(const Args& a, int layer, int b, int G, u32x4* held) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0, r1;
    rows_of(H, 5 * layer + 2, b, G, r0, r1);
    const int nr = min(rows_per_chunk(QD), r1 - r0);
    const u16* w = (const u16*)a.table[TBL * layer + 2];
#pragma unroll
    for (int rr = 0; rr < O_RPW; rr++) {
        const int r = warp + NCW * rr;
#pragma unroll
        for (int v = 0; v < O_NV; v++) {
            const int idx = lane + 32 * v;
            held[rr * O_NV + v] = {0u, 0u, 0u, 0u};
            if (r < nr && idx < QD / 8)
                held[rr * O_NV + v] = ld_cg4(w + (size_t)(r0 + r) * QD + 8 * idx);
        }
    }
}

// One op's products for this block: its rows of W (streamed into the ring) against x (in each
// lane's registers), with the op's epilogue. c: the consumers' chunk count (the slot sequence).
template <int K, int KIND>
__device__ void matrix_op(const Args& a, Shared& s, unsigned char* ring, u32& c, int layer,
                          int b, int G, u32 step, int wait_j, const u32x4* held = nullptr) {
    constexpr int R = rows_per_chunk(K);
    constexpr int WPR = R >= NCW ? 1 : NCW / R;   // warps a row
    constexpr int RPW = R >= NCW ? R / NCW : 1;   // rows a warp a chunk
    constexpr int NVEC = K / 8;                    // 16-byte pieces a row
    constexpr int VS = (NVEC + WPR - 1) / WPR;     // pieces a warp's segment
    constexpr int NV = (VS + 31) / 32;             // pieces a lane
    // Rows split over warps: DOWN adds the segments at the op's end (its rows fit Shared.red);
    // the other ops (long rows: hidden size over 1,536) add them a chunk at a time.
    constexpr bool SPLIT_CHUNK = WPR > 1 && KIND != OP_DOWN;
    static_assert(!LLX || !SPLIT_CHUNK, "LLX takes a warp a row in QKV, O, GU and HEAD");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = warp % WPR, wrow = warp / WPR;
    const int v_end = min(NVEC, (seg + 1) * VS);
    const long long tok = layer > 0 ? 0 : *a.token;  // read where the embedding is x

    const u16* src = op_input<KIND>(a, layer, tok);
    int n, j;
    if (KIND == OP_QKV) { n = NQKV; j = 5 * layer; }
    else if (KIND == OP_O) { n = H; j = 5 * layer + 2; }
    else if (KIND == OP_GU) { n = INTER; j = 5 * layer + 3; }
    else if (KIND == OP_DOWN) { n = H; j = 5 * layer + 4; }
    else { n = VOCAB; j = 5 * NL; }
    int r0, r1;
    rows_of(n, j, b, G, r0, r1);
    // The epilogue's other input a row (QKV: the bias; O and DOWN: the residual), loaded for
    // all of the block's rows at once, lane i holding rows i and i + 32 (side loads in a chunk's
    // epilogue would wait a round trip to the L2 a chunk). QKV's and O's (x of the layer before)
    // are asked for before the op's wait.
    constexpr bool SIDE = KIND == OP_QKV ? QKV_BIAS
                        : (KIND == OP_O || (KIND == OP_DOWN && WPR == 1));
    constexpr bool SIDE_EARLY = KIND == OP_QKV || KIND == OP_O;
    const u16* side_src = op_side<KIND>(a, layer, tok);
    const bool side_all = r1 - r0 <= 64;
    // LLX: the residual (x from DOWN of the layer before, for O; from O, for DOWN) by its flag
    const bool ll_side = LLX && (KIND == OP_O ? layer > 0 : KIND == OP_DOWN);
    u16 side0w = 0, side1w = 0;
    auto load_side = [&]() {
        if (r0 + lane < r1) side0w = ld_cg16(side_src + r0 + lane);
        if (r0 + lane + 32 < r1) side1w = ld_cg16(side_src + r0 + lane + 32);
    };
    if (SIDE && SIDE_EARLY && side_all && !ll_side) load_side();
    if (wait_j >= 0) wait_op(a, wait_j, G);
    // LLX: x read by QKV (past layer 0), GU and HEAD comes from polling x itself (the op's
    // wait); LLA 4: O's att likewise
    constexpr bool POLL = LLX && (KIND == OP_QKV || KIND == OP_GU || KIND == OP_HEAD);
    constexpr bool POLL_ATT = (LLA & 4) && KIND == OP_O;
    const bool polled = (POLL && !(KIND == OP_QKV && layer == 0)) || POLL_ATT;
    if (polled) {
        TR(j, 0);
        poll_x<K>(a, s, src, x_flag(step, POLL_ATT || KIND == OP_GU ? 2 * layer : 2 * layer - 1),
                  j);
        TR(j, 1);
    }
    u32x4 xw[NV];  // x's words: every load of the op's inputs in flight before any is used
#pragma unroll
    for (int v = 0; v < NV; v++) {
        const int idx = seg * VS + lane + 32 * v;
        xw[v] = {0u, 0u, 0u, 0u};
#if LL_XS
        if (polled) {
            if (idx < v_end) xw[v] = *(const u32x4*)(s.u.xs + 4 * idx);
            continue;
        }
#endif
        if (idx < v_end && !(LLH && KIND == OP_DOWN)) xw[v] = ld_cg4(src + 8 * idx);
    }
    if (LLH && KIND == OP_DOWN) {  // each lane's pieces of h (the warps' segments part it)
        TR(j, 0);
        poll_pieces<NV>(a, (const u32*)src, seg * VS + lane, v_end, x_flag(step, 2 * layer), j,
                        xw);
        TR(j, 1);
    }
    u16 resid_w = 0;  // DOWN over several warps a row: thread r's row r0 + r's residual
    const u32 resid_flag = x_flag(step, KIND == OP_O ? 2 * layer - 1 : 2 * layer);
    if (ll_side) {
        if (SIDE) {
            ll_rows(a, r0 + lane < r1 ? r0 + lane : -1, r0 + lane + 32 < r1 ? r0 + lane + 32 : -1,
                    resid_flag, j, side0w, side1w);
        } else if (KIND == OP_DOWN && WPR > 1) {
            u16 none;
            const int t = threadIdx.x;
            ll_rows(a, t < r1 - r0 ? r0 + t : -1, -1, resid_flag, j, resid_w, none);
        }
    } else {
        if (SIDE && !SIDE_EARLY && side_all) load_side();
        if (KIND == OP_DOWN && WPR > 1 && threadIdx.x < r1 - r0)
            resid_w = ld_cg16(a.x + r0 + threadIdx.x);
    }
    float xr[NV * 8];
#pragma unroll
    for (int v = 0; v < NV; v++) {
        const u32x4 q = xw[v];
        xr[8 * v + 0] = lo_f32(q.x); xr[8 * v + 1] = hi_f32(q.x);
        xr[8 * v + 2] = lo_f32(q.y); xr[8 * v + 3] = hi_f32(q.y);
        xr[8 * v + 4] = lo_f32(q.z); xr[8 * v + 5] = hi_f32(q.z);
        xr[8 * v + 6] = lo_f32(q.w); xr[8 * v + 7] = hi_f32(q.w);
    }
    float scale = 1.f;
    if (KIND == OP_QKV || KIND == OP_GU || KIND == OP_HEAD) {  // RMS of x: a warp holds all of it
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < NV * 8; i++) ss = fmaf(xr[i], xr[i], ss);
        ss = warp_sum(ss);
        if (WPR > 1) {  // each warp holds a segment: the segments' sums added in order
            if (wrow == 0 && lane == 0) s.ss[seg] = ss;
            consumer_sync();
            ss = 0.f;
#pragma unroll
            for (int sg = 0; sg < WPR; sg++) ss += s.ss[sg];
        }
        scale = rsqrtf(ss / (float)K + a.eps);
    }
    if (KIND == OP_HEAD) {  // the final norm, rounded as its own kernel would round it
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int idx = seg * VS + lane + 32 * v;
            if (idx < v_end) {
                u32x4 g = *(const u32x4*)(a.fnorm + 8 * idx);
                const u32 gw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    xr[8 * v + 2 * e] = round_bf16(xr[8 * v + 2 * e] * scale * lo_f32(gw[e]));
                    xr[8 * v + 2 * e + 1] =
                        round_bf16(xr[8 * v + 2 * e + 1] * scale * hi_f32(gw[e]));
                }
            }
        }
        scale = 1.f;
    }

    const int chunks = (r1 - r0 + R - 1) / R;
    const int total = KIND == OP_GU ? 2 * chunks : chunks;
    const float side0 = bf(side0w), side1 = bf(side1w);
    float gate[RPW];
    float best_v = -3.0e38f;
    int best_i = 0x7fffffff;

    constexpr bool HELD = O_HELD && KIND == OP_O;  // chunk 0 in `held` (hold_rows), not the ring
    static_assert(!HELD || (WPR == 1 && RPW == O_RPW && NV == O_NV),
                  "hold_rows lays O's rows out as this loop reads a slot");
    for (int i = 0; i < total; c += !(HELD && i == 0), i++) {  // (a held chunk takes no slot)
        const int ci = KIND == OP_GU ? i >> 1 : i;
        const int nr = min(R, r1 - r0 - ci * R);
        const bool regs = HELD && i == 0;
        if (!regs) mbar_wait(&s.full[c % NS], (c / NS) & 1);
        if (i == 0) TR(j, 2);
        const u16* w = (const u16*)slot_ptr(ring, c);
#pragma unroll
        for (int rr = 0; rr < RPW; rr++) {
            const int r = wrow + NCW * rr;
            if (!NOCOMPUTE && r < nr) {
                const u32x4* row = (const u32x4*)(w + (size_t)r * K);
                float part[ACCS];  // ACCS independent chains of FMAs, added at the end
#pragma unroll
                for (int k = 0; k < ACCS; k++) part[k] = 0.f;
#pragma unroll
                for (int v = 0; v < NV; v++) {
                    const int idx = seg * VS + lane + 32 * v;
                    if ((NVEC % (32 * WPR) == 0) || idx < v_end) {
                        const u32x4 q = regs ? held[rr * NV + v] : row[idx];
                        float& acc = part[v % ACCS];
                        acc = fmaf(lo_f32(q.x), xr[8 * v + 0], acc);
                        acc = fmaf(hi_f32(q.x), xr[8 * v + 1], acc);
                        acc = fmaf(lo_f32(q.y), xr[8 * v + 2], acc);
                        acc = fmaf(hi_f32(q.y), xr[8 * v + 3], acc);
                        acc = fmaf(lo_f32(q.z), xr[8 * v + 4], acc);
                        acc = fmaf(hi_f32(q.z), xr[8 * v + 5], acc);
                        acc = fmaf(lo_f32(q.w), xr[8 * v + 6], acc);
                        acc = fmaf(hi_f32(q.w), xr[8 * v + 7], acc);
                    }
                }
                float acc = part[0];
#pragma unroll
                for (int k = 1; k < ACCS; k++) acc += part[k];
                acc = warp_sum(acc);
                if (SPLIT_CHUNK) {  // the row's warps meet; its first warp adds and finishes it
                    if (lane == 0) s.red_chunk[i & 1][warp] = acc;
                    asm volatile("bar.sync %0, %1;" :: "r"(2 + wrow), "n"(WPR * 32) : "memory");
                    if (seg != 0) continue;
                    acc = 0.f;
#pragma unroll
                    for (int sg = 0; sg < WPR; sg++) acc += s.red_chunk[i & 1][warp + sg];
                }
                const int row_id = r0 + ci * R + r;  // the op's output feature
                if (KIND == OP_DOWN && WPR > 1) {
                    if (lane == 0) s.red[ci * R + r][seg] = acc;
                } else if (KIND == OP_QKV || KIND == OP_O || KIND == OP_DOWN) {
                    float other = 0.f;
                    if (SIDE) {
                        const int lr = row_id - r0;
                        const float mine = __shfl_sync(0xffffffffu, side0, lr & 31);
                        const float mine1 = __shfl_sync(0xffffffffu, side1, lr & 31);
                        other = side_all ? (lr < 32 ? mine : mine1)
                                         : bf(ld_cg16(side_src + row_id));
                    }
                    if (lane == 0)  // QKV: the bias; O, DOWN: the residual
                        put_row<KIND>(a, s, row_id, r0,
                                      to_bf16(KIND == OP_QKV ? acc * scale + other : other + acc));
                } else if (KIND == OP_GU) {
                    const float y = round_bf16(acc * scale);
                    if ((i & 1) == 0) {
                        gate[rr] = y;
                    } else {
                        if (lane == 0) put_row<KIND>(a, s, row_id, r0, silu_mul(gate[rr], y));
                    }
                } else {  // HEAD
                    const float y = round_bf16(acc);
                    if (lane == 0) a.logits[row_id] = y;
                    take_best(best_v, best_i, y, row_id);
                }
            }
        }
        if (regs) continue;
        __syncwarp();
        if (lane == 0) mbar_arrive(&s.empty[c % NS]);
    }
    if (KIND == OP_DOWN && WPR > 1) {  // DOWN over several warps a row: segments added in order
        consumer_sync();
        for (int r = threadIdx.x; r < r1 - r0; r += CT) {
            float acc = 0.f;
#pragma unroll
            for (int sg = 0; sg < WPR; sg++) acc += s.red[r][sg];
            const float resid = r == threadIdx.x ? bf(resid_w) : bf(ld_cg16(a.x + r0 + r));
            const u16 v = to_bf16(resid + acc);
            put_row<KIND>(a, s, r0 + r, r0, v);
        }
    }
#if LL_XO
    if (flagged_out(KIND)) {  // the block's rows of the output, a word with its flag each
        consumer_sync();
        const u32 flag = x_flag(step, 2 * layer + (KIND == OP_DOWN));
        u32* xw = (u32*)op_output<KIND>(a);
        for (int t = threadIdx.x; t < (r1 - r0) / 2; t += CT) {
            const u32 d = (u32)s.xo[2 * t] | ((u32)s.xo[2 * t + 1] << 16);
            st_flagged<1>(xw + 2 * ((r0 >> 1) + t), &d, flag);
        }
    }
#endif
    if (KIND == OP_HEAD) block_best(a, s, b, best_v, best_i);
}

// -- consumers: an int4 matrix op (Q4) -------------------------------------------------------

#if Q4
#ifndef Q4_PROBE
#define Q4_PROBE 0  // measurement only, wrong output: 1 x not loaded (the codes stand in), 2 no
                    // int4 conversion (the codes are the operand), 3 no mma (one FMA instead),
                    // 4 codes not read from shared memory
#endif
#ifndef Q4_CHAINS
#define Q4_CHAINS 2  // accumulators a unit's 8 mma are spread over (1, 2 or 4), added at its end:
                     // 2 measured 1-3 % faster a step than 1 or 4
#endif

// One (tile, group) unit against x (s.xq): the mma's C fragment in d, from the lane's A words
// of the unit's two 16-byte halves at w and w + 512 bytes in shared memory (gr: the group).
// Every B column is x, so every lane's d[0] and d[2] are features g and g + 8 of the tile
// (int4_mma.cu: the B fragments and the k order of a lane). One unit a warp at a time: 2 to 4
// units' chains interleaved measured slower; the unit's own 8 mma in two chains
// (Q4_CHAINS) faster. No branch around an mma: under one, the compiler puts a
// warp sync before each.
__device__ __forceinline__ void q4_unit(const u16* xq, int gr, const unsigned char* w, int t,
                                        float* d) {
    float part[Q4_CHAINS > 1 ? 4 * (Q4_CHAINS - 1) : 1] = {};  // chains 1 .. Q4_CHAINS - 1
#pragma unroll
    for (int h = 0; h < 2; h++) {  // Q4_PROBE 4: codes made up from the address, not read
        const u32x4 q4 = Q4_PROBE == 4 ? u32x4{(u32)(size_t)w, (u32)(size_t)w >> 4, 7u * h, 3u}
                       : *(const u32x4*)(w + 512 * h);
#pragma unroll
        for (int p = 0; p < 2; p++) {  // inputs 8 (8 h + 4 p + t) .. + 8: A words 2 p, 2 p + 1
            const u32x4 xv = Q4_PROBE == 1 ? q4
                           : *(const u32x4*)(xq + gr * 128 + 8 * (8 * h + 4 * p + t));
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int ch = (4 * h + 2 * p + e) % Q4_CHAINS;
                float* dc = ch == 0 ? d : part + 4 * (ch - 1);
                const u32 b0 = e ? xv.z : xv.x, b1 = e ? xv.w : xv.y;
                const u32 q = p == 0 ? (e ? q4.y : q4.x) : (e ? q4.w : q4.z);
                if (Q4_PROBE == 2)  // no conversion: the codes as the operand
                    mma16816(dc, q, q ^ b0, q ^ b1, q + 1, b0, b1);
                else if (Q4_PROBE == 3)  // no mma: the operands folded in with one FMA
                    d[0] = fmaf(__uint_as_float(biased(q) ^ biased(q >> 4) ^ biased(q >> 8)
                                                ^ biased(q >> 12)),
                                __uint_as_float(b0 ^ b1), d[0]);
                else
                    mma16816(dc, biased(q), biased(q >> 4), biased(q >> 8), biased(q >> 12),
                             b0, b1);
            }
        }
    }
#pragma unroll
    for (int ch = 1; ch < Q4_CHAINS; ch++) {  // features g and g + 8: d[0], d[2]
        d[0] += part[4 * (ch - 1)];
        d[2] += part[4 * (ch - 1) + 2];
    }
}

// The ends of tiles [t_lo, t_hi) of the block's (its first: t0): each tile's warps added in
// order, then the op's epilogue (QKV: + bias; O, DOWN: + residual into x; GU: SiLU(gate) up;
// HEAD: the logit, and the thread's best so far).
template <int KIND>
__device__ __forceinline__ void q4_finish(const Args& a, Shared& s, int t0, int t_lo, int t_hi,
                                          float& best_v, int& best_i) {
    constexpr int PER = KIND == OP_GU ? 8 : 16;  // outputs a tile
    for (int idx = threadIdx.x; idx < (t_hi - t_lo) * PER; idx += CT) {
        const int tl = t_lo + idx / PER, f = idx % PER;
        float* red = &s.q4red[tl % RT][0][0];
        float y = 0.f, up = 0.f;
#pragma unroll
        for (int w = 0; w < NCW; w++) {  // zeroed behind: a warp without a unit of a tile
            y += red[16 * w + f];         // (fewer groups than warps) leaves its zero
            red[16 * w + f] = 0.f;
            if (KIND == OP_GU) { up += red[16 * w + f + 8]; red[16 * w + f + 8] = 0.f; }
        }
        const int row = (t0 + tl) * 16 + f;  // the output feature (GU: stored order)
        if (KIND == OP_QKV) {
            a.qkv[row] = to_bf16(QKV_BIAS ? y + bf(s.side[tl * 16 + f]) : y);
        } else if (KIND == OP_O || KIND == OP_DOWN) {
            a.x[row] = to_bf16(bf(s.side[tl * 16 + f]) + round_bf16(y));
        } else if (KIND == OP_GU) {
            a.hbuf[(t0 + tl) * 8 + f] = silu_mul(y, up);
        } else {
            const float v = round_bf16(y);
            a.logits[row] = v;
            take_best(best_v, best_i, v, row);
        }
    }
    __syncwarp();
}

// Q4: the op's x into s.u.xq (NORM: bf16(x r g), as the model's norm kernel rounds it), the
// block's side rows (bias, residual) of tiles [t0, t1) and of tile pt (>= 0: the half tile it
// owns) after them into s.side, and each group's sum of x into s.sx; one round trip to the L2
// for all of it.
// j: the op (TRACE's index); wait_j: the op to wait for first (-1: none). What does not
// depend on it (the token, the norm's weights, the bias, O's residual: x of the layer before)
// is asked for before the wait: the norms' and the bias's loads wait for the table's pointers,
// a round trip ahead of them (the 1.5B int4 step 0.816-0.822 → 0.782 ms).
template <int K, int KIND>
__device__ __forceinline__ void q4_stage(const Args& a, Shared& s, int layer, int j, int t0,
                                         int t1, int pt, int wait_j, int G) {
    constexpr bool NORM = KIND == OP_QKV || KIND == OP_GU || KIND == OP_HEAD;
    constexpr int NP = (K / 8 + CT - 1) / CT;  // 16-byte pieces of x a thread
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long tok = layer > 0 ? 0 : *a.token;  // read where the embedding is x
    const u16* src = op_input<KIND>(a, layer, tok);
    const u64* tb = a.table + TBL * layer;
    const u16* side = op_side<KIND>(a, layer, tok);
    u32x4 gw[NP];  // the norm's weights of this thread's pieces
    if (NORM) {
        const u16* nw = KIND == OP_HEAD ? a.fnorm : (const u16*)tb[KIND == OP_QKV ? 9 : 10];
#pragma unroll
        for (int p = 0; p < NP; p++) {
            const int i = threadIdx.x + p * CT;
            if (i < K / 8) gw[p] = *(const u32x4*)(nw + 8 * i);
        }
    }
    auto copy_side = [&]() {
        for (int i = threadIdx.x; i < (t1 - t0) * 2; i += CT)
            cp_async16(s.side + 8 * i, side + t0 * 16 + 8 * i);
        if (Q4_PARTS && pt >= 0 && threadIdx.x < 2)
            cp_async16(s.side + (t1 - t0) * 16 + 8 * threadIdx.x, side + pt * 16 + 8 * threadIdx.x);
    };
    if (side && KIND != OP_DOWN) copy_side();  // DOWN's residual comes from O
    if (wait_j >= 0) wait_op(a, wait_j, G);
    for (int i = threadIdx.x; i < K / 8; i += CT) cp_async16(s.u.xq + 8 * i, src + 8 * i);
    if (side && KIND == OP_DOWN) copy_side();
    asm volatile("cp.async.wait_all;" ::: "memory");
    consumer_sync();
    TR(j, 5);
    float r = 1.f;
    if (NORM) {  // r = 1 / rms(x): the warps' sums of squares added in order
        float ss = 0.f;
#pragma unroll
        for (int p = 0; p < NP; p++) {
            const int i = threadIdx.x + p * CT;
            if (i < K / 8) {
                const u32x4 q = *(const u32x4*)(s.u.xq + 8 * i);
                const u32 qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    ss = fmaf(lo_f32(qw[e]), lo_f32(qw[e]), ss);
                    ss = fmaf(hi_f32(qw[e]), hi_f32(qw[e]), ss);
                }
            }
        }
        ss = warp_sum(ss);
        if (lane == 0) s.ss[warp] = ss;
        consumer_sync();
        ss = 0.f;
#pragma unroll
        for (int w = 0; w < NCW; w++) ss += s.ss[w];
        r = rsqrtf(ss / (float)K + a.eps);
    }
    // x as the products take it (NORM: bf16(x r g), as the model's norm kernel rounds it), and
    // each group's sum of it: a piece's 8 values in order, then the group's 16 pieces (16
    // lanes) in a fixed tree. In float32 FMAs, not from the mma that forms d: the FOLD's
    // cancellation loses ~1e-6 of a group's sum this way, far below the output's bf16 rounding.
    for (int p = 0; p < NP; p++) {
        const int i = threadIdx.x + p * CT;
        float sum = 0.f;
        if (i < K / 8) {
            u32x4* at = (u32x4*)(s.u.xq + 8 * i);
            const u32x4 q = *at;
            u32 qw[4] = {q.x, q.y, q.z, q.w};
            if (NORM) {
                const u32 nw[4] = {gw[p].x, gw[p].y, gw[p].z, gw[p].w};
#pragma unroll
                for (int e = 0; e < 4; e++)
                    qw[e] = (u32)to_bf16(lo_f32(qw[e]) * r * lo_f32(nw[e]))
                          | ((u32)to_bf16(hi_f32(qw[e]) * r * hi_f32(nw[e])) << 16);
                *at = u32x4{qw[0], qw[1], qw[2], qw[3]};
            }
#pragma unroll
            for (int e = 0; e < 4; e++) sum += lo_f32(qw[e]) + hi_f32(qw[e]);
        }
#pragma unroll
        for (int o = 8; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if ((lane & 15) == 0 && i < K / 8) s.sx[i / 16] = sum;  // K / 8: whole groups of 16
    }
    consumer_sync();
    TR(j, 4);
}

// Unit ui of a chunk in `slot` (group gr of its tile) against x into a warp's sums of features
// g and g + 8 (g = lane / 4; lanes with lane % 4 == 0 hold them after the tile's units).
__device__ __forceinline__ void q4_acc(const Shared& s, const unsigned char* slot, int ui, int gr,
                                       int lane, float& acc0, float& acc1) {
    const int t = lane & 3, g = lane >> 2;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if (!NOCOMPUTE) q4_unit(s.u.xq, gr, slot + (size_t)ui * 1024 + 16 * lane, t, d);
    const uint2 sc = *(const uint2*)(slot + CU * 1024 + ui * 64 + 8 * g);
    // sum_k x (q - 8) s + z = s d + (z - 136 s) sum_k x (int4_mma.cu's FOLD)
    const float s0 = lo_f32(sc.x), s1 = lo_f32(sc.y), sxg = s.sx[gr];
    acc0 = fmaf(fmaf(-136.f, s0, hi_f32(sc.x)), sxg, fmaf(s0, d[0], acc0));
    acc1 = fmaf(fmaf(-136.f, s1, hi_f32(sc.y)), sxg, fmaf(s1, d[2], acc1));
}

// Q4_PARTS (O, DOWN; gate/up): the block's half tile (q4_share), chunk by chunk from the ring,
// its warps' sums added in order. The pair's second block sends them as (value, flag) words
// (gate/up's in the second half of Args.xpart, as O's share a layer's flag); the owner asks for
// those before its own half runs, adds them after its own, and writes the tile's rows of x (its
// residual staged in s.side after the whole tiles' rows) or of h.
template <int KIND>
__device__ __forceinline__ void q4_half(const Args& a, Shared& s, unsigned char* ring, u32& c,
                                        const Share& sh, int j, u32 flag) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int units = sh.g1 - sh.g0, chunks = (units + CU - 1) / CU;
    u64* words = a.xpart + (size_t)sh.pair * 16 + (KIND == OP_GU ? 8 * gridDim.x : 0);
    u32 pv = 0u, pf = 0u;
    if (sh.owner && threadIdx.x < 16) ld_word(words + threadIdx.x, pv, pf);
    float acc0 = 0.f, acc1 = 0.f;
    for (int i = 0; i < chunks; i++, c++) {
        const int u0 = i * CU, nu = min(CU, units - u0);
        mbar_wait(&s.full[c % NS], (c / NS) & 1);
        if (i == 0 && !sh.owner) TR(j, 2);
        const unsigned char* slot = slot_ptr(ring, c);
        for (int u = u0 + (warp - u0 % NCW + NCW) % NCW; u < u0 + nu; u += NCW)
            q4_acc(s, slot, u - u0, sh.g0 + u, lane, acc0, acc1);
        __syncwarp();
        if (lane == 0) mbar_arrive(&s.empty[c % NS]);
    }
    if ((lane & 3) == 0) {  // every warp, with or without units
        s.q4red[RT][warp][lane >> 2] = acc0;
        s.q4red[RT][warp][(lane >> 2) + 8] = acc1;
    }
    consumer_sync();
    if (threadIdx.x < 16) {
        const int f = threadIdx.x;
        float y = 0.f;
#pragma unroll
        for (int w = 0; w < NCW; w++) y += s.q4red[RT][w][f];
        if (!sh.owner) {
            asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};"
                         :: "l"(words + f), "r"(__float_as_uint(y)), "r"(flag) : "memory");
        } else {
            for (u32 spins = 0; pf != flag; spins++) {  // gives up as poll_items does
                if (spins == SPIN_LIMIT) { atomicExch(a.error, 1u + j); break; }
                if (spins % ERR_EVERY == ERR_EVERY - 1 && ld_cg(a.error)) break;
                ld_word(words + f, pv, pf);
            }
            y += __uint_as_float(pv);
            if (KIND == OP_GU) {  // features f < 8: gates, f + 8: their ups (lanes 0-15)
                const float up = __shfl_down_sync(0xffffu, y, 8);
                if (f < 8) a.hbuf[sh.pt * 8 + f] = silu_mul(y, up);
            } else {
                a.x[sh.pt * 16 + f] = to_bf16(bf(s.side[(sh.t1 - sh.t0) * 16 + f])
                                              + round_bf16(y));
            }
        }
    }
}

// One op's int4 products for this block: x staged (normed where a norm comes first), the
// group sums of x, then the block's tiles chunk by chunk from the ring (see Q4 above).
template <int K, int KIND>
__device__ void q4_op(const Args& a, Shared& s, unsigned char* ring, u32& c, int layer, int b,
                      int G, u32 step, int wait_j) {
    constexpr int NG = K / 128;  // groups a tile
    constexpr bool HALVES = q4_halves(KIND == OP_O || KIND == OP_DOWN, KIND == OP_GU);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3, g = lane >> 2;
    int n, k, j;
    const unsigned char *wq, *wsz;
    op_matrix(a, layer, KIND == OP_HEAD ? 4 : KIND == OP_QKV ? 0 : KIND - 1, n, k, j, wq, wsz);
    const Share sh = q4_share(n / 16, NG, j, b, G, HALVES);
    const int t0 = sh.t0, t1 = sh.t1;
    const bool half_first = HALVES && sh.pt >= 0 && !sh.owner;
    q4_stage<K, KIND>(a, s, layer, j, t0, t1, sh.owner ? sh.pt : -1, wait_j, G);
    const u32 flag = x_flag(step, 2 * layer + (KIND == OP_DOWN));
    if (half_first) q4_half<KIND>(a, s, ring, c, sh, j, flag);
    const int units = (t1 - t0) * NG, chunks = (units + CU - 1) / CU;
    if (chunks == 0 && !half_first)  // a block without tiles of this op: the timeline's "first
        TR(j, 2);                     // chunk" now
    float acc0 = 0.f, acc1 = 0.f;  // features g and g + 8 of the warp's tile
    float best_v = -3.0e38f;
    int best_i = 0x7fffffff, done = 0;
    for (int i = 0; i < chunks; i++, c++) {
        const int u0 = i * CU, nu = min(CU, units - u0);
        mbar_wait(&s.full[c % NS], (c / NS) & 1);
        if (i == 0 && !half_first) TR(j, 2);
        const unsigned char* slot = slot_ptr(ring, c);
        // the warp's units u = warp mod NCW of the chunk, added to the tile's sums in order
        for (int u = u0 + (warp - u0 % NCW + NCW) % NCW; u < u0 + nu; u += NCW) {
            const int tl = u / NG, gr = u - tl * NG;
            q4_acc(s, slot, u - u0, gr, lane, acc0, acc1);
            if (u + NCW >= (tl + 1) * NG) {  // the warp's last unit of the tile
                if (t == 0) {
                    s.q4red[tl % RT][warp][g] = acc0;
                    s.q4red[tl % RT][warp][g + 8] = acc1;
                }
                acc0 = acc1 = 0.f;
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&s.empty[c % NS]);
        // tiles whose every unit is done after this chunk: added every Q4_FINISH_EVERY
        // chunks, unless the block's tiles all fit Shared.q4red (then once at the end)
        const int ended = (u0 + nu) / NG;
        if (t1 - t0 > RT && ended > done && (i + 1) % Q4_FINISH_EVERY == 0) {
            consumer_sync();
            q4_finish<KIND>(a, s, t0, done, ended, best_v, best_i);
            done = ended;
        }
    }
    if (done < t1 - t0) {
        consumer_sync();
        q4_finish<KIND>(a, s, t0, done, t1 - t0, best_v, best_i);
    }
    if (HALVES && sh.owner) q4_half<KIND>(a, s, ring, c, sh, j, flag);
    if (KIND == OP_HEAD) {  // the block's best logit (ties: the lower id)
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, best_v, o);
            const int id = __shfl_xor_sync(0xffffffffu, best_i, o);
            take_best(best_v, best_i, v, id);
        }
        block_best(a, s, b, best_v, best_i);
    }
}
#endif

// -- consumers: attention -------------------------------------------------------------------------

// x[d] and its rope partner (d ± HD/2, lane ± 16 for HD 128, lane ± 16 for HD 64 too: EPL
// elements a lane, the first half of the head in lanes 0-15).
__device__ __forceinline__ void rope_lane(float* v, const float* cs, const float* sn, int lane) {
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const float other = __shfl_xor_sync(0xffffffffu, v[e], 16);
        v[e] = lane < 16 ? v[e] * cs[e] - other * sn[e] : v[e] * cs[e] + other * sn[e];
    }
}

// QK_NORM: a head's RMSNorm (w: this lane's EPL weights), rounded to bfloat16 before rope as
// the model's kernel stores it.
__device__ __forceinline__ void head_norm(float* v, const float* w, float eps) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; e++) ss = fmaf(v[e], v[e], ss);
    const float inv = rsqrtf(warp_sum(ss) / (float)HD + eps);
#pragma unroll
    for (int e = 0; e < EPL; e++) v[e] = round_bf16(v[e] * inv * w[e]);
}

// This lane's EPL bfloat16 of a head as raw words (loads only: convert with unpack_head, after
// every load of a batch is issued, so that a batch waits for one round trip, not one a load).
__device__ __forceinline__ void load_words(const u16* p, u32* w) {
    if (EPL == 4) {
        asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    } else {
        w[0] = ld_cg(p);
    }
}
__device__ __forceinline__ void unpack_head(const u32* w, float* v) {
#pragma unroll
    for (int i = 0; i < EPL / 2; i++) { v[2 * i] = lo_f32(w[i]); v[2 * i + 1] = hi_f32(w[i]); }
}

#ifndef PU
// cached positions a warp scores at once: 8 against 4 (same call), the 32B int4
// 6.321 → 6.227 ms at 512 positions and 7.446 → 7.337 at 4,096, the 1.5B int4 0.728 → 0.711,
// the 0.5B int4 0.460 → 0.451, the 1.5B bf16 level at 512 (1.030 / 1.029) and 1.187 → 1.166
// at 4,096
#define PU 8
#endif
#ifndef NOATT
#define NOATT 0  // measurement only, wrong output: attention skipped
#endif

// Fewest positions an attention unit takes (fewer units below it): 8 where fewer than two
// thirds of the warps have a head (the 0.5B int4, 7 heads on 12 warps: 0.517 → 0.505 ms a step
// with 8 ring slots), else 16.
#ifndef ATT_MIN
#define ATT_MIN (3 * GS * WH < 2 * NCW ? 8 : 16)
#endif

// The split of positions 0 .. p over kv heads: nsplit units a head, ch positions a unit. At most
// MAX_SPLIT units a head: a unit's merge holds its slice of the outputs from every unit's WH
// partials, and their max and sum, in the space of the staged keys and values (AttState).
constexpr int MAX_SPLIT = (ATT_BYTES / WH - 4 * GS * HD) / (16 + 8 * GS);
static_assert(MAX_SPLIT >= ATT_SPLITS, "the merge's space holds ATT_SPLITS units a head");
__device__ __forceinline__ void attention_split(int p, int G, int& nsplit, int& ch) {
    const int by_len = (p + ATT_MIN) / ATT_MIN;  // ceil((p + 1) / ATT_MIN)
    nsplit = max(1, min(min(G / NKV, MAX_SPLIT), by_len));
    ch = (p + nsplit) / nsplit;  // ceil((p + 1) / nsplit)
}

// Round r of a unit's cached keys and values (positions j0 + r KS .., at most KS, below j1)
// into staging buffer r % NB, 16 bytes a consumer thread at a time; one cp.async group a round,
// empty past the unit, so that a thread's wait_group counts rounds.
__device__ __forceinline__ void stage_kv(AttState& st, const u16* kcache, const u16* vcache,
                                         int j0, int j1, int r) {
    constexpr int PR = HD / 8;  // 16-byte pieces a row
    const int s0 = j0 + r * KS, n = min(KS, j1 - s0);
    for (int t = threadIdx.x; t < 2 * KS * PR; t += CT) {
        const int kv = t / (KS * PR), jj = (t / PR) % KS, pc = t % PR;
        if (jj < n)
            cp_async16(&st.kv[r % NB][kv][jj][8 * pc],
                       (kv ? vcache : kcache) + (size_t)(s0 + jj) * HD + 8 * pc);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The step's own key and value (kn, vn: already rounded to bfloat16) into row `row` of a staging
// buffer, this lane's EPL elements.
__device__ __forceinline__ void put_own(u16 (*kv)[KS][HD], int row, int lane, const float* kn,
                                       const float* vn) {
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        kv[0][row][lane * EPL + e] = to_bf16(kn[e]);
        kv[1][row][lane * EPL + e] = to_bf16(vn[e]);
    }
}

// 2^x on the special function unit, subnormal results flushed to zero (softmax weights below
// 2^-126 of the largest)
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Sums over the warp's lanes of N values a lane at once (N a power of two up to 32), into
// every lane's v: the first levels halve the values a lane holds (a lane keeps one half and
// takes its partner's sums of it), so N values take N - 1 + 5 - log2(N) shuffles, then N more
// to hand each sum from the lanes that hold it to all. Every lane ends with the same sums.
template <int N>
__device__ __forceinline__ void warp_sums(float* v, int lane) {
    int held = N;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        if (held > 1) {  // upper lanes keep the upper half
            const bool upper = lane & o;
            held /= 2;
#pragma unroll
            for (int i = 0; i < held; i++) {
                const float send = upper ? v[i] : v[i + held];
                const float keep = upper ? v[i + held] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
    // value t's sum is in the lanes whose bits (16, 8, ..) spell t (most significant first)
    const float mine = v[0];
#pragma unroll
    for (int t = 0; t < N; t++) {
        int src = 0;
#pragma unroll
        for (int b = N / 2, o = 16; b; b >>= 1, o >>= 1) src |= t & b ? o : 0;
        v[t] = __shfl_sync(0xffffffffu, mine, src);
    }
}

// This lane's EPL bfloat16 of a staged key or value, as raw words.
__device__ __forceinline__ void shared_words(const u16* p, u32* w) {
    if (EPL == 4) {
        const uint2 v = *(const uint2*)p;
        w[0] = v.x;
        w[1] = v.y;
    } else {
        w[0] = *(const u32*)p;
    }
}

// A warp's PU positions of a round at once (rows ib, ib + WH, ... of the staged keys and
// values kv, below n; ib itself below n): scores, their sums over the lanes, then one update
// of the running max m, sum l and accumulators acc. No case for the step's own position (its
// row is staged by put_own), 10 shuffles for 4 scores (warp_sums) instead of 20, and exp2 as
// one instruction: a unit's math 2.08 → 1.48 µs on the 1.5B bf16, 4.95 → 3.15 on the 32B int4
// (5.74 against 8.13 at 4,096 positions).
__device__ __forceinline__ void score_batch(const u16 (*kv)[KS][HD], int ib, int n, int lane,
                                            const float* q, float& m, float& l, float* acc) {
    float sc[PU], vv[PU][EPL];
#pragma unroll
    for (int t = 0; t < PU; t++) {  // rows past the round: a zero key and value, weight 0
        const bool in = ib + WH * t < n;
        u32 kw[EPL / 2] = {}, vw[EPL / 2] = {};
        if (in) {
            shared_words(&kv[0][ib + WH * t][lane * EPL], kw);
            shared_words(&kv[1][ib + WH * t][lane * EPL], vw);
        }
        float kk[EPL];
        unpack_head(kw, kk);
        unpack_head(vw, vv[t]);
        sc[t] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; e++) sc[t] = fmaf(q[e], kk[e], sc[t]);
    }
    warp_sums<PU>(sc, lane);
    float mn = m;
#pragma unroll
    for (int t = 0; t < PU; t++) {
        if (ib + WH * t >= n) sc[t] = -1.0e30f;
        mn = fmaxf(mn, sc[t]);
    }
    const float corr = ex2(m - mn);
    float pr[PU];
#pragma unroll
    for (int t = 0; t < PU; t++) pr[t] = ex2(sc[t] - mn);
    float ls = l * corr;
#pragma unroll
    for (int t = 0; t < PU; t++) ls += pr[t];
    l = ls;
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        float v = acc[e] * corr;
#pragma unroll
        for (int t = 0; t < PU; t++) v = fmaf(pr[t], vv[t][e], v);
        acc[e] = v;
    }
    m = mn;
}

// A block's unit of (kv head g, split sp of positions), at most one. A unit's cached keys and
// values are staged in shared memory in rounds of KS positions (the first NB rounds before the wait
// for QKV, each later one once the round NB before it is scored); a warp takes one head of the
// group (HPW heads where the group has more heads than the block has warps; WH warps a head, every
// WH-th position, where it has fewer) with an online softmax, so no warp waits for another until
// its partials are out. With one partial a head it is the output; else each (m, l, acc) goes to
// a.part, and once every unit of head g has arrived (a counter a kv head), each unit merges its
// slice of the head group's outputs from every partial.
// Round trips to memory on the way: the staged keys/values (before the wait); the unit's q, k,
// v; later rounds (units longer than NB KS positions); the partials' release and the wait for
// the other units; the merge's loads, all at once.
__device__ void attention_op(const Args& a, Shared& s, int layer, int b, int G, u32 step) {
    if (NOATT) { wait_op(a, 5 * layer, G); return; }
    AttState& st = s.u.at;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int p = (int)*a.pos;
    int nsplit, ch;
    attention_split(p, G, nsplit, ch);
    const int nparts = nsplit * WH;  // partials a head
    const float qscale = rsqrtf((float)HD) * 1.4426950408889634f;  // softmax in base 2
    const size_t head_stride = (size_t)a.max_len * HD;
    if (b >= NKV * nsplit) {  // no unit for this block (NKV nsplit <= G: one at most)
        if (LLA & 1) { TR(5 * layer + 1, 0); TR(5 * layer + 1, 1); }  // nothing to wait for
        else wait_op(a, 5 * layer, G);
        return;
    }
    const int g = b / nsplit, sp = b % nsplit;
    const int j0 = sp * ch, j1 = min(p + 1, j0 + ch), rounds = (j1 - j0 + KS - 1) / KS;
    u16* kcache = a.kv + ((size_t)(2 * layer) * NKV + g) * head_stride;
    u16* vcache = a.kv + ((size_t)(2 * layer + 1) * NKV + g) * head_stride;
    // the first rounds of cached keys/values (earlier steps' writes: asked for before the
    // wait for QKV), then q of the warp's heads, the new key and value
    const int jc = min(j1, p);  // cached rows: the step's own (p) is put_own's
#pragma unroll
    for (int r = 0; r < NB; r++) stage_kv(st, kcache, vcache, j0, jc, r);
    u32 qnw[EPL / 2], knw[EPL / 2];  // QK_NORM: the head norms' weights
    if (QK_NORM) {
        load_words(a.qknorm + (size_t)(2 * layer) * HD + lane * EPL, qnw);
        load_words(a.qknorm + (size_t)(2 * layer + 1) * HD + lane * EPL, knw);
    }
    // rope angles of this lane's elements, rounded to bfloat16 as the model's cos/sin are
    // (before the wait: they depend on the position only)
    float cs[EPL], sn[EPL];
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int d = (lane * EPL + e) % (HD / 2);
        const float ang = (float)p * a.inv_freq[d];
        cs[e] = round_bf16(cosf(ang));
        sn[e] = round_bf16(sinf(ang));
    }
    // the warp's heads: wh = warp + NCW i, head wh % GS, every WH-th position from wh / GS
    u32 qw[HPW][EPL / 2], kw[EPL / 2], vw[EPL / 2];
#if LLA & 1
    // q, k and v from their words once each carries this layer's flag (no wait for QKV)
    {
        TR(5 * layer + 1, 0);
        const u32* qkvw = (const u32*)a.qkv;
        const u32 want = x_flag(step, 2 * layer);
        bool ok[HPW + 2];  // the warp's q heads, then k and v
#pragma unroll
        for (int i = 0; i < HPW; i++) ok[i] = warp + NCW * i >= GS * WH;
        ok[HPW] = ok[HPW + 1] = false;
        poll_items<HPW + 2>(a, 1u + 5 * layer, ok, [&](int i) {
            const int e = i < HPW ? (g * GS + (warp + NCW * i) % GS) * HD
                                  : QD + (i - HPW) * KVD + g * HD;
            return ld_flagged<EPL / 2>(qkvw + e + lane * EPL, i < HPW ? qw[i] : i == HPW ? kw : vw,
                                       want);
        });
        if (TRACE) { consumer_sync(); TR(5 * layer + 1, 1); }
    }
#else
    wait_op(a, 5 * layer, G);
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        const int wh = warp + NCW * i;
        if (wh < GS * WH) load_words(a.qkv + (g * GS + wh % GS) * HD + lane * EPL, qw[i]);
    }
    load_words(a.qkv + QD + g * HD + lane * EPL, kw);
    load_words(a.qkv + QD + KVD + g * HD + lane * EPL, vw);
#endif
    // the new key (rope) and value, rounded to the cache's bfloat16
    float kn[EPL], vn[EPL];
    unpack_head(kw, kn);
    unpack_head(vw, vn);
    float qn_w[EPL], kn_w[EPL];
    if (QK_NORM) {
        unpack_head(qnw, qn_w);
        unpack_head(knw, kn_w);
        head_norm(kn, kn_w, a.eps);
    }
    rope_lane(kn, cs, sn, lane);
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        kn[e] = round_bf16(kn[e]);
        vn[e] = round_bf16(vn[e]);
    }
    if (sp == 0 && warp == 0) {
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            kcache[(size_t)p * HD + lane * EPL + e] = to_bf16(kn[e]);
            vcache[(size_t)p * HD + lane * EPL + e] = to_bf16(vn[e]);
        }
    }
    // the step's own key and value into their staging row (the last unit's last
    // position): now if its round is staged, else once the loop below stages it. Units past p
    // (ch rounded up: j0 > p, with no rounds) have none; (p - j0) / KS would round a row
    // below their buffer's to round 0
    const int rp = p >= j0 && p < j1 ? (p - j0) / KS : -1;
    auto own_row = [&]() { put_own(st.kv[rp % NB], p - j0 - rp * KS, lane, kn, vn); };
    if (rp >= 0 && rp < NB && warp == 0) own_row();
    float q[HPW][EPL], acc[HPW][EPL], m[HPW], l[HPW];
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        unpack_head(qw[i], q[i]);
        if (QK_NORM) head_norm(q[i], qn_w, a.eps);
        rope_lane(q[i], cs, sn, lane);
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            q[i][e] = round_bf16(q[i][e]) * qscale;
            acc[i][e] = 0.f;
        }
        m[i] = -1.0e30f;
        l[i] = 0.f;
    }
    if (TRACE) { consumer_sync(); TR(5 * layer + 1, 4); }
    for (int r = 0; r < rounds; r++) {
        // round r in: the NB - 1 groups after it may still be on their way
        asm volatile("cp.async.wait_group %0;" :: "n"(NB - 1) : "memory");
        consumer_sync();
        const int n = min(KS, j1 - j0 - r * KS);
#pragma unroll
        for (int i = 0; i < HPW; i++) {
            const int wh = warp + NCW * i;
            if (wh >= GS * WH) break;
            for (int ib = wh / GS; ib < n; ib += WH * PU)
                score_batch(st.kv[r % NB], ib, n, lane, q[i], m[i], l[i], acc[i]);
        }
        // round r + NB into this round's buffer once every warp has scored it (an empty
        // group past the unit, so that the wait above stays NB - 1)
        if (r + NB < rounds) consumer_sync();
        stage_kv(st, kcache, vcache, j0, jc, r + NB);
        if (r + NB == rp && warp == 0) own_row();
    }
    // partials: accumulators [NKV][G WH][GS][HD], then (max, sum) [NKV][G WH][GS][2] (LLA 2:
    // each float a flagged word)
    const u32 flag = x_flag(step, 2 * layer);  // LLA's words of this layer
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        const int wh = warp + NCW * i;
        if (wh >= GS * WH) break;
        const int hh = wh % GS, part = sp * WH + wh / GS;
        if (nparts == 1) {
#if LLA & 4
            u32 o[EPL / 2];
#pragma unroll
            for (int k = 0; k < EPL / 2; k++)
                o[k] = (u32)to_bf16(acc[i][2 * k] / l[i])
                       | ((u32)to_bf16(acc[i][2 * k + 1] / l[i]) << 16);
            st_flagged<EPL / 2>((u32*)a.att + (g * GS + hh) * HD + lane * EPL, o, flag);
#else
#pragma unroll
            for (int e = 0; e < EPL; e++)
                a.att[(g * GS + hh) * HD + lane * EPL + e] = to_bf16(acc[i][e] / l[i]);
#endif
        } else {
            float* mine = a.part + ((size_t)(g * G * WH + part) * GS + hh) * HD;
            float* mine_ml = a.part + (size_t)NKV * G * WH * GS * HD
                             + ((size_t)(g * G * WH + part) * GS + hh) * 2;
#if LLA & 2
            // float f of a.part: the flagged word at u32 2 f
            u32* pw = (u32*)a.part + 2 * (mine + lane * EPL - a.part);
#pragma unroll
            for (int k = 0; k < EPL / 2; k++) {
                const u32 v[2] = {__float_as_uint(acc[i][2 * k]),
                                  __float_as_uint(acc[i][2 * k + 1])};
                st_flagged<2>(pw + 4 * k, v, flag);
            }
            if (lane == 0) {
                const u32 v[2] = {__float_as_uint(m[i]), __float_as_uint(l[i])};
                st_flagged<2>((u32*)a.part + 2 * (mine_ml - a.part), v, flag);
            }
#else
#pragma unroll
            for (int e = 0; e < EPL; e++) mine[lane * EPL + e] = acc[i][e];
            if (lane == 0) { mine_ml[0] = m[i]; mine_ml[1] = l[i]; }
#endif
        }
    }
    consumer_sync();
    TR(5 * layer + 1, 2);
    if (nparts > 1) {  // every unit of kv head g merges a slice of its outputs
        if (!(LLA & 2) && threadIdx.x == 0) {  // release this unit's partials; acquire every unit's
            if (FENCES) __threadfence();
            red_release(&a.counters[NOPS + g]);
            const u32 target = (u32)nsplit * (u32)(layer + 1);  // zeroed at the step's end
            if (!poll_until(&a.counters[NOPS + g], target))
                atomicExch(a.error, 2u + 5 * layer);
            if (FENCES) __threadfence();
        }
        if (!(LLA & 2)) consumer_sync();
        TR(5 * layer + 1, 5);
        // this unit's outputs: 4-float pieces [pc0, pc0 + npc) of the group's GS * HD; one
        // round trip loads every partial's piece and (max, sum), a thread a load (LLA 2: until
        // each carries this layer's flag)
        constexpr int NPC = GS * HD / 4;
        const int ppu = (NPC + nsplit - 1) / nsplit;
        const int pc0 = min(NPC, sp * ppu), npc = min(NPC, pc0 + ppu) - pc0;
        const float* all = a.part + (size_t)g * G * WH * GS * HD;
        const float* all_ml = a.part + (size_t)NKV * G * WH * GS * HD
                              + (size_t)g * G * WH * GS * 2;
        u32x4* po = (u32x4*)&st;  // [nparts][npc]
        float* ml = (float*)(po + nparts * npc);  // [nparts][GS][2]
        for (int t = threadIdx.x; t < max(nparts * npc, nparts * GS); t += CT) {
            u32x4 v;
            float2 w;
#if LLA & 2
            const int np = max(npc, 1);  // (a unit without a slice loads no piece)
            const u32* pv = (const u32*)a.part + 2 * ((all - a.part) + (size_t)(t / np) * GS * HD
                                                      + 4 * (pc0 + t % np));
            const u32* pm = (const u32*)a.part + 2 * ((all_ml - a.part) + 2 * t);
            u32 d[6];  // the piece's 4 floats, then (max, sum)
            bool ok[3] = {t >= nparts * npc, t >= nparts * npc, t >= nparts * GS};
            poll_items<3>(a, 2u + 5 * layer, ok, [&](int i) {
                return ld_flagged<2>(i < 2 ? pv + 4 * i : pm, d + 2 * i, flag);
            });
            v = {d[0], d[1], d[2], d[3]};
            w = make_float2(__uint_as_float(d[4]), __uint_as_float(d[5]));
#else
            if (t < nparts * npc)
                v = ld_cg4(all + (size_t)(t / npc) * GS * HD + 4 * (pc0 + t % npc));
            if (t < nparts * GS)
                asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];"
                             : "=f"(w.x), "=f"(w.y) : "l"(all_ml + 2 * t));
#endif
            if (t < nparts * npc) po[t] = v;
            if (t < nparts * GS) { ml[2 * t] = w.x; ml[2 * t + 1] = w.y; }
        }
        consumer_sync();
        TR(5 * layer + 1, 6);
        // lp lanes a piece of 4 outputs (as many as leave every piece a lane group at
        // once): lane l of a group takes the partials l, l + lp, ..., and their max and
        // sums are added over the group in a fixed tree (every lane ends with the same)
        int lp = 32;
        while (lp > 1 && npc * lp > CT) lp >>= 1;
        for (int i0 = warp * (32 / lp); i0 < npc; i0 += NCW * (32 / lp)) {
            const int i = i0 + lane / lp, sub = lane % lp;  // groups past npc add zeros
            const int pc = pc0 + min(i, npc - 1), hh = 4 * pc / HD;
            const int nt = i < npc ? nparts : 0;
            float mm = -1.0e30f;
            for (int t = sub; t < nt; t += lp) mm = fmaxf(mm, ml[2 * (t * GS + hh)]);
            for (int o = lp / 2; o; o >>= 1)
                mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
            float ll = 0.f, o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
            for (int t = sub; t < nt; t += lp) {
                const float f = exp2f(ml[2 * (t * GS + hh)] - mm);
                const u32x4 v = po[t * npc + i];
                ll = fmaf(ml[2 * (t * GS + hh) + 1], f, ll);
                o0 = fmaf(__uint_as_float(v.x), f, o0);
                o1 = fmaf(__uint_as_float(v.y), f, o1);
                o2 = fmaf(__uint_as_float(v.z), f, o2);
                o3 = fmaf(__uint_as_float(v.w), f, o3);
            }
            for (int o = lp / 2; o; o >>= 1) {
                ll += __shfl_xor_sync(0xffffffffu, ll, o);
                o0 += __shfl_xor_sync(0xffffffffu, o0, o);
                o1 += __shfl_xor_sync(0xffffffffu, o1, o);
                o2 += __shfl_xor_sync(0xffffffffu, o2, o);
                o3 += __shfl_xor_sync(0xffffffffu, o3, o);
            }
            if (i < npc && sub == 0) {
                const float r = 1.f / ll;
                const u32 lo = (u32)to_bf16(o0 * r) | ((u32)to_bf16(o1 * r) << 16);
                const u32 hi = (u32)to_bf16(o2 * r) | ((u32)to_bf16(o3 * r) << 16);
#if LLA & 4
                const u32 o[2] = {lo, hi};
                st_flagged<2>((u32*)a.att + g * GS * HD + 4 * pc, o, flag);
#else
                *(uint2*)(a.att + g * GS * HD + 4 * pc) = make_uint2(lo, hi);
#endif
            }
        }
        if (TRACE) { consumer_sync(); TR(5 * layer + 1, 7); }
    }
}

#if Q4
#define OP q4_op
static_assert(LDGSTS && !LLX && !LLA && !LLH, "Q4: cp.async (LDGSTS=1), no LLX, LLA or LLH");
#else
#define OP matrix_op
#endif

// -- the kernel -----------------------------------------------------------------------------------

// Registers: 9 warps put 3 on one of the 4 sub-partitions (16,384 registers each): 168 a thread.
extern "C" __global__ void __launch_bounds__((NCW + NPROD) * 32, 1)
decode_step(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    Shared& s = *(Shared*)(smem + (size_t)NS * SLOT);
    const int b = blockIdx.x, G = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) {
            mbar_init(&s.full[i], LDGSTS ? 32 : 1);
            mbar_init(&s.empty[i], NCW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp >= NCW) {  // the producers: every weight chunk of the step, in order
        const u32 me = warp - NCW;
#if LDGSTS
        {
            Cursor cur = {0, 0, 0};
            Chunk ch;
            for (u32 c = 0; next_chunk(a, cur, b, G, ch); c++) {
                if (c % NPROD != me) continue;
                if (c >= NS) mbar_wait(&s.empty[c % NS], ((c / NS) - 1) & 1);
                // at most INFLIGHT chunks on their way: chunk c - INFLIGHT has landed. Its slot
                // cannot have been filled again meanwhile (the parity would then name the use
                // after, a producer's own later chunk: a hang): chunk c - INFLIGHT + NS waits
                // for c - 2 INFLIGHT + NS, ..., a chain that reaches chunk c, not yet issued,
                // where INFLIGHT divides NS (an odd NS with 2 would step over it)
                if (INFLIGHT && c >= INFLIGHT)
                    mbar_wait(&s.full[(c - INFLIGHT) % NS], ((c - INFLIGHT) / NS) & 1);
                if (lane == 0 && ch.first) TRP(ch.j, 0);
                const u32 dst = smem_addr(slot_ptr(ring, c));
                for (u32 off = 16 * lane; off < ch.bytes; off += 512)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                                 :: "r"(dst + off), "l"(ch.src + off) : "memory");
                for (u32 off = 16 * lane; off < ch.bytes2; off += 512)  // Q4: the scales
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                                 :: "r"(dst + CU * 1024 + off), "l"(ch.src2 + off) : "memory");
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];"
                             :: "r"(smem_addr(&s.full[c % NS])) : "memory");
                if (lane == 0) TRP(ch.j, 1);
            }
            asm volatile("cp.async.wait_all;" ::: "memory");
        }
        return;
#endif
        if (lane == 0) {
            Cursor cur = {0, 0, 0};
            Chunk ch;
            for (u32 c = 0; next_chunk(a, cur, b, G, ch); c++) {
                if (c % NPROD != me) continue;
                if (c >= NS) mbar_wait(&s.empty[c % NS], ((c / NS) - 1) & 1);
                if (ch.first) TRP(ch.j, 0);
                bulk_load(slot_ptr(ring, c), ch.src, ch.bytes, &s.full[c % NS]);
                TRP(ch.j, 1);
            }
        }
        return;
    }

#if Q4
    for (int i = threadIdx.x; i < RT * NCW * 16; i += CT) (&s.q4red[0][0][0])[i] = 0.f;
    consumer_sync();
#endif
    u32 c = 0;
    const u32 step = LLX || LLA || LLH || Q4_PARTS ? ld_cg(a.step_count) : 0u;  // flags' step
    for (int layer = 0; layer < NL; layer++) {
        const int j = 5 * layer;
        // each op waits for the one before (the last argument; -1: none) inside
        OP<H, OP_QKV>(a, s, ring, c, layer, b, G, step, layer > 0 && !LLX ? j - 1 : -1);
        if (LLA & 1) TR(j, 3);  // attention polls q, k and v
        else signal_op(a, j);
        u32x4 oheld[O_HELD ? O_RPW * O_NV : 1];  // OREG: O's first chunk, this warp's rows
        if (O_HELD) hold_rows(a, layer, b, G, oheld);
        attention_op(a, s, layer, b, G, step);  // waits for QKV inside, its first loads issued
        if (LLA & 4) { consumer_sync(); TR(j + 1, 3); }  // O polls att (into the merge's space)
        else signal_op(a, j + 1);
#if Q4
        OP<QD, OP_O>(a, s, ring, c, layer, b, G, step, LLA & 4 ? -1 : j + 1);
#else
        OP<QD, OP_O>(a, s, ring, c, layer, b, G, step, LLA & 4 ? -1 : j + 1,
                     O_HELD ? oheld : nullptr);
#endif
        if (LLX) TR(j + 2, 3);
        else signal_op(a, j + 2);
        OP<H, OP_GU>(a, s, ring, c, layer, b, G, step, LLX ? -1 : j + 2);
        // DOWN polls h (the barrier: gate/up's rows read from xo before DOWN's LLX rows go in)
        if (LLH) { consumer_sync(); TR(j + 3, 3); }
        else signal_op(a, j + 3);
        OP<INTER, OP_DOWN>(a, s, ring, c, layer, b, G, step, LLH ? -1 : j + 3);
        if (LLX) TR(j + 4, 3);
        else signal_op(a, j + 4);
    }
    OP<H, OP_HEAD>(a, s, ring, c, NL, b, G, step, LLX ? -1 : 5 * NL - 1);
    consumer_sync();
    TR(NOPS - 1, 3);
    if (threadIdx.x == 0) {  // the last block picks the token and clears the counters
        const bool last = atom_add_acq_rel(&a.counters[NOPS - 1]) == (u32)(G - 1);
        if (last) {
            float bv = ld_cgf(a.best);
            int bi = __float_as_int(ld_cgf(a.best + 1));
            for (int t = 1; t < G; t++) {
                const float v = ld_cgf(a.best + 2 * t);
                const int i = __float_as_int(ld_cgf(a.best + 2 * t + 1));
                take_best(bv, bi, v, i);
            }
            if (bi < 0 || bi >= VOCAB) bi = 0;  // NaN logits everywhere: no token past the table
            *a.out_token = bi;
            if (a.chain) {  // every block read both before it added to the head's counter
                *a.token = bi;
                *a.pos = min(*a.pos + 1, (long long)a.max_len - 1);  // never past the cache
            }
            if (LLX || LLA || LLH || Q4_PARTS) *a.step_count = step + 1u;  // all read it first
            for (int t = 0; t < NOPS + NKV; t++) a.counters[t] = 0u;
        }
    }
}
