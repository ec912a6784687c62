// sm_90a forward, tf32: the bf16 forward's plan (forward.cuh) with fp32 tiles and the tf32 wgmma.
//
// Block (tile x, head y): 128 query rows, two warpgroups of 64. K [64][D] and V^T [D][64] (from the permuted
// transposed copy, tf32.cuh) stream in 64-key tiles, double-buffered. The key tiles start at the sequence start
// rounded down to a multiple of 8 (the permuted groups are aligned); keys outside the sequence are masked.
//   S = Q K^T      wgmma m64n64k8, A and B from shared memory (K-major)
//   O += P V       wgmma m64nDk8, A = P from registers (permuted order), B = V^T tile
// Shared memory at D = 128: Q 64 KB, K 2 x 32 KB, V^T 2 x 32 KB.
#pragma once
#include "attention/sm90/forward.cuh"
#include "attention/sm90/tf32.cuh"

#define HOP32_BN 64  // keys per streamed tile

template <int D> struct Hop32Fwd {
    static constexpr int NB = (D + 31) / 32;       // 32-column blocks of a Q or K row
    static constexpr int QT = HOP_BM * 32 * NB;    // floats of the Q tile
    static constexpr int KT = HOP32_BN * 32 * NB;  // of a K tile
    static constexpr int VT = (HOP32_BN / 32) * D * 32;  // of a V^T tile
    static constexpr int BYTES = (QT + 2 * KT + 2 * VT) * 4 + 64;
    static_assert(D % 8 == 0, "head dims of the tf32 path are multiples of 8");
};

// The tf32 forwards' end: each row's sum over its quad, then O = o / l (fp32, row stride ldo) and lse2 * lse_scale for
// the rows of the tile inside its sequence.
template <int D>
__device__ __forceinline__ void hop32_fwd_epilogue(const float (&o)[D / 2], const float (&m)[2], float (&l)[2], int wg,
                                                   int wq, int g, int t, int row0, int s1, int h,
                                                   float* __restrict__ O, i64 ldo, float* __restrict__ lse, int T,
                                                   float lse_scale) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const int nq = min(HOP_BM, s1 - row0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wg * 64 + wq * 16 + g + 8 * r;
        if (row >= nq) continue;
        const float inv = 1.f / l[r];
        const i64 tok = row0 + row;
        float* orow = O + tok * ldo + (i64)h * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<float2*>(orow + 8 * j + 2 * t) = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (t == 0) lse[(i64)h * T + tok] = __fmul_rn(m[r] + __log2f(l[r]), lse_scale);
    }
}

template <int D>
__device__ __forceinline__ void hop_fwd_tf32(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tvt,
                                             const int* __restrict__ tiles, float* __restrict__ O, i64 ldo,
                                             float* __restrict__ lse, int T, float scale_log2, float lse_scale) {
    typedef Hop32Fwd<D> SM;
    constexpr int NB = SM::NB;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* sQ = reinterpret_cast<float*>(smem_raw);
    float* sK = sQ + SM::QT;      // [2][KT]
    float* sV = sK + 2 * SM::KT;  // [2][VT]
    u64* bar = reinterpret_cast<u64*>(sV + 2 * SM::VT);  // [0] Q, [1..2] K/V stages

    const int h = blockIdx.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int s0a = s0 & ~7, nit = (s1 - s0a + HOP32_BN - 1) / HOP32_BN;
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 KV_BYTES = (SM::KT + SM::VT) * 4;

    mbar_setup<3>(bar);
    if (threadIdx.x == 0) {
        mbar_expect_tx(&bar[0], SM::QT * 4);
        tma_rows32<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
        mbar_expect_tx(&bar[1], KV_BYTES);
        tma_rows32<NB, HOP32_BN>(sK, tk, &bar[1], h, s0a);
        tma_cols32<HOP32_BN / 32, D>(sV, tvt, &bar[1], h, s0a);
    }
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {HOP_NEG_INF, HOP_NEG_INF}, l[2] = {0.f, 0.f};
    mbar_wait(&bar[0], 0);
    const float* sQw = sQ + wg * 64 * 32;  // this warpgroup's 64 rows of each column block

    for (int it = 0; it < nit; ++it) {
        const int st = it & 1, kv0 = s0a + it * HOP32_BN;
        if (threadIdx.x == 0 && it + 1 < nit) {  // the other stage was released by the barrier ending it - 1
            mbar_expect_tx(&bar[1 + (st ^ 1)], KV_BYTES);
            tma_rows32<NB, HOP32_BN>(sK + (st ^ 1) * SM::KT, tk, &bar[1 + (st ^ 1)], h, kv0 + HOP32_BN);
            tma_cols32<HOP32_BN / 32, D>(sV + (st ^ 1) * SM::VT, tvt, &bar[1 + (st ^ 1)], h, kv0 + HOP32_BN);
        }
        mbar_wait(&bar[1 + st], (it >> 1) & 1);
        const float* k = sK + st * SM::KT;
        const float* v = sV + st * SM::VT;

        float s[HOP32_BN / 2];
        const u64 dq0 = smem_desc(sQw, 0), dk0 = smem_desc(k, 0), dv0 = smem_desc(v, 0);
        __syncwarp();  // wgmma is .aligned: the lanes leave the barrier wait above at different times
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 8; ++ks) {  // column block, element offset in the 128-byte row
            const int b = ks >> 2, off = (ks & 3) * 8;
            wgmma_ss_tf32<HOP32_BN>(s, dq0, dk0, ks > 0, u16b(b * HOP_BM * 32 + off), u16b(b * HOP32_BN * 32 + off));
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(s);

        float corr[2];  // the first tile holds the sequence start: m is finite after it
        hop_fwd_softmax_t<HOP32_BN, true>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
        hop_fwd_rescale<D>(o, corr);

        u32 pa[HOP32_BN / 8][4];  // live until the wait: wgmma reads its A registers asynchronously
#pragma unroll
        for (int kk = 0; kk < HOP32_BN / 8; ++kk) acc_to_a_tf32(pa[kk], s, kk);
        wgmma_fence();
        hop32_rs_tokens<D>(o, pa, dv0);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence_u(pa);
        __syncthreads();  // every warpgroup is done with this stage: it may be refilled
    }
    hop32_fwd_epilogue<D>(o, m, l, wg, wq, g, t, row0, s1, h, O, ldo, lse, T, lse_scale);
}

// Warp-specialised form (hop_fwd_tf32_ws, 384 threads), the same products in the same order (the same bits).
// hop_fwd_tf32 above copies tile j + 1 into the stage that tile j - 1 freed at a block-wide barrier, waits for each
// product in turn and holds Q in shared memory for every S product. Here:
//   - each consumer warpgroup reads its 64 rows of Q once, as wgmma A fragments (S = Q K^T from registers: RS),
//     and Q's 64 KB become a third K/V stage (K [64][D] and V^T [D][64] take 32 + 32 KB at D = 128, as Q does);
//   - warp 8 issues the copies, each once its stage is free (an mbarrier of the 256 consumer threads, arrived on
//     once a tile's P V product is done), and gives its registers to the consumers (setmaxnreg 40 / 232);
//   - per tile j >= 1 a warpgroup issues S_j, then O += P_{j-1} V_{j-1}, waits for S_j alone and computes its
//     softmax while the P V product runs, then waits for that, releases tile j - 1's stage and rescales O: the
//     operations of hop_fwd_tf32 in its order (O * corr_{j-1} + P_{j-1} V_{j-1}, then * corr_j).
// Barriers: [0] Q full; [1 + s] K/V stage s full (stage 2 is Q's region); [4 + s] stage s empty (256); [7] Q read
// (256 arrivals: stage 2 may be filled for the first time).
//
// TAIL (hop_fwd_tf32_ws_tail): the last wave filled. A block holds an SM alone and the units (query tile, head)
// of a long sequence take about the same time W, so NH x NT = k x SMs + R units end in a wave of R blocks with the
// other SMs idle. The launch (a 1-D grid of NH NT + R (P - 1) blocks) first runs the first R units (unit u:
// tile u % NT, head u / NT, the unsplit grid's order) as P blocks each, part p walking the key steps
// [p n / P, (p + 1) n / P) of the unit's n, and writing its rows' O_p (normalised by its own sum) and lse2_p to
// opart [R P][128][D] and lpart [R P][128]; then every other unit as the unsplit kernel does. hop32_fwd_combine
// then writes those R units' O and lse from their parts. The host gives P <= n for each split unit.
struct Hop32FwdTail {
    int R, P, NT;
    float* opart;
    float* lpart;
};

template <int D, bool TAIL = false>
__device__ __forceinline__ void hop_fwd_tf32_ws(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tvt,
                                                const int* __restrict__ tiles, float* __restrict__ O, i64 ldo,
                                                float* __restrict__ lse, int T, float scale_log2, float lse_scale,
                                                Hop32FwdTail tail = {}) {
    typedef Hop32Fwd<D> SM;
    constexpr int NB = SM::NB, STAGE = SM::KT + SM::VT;
    static_assert(STAGE <= SM::QT, "a K/V stage fits in Q's region");
    static_assert(STAGE * 4 % 1024 == 0, "stages stay 1024-byte aligned (the 128-byte swizzle)");
    static_assert((SM::QT + 2 * STAGE) * 4 + 8 * 8 <= SM::BYTES, "Q's region, two stages and 8 barriers: BYTES");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    float* sQ = reinterpret_cast<float*>(smem_raw);  // Q, then K/V stage 2
    float* sS = sQ + SM::QT;                          // K/V stages 0 and 1
    u64* bar = reinterpret_cast<u64*>(sS + 2 * STAGE);
    auto stage = [&](int st) { return st == 2 ? sQ : sS + st * STAGE; };  // K at +0, V^T at +KT

    int h = blockIdx.y, tile = blockIdx.x, part = -1, slot = 0;  // part >= 0: part of split unit `slot / P`
    if constexpr (TAIL) {
        const int lin = blockIdx.x, rp = tail.R * tail.P;
        const int u = lin < rp ? lin / tail.P : lin - rp + tail.R;
        if (lin < rp) part = lin - u * tail.P, slot = lin;
        tile = u % tail.NT;
        h = u / tail.NT;
    }
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    int s0a = s0 & ~7, nit = (s1 - s0a + HOP32_BN - 1) / HOP32_BN;
    if constexpr (TAIL) {
        if (part >= 0) {  // key steps [j0, j1) of the unit's nit
            const int j0 = part * nit / tail.P, j1 = (part + 1) * nit / tail.P;
            s0a += j0 * HOP32_BN;
            nit = j1 - j0;
        }
    }
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 KV_BYTES = STAGE * 4;

    if (threadIdx.x == 0) {
        mbar_init(&bar[0], 1);
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            mbar_init(&bar[1 + i], 1);
            mbar_init(&bar[4 + i], 256);
        }
        mbar_init(&bar[7], 256);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 256) {
            mbar_expect_tx(&bar[0], SM::QT * 4);
            tma_rows32<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
            for (int j = 0; j < nit; ++j) {
                const int st = j % 3;
                if (j == 2) mbar_wait(&bar[7], 0);  // every consumer holds its Q fragments
                else if (j >= 3) mbar_wait(&bar[4 + st], ((j / 3) - 1) & 1);  // tile j - 3 is done with it
                float* k = stage(st);
                mbar_expect_tx(&bar[1 + st], KV_BYTES);
                tma_rows32<NB, HOP32_BN>(k, tk, &bar[1 + st], h, s0a + j * HOP32_BN);
                tma_cols32<HOP32_BN / 32, D>(k + SM::KT, tvt, &bar[1 + st], h, s0a + j * HOP32_BN);
            }
        }
        return;  // the consumers meet no block-wide barrier after this
    }
    setmaxnreg_inc<232>();

    u32 qa[D / 8][4];  // this thread's rows of Q as A fragments
    mbar_wait(&bar[0], 0);
    hop32_rows_to_a<D, HOP_BM>(qa, sQ, wg * 64 + wq * 16, g, t);
    mbar_arrive(&bar[7]);

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {HOP_NEG_INF, HOP_NEG_INF}, l[2] = {0.f, 0.f};
    float s[HOP32_BN / 2];
    u32 pa[HOP32_BN / 8][4];  // P_{j-1} as A fragments: live until its product is done
    // S_j = Q K_j^T from the Q fragments, issued and committed (not waited for)
    auto scores = [&](const float* k) {
        const u64 dk0 = smem_desc(k, 0);
        __syncwarp();  // wgmma is .aligned: the lanes leave the barrier wait before at different times
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 8; ++ks) {
            const int b = ks >> 2, off = (ks & 3) * 8;
            wgmma_rs_tf32<HOP32_BN>(s, qa[ks], dk0, ks > 0, u16b(b * HOP32_BN * 32 + off));
        }
        wgmma_commit();
    };
    {  // tile 0
        float corr[2];
        mbar_wait(&bar[1], 0);
        scores(stage(0));
        wgmma_wait<0>();
        reg_fence(s);
        hop_fwd_softmax_t<HOP32_BN, true>(s, m, l, corr, s0a, s0, s1, t, scale_log2);
        hop_fwd_rescale<D>(o, corr);
#pragma unroll
        for (int kk = 0; kk < HOP32_BN / 8; ++kk) acc_to_a_tf32(pa[kk], s, kk);
    }
    for (int j = 1; j < nit; ++j) {
        const int st = j % 3, pst = (j - 1) % 3, kv0 = s0a + j * HOP32_BN;
        const u64 dv0 = smem_desc(stage(pst) + SM::KT, 0);
        mbar_wait(&bar[1 + st], (j / 3) & 1);
        scores(stage(st));
        hop32_rs_tokens<D>(o, pa, dv0);  // O += P_{j-1} V_{j-1}, beside this tile's softmax
        wgmma_commit();
        wgmma_wait<1>();  // S_j (groups complete in order)
        reg_fence(s);
        float corr[2];
        hop_fwd_softmax_t<HOP32_BN, true>(s, m, l, corr, kv0, s0, s1, t, scale_log2);
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence_u(pa);
        mbar_arrive(&bar[4 + pst]);  // tile j - 1's stage is free
        hop_fwd_rescale<D>(o, corr);
#pragma unroll
        for (int kk = 0; kk < HOP32_BN / 8; ++kk) acc_to_a_tf32(pa[kk], s, kk);
    }
    const u64 dvl = smem_desc(stage((nit - 1) % 3) + SM::KT, 0);
    wgmma_fence();
    hop32_rs_tokens<D>(o, pa, dvl);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
    reg_fence_u(pa);
    if (TAIL && part >= 0)  // this part's O_p and lse2_p, rows of the tile inside its sequence
        hop32_fwd_epilogue<D>(o, m, l, wg, wq, g, t, 0, min(HOP_BM, s1 - row0), 0,
                              tail.opart + (i64)slot * HOP_BM * D, D, tail.lpart + (i64)slot * HOP_BM, 0, 1.f);
    else hop32_fwd_epilogue<D>(o, m, l, wg, wq, g, t, row0, s1, h, O, ldo, lse, T, lse_scale);
}

// After hop_fwd_tf32_ws_tail: split unit blockIdx.x's O rows and lse from its P parts, lse2 = log2 sum_p
// exp2(lse2_p) and O = sum_p exp2(lse2_p - lse2) O_p, the parts in order (the same bits every run).
template <int D>
__device__ __forceinline__ void hop32_fwd_combine(const int* __restrict__ tiles, Hop32FwdTail tail,
                                                  float* __restrict__ O, i64 ldo, float* __restrict__ lse, int T,
                                                  float lse_scale) {
    const int u = blockIdx.x, P = tail.P, tile = u % tail.NT, h = u / tail.NT;
    const int row0 = tiles[3 * tile], nq = min(HOP_BM, tiles[3 * tile + 2] - row0);
    const float* lp = tail.lpart + (i64)u * P * HOP_BM;
    const float* op = tail.opart + (i64)u * P * HOP_BM * D;
    for (int i = threadIdx.x; i < nq * (D / 2); i += blockDim.x) {
        const int row = i / (D / 2), c = (i - row * (D / 2)) * 2;
        float mx = HOP_NEG_INF, sum = 0.f;
        for (int p = 0; p < P; ++p) mx = fmaxf(mx, lp[p * HOP_BM + row]);
        for (int p = 0; p < P; ++p) sum += exp2f(lp[p * HOP_BM + row] - mx);
        const float lse2 = mx + __log2f(sum);
        float a = 0.f, b = 0.f;
        for (int p = 0; p < P; ++p) {
            const float w = exp2f(lp[p * HOP_BM + row] - lse2);
            const float2 v = *reinterpret_cast<const float2*>(op + ((i64)p * HOP_BM + row) * D + c);
            a = fmaf(w, v.x, a);
            b = fmaf(w, v.y, b);
        }
        const i64 tok = row0 + row;
        *reinterpret_cast<float2*>(O + tok * ldo + (i64)h * D + c) = make_float2(a, b);
        if (c == 0) lse[(i64)h * T + tok] = __fmul_rn(lse2, lse_scale);
    }
}
