// sm_90a backward, tf32: key/value-stationary like backward.cuh, with fp32 tiles and the tf32 wgmma.
//
// tf32 operands are K-major only, so every product whose reduction is over tokens reads a transposed copy: Q^T and
// dO^T (permuted, tf32.cuh) for dK and dV, K^T (laid out by tile, tf32.cuh) for dQ. Those copies double the shared memory of a step, so a
// block owns 64 keys (K, V, K^T: 96 KB at D = 128) and walks 64-query steps with one buffer of each streamed tile
// (Q, dO, Q^T, dO^T: 128 KB). Each buffer is refilled as soon as its last product of the step has completed, so
// its copy runs beside the rest of the step: Q and dO after S^T and dP^T, dO^T after dV, Q^T after dQ (dS is
// staged in the Q^T buffer once dK has read it). Warpgroup 0 computes and releases each buffer on an "empty"
// barrier; the first warp of warpgroup 1 (the producer) waits on those and issues the copies; both warpgroups
// write the epilogue.
// Per step (64 keys x 64 queries; query steps start at the sequence start rounded down to 8, as the permuted
// copies are aligned; queries outside the sequence are masked):
//   S^T = K Q^T, dP^T = V dO^T       wgmma m64n64k8 from shared memory
//   P^T, dS^T as in backward.cuh
//   dK += dS^T Q, dV += P^T dO       wgmma m64nDk8, A = dS^T / P^T from registers, B = Q^T / dO^T tiles
//   dQ^T = K^T dS^T                  wgmma m64n64k8 per 64 rows of D, B = dS staged [query][key]
// dQ is added into dqacc^T [NH][D][ldq] (zeroed first) in key-tile order (backward.cuh), counted per step at its
// first query; hop_dq_finish_t writes it out.
// The grid is (NH, 2 x tiles): block y covers keys [tile start + 64 (y % 2), + 64) of 128-key tile y / 2; its
// bias partial sums go to row y of part [2 x tiles][3H] (the second half of a tile also zeroes its q columns).
#pragma once
#include "attention/sm90/backward.cuh"
#include "attention/sm90/tf32.cuh"

#define HOP32_BK 64  // keys per block
#define HOP32_BQ 64  // queries per step

template <int D> struct Hop32Bwd {
    static constexpr int NB = (D + 31) / 32;
    static constexpr int MB = (D + 63) / 64;          // 64-row blocks of D (dQ^T products)
    static constexpr int KT = HOP32_BK * 32 * NB;     // floats of K or V [64][D]
    static constexpr int KTT = 2 * (64 * MB) * 32;     // of K^T [2][64 MB rows][32 keys]
    static constexpr int QT = HOP32_BQ * 32 * NB;     // of Q or dO [64][D]
    static constexpr int QTT = 2 * D * 32;             // of Q^T or dO^T [2][D][32 queries]
    static constexpr int DS = 2 * HOP32_BQ * 32;       // dS [2][64 queries][32 keys], staged in the Q^T buffer
    static constexpr int MAIN = (2 * KT + KTT + 2 * QT + 2 * QTT) * 4;
    static constexpr int STAGE = HOP_BM * (D + 4) * 4;  // the epilogue's [128][D + 4] tile, over Q onwards
    // + lse2 and delta of the step's queries [2][64], + the barriers
    static constexpr int BYTES = (MAIN > (2 * KT + KTT) * 4 + STAGE ? MAIN : (2 * KT + KTT) * 4 + STAGE) + 512 + 64;
    static_assert(DS <= QTT, "dS is staged in the Q^T buffer");
};

// The producers' per-step tail, shared by the tf32 backwards: the step's dO^T (once dot_free of the previous
// step has completed; arrival on dot_full) and Q^T (qt_free, qt_full) copies, then, once the previous key tile's
// share of the step is in dqacc (its count, sem), the consumers' dQ turn (turn). The whole warp spins, so that it
// stays converged for the arrive.
// PART, bits: 1 the dO^T copy, 2 the Q^T copy, 4 the turn (backward_tf32_ws2.cuh, with the dQ^T tiles through
// the copy engine, waits for the count in warp 9 and issues the dO^T copies from warp 10).
template <int D, bool ONCE = false, int PART = 7>  // ONCE: CUPY_ROPE_PROBE_TF32_NO_STREAM (backward_tf32_ws2.cuh)
__device__ __forceinline__ void hop32_produce_transposed(const TmaDesc* tqt, const TmaDesc* tdot, float* sQt,
                                                         float* sdOt, u64* dot_free, u64* dot_full, u64* qt_free,
                                                         u64* qt_full, u64* turn, int it, int ph, int h, int q0,
                                                         int s0, int kvi, const int* __restrict__ sem, int T,
                                                         bool leader) {
    constexpr u32 QTT_BYTES = Hop32Bwd<D>::QTT * 4;
    if constexpr ((PART & 1) != 0) {
        if (it > 0) mbar_wait(dot_free, ph);
        if (leader) {
            mbar_expect_tx(dot_full, ONCE && it > 0 ? 0 : QTT_BYTES);
            if (!ONCE || it == 0) tma_cols32<2, D>(sdOt, tdot, dot_full, h, q0);
        }
    }
    if constexpr ((PART & 2) != 0) {
        if (it > 0) mbar_wait(qt_free, ph);
        if (leader) {
            mbar_expect_tx(qt_full, ONCE && it > 0 ? 0 : QTT_BYTES);
            if (!ONCE || it == 0) tma_cols32<2, D>(sQt, tqt, qt_full, h, q0);
        }
    }
    if constexpr ((PART & 4) != 0) {
        const int* sp = sem + (i64)h * T + max(q0, s0);
        while (ld_acquire(sp) < kvi) {
        }
        __syncwarp();
        if (leader) mbar_arrive(turn);
        __syncwarp();
    }
}

// The producer: lane 0 of one warp issues every copy of a block, each once its buffer is free (the consumers
// arrive on the "empty" barriers [4] Q/dO, [5] Q^T, [6] dO^T), and before each step waits for the previous key
// tile's dQ count of it, then signals the consumers' dQ turn on [7]. The whole warp spins, so that it stays
// converged for the arrive.
template <int D>
__device__ __forceinline__ void hop32_produce(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                              const TmaDesc* tdo, const TmaDesc* tkt, const TmaDesc* tqt,
                                              const TmaDesc* tdot, float* sK, float* sV, float* sKt, float* sQ,
                                              float* sdO, float* sQt, float* sdOt, u64* bar, int h, int kb, int kv0,
                                              int s0, int s0a, int nit, int kvi, const int* __restrict__ sem, int T,
                                              int lane) {
    typedef Hop32Bwd<D> SM;
    constexpr int NB = SM::NB, MB = SM::MB;
    constexpr u32 Q_BYTES = SM::QT * 4;
    const bool leader = lane == 0;
    if (leader) {
        mbar_expect_tx(&bar[0], (2 * SM::KT + 2 * D * 32) * 4);
        tma_rows32<NB, HOP32_BK>(sK, tk, &bar[0], h, kv0);
        tma_rows32<NB, HOP32_BK>(sV, tv, &bar[0], h, kv0);
        tma_cols32<2, 64 * MB>(sKt, tkt, &bar[0], h, kb * HOP32_BK);  // K^T is laid out by tile
    }
    for (int it = 0; it < nit; ++it) {
        const int q0 = s0a + it * HOP32_BQ, ph = (it - 1) & 1;
        if (it > 0) mbar_wait(&bar[4], ph);
        if (leader) {
            mbar_expect_tx(&bar[1], 2 * Q_BYTES);
            tma_rows32<NB, HOP32_BQ>(sQ, tq, &bar[1], h, q0);
            tma_rows32<NB, HOP32_BQ>(sdO, tdo, &bar[1], h, q0);
        }
        hop32_produce_transposed<D>(tqt, tdot, sQt, sdOt, &bar[6], &bar[3], &bar[5], &bar[2], &bar[7], it, ph, h,
                                    q0, s0, kvi, sem, T, leader);
    }
}

// dQ^T rows [64 mb, 64 mb + 64) of a step = K^T dS^T (wgmma m64n64k8, B = dS staged [query][key]), added into
// dqacc^T [NH][D][ldq] four queries at a time: lane (g, t) holds d = 64 mb + 16 wq + g (+8), query q0 + 8j + 2t
// (+1); lanes t and t ^ 1 swap halves so that the even one holds d = .. + g and the odd one d = .. + g + 8,
// queries q0 + 8j + 4 (t / 2) + 0..3 (16-byte aligned: q0 is a multiple of 8). Queries outside the sequence add
// exact zeros (their P and dS are 0), so no mask is needed; dqacc^T starts at zero and every share is an add.
// The product alone: dq = dQ^T rows [64 mb, 64 mb + 64) issued as one committed wgmma group (hop32_dq_add adds
// them once waited for).
template <int D>
__device__ __forceinline__ void hop32_dq_issue(float (&dq)[HOP32_BQ / 2], const float* sKt, const float* sDS, int mb) {
    constexpr int MB = Hop32Bwd<D>::MB;
    const u64 dKt0 = smem_desc(sKt + mb * 64 * 32, 0), dS0 = smem_desc(sDS, 0);
    __syncwarp();  // wgmma is .aligned: reconverge after the per-lane writes before it
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < HOP32_BK / 8; ++ks) {  // k8 steps over the keys
        const int b = ks >> 2, off = (ks & 3) * 8;
        const u32 oa = u16b(b * 64 * MB * 32 + off), ob = u16b(b * HOP32_BQ * 32 + off);
        wgmma_ss_tf32<HOP32_BQ>(dq, dKt0, dS0, ks > 0, oa, ob);
    }
    wgmma_commit();
}

// The adds alone: a waited-for product's values of the lane, scaled, into dqacc^T as above.
template <int D>
__device__ __forceinline__ void hop32_dq_add(const float (&dq)[HOP32_BQ / 2], int mb, float* __restrict__ dqacc,
                                             int ldq, int h, int q0, float scaling, int wq, int g, int t,
                                             bool store = false) {
    const bool odd = t & 1;
    const int d = 64 * mb + wq * 16 + g + (odd ? 8 : 0);
    float* row = dqacc + ((i64)h * D + d) * ldq + q0 + 4 * (t >> 1);
#pragma unroll
    for (int j = 0; j < HOP32_BQ / 8; ++j) {
        const float* e = dq + 4 * j;
        const float r0 = __shfl_xor_sync(0xffffffffu, odd ? e[0] : e[2], 1);
        const float r1 = __shfl_xor_sync(0xffffffffu, odd ? e[1] : e[3], 1);
        const float4 v = odd ? make_float4(r0, r1, e[2], e[3]) : make_float4(e[0], e[1], r0, r1);
        if (D % 64 != 0 && d >= D) continue;
        if (store)  // the sequence's first key tile, over columns of its own (backward_tf32_ws2.cuh)
            *reinterpret_cast<float4*>(row + 8 * j) = make_float4(v.x * scaling, v.y * scaling, v.z * scaling,
                                                                  v.w * scaling);
        else
            red_add_v4(row + 8 * j, v.x * scaling, v.y * scaling, v.z * scaling, v.w * scaling);
    }
}

// Both, one block at a time.
template <int D>
__device__ __forceinline__ void hop32_dq_rows(const float* sKt, const float* sDS, int mb, float* __restrict__ dqacc,
                                              int ldq, int h, int q0, float scaling, int wq, int g, int t,
                                              bool store = false) {
    float dq[HOP32_BQ / 2];
    hop32_dq_issue<D>(dq, sKt, sDS, mb);
    wgmma_wait<0>();
    reg_fence(dq);
    hop32_dq_add<D>(dq, mb, dqacc, ldq, h, q0, scaling, wq, g, t, store);
}

// Rows 0..63 of the epilogue's [128][D + 4] staging tile from a warpgroup's m64nD accumulator, times sc.
template <int D>
__device__ __forceinline__ void hop32_stage_rows(float* stg, const float* acc, float sc, int wq, int g, int t) {
    constexpr int LDST = D + 4;
    const int r0 = wq * 16 + g;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<float2*>(stg + r0 * LDST + 8 * j + 2 * t) = make_float2(acc[4 * j] * sc, acc[4 * j + 1] * sc);
        *reinterpret_cast<float2*>(stg + (r0 + 8) * LDST + 8 * j + 2 * t) =
            make_float2(acc[4 * j + 2] * sc, acc[4 * j + 3] * sc);
    }
}

template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop_bwd_tf32(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                             const TmaDesc* tdo, const TmaDesc* tkt, const TmaDesc* tqt,
                                             const TmaDesc* tdot, const TmaDesc* /*tdqt*/,
                                             const int* __restrict__ tiles,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             float* __restrict__ dqacc, int ldq, int* __restrict__ sem,
                                             typename OT::T* __restrict__ dk_out, typename OT::T* __restrict__ dv_out,
                                             i64 out_ld, const float* __restrict__ cs, const float* __restrict__ sn,
                                             float* __restrict__ part, float* __restrict__ outT, int ldt, int T,
                                             float scale_log2, float scaling, int order, int /*first_stores*/) {
    typedef Hop32Bwd<D> SM;
    constexpr int MB = SM::MB;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* sK = reinterpret_cast<float*>(smem_raw);
    float* sV = sK + SM::KT;
    float* sKt = sV + SM::KT;
    float* sQ = sKt + SM::KTT;
    float* sdO = sQ + SM::QT;
    float* sQt = sdO + SM::QT;
    float* sdOt = sQt + SM::QTT;
    float* sDS = sQt;
    // full: [0] K/V/K^T, [1] Q/dO, [2] Q^T, [3] dO^T; empty (released by the consumers): [4] Q/dO, [5] Q^T, [6] dO^T;
    // [7] the dQ turn of the step (the producer waits for the previous key tile's count)
    u64* bar = reinterpret_cast<u64*>(smem_raw + SM::BYTES - 64);
    float* sL = reinterpret_cast<float*>(smem_raw + SM::BYTES - 64 - 512);  // lse2 [64], then delta [64]

    const HopBlock blk = hop_bwd_block(order);
    const int h = blk.h, NH = gridDim.x, tile = blk.kb >> 1, half = blk.kb & 1;
    const int s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int kv0 = tiles[3 * tile] + HOP32_BK * half, nkv = max(0, min(HOP32_BK, s1 - kv0));
    const int kvi = (kv0 - s0) / HOP32_BK;  // this key tile's index in its sequence
    const int s0a = s0 & ~7, nit = nkv > 0 ? (s1 - s0a + HOP32_BQ - 1) / HOP32_BQ : 0;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3, tid = threadIdx.x;

    mbar_setup<8>(bar);
    if (tid >> 5 == 4 && nit > 0)  // the producer warp
        hop32_produce<D>(tq, tk, tv, tdo, tkt, tqt, tdot, sK, sV, sKt, sQ, sdO, sQt, sdOt, bar, h, blk.kb, kv0, s0,
                         s0a, nit, kvi, sem, T, lane);
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

    if (wg == 0 && nit > 0) {
        const bool kvalid0 = wq * 16 + g < nkv, kvalid1 = wq * 16 + g + 8 < nkv;
        mbar_wait(&bar[0], 0);
        for (int it = 0; it < nit; ++it) {
            const int q0 = s0a + it * HOP32_BQ, ph = it & 1;
            const int qs = max(q0, s0);  // the step's first query: its counter in sem
            {  // lse2 and delta of the step's queries (+inf / 0 outside the sequence: P = 0 there)
                const int c = q0 + (tid & 63);
                const bool ok = c >= s0 && c < s1;
                sL[tid] = tid < 64 ? (ok ? lse[(i64)h * T + c] : __int_as_float(0x7f800000))
                                   : (ok ? delta[(i64)h * T + c] : 0.f);
            }
            mbar_wait(&bar[1], ph);
            float s[HOP32_BQ / 2], dp[HOP32_BQ / 2];
            const u64 dK0 = smem_desc(sK, 0), dQ0 = smem_desc(sQ, 0), dV0 = smem_desc(sV, 0), dO0 = smem_desc(sdO, 0);
            __syncwarp();
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 8; ++ks) {  // k8 steps over the head dim (column block b, offset in the row)
                const int b = ks >> 2, off = (ks & 3) * 8;
                const u32 oa = u16b(b * HOP32_BK * 32 + off), ob = u16b(b * HOP32_BQ * 32 + off);
                wgmma_ss_tf32<HOP32_BQ>(s, dK0, dQ0, ks > 0, oa, ob);
            }
#pragma unroll
            for (int ks = 0; ks < D / 8; ++ks) {
                const int b = ks >> 2, off = (ks & 3) * 8;
                const u32 oa = u16b(b * HOP32_BK * 32 + off), ob = u16b(b * HOP32_BQ * 32 + off);
                wgmma_ss_tf32<HOP32_BQ>(dp, dV0, dO0, ks > 0, oa, ob);
            }
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(s);
            reg_fence(dp);
            named_barrier(1, 128);  // Q and dO of this step are read (and sL is written)
            if (tid == 0) mbar_arrive(&bar[4]);
            // P^T and dS^T (keys past the sequence: 0), then their tf32 A fragments
            u32 pa[HOP32_BQ / 8][4], sa[HOP32_BQ / 8][4];
#pragma unroll
            for (int j = 0; j < HOP32_BQ / 8; ++j) {
                const float2 lq = *reinterpret_cast<const float2*>(sL + 8 * j + 2 * t);
                const float2 dl = *reinterpret_cast<const float2*>(sL + 64 + 8 * j + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool kv_ok = (e >> 1) ? kvalid1 : kvalid0;
                    const float p = kv_ok ? exp2_ftz(s[4 * j + e] * scale_log2 - ((e & 1) ? lq.y : lq.x)) : 0.f;
                    s[4 * j + e] = p;
                    dp[4 * j + e] = p * (dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
                }
                acc_to_a_tf32(pa[j], s, j);
                acc_to_a_tf32(sa[j], dp, j);
            }
            mbar_wait(&bar[2], ph);
            mbar_wait(&bar[3], ph);
            const u64 dQt0 = smem_desc(sQt, 0), dOt0 = smem_desc(sdOt, 0);
            __syncwarp();
            wgmma_fence();
            hop32_rs_tokens<D>(dk, sa, dQt0);  // k8 steps over the queries
            wgmma_commit();
            hop32_rs_tokens<D>(dv, pa, dOt0);
            wgmma_commit();
            wgmma_wait<1>();  // dK is done (Q^T read); dV may still run
            reg_fence(dk);
            reg_fence_u(sa);
            named_barrier(1, 128);
            // dS to shared memory over Q^T: [2 key blocks][64 queries][32 keys], swizzled. sa[kk] holds
            // dS^T(key 16 wq + g (+8), query 8kk + 2t (+1)) as (r, c), (r + 8, c), (r, c + 1), (r + 8, c + 1).
            {
                unsigned char* ds = reinterpret_cast<unsigned char*>(sDS);
                const int r = wq * 16 + g;
                const u32 kb = (r >> 5) * HOP32_BQ * 128;  // both r and r + 8 are in the same 32-key block
#pragma unroll
                for (int kk = 0; kk < HOP32_BQ / 8; ++kk) {
                    const int c = 8 * kk + 2 * t;
                    *reinterpret_cast<u32*>(ds + kb + swz128w(c, r & 31)) = sa[kk][0];
                    *reinterpret_cast<u32*>(ds + kb + swz128w(c, (r & 31) + 8)) = sa[kk][1];
                    *reinterpret_cast<u32*>(ds + kb + swz128w(c + 1, r & 31)) = sa[kk][2];
                    *reinterpret_cast<u32*>(ds + kb + swz128w(c + 1, (r & 31) + 8)) = sa[kk][3];
                }
            }
            fence_async_smem();
            wgmma_wait<0>();  // dV is done: its A registers are free for the dQ^T accumulators
            reg_fence(dv);
            reg_fence_u(pa);
            named_barrier(1, 128);  // dS complete; dO^T is read
            if (tid == 0) mbar_arrive(&bar[6]);
            mbar_wait(&bar[7], ph);  // our turn (the producer saw the counter)
#pragma unroll 1
            for (int mb = 0; mb < MB; ++mb) hop32_dq_rows<D>(sKt, sDS, mb, dqacc, ldq, h, q0, scaling, wq, g, t);
            named_barrier(1, 128);  // every share written; dS (over Q^T) is free
            if (tid == 0) {  // cumulative: publishes the reductions of every thread before the barrier
                st_release(sem + (i64)h * T + qs, kvi + 1);
                mbar_arrive(&bar[5]);
            }
        }
    }

    // epilogue (both warpgroups): dK (scaled) and dV through the [128][D + 4] staging tile over Q onwards; rows
    // 64..127 and those past the sequence are zeroed by write_grad_tile (nvalid = nkv)
    float* stg = sQ;
    const i64 col = (i64)h * D, H = (i64)NH * D;
    float* prow = part + (i64)blk.kb * 3 * H;  // part [2 x tiles][3H]
    if (half == 1)
        for (int c = tid; c < D; c += blockDim.x) prow[col + c] = 0.f;  // q columns: the dQ writer fills row 2 tile
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        const float* acc = pass == 0 ? dk : dv;
        const float sc = pass == 0 ? scaling : 1.f;
        if (wg == 0) hop32_stage_rows<D>(stg, acc, sc, wq, g, t);
        float* pt = prow + (pass + 1) * H + col;
        float* ot = outT ? outT + ((pass + 1) * H + col) * ldt : nullptr;
        if (pass == 0) write_grad_tile<OT, D, ROPE, ROPE>(stg, dk_out + col, out_ld, cs, sn, kv0, nkv, pt, ot, T, ldt);
        else write_grad_tile<OT, D, false, ROPE>(stg, dv_out + col, out_ld, cs, sn, kv0, nkv, pt, ot, T, ldt);
        __syncthreads();
    }
}

// dQ of a 128-query tile (tiles[x], head y) from the transposed accumulator dqacc^T [NH][D][ldq], through the
// block epilogue; bias partial sums to row 2 x of part.
template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop_dq_finish_t(const float* __restrict__ dqacc, int ldq, const int* __restrict__ tiles,
                                                typename OT::T* __restrict__ dq_out, i64 out_ld,
                                                const float* __restrict__ cs, const float* __restrict__ sn,
                                                float* __restrict__ part, float* __restrict__ outT, int ldt, int T) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* stg = reinterpret_cast<float*>(smem_raw);
    constexpr int LDST = D + 4;
    const int h = blockIdx.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s1 = tiles[3 * tile + 2], nq = min(HOP_BM, s1 - row0);
    const float* src = dqacc + (i64)h * D * ldq + row0;
    // consecutive threads: consecutive tokens; 8 loads of a thread in flight before their stores (16 measured
    // slower at 32 x 256 and even elsewhere: bench/NOTES.md)
    static_assert(HOP_BM * D % (256 * 8) == 0, "256 threads take the tile in batches of 8 values each");
#pragma unroll 1
    for (int u0 = 0; u0 < HOP_BM * D; u0 += 256 * 8) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int u = u0 + threadIdx.x + 256 * i, c = u / HOP_BM, r = u - c * HOP_BM;
            v[i] = r < nq ? __ldcs(src + (i64)c * ldq + r) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int u = u0 + threadIdx.x + 256 * i, c = u / HOP_BM, r = u - c * HOP_BM;
            stg[r * LDST + c] = v[i];
        }
    }
    const i64 col = (i64)h * D;
    write_grad_tile<OT, D, ROPE, ROPE>(stg, dq_out + col, out_ld, cs, sn, row0, nq, part + (i64)tile * 2 * 3 * gridDim.y * D + col,
                                 outT ? outT + col * ldt : nullptr, T, ldt);
}
