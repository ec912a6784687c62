// sm_90a backward, bf16: key/value-stationary, one pass over the queries, wgmma from TMA-loaded tiles.
//
// Block (head x, tile y): the 128 keys of tile tiles[y] of head x, two warpgroups of 64 keys each; K and V stay
// in shared memory, dK and dV in registers. Query tiles of 64 rows (Q, dO, double-buffered by TMA) are walked in
// order; per query tile and warpgroup:
//   S^T = K Q^T, dP^T = V dO^T        wgmma m64n64k16, both operands K-major in shared memory
//   P^T = exp2(S^T scale_log2 - lse2), dS^T = P^T (dP^T - delta)   (lse2 and delta of the query columns)
//   dV += P^T dO, dK += dS^T Q        wgmma m64nDk16, A from registers, B (dO, Q) read MN-major
//   dQ(tile) = dS K                    dS^T through shared memory (read MN-major), K MN-major; warpgroup 0 the
//                                      first 64 columns, warpgroup 1 the rest
// dQ is accumulated in fp32 (dqacc [NH][T][D]) in a fixed order: the block of the n-th key tile of a sequence adds
// its share of query tile q0 only once sem[h][q0] == n (written by the (n-1)-th), then sets it to n + 1; the
// first stores instead of adding. So the sum runs over the key tiles in order: bit-identical from run to run.
// Blocks run key-tile-fastest or head-fastest (hop_bwd_block, the plan's choice); either way a key tile's
// predecessor is scheduled before it, so no wait can deadlock.
// dK (scaled) and dV go through the block epilogue (write_grad_tile: RoPE backward for dK if ROPE, bias partial
// sums, optional transposed copy).
#pragma once
#include "attention/sm90/forward.cuh"

#define HOP_BQ 64  // query rows per step

// Which block this is, for a grid (NH, key blocks). group > 0: consecutive blocks in launch order (blockIdx.x +
// gridDim.x * blockIdx.y) take consecutive key blocks of `group` heads in turn (the last group may have fewer), so
// the blocks in flight together read the query tiles of those heads only (at 1 x 16384 tokens, 28 x 128: one
// head's bf16 Q and dO are 8 MiB, every head's 235 MB, against a 50 MB L2); group = 1 is key-tile-fastest over
// one head at a time. group = 0: head-fastest, a key tile's predecessor then started NH blocks earlier. The more
// heads in a group, the fewer key tiles of one sequence start together and wait on each other's dQ shares
// (plan.py: BWD_GROUP_BYTES says how the plan picks). Every order schedules a key tile's predecessor first, so
// no wait can deadlock.
struct HopBlock {
    int h, kb;
};
// hop_bwd_unit: the same for the lin-th unit (head, key tile) of NH x NT in launch order (the split kernels,
// whose grid is longer than the units).
__device__ __forceinline__ HopBlock hop_bwd_unit(int group, int lin, int NH, int NT) {
    if (!group) return {lin % NH, lin / NH};
    const int h0 = lin / (group * NT) * group, r = lin % (group * NT), g = min(group, NH - h0);
    return {h0 + r % g, r / g};
}
// (hop_bwd_block keeps its own copy of the formula: through hop_bwd_unit ptxas builds every backward kernel
// differently, and these are the measured ones.)
__device__ __forceinline__ HopBlock hop_bwd_block(int group) {
    if (!group) return {(int)blockIdx.x, (int)blockIdx.y};
    const int NH = gridDim.x, NT = gridDim.y, lin = blockIdx.x + NH * blockIdx.y;
    const int h0 = lin / (group * NT) * group, r = lin % (group * NT), g = min(group, NH - h0);
    return {h0 + r % g, r / g};
}

template <int D> struct HopBwdSmem {
    static constexpr int NB = HopDims<D>::NB;
    static constexpr int KT = HOP_BN * 64 * NB;  // elements of a K or V tile
    static constexpr int QT = HOP_BQ * 64 * NB;  // elements of a Q or dO tile
    static constexpr int DS = HOP_BN * 64;        // dS^T [128 keys][64 queries], one column block
    // K, V, Q[2], dO[2], dS; the fp32 epilogue tile [128][D + 4] reuses Q, dO and dS (and more if needed)
    static constexpr int MAIN = (2 * KT + 4 * QT + DS) * 2;
    static constexpr int STAGE = HOP_BN * (D + 4) * 4;
    static constexpr int BYTES = 2 * KT * 2 + (4 * QT + DS) * 2 > 2 * KT * 2 + STAGE ? MAIN + 64 : 2 * KT * 2 + STAGE + 64;
};

// dQ columns of warpgroup wg: [64 wg, 64 wg + N) with N = min(64, D - 64 wg) (0: none).
template <int D, int WG> struct HopDqCols { static constexpr int N = D - 64 * WG >= 64 ? 64 : D - 64 * WG; };

// dq = dS K for N columns of K (sKcols: the first of them; A = dS^T [128 keys][64 queries] and B = K read
// MN-major, keys the reduction), issued and committed, not waited for.
// TRANS (the q80 kernels): dq^T = K^T dS^T instead, m64nNk16 with N the step's BQ queries: A = the warpgroup's 64
// columns of K read MN-major (D the rows), B = dS [2][BQ][64] K-major (keys the reduction). Lane (g, t) of warp
// wq then holds column 16 wq + g (+ 8) of query rows 8 j + 2 t (+ 1).
template <int N, bool TRANS = false>
__device__ __forceinline__ void hop_dq_issue(float (&dq)[N / 2], const u16* sDS, const u16* sKcols) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HOP_BN / 16; ++kk) {
        if constexpr (TRANS)
            wgmma_ss<N, 1, 0>(dq, smem_desc(sKcols + kk * 16 * 64, HOP_BN * 128),
                              smem_desc(sDS + (kk >> 2) * N * 64 + (kk & 3) * 16, 0), kk > 0);
        else
            wgmma_ss<N, 1, 1>(dq, smem_desc(sDS + kk * 16 * 64, HOP_BN * 128),
                              smem_desc(sKcols + kk * 16 * 64, HOP_BN * 128), kk > 0);
    }
    wgmma_commit();
}

template <int N>
__device__ __forceinline__ void hop_dq_part(float* __restrict__ dst, const u16* sDS, const u16* sKcols, int first,
                                            float scaling, int nq, int wq, int g, int t, int D) {
    float dq[N / 2];
    hop_dq_issue<N>(dq, sDS, sKcols);
    wgmma_wait<0>();
    reg_fence(dq);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wq * 16 + g + 8 * r;
        if (row >= nq) continue;
        float* p = dst + (i64)row * D + 2 * t;
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const float a = dq[4 * j + 2 * r] * scaling, b = dq[4 * j + 2 * r + 1] * scaling;
            if (first) *reinterpret_cast<float2*>(p + 8 * j) = make_float2(a, b);
            else red_add_v2(p + 8 * j, a, b);
        }
    }
}

// ---- one query step of the bf16 backwards (backward.cuh, backward_ws.cuh), per warpgroup of 64 keys ----------
// S^T = K Q^T and dP^T = V dO^T (wgmma m64n64k16, both operands K-major in shared memory), issued and committed
// as one group, not waited for.
// BQ: the step's query rows (the Q and dO tiles [NB][BQ][64]); HOP_BQ but in the q80 kernels (backward_ws.cuh).
template <int D, int BQ = HOP_BQ>
__device__ __forceinline__ void hop_bwd_scores_issue(float (&s)[BQ / 2], float (&dp)[BQ / 2], const u16* sKw,
                                                     const u16* sVw, const u16* q, const u16* dO) {
    constexpr int KS = HopDims<D>::KS;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int b = ks >> 2, off = (ks & 3) * 16;
        wgmma_ss<BQ, 0, 0>(s, smem_desc(sKw + b * HOP_BN * 64 + off, 0), smem_desc(q + b * BQ * 64 + off, 0),
                           ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int b = ks >> 2, off = (ks & 3) * 16;
        wgmma_ss<BQ, 0, 0>(dp, smem_desc(sVw + b * HOP_BN * 64 + off, 0), smem_desc(dO + b * BQ * 64 + off, 0),
                           ks > 0);
    }
    wgmma_commit();
}

// ... and waited for.
template <int D, int BQ = HOP_BQ>
__device__ __forceinline__ void hop_bwd_scores(float (&s)[BQ / 2], float (&dp)[BQ / 2], const u16* sKw,
                                               const u16* sVw, const u16* q, const u16* dO) {
    hop_bwd_scores_issue<D, BQ>(s, dp, sKw, sVw, q, dO);
    wgmma_wait<0>();
    reg_fence(s);
    reg_fence(dp);
}

// P^T and dS^T in place (keys past the sequence: 0, which only a block whose key tile the sequence does not
// fill needs to test: MASK; queries past it have lse2 = +inf, so P = 0 there without a test). lq, dl: the lse2
// and delta of the lane's query columns 8j + 2t + {0, 1}, read by the callable ld(j) as two float2.
template <bool MASK, int N, class LD>
__device__ __forceinline__ void hop_bwd_p_ds_t(float (&s)[N], float (&dp)[N], LD ld, bool kvalid0, bool kvalid1,
                                               float scale_log2) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
        float2 lq, dl;
        ld(j, lq, dl);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float p = exp2_ftz(s[4 * j + e] * scale_log2 - ((e & 1) ? lq.y : lq.x));
            if constexpr (MASK) p = ((e >> 1) ? kvalid1 : kvalid0) ? p : 0.f;
            s[4 * j + e] = p;
            dp[4 * j + e] = p * (dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
        }
    }
}

// full: every key row of the block is in the sequence (uniform over the block).
template <int N, class LD>
__device__ __forceinline__ void hop_bwd_p_ds(float (&s)[N], float (&dp)[N], LD ld, bool kvalid0, bool kvalid1,
                                             bool full, float scale_log2) {
    if (full) hop_bwd_p_ds_t<false>(s, dp, ld, kvalid0, kvalid1, scale_log2);
    else hop_bwd_p_ds_t<true>(s, dp, ld, kvalid0, kvalid1, scale_log2);
}

// This lane's lse2 and delta (columns 8j + 2t + {0, 1} of the step's queries; L: lse2 [64], then delta [64]) into
// registers, for HopLseRegs.
__device__ __forceinline__ void hop_bwd_lse_load(const float* L, int t, float (&lq)[HOP_BQ / 4],
                                                 float (&dl)[HOP_BQ / 4]) {
#pragma unroll
    for (int j = 0; j < HOP_BQ / 8; ++j) {
        const float2 l = *reinterpret_cast<const float2*>(L + 8 * j + 2 * t);
        const float2 d = *reinterpret_cast<const float2*>(L + HOP_BQ + 8 * j + 2 * t);
        lq[2 * j] = l.x;
        lq[2 * j + 1] = l.y;
        dl[2 * j] = d.x;
        dl[2 * j + 1] = d.y;
    }
}

// The lse2/delta reader of hop_bwd_p_ds from registers (lq, dl: this lane's 16 + 16 values).
struct HopLseRegs {
    const float* lq;
    const float* dl;
    __device__ __forceinline__ void operator()(int j, float2& l, float2& d) const {
        l = make_float2(lq[2 * j], lq[2 * j + 1]);
        d = make_float2(dl[2 * j], dl[2 * j + 1]);
    }
};

// ... and from shared memory where each pair is used (L: lse2 [BQ], then delta [BQ]; t the lane's column pair).
template <int BQ> struct HopLseSmemT {
    const float* L;
    int t;
    __device__ __forceinline__ void operator()(int j, float2& l, float2& d) const {
        l = *reinterpret_cast<const float2*>(L + 8 * j + 2 * t);
        d = *reinterpret_cast<const float2*>(L + BQ + 8 * j + 2 * t);
    }
};
typedef HopLseSmemT<HOP_BQ> HopLseSmem;

// P^T and dS^T (bf16) as the A fragments of the dV and dK products, each value rounded once; s and dp are dead
// afterwards (the fragments are what the step keeps: 32 registers instead of 64).
template <int N>
__device__ __forceinline__ void hop_bwd_to_a(u32 (&pa)[N / 8][4], u32 (&sa)[N / 8][4], const float (&s)[N],
                                             const float (&dp)[N]) {
#pragma unroll
    for (int kk = 0; kk < N / 8; ++kk) {
        acc_to_a(pa[kk], s, kk);
        acc_to_a(sa[kk], dp, kk);
    }
}

// dS^T rows r0 and r0 + 8 into the swizzled [128 keys][64 queries] buffer, for the dQ product, from its A
// fragments: word 2 jj + r of k16 step kk holds row r0 + 8 r, query columns 8 (2 kk + jj) + 2t and + 1.
__device__ __forceinline__ void hop_bwd_store_ds(u16* sDS, const u32 (&sa)[HOP_BQ / 16][4], int r0, int t) {
    unsigned char* ds = reinterpret_cast<unsigned char*>(sDS);
#pragma unroll
    for (int kk = 0; kk < HOP_BQ / 16; ++kk)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int c = 8 * (2 * kk + jj) + 2 * t;
            *reinterpret_cast<u32*>(ds + swz128(r0, c)) = sa[kk][2 * jj];
            *reinterpret_cast<u32*>(ds + swz128(r0 + 8, c)) = sa[kk][2 * jj + 1];
        }
}

// dV += P^T dO, dK += dS^T Q (the query rows are the reduction: dO and Q read MN-major), issued and committed,
// not waited for: the A fragments pa, sa are the caller's, live until its wait (wgmma reads them asynchronously).
template <int D, int KQ>
__device__ __forceinline__ void hop_bwd_dkdv(float (&dk)[D / 2], float (&dv)[D / 2], const u32 (&pa)[KQ][4],
                                             const u32 (&sa)[KQ][4], const u16* q, const u16* dO) {
    constexpr int BQ = 16 * KQ;  // the step's query rows: KQ k16 steps
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk)
        wgmma_rs<D, 1>(dv, pa[kk], smem_desc(dO + kk * 16 * 64, BQ * 128), 1);
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk)
        wgmma_rs<D, 1>(dk, sa[kk], smem_desc(q + kk * 16 * 64, BQ * 128), 1);
    wgmma_commit();
}

// The q80 kernels' dS (transposed back): this warp's 16 key rows of dS^T, from its A fragments, into dS
// [BQ queries][64 keys] (sDSw: the warpgroup's 128-byte-swizzled column block of [2][BQ][64], K-major for the
// dQ^T product) by stmatrix .trans: per k16 step, matrix m of x4 is fragment word m, keys 8 (m & 1) and queries
// 8 (m >> 1) on; lane l gives the address of row l & 7 (a query) of matrix l >> 3, its 8 keys one 16-byte chunk.
template <int KQ>
__device__ __forceinline__ void hop_bwd_store_ds_t(u16* sDSw, const u32 (&sa)[KQ][4], int wq, int lane) {
    const int m = lane >> 3, i = lane & 7;
    const u32 base = cvta_smem(sDSw);
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
        const u32 a = base + swz128(16 * kk + 8 * (m >> 1) + i, 16 * wq + 8 * (m & 1));
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a),
                     "r"(sa[kk][0]), "r"(sa[kk][1]), "r"(sa[kk][2]), "r"(sa[kk][3])
                     : "memory");
    }
}

// The bf16 backwards' epilogue: dK (scaled) and dV of the block's 128 keys (warpgroup wg's accumulators, rows
// 64 wg + 16 wq + g (+ 8)) through the fp32 staging tile stg [128][D + 4] and the block epilogue (write_grad_tile:
// RoPE backward of dK if ROPE, bias partial sums into part [tiles][3H], the optional transposed copy). UNALIGNED:
// its barriers in the unaligned form (block_sync), as the warp-specialised kernel's producer warps meet them; BAR
// > 0: named barrier BAR of the 256 consumer threads instead (the producer warps take no part); UNROLL: the
// unrolling of write_grad_tile's row loop.
template <int D, class OT, bool ROPE, bool UNALIGNED = false, int BAR = 0, int UNROLL = 2>
__device__ __forceinline__ void hop_bwd_epilogue(float* stg, const float* dk, const float* dv, float scaling,
                                                 int wg, int wq, int g, int t, int h, int NH, int tile, int kv0,
                                                 int nkv, typename OT::T* __restrict__ dk_out,
                                                 typename OT::T* __restrict__ dv_out, i64 out_ld,
                                                 const float* __restrict__ cs, const float* __restrict__ sn,
                                                 float* __restrict__ part, float* __restrict__ outT, int ldt, int T) {
    constexpr int LDST = D + 4;
    const i64 col = (i64)h * D, H = (i64)NH * D;
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        const float* acc = pass == 0 ? dk : dv;
        const float sc = pass == 0 ? scaling : 1.f;
        const int r0 = wg * 64 + wq * 16 + g;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<float2*>(stg + r0 * LDST + 8 * j + 2 * t) =
                make_float2(acc[4 * j] * sc, acc[4 * j + 1] * sc);
            *reinterpret_cast<float2*>(stg + (r0 + 8) * LDST + 8 * j + 2 * t) =
                make_float2(acc[4 * j + 2] * sc, acc[4 * j + 3] * sc);
        }
        float* pt = part + (i64)tile * 3 * H + (pass + 1) * H + col;  // part [tiles][3H]: q, k, v columns
        float* ot = outT ? outT + ((pass + 1) * H + col) * ldt : nullptr;
        if (pass == 0)
            write_grad_tile<OT, D, ROPE, ROPE, UNALIGNED, BAR, UNROLL>(stg, dk_out + col, out_ld, cs, sn, kv0, nkv, pt,
                                                                      ot, T, ldt);
        else
            write_grad_tile<OT, D, false, ROPE, UNALIGNED, BAR, UNROLL>(stg, dv_out + col, out_ld, cs, sn, kv0, nkv,
                                                                       pt, ot, T, ldt);
        epi_sync<UNALIGNED, BAR>();
    }
}

template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop_bwd(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                        const TmaDesc* tdo, const int* __restrict__ tiles,
                                        const float* __restrict__ lse, const float* __restrict__ delta,
                                        float* __restrict__ dqacc, int* __restrict__ sem,
                                        typename OT::T* __restrict__ dk_out, typename OT::T* __restrict__ dv_out,
                                        i64 out_ld, const float* __restrict__ cs, const float* __restrict__ sn,
                                        float* __restrict__ part, float* __restrict__ outT, int ldt, int T,
                                        float scale_log2, float scaling, int order) {
    typedef HopBwdSmem<D> SM;
    constexpr int NB = HopDims<D>::NB;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + SM::KT;
    u16* sQ = sV + SM::KT;       // [2][QT]
    u16* sdO = sQ + 2 * SM::QT;  // [2][QT]
    u16* sDS = sdO + 2 * SM::QT;
    u64* bar = reinterpret_cast<u64*>(smem_raw + SM::BYTES - 64);  // [0] K/V, [1..2] Q/dO stages

    const HopBlock blk = hop_bwd_block(order);
    const int h = blk.h, NH = gridDim.x, tile = blk.kb;
    const int kv0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nkv = min(HOP_BN, s1 - kv0), kvi = (kv0 - s0) / HOP_BN;  // this key tile's index in its sequence
    const int nit = (s1 - s0 + HOP_BQ - 1) / HOP_BQ;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 KV_BYTES = SM::KT * 2, Q_BYTES = SM::QT * 2;

    mbar_setup<3>(bar);
    if (threadIdx.x == 0) {
        mbar_expect_tx(&bar[0], 2 * KV_BYTES);
        tma_tile<NB, HOP_BN>(sK, tk, &bar[0], h, kv0);
        tma_tile<NB, HOP_BN>(sV, tv, &bar[0], h, kv0);
        mbar_expect_tx(&bar[1], 2 * Q_BYTES);
        tma_tile<NB, HOP_BQ>(sQ, tq, &bar[1], h, s0);
        tma_tile<NB, HOP_BQ>(sdO, tdo, &bar[1], h, s0);
    }
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    const u16* sKw = sK + wg * 64 * 64;  // this warpgroup's 64 keys of each column block
    const u16* sVw = sV + wg * 64 * 64;
    // key rows of this thread (for masking keys past the sequence): 64 wg + 16 wq + g (+ 8)
    const bool kvalid0 = wg * 64 + wq * 16 + g < nkv, kvalid1 = wg * 64 + wq * 16 + g + 8 < nkv;
    mbar_wait(&bar[0], 0);

    for (int it = 0; it < nit; ++it) {
        const int st = it & 1, q0 = s0 + it * HOP_BQ, nq = min(HOP_BQ, s1 - q0);
        if (threadIdx.x == 0 && it + 1 < nit) {
            mbar_expect_tx(&bar[1 + (st ^ 1)], 2 * Q_BYTES);
            tma_tile<NB, HOP_BQ>(sQ + (st ^ 1) * SM::QT, tq, &bar[1 + (st ^ 1)], h, q0 + HOP_BQ);
            tma_tile<NB, HOP_BQ>(sdO + (st ^ 1) * SM::QT, tdo, &bar[1 + (st ^ 1)], h, q0 + HOP_BQ);
        }
        // lse2 and delta of this lane's query columns 8j + 2t + {0, 1}: +inf / 0 past the sequence (P = 0 there)
        float lq[HOP_BQ / 4], dq_[HOP_BQ / 4];
#pragma unroll
        for (int j = 0; j < HOP_BQ / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = 8 * j + 2 * t + e;
                const bool ok = c < nq;
                lq[2 * j + e] = ok ? lse[(i64)h * T + q0 + c] : __int_as_float(0x7f800000);
                dq_[2 * j + e] = ok ? delta[(i64)h * T + q0 + c] : 0.f;
            }
        mbar_wait(&bar[1 + st], (it >> 1) & 1);
        const u16* q = sQ + st * SM::QT;
        const u16* dO = sdO + st * SM::QT;

        float s[HOP_BQ / 2], dp[HOP_BQ / 2];
        hop_bwd_scores<D>(s, dp, sKw, sVw, q, dO);
        hop_bwd_p_ds(s, dp, HopLseRegs{lq, dq_}, kvalid0, kvalid1, nkv == HOP_BN, scale_log2);
        u32 pa[HOP_BQ / 16][4], sa[HOP_BQ / 16][4];  // live until the wait below
        hop_bwd_to_a(pa, sa, s, dp);
        hop_bwd_store_ds(sDS, sa, wg * 64 + wq * 16 + g, t);
        hop_bwd_dkdv<D>(dk, dv, pa, sa, q, dO);
        fence_async_smem();  // dS^T stores, read by wgmma below
        if (threadIdx.x == 0) {  // wait for the previous key tile's share of this query tile
            const int* sp = sem + (i64)h * T + q0;
            while (ld_acquire(sp) < kvi) {
            }
        }
        __syncthreads();  // dS^T complete; the dQ turn is ours
        // dQ(tile) = dS K: A = dS^T read MN-major, B = K read MN-major (keys are the reduction)
        float* dst = dqacc + ((i64)h * T + q0) * D + 64 * wg;
        if (wg == 0) hop_dq_part<HopDqCols<D, 0>::N>(dst, sDS, sK, kvi == 0, scaling, nq, wq, g, t, D);
        else if constexpr (HopDqCols<D, 1>::N > 0)
            hop_dq_part<HopDqCols<D, 1>::N>(dst, sDS, sK + HOP_BN * 64, kvi == 0, scaling, nq, wq, g, t, D);
        wgmma_wait<0>();
        reg_fence(dk);
        reg_fence(dv);
        reg_fence_u(pa);
        reg_fence_u(sa);
        __threadfence();
        __syncthreads();  // every share written; Q, dO and dS^T of this step are free
        if (threadIdx.x == 0) st_release(sem + (i64)h * T + q0, kvi + 1);
    }

    // epilogue: dK (scaled) and dV through the fp32 staging tile [128][D + 4] (over Q, dO, dS^T: all done)
    hop_bwd_epilogue<D, OT, ROPE>(reinterpret_cast<float*>(sQ), dk, dv, scaling, wg, wq, g, t, h, NH, tile, kv0, nkv,
                                  dk_out, dv_out, out_ld, cs, sn, part, outT, ldt, T);
}

// dQ of a 128-query tile (tiles[x], head y) from the fp32 accumulator, through the block epilogue.
template <int D, class OT, bool ROPE>
__device__ __forceinline__ void hop_dq_finish(const float* __restrict__ dqacc, const int* __restrict__ tiles,
                                              typename OT::T* __restrict__ dq_out, i64 out_ld,
                                              const float* __restrict__ cs, const float* __restrict__ sn,
                                              float* __restrict__ part, float* __restrict__ outT, int ldt, int T) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* stg = reinterpret_cast<float*>(smem_raw);
    constexpr int LDST = D + 4, Q4 = D / 4;
    const int h = blockIdx.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s1 = tiles[3 * tile + 2], nq = min(HOP_BM, s1 - row0);
    const float* src = dqacc + ((i64)h * T + row0) * D;
    // every load of the thread first, then the stores (HOP_BM * Q4 / 256 float4 each: 16 at D = 128), so that a
    // thread has all of its share of the tile in flight, not one load at a time
    constexpr int PER = HOP_BM * Q4 / 256;
    static_assert(HOP_BM * Q4 % 256 == 0, "256 threads take the tile in equal shares");
    float4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int u = threadIdx.x + 256 * i, r = u / Q4, c = (u - r * Q4) * 4;
        v[i] = r < nq ? __ldcs(reinterpret_cast<const float4*>(src + (i64)r * D + c)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int u = threadIdx.x + 256 * i, r = u / Q4, c = (u - r * Q4) * 4;
        *reinterpret_cast<float4*>(stg + r * LDST + c) = v[i];
    }
    const i64 col = (i64)h * D;
    write_grad_tile<OT, D, ROPE, ROPE>(stg, dq_out + col, out_ld, cs, sn, row0, nq, part + (i64)tile * 3 * gridDim.y * D + col,
                                 outT ? outT + col * ldt : nullptr, T, ldt);
}
