// sm_90a backward, tf32, warp-specialised, two Q/dO stages: backward_tf32_ws.cuh with K and V held in registers
// as wgmma A fragments, which frees their 64 KB of shared memory for a second stage of Q and dO.
//
// backward_tf32_ws.cuh has one buffer per streamed tile, so a step's S^T / dP^T wait for the copy of its Q / dO
// issued only when the step before released them. Here:
//   - WG0 reads its K fragments (S^T = K Q^T, RS: rows = keys, k = head dim; K is tf32-rounded already) and WG1
//     its V fragments (dP^T = V dO^T) from the K/V tiles once; then that region is Q/dO stage 1 (stage 0 is
//     where the single buffer was). The producer issues step it + 1's Q and dO as soon as their stage is free;
//   - P^T is handed over on a per-stage mbarrier (WG0 may run a step ahead, which a named barrier's count
//     would not survive);
//   - Q^T and dO^T stay single-buffered (their copies are issued at the end of the previous step's dK / dV and
//     have the S^T / dP^T products of the next step to arrive in).
// Barriers: full [0] K/V/K^T, [1 + s] Q/dO stage s, [3] Q^T, [4] dO^T; empty [5 + s] Q/dO stage s (stage 1's
// first arrival: K and V are in registers; with dQ^T staged over the stage's Q, from warp 9 once the engine has
// read it), [7] Q^T, [8] dO^T (read by WG0's dV); [9] dQ turn, or dQ^T staged (over Q: even steps);
// [10 + s] P^T of stage s; [12] dO^T read by the engine (with dQ^T staged over it), or dQ^T staged (over Q: odd
// steps); without the copy engine's dQ^T, [12 + s] step handed to the releasing warp, [14 + s] step released
// (CUPY_ROPE_TF32_RELEASER); with CUPY_ROPE_TF32_DO_APART, [1 + s] is the stage's Q only, and its dO has full
// [13 + s] and empty [15 + s] (stage 1's first arrival: K and V are in registers).
//
// The step's dQ count is released by warp 9 (idle otherwise: the producer warpgroup's second warp), not by WG1
// (CUPY_ROPE_TF32_RELEASER, backward_tf32_ws.cuh). The release's fence waits for the step's reductions to reach
// L2; done by one of WG1's warps it held all four at their next products (wgmma needs the whole warpgroup).
//
// The step's dQ^T leaves through the copy engine (CUPY_ROPE_TF32_DQ_BULK, below): WG1 stages it over the Q half
// of the step's Q/dO stage (CUPY_ROPE_TF32_DQ_OVER_Q; 0: over the dO^T buffer, which WG0's dV has finished with,
// CUPY_ROPE_TF32_DQ_OVER_DOT; both 0: over Q^T), and warp 9 adds it into
// dqacc^T with tensor reductions in key-tile order, so WG1 neither waits for the dQ turn nor issues the adds.
// With CUPY_ROPE_TF32_DQ_BULK at 0, WG1 adds its rows itself in the turn: both 64-row blocks' products issued
// into two accumulator sets before the first block's adds (CUPY_ROPE_TF32_DQ_PAIR), a lone block's product
// before the turn's wait (CUPY_ROPE_TF32_DQ_EARLY).
// Set to 1, CUPY_ROPE_TF32_DQ_SPLIT splits the product by its 64-row blocks: WG0, once its dV product is done,
// waits for WG1's dS^T (named barrier 5: WG1 arrives after staging it), takes rows [0, 64) and WG1 the rest; both
// add their rows in the dQ turn and meet on named barrier 6 before WG1 releases the count and the Q^T buffer (both
// barriers unaligned: the warpgroups reach them from different instructions). WG1's chain per step (dP^T, dS^T,
// dK, dQ^T: three products) against WG0's (S^T, P^T, dV: two) becomes two and a half each. Every form makes the
// same sums in the same order (the same bits).
#pragma once
#include "attention/sm90/backward_tf32_ws.cuh"

#ifndef CUPY_ROPE_TF32_DQ_SPLIT
#define CUPY_ROPE_TF32_DQ_SPLIT 0
#endif
// CUPY_ROPE_TF32_DQ_BULK (a build switch; unset: 1; unsplit only): the step's dQ^T leaves through the copy engine
// instead of WG1's reductions. Once the dQ^T products have read dS^T (staged over Q^T), WG1 stages dQ^T, scaled,
// over a transposed tile's buffer ([2][D][32], the layout the Q^T and dO^T copies have: exactly their size; which
// buffer: CUPY_ROPE_TF32_DQ_OVER_DOT) and goes on to the next step without waiting for the turn; warp 9 waits for
// the previous key tile's count, issues two tensor reductions (fp32 adds in L2, as red.add: the same bits), frees
// the buffer once the engine has read it and releases the count once the adds completed. The producers then only
// copy (no turn); barrier [9] says "dQ^T staged". Measured with dQ^T over Q^T (backward
// alone, ms, on / off, the same bits; bench/lab/tf32_dq_bulk_ab.txt): 1 x 16384 D = 128 50.46 / 53.93, 4 x 4096
// 13.29 / 14.05, 32 x 256 1.103 / 1.190; 9216 D = 80 7.72 / 8.73 and 8192 D = 96 6.53 / 7.28 (against the split,
// which unsplit without the engine already beat there: 8.36 and 6.98); 8192 D = 64 5.15 against the one-stage
// kernel's 5.56 (plan.tf32_stages).
#ifndef CUPY_ROPE_TF32_DQ_BULK
#define CUPY_ROPE_TF32_DQ_BULK 1
#endif
// Lab probe (wrong results, timing only): CUPY_ROPE_PROBE_TF32_NO_STREAM=1 makes the two-stage backward's producer
// copy each streamed buffer (Q/dO stages 0 and 1, Q^T, dO^T) once only; every later step's full barrier is met by
// a bare arrival and the step reads the stale tiles. It bounds what less streamed traffic per FLOP (tiles shared
// by a pair of key blocks through a cluster's multicast copies: half of it) could buy. Unset: 0.
#ifndef CUPY_ROPE_PROBE_TF32_NO_STREAM
#define CUPY_ROPE_PROBE_TF32_NO_STREAM 0
#endif

// Whether the two-stage backward splits its dQ^T rows between the warpgroups (CUPY_ROPE_TF32_DQ_SPLIT; unset: 0).
// The split ties the warpgroups together each step (WG0 waits for dS^T, which follows WG1's dK, instead of running
// a stage ahead); what it buys is balance. While WG1 added its rows from registers it measured 5-8% faster at D =
// 80 and 96 (dQ^T is two full 64-row blocks there, as at 128, while WG1's other products shrink with D) and 4-5%
// slower at 128; with the dQ^T pair and the early issue, unsplit was faster at 80 and 96 too (8.36 against 8.73
// ms at 9216 D = 80), and with dQ^T through the copy engine WG1's chain is shorter still.
template <int D>
__device__ constexpr bool hop32_dq_split() {
    return CUPY_ROPE_TF32_DQ_SPLIT != 0;
}

// acc (m64nD) += A B over one k8 step. At D = 64, as two m64n32k8 halves (B rows d: + 32 rows = + 4096 bytes; the
// same arithmetic): a dV / dK product of the S^T / dP^T products' shape (m64n64k8) has its register A operand
// placed by ptxas in the K / V fragments' registers, although those stay live across the loop (seen in the
// machine code at D = 64; the other head dims' products are m64nDk8 and keep them).
template <int D>
__device__ __forceinline__ void ws2_rs_acc(float (&acc)[D / 2], const u32 (&a)[4], u64 db, u32 ob) {
    if constexpr (D == 64) {
        wgmma_rs_tf32<32>(*reinterpret_cast<float(*)[16]>(acc), a, db, 1, ob);
        wgmma_rs_tf32<32>(*reinterpret_cast<float(*)[16]>(acc + 16), a, db, 1, ob + u16b(32 * 32));
        return;
    }
    wgmma_rs_tf32<D>(acc, a, db, 1, ob);
}

template <int D>
__device__ constexpr bool hop32_dq_bulk() {
    return CUPY_ROPE_TF32_DQ_BULK && !hop32_dq_split<D>();
}

// CUPY_ROPE_TF32_DQ_OVER_DOT (a build switch; unset: 1; with the dQ^T tiles through the copy engine only): dQ^T
// staged over the dO^T buffer instead of Q^T's. WG1 frees Q^T as soon as its dQ^T products have read dS^T (so the
// next Q^T copy, which its next dK waits for, no longer follows the dQ turn and the engine's read), then waits for
// WG0's dV to have read dO^T ([8], which the producer no longer waits on) and stages dQ^T there; warp 9 frees dO^T
// on [12] once the engine has read it, and warp 10 issues the dO^T copies on that, so that the turn's wait lands
// on WG0's dV, which has the slack (its dO^T wait, Nsight Compute), and never on warp 8's Q^T and Q/dO copies.
// Nsight Compute on the form over Q^T (1 x 4096, D = 128; bench/lab/ncu_tf32_ws2_bulk.txt): WG1 waited for Q^T
// in ~12% of its samples, WG0 for dO^T in ~35%, warp 8 mostly for Q^T's release. Measured (backward alone, ms,
// on / off, the same bits; bench/lab/tf32_dq_over_dot_ab.txt): 4 x 4096 12.06 / 13.18, 9216 D = 80 6.93 / 7.75,
// 1 x 16384 46.96 / 50.25. Only the Q^T copies moved to a warp of their own (dQ^T still over Q^T) gave nothing
// (bench/lab/tf32_qt_warp_ab.txt): what held WG1 was Q^T's release behind the turn.
#ifndef CUPY_ROPE_TF32_DQ_OVER_DOT
#define CUPY_ROPE_TF32_DQ_OVER_DOT 1
#endif
// CUPY_ROPE_TF32_DQ_OVER_Q (a build switch; unset: 1; with the dQ^T tiles through the copy engine only; before
// CUPY_ROPE_TF32_DQ_OVER_DOT): dQ^T staged over the Q half of the step's own Q/dO stage, which WG0's S^T (then its
// P^T, read by WG1's dS^T) and WG1's dP^T are done with by then (QTT <= QT at every head dim). Q^T and dO^T are
// then freed as soon as dK / dV have read them (dO^T on [8] by WG0 again, Q^T on [7] by WG1 after its dQ^T
// products have read the dS^T staged there), so neither transposed copy waits for the engine; what waits for it
// is the stage's release ([5 + s], now from warp 9), which the Q/dO copy two steps on needs (issued by warp 10),
// a whole step of slack where the transposed tiles had none. Warp 9 may then be two staged tiles behind WG1, so
// "dQ^T staged" alternates between [9] (even steps) and [12] (odd). Nsight Compute on the form over dO^T (1 x
// 4096, D = 128; bench/lab/ncu_tf32_ws2_over_dot.txt): WG0 waited for dO^T in 30% of its samples (the turn and
// the engine's read, then the copy), WG1 for WG0's dV before staging in ~6%. Measured (backward alone, ms, on /
// off, the same bits; bench/lab/tf32_dq_over_q_ab.txt): 1 x 16384 43.75 / 46.65, 4 x 4096 11.53 / 12.03, 9216
// D = 80 6.59 / 6.93, 8192 D = 64 4.64 / 4.85, 32 x 256 1.070 / 1.081. The wait that is left is the step's Q/dO
// (both warpgroups, ~14% of their samples: the turn and the engine's read, two steps on).
#ifndef CUPY_ROPE_TF32_DQ_OVER_Q
#define CUPY_ROPE_TF32_DQ_OVER_Q 1
#endif
template <int D>
__device__ constexpr bool hop32_dq_over_q() {
    return CUPY_ROPE_TF32_DQ_OVER_Q && hop32_dq_bulk<D>();
}
// CUPY_ROPE_TF32_DO_APART (a build switch; unset: above D = 64; with CUPY_ROPE_TF32_DQ_OVER_Q only): a stage's dO
// has barriers of its own (full [13 + s], empty [15 + s]). WG1 frees it once its dP^T has read it (with P^T read,
// the barrier it already meets), and warp 10 copies the next dO into it then, instead of waiting with Q for the
// engine's read of the dQ^T staged over Q; WG1's dP^T waits for dO only. Measured (backward alone, ms, on / off,
// the same bits, 4 rounds; bench/lab/tf32_do_apart_ab.txt): 1 x 16384 44.43 / 45.46, 4 x 4096 11.53 / 11.88,
// 32 x 256 1.096 / 1.106, 9216 D = 80 6.38 / 6.57, 8192 D = 96 5.48 / 5.48. At D = 64 it lost (8192 4.56 / 4.48,
// the mixed case 2.75 / 2.69; why is not measured: its dQ^T read over Q is half of D = 128's), so D = 64 keeps a
// stage's Q and dO freed together.
#ifndef CUPY_ROPE_TF32_DO_APART
#define CUPY_ROPE_TF32_DO_APART (-1)
#endif
template <int D>
__device__ constexpr bool hop32_do_apart() {
    return (CUPY_ROPE_TF32_DO_APART < 0 ? D > 64 : CUPY_ROPE_TF32_DO_APART != 0) && hop32_dq_over_q<D>() &&
           !CUPY_ROPE_PROBE_TF32_NO_STREAM;
}
template <int D>
__device__ constexpr bool hop32_dq_over_dot() {
    return CUPY_ROPE_TF32_DQ_OVER_DOT && hop32_dq_bulk<D>() && !hop32_dq_over_q<D>();
}

// dQ^T rows [64 mb, 64 mb + 64) of a step (a waited-for product, lane layout of hop32_dq_add), times sc, into the
// staged [2][D][32] 128-byte-swizzled tile of 32-query boxes that the dqacc^T tensor map reduces from.
template <int D>
__device__ __forceinline__ void hop32_stage_dqt(float* sT, const float (&dq)[HOP32_BQ / 2], int mb, float sc, int wq,
                                                int g, int t) {
    unsigned char* base = reinterpret_cast<unsigned char*>(sT);
    if (64 * mb + 16 * wq >= D) return;  // the product's rows past D (D = 80, 96: 16-row groups, all or none)
    const int d = 64 * mb + 16 * wq + g;
#pragma unroll
    for (int j = 0; j < HOP32_BQ / 8; ++j) {
        const int q = 8 * j + 2 * t;
        unsigned char* blk = base + (q >> 5) * D * 128;
        *reinterpret_cast<float2*>(blk + swz128w(d, q & 31)) = make_float2(dq[4 * j] * sc, dq[4 * j + 1] * sc);
        *reinterpret_cast<float2*>(blk + swz128w(d + 8, q & 31)) =
            make_float2(dq[4 * j + 2] * sc, dq[4 * j + 3] * sc);
    }
}

// With first_stores (the host's, hopper.first_tile_stores: every step of every sequence is such), whether key
// tile kvi of the sequence [s0, s1) stores its dQ^T share of the step from q0 rather than adding it: the
// sequence's first key tile, over the step's 64 columns when they are the sequence's own (the step starts in it
// and ends at or before its end, or the sequence ends at T: the columns past T are the accumulator's padding,
// read by no one). The accumulator then needs no zeroing. The stored share is the value that adding it into zero
// gives: the sums keep their bits (the sign of an exact zero aside).
__device__ __forceinline__ bool hop32_first_store(int first_stores, int kvi, int q0, int s0, int s1, int T) {
    return first_stores && kvi == 0 && q0 >= s0 && (q0 + HOP32_BQ <= s1 || s1 >= T);
}

// Warp 9 with CUPY_ROPE_TF32_DQ_BULK: each step's staged dQ^T (in sT0, staged0, freed0 for even steps and sT1,
// staged1, freed1 for odd ones; one buffer and one "staged" barrier, phase it & 1, where the pairs are the same)
// added into dqacc^T in key-tile order by the copy engine, its buffer freed once read, the count released once
// added (stored where hop32_first_store).
template <int D>
__device__ __forceinline__ void hop32_dq_bulk_warp(const TmaDesc* tdqt, const float* sT0, const float* sT1,
                                                   u64* staged0, u64* staged1, u64* freed0, u64* freed1,
                                                   int* __restrict__ sem, int h, int T, int s0, int s1, int s0a,
                                                   int nit, int kvi, int first_stores, int lane) {
#pragma unroll 1
    for (int it = 0; it < nit; ++it) {
        const bool odd = it & 1;  // the odd steps' buffer and barriers (the same as the even steps' but over Q)
        const float* sT = odd ? sT1 : sT0;
        u64* freed = odd ? freed1 : freed0;
        if (staged1 == staged0) mbar_wait(staged0, it & 1);
        else mbar_wait(odd ? staged1 : staged0, (it >> 1) & 1);
        if (lane == 0) {
            const int q0 = s0a + it * HOP32_BQ;
            int* sp = sem + (i64)h * T + max(q0, s0);
            const bool store = hop32_first_store(first_stores, kvi, q0, s0, s1, T);
            while (!CUPY_ROPE_PROBE_NO_COUNT_WAIT && ld_acquire(sp) < kvi) {  // (the probe: backward_ws.cuh)
            }
            fence_async_global();  // the earlier key tiles' adds, acquired, before this tile's
#pragma unroll
            for (int b = 0; b < HOP32_BQ / 32; ++b) {
                if (store) tma_store_3d(tdqt, sT + b * D * 32, q0 + 32 * b, 0, h);
                else tma_reduce_add_3d(tdqt, sT + b * D * 32, q0 + 32 * b, 0, h);
            }
            bulk_commit();
            bulk_wait_read<0>();
            mbar_arrive(freed);  // the engine has read the tile: the buffer may be copied into again
            bulk_wait<0>();
            fence_async_global();
            st_release(sp, kvi + 1);
        }
        __syncwarp();
    }
}

// Warp 10 with CUPY_ROPE_TF32_DQ_OVER_Q: each next step's Q and dO, once their stage is free (from warp 9, once
// the engine has read the dQ^T staged in it two steps before; stage 1's first use: K and V are in registers).
template <int D>
__device__ __forceinline__ void ws2_produce_qdo(const TmaDesc* tq, const TmaDesc* tdo, float* sA, float* sS0,
                                                u64* bar, int h, int s0a, int nit, int lane) {
    typedef Hop32Bwd<D> SM;
    constexpr u32 Q_BYTES = SM::QT * 4;
#pragma unroll 1
    for (int n = 1; n < nit; ++n) {
        const int st = n & 1;
        const u32 eph = st == 1 ? (n >> 1) & 1 : ((n >> 1) - 1) & 1;  // stage 1's first phase: K and V read
        float* dst = st ? sA : sS0;
        if constexpr (hop32_do_apart<D>()) {  // dO, then Q, each once its half is free
            mbar_wait(&bar[15 + st], eph);
            if (lane == 0) {
                mbar_expect_tx(&bar[13 + st], Q_BYTES);
                tma_rows32<SM::NB, HOP32_BQ>(dst + SM::QT, tdo, &bar[13 + st], h, s0a + n * HOP32_BQ);
            }
            mbar_wait(&bar[5 + st], eph);
            if (lane == 0) {
                mbar_expect_tx(&bar[1 + st], Q_BYTES);
                tma_rows32<SM::NB, HOP32_BQ>(dst, tq, &bar[1 + st], h, s0a + n * HOP32_BQ);
            }
        } else {  // Q and dO together, once the stage is free
            mbar_wait(&bar[5 + st], eph);
            if (lane == 0 && CUPY_ROPE_PROBE_TF32_NO_STREAM && n >= 2) {
                mbar_expect_tx(&bar[1 + st], 0);  // the probe: the stage's stale tiles, once it is released
            } else if (lane == 0) {
                mbar_expect_tx(&bar[1 + st], 2 * Q_BYTES);
                tma_rows32<SM::NB, HOP32_BQ>(dst, tq, &bar[1 + st], h, s0a + n * HOP32_BQ);
                tma_rows32<SM::NB, HOP32_BQ>(dst + SM::QT, tdo, &bar[1 + st], h, s0a + n * HOP32_BQ);
            }
        }
        __syncwarp();
    }
}

// Warp 10 with CUPY_ROPE_TF32_DQ_OVER_DOT: each step's dO^T copy, once the engine has read the step before's dQ^T
// staged over it (dot_free: [12], from warp 9).
template <int D>
__device__ __forceinline__ void ws2_produce_dot(const TmaDesc* tdot, float* sdOt, u64* bar, int h, int s0a, int nit,
                                                int lane) {
#pragma unroll 1
    for (int it = 0; it < nit; ++it)
        hop32_produce_transposed<D, CUPY_ROPE_PROBE_TF32_NO_STREAM, 1>(
            nullptr, tdot, nullptr, sdOt, &bar[12], &bar[4], nullptr, nullptr, nullptr, it, (it - 1) & 1, h,
            s0a + it * HOP32_BQ, 0, 0, nullptr, 0, lane == 0);
}

template <int D>
__device__ __forceinline__ void ws2_produce(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                            const TmaDesc* tdo, const TmaDesc* tkt, const TmaDesc* tqt,
                                            const TmaDesc* tdot, float* sA, float* sKt, float* sS0, float* sQt,
                                            float* sdOt, u64* bar, int h, int kb, int kv0, int s0, int s0a, int nit,
                                            int kvi, const int* __restrict__ sem, int T, int lane) {
    typedef Hop32Bwd<D> SM;
    constexpr int NB = SM::NB, MB = SM::MB;
    constexpr u32 Q_BYTES = SM::QT * 4;
    const bool leader = lane == 0;
    if (leader) {
        mbar_expect_tx(&bar[0], (2 * SM::KT + 2 * D * 32) * 4);
        tma_rows32<NB, HOP32_BK>(sA, tk, &bar[0], h, kv0);
        tma_rows32<NB, HOP32_BK>(sA + SM::KT, tv, &bar[0], h, kv0);
        tma_cols32<2, 64 * MB>(sKt, tkt, &bar[0], h, kb * HOP32_BK);
        constexpr bool APART = hop32_do_apart<D>();  // the first dO on a barrier of its own, or on Q's
        u64* dobar = APART ? &bar[13] : &bar[1];
        mbar_expect_tx(&bar[1], APART ? Q_BYTES : 2 * Q_BYTES);
        tma_rows32<NB, HOP32_BQ>(sS0, tq, &bar[1], h, s0a);
        if (APART) mbar_expect_tx(dobar, Q_BYTES);
        tma_rows32<NB, HOP32_BQ>(sS0 + SM::QT, tdo, dobar, h, s0a);
    }
    for (int it = 0; it < nit; ++it) {
        const int q0 = s0a + it * HOP32_BQ, ph = (it - 1) & 1;
        if (!hop32_dq_over_q<D>() && it + 1 < nit) {  // the next step's Q and dO, into the stage the step before
                                                       // this one released (over Q: warp 10)
            const int n = it + 1, st = n & 1;
            if (st == 1) mbar_wait(&bar[6], (n >> 1) & 1);  // n = 1: K and V are in registers
            else mbar_wait(&bar[5], ((n >> 1) - 1) & 1);
            if (leader && CUPY_ROPE_PROBE_TF32_NO_STREAM && n >= 2) {
                mbar_expect_tx(&bar[1 + st], 0);
            } else if (leader) {
                mbar_expect_tx(&bar[1 + st], 2 * Q_BYTES);
                float* dst = st ? sA : sS0;
                tma_rows32<NB, HOP32_BQ>(dst, tq, &bar[1 + st], h, q0 + HOP32_BQ);
                tma_rows32<NB, HOP32_BQ>(dst + SM::QT, tdo, &bar[1 + st], h, q0 + HOP32_BQ);
            }
        }
        constexpr int PART = !hop32_dq_bulk<D>() ? 7 : hop32_dq_over_dot<D>() ? 2 : 3;  // dO^T, Q^T, the turn
        hop32_produce_transposed<D, CUPY_ROPE_PROBE_TF32_NO_STREAM, PART>(
            tqt, tdot, sQt, sdOt, &bar[8], &bar[4], &bar[7], &bar[3], &bar[9], it, ph, h, q0, s0, kvi, sem, T, leader);
    }
}

// TAIL (plain outputs only): the kernel that takes the tail split (hopper.tail_split). The first split_units
// units (head, 64-key block) of the launch order run as split_parts blocks each, part p walking the query steps
// [p n / P, (p + 1) n / P) of its sequence's n; each part writes its partial dK and dV (each consumer thread's
// accumulators, D / 2 floats, in slot lin of split_buf) and counts itself in split_count; the part that counts
// last sums the parts' partials in part order (deterministic, whichever part ends last) and stores dK and dV,
// the others store nothing. A part's dQ^T adds wait for the previous key block's on the same query steps, as
// unsplit: the parts of a unit follow their predecessor's parts, launched before them. nunits: the units of a
// head (grid rows of the unsplit launch); the grid's last row may hold blocks past the last unit.
template <int D, class OT, bool ROPE, bool TAIL = false>
__device__ __forceinline__ void hop_bwd_tf32_ws2(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                                 const TmaDesc* tdo, const TmaDesc* tkt, const TmaDesc* tqt,
                                                 const TmaDesc* tdot, const TmaDesc* tdqt,
                                                 const int* __restrict__ tiles,
                                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                                 float* __restrict__ dqacc, int ldq, int* __restrict__ sem,
                                                 typename OT::T* __restrict__ dk_out,
                                                 typename OT::T* __restrict__ dv_out, i64 out_ld,
                                                 const float* __restrict__ cs, const float* __restrict__ sn,
                                                 float* __restrict__ part, float* __restrict__ outT, int ldt, int T,
                                                 float scale_log2, float scaling, int order, int first_stores,
                                                 int split_units = 0, int split_parts = 1, int nunits = 0,
                                                 float* __restrict__ split_buf = nullptr,
                                                 int* __restrict__ split_count = nullptr) {
    typedef Hop32Bwd<D> SM;
    static_assert(!TAIL || !ROPE, "the split kernel has plain outputs");
    static_assert(SM::QT >= 32 * 128, "P^T (64 x 64 fp32) is handed over in the Q buffer");
    static_assert(2 * SM::KT == 2 * SM::QT, "stage 1 of Q/dO takes the K/V tiles' place");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* sA = reinterpret_cast<float*>(smem_raw);  // K, V; then Q/dO stage 1
    float* sKt = sA + 2 * SM::KT;
    float* sS0 = sKt + SM::KTT;  // Q/dO stage 0
    float* sQt = sS0 + 2 * SM::QT;
    float* sdOt = sQt + SM::QTT;
    float* sDS = sQt;
    u64* bar = reinterpret_cast<u64*>(smem_raw + SM::BYTES - 64 - 512);  // 17 barriers in the unused lse area

    int parts = 1, pid = 0;  // this block's part of its unit (TAIL)
    HopBlock blk;
    if constexpr (TAIL) {
        const int lin = blockIdx.x + gridDim.x * blockIdx.y, nsplit = split_units * split_parts;
        const int unit = lin < nsplit ? lin / split_parts : lin - nsplit + split_units;
        if (unit >= (int)gridDim.x * nunits) return;  // the whole block: before any barrier
        if (lin < nsplit) parts = split_parts, pid = lin - unit * split_parts;
        blk = hop_bwd_unit(order, unit, gridDim.x, nunits);
    } else {
        blk = hop_bwd_block(order);
    }
    const int h = blk.h, NH = gridDim.x, tile = blk.kb >> 1, half = blk.kb & 1;
    const int s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int kv0 = tiles[3 * tile] + HOP32_BK * half, nkv = max(0, min(HOP32_BK, s1 - kv0));
    const int kvi = (kv0 - s0) / HOP32_BK;
    int s0a = s0 & ~7, nit = nkv > 0 ? (s1 - s0a + HOP32_BQ - 1) / HOP32_BQ : 0;
    if constexpr (TAIL) {  // a part walks steps [ib, ib + nit) of the sequence's, from s0a
        const int ib = pid * nit / parts;
        nit = (pid + 1) * nit / parts - ib;
        s0a += ib * HOP32_BQ;
    }
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3, tw = threadIdx.x & 127;

    mbar_setup<17>(bar);
    u64* rel = CUPY_ROPE_TF32_RELEASER ? &bar[12] : nullptr;
    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<40>();
        if (threadIdx.x >> 5 == 8 && nit > 0)
            ws2_produce<D>(tq, tk, tv, tdo, tkt, tqt, tdot, sA, sKt, sS0, sQt, sdOt, bar, h, blk.kb, kv0, s0, s0a,
                           nit, kvi, sem, T, lane);
        else if (hop32_dq_over_q<D>() && threadIdx.x >> 5 == 9 && nit > 0)
            hop32_dq_bulk_warp<D>(tdqt, sS0, sA, &bar[9], &bar[12], &bar[5], &bar[6], sem, h, T, s0, s1, s0a, nit,
                                  kvi, first_stores, lane);
        else if (hop32_dq_bulk<D>() && threadIdx.x >> 5 == 9 && nit > 0)
            hop32_dq_bulk_warp<D>(tdqt, hop32_dq_over_dot<D>() ? sdOt : sQt, hop32_dq_over_dot<D>() ? sdOt : sQt,
                                  &bar[9], &bar[9], hop32_dq_over_dot<D>() ? &bar[12] : &bar[7],
                                  hop32_dq_over_dot<D>() ? &bar[12] : &bar[7], sem, h, T, s0, s1, s0a, nit, kvi,
                                  first_stores, lane);
        else if (hop32_dq_over_q<D>() && threadIdx.x >> 5 == 10 && nit > 0)
            ws2_produce_qdo<D>(tq, tdo, sA, sS0, bar, h, s0a, nit, lane);
        else if (hop32_dq_over_dot<D>() && threadIdx.x >> 5 == 10 && nit > 0)
            ws2_produce_dot<D>(tdot, sdOt, bar, h, s0a, nit, lane);
        else if (CUPY_ROPE_TF32_RELEASER && threadIdx.x >> 5 == 9 && nit > 0)
            hop32_releaser(rel, sem, h, T, s0, s0a, nit, kvi, lane);
#pragma unroll 1
        for (int i = 0; i < HOP32_EPI_SYNCS; ++i) block_sync<true>();  // the consumers' epilogue barriers
        return;
    }
    setmaxnreg_inc<232>();
    float acc[D / 2];  // WG0: dV, WG1: dK
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    const bool kvalid0 = wq * 16 + g < nkv, kvalid1 = wq * 16 + g + 8 < nkv;
    u32 kv[D / 8][4];  // WG0: K, WG1: V, as A fragments
    if (nit > 0) {
        mbar_wait(&bar[0], 0);
        hop32_rows_to_a<D, HOP32_BK>(kv, sA + wg * SM::KT, wq * 16, g, t);
        named_barrier(4, 256);  // both warpgroups have read their tile: the region is Q/dO stage 1
        if (threadIdx.x == 0) mbar_arrive(&bar[6]);
        if (hop32_do_apart<D>() && threadIdx.x == 0) mbar_arrive(&bar[16]);
    }
    for (int it = 0; it < nit; ++it) {
        const int q0 = s0a + it * HOP32_BQ, ph = it & 1, st = it & 1, sph = (it >> 1) & 1;
        float* sQ = st ? sA : sS0;
        float* sdO = sQ + SM::QT;
        float* sP = sQ;
        float lq[HOP32_BQ / 4];  // lse2 (WG0) or delta (WG1) of this lane's query columns q0 + 8j + 2t + e
#pragma unroll
        for (int j = 0; j < HOP32_BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = q0 + 8 * j + 2 * t + e;
                const bool ok = c >= s0 && c < s1;
                lq[2 * j + e] = wg == 0 ? (ok ? lse[(i64)h * T + c] : __int_as_float(0x7f800000))
                                        : (ok ? delta[(i64)h * T + c] : 0.f);
            }
        mbar_wait(hop32_do_apart<D>() && wg == 1 ? &bar[13 + st] : &bar[1 + st], sph);  // WG1: dO
        float s[HOP32_BQ / 2];  // WG0: S^T then P^T; WG1: dP^T then dS^T
        {
            const u64 dB = smem_desc(wg == 0 ? sQ : sdO, 0);
            __syncwarp();
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 8; ++ks) {
                const int b = ks >> 2, off = (ks & 3) * 8;
                wgmma_rs_tf32<HOP32_BQ>(s, kv[ks], dB, ks > 0, u16b(b * HOP32_BQ * 32 + off));
            }
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(s);
        }
        if (wg == 0) {  // ------------------------------------------------------------ P^T, dV
            hop32_ws_p(s, lq, kvalid0, kvalid1, scale_log2);
            named_barrier(3, 128);  // every S^T product of WG0 has read Q: P^T may overwrite it
#pragma unroll
            for (int i = 0; i < HOP32_BQ / 2; ++i) sP[i * 128 + tw] = s[i];  // unrounded, as dS takes it
            named_barrier(3, 128);
            if (tw == 0) mbar_arrive(&bar[10 + st]);  // P^T handed to WG1
            mbar_wait(&bar[4], ph);
            u32 pa[HOP32_BQ / 8][4];
#pragma unroll
            for (int kk = 0; kk < HOP32_BQ / 8; ++kk) acc_to_a_tf32(pa[kk], s, kk);
            const u64 dOt0 = smem_desc(sdOt, 0);
            __syncwarp();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HOP32_BQ / 8; ++kk)
                ws2_rs_acc<D>(acc, pa[kk], dOt0, hop32_token_step<D>(kk));
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(acc);
            reg_fence_u(pa);
            named_barrier(3, 128);
            if (tw == 0) mbar_arrive(&bar[8]);  // dO^T is free
            if constexpr (hop32_dq_split<D>()) {
                named_barrier<true>(5, 256);  // WG1's dS^T of this step is staged
                hop32_dq_block_turn<D>(sKt, sDS, 0, dqacc, ldq, h, q0, scaling, wq, g, t, &bar[9], ph,
                                       hop32_first_store(first_stores, kvi, q0, s0, s1, T));
                named_barrier<true>(6, 256);  // both warpgroups' rows are added
            }
        } else {  // --------------------------------------------------------------- dS^T, dK, dQ
            mbar_wait(&bar[10 + st], sph);  // P^T is in sP
            hop32_ws_ds(s, sP, lq, tw);
            named_barrier(1, 128);  // every lane has read P^T, dP^T has read dO: the stage is free (over Q: for dQ^T)
            if (!hop32_dq_over_q<D>() && tw == 0) mbar_arrive(&bar[5 + st]);
            if (hop32_do_apart<D>() && tw == 0) mbar_arrive(&bar[15 + st]);  // dO's half is free
            mbar_wait(&bar[3], ph);
            u32 sa[HOP32_BQ / 8][4];
            hop32_ws_ds_a(sa, s);
            const u64 dQt0 = smem_desc(sQt, 0);
            __syncwarp();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HOP32_BQ / 8; ++kk)
                ws2_rs_acc<D>(acc, sa[kk], dQt0, hop32_token_step<D>(kk));
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(acc);
            reg_fence_u(sa);
            named_barrier(1, 128);  // Q^T is read: dS goes over it
            hop32_ws_store_ds(sDS, s, wq, g, t);
            fence_async_smem();
            named_barrier(1, 128);
            constexpr bool SPLIT = hop32_dq_split<D>();
            if constexpr (SPLIT) named_arrive<true>(5, 256);  // dS^T staged: WG0 takes the first 64 rows of dQ^T
            // with the split, barrier 6 meets WG0's rows too: the count's release is cumulative over both
            if constexpr (hop32_dq_bulk<D>()) {  // dQ^T staged for warp 9's tensor reductions
                float dq[SM::MB][HOP32_BQ / 2];
#pragma unroll
                for (int mb = 0; mb < SM::MB; ++mb) hop32_dq_issue<D>(dq[mb], sKt, sDS, mb);
                wgmma_wait<0>();
#pragma unroll
                for (int mb = 0; mb < SM::MB; ++mb) reg_fence(dq[mb]);
                named_barrier(1, 128);  // the products have read dS^T: dQ^T goes over the stage's Q, dO^T or Q^T
                if constexpr (hop32_dq_over_dot<D>() || hop32_dq_over_q<D>())
                    if (tw == 0) mbar_arrive(&bar[7]);  // Q^T may be copied again
                if constexpr (hop32_dq_over_dot<D>()) mbar_wait(&bar[8], ph);  // WG0's dV has read dO^T
                float* sT = hop32_dq_over_q<D>() ? sQ : hop32_dq_over_dot<D>() ? sdOt : sQt;
#pragma unroll
                for (int mb = 0; mb < SM::MB; ++mb) hop32_stage_dqt<D>(sT, dq[mb], mb, scaling, wq, g, t);
                fence_async_smem();
                named_barrier(1, 128);
                if (tw == 0) mbar_arrive(hop32_dq_over_q<D>() && st ? &bar[12] : &bar[9]);
            } else {
                hop32_ws_dq_turn<D, SPLIT ? 1 : 0, SPLIT ? 6 : 1, SPLIT ? 256 : 128>(
                    sKt, sDS, dqacc, ldq, h, q0, s0, scaling, wq, g, t, tw, &bar[9], it, sem, T, kvi, &bar[7], rel,
                    hop32_first_store(first_stores, kvi, q0, s0, s1, T));
            }
        }
    }

    // With the producer warpgroup leaving before the epilogue (CUPY_ROPE_TF32_EPI_NAMED), the consumers wait for the
    // engine's read of the last dQ^T tile staged over the stage's Q or over Q^T, which the epilogue's staging tile
    // overlaps (stage 0 and Q^T's first 2 KB; not dO^T).
    if constexpr (hop32_dq_over_q<D>() && HOP32_EPI_BAR != 0) {  // over Q: the last step's stage, released
        const int it = nit - 1;                                      // in order by warp 9
        if (nit > 0) mbar_wait(&bar[5 + (it & 1)], (it & 1) ? ((it >> 1) + 1) & 1 : (it >> 1) & 1);
    } else if constexpr (hop32_dq_bulk<D>() && !hop32_dq_over_dot<D>() && HOP32_EPI_BAR != 0) {
        if (nit > 0) mbar_wait(&bar[7], (nit - 1) & 1);
    }
    int nstore = nkv;  // the rows the epilogue stores (TAIL: none but in a split unit's last part)
    if constexpr (TAIL) {
        const int slot = blockIdx.x + gridDim.x * blockIdx.y;
        if (slot < split_units * split_parts) {  // a split unit's part: its partials, summed by the last part
            float* mine = split_buf + ((i64)slot * 256 + threadIdx.x) * (D / 2);
#pragma unroll
            for (int i = 0; i < D / 2; i += 4)
                *reinterpret_cast<float4*>(mine + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
            __threadfence();
            named_barrier(4, 256);  // every consumer's partial is written
            volatile int* s_last = reinterpret_cast<volatile int*>(bar + 32);  // past the 16 barriers
            if (threadIdx.x == 0) *s_last = atomicAdd(split_count + slot / split_parts, 1) == split_parts - 1;
            named_barrier(4, 256);
            if (*s_last) {
                __threadfence();
                const float* src = split_buf + ((i64)(slot - slot % split_parts) * 256 + threadIdx.x) * (D / 2);
#pragma unroll
                for (int i = 0; i < D / 2; i += 4) {  // part 0, then the others in order
                    const float4 a = ld_cg_v4(src + i);
                    acc[i] = a.x, acc[i + 1] = a.y, acc[i + 2] = a.z, acc[i + 3] = a.w;
                }
#pragma unroll 1
                for (int p = 1; p < split_parts; ++p) {
                    src += 256 * (D / 2);
#pragma unroll
                    for (int i = 0; i < D / 2; i += 4) {
                        const float4 a = ld_cg_v4(src + i);
                        acc[i] += a.x, acc[i + 1] += a.y, acc[i + 2] += a.z, acc[i + 3] += a.w;
                    }
                }
            } else {
                nstore = 0;  // the epilogue's barriers, no stores
            }
        }
    }
    hop32_ws_epilogue<D, OT, ROPE>(sS0, acc, scaling, wg, wq, g, t, half, h, NH, blk.kb, kv0, nstore, dk_out,
                                   dv_out, out_ld, cs, sn, part, outT, ldt, T);
}
