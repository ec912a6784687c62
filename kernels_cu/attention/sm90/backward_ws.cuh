// sm_90a backward, bf16, warp-specialised: backward.cuh's products on two consumer warpgroups, with the copies
// and the ordered dQ sum on a third (384 threads).
//
// backward.cuh spends much of a step outside the tensor cores on the ordered dQ sum: thread 0 spins on the
// previous key tile's count, two block-wide barriers and a __threadfence (which waits for the step's 4096
// reductions to reach L2) sit between one step's products and the next. Here the consumers only stage dQ:
//   WG0, WG1 (keys 64 wg .. 64 wg + 63 of the block's 128): S^T, dP^T, P^T, dS^T, dV, dK as backward.cuh; dS^T
//        into one of two buffers (step parity), then dQ(step) = dS K for their 64 columns, scaled, into the fp32
//        staging tile [64][D + 4] (up to D = 96 one step late: HopBwdPipe);
//   WG2: warp 8 issues the copies (K, V once; Q and dO into two stages: lane 0) and stages each step's lse2 and
//        delta in shared memory (lanes 1-31; the consumers read no global memory in the loop); warp 9 waits for
//        the previous key tile's count of the step (sem) and for the staging tile; warps 9-11 add the tile into
//        dqacc by red.add (the first key tile stores), free the tile and release the count. In the q80 kernels
//        (DQ_TMA) and at D = 64 (T64), where dQ is made transposed, a full step's tile leaves through the copy
//        engine instead: thread 288 issues one tensor reduction per 32-column box, frees the tile once the
//        engine has read it and releases the count once it completed. FUSED (hop_bwd_bf16_ws_plain_dq): a
//        sequence's last key tile writes its rows of dQ instead (dqacc's sum, read ahead into shared memory by
//        the copy engine, plus its own), and the dQ write kernel is not run. (Bulk reductions from one warp,
//        one per row, measured 13-35% slower over the whole backward.) WG2 gives its registers to the consumers
//        (setmaxnreg 40 / 232, 24 / 240 in the q80 kernels: 64512 registers, the 168 x 384 the block holds
//        from launch; more for the consumers would wait forever).
// dQ is the same sum in the same order as backward.cuh: bit-identical results.
// Barriers: [0] K/V full; [1 + s] Q/dO stage s full (the copies' bytes and warp 8's 32 lanes); [3 + s] stage s
// empty (256 arrivals: every consumer thread once its dK/dV products have read the stage); [5] staging full
// (256); [6] staging empty (the writers); [7 + b] dS^T buffer b written (256; HopBwdPipe only); FUSED: [15] the
// read-ahead dQ rows in (hop_bwd_write_last_step).
// Named barriers: 1 (256, both consumers' dS^T written; not in HopBwdPipe), 2 (96, the red.add writers).
#pragma once
#include "attention/sm90/backward.cuh"

#ifndef CUPY_ROPE_BWD_PIPE
#define CUPY_ROPE_BWD_PIPE 1
#endif
#ifndef CUPY_ROPE_DQ_TMA
#define CUPY_ROPE_DQ_TMA 1
#endif
#ifndef CUPY_ROPE_DQ_T64
#define CUPY_ROPE_DQ_T64 1
#endif
// The RoPE epilogue (the block's backward) of the unsplit kernels meets on a named barrier of the 256 consumers
// (5), so that it starts without waiting for the dQ writers' last step and the producer warps leave once done;
// its row loop is unrolled 8 (every item's cos/sin loads of a thread in flight). Measured at the seeds' 8192 x 32
// (dev/bwd_timeline.py): the epilogue from ~10 to 7.8 µs of a ~24 µs unit, the kernel -9%. CUPY_ROPE_BWD_EPI_NAMED=0
// (block-wide barriers, the writers taking part) and CUPY_ROPE_BWD_EPI_UNROLL=2 build the forms before.
#ifndef CUPY_ROPE_BWD_EPI_NAMED
#define CUPY_ROPE_BWD_EPI_NAMED 1
#endif
#ifndef CUPY_ROPE_BWD_EPI_UNROLL
#define CUPY_ROPE_BWD_EPI_UNROLL 8
#endif
// Lab probe (wrong results, timing only): every unblocked unit walks its query steps CUPY_ROPE_PROBE_REPEAT times
// (the dQ shares added again, the counts released again), so that the time per step and the time per unit outside
// its steps (prologue, epilogue, pipeline fill) can be told apart: T(2) - T(1) is the steps', 2 T(1) - T(2) the
// rest. Unset (1): the library's kernels, unchanged.
#ifndef CUPY_ROPE_PROBE_REPEAT
#define CUPY_ROPE_PROBE_REPEAT 1
#endif
#if CUPY_ROPE_PROBE_REPEAT > 1
#define HOP_PROBE_STEP(it, n) ((it) % (n))
#else
#define HOP_PROBE_STEP(it, n) (it)
#endif
// Lab probe (wrong results, timing only): CUPY_ROPE_PROBE_BF16_GRADS=1 makes the plain (varlen API) kernels store
// dK, dV and dQ as bf16, row stride out_ld bf16 values, into the first half of each fp32 output's bytes: the
// traffic of gradients in the inputs' dtype (half the writes), to see what it would buy before building it.
#ifndef CUPY_ROPE_PROBE_BF16_GRADS
#define CUPY_ROPE_PROBE_BF16_GRADS 0
#endif
// Lab probe (timing only, the same results): CUPY_ROPE_PROBE_TIMES=1 makes the unsplit specialised bf16 backwards
// (hop_bwd_ws; slot = the block's place in launch order) stamp each unit into hop_probe_out[16 slot + field]: 0
// %globaltimer (ns) and 1 clock64 as consumer thread 0 starts, 2 its clock once K and V are in, 3 after its last step,
// 4 after its dK/dV stores, 5 and 6 the cycles it waited for full Q/dO stages and for the staging tile to be read, 7
// %globaltimer at the end, 8 %smid, 9 the unit's steps, 13 the kernel (1 fused dQ, 2 plain, 3 RoPE epilogue) + 16 x the
// key tile's place in its sequence; and the writers' thread 0 (288): 10 the cycles it waited for full staging tiles, 11
// those in the previous key tile's count, 12 its clock after the unit's last step. The waits add up in the barrier
// line's free words (bar[10 + i]).
// dev/bwd_timeline.py reads them. Unset: the library's kernels, unchanged.
#ifndef CUPY_ROPE_PROBE_TIMES
#define CUPY_ROPE_PROBE_TIMES 0
#endif
#if CUPY_ROPE_PROBE_TIMES
__device__ unsigned long long hop_probe_out[1 << 21];
__device__ __forceinline__ unsigned long long hop_gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned hop_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#define HOP_PROBE_WAIT(b, p, acc)                                                                               \
    do {                                                                                                        \
        if (threadIdx.x == 0 || threadIdx.x == 288) {                                                           \
            const long long t0_ = clock64();                                                                    \
            mbar_wait(b, p);                                                                                    \
            *(acc) += clock64() - t0_;                                                                          \
        } else {                                                                                                \
            mbar_wait(b, p);                                                                                    \
        }                                                                                                       \
    } while (0)
#define HOP_PROBE(...) __VA_ARGS__
__device__ __forceinline__ unsigned long long* hop_probe_rec(int slot) { return hop_probe_out + 16 * (long long)slot; }
// consumer thread 0, at the unit's end: the rest of its record (kind: 1 fused dQ, 2 plain, 3 RoPE epilogue)
__device__ __forceinline__ void hop_probe_end(const u64* bar, int slot, int nit, int kind) {
    unsigned long long* r = hop_probe_rec(slot);
    r[4] = clock64(), r[5] = bar[10], r[6] = bar[11], r[7] = hop_gtime(), r[8] = hop_smid(), r[9] = nit;
    r[13] = kind;
}
#else
#define HOP_PROBE_WAIT(b, p, acc) mbar_wait(b, p)
#define HOP_PROBE(...)
#endif
// Lab probe (wrong results, timing only): CUPY_ROPE_PROBE_NO_COUNT_WAIT=1 makes the specialised bf16 backwards' dQ
// writers (and the two-stage tf32 backward's warp 9, hop32_dq_bulk_warp) skip their wait for the previous key
// tile's count (hop_wait_count), to bound what an order of the dQ sum without those waits could buy. Unset: the
// library's kernels, unchanged.
#ifndef CUPY_ROPE_PROBE_NO_COUNT_WAIT
#define CUPY_ROPE_PROBE_NO_COUNT_WAIT 0
#endif
// Writer 0's wait for the previous key tile's dQ share of the step at query q0 of head h: its count reaches kvi
// (an acquire: the share is visible after it). With the probe, the cycles spent add up in *probe_acc.
__device__ __forceinline__ void hop_wait_count(const int* sem, int h, int T, int q0, int kvi, u64* probe_acc) {
    HOP_PROBE(const long long t0 = clock64();)
    const int* sp = sem + (i64)h * T + q0;
    while (!CUPY_ROPE_PROBE_NO_COUNT_WAIT && ld_acquire(sp) < kvi) {
    }
    HOP_PROBE(*probe_acc += clock64() - t0;)
}
// Two values to plain output `out` at element `at` (fp32; bf16 with the probe).
__device__ __forceinline__ void hop_plain_store2(float* out, i64 at, float a, float b) {
    if (CUPY_ROPE_PROBE_BF16_GRADS) *reinterpret_cast<u32*>(reinterpret_cast<u16*>(out) + at) = pack2<BF16>(a, b);
    else *reinterpret_cast<float2*>(out + at) = make_float2(a, b);
}
// Four values, likewise.
__device__ __forceinline__ void hop_plain_store4(float* out, i64 at, float4 v) {
    if (CUPY_ROPE_PROBE_BF16_GRADS)
        *reinterpret_cast<uint2*>(reinterpret_cast<u16*>(out) + at) =
            make_uint2(pack2<BF16>(v.x, v.y), pack2<BF16>(v.z, v.w));
    else *reinterpret_cast<float4*>(out + at) = v;
}

// BQ: query rows per step. HOP_BQ (64), or 80 in the q80 kernels (D = 128 only: each warpgroup's dQ share is
// then dq^T for its 64 of the 128 columns, m64n80k16 with dS K-major, where m64 fits no 80-row dQ): a step holds
// 25% more products against the same fixed costs (the waits, the barrier, the staging hand-over), for 16 more
// registers of S^T and dP^T, and Q, dO and dS of 80 rows fill the 227 KB to 1664 bytes (with DQ_TMA's unpadded
// staging tile; 384 with the padded one).
template <int D, int BQ_ = HOP_BQ> struct HopBwdWs {
    static constexpr int BQ = BQ_;
    static constexpr bool Q80 = BQ != HOP_BQ;
    static_assert(!Q80 || (BQ == 80 && D == 128), "the q80 layout is built for D = 128");
    static constexpr int NB = HopDims<D>::NB;
    static constexpr int KT = HOP_BN * 64 * NB;  // elements of a K or V tile
    static constexpr int QT = BQ * 64 * NB;      // of a Q or dO tile
    static constexpr int DS = HOP_BN * BQ;       // dS^T [128 keys][64 queries] (q80: dS [2][80 queries][64 keys])
    static constexpr int LDQ = D + 4;            // the dQ staging tile [BQ][D + 4] fp32
    static constexpr int MAIN = (2 * KT + 4 * QT + 2 * DS) * 2;  // K, V, Q[2], dO[2], dS^T[2]
    // The q80 kernels' full steps leave through the copy engine (DQ_TMA): the staging tile is then D / 32 boxes of
    // [BQ][32] fp32 in the 128-byte swizzle (1024-byte aligned, no padding), one tensor reduction each into
    // dqacc, issued by one writer thread; a sequence's last, partial step is added by the writers' red.add.
    static constexpr bool DQ_TMA = CUPY_ROPE_DQ_TMA && Q80;
    // At D = 64 the 64-row step makes dQ transposed as well (T64: warpgroup 0's dq^T = K^T dS^T, m64n64k16, from
    // dS stored K-major as in q80; warpgroup 1 has no dQ columns either way), so that its full steps leave through
    // the copy engine in two such boxes [64][32]. Not in the kernels that write dQ from the last key tile (the
    // kernel's T64 says), whose writers read the padded tile.
    static constexpr bool T64 = CUPY_ROPE_DQ_TMA && CUPY_ROPE_DQ_T64 && D == 64 && !Q80;
    static_assert(!(DQ_TMA || T64) || MAIN % 1024 == 0, "the swizzled staging tile is 1024-byte aligned");
    static constexpr int DQ = DQ_TMA ? BQ * D * 4 : BQ * LDQ * 4;
    static constexpr int STAGE = HOP_BN * (D + 4) * 4;  // the epilogue's [128][D + 4], over Q onwards
    static_assert(2 * KT * 2 + STAGE <= MAIN, "the epilogue tile fits before the dQ staging tile");
    static constexpr int LD = 2 * 2 * BQ * 4;  // lse2 and delta of each stage's queries [2][2][BQ] fp32
    static constexpr int BYTES = MAIN + DQ + LD + 128;  // barriers: two 64-byte lines
    // The kernels that write dQ from a sequence's last key tile (FUSED) read the earlier key tiles' sum of a step's
    // rows ahead, into [BQ][D] fp32 after the barriers (hop_bwd_write_last_step): 231552 bytes at D = 128.
    static constexpr int PRE = BYTES, FUSED_BYTES = BYTES + BQ * D * 4;
    static_assert(Q80 || FUSED_BYTES <= 232448, "the read-ahead rows fit in a block's shared memory");
    // Read the step's lse2 and delta (64 registers) before issuing S^T and dP^T, so that their shared-memory
    // latency hides under the products, only where the registers allow it. At D = 64 the accumulators dK and
    // dV leave room: 13% faster (1 x 8192, 16 heads: 3.01 ms against 3.42). From D = 80 the early read
    // lengthens the live range across the products: D = 80 and 96 3% slower, D = 128 spills and is 24% slower.
    static constexpr bool LSE_FIRST = D <= 64;
    // The step's dQ product issued one step late (HopBwdPipe), where its accumulators fit beside the step's S^T,
    // dP^T, dK and dV: D <= 96 (backward alone, same bits: 1 x 9216 D 80 +8%, 8192 D 96 +10%, D 64 +1 to 1.5%,
    // 32 x 256 D 80 -4%). At D = 128 they would take 224 of the 232 registers (ptxas serialises the wgmma).
    // Not in the kernel that writes dQ from the last key tile (FUSED: the plan's choice while the longest
    // sequence has at most 16 key tiles), where it lost (32 x 256) and ptxas spilled a register at D = 80.
    // CUPY_ROPE_BWD_PIPE=0 builds the other loop everywhere.
    static constexpr bool PIPE = CUPY_ROPE_BWD_PIPE && D <= 96 && !Q80;
    // The registers of each consumer and producer thread (setmaxnreg: 256 c + 128 p = 64512, the 168 x 384 of
    // the launch). The q80 step's S^T and dP^T (80) beside dK and dV (128) need the consumers' 240.
    static constexpr int CONSUMER_REGS = Q80 ? 240 : 232, PRODUCER_REGS = Q80 ? 24 : 40;
    static_assert(256 * CONSUMER_REGS + 128 * PRODUCER_REGS == 168 * 384, "the block's registers");
};

// One warpgroup's dQ share of a step: dq = dS K for N columns of K (kcols: the first of them; A = dS^T and B = K
// read MN-major, keys the reduction), issued, committed and waited for with every wgmma group before it (so the
// stage's Q and dO are free: its empty barrier gets this thread's arrival); then, once the writers have read the
// previous step's staging tile, dq (scaled) into it: stq the tile at this warpgroup's first column.
// TRANS (the q80 kernels): dq^T for this warpgroup's 64 columns over the step's N = BQ queries (hop_dq_issue),
// staged transposed: lane (g, t) of warp wq writes columns 16 wq + g (+ 8) of rows 8 j + 2 t (+ 1), 32 banks
// apart for LDQ = 132.
// A warpgroup's dq^T (lane (g, t) of warp wq: column 16 wq + g (+ 8) of query rows 8 j + 2 t (+ 1), scaled)
// into its two [N][32] boxes of the staging tile in the 128-byte swizzle (stq: the first box): column d of the
// warpgroup's 64 is in box d / 32, its 16-byte chunk (d % 32) / 4 of row q at chunk ((d % 32) / 4) ^ (q % 8), so
// the 32 lanes of a store meet 8 chunks x 4 columns, every bank once; then fenced for the copy engine.
template <int N>
__device__ __forceinline__ void hop_bwd_stage_dqt(float* stq, const float (&dq)[N / 2], float scaling, int wq, int g,
                                                  int t) {
    float* box = stq + (wq >> 1) * N * 32 + (g & 3);
    const int c0 = 4 * (wq & 1) + (g >> 2);  // the chunk of column 16 (wq % 2) + g within its box
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int q = 2 * t + (e & 1);  // row within each 8-row group j (q % 8)
        float* p = box + q * 32 + (((c0 + 2 * (e >> 1)) ^ q) << 2);
#pragma unroll
        for (int j = 0; j < N / 8; ++j) p[j * 8 * 32] = dq[4 * j + e] * scaling;
    }
    fence_async_smem();  // the tile is read by the copy engine next
}

// SWZ (TRANS, HopBwdWs::DQ_TMA): stq is this warpgroup's first of the staging tile's swizzled boxes
// (hop_bwd_stage_dqt).
template <int N, int LDQ, bool TRANS = false, bool SWZ = false>
__device__ __forceinline__ void hop_bwd_dq_step(const u16* ds, const u16* kcols, float* stq, float scaling,
                                                u64* stage_empty, u64* staging_empty, int it, int wq, int g, int t) {
    float dq[N / 2];
    hop_dq_issue<N, TRANS>(dq, ds, kcols);
    wgmma_wait<0>();
    reg_fence(dq);
    mbar_arrive(stage_empty);
    if (it > 0) HOP_PROBE_WAIT(staging_empty, (it - 1) & 1, staging_empty + 5);
    if constexpr (SWZ) {
        static_assert(TRANS, "the swizzled staging tile is the transposed layout's");
        hop_bwd_stage_dqt<N>(stq, dq, scaling, wq, g, t);
    } else if constexpr (TRANS) {
        float* p = stq + 2 * t * LDQ + wq * 16 + g;
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[(8 * j + (e & 1)) * LDQ + 8 * (e >> 1)] = dq[4 * j + e] * scaling;
    } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float* p = stq + (wq * 16 + g + 8 * r) * LDQ + 2 * t;
#pragma unroll
            for (int j = 0; j < N / 8; ++j)
                *reinterpret_cast<float2*>(p + 8 * j) =
                    make_float2(dq[4 * j + 2 * r] * scaling, dq[4 * j + 2 * r + 1] * scaling);
        }
    }
}

// The last key tile's dQ rows of a step (wt: one of the 96 writer threads): out = pre + staging (pre: the earlier
// tiles' sum of the step's rows, read ahead into shared memory; then this tile's share, rounded as red.add rounds:
// the bits the dQ write kernel would have read back), or the staging tile alone when the sequence has one key
// tile (add false). A warp's 32 lanes take one row's 128 contiguous bytes of each.
template <int D, int LDQ>
__device__ __forceinline__ void hop_bwd_dq_last(float* out, int out_ld, const float* pre, const float* stq, int nq,
                                                int wt, bool add) {
    constexpr int Q4 = D / 4;
#pragma unroll 2
    for (int u = wt; u < nq * Q4; u += 96) {
        const int r = u / Q4, c = (u - r * Q4) * 4;
        float4 v = *reinterpret_cast<const float4*>(stq + r * LDQ + c);
        if (add) {
            const float4 a = *reinterpret_cast<const float4*>(pre + r * D + c);
            v = make_float4(add_ftz(a.x, v.x), add_ftz(a.y, v.y), add_ftz(a.z, v.z), add_ftz(a.w, v.w));
        }
        hop_plain_store4(out, (i64)r * out_ld + c, v);
    }
}

// One query step's loads (warp 8, step `it` of the block's walk, queries q0 .. q0 + nq of head h): lane 0 copies Q
// and dO into stage it & 1 once every consumer thread has read it two steps before; lanes 1-31 stage the step's
// lse2 and delta (+inf / 0 past the sequence: P = 0 there) and arrive.
template <int NB, int BQ>
__device__ __forceinline__ void hop_bwd_load_step(const TmaDesc* tq, const TmaDesc* tdo, const float* __restrict__ lse,
                                                  const float* __restrict__ delta, u16* sQ, u16* sdO, float* sL,
                                                  u64* bar, int it, int h, int q0, int nq, int T, int lane) {
    constexpr int QT = BQ * 64 * NB;
    const int st = it & 1;
    if (it >= 2) mbar_wait(&bar[3 + st], ((it >> 1) - 1) & 1);
    if (lane == 0) {  // the copies first: the loads below would hold them back by a global read
        mbar_expect_tx(&bar[1 + st], 2 * QT * 2);
        tma_tile<NB, BQ>(sQ + st * QT, tq, &bar[1 + st], h, q0);
        tma_tile<NB, BQ>(sdO + st * QT, tdo, &bar[1 + st], h, q0);
    } else {
        float* L = sL + st * 2 * BQ;
        const i64 g0 = (i64)h * T + q0;
#pragma unroll 1
        for (int i = lane - 1; i < BQ; i += 31) {
            L[i] = i < nq ? lse[g0 + i] : __int_as_float(0x7f800000);
            L[BQ + i] = i < nq ? delta[g0 + i] : 0.f;
        }
        mbar_arrive(&bar[1 + st]);
    }
}

// The writers' step `it` on a sequence's last key tile (FUSED): rows q0 .. q0 + nq of dQ (fp32 [T][NH][D], row
// stride out_ld) are the earlier key tiles' sum in dqacc plus the staged share (hop_bwd_dq_last); then the staging
// tile is free. Where there are earlier tiles (kvi > 0), writer 0 reads their sum ahead: once their count of the step
// is in, one bulk copy of the rows into pre (completing on bar_pre, parity pp), issued before the staging tile is
// full, so that the copy runs beside the consumers' step (reading the rows from L2 after it, two rows in flight per
// thread, held the consumers 11 of a 21 µs unit at 32 x 256 tokens, D = 128). The call that follows for the next
// step issues the next copy once every writer has read pre (the barrier at the end). wt: 0..95.
template <int D, int LDQ>
__device__ __forceinline__ void hop_bwd_write_last_step(float* dq_out, i64 out_ld, const float* dqacc, const int* sem,
                                                        const float* sDQ, float* pre, u64* bar, u64* bar_pre, int pp,
                                                        int it, int h, int T, int q0, int nq, int kvi, int wt) {
    if (kvi > 0 && wt == 0) {
        hop_wait_count(sem, h, T, q0, kvi, &bar[13]);
        fence_async_global();  // the acquired rows, written through the generic proxy, read by the copy engine
        mbar_expect_tx(bar_pre, nq * D * 4);
        bulk_load(pre, dqacc + ((i64)h * T + q0) * D, nq * D * 4, bar_pre);
    }
    HOP_PROBE_WAIT(&bar[5], it & 1, &bar[12]);
    if (kvi > 0) mbar_wait(bar_pre, pp);
    hop_bwd_dq_last<D, LDQ>(dq_out + (i64)q0 * out_ld + (i64)h * D, (int)out_ld, pre, sDQ, nq, wt, kvi > 0);
    named_barrier(2, 96);
    if (wt == 0) mbar_arrive(&bar[6]);
}

// The writers' step `it` on any other key tile kvi: after the previous key tile's share, the staged share into
// dqacc by red.add (the first key tile stores), the staging tile freed and the count released. TMA: the tile is in
// the swizzled boxes (HopBwdWs::DQ_TMA, T64; a partial step's rows).
template <int D, int BQ, int LDQ, bool TMA>
__device__ __forceinline__ void hop_bwd_write_add_step(float* dqacc, int* sem, const float* sDQ, u64* bar, int it,
                                                       int h, int T, int q0, int nq, int kvi, int wt) {
    constexpr int Q4 = D / 4;
    if (kvi > 0 && wt == 0) hop_wait_count(sem, h, T, q0, kvi, &bar[13]);  // the previous key tile's share is in
    HOP_PROBE_WAIT(&bar[5], it & 1, &bar[12]);
    named_barrier(2, 96);
    float* dst = dqacc + ((i64)h * T + q0) * D;
    for (int u = wt; u < nq * Q4; u += 96) {
        const int r = u / Q4, c = (u - r * Q4) * 4;
        // TMA: chunk c / 4 of the row is in box c / 32 at chunk (c / 4 % 8) ^ (r % 8)
        const float* src = TMA ? sDQ + (c >> 5) * BQ * 32 + r * 32 + ((((c >> 2) & 7) ^ (r & 7)) << 2)
                               : sDQ + r * LDQ + c;
        const float4 v = *reinterpret_cast<const float4*>(src);
        if (kvi == 0) *reinterpret_cast<float4*>(dst + (i64)r * D + c) = v;
        else red_add_v4(dst + (i64)r * D + c, v.x, v.y, v.z, v.w);
    }
    named_barrier(2, 96);
    // every writer's reductions precede the barrier, and the release that thread 0 then makes is cumulative: it
    // publishes them all (no fence in each writer, and no second barrier: 2-8% faster, the same bits)
    if (wt == 0) {
        mbar_arrive(&bar[6]);  // the staging tile is read
        st_release(sem + (i64)h * T + q0, kvi + 1);
    }
}

// The plain kernels' dK (scaled) and dV (fp32, no RoPE, no bias sums, no transposed copy): stored straight from
// a consumer thread's accumulators, rows `row` and row + 8 of the block's keys (those below nkv), column pairs
// 8 j + 2 t: a quad of lanes writes a row's 32-byte sector whole. The same values the staged epilogue writes.
template <int D>
__device__ __forceinline__ void hop_bwd_store_plain(float* dk_out, float* dv_out, i64 out_ld, const float* dk,
                                                    const float* dv, float scaling, int row, int nkv, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (row + 8 * r >= nkv) continue;
        const i64 off = (i64)(row + 8 * r) * out_ld + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            hop_plain_store2(dk_out, off + 8 * j, dk[4 * j + 2 * r] * scaling, dk[4 * j + 2 * r + 1] * scaling);
            hop_plain_store2(dv_out, off + 8 * j, dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
    }
}

// A split tile's plain dK and dV from its parts' partials (src: part 0's copy of this thread's accumulators, D
// floats, the next part 256 D further): each 4-value chunk summed in part order, then stored as
// hop_bwd_store_plain stores the accumulators (chunk j: column pair 8 j + 2 t of rows `row` and row + 8).
template <int D>
__device__ __forceinline__ void hop_bwd_sum_store_plain(float* dk_out, float* dv_out, i64 out_ld, const float* src,
                                                        int parts, float scaling, int row, int nkv, int t) {
#pragma unroll 1
    for (int j = 0; j < D / 8; ++j) {
        float4 k = ld_cg_v4(src + 4 * j), v = ld_cg_v4(src + D / 2 + 4 * j);
#pragma unroll 1
        for (int p = 1; p < parts; ++p) {
            const float* q = src + (i64)p * 256 * D + 4 * j;
            const float4 a = ld_cg_v4(q), b = ld_cg_v4(q + D / 2);
            k.x += a.x, k.y += a.y, k.z += a.z, k.w += a.w;
            v.x += b.x, v.y += b.y, v.z += b.z, v.w += b.w;
        }
        const i64 off = (i64)row * out_ld + 8 * j + 2 * t;
        if (row < nkv) {
            hop_plain_store2(dk_out, off, k.x * scaling, k.y * scaling);
            hop_plain_store2(dv_out, off, v.x, v.y);
        }
        if (row + 8 < nkv) {
            hop_plain_store2(dk_out, off + 8 * out_ld, k.z * scaling, k.w * scaling);
            hop_plain_store2(dv_out, off + 8 * out_ld, v.z, v.w);
        }
    }
}

// The consumers' loop with each step's dQ product issued one step late (HopBwdWs::PIPE), for one warpgroup (N: its
// dQ columns, from kcols of K and stq of the staging tile; 0: none). In the other loop the two warpgroups meet at a
// named barrier once both halves of dS^T are written, and only then issue dQ: the faster one waits, and its tensor
// cores with it. Here each warpgroup arrives on the dS^T buffer's barrier (bar[7 + b], 256 arrivals) and goes on;
// at the next step it issues S^T and dP^T first, then waits for that barrier (by then the other warpgroup has long
// arrived) and issues the previous step's dQ, which runs while P^T and dS^T are made. dS^T has two buffers: the
// buffer step it writes was last read by the dQ products of step it - 2. A warpgroup waits for its own such
// product (at step it - 1, before it stores dS^T (it - 1) and arrives), so the other warpgroup's arrival, which
// this one waits for at the start of step it, comes after both reads are over. Every group is issued and
// waited for inside the loop of one warpgroup (no wgmma group crosses a warpgroup-dependent branch). The same
// products, the same dQ sum: the same bits as the other loop.
// T (HopBwdWs::T64): dS stored K-major and dQ made transposed into the swizzled boxes, as in the q80 kernels.
template <int D, int N, int LDQ, bool T = false> struct HopBwdPipe {
    typedef HopBwdWs<D> SM;
    float (&dk)[D / 2];
    float (&dv)[D / 2];
    const u16 *sKw, *sVw, *sQ, *sdO;
    u16* sDS;
    const float* sL;
    u64* bar;
    const u16* kcols;  // this warpgroup's dQ columns of K
    float* stq;        // this thread's first value of the staging tile: row 16 wq + g, column 2 t of kcols'
    int row0, t;
    bool kvalid0, kvalid1, full;
    float scale_log2, scaling;
    int wq, lane;
    static constexpr int NQ = N > 0 ? N / 2 : 1;  // dQ accumulators (a step's own: dead between steps)
    static_assert(!T || N == 0 || N == HOP_BQ, "T: dq^T over the step's 64 queries, for the warpgroup's 64 columns");

    // dQ of step j (its dS^T in buffer j & 1), issued and committed
    __device__ __forceinline__ void issue_dq(float (&dq)[NQ], int j) {
        if constexpr (N > 0 && T) hop_dq_issue<HOP_BQ, true>(dq, sDS + (j & 1) * SM::DS, kcols);
        else if constexpr (N > 0) hop_dq_issue<N>(dq, sDS + (j & 1) * SM::DS, kcols);
    }
    // dQ of step j (waited for) into the staging tile, once the writers have read step j - 1's
    __device__ __forceinline__ void stage_dq(const float (&dq)[NQ], int j) {
        if (j > 0) mbar_wait(&bar[6], (j - 1) & 1);
        if constexpr (N > 0 && T) {
            hop_bwd_stage_dqt<HOP_BQ>(stq, dq, scaling, wq, row0 & 7, t);
        } else if constexpr (N > 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float* p = stq + 8 * r * LDQ;
#pragma unroll
                for (int c = 0; c < N / 8; ++c)
                    *reinterpret_cast<float2*>(p + 8 * c) =
                        make_float2(dq[4 * c + 2 * r] * scaling, dq[4 * c + 2 * r + 1] * scaling);
            }
        }
        mbar_arrive(&bar[5]);  // this thread's share of step j's staging tile is written
    }
    __device__ __forceinline__ void wait_ds(int j) { mbar_wait(&bar[7 + (j & 1)], (j >> 1) & 1); }

    // step it; FIRST (it == 0: no dQ of a step before) at compile time, so that every path issues and waits for
    // the same wgmma groups
    template <bool FIRST> __device__ __forceinline__ void step(int it) {
        const int st = it & 1;
        mbar_wait(&bar[1 + st], (it >> 1) & 1);
        const u16* q = sQ + st * SM::QT;
        const u16* dO = sdO + st * SM::QT;
        const float* L = sL + st * 2 * HOP_BQ;  // lse2 [64] and delta [64] of the step's queries
        float s[HOP_BQ / 2], dp[HOP_BQ / 2], dq[NQ];
        float lq[HOP_BQ / 4], dl[HOP_BQ / 4];
        if constexpr (SM::LSE_FIRST) hop_bwd_lse_load(L, t, lq, dl);
        hop_bwd_scores_issue<D>(s, dp, sKw, sVw, q, dO);
        if constexpr (!FIRST) {
            wait_ds(it - 1);  // both halves of dS^T (it - 1)
            issue_dq(dq, it - 1);
            if constexpr (N > 0) wgmma_wait<1>();  // S^T and dP^T in, dQ (it - 1) running
            else wgmma_wait<0>();
        } else {
            wgmma_wait<0>();
        }
        reg_fence(s);
        reg_fence(dp);
        if constexpr (SM::LSE_FIRST) hop_bwd_p_ds(s, dp, HopLseRegs{lq, dl}, kvalid0, kvalid1, full, scale_log2);
        else hop_bwd_p_ds(s, dp, HopLseSmem{L, t}, kvalid0, kvalid1, full, scale_log2);
        u32 pa[HOP_BQ / 16][4], sa[HOP_BQ / 16][4];
        hop_bwd_to_a(pa, sa, s, dp);
        if constexpr (!FIRST) {  // dQ (it - 1) done: its reads of dS^T buffer (it - 1) & 1 are over
            wgmma_wait<0>();
            if constexpr (N > 0) reg_fence(dq);
        }
        if constexpr (T) hop_bwd_store_ds_t(sDS + st * SM::DS + (row0 >> 6) * HOP_BQ * 64, sa, wq, lane);
        else hop_bwd_store_ds(sDS + st * SM::DS, sa, row0, t);
        fence_async_smem();  // dS^T stores, read by wgmma
        mbar_arrive(&bar[7 + st]);
        if constexpr (!FIRST) stage_dq(dq, it - 1);
        hop_bwd_dkdv<D>(dk, dv, pa, sa, q, dO);
        wgmma_wait<0>();
        reg_fence(dk);
        reg_fence(dv);
        reg_fence_u(pa);
        reg_fence_u(sa);
        mbar_arrive(&bar[3 + st]);  // the stage's Q and dO are read
    }

    __device__ __forceinline__ void run(int nit) {
        // dK and dV are zero here, which the compiler would otherwise know at the first step's products, and
        // materialise (32 moves) between their wgmma fence and the products
        reg_fence(dk);
        reg_fence(dv);
        step<true>(0);
#pragma unroll 1
        for (int it = 1; it < nit; ++it) step<false>(it);
        float dq[NQ];
        wait_ds(nit - 1);
        issue_dq(dq, nit - 1);
        wgmma_wait<0>();
        if constexpr (N > 0) reg_fence(dq);
        stage_dq(dq, nit - 1);
    }
};

// This block's place in launch order, read afresh (asm volatile: not a value the compiler keeps live across the
// loop, where D = 128 has no register to spare).
__device__ __forceinline__ int hop_lin_fresh() {
    unsigned x, y;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    return (int)(x + gridDim.x * y);
}

// SPLIT: the kernel that takes the tail split (split_units, split_parts, ntiles, split_buf, split_count: below);
// without it those parameters are not read.
template <int D, class OT, bool ROPE, bool FUSED = false, bool SPLIT = false, int BQ = HOP_BQ>
__device__ __forceinline__ void hop_bwd_ws(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                           const TmaDesc* tdo, const int* __restrict__ tiles,
                                           const float* __restrict__ lse, const float* __restrict__ delta,
                                           float* __restrict__ dqacc, int* __restrict__ sem,
                                           typename OT::T* __restrict__ dk_out, typename OT::T* __restrict__ dv_out,
                                           i64 out_ld, const float* __restrict__ cs, const float* __restrict__ sn,
                                           float* __restrict__ part, float* __restrict__ outT, int ldt, int T,
                                           float scale_log2, float scaling, int order, int split_units = 0,
                                           int split_parts = 1, int ntiles = 0, float* __restrict__ split_buf = nullptr,
                                           int* __restrict__ split_count = nullptr,
                                           typename OT::T* __restrict__ dq_out = nullptr,
                                           const TmaDesc* tdq = nullptr) {
    typedef HopBwdWs<D, BQ> SM;
    constexpr int NB = HopDims<D>::NB, LDQ = SM::LDQ;
    constexpr bool EPI_NAMED = CUPY_ROPE_BWD_EPI_NAMED && !SPLIT;  // the epilogue on named barrier 5 (above)
    constexpr bool T64 = SM::T64 && !FUSED;  // D = 64: dQ transposed into swizzled boxes (HopBwdWs::T64)
    constexpr bool TMA = SM::DQ_TMA || T64;   // full steps through the copy engine, boxes of 32 columns
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + SM::KT;
    u16* sQ = sV + SM::KT;       // [2][QT]
    u16* sdO = sQ + 2 * SM::QT;  // [2][QT]
    u16* sDS = sdO + 2 * SM::QT; // [2][DS]
    float* sDQ = reinterpret_cast<float*>(smem_raw + SM::MAIN);
    float* sL = reinterpret_cast<float*>(smem_raw + SM::MAIN + SM::DQ);  // [2 stages][lse2 64, delta 64]
    u64* bar = reinterpret_cast<u64*>(smem_raw + SM::BYTES - 128);

    // The unit (head, key tile) of this block in launch order, and its part: the first split_units units run as
    // split_parts blocks each (the tail split, hopper.tail_split), part p walking query steps [ib, ib + nit) of
    // the tile's sequence, its partial dK and dV in slot lin of split_buf; the grid's last row may hold blocks
    // past the last unit. After the loop the split facts are derived again from hop_lin_fresh() and the
    // parameters.
    const int NH = gridDim.x;
    int parts = 1, pid = 0;
    HopBlock blk;
    if constexpr (SPLIT) {
        const int lin = blockIdx.x + NH * blockIdx.y, nsplit = split_units * split_parts;
        const int unit = lin < nsplit ? lin / split_parts : lin - nsplit + split_units;
        if (unit >= NH * ntiles) return;
        if (lin < nsplit) parts = split_parts, pid = lin - unit * split_parts;
        blk = hop_bwd_unit(order, unit, NH, ntiles);
    } else {
        blk = hop_bwd_block(order);
    }
    const int h = blk.h, tile = blk.kb;
    const int kv0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nkv = min(HOP_BN, s1 - kv0), kvi = (kv0 - s0) / HOP_BN;
    const int nall = (s1 - s0 + BQ - 1) / BQ, ib = SPLIT ? pid * nall / parts : 0;
    // this part's steps (0: a split tile's part with none)
    const int nit = SPLIT ? (pid + 1) * nall / parts - ib : nall * CUPY_ROPE_PROBE_REPEAT;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 KV_BYTES = SM::KT * 2;

    if (threadIdx.x == 0) {
        mbar_init(&bar[0], 1);
        mbar_init(&bar[1], 32);
        mbar_init(&bar[2], 32);
        mbar_init(&bar[3], 256);
        mbar_init(&bar[4], 256);
        mbar_init(&bar[5], 256);
        mbar_init(&bar[6], 1);
        mbar_init(&bar[7], 256);
        mbar_init(&bar[8], 256);
        if (FUSED) mbar_init(&bar[15], 1);  // the read-ahead rows in (hop_bwd_write_last_step)
        mbar_init_fence();
        HOP_PROBE(for (int i = 10; i < 14; ++i) bar[i] = 0;)
        HOP_PROBE(if (!SPLIT) hop_probe_rec(hop_lin_fresh())[0] = hop_gtime(),
                                hop_probe_rec(hop_lin_fresh())[1] = clock64();)
    }
    __syncthreads();

    if (wg == 2) {  // ---------------------------------------------------------------- producer, dQ writers
        setmaxnreg_dec<SM::PRODUCER_REGS>();
        const int w = (threadIdx.x >> 5) - 8;
        if (w == 0) {  // lane 0 the copies; lanes 1-31 the stage's lse2 and delta, then their arrivals
            if (lane == 0) {
                mbar_expect_tx(&bar[0], 2 * KV_BYTES);
                tma_tile<NB, HOP_BN>(sK, tk, &bar[0], h, kv0);
                tma_tile<NB, HOP_BN>(sV, tv, &bar[0], h, kv0);
            }
            for (int it = 0; it < nit; ++it) {
                const int q0 = s0 + (ib + HOP_PROBE_STEP(it, nall)) * BQ;
                hop_bwd_load_step<NB, BQ>(tq, tdo, lse, delta, sQ, sdO, sL, bar, it, h, q0, min(BQ, s1 - q0), T, lane);
            }
        } else {
            const int wt = threadIdx.x - 288;  // 0..95
            // FUSED (plain outputs only): the sequence's last key tile writes dQ, its rows' sums from the tiles
            // before it (dqacc) plus its own straight to dq_out, and no dQ write kernel follows
            if (FUSED && kv0 + HOP_BN >= s1) {
                // the sequence's last key tile: this step's rows of dQ, then the staging tile is free (no later
                // key tile waits on these rows)
                float* pre = reinterpret_cast<float*>(smem_raw + SM::PRE);
                for (int it = 0; it < nit; ++it) {
                    const int q0 = s0 + (ib + HOP_PROBE_STEP(it, nall)) * BQ;
                    hop_bwd_write_last_step<D, LDQ>(reinterpret_cast<float*>(dq_out), out_ld, dqacc, sem, sDQ, pre,
                                                    bar, &bar[15], it & 1, it, h, T, q0, min(BQ, s1 - q0), kvi, wt);
                }
            } else {
                for (int it = 0; it < nit; ++it) {
                    const int q0 = s0 + (ib + HOP_PROBE_STEP(it, nall)) * BQ, nq = min(BQ, s1 - q0);
                    if (TMA && nq == BQ) {  // a full step: one thread, D / 32 tensor reductions
                        if (wt == 0) {
                            hop_wait_count(sem, h, T, q0, kvi, &bar[13]);
                            mbar_wait(&bar[5], it & 1);
#pragma unroll
                            for (int b = 0; b < D / 32; ++b) {
                                if (kvi == 0) tma_store_3d(tdq, sDQ + b * BQ * 32, 32 * b, h, q0);
                                else tma_reduce_add_3d(tdq, sDQ + b * BQ * 32, 32 * b, h, q0);
                            }
                            bulk_commit();
                            bulk_wait_read<0>();
                            mbar_arrive(&bar[6]);  // the staging tile is read
                            bulk_wait<0>();        // ... and added: then the next key tile may add
                            fence_async_global();
                            st_release(sem + (i64)h * T + q0, kvi + 1);
                        }
                        continue;
                    }
                    hop_bwd_write_add_step<D, BQ, LDQ, TMA>(dqacc, sem, sDQ, bar, it, h, T, q0, nq, kvi, wt);
                }
            }
            HOP_PROBE(if (!SPLIT && wt == 0) {
                unsigned long long* r = hop_probe_rec(hop_lin_fresh());
                r[10] = bar[12], r[11] = bar[13], r[12] = clock64();
            })
        }
        // a split tile's epilogue runs in its last part only: the consumers say which (named barrier 4, met by
        // the consumers at another instruction: unaligned)
        if (SPLIT && ROPE && hop_lin_fresh() < split_units * split_parts) {
            named_barrier<true>(4, 384);
            if (!*reinterpret_cast<volatile int*>(smem_raw + SM::BYTES - 48)) return;
        }
        // the consumers' epilogue barriers: one before the passes, then per pass write_grad_tile's two and one
        // (the plain kernels' consumers store from their accumulators and meet at none); unaligned barriers, as the
        // consumers meet them at other instructions
#pragma unroll 1
        for (int i = 0; i < (ROPE && !EPI_NAMED ? 7 : 0); ++i) block_sync<true>();
        return;
    }
    setmaxnreg_inc<SM::CONSUMER_REGS>();

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    const u16* sKw = sK + wg * 64 * 64;  // this warpgroup's 64 keys of each column block
    const u16* sVw = sV + wg * 64 * 64;
    const bool kvalid0 = wg * 64 + wq * 16 + g < nkv, kvalid1 = wg * 64 + wq * 16 + g + 8 < nkv;
    mbar_wait(&bar[0], 0);
    HOP_PROBE(if (!SPLIT && threadIdx.x == 0) hop_probe_rec(hop_lin_fresh())[2] = clock64();)

    constexpr int N0 = HopDqCols<D, 0>::N, N1 = HopDqCols<D, 1>::N;
    if constexpr (SM::PIPE && !FUSED) {
        if (!SPLIT || nit > 0) {  // a part of a split tile may have no steps
            const int row0 = wg * 64 + wq * 16 + g;
            const bool full = nkv == HOP_BN;
            if (wg == 0)
                HopBwdPipe<D, N0, LDQ, T64>{dk, dv, sKw, sVw, sQ, sdO, sDS, sL, bar, sK,
                                            T64 ? sDQ : sDQ + (wq * 16 + g) * LDQ + 2 * t, row0, t, kvalid0, kvalid1,
                                            full, scale_log2, scaling, wq, lane}.run(nit);
            else
                HopBwdPipe<D, N1, LDQ, T64>{dk, dv, sKw, sVw, sQ, sdO, sDS, sL, bar, sK + HOP_BN * 64,
                                            sDQ + 64 + (wq * 16 + g) * LDQ + 2 * t, row0, t, kvalid0, kvalid1, full,
                                            scale_log2, scaling, wq, lane}.run(nit);
        }
    } else {  // the barrier loop: D = 128, and the kernel that writes dQ from the last key tile
        for (int it = 0; it < nit; ++it) {
            const int st = it & 1;
            HOP_PROBE_WAIT(&bar[1 + st], (it >> 1) & 1, &bar[10]);
            const u16* q = sQ + st * SM::QT;
            const u16* dO = sdO + st * SM::QT;
            u16* ds_buf = sDS + st * SM::DS;

            float s[BQ / 2], dp[BQ / 2];
            const float* L = sL + st * 2 * BQ;  // lse2 [BQ] and delta [BQ] of the step's queries
            if constexpr (SM::LSE_FIRST) {  // this lane's columns 8j + 2t + {0, 1}, read before the products
                // (hop_bwd_lse_load's loop, written out: through the call ptxas schedules the fused-dQ kernel at
                // D = 64 differently, and this loop's kernels are the measured ones)
                float lq[BQ / 4], dq_[BQ / 4];
#pragma unroll
                for (int j = 0; j < BQ / 8; ++j) {
                    const float2 l = *reinterpret_cast<const float2*>(L + 8 * j + 2 * t);
                    const float2 d = *reinterpret_cast<const float2*>(L + BQ + 8 * j + 2 * t);
                    lq[2 * j] = l.x;
                    lq[2 * j + 1] = l.y;
                    dq_[2 * j] = d.x;
                    dq_[2 * j + 1] = d.y;
                }
                hop_bwd_scores<D>(s, dp, sKw, sVw, q, dO);
                hop_bwd_p_ds(s, dp, HopLseRegs{lq, dq_}, kvalid0, kvalid1, nkv == HOP_BN, scale_log2);
            } else {  // read column pair by column pair as P^T and dS^T are made (no registers held across)
                hop_bwd_scores<D, BQ>(s, dp, sKw, sVw, q, dO);
                hop_bwd_p_ds(s, dp, HopLseSmemT<BQ>{L, t}, kvalid0, kvalid1, nkv == HOP_BN, scale_log2);
            }
            // dS^T into the step's buffer; the buffer of step it - 2 is free: both warpgroups passed named barrier 1
            // of step it - 1 after their dQ products of step it - 2
            u32 pa[BQ / 16][4], sa[BQ / 16][4];  // live until the wait below
            hop_bwd_to_a(pa, sa, s, dp);
            if constexpr (SM::Q80) hop_bwd_store_ds_t(ds_buf + wg * BQ * 64, sa, wq, lane);
            else hop_bwd_store_ds(ds_buf, sa, wg * 64 + wq * 16 + g, t);
            hop_bwd_dkdv<D>(dk, dv, pa, sa, q, dO);
            fence_async_smem();        // dS^T stores, read by wgmma below
            named_barrier(1, 256);     // both halves of dS^T are written
            // dQ(step) = dS K for this warpgroup's columns [64 wg, 64 wg + N), into the staging tile. Each branch
            // waits for its own wgmma groups: a group left in flight across a warpgroup-dependent branch makes ptxas
            // serialise every wgmma of the kernel.
            if constexpr (SM::DQ_TMA) {  // the same, into the swizzled boxes (two per warpgroup)
                hop_bwd_dq_step<BQ, LDQ, true, true>(ds_buf, sK + wg * HOP_BN * 64, sDQ + wg * 64 * BQ, scaling,
                                                     &bar[3 + st], &bar[6], it, wq, g, t);
            } else if constexpr (SM::Q80) {  // no branch: the warpgroups differ in their columns only
                hop_bwd_dq_step<BQ, LDQ, true>(ds_buf, sK + wg * HOP_BN * 64, sDQ + wg * 64, scaling, &bar[3 + st],
                                               &bar[6], it, wq, g, t);
            } else if (wg == 0) {
                hop_bwd_dq_step<N0, LDQ>(ds_buf, sK, sDQ, scaling, &bar[3 + st], &bar[6], it, wq, g, t);
            } else if constexpr (N1 > 0) {
                hop_bwd_dq_step<N1, LDQ>(ds_buf, sK + HOP_BN * 64, sDQ + 64, scaling, &bar[3 + st], &bar[6], it, wq,
                                         g, t);
            } else {  // no dQ columns (D = 64): release the stage, and keep in step with the writers
                wgmma_wait<0>();
                mbar_arrive(&bar[3 + st]);
                if (it > 0) mbar_wait(&bar[6], (it - 1) & 1);
            }
            reg_fence(dk);
            reg_fence(dv);
            reg_fence_u(pa);
            reg_fence_u(sa);
            mbar_arrive(&bar[5]);  // this thread's share of the staging tile is written
        }
    }

    HOP_PROBE(if (!SPLIT && threadIdx.x == 0) hop_probe_rec(hop_lin_fresh())[3] = clock64();)
    const int slot = SPLIT ? hop_lin_fresh() : 0;
    if (SPLIT && slot < split_units * split_parts) {  // a split tile: dK and dV of every part, summed in part
        const int tid = threadIdx.x, parts_ = split_parts;  // order by the last part to finish
        volatile int* s_last = reinterpret_cast<volatile int*>(smem_raw + SM::BYTES - 48);  // after the barriers
        float* mine = split_buf + ((i64)slot * 256 + tid) * D;
#pragma unroll
        for (int i = 0; i < D / 2; i += 4) {
            *reinterpret_cast<float4*>(mine + i) = make_float4(dk[i], dk[i + 1], dk[i + 2], dk[i + 3]);
            *reinterpret_cast<float4*>(mine + D / 2 + i) = make_float4(dv[i], dv[i + 1], dv[i + 2], dv[i + 3]);
        }
        __threadfence();
        named_barrier(3, 256);
        if (tid == 0) *s_last = atomicAdd(split_count + slot / parts_, 1) == parts_ - 1;
        named_barrier<true>(4, ROPE ? 384 : 256);  // with ROPE, met by the producers at another instruction
        if (!*s_last) return;
        __threadfence();
        const float* src = split_buf + ((i64)(slot - slot % parts_) * 256 + tid) * D;
        if constexpr (!ROPE) {  // plain outputs: summed chunk by chunk and stored (hop_bwd_store_plain's values)
            hop_bwd_sum_store_plain<D>(reinterpret_cast<float*>(dk_out) + (i64)kv0 * out_ld + (i64)h * D,
                                       reinterpret_cast<float*>(dv_out) + (i64)kv0 * out_ld + (i64)h * D, out_ld,
                                       src, parts_, scaling, wg * 64 + wq * 16 + g, nkv, t);
            return;
        }
#pragma unroll
        for (int i = 0; i < D / 2; i += 4) {  // part 0
            const float4 a = ld_cg_v4(src + i), b = ld_cg_v4(src + D / 2 + i);
            dk[i] = a.x, dk[i + 1] = a.y, dk[i + 2] = a.z, dk[i + 3] = a.w;
            dv[i] = b.x, dv[i + 1] = b.y, dv[i + 2] = b.z, dv[i + 3] = b.w;
        }
#pragma unroll 1
        for (int p = 1; p < parts_; ++p) {  // then the others, in order
            src += 256 * D;
#pragma unroll
            for (int i = 0; i < D / 2; i += 4) {
                const float4 a = ld_cg_v4(src + i), b = ld_cg_v4(src + D / 2 + i);
                dk[i] += a.x, dk[i + 1] += a.y, dk[i + 2] += a.z, dk[i + 3] += a.w;
                dv[i] += b.x, dv[i + 1] += b.y, dv[i + 2] += b.z, dv[i + 3] += b.w;
            }
        }
    }
    if constexpr (!ROPE) {  // plain outputs: straight from the accumulators, no barrier
        hop_bwd_store_plain<D>(reinterpret_cast<float*>(dk_out) + (i64)kv0 * out_ld + (i64)h * D,
                               reinterpret_cast<float*>(dv_out) + (i64)kv0 * out_ld + (i64)h * D, out_ld, dk, dv,
                               scaling, wg * 64 + wq * 16 + g, nkv, t);
        HOP_PROBE(if (!SPLIT && threadIdx.x == 0) hop_probe_end(bar, hop_lin_fresh(), nit, (FUSED ? 1 : 2) + 16 * kvi);)
        return;
    }
    // epilogue (backward.cuh's) over Q, dO, dS^T, once every consumer is out of the loop
    if constexpr (EPI_NAMED) named_barrier(5, 256);
    else block_sync<true>();
    hop_bwd_epilogue<D, OT, ROPE, true, EPI_NAMED ? 5 : 0, CUPY_ROPE_BWD_EPI_UNROLL>(
        reinterpret_cast<float*>(sQ), dk, dv, scaling, wg, wq, g, t, h, NH, tile, kv0, nkv, dk_out, dv_out, out_ld, cs,
        sn, part, outT, ldt, T);
    HOP_PROBE(if (!SPLIT && threadIdx.x == 0) hop_probe_end(bar, hop_lin_fresh(), nit, 3 + 16 * kvi);)
}

