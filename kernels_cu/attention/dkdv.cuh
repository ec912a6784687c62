// Kernel 2, attn_dkdv: one key/value tile's dK and dV (and, with DQP, the fp32 dQ partials of its keys).
#pragma once
#include "attention/config.cuh"
#include "attention/cp_async.cuh"
#include "attention/epilogue.cuh"

// dQ rows [nq] x [D] of the streamed query tile over the block's first nkp keys (a multiple of 16: the active
// warps'), from dS in the warps' scratch (warp w: dS[q][16w + k] at scratch0 + w * SCR + q * LDPT + k) and the
// resident fp32 K tile (row stride LD), stored at out[q * ld + d]. Thread unit: 4 query rows 4 (lane / 4) + i
// by 4 head columns 16 w + 4 (lane % 4) + c; 0.5 shared-memory wavefronts per FMA, as the score products. With
// ADD, each row is added to what `out` holds (read through L2: the earlier key tiles' shares, another block's).
template <int D>
__device__ __forceinline__ void dq_partial(const float* sK, const float* scratch0, int nkp, int nq,
                                           float* __restrict__ out, int ld, bool add) {
    constexpr int LD = Layout<MODE_FP32, D>::LD, LDPT = RsScratch<NTS>::LDPT, SCR = RsScratch<NTS>::value;
    const int lane = threadIdx.x & 31, qa = lane >> 2;
    const int col = 4 * (4 * (threadIdx.x >> 5) + (lane & 3));
    if (col >= D) return;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const float* pa = scratch0 + 4 * qa * LDPT;
    const float* pb = sK + col;
#pragma unroll 2
    for (int k = 0; k < nkp; k += 4) {
        const float* a = pa + (k >> 4) * SCR + (k & 15);
        float x[4][4], y[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 v = *reinterpret_cast<const float4*>(a + i * LDPT);
            x[i][0] = v.x; x[i][1] = v.y; x[i][2] = v.z; x[i][3] = v.w;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float4 v = *reinterpret_cast<const float4*>(pb + (k + u) * LD);
            y[u][0] = v.x; y[u][1] = v.y; y[u][2] = v.z; y[u][3] = v.w;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                acc[i][c] = fmaf(x[i][3], y[3][c],
                                 fmaf(x[i][2], y[2][c], fmaf(x[i][1], y[1][c], fmaf(x[i][0], y[0][c], acc[i][c]))));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if (4 * qa + i < nq) {
            float* p = out + (i64)(4 * qa + i) * ld + col;
            float4 v = add ? ld_cg_v4(p) : make_float4(0.f, 0.f, 0.f, 0.f);
            if (add) { v.x += acc[i][0]; v.y += acc[i][1]; v.z += acc[i][2]; v.w += acc[i][3]; }
            else v = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
            *reinterpret_cast<float4*>(p) = v;
        }
}

// ---- kernel 2: dK and dV. Block (x, y) owns key/value tile tiles[x] (BM rows) of head y. ------------------
// Streams the sequence's query tiles (double-buffered cp.async): S^T = K Q^T, P^T = exp2(S2^T - lse2),
// dV += P^T dO, dP^T = V dO^T, dS^T = scaling * P^T * (dP^T - delta), dK += dS^T Q.
// Writes RoPE-backwarded dk into gqkv[:, H:2H], dv into gqkv[:, 2H:3H], and their column sums.
// DQP (fp32 with blocked scores): also dQ of every streamed query row over this block's keys, dS K, the share of
// key tile kt = (first key - sequence start) / BM. Without `sem`, written as partial kt of dqp [kt][T][H]
// (attn_dq_reduce sums the partials). With `sem` ([NH][T] int32, zero), added into dqp [T][H] in key-tile order:
// sem[h][the step's first query row] counts the key tiles whose share of those rows is in; tile kt waits for kt,
// adds (tile 0 stores), publishes kt + 1. The same sums in the same order as the partials' reduction.
template <int MODE, int D, class OT, bool DQP>
__device__ void attn_dkdv(const typename Smem<MODE>::T* __restrict__ P, const float* __restrict__ cs,
                          const float* __restrict__ sn, const int* __restrict__ tiles, const float* __restrict__ lse,
                          const float* __restrict__ delta, typename OT::T* __restrict__ gqkv,
                          float* __restrict__ gqkvT, float* __restrict__ part, float* __restrict__ dqp,
                          int* __restrict__ sem, int T, int ldt, int H, float scale_log2, float scaling) {
    typedef typename Smem<MODE>::T ST;
    typedef Layout<MODE, D> L;
    constexpr int LD = L::LD, DK = L::DK, DN = D / 8;
    constexpr bool BLK = Blocked<MODE, DN>::value;  // fp32: scores, o, dq, dk, dv register-blocked (mma.cuh)
    typedef Score<BLK> SC;
    static_assert(!DQP || BLK, "dQ partials read dS from the fp32 blocked-score scratch");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    ST* sK = reinterpret_cast<ST*>(smem_raw);
    ST* sV = sK + BM * LD;
    ST* sQ = sV + BM * LD;       // [2][BN][LD]
    ST* sdO = sQ + 2 * BN * LD;  // [2][BN][LD]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BN * LD);  // [2][BN]
    float* sD = sL + 2 * BN;                                    // [2][BN]
    float* scratch = sD + 2 * BN + (threadIdx.x >> 5) * L::SCR;

    const int h = blockIdx.y, NH = gridDim.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nkv = min(BM, s1 - row0);
    const int nit = (s1 - s0 + BN - 1) / BN;
    const i64 ld3 = 3 * (i64)H;
    const int lane = threadIdx.x & 31, t = lane & 3, w = threadIdx.x >> 5;
    const ST* Pq = P + (i64)h * T * DK;
    const ST* Pk = P + ((i64)NH + h) * T * DK;
    const ST* Pv = P + ((i64)2 * NH + h) * T * DK;
    const ST* Pdo = P + ((i64)3 * NH + h) * T * DK;
    auto issue_q = [&](int it) {
        const int q0 = s0 + it * BN, nq = min(BN, s1 - q0), b = it & 1;
        copy_tile<MODE, D, BN>(sQ + b * BN * LD, Pq + (i64)q0 * DK, nq);
        copy_tile<MODE, D, BN>(sdO + b * BN * LD, Pdo + (i64)q0 * DK, nq);
        if (threadIdx.x < 2 * BN) {  // lse2 and delta of these rows (zero past the sequence)
            const int r = threadIdx.x & (BN - 1);
            const bool v = r < nq;
            const float* src = (threadIdx.x < BN ? lse : delta) + (i64)h * T + q0 + (v ? r : 0);
            cp_async4((threadIdx.x < BN ? sL : sD) + b * BN + r, src, v ? 4 : 0);
        }
        cp_async_commit();
    };

    copy_tile<MODE, D, BM>(sK, Pk + (i64)row0 * DK, nkv);
    copy_tile<MODE, D, BM>(sV, Pv + (i64)row0 * DK, nkv);
    const ST* sKw = sK + w * 16 * LD;
    const ST* sVw = sV + w * 16 * LD;
    const bool active = !SkipIdle<MODE>::value || w * 16 < nkv;  // keys past the tile's end: nothing to compute

    float dk[DN][4], dv[DN][4];
#pragma unroll
    for (int j = 0; j < DN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
    issue_q(0);
    for (int it = 0; it < nit; ++it) {
        stream_step(it, nit, issue_q);
        const int nq = min(BN, s1 - s0 - it * BN), b = it & 1;
        const ST* bQ = sQ + b * BN * LD;
        const ST* bdO = sdO + b * BN * LD;
        if (active) {
            const float* bL = sL + b * BN;
            const float* bD = sD + b * BN;
            float s[NTS][4], dp[NTS][4];
#pragma unroll
            for (int j = 0; j < NTS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
            mm_ss<MODE, NTS, DK, BLK>(s, sKw, LD, bQ, LD);
#pragma unroll
            for (int x = 0; x < NTS; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    const int c = SC::col(x, y);
                    s[x][y] = c < nq ? exp2_ftz(s[x][y] * scale_log2 - bL[c]) : 0.f;
                }
            mm_rs<MODE, DN, NTS>(dv, s, bdO, LD, scratch);
            mm_ss<MODE, NTS, DK, BLK>(dp, sVw, LD, bdO, LD);
#pragma unroll
            for (int x = 0; x < NTS; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) s[x][y] = scaling * s[x][y] * (dp[x][y] - bD[SC::col(x, y)]);
            mm_rs<MODE, DN, NTS>(dk, s, bQ, LD, scratch);  // leaves dS in this warp's scratch: [query][key]
        }
        if constexpr (DQP) {
            const int kt = (row0 - s0) / BM;
            int* count = sem ? sem + (i64)h * T + s0 + it * BN : nullptr;
            if (count && kt > 0 && threadIdx.x == 0)  // the sequence's earlier key tiles' shares of these rows
                while (ld_acquire(count) < kt) {
                }
            __syncthreads();  // every active warp's dS is in its scratch (and, ordered, the rows are ours)
            dq_partial<D>(reinterpret_cast<const float*>(sK), sD + 2 * BN, (nkv + 15) & ~15, nq,
                          dqp + ((count ? 0 : (i64)kt * T) + s0 + it * BN) * H + h * D, H, count && kt > 0);
            if (count) {
                __threadfence();
                __syncthreads();  // every thread's share written
                if (threadIdx.x == 0) st_release(count, kt + 1);
            }
        }
        __syncthreads();
    }
    float* st = reinterpret_cast<float*>(smem_raw);
    float* pt = part + (i64)tile * ld3;
    stage_acc<D, BLK>(st, dk);
    write_grad_tile<OT, D, true>(st, gqkv + H + h * D, ld3, cs, sn, row0, nkv, pt + H + h * D,
                                 gqkvT ? gqkvT + ((i64)H + h * D) * ldt : nullptr, T, ldt);
    __syncthreads();
    stage_acc<D, BLK>(st, dv);
    write_grad_tile<OT, D, false>(st, gqkv + 2 * H + h * D, ld3, cs, sn, row0, nkv, pt + 2 * H + h * D,
                                  gqkvT ? gqkvT + ((i64)2 * H + h * D) * ldt : nullptr, T, ldt);
}
