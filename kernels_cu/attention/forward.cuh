// Kernel 1, attn_fwd_dq: one query tile's forward (online softmax) and, in a second pass over the same keys,
// its dQ; attn_fwd (the forward alone) and attn_dq (the second pass alone, on given lse2 and delta) are its
// first and second halves.
#pragma once
#include "attention/config.cuh"
#include "attention/cp_async.cuh"
#include "attention/epilogue.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

// Two consecutive shared-memory operand elements as floats.
template <int MODE> __device__ __forceinline__ float2 smem_pair(const typename Smem<MODE>::T* p) {
    if constexpr (MODE == MODE_BF16) return unpack2<BF16>(*reinterpret_cast<const u32*>(p));
    else return *reinterpret_cast<const float2*>(p);
}

// Row reductions across the lanes that share a row (Score<...>::reduce).
struct FMax { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct FAdd { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };

// Sum over the 4 lanes of a quad (the lanes holding one C-layout row).
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- kernel 1: forward + dQ. Block (x, y) owns query tile tiles[x] (BM rows) of head y. --------------------
// Pass 1 streams K/V tiles (double-buffered cp.async) with an online softmax: O, lse2, delta = rowsum(dO * O).
// Pass 2 streams them again: P = exp2(S2 - lse2), dP = dO V^T, dS = scaling * P * (dP - delta), dQ += dS K.
// Writes O (OT) [T, H], lse2 and delta [NH, T], RoPE-backwarded dq into gqkv[:, 0:H] and its column sums.
// STAGE 0 stops after O and lse2 (the forward op; lse2 where lse is given), STAGE 1 after lse2 and delta (dQ then
// comes from attn_dkdv's partials). STAGE 3 is pass 2 alone: lse2 and delta are read from lse and delta (the
// varlen API's backward, from the forward's o and lse: attention/delta.cuh), and O is neither computed nor
// written.
template <int MODE, int D, class OT, int STAGE>
__device__ void attn_fwd_dq(const typename Smem<MODE>::T* __restrict__ P, const float* __restrict__ cs,
                            const float* __restrict__ sn, const float* __restrict__ dO, const int* __restrict__ tiles,
                            typename OT::T* __restrict__ O, float* __restrict__ Ot, float* __restrict__ lse,
                            float* __restrict__ delta, typename OT::T* __restrict__ gqkv, float* __restrict__ gqkvT,
                            float* __restrict__ part, int T, int ldt, int H, float scale_log2, float scaling) {
    typedef typename Smem<MODE>::T ST;
    typedef Layout<MODE, D> L;
    constexpr int LD = L::LD, DK = L::DK, DN = D / 8;
    constexpr bool BLK = Blocked<MODE, DN>::value;  // fp32: scores, o, dq, dk, dv register-blocked (mma.cuh)
    typedef Score<BLK> SC;
    constexpr int NR = SC::NR;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    ST* sQ = reinterpret_cast<ST*>(smem_raw);
    ST* sdO = sQ + BM * LD;
    ST* sK = sdO + BM * LD;   // [2][BN][LD]
    ST* sV = sK + 2 * BN * LD;  // [2][BN][LD]
    float* scratch = reinterpret_cast<float*>(sV + 2 * BN * LD) + (threadIdx.x >> 5) * L::SCR;

    const int h = blockIdx.y, NH = gridDim.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nq = min(BM, s1 - row0);
    const int nit = (s1 - s0 + BN - 1) / BN;
    const i64 ld3 = 3 * (i64)H;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = threadIdx.x >> 5;
    const ST* Pq = P + (i64)h * T * DK;
    const ST* Pk = P + ((i64)NH + h) * T * DK;
    const ST* Pv = P + ((i64)2 * NH + h) * T * DK;
    const ST* Pdo = P + ((i64)3 * NH + h) * T * DK;
    auto issue_kv = [&](int it) {
        const int kv0 = s0 + it * BN, nk = min(BN, s1 - kv0), b = it & 1;
        copy_tile<MODE, D, BN>(sK + b * BN * LD, Pk + (i64)kv0 * DK, nk);
        copy_tile<MODE, D, BN>(sV + b * BN * LD, Pv + (i64)kv0 * DK, nk);
        cp_async_commit();
    };

    copy_tile<MODE, D, BM>(sQ, Pq + (i64)row0 * DK, nq);
    if (STAGE > 0) copy_tile<MODE, D, BM>(sdO, Pdo + (i64)row0 * DK, nq);
    const ST* sQw = sQ + w * 16 * LD;
    const ST* sdOw = sdO + w * 16 * LD;
    const bool active = !SkipIdle<MODE>::value || w * 16 < nq;  // rows past the tile's end: nothing to compute

    // ---- pass 2: dQ, from the rows' lse2 (lr) and delta (dr) in the score layout
    auto dq_pass = [&](const float (&lr)[NR], const float (&dr)[NR]) {
        float dq[DN][4];
#pragma unroll
        for (int j = 0; j < DN; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
        issue_kv(0);
        for (int it = 0; it < nit; ++it) {
            stream_step(it, nit, issue_kv);
            if (active) {
                const int nk = min(BN, s1 - s0 - it * BN), b = it & 1;
                float s[NTS][4], dp[NTS][4];
#pragma unroll
                for (int j = 0; j < NTS; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
                mm_ss<MODE, NTS, DK, BLK>(s, sQw, LD, sK + b * BN * LD, LD);
                mm_ss<MODE, NTS, DK, BLK>(dp, sdOw, LD, sV + b * BN * LD, LD);
#pragma unroll
                for (int x = 0; x < NTS; ++x)
#pragma unroll
                    for (int y = 0; y < 4; ++y) {
                        const int r = SC::slot(x, y);
                        const float p = SC::col(x, y) < nk ? exp2_ftz(s[x][y] * scale_log2 - lr[r]) : 0.f;
                        s[x][y] = scaling * p * (dp[x][y] - dr[r]);
                    }
                mm_rs<MODE, DN, NTS>(dq, s, sK + b * BN * LD, LD, scratch);
            }
            __syncthreads();
        }
        float* st = reinterpret_cast<float*>(smem_raw);
        stage_acc<D, BLK>(st, dq);
        write_grad_tile<OT, D, true>(st, gqkv + h * D, ld3, cs, sn, row0, nq, part + (i64)tile * ld3 + h * D,
                                     gqkvT ? gqkvT + (i64)h * D * ldt : nullptr, T, ldt);
    };

    if constexpr (STAGE == 3) {  // lse2 and delta as given; rows past the tile's end read nothing (their Q and
        float lr[NR], dr[NR];    // dO rows are zero)
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            int rr = w * 16 + g + 8 * r;
            if constexpr (BLK) rr = w * 16 + SC::row(r);
            lr[r] = rr < nq ? lse[(i64)h * T + row0 + rr] : 0.f;
            dr[r] = rr < nq ? delta[(i64)h * T + row0 + rr] : 0.f;
        }
        dq_pass(lr, dr);
        return;
    }

    // ---- pass 1: online softmax and O
    float o[DN][4];
#pragma unroll
    for (int j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[NR], l[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) { m[r] = NEG_INF; l[r] = 0.f; }
    issue_kv(0);
    for (int it = 0; it < nit; ++it) {
        stream_step(it, nit, issue_kv);
        if (active) {
            const int nk = min(BN, s1 - s0 - it * BN), b = it & 1;
            float s[NTS][4];
#pragma unroll
            for (int j = 0; j < NTS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            mm_ss<MODE, NTS, DK, BLK>(s, sQw, LD, sK + b * BN * LD, LD);
            float mx[NR], a[NR], rs[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) { mx[r] = NEG_INF; rs[r] = 0.f; }
#pragma unroll
            for (int x = 0; x < NTS; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    s[x][y] = SC::col(x, y) < nk ? s[x][y] * scale_log2 : NEG_INF;
                    mx[SC::slot(x, y)] = fmaxf(mx[SC::slot(x, y)], s[x][y]);
                }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const float n = fmaxf(m[r], SC::reduce(mx[r], FMax()));
                a[r] = exp2_ftz(m[r] - n);
                m[r] = n;
            }
#pragma unroll
            for (int x = 0; x < NTS; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    s[x][y] = exp2_ftz(s[x][y] - m[SC::slot(x, y)]);
                    rs[SC::slot(x, y)] += s[x][y];
                }
#pragma unroll
            for (int r = 0; r < NR; ++r) l[r] = l[r] * a[r] + rs[r];
            if constexpr (BLK) {  // rows 8rg + i need the factors of the score layout's rows: via scratch
                __syncwarp();
                if (SC::leader())
#pragma unroll
                    for (int r = 0; r < NR; ++r) scratch[SC::row(r)] = a[r];
                __syncwarp();
                const float* f = scratch + 8 * (lane >> 4);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float fi = f[i];
#pragma unroll
                    for (int c = 0; c < DN / 2; ++c) BLK_AT(o, DN, i, c) *= fi;
                }
            } else {
#pragma unroll
                for (int j = 0; j < DN; ++j) { o[j][0] *= a[0]; o[j][1] *= a[0]; o[j][2] *= a[1]; o[j][3] *= a[1]; }
            }
            mm_rs<MODE, DN, NTS>(o, s, sV + b * BN * LD, LD, scratch);
        }
        __syncthreads();
    }
    if constexpr (BLK) {  // back to the C layout, through the idle K/V buffers ([BM][LD] floats fit exactly)
        float* stg = reinterpret_cast<float*>(sK);
        stage_acc<D, true, LD>(stg, o);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < DN; ++j) {
            const float2 u = *reinterpret_cast<const float2*>(stg + (w * 16 + g) * LD + 8 * j + 2 * t);
            const float2 v = *reinterpret_cast<const float2*>(stg + (w * 16 + g + 8) * LD + 8 * j + 2 * t);
            o[j][0] = u.x; o[j][1] = u.y; o[j][2] = v.x; o[j][3] = v.y;
        }
        __syncthreads();  // every warp has read its strip before pass 2 refills the buffers
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) l[r] = SC::reduce(l[r], FAdd());
    float inv0, inv1, lse0, lse1;  // of this thread's C-layout rows g and g + 8
    if constexpr (BLK) {
        __syncwarp();
        if (SC::leader())
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                scratch[SC::row(r)] = m[r] + log2f(l[r]);
                scratch[16 + SC::row(r)] = 1.f / l[r];
            }
        __syncwarp();
        lse0 = scratch[g]; lse1 = scratch[g + 8]; inv0 = scratch[16 + g]; inv1 = scratch[24 + g];
        __syncwarp();
    } else {
        inv0 = 1.f / l[0]; inv1 = 1.f / l[1];
        lse0 = m[0] + log2f(l[0]); lse1 = m[1] + log2f(l[1]);
    }
    const int ra = w * 16 + g, rb = ra + 8;  // this thread's two rows within the tile
    const bool va = ra < nq, vb = rb < nq;
    const i64 ta = row0 + ra, tb = row0 + rb;
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int j = 0; j < DN; ++j) {
        const int c = h * D + 8 * j + 2 * t;
        o[j][0] *= inv0; o[j][1] *= inv0; o[j][2] *= inv1; o[j][3] *= inv1;
        if (Ot) {
            if (va) { Ot[(i64)c * ldt + ta] = o[j][0]; Ot[(i64)(c + 1) * ldt + ta] = o[j][1]; }
            if (vb) { Ot[(i64)c * ldt + tb] = o[j][2]; Ot[(i64)(c + 1) * ldt + tb] = o[j][3]; }
        }
        if (STAGE > 0) {  // delta from the staged dO: the same operand values that dP = dO V^T uses
            const float2 ya = smem_pair<MODE>(sdO + ra * LD + 8 * j + 2 * t);
            const float2 yb = smem_pair<MODE>(sdO + rb * LD + 8 * j + 2 * t);
            d0 += o[j][0] * ya.x + o[j][1] * ya.y;
            d1 += o[j][2] * yb.x + o[j][3] * yb.y;
        }
        if (va && O) store2<OT>(O + ta * H + c, o[j][0], o[j][1]);
        if (vb && O) store2<OT>(O + tb * H + c, o[j][2], o[j][3]);
    }
    if (Ot && row0 + nq == T)  // zero the row padding of O^T once per head
        for (int u = threadIdx.x; u < D * (ldt - T); u += NWARP * 32)
            Ot[(i64)(h * D + u / (ldt - T)) * ldt + T + u % (ldt - T)] = 0.f;
    if constexpr (STAGE == 0) {
        if (lse && t == 0) {
            if (va) lse[(i64)h * T + ta] = lse0;
            if (vb) lse[(i64)h * T + tb] = lse1;
        }
        return;
    }
    d0 = quad_sum(d0);
    d1 = quad_sum(d1);
    if (t == 0) {
        if (va) { lse[(i64)h * T + ta] = lse0; delta[(i64)h * T + ta] = d0; }
        if (vb) { lse[(i64)h * T + tb] = lse1; delta[(i64)h * T + tb] = d1; }
    }
    if constexpr (STAGE == 1) return;
    float lr[NR], dr[NR];  // lse2 and delta of the score layout's rows
    if constexpr (BLK) {
        if (t == 0) { scratch[g] = lse0; scratch[g + 8] = lse1; scratch[16 + g] = d0; scratch[24 + g] = d1; }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < NR; ++r) { lr[r] = scratch[SC::row(r)]; dr[r] = scratch[16 + SC::row(r)]; }
        __syncwarp();
    } else {
        lr[0] = lse0; lr[1] = lse1; dr[0] = d0; dr[1] = d1;
    }

    dq_pass(lr, dr);
}
