// sm_90a forward, bf16, warp-specialised: forward.cuh's products on two consumer warpgroups and a producer
// warpgroup (384 threads), with the scores of the next K/V tile computed beside the softmax of the current one.
//
// forward.cuh runs S = Q K^T, waits, does the softmax, runs O += P V, waits, and the whole block meets at a
// barrier before the next tile, so the tensor cores idle through every softmax. Here, per consumer warpgroup
// (64 query rows) and K/V tile j >= 1:
//   issue S_j = Q K_j^T; issue O += P_{j-1} V_{j-1} (P_{j-1} already in registers as bf16 A fragments);
//   wait for S_j alone (wgmma groups complete in order), softmax of S_j (running max, corr_j, P_j, l) while
//   the P V product runs; wait for it, release tile j-1's stage, O *= corr_j.
// The arithmetic is forward.cuh's in the same order (O = O * corr_j + P_j V_j, tile by tile): bit-identical O and
// lse2. The warpgroups no longer meet per tile: each releases a stage on its own (mbarrier of 256 arrivals).
// Warp 8 issues the copies (Q once, K and V into S = 3 stages) and gives its registers to the consumers
// (setmaxnreg 40 / 232).
// Barriers: [0] Q full; [1 + s] K/V stage s full; [1 + S + s] stage s empty (256: every consumer thread once its
// P V product of the stage's tile is done).
// The two consumer warpgroups take turns to issue their products (named barriers 1 and 2, 256 threads:
// warpgroup w waits at 1 + w before issuing, then lets the other go at 2 - w), so one warpgroup's softmax runs
// while the other's products hold the tensor cores: 5-8% faster than both issuing at once (1 x 16384, 28 heads,
// D 128: 9.14 ms against 9.84; 1 x 9216, D 80: 1.73 against 1.83), the same bits.
#pragma once
#include "attention/sm90/forward.cuh"

// Lab switch: CUPY_ROPE_FWD_TURNS=0 builds the specialised forwards with both warpgroups issuing at once (no turn
// barriers at all), to measure the turns where units are short (two tiles: little softmax to hide). Unset: 1.
#ifndef CUPY_ROPE_FWD_TURNS
#define CUPY_ROPE_FWD_TURNS 1
#endif

// warpgroup wg's turn to issue products (wg 1 goes after wg 0, wg 0 after wg 1's previous turn)
__device__ __forceinline__ void hop_fwd_turn_wait(int wg) {
    if (CUPY_ROPE_FWD_TURNS) named_barrier(1 + wg, 256);
}
// wg's products are issued: the other warpgroup's turn
__device__ __forceinline__ void hop_fwd_turn_pass(int wg) {
    if (CUPY_ROPE_FWD_TURNS) named_arrive(2 - wg, 256);
}
// warpgroup 0 takes the first turn
__device__ __forceinline__ void hop_fwd_turn_first(int wg) {
    if (CUPY_ROPE_FWD_TURNS && wg == 1) named_arrive(1, 256);
}
// warpgroup 0 meets warpgroup 1's last pass (each barrier balanced)
__device__ __forceinline__ void hop_fwd_turn_last(int wg) {
    if (CUPY_ROPE_FWD_TURNS && wg == 0) named_barrier(1, 256);
}

// The persistent forward's producer copies a unit's first K/V tile before it waits to copy the unit's Q (the previous
// unit's last scores in): that tile's stage was freed by the previous unit's tile before last or earlier (three
// stages), so its copy starts about a step earlier than behind Q. CUPY_ROPE_FWD_KV_FIRST=0 builds the order before
// (Q, then the unit's K/V tiles), to measure it; the same bits either way. Unset: 1.
#ifndef CUPY_ROPE_FWD_KV_FIRST
#define CUPY_ROPE_FWD_KV_FIRST 1
#endif

// K/V stages of the specialised forward: a stage is free only once the P V product of its tile is done, in the
// next tile's step, so with two the copy of tile j + 2 started less than a step before its scores were issued,
// and the consumers waited for it. Three (224 KB at D = 128): forward 1.3-1.75x as fast, the same bits
// (1 x 16384, 28 heads, D 128: 8.92 -> 6.76 ms; 1 x 9216, D 80: 1.58 -> 0.90; the mixed D 64 case 0.516 ->
// 0.375).
#ifndef CUPY_ROPE_FWD_STAGES
#define CUPY_ROPE_FWD_STAGES 3  // hopper.FWD_STAGES
#endif
#define HOP_FWD_STAGES CUPY_ROPE_FWD_STAGES

// The specialised forwards' barriers: [0] Q full, [1 + s] K/V stage s full, [1 + S + s] stage s empty (256
// arrivals), with QEMPTY [1 + 2 S] Q empty (256: the persistent kernel's); then the block meets once.
template <int S, bool QEMPTY = false> __device__ __forceinline__ void hop_fwd_ws_bars(u64* bar) {
    if (threadIdx.x == 0) {
        mbar_init(&bar[0], 1);
#pragma unroll
        for (int i = 0; i < S; ++i) {
            mbar_init(&bar[1 + i], 1);
            mbar_init(&bar[1 + S + i], 256);
        }
        if (QEMPTY) mbar_init(&bar[1 + 2 * S], 256);
        mbar_init_fence();
    }
    __syncthreads();
}

// The consumer warpgroups' steps shared by hop_fwd_ws, hop_fwd_ws_kv and hop_fwd_ws_persist.
// Start: O, the running max and sum; warpgroup 0 takes the first turn; Q is in.
template <int D>
__device__ __forceinline__ void hop_fwd_ws_begin(float (&o)[D / 2], float (&m)[2], float (&l)[2], int wg,
                                                 u64* q_full) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = HOP_NEG_INF;
    l[0] = l[1] = 0.f;
    hop_fwd_turn_first(wg);
    mbar_wait(q_full, 0);
}

// Tile 0 (K in k, filled on `full`, that fill's parity `parity`): scores and softmax only, P_0 as A fragments (its
// P V product is issued beside tile 1's scores). k_read (or nullptr): arrived on once the scores are in, where
// `arrive`.
template <int D, int KN>
__device__ __forceinline__ void hop_fwd_ws_first(float (&s)[KN / 2], float (&o)[D / 2], float (&m)[2], float (&l)[2],
                                                 float (&corr)[2], u32 (&pa)[KN / 16][4], const u16* sQw,
                                                 const u16* k, u64* full, u64* k_read, int wg, int s0, int s1, int t,
                                                 float scale_log2, u32 parity = 0, bool arrive = true) {
    mbar_wait(full, parity);
    hop_fwd_turn_wait(wg);
    hop_fwd_scores<D, KN>(s, sQw, k);
    hop_fwd_turn_pass(wg);
    wgmma_wait<0>();
    reg_fence(s);
    if (k_read && arrive) mbar_arrive(k_read);
    hop_fwd_softmax(s, m, l, corr, s0, s1, t, scale_log2);
    hop_fwd_rescale<D>(o, corr);
    hop_fwd_p_to_a(pa, s);
}

// Tile j >= 1 of the keys from s0, in K/V stage st (its fill's parity ph; tile j - 1 in stage prev, released once its
// P V product is done; the barriers as hop_fwd_ws_bars): S_j issued beside O += P_{j-1} V_{j-1}, S_j's softmax
// while that product runs, then O rescaled and P_j made A fragments. scores_done (or nullptr): arrived on once
// S_j is in, where `last`.
template <int D, int S>
__device__ __forceinline__ void hop_fwd_ws_step(float (&s)[HOP_BN / 2], float (&o)[D / 2], float (&m)[2],
                                                float (&l)[2], float (&corr)[2], u32 (&pa)[HOP_BN / 16][4],
                                                const u16* sQw, const u16* sK, const u16* sV, u64* bar, int st,
                                                int prev, int ph, u64* scores_done, bool last, int wg, int s0,
                                                int j, int s1, int t, float scale_log2) {
    constexpr int TL = HopFwdSmem<D, S>::TILE;
    mbar_wait(&bar[1 + st], ph);
    hop_fwd_turn_wait(wg);
    hop_fwd_scores<D>(s, sQw, sK + st * TL);       // group 1: S_j
    hop_fwd_pv<D>(o, pa, sV + prev * TL);          // group 2: O += P_{j-1} V_{j-1}
    hop_fwd_turn_pass(wg);
    wgmma_wait<1>();                               // S_j is in (groups complete in order)
    reg_fence(s);
    if (scores_done && last) mbar_arrive(scores_done);
    hop_fwd_softmax(s, m, l, corr, s0 + j * HOP_BN, s1, t, scale_log2);
    wgmma_wait<0>();
    reg_fence(o);
    reg_fence_u(pa);
    mbar_arrive(&bar[1 + S + prev]);  // tile j - 1 is done with its stage
    hop_fwd_rescale<D>(o, corr);
    hop_fwd_p_to_a(pa, s);
}

// The last tile's P V product (V in v) in warpgroup wg's turn, with dO for delta (dg) loaded while it runs.
template <int D, int KK>
__device__ __forceinline__ void hop_fwd_ws_last_pv(float (&o)[D / 2], u32 (&pa)[KK][4], const u16* v,
                                                   u32 (&dg)[2][D / 8], const HopDelta& dl, int wg, int r0, int t,
                                                   int row0, int nq, int h) {
    hop_fwd_turn_wait(wg);
    hop_fwd_pv<D>(o, pa, v);
    hop_fwd_turn_pass(wg);
    hop_fwd_delta_load<D>(dg, dl, r0, t, row0, nq, h);
    wgmma_wait<0>();
    reg_fence(o);
    reg_fence_u(pa);
}

// The last tile's P V product (V in v; dO for delta loaded beside it), then the block epilogue. last_empty (or nullptr): the stage of v, released
// once the product is done; TURN: warpgroup 0 meets warpgroup 1's last pass (each barrier balanced: not in the
// persistent kernel, whose turns run on into the next unit).
template <int D, class OT, int KK, bool TURN = true>
__device__ __forceinline__ void hop_fwd_ws_end(float (&o)[D / 2], u32 (&pa)[KK][4], const u16* v, float (&m)[2],
                                               float (&l)[2], int wg, int wq, int g, int t, int row0, int s1, int h,
                                               typename OT::T* __restrict__ O, i64 ldo, float* __restrict__ lse,
                                               int T, float scale_log2, float lse_scale, const HopDelta& dl,
                                               u64* last_empty = nullptr) {
    const int r0 = wg * 64 + wq * 16 + g, nq = min(HOP_BM, s1 - row0);
    u32 dg[2][D / 8];
    hop_fwd_ws_last_pv<D>(o, pa, v, dg, dl, wg, r0, t, row0, nq, h);
    if (last_empty) mbar_arrive(last_empty);
    if (TURN) hop_fwd_turn_last(wg);
    hop_fwd_epilogue<D, OT>(o, m, l, r0, t, row0, nq, h, O, ldo, lse, T, scale_log2, lse_scale, dl, dg);
}

// hop_fwd_ws_end for the persistent forward that stores O through the copy engine (hop_fwd_bf16_ws_persist_bulk,
// Plan.fwd_o_bulk; `to`: O's tensor map, boxes of 64 columns x 64 rows): a warpgroup whose 64 rows are all in the
// sequence writes its O into its rows of the last tile's K buffer (`stage`, free once every consumer's last scores
// are in: q_empty's phase q_parity), and its thread 0 stores them, one box per column block, and arrives on
// last_empty only once the engine has read them, at the next unit's start (`pending`; the warps run on meanwhile).
// A warpgroup whose rows run past the sequence stores from registers (a box would write the next sequence's rows).
template <int D, class OT>
__device__ __forceinline__ void hop_fwd_ws_end_bulk(float (&o)[D / 2], u32 (&pa)[HOP_BN / 16][4], const u16* v,
                                                    u16* stage, float (&m)[2], float (&l)[2], int wg, int wq, int g,
                                                    int t, int row0, int s1, int h, typename OT::T* __restrict__ O,
                                                    i64 ldo, float* __restrict__ lse, int T, float scale_log2,
                                                    float lse_scale, const HopDelta& dl, u64* last_empty,
                                                    u64* q_empty, u32 q_parity, const TmaDesc* to,
                                                    u64*& pending) {
    constexpr int NB = HopDims<D>::NB;
    const int r0 = wg * 64 + wq * 16 + g, nq = min(HOP_BM, s1 - row0);
    u32 dg[2][D / 8];
    hop_fwd_ws_last_pv<D>(o, pa, v, dg, dl, wg, r0, t, row0, nq, h);
    if (wg * 64 + 64 > nq) {
        mbar_arrive(last_empty);
        hop_fwd_epilogue<D, OT>(o, m, l, r0, t, row0, nq, h, O, ldo, lse, T, scale_log2, lse_scale, dl, dg);
        return;
    }
    mbar_wait(q_empty, q_parity);  // no product reads the K buffer any more
    hop_fwd_epilogue<D, OT, true>(o, m, l, r0, t, row0, nq, h, O, ldo, lse, T, scale_log2, lse_scale, dl, dg, stage);
    fence_async_smem();
    named_barrier(3 + wg, 128);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
        for (int b = 0; b < NB; ++b) tma_store_3d(to, stage + b * HOP_BN * 64 + wg * 64 * 64, 64 * b, h, row0 + wg * 64);
        bulk_commit();
        pending = last_empty;
    } else {
        mbar_arrive(last_empty);
    }
}

template <int D, class OT>
__device__ __forceinline__ void hop_fwd_ws(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                           const int* __restrict__ tiles, typename OT::T* __restrict__ O, i64 ldo,
                                           float* __restrict__ lse, int T, float scale_log2, float lse_scale,
                                           const HopDelta& dl) {
    constexpr int S = HOP_FWD_STAGES, NB = HopDims<D>::NB, TL = HopFwdSmem<D, S>::TILE;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const auto [sQ, sK, sV, bar, h, row0, s0, s1, nit] = hop_fwd_block<D, S>(smem_raw, tiles);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 TILE_BYTES = TL * 2;

    hop_fwd_ws_bars<S>(bar);

    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 256) {
            mbar_expect_tx(&bar[0], TILE_BYTES);
            tma_tile<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
            for (int it = 0, st = 0, ph = 0; it < nit; ++it) {
                if (it >= S) mbar_wait(&bar[1 + S + st], ph ^ 1);  // tile it - S is done with the stage
                mbar_expect_tx(&bar[1 + st], 2 * TILE_BYTES);
                tma_tile<NB, HOP_BN>(sK + st * TL, tk, &bar[1 + st], h, s0 + it * HOP_BN);
                tma_tile<NB, HOP_BN>(sV + st * TL, tv, &bar[1 + st], h, s0 + it * HOP_BN);
                if (++st == S) st = 0, ph ^= 1;
            }
        }
        return;  // the consumers meet no block-wide barrier after this
    }
    setmaxnreg_inc<232>();

    float o[D / 2], m[2], l[2];
    const u16* sQw = sQ + wg * 64 * 64;  // this warpgroup's 64 rows of each column block
    hop_fwd_ws_begin<D>(o, m, l, wg, &bar[0]);
    float s[HOP_BN / 2];  // S_j, then P_j
    float corr[2];
    u32 pa[HOP_BN / 16][4];  // P_{j-1} as A fragments, made as soon as P_{j-1} is: live until its product is done
    hop_fwd_ws_first<D, HOP_BN>(s, o, m, l, corr, pa, sQw, sK, &bar[1], nullptr, wg, s0, s1, t, scale_log2);

    int prev = 0;  // the stage of tile it - 1
    for (int it = 1, st = 1, ph = 0; it < nit; ++it) {  // tile it's stage st, its fill's phase ph
        hop_fwd_ws_step<D, S>(s, o, m, l, corr, pa, sQw, sK, sV, bar, st, prev, ph, nullptr, false, wg, s0, it, s1,
                              t, scale_log2);
        prev = st;
        if (++st == S) st = 0, ph ^= 1;
    }
    hop_fwd_ws_end<D, OT>(o, pa, sV + prev * TL, m, l, wg, wq, g, t, row0, s1, h, O, ldo, lse, T, scale_log2,
                          lse_scale, dl);
}

// The k192 forward (D = 128, long sequences): hop_fwd_ws over K/V tiles of KN = 192 keys: 50% more products per
// tile against the same per-tile costs (the waits, the turn, the row max and sum shuffles, the rescale); S and
// P take 96 + 48 registers beside O's 64, so the consumers hold 240 (setmaxnreg 240 / 24: at 232 ptxas spilled).
// Two stages of 192-row K and V fill the shared memory (224 KB), so K and V get barriers of their own: a K stage is free once its scores are in (in the step of its
// tile), a V stage once its P V product is (a step later), so each copy starts about two steps before its use,
// as the three shared stages of hop_fwd_ws allow. Barriers: [0] Q full; [1 + s] K stage s full; [3 + s] V stage
// s full; [5 + s] K stage s empty (256); [7 + s] V stage s empty (256). The same steps as hop_fwd_ws; the
// online softmax runs over other tiles, so O and lse2 are as close to the float64 values, in other bits.
template <int D, class OT, int KN>
__device__ __forceinline__ void hop_fwd_ws_kv(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                              const int* __restrict__ tiles, typename OT::T* __restrict__ O,
                                              i64 ldo, float* __restrict__ lse, int T, float scale_log2,
                                              float lse_scale, const HopDelta& dl) {
    constexpr int NB = HopDims<D>::NB, TL = HopFwdSmem<D, 2, KN>::TILE;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const auto [sQ, sK, sV, bar, h, row0, s0, s1, nit] = hop_fwd_block<D, 2, KN>(smem_raw, tiles);
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 Q_BYTES = HopFwdSmem<D, 2, KN>::QTILE * 2, TILE_BYTES = TL * 2;

    if (threadIdx.x == 0) {
        mbar_init(&bar[0], 1);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mbar_init(&bar[1 + i], 1);
            mbar_init(&bar[3 + i], 1);
            mbar_init(&bar[5 + i], 256);
            mbar_init(&bar[7 + i], 256);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 256) {
            mbar_expect_tx(&bar[0], Q_BYTES);
            tma_tile<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
            for (int it = 0; it < nit; ++it) {
                const int st = it & 1, ph = (it >> 1) & 1;
                if (it >= 2) mbar_wait(&bar[5 + st], ph ^ 1);  // tile it - 2's scores are in
                mbar_expect_tx(&bar[1 + st], TILE_BYTES);
                tma_tile<NB, KN>(sK + st * TL, tk, &bar[1 + st], h, s0 + it * KN);
                if (it >= 2) mbar_wait(&bar[7 + st], ph ^ 1);  // tile it - 2's P V product is done
                mbar_expect_tx(&bar[3 + st], TILE_BYTES);
                tma_tile<NB, KN>(sV + st * TL, tv, &bar[3 + st], h, s0 + it * KN);
            }
        }
        return;  // the consumers meet no block-wide barrier after this
    }
    setmaxnreg_inc<240>();

    float o[D / 2], m[2], l[2];
    const u16* sQw = sQ + wg * 64 * 64;  // this warpgroup's 64 rows of each column block
    hop_fwd_ws_begin<D>(o, m, l, wg, &bar[0]);
    float s[KN / 2];  // S_j, then P_j
    float corr[2];
    u32 pa[KN / 16][4];  // P_{j-1} as A fragments: live until its product is done
    // K stage 0 is free once tile 0's scores are in
    hop_fwd_ws_first<D, KN>(s, o, m, l, corr, pa, sQw, sK, &bar[1], &bar[5], wg, s0, s1, t, scale_log2);

    for (int it = 1; it < nit; ++it) {
        const int st = it & 1, prev = st ^ 1;
        mbar_wait(&bar[1 + st], (it >> 1) & 1);         // K_it
        mbar_wait(&bar[3 + prev], ((it - 1) >> 1) & 1);  // V_{it-1}
        hop_fwd_turn_wait(wg);
        hop_fwd_scores<D, KN>(s, sQw, sK + st * TL);    // group 1: S_it
        hop_fwd_pv<D>(o, pa, sV + prev * TL);           // group 2: O += P_{it-1} V_{it-1}
        hop_fwd_turn_pass(wg);
        wgmma_wait<1>();                                // S_it is in (groups complete in order)
        reg_fence(s);
        mbar_arrive(&bar[5 + st]);  // K stage st is read
        hop_fwd_softmax(s, m, l, corr, s0 + it * KN, s1, t, scale_log2);
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence_u(pa);
        mbar_arrive(&bar[7 + prev]);  // V stage prev is read
        hop_fwd_rescale<D>(o, corr);
        hop_fwd_p_to_a(pa, s);
    }
    const int last = (nit - 1) & 1;
    mbar_wait(&bar[3 + last], ((nit - 1) >> 1) & 1);
    hop_fwd_ws_end<D, OT>(o, pa, sV + last * TL, m, l, wg, wq, g, t, row0, s1, h, O, ldo, lse, T, scale_log2,
                          lse_scale, dl);
}

// The persistent form of hop_fwd_ws, for short sequences: a grid of one block per SM walks the units (head, query tile)
// u = blockIdx.x, + gridDim.x, ... (tile-fastest, as hop_fwd_ws's grid), the same products per unit in the same order
// (the same bits). A block of hop_fwd_ws on a 256-key sequence streams two K/V tiles, so its prologue (the Q, K and V
// copies' latency) and epilogue (O from registers) are not hidden behind products and the SM idles through them between
// blocks. Here the producer runs ahead across units: it loads the next unit's Q as soon as every consumer thread has
// its last scores of the current one (barrier [1 + 2 S], 256 arrivals), and the K/V stages are one ring over all the
// block's tiles (the last tile of a unit releases its stage too); a unit's first K/V tile goes ahead of its Q
// (CUPY_ROPE_FWD_KV_FIRST, above). The warpgroups' turns pass on from unit to unit (warpgroup 1's last pass of a unit
// is warpgroup 0's first turn of the next), so the turn barriers are met once at the start and once at the end of the
// block, not per unit.
template <int D, class OT, bool BULK = false>
__device__ __forceinline__ void hop_fwd_ws_persist(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                                   const int* __restrict__ tiles, typename OT::T* __restrict__ O,
                                                   i64 ldo, float* __restrict__ lse, int T, float scale_log2,
                                                   float lse_scale, int ntiles, int units, const HopDelta& dl,
                                                   const TmaDesc* to = nullptr) {
    constexpr int S = HOP_FWD_STAGES, NB = HopDims<D>::NB, TL = HopFwdSmem<D, S>::TILE;
    static_assert(8 * (2 + 2 * S) <= HopFwdSmem<D, S>::BARS, "the Q-empty barrier fits beside the others");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sK = sQ + HopFwdSmem<D, S>::QTILE;
    u16* sV = sK + S * TL;
    u64* bar = reinterpret_cast<u64*>(sV + S * TL);  // [0] Q full, [1 + s] full, [1 + S + s] empty, [1 + 2 S] Q empty
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
    constexpr u32 TILE_BYTES = TL * 2;

    hop_fwd_ws_bars<S, true>(bar);

    if (wg == 2) {  // ---------------------------------------------------------------- producer
        setmaxnreg_dec<40>();
        if (threadIdx.x == 256) {
            int c = 0;  // K/V tiles issued by this block: the ring position
            for (int u = blockIdx.x, n = 0; u < units; u += gridDim.x, ++n) {
                const int tile = u % ntiles, h = u / ntiles;
                const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
                const int nit = (s1 - s0 + HOP_BN - 1) / HOP_BN;
                auto kv = [&](int it) {  // K/V tile it of the unit, ring position c
                    const int st = c % S, ph = (c / S) & 1;
                    if (c >= S) mbar_wait(&bar[1 + S + st], ph ^ 1);  // tile c - S is done with the stage
                    mbar_expect_tx(&bar[1 + st], 2 * TILE_BYTES);
                    tma_tile<NB, HOP_BN>(sK + st * TL, tk, &bar[1 + st], h, s0 + it * HOP_BN);
                    tma_tile<NB, HOP_BN>(sV + st * TL, tv, &bar[1 + st], h, s0 + it * HOP_BN);
                    ++c;
                };
                int it = 0;
                if (CUPY_ROPE_FWD_KV_FIRST && nit > 0) kv(it++);  // before Q (above)
                if (n > 0) mbar_wait(&bar[1 + 2 * S], (n - 1) & 1);  // the previous unit's scores are in
                mbar_expect_tx(&bar[0], TILE_BYTES);
                tma_tile<NB, HOP_BM>(sQ, tq, &bar[0], h, row0);
                for (; it < nit; ++it) kv(it);
            }
        }
        return;  // the consumers meet no block-wide barrier after this
    }
    setmaxnreg_inc<232>();

    const u16* sQw = sQ + wg * 64 * 64;  // this warpgroup's 64 rows of each column block
    hop_fwd_turn_first(wg);  // the block's first turn; then turns pass on from unit to unit
    int c = 0;  // K/V tiles consumed: the ring position, as the producer's
    [[maybe_unused]] u64* pending = nullptr;  // BULK: the stage whose O the copy engine is storing
    auto release = [&] {
        if constexpr (BULK) {
            if (pending != nullptr) {
                bulk_wait_read<0>();
                mbar_arrive(pending);
                pending = nullptr;
            }
        }
    };
    for (int u = blockIdx.x, n = 0; u < units; u += gridDim.x, ++n) {
        const int tile = u % ntiles, h = u / ntiles;
        const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
        const int nit = (s1 - s0 + HOP_BN - 1) / HOP_BN;
        mbar_wait(&bar[0], n & 1);
        release();
        u64* q_empty = &bar[1 + 2 * S];  // arrived on once the unit's last scores are in: Q may be refilled
        if (nit <= 0) {  // no keys (not made by the tile table): nothing to write, Q handed back
            mbar_arrive(q_empty);
            continue;
        }
        float o[D / 2], m[2] = {HOP_NEG_INF, HOP_NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        float s[HOP_BN / 2];  // S_j, then P_j
        float corr[2];
        u32 pa[HOP_BN / 16][4];  // P_{j-1} as A fragments: live until its product is done
        int prev = c % S;        // the stage of the tile before
        hop_fwd_ws_first<D, HOP_BN>(s, o, m, l, corr, pa, sQw, sK + prev * TL, &bar[1 + prev], q_empty, wg, s0, s1,
                                    t, scale_log2, (c / S) & 1, nit == 1);
        ++c;
        for (int it = 1; it < nit; ++it, ++c) {
            const int st = c % S;
            hop_fwd_ws_step<D, S>(s, o, m, l, corr, pa, sQw, sK, sV, bar, st, prev, (c / S) & 1, q_empty,
                                  it == nit - 1, wg, s0, it, s1, t, scale_log2);
            prev = st;
        }
        if constexpr (BULK)
            hop_fwd_ws_end_bulk<D, OT>(o, pa, sV + prev * TL, sK + prev * TL, m, l, wg, wq, g, t, row0, s1, h, O, ldo,
                                       lse, T, scale_log2, lse_scale, dl, &bar[1 + S + prev], q_empty, n & 1, to,
                                       pending);
        else
            hop_fwd_ws_end<D, OT, HOP_BN / 16, false>(o, pa, sV + prev * TL, m, l, wg, wq, g, t, row0, s1, h, O, ldo,
                                                      lse, T, scale_log2, lse_scale, dl, &bar[1 + S + prev]);
    }
    release();
    if constexpr (BULK)
        if ((threadIdx.x & 127) == 0) bulk_wait<0>();  // O written before the block ends
    hop_fwd_turn_last(wg);
}
