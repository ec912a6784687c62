// sm_90a backward, tf32, warp-specialised: the products of backward_tf32.cuh split over two consumer warpgroups
// and a producer warpgroup, 384 threads.
//
// backward_tf32.cuh runs every product of a step in one warpgroup, so the exponentials, the dS arithmetic and the
// dQ adds of a step sit between its wgmma groups and the tensor cores idle there. Here the two chains of a step
// run side by side:
//   WG0: S^T = K Q^T, P^T (lse2 from its registers), P^T into shared memory over the Q buffer (fragment order:
//        sP[i][128 threads], so WG1's lane reads the values its own fragment needs), dV += P^T dO (dO^T tile);
//   WG1: dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q (Q^T tile), dS staged over Q^T, dQ^T = K^T dS^T
//        added in key-tile order into dqacc^T as backward_tf32.cuh does;
//   WG2: one lane of warp 8 issues the tile copies and spins on the dQ turn, one lane of warp 9 releases each
//        step's dQ count (CUPY_ROPE_TF32_RELEASER); it gives its registers to the consumers (setmaxnreg: 40 for
//        the producer warpgroup, 232 for the consumers).
// Barriers: full [0] K/V/K^T, [1] Q/dO, [2] Q^T, [3] dO^T; empty [4] Q/dO (WG1, once P^T is read and dP^T is
// done), [5] Q^T (WG1, after its dQ adds), [6] dO^T (WG0, after dV); [7] the dQ turn; and the releasing warp's
// two full / empty pairs (CUPY_ROPE_TF32_RELEASER) in the unused lse area. Named barrier 2 (WG0
// arrives, WG1 waits: 256 threads) hands P^T over; 3 (WG0) and 1 (WG1) are each consumer's own.
#pragma once
#include "attention/sm90/backward_tf32.cuh"

// The specialised tf32 backwards' per-value steps. WG0: P^T = exp2(S^T scale - lse2) in place (keys past the
// sequence: 0); lq: lse2 of the lane's query columns 8j + 2t + {0, 1}.
__device__ __forceinline__ void hop32_ws_p(float (&s)[HOP32_BQ / 2], const float (&lq)[HOP32_BQ / 4], bool kvalid0,
                                           bool kvalid1, float scale_log2) {
#pragma unroll
    for (int j = 0; j < HOP32_BQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bool kv_ok = (e >> 1) ? kvalid1 : kvalid0;
            s[4 * j + e] = kv_ok ? exp2_ftz(s[4 * j + e] * scale_log2 - lq[2 * j + (e & 1)]) : 0.f;
        }
}

// WG1: dS^T = P^T (WG0's, in sP by lane tw) * (dP^T - delta), rounded to tf32, in place; lq: delta of the lane's
// query columns.
__device__ __forceinline__ void hop32_ws_ds(float (&s)[HOP32_BQ / 2], const float* sP, const float (&lq)[HOP32_BQ / 4],
                                            int tw) {
#pragma unroll
    for (int j = 0; j < HOP32_BQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = sP[(4 * j + e) * 128 + tw];
            s[4 * j + e] = __uint_as_float(rna_tf32(p * (s[4 * j + e] - lq[2 * j + (e & 1)])));
        }
}

// dS^T (rounded) as the A fragments of the dK product (the k8 steps' token order of tf32.cuh).
__device__ __forceinline__ void hop32_ws_ds_a(u32 (&sa)[HOP32_BQ / 8][4], const float (&s)[HOP32_BQ / 2]) {
#pragma unroll
    for (int kk = 0; kk < HOP32_BQ / 8; ++kk) {
        sa[kk][0] = __float_as_uint(s[4 * kk]);
        sa[kk][1] = __float_as_uint(s[4 * kk + 2]);
        sa[kk][2] = __float_as_uint(s[4 * kk + 1]);
        sa[kk][3] = __float_as_uint(s[4 * kk + 3]);
    }
}

// dS^T (rounded) into the staged [query][key] tile sDS (128-byte swizzled rows of 32 keys), for the dQ^T product.
__device__ __forceinline__ void hop32_ws_store_ds(float* sDS, const float (&s)[HOP32_BQ / 2], int wq, int g, int t) {
    unsigned char* ds = reinterpret_cast<unsigned char*>(sDS);
    const int r = wq * 16 + g;
    const u32 kb = (r >> 5) * HOP32_BQ * 128;
#pragma unroll
    for (int kk = 0; kk < HOP32_BQ / 8; ++kk) {
        const int c = 8 * kk + 2 * t;
        *reinterpret_cast<float*>(ds + kb + swz128w(c, r & 31)) = s[4 * kk];
        *reinterpret_cast<float*>(ds + kb + swz128w(c + 1, r & 31)) = s[4 * kk + 1];
        *reinterpret_cast<float*>(ds + kb + swz128w(c, (r & 31) + 8)) = s[4 * kk + 2];
        *reinterpret_cast<float*>(ds + kb + swz128w(c + 1, (r & 31) + 8)) = s[4 * kk + 3];
    }
}

// CUPY_ROPE_TF32_RELEASER (a build switch; unset: 1): the specialised tf32 backwards release each step's dQ count
// from warp 9 (idle otherwise: the producer warpgroup's second warp) instead of from WG1 (hop32_ws_dq_turn).
#ifndef CUPY_ROPE_TF32_RELEASER
#define CUPY_ROPE_TF32_RELEASER 1
#endif
// CUPY_ROPE_TF32_DQ_PAIR (a build switch; unset: 1): where WG1 adds both 64-row blocks of a step's dQ^T (MB = 2,
// unsplit), both products are issued before the first block's reductions, into two accumulator sets (the step's
// dS^T and its A fragments are dead by then), so that the second product runs while the first block's
// reductions leave; one set in a loop (0), the second product waited for until the reductions had read their
// registers.
#ifndef CUPY_ROPE_TF32_DQ_PAIR
#define CUPY_ROPE_TF32_DQ_PAIR 1
#endif
// CUPY_ROPE_TF32_DQ_EARLY (a build switch; unset: 1): where a warpgroup's turn adds one 64-row block, its dQ^T
// product is issued before the wait for the turn (the previous key tile's share of the step), which only the
// reductions need; 2: the pair above too; 0: every product after the wait.
#ifndef CUPY_ROPE_TF32_DQ_EARLY
#define CUPY_ROPE_TF32_DQ_EARLY 1
#endif

// One 64-row block of a step's dQ^T (mb) added in the turn (turn, phase ph): the product issued before the
// turn's wait, which only the adds need (CUPY_ROPE_TF32_DQ_EARLY; 0: after it).
template <int D>
__device__ __forceinline__ void hop32_dq_block_turn(const float* sKt, const float* sDS, int mb,
                                                    float* __restrict__ dqacc, int ldq, int h, int q0, float scaling,
                                                    int wq, int g, int t, u64* turn, int ph,
                                                    bool store = false) {
    float dq[HOP32_BQ / 2];
    if (!CUPY_ROPE_TF32_DQ_EARLY) mbar_wait(turn, ph);
    hop32_dq_issue<D>(dq, sKt, sDS, mb);
    if (CUPY_ROPE_TF32_DQ_EARLY) mbar_wait(turn, ph);  // the key tile before has added its share
    wgmma_wait<0>();
    reg_fence(dq);
    hop32_dq_add<D>(dq, mb, dqacc, ldq, h, q0, scaling, wq, g, t, store);
}

// WG1's dQ turn of step it (turn, phase it & 1: the previous key tile's share is in): dQ^T rows added into dqacc (its
// 64-row blocks from MB0), named barrier BAR of NBAR threads, the turn handed back (done: the dS^T buffer is
// read), then the key tile's count of the step released (sem, kvi + 1: a release by one thread is cumulative over
// the reductions the barrier ordered before it, so no thread fences: 4% faster). With MB0 = 1 WG0 adds the first
// block and meets the barrier (backward_tf32_ws2.cuh, CUPY_ROPE_TF32_DQ_SPLIT).
// With rel (not null: step it's full / empty pair rel[it & 1], rel[2 + (it & 1)]), the release is a releasing
// warp's (hop32_releaser): the release's fence waits for the step's reductions to reach L2, and WG1, whose next
// products need all four of its warps, no longer waits with it.
template <int D, int MB0 = 0, int BAR = 1, int NBAR = 128>
__device__ __forceinline__ void hop32_ws_dq_turn(const float* sKt, const float* sDS, float* __restrict__ dqacc,
                                                 int ldq, int h, int q0, int s0, float scaling, int wq, int g, int t,
                                                 int tw, u64* turn, int it, int* __restrict__ sem, int T, int kvi,
                                                 u64* done, u64* rel = nullptr, bool store = false) {
    constexpr int MB = Hop32Bwd<D>::MB;
    if constexpr (CUPY_ROPE_TF32_DQ_PAIR && MB0 == 0 && MB == 2) {
        float dq0[HOP32_BQ / 2], dq1[HOP32_BQ / 2];
        if (CUPY_ROPE_TF32_DQ_EARLY < 2) mbar_wait(turn, it & 1);
        hop32_dq_issue<D>(dq0, sKt, sDS, 0);
        hop32_dq_issue<D>(dq1, sKt, sDS, 1);
        if (CUPY_ROPE_TF32_DQ_EARLY >= 2) mbar_wait(turn, it & 1);
        wgmma_wait<1>();
        reg_fence(dq0);
        hop32_dq_add<D>(dq0, 0, dqacc, ldq, h, q0, scaling, wq, g, t, store);
        wgmma_wait<0>();
        reg_fence(dq1);
        hop32_dq_add<D>(dq1, 1, dqacc, ldq, h, q0, scaling, wq, g, t, store);
    } else if constexpr (CUPY_ROPE_TF32_DQ_EARLY && MB - MB0 == 1) {
        hop32_dq_block_turn<D>(sKt, sDS, MB0, dqacc, ldq, h, q0, scaling, wq, g, t, turn, it & 1, store);
    } else {
        mbar_wait(turn, it & 1);
#pragma unroll 1
        for (int mb = MB0; mb < MB; ++mb)
            hop32_dq_rows<D>(sKt, sDS, mb, dqacc, ldq, h, q0, scaling, wq, g, t, store);
    }
    named_barrier<(NBAR > 128)>(BAR, NBAR);  // met by WG0 too (MB0 = 1) from its own instruction: unaligned
    if (tw == 0) {
        mbar_arrive(done);
        if (rel == nullptr) {
            st_release(sem + (i64)h * T + max(q0, s0), kvi + 1);
        } else {
            if (it >= 2) mbar_wait(&rel[2 + (it & 1)], ((it >> 1) - 1) & 1);  // step it - 2 is released
            mbar_arrive(&rel[it & 1]);  // mbarrier arrive: a release (CTA scope) the releasing warp acquires
        }
    }
}

// The releasing warp (rel as above): each step's count released once WG1 has handed the step over.
__device__ __forceinline__ void hop32_releaser(u64* rel, int* __restrict__ sem, int h, int T, int s0, int s0a,
                                               int nit, int kvi, int lane) {
#pragma unroll 1
    for (int it = 0; it < nit; ++it) {
        mbar_wait(&rel[it & 1], (it >> 1) & 1);
        if (lane == 0) {
            st_release(sem + (i64)h * T + max(s0a + it * HOP32_BQ, s0), kvi + 1);
            mbar_arrive(&rel[2 + (it & 1)]);
        }
        __syncwarp();
    }
}

// CUPY_ROPE_TF32_EPI_NAMED=1 (a build switch, off by default): the epilogue's barriers are named barrier
// HOP32_EPI_BAR of the 256 consumer threads, and the producer warpgroup leaves at once instead of meeting them.
#ifndef CUPY_ROPE_TF32_EPI_NAMED
#define CUPY_ROPE_TF32_EPI_NAMED 0
#endif
#define HOP32_EPI_BAR (CUPY_ROPE_TF32_EPI_NAMED ? 8 : 0)
// How many block-wide barriers the producer warpgroup meets for the consumers' epilogue: one before the passes,
// then per pass write_grad_tile's two and one more.
#define HOP32_EPI_SYNCS (HOP32_EPI_BAR ? 0 : 7)

// Lab probe (wrong results, timing only): CUPY_ROPE_PROBE_TF32_EPI, a bit mask of what the block's epilogue leaves
// out: 1 the transposed copy (outT), 2 the RoPE backward of dK, 4 the column sums and the transposed copy (the
// plain outputs' epilogue, rows stored as the block's). Unset: 0.
#ifndef CUPY_ROPE_PROBE_TF32_EPI
#define CUPY_ROPE_PROBE_TF32_EPI 0
#endif

// CUPY_ROPE_TF32_EPI_ROWS (a build switch; unset: 64): the rows of the staging tile the epilogue reads, stores and
// sums: a key block's 64 (HOP32_BK), or 128 (BM: the mma.sync kernels' tile, rows 64-127 zeroed, then summed and
// skipped by the transposed copy). The same bits (the sign of an all-zero column's sum aside). Measured (kernel
// timelines, one H100, 128 / 64 rows; bench/lab/tf32_epi_rows.txt): the block's backward at 8192 x 32 959 / 810
// µs, at 8 x 1024 2216 / 2058; the varlen API's at 32 x 256 644 / 628.
#ifndef CUPY_ROPE_TF32_EPI_ROWS
#define CUPY_ROPE_TF32_EPI_ROWS 64
#endif

// The specialised tf32 backwards' epilogue (WG0 and WG1; WG2 matches the barriers): dK (WG1, scaled) then dV
// (WG0) through the staging tile stg (over the step buffers), each through the block epilogue; unaligned barriers
// (block_sync), as the producer warpgroup meets them in a loop of its own (or named ones without it, above).
template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop32_ws_epilogue(float* stg, const float* acc, float scaling, int wg, int wq, int g,
                                                  int t, int half, int h, int NH, int kb, int kv0, int nkv,
                                                  typename OT::T* __restrict__ dk_out,
                                                  typename OT::T* __restrict__ dv_out, i64 out_ld,
                                                  const float* __restrict__ cs, const float* __restrict__ sn,
                                                  float* __restrict__ part, float* __restrict__ outT, int ldt,
                                                  int T) {
    const i64 col = (i64)h * D, H = (i64)NH * D;
    float* prow = part + (i64)kb * 3 * H;
    if (half == 1)
        for (int c = threadIdx.x; c < D; c += 256) prow[col + c] = 0.f;
    epi_sync<true, HOP32_EPI_BAR>();  // every consumer is out of the loop (stg overlaps the step buffers)
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        if (wg == 1 - pass)  // pass 0: dK from WG1, pass 1: dV from WG0
            hop32_stage_rows<D>(stg, acc, pass == 0 ? scaling : 1.f, wq, g, t);
        float* pt = prow + (pass + 1) * H + col;
        float* ot = outT && !(CUPY_ROPE_PROBE_TF32_EPI & 1) ? outT + ((pass + 1) * H + col) * ldt : nullptr;
        constexpr bool RB = ROPE && !(CUPY_ROPE_PROBE_TF32_EPI & 2), BL = ROPE && !(CUPY_ROPE_PROBE_TF32_EPI & 4);
        constexpr int U = ATTN_EPI_UNROLL, R = CUPY_ROPE_TF32_EPI_ROWS;
        if (pass == 0)
            write_grad_tile<OT, D, RB, BL, true, HOP32_EPI_BAR, U, R>(stg, dk_out + col, out_ld, cs, sn, kv0, nkv, pt,
                                                                      ot, T, ldt);
        else write_grad_tile<OT, D, false, BL, true, HOP32_EPI_BAR, U, R>(stg, dv_out + col, out_ld, cs, sn, kv0, nkv,
                                                                          pt, ot, T, ldt);
        epi_sync<true, HOP32_EPI_BAR>();
    }
}

template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop_bwd_tf32_ws(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                                const TmaDesc* tdo, const TmaDesc* tkt, const TmaDesc* tqt,
                                                const TmaDesc* tdot, const TmaDesc* /*tdqt*/,
                                                const int* __restrict__ tiles,
                                                const float* __restrict__ lse, const float* __restrict__ delta,
                                                float* __restrict__ dqacc, int ldq, int* __restrict__ sem,
                                                typename OT::T* __restrict__ dk_out,
                                                typename OT::T* __restrict__ dv_out,
                                                i64 out_ld, const float* __restrict__ cs, const float* __restrict__ sn,
                                                float* __restrict__ part, float* __restrict__ outT, int ldt, int T,
                                                float scale_log2, float scaling, int order,
                                                int /*first_stores*/) {
    typedef Hop32Bwd<D> SM;
    static_assert(SM::QT >= 32 * 128, "P^T (64 x 64 fp32) is handed over in the Q buffer");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* sK = reinterpret_cast<float*>(smem_raw);
    float* sV = sK + SM::KT;
    float* sKt = sV + SM::KT;
    float* sQ = sKt + SM::KTT;
    float* sdO = sQ + SM::QT;
    float* sQt = sdO + SM::QT;
    float* sdOt = sQt + SM::QTT;
    float* sDS = sQt;
    float* sP = sQ;
    u64* bar = reinterpret_cast<u64*>(smem_raw + SM::BYTES - 64);
    // the releasing warp's pairs (hop32_ws_dq_turn) in the unused lse area
    u64* rel = CUPY_ROPE_TF32_RELEASER ? reinterpret_cast<u64*>(smem_raw + SM::BYTES - 64 - 512) : nullptr;

    const HopBlock blk = hop_bwd_block(order);
    const int h = blk.h, NH = gridDim.x, tile = blk.kb >> 1, half = blk.kb & 1;
    const int s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int kv0 = tiles[3 * tile] + HOP32_BK * half, nkv = max(0, min(HOP32_BK, s1 - kv0));
    const int kvi = (kv0 - s0) / HOP32_BK;
    const int s0a = s0 & ~7, nit = nkv > 0 ? (s1 - s0a + HOP32_BQ - 1) / HOP32_BQ : 0;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3, tw = threadIdx.x & 127;

    if (CUPY_ROPE_TF32_RELEASER && threadIdx.x == 0)
        for (int i = 0; i < 4; ++i) mbar_init(&rel[i], 1);
    mbar_setup<8>(bar);  // its fence (the same thread) and its one aligned barrier cover the inits above
    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<40>();
        if (threadIdx.x >> 5 == 8 && nit > 0)
            hop32_produce<D>(tq, tk, tv, tdo, tkt, tqt, tdot, sK, sV, sKt, sQ, sdO, sQt, sdOt, bar, h, blk.kb, kv0,
                             s0, s0a, nit, kvi, sem, T, lane);
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
    if (nit > 0) mbar_wait(&bar[0], 0);
    for (int it = 0; it < nit; ++it) {
        const int q0 = s0a + it * HOP32_BQ, ph = it & 1;
        // lse2 (WG0) or delta (WG1) of this lane's query columns q0 + 8j + 2t + e
        float lq[HOP32_BQ / 4];
#pragma unroll
        for (int j = 0; j < HOP32_BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = q0 + 8 * j + 2 * t + e;
                const bool ok = c >= s0 && c < s1;
                lq[2 * j + e] = wg == 0 ? (ok ? lse[(i64)h * T + c] : __int_as_float(0x7f800000))
                                        : (ok ? delta[(i64)h * T + c] : 0.f);
            }
        mbar_wait(&bar[1], ph);
        float s[HOP32_BQ / 2];  // WG0: S^T then P^T; WG1: dP^T then dS^T
        {
            const u64 dA = smem_desc(wg == 0 ? sK : sV, 0), dB = smem_desc(wg == 0 ? sQ : sdO, 0);
            __syncwarp();
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 8; ++ks) {
                const int b = ks >> 2, off = (ks & 3) * 8;
                const u32 oa = u16b(b * HOP32_BK * 32 + off), ob = u16b(b * HOP32_BQ * 32 + off);
                wgmma_ss_tf32<HOP32_BQ>(s, dA, dB, ks > 0, oa, ob);
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
            named_arrive(2, 256);  // P^T handed to WG1
            mbar_wait(&bar[3], ph);
            u32 pa[HOP32_BQ / 8][4];
#pragma unroll
            for (int kk = 0; kk < HOP32_BQ / 8; ++kk) acc_to_a_tf32(pa[kk], s, kk);
            const u64 dOt0 = smem_desc(sdOt, 0);
            __syncwarp();
            wgmma_fence();
            hop32_rs_tokens<D>(acc, pa, dOt0);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(acc);
            reg_fence_u(pa);
            named_barrier(3, 128);
            if (tw == 0) mbar_arrive(&bar[6]);  // dO^T is free
        } else {  // --------------------------------------------------------------- dS^T, dK, dQ
            named_barrier(2, 256);  // P^T is in sP
            hop32_ws_ds(s, sP, lq, tw);
            named_barrier(1, 128);  // every lane has read P^T and dP^T's dO reads are done: Q/dO are free
            if (tw == 0) mbar_arrive(&bar[4]);
            mbar_wait(&bar[2], ph);
            u32 sa[HOP32_BQ / 8][4];
            hop32_ws_ds_a(sa, s);
            const u64 dQt0 = smem_desc(sQt, 0);
            __syncwarp();
            wgmma_fence();
            hop32_rs_tokens<D>(acc, sa, dQt0);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(acc);
            reg_fence_u(sa);
            named_barrier(1, 128);  // Q^T is read: dS goes over it
            hop32_ws_store_ds(sDS, s, wq, g, t);
            fence_async_smem();
            named_barrier(1, 128);
            hop32_ws_dq_turn<D>(sKt, sDS, dqacc, ldq, h, q0, s0, scaling, wq, g, t, tw, &bar[7], it, sem, T, kvi,
                                &bar[5], rel);
        }
    }

    hop32_ws_epilogue<D, OT, ROPE>(sQ, acc, scaling, wg, wq, g, t, half, h, NH, blk.kb, kv0, nkv, dk_out, dv_out,
                                   out_ld, cs, sn, part, outT, ldt, T);
}
