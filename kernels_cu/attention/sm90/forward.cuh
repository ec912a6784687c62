// sm_90a forward, bf16: one pass over K and V per query tile (online softmax), wgmma from TMA-loaded tiles.
//
// Block (tile x, head y): 128 query rows (tiles[x]) of head y, two warpgroups of 64 rows each. K and V stream in
// 128-row tiles, double-buffered: thread 0 issues the next tile's TMA as soon as the block has finished with the
// buffer it refills, so the copy engine runs beside the products. Per K/V tile and warpgroup:
//   S = Q K^T                       wgmma m64n128k16, A and B from shared memory (K-major)
//   online softmax in registers     running max m of S and sum l per row, P = exp2(S scale_log2 - m scale_log2)
//   O += P V                        wgmma m64nDk16, A = P from registers (bf16), B = V read MN-major
// Writes O (OT, row stride ldo, head h at column h*D) and lse2 = m scale_log2 + log2(l) [NH][T].
#pragma once
#include "attention/sm90/async.cuh"
#include "attention/sm90/wgmma_ops.cuh"

// Lab probe (wrong results, timing only): CUPY_ROPE_PROBE_FWD_NO_O=1 makes the bf16 forwards' epilogue store no O
// (lse and delta still), to see what O's stores cost at a unit's end. Unset: 0.
#ifndef CUPY_ROPE_PROBE_FWD_NO_O
#define CUPY_ROPE_PROBE_FWD_NO_O 0
#endif
// How the bf16 forwards store a bf16 O from registers: 1 (unset) each lane's column pairs as 4-byte stores with the
// streaming hint (__stcs: st.global.cs, evict-first: O is not read again by the kernel, K and V are, by the
// sequence's other query tiles), measured 2-5% faster than plain stores, the same bits (bench/NOTES.md); 0 (a lab
// switch) the same stores without the hint.
#ifndef CUPY_ROPE_FWD_O_STORE
#define CUPY_ROPE_FWD_O_STORE 1
#endif

#define HOP_BM 128  // query rows per block (two warpgroups of 64)
#define HOP_BN 128  // key/value rows per streamed tile
#define HOP_NEG_INF (-__int_as_float(0x7f800000))

template <int D> struct HopDims {
    static constexpr int NB = (D + 63) / 64;   // 64-column blocks of a tile row
    static constexpr int KS = D / 16;          // k16 steps over the head dim
    static_assert(D % 16 == 0, "head dims of the sm_90a path are multiples of 16");
};

// Shared memory of a forward with S K/V stages: Q [NB][128][64], K and V [S][NB][128][64], then up to eight
// barriers (hopper.smem_bytes sizes it; the compile test checks the two agree).
// KN: keys per K/V tile (HOP_BN, or 192 in the k192 forward: Q [NB][128][64], then K and V tiles of KN rows and
// up to sixteen barriers).
template <int D, int S = 2, int KN = HOP_BN> struct HopFwdSmem {
    static constexpr int NB = HopDims<D>::NB;
    static constexpr int TILE = KN * 64 * NB;  // elements of one K or V tile
    static constexpr int QTILE = HOP_BM * 64 * NB;
    static constexpr int BARS = KN == HOP_BN ? 64 : 128;
    static constexpr int BYTES = (QTILE + 2 * S * TILE) * 2 + BARS;
    static_assert(S >= 2 && 8 * (1 + 2 * S) <= 64 && BYTES <= 227 * 1024, "stages that fit one block per SM");
};

// Online softmax of one NK-key tile's scores s (rows g and g + 8 of the warp's 16; keys kv0 + 8j + 2t (+1)):
// mask the keys past the sequence (s1; with LO also those before its start s0, where a tile may begin earlier),
// raise the running max m, P = exp2(S scale_log2 - m scale_log2) in place, l = l * corr + rowsum(P) (this lane's
// share); corr = exp2((m_old - m) scale_log2), the factor for O (0 on the first tile, where m was -inf). MASK:
// the tile crosses an end of the sequence (the others skip the per-value test and select).
// RAW (the bf16 kernels, scale_log2 > 0: every real call): m is the max of the raw scores, and each value costs
// one FFMA before its exp2 (as the backward computes P); otherwise (tf32, or a zero or negative scale) the scores
// are scaled first and m is the max in the log2 domain. hop_lse2 turns either m into lse2. (bf16 forward, RAW
// against scaled, same run: D = 80 and 96 4-5% faster, D = 64 1%, D = 128 even; the tf32 forward lost 1-6%.)
template <int NK, bool LO, bool MASK, bool RAW>
__device__ __forceinline__ void hop_fwd_softmax_tile(float (&s)[NK / 2], float (&m)[2], float (&l)[2],
                                                     float (&corr)[2], int kv0, int s0, int s1, int t,
                                                     float scale_log2) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = RAW ? s[4 * j + e] : s[4 * j + e] * scale_log2;
            if constexpr (MASK) {
                const int c = kv0 + 8 * j + 2 * t + (e & 1);
                x = (!LO || c >= s0) && c < s1 ? x : HOP_NEG_INF;
            }
            s[4 * j + e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    float rs[2] = {0.f, 0.f}, ms[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        ms[r] = RAW ? mx[r] * scale_log2 : mx[r];
        corr[r] = exp2_ftz((RAW ? m[r] * scale_log2 : m[r]) - ms[r]);  // m = -inf on the first tile: 0
        m[r] = mx[r];
    }
#pragma unroll
    for (int j = 0; j < NK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float x = s[4 * j + e], mr = ms[e >> 1];
            const float p = exp2_ftz(RAW ? fmaf(x, scale_log2, -mr) : x - mr);
            s[4 * j + e] = p;
            rs[e >> 1] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + rs[r];
}

template <int NK, bool LO, bool RAW_MAX = false>
__device__ __forceinline__ void hop_fwd_softmax_t(float (&s)[NK / 2], float (&m)[2], float (&l)[2],
                                                  float (&corr)[2], int kv0, int s0, int s1, int t,
                                                  float scale_log2) {
    const bool full = (!LO || kv0 >= s0) && kv0 + NK <= s1;
    if (RAW_MAX && scale_log2 > 0.f) {
        if (full) hop_fwd_softmax_tile<NK, LO, false, true>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
        else hop_fwd_softmax_tile<NK, LO, true, true>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
    } else {
        if (full) hop_fwd_softmax_tile<NK, LO, false, false>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
        else hop_fwd_softmax_tile<NK, LO, true, false>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
    }
}

// lse2 = m scale_log2 + log2(l) of a row of the bf16 kernels (m in the domain hop_fwd_softmax_tile kept it).
__device__ __forceinline__ float hop_lse2(float m, float l, float scale_log2) {
    return (scale_log2 > 0.f ? m * scale_log2 : m) + __log2f(l);
}

// The bf16 kernels' tiles start at the sequence start: only keys past its end are masked. (N: the tile's keys
// over 2, HOP_BN / 2 but in the k192 forward.)
template <int N>
__device__ __forceinline__ void hop_fwd_softmax(float (&s)[N], float (&m)[2], float (&l)[2], float (&corr)[2], int kv0,
                                                int s1, int t, float scale_log2) {
    hop_fwd_softmax_t<2 * N, false, true>(s, m, l, corr, kv0, 0, s1, t, scale_log2);
}

// S = Q K^T for a warpgroup's 64 query rows (sQw) and a KN-key tile (k, [NB][KN][64]): wgmma m64nKNk16, A and B
// from shared memory (K-major); issued and committed, not waited for.
template <int D, int KN = HOP_BN>
__device__ __forceinline__ void hop_fwd_scores(float (&s)[KN / 2], const u16* sQw, const u16* k) {
    constexpr int KS = HopDims<D>::KS;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int b = ks >> 2, off = (ks & 3) * 16;  // column block, element offset in the 128-byte row
        wgmma_ss<KN, 0, 0>(s, smem_desc(sQw + b * HOP_BM * 64 + off, 0), smem_desc(k + b * KN * 64 + off, 0),
                           ks > 0);
    }
    wgmma_commit();
}

// O *= corr, per row (the lane's rows g and g + 8). Skipped by a warp whose 16 rows all kept their max (corr
// exactly 1, so the product would change no bit): on long sequences most tiles raise no row's max.
template <int D>
__device__ __forceinline__ void hop_fwd_rescale(float (&o)[D / 2], const float (&corr)[2]) {
    if (__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) return;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        o[4 * j] *= corr[0];
        o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1];
        o[4 * j + 3] *= corr[1];
    }
}

// P (fp32 accumulator layout) as the bf16 A fragments of the P V product.
template <int N>
__device__ __forceinline__ void hop_fwd_p_to_a(u32 (&pa)[N / 8][4], const float (&p)[N]) {
#pragma unroll
    for (int kk = 0; kk < N / 8; ++kk) acc_to_a(pa[kk], p, kk);
}

// O += P V: A = P from registers (pa, the caller's: live until its wait), V tile rows the reduction (MN-major B,
// column blocks TILE/NB elements apart); issued and committed, not waited for. KK: the tile's k16 steps.
template <int D, int KK>
__device__ __forceinline__ void hop_fwd_pv(float (&o)[D / 2], const u32 (&pa)[KK][4], const u16* v) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
        wgmma_rs<D, 1>(o, pa[kk], smem_desc(v + kk * 16 * 64, KK * 16 * 128), 1);
    wgmma_commit();
}

// The block's backward runs its forward with dO at hand (the product that makes it is joined before): the epilogue
// then also writes delta = rowsum(dO * O) of its rows, O as stored (bf16, the values the backward's dP is
// compared against), and zeroes the rows' ordered dQ counts (sem), so that no delta pass runs between the forward
// and the backward (it read O back and dO again: ~30 us at the seeds' 8192 tokens, 28 heads of 128). dO [T] rows
// of ldg elements, head h at h * hsg; delta and sem [NH][T]. dO null: neither is written.
struct HopDelta {
    const u16* __restrict__ dO;
    i64 ldg, hsg;
    float* __restrict__ delta;
    int* __restrict__ sem;
};

// With dl.dO: the lane's dO values of rows r0 and r0 + 8 of the block's tile (bf16 pairs at columns 8 j + 2 t; zero
// past the sequence's nq rows), loaded before the last P V product is waited for, so that their latency hides
// under it.
template <int D>
__device__ __forceinline__ void hop_fwd_delta_load(u32 (&g)[2][D / 8], const HopDelta& dl, int r0, int t, int row0,
                                                   int nq, int h) {
    if (dl.dO == nullptr) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        const u32* p = reinterpret_cast<const u32*>(dl.dO + (i64)(row0 + row) * dl.ldg + (i64)h * dl.hsg + 2 * t);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) g[r][j] = row < nq ? __ldg(p + 4 * j) : 0u;
    }
}

// O / l and lse2 (hop_lse2) times lse_scale of the lane's rows r0 and r0 + 8 of the block's tile (row0: its first
// token, nq its rows in the sequence: rows past it are not written). lse_scale: 1 (the block keeps lse2) or ln 2
// (the varlen API's natural log-sum-exp: the one rounding a separate multiply would make). With dl.dO (bf16 O
// only; g from hop_fwd_delta_load), delta and the zeroed counts as HopDelta says: each row's sum runs over its
// column pairs in order and then across the quad (a fixed order: the same bits each run).
// TILE (bf16 O, every row of the lane's warpgroup in the sequence): O goes into the [NB][HOP_BN][64] swizzled `tile`
// at its rows instead, for the copy engine to store.
template <int D, class OT, bool TILE = false>
__device__ __forceinline__ void hop_fwd_epilogue(const float (&o)[D / 2], const float (&m)[2], float (&l)[2], int r0,
                                                 int t, int row0, int nq, int h, typename OT::T* __restrict__ O,
                                                 i64 ldo, float* __restrict__ lse, int T, float scale_log2,
                                                 float lse_scale, const HopDelta& dl, const u32 (&g)[2][D / 8],
                                                 u16* tile = nullptr) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const bool with_delta = dl.dO != nullptr;
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r;
        if (row >= nq) continue;
        const float inv = 1.f / l[r];
        const i64 tok = row0 + row;
        typename OT::T* orow = O + tok * ldo + (i64)h * D;
        constexpr bool BF16_O = sizeof(typename OT::T) == 2;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const float a = o[4 * j + 2 * r] * inv, b = o[4 * j + 2 * r + 1] * inv;
            if constexpr (CUPY_ROPE_PROBE_FWD_NO_O) {
            } else if constexpr (TILE && BF16_O) {
                *reinterpret_cast<u32*>(reinterpret_cast<unsigned char*>(tile + (j >> 3) * HOP_BN * 64) +
                                        swz128(row, 8 * (j & 7) + 2 * t)) = pack2<BF16>(a, b);
            } else if constexpr (CUPY_ROPE_FWD_O_STORE == 1 && BF16_O) {
                __stcs(reinterpret_cast<unsigned*>(orow + 8 * j + 2 * t), pack2<BF16>(a, b));
            } else {
                store2<OT>(orow + 8 * j + 2 * t, a, b);
            }
            if (with_delta) {
                const float2 os = unpack2<BF16>(pack2<BF16>(a, b)), gs = unpack2<BF16>(g[r][j]);
                acc[r] = fmaf(os.x, gs.x, acc[r]);
                acc[r] = fmaf(os.y, gs.y, acc[r]);
            }
        }
        if (t == 0) lse[(i64)h * T + tok] = __fmul_rn(hop_lse2(m[r], l[r], scale_log2), lse_scale);
    }
    if (with_delta) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
            acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
            const int row = r0 + 8 * r;
            if (t == 0 && row < nq) {
                const i64 at = (i64)h * T + row0 + row;
                dl.delta[at] = acc[r];
                dl.sem[at] = 0;
            }
        }
    }
}

// A forward block's shared memory (Q, K and V in S stages each, then the barriers: [0] Q, [1 .. S] K/V stages
// full, [1 + S .. 2 S] the specialised kernel's stage-empty) and its query tile tiles[blockIdx.x] of head
// blockIdx.y: first query row row0, keys s0 .. s1 in nit tiles of HOP_BN.
struct HopFwdBlock {
    u16 *sQ, *sK, *sV;
    u64* bar;
    int h, row0, s0, s1, nit;
};
template <int D, int S = 2, int KN = HOP_BN>
__device__ __forceinline__ HopFwdBlock hop_fwd_block(unsigned char* smem, const int* __restrict__ tiles) {
    constexpr int TL = HopFwdSmem<D, S, KN>::TILE;
    HopFwdBlock b;
    b.sQ = reinterpret_cast<u16*>(smem);
    b.sK = b.sQ + HopFwdSmem<D, S, KN>::QTILE;  // [S][TL]
    b.sV = b.sK + S * TL;  // [S][TL]
    b.bar = reinterpret_cast<u64*>(b.sV + S * TL);
    const int tile = blockIdx.x;
    b.h = blockIdx.y;
    b.row0 = tiles[3 * tile];
    b.s0 = tiles[3 * tile + 1];
    b.s1 = tiles[3 * tile + 2];
    b.nit = (b.s1 - b.s0 + KN - 1) / KN;
    return b;
}

template <int D, class OT>
__device__ __forceinline__ void hop_fwd(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                        const int* __restrict__ tiles, typename OT::T* __restrict__ O, i64 ldo,
                                        float* __restrict__ lse, int T, float scale_log2, float lse_scale,
                                        const HopDelta& dl) {
    constexpr int NB = HopDims<D>::NB, TL = HopFwdSmem<D>::TILE;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const auto [sQ, sK, sV, bar, h, row0, s0, s1, nit] = hop_fwd_block<D>(smem_raw, tiles);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 TILE_BYTES = TL * 2;

    mbar_setup<3>(bar);
    if (threadIdx.x == 0) {
        mbar_expect_tx(&bar[0], TILE_BYTES);
        tma_tile<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
        mbar_expect_tx(&bar[1], 2 * TILE_BYTES);
        tma_tile<NB, HOP_BN>(sK, tk, &bar[1], h, s0);
        tma_tile<NB, HOP_BN>(sV, tv, &bar[1], h, s0);
    }

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {HOP_NEG_INF, HOP_NEG_INF}, l[2] = {0.f, 0.f};
    mbar_wait(&bar[0], 0);
    const u16* sQw = sQ + wg * 64 * 64;  // this warpgroup's 64 rows of each column block

    for (int it = 0; it < nit; ++it) {
        const int st = it & 1;
        if (threadIdx.x == 0 && it + 1 < nit) {  // the other stage was released by the barrier ending it - 1
            mbar_expect_tx(&bar[1 + (st ^ 1)], 2 * TILE_BYTES);
            tma_tile<NB, HOP_BN>(sK + (st ^ 1) * TL, tk, &bar[1 + (st ^ 1)], h, s0 + (it + 1) * HOP_BN);
            tma_tile<NB, HOP_BN>(sV + (st ^ 1) * TL, tv, &bar[1 + (st ^ 1)], h, s0 + (it + 1) * HOP_BN);
        }
        mbar_wait(&bar[1 + st], (it >> 1) & 1);
        const u16* k = sK + st * TL;
        const u16* v = sV + st * TL;

        float s[HOP_BN / 2];
        hop_fwd_scores<D>(s, sQw, k);
        wgmma_wait<0>();
        reg_fence(s);

        float corr[2];
        hop_fwd_softmax(s, m, l, corr, s0 + it * HOP_BN, s1, t, scale_log2);
        hop_fwd_rescale<D>(o, corr);
        u32 pa[HOP_BN / 16][4];  // live until the wait: wgmma reads its A registers asynchronously
        hop_fwd_p_to_a(pa, s);
        hop_fwd_pv<D>(o, pa, v);
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence_u(pa);
        __syncthreads();  // every warpgroup is done with this stage: it may be refilled
    }

    u32 dg[2][D / 8];
    hop_fwd_delta_load<D>(dg, dl, wg * 64 + wq * 16 + g, t, row0, min(HOP_BM, s1 - row0), h);
    hop_fwd_epilogue<D, OT>(o, m, l, wg * 64 + wq * 16 + g, t, row0, min(HOP_BM, s1 - row0), h, O, ldo, lse, T,
                            scale_log2, lse_scale, dl, dg);
}
