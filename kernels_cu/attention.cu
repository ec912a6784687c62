// Fused varlen (cu_seqlens) vision attention with 2D RoPE: the attention kernels of the backward (and forward).
//
// attn_prep turns the GEMM outputs (fp32, row-major)
//   qkv [T, 3H]   X * Wqkv^T, *without* its bias: q/k/v of head h are columns {0,1,2}*H + h*D + [0, D)
//   dO [T, H]     dY * Wp
// into the attention operands P[which][NH][T][DK] (which = q', k', v, dO; q' and k' with bias and RoPE, v with
// bias), in the mode's shared-memory element type (tf32-rounded fp32, fp32 or bf16), zero-padded to DK columns,
// so that every tile the attention kernels stream is one contiguous block that cp.async copies as it is.
//   tiles [ntiles][3] int32: (first token of the tile, first token of its sequence, end of its sequence)
// Softmax runs in the log2 domain: S2 = S * scaling * log2(e), lse2 = max + log2(sum).
// No L x L matrix leaves registers; the kernels write disjoint outputs and add nothing atomically (the fp32 dQ
// partials are summed in a fixed order), so the results are bit-identical from run to run.
// Blocks are NWARP warps; each warp owns 16 rows of the block's tile.
#include "mma.cuh"

#define NWARP 8
#define NEG_INF (-__int_as_float(0x7f800000))
#define BM (16 * NWARP)  // rows a block owns: 16 per warp
#define BN 32  // rows of the tile streamed through the inner loop
#define NTS (BN / 8)
static_assert(BM <= 4 * BN, "the fp32 o conversion stages a [BM][LD] tile in the K/V buffers");

template <int D> struct Dims {
    static constexpr int DK = (D + 15) / 16 * 16;  // reduction length, zero-padded
    static constexpr int DN = D / 8;                // n8 tiles across the head dimension
};

template <int MODE, int D> struct Layout {
    static constexpr int DK = Dims<D>::DK;
    static constexpr int LD = MODE == 2 ? DK + 8 : DK + 4;  // smem row stride (elements): conflict-free fragments
    static constexpr int SCR = MODE == 0 ? RsScratch<NTS>::value : 0;  // per-warp scratch floats (FFMA path)
};

// ---- kernel 0: operand preparation. Thread unit = (which, token, head, 4 columns d..d+3 and their RoPE
// partners d+D/2..d+D/2+3); consecutive threads take consecutive units along a row (coalesced both ways).
template <int MODE, int D>
__device__ void attn_prep(const float* __restrict__ qkv, const float* __restrict__ bqkv, const float* __restrict__ cs,
                          const float* __restrict__ sn, const float* __restrict__ dO, typename Smem<MODE>::T* __restrict__ P,
                          int T, int H, int nwhich) {
    typedef typename Smem<MODE>::T ST;
    constexpr int H2 = D / 2, G = H2 / 4, DK = Dims<D>::DK;
    const int NH = H / D;
    const i64 total = (i64)nwhich * T * NH * G;
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (i64)gridDim.x * blockDim.x) {
        const int grp = (int)(u % G);
        i64 rest = u / G;
        const int head = (int)(rest % NH);
        rest /= NH;
        const int tok = (int)(rest % T);
        const int which = (int)(rest / T);
        const int d = grp * 4;
        const float* src = which == 3 ? dO + (i64)tok * H + head * D : qkv + (i64)tok * 3 * H + which * H + head * D;
        float4 a = *reinterpret_cast<const float4*>(src + d), b = *reinterpret_cast<const float4*>(src + d + H2);
        float lo[4] = {a.x, a.y, a.z, a.w}, hi[4] = {b.x, b.y, b.z, b.w};
        if (which < 3) {
            const float* bias = bqkv + which * H + head * D;
            float4 ba = *reinterpret_cast<const float4*>(bias + d), bb = *reinterpret_cast<const float4*>(bias + d + H2);
            lo[0] += ba.x; lo[1] += ba.y; lo[2] += ba.z; lo[3] += ba.w;
            hi[0] += bb.x; hi[1] += bb.y; hi[2] += bb.z; hi[3] += bb.w;
        }
        if (which < 2) {
            // rope(x) = x*cos + rotate_half(x)*sin, rotate_half([x1, x2]) = [-x2, x1]
            const float* c = cs + (i64)tok * D;
            const float* s = sn + (i64)tok * D;
            float4 cl = *reinterpret_cast<const float4*>(c + d), ch = *reinterpret_cast<const float4*>(c + d + H2);
            float4 sl = *reinterpret_cast<const float4*>(s + d), sh = *reinterpret_cast<const float4*>(s + d + H2);
            const float c0[4] = {cl.x, cl.y, cl.z, cl.w}, c1[4] = {ch.x, ch.y, ch.z, ch.w};
            const float s0[4] = {sl.x, sl.y, sl.z, sl.w}, s1[4] = {sh.x, sh.y, sh.z, sh.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x1 = lo[e], x2 = hi[e];
                lo[e] = x1 * c0[e] - x2 * s0[e];
                hi[e] = x2 * c1[e] + x1 * s1[e];
            }
        }
        ST* dst = P + (((i64)which * NH + head) * T + tok) * DK;
        if constexpr (MODE == 2) {
            *reinterpret_cast<uint2*>(dst + d) = make_uint2(pack2<BF16>(lo[0], lo[1]), pack2<BF16>(lo[2], lo[3]));
            *reinterpret_cast<uint2*>(dst + d + H2) = make_uint2(pack2<BF16>(hi[0], hi[1]), pack2<BF16>(hi[2], hi[3]));
        } else {
            *reinterpret_cast<float4*>(dst + d) = make_float4(to_smem<MODE>(lo[0]), to_smem<MODE>(lo[1]), to_smem<MODE>(lo[2]), to_smem<MODE>(lo[3]));
            *reinterpret_cast<float4*>(dst + d + H2) = make_float4(to_smem<MODE>(hi[0]), to_smem<MODE>(hi[1]), to_smem<MODE>(hi[2]), to_smem<MODE>(hi[3]));
        }
        if (DK > D && grp == G - 1)
            for (int c = D; c < DK; ++c) dst[c] = to_smem<MODE>(0.f);
    }
}

// ---- asynchronous tile copies (cp.async, 16 bytes per request) ----------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(a), "l"(gmem), "r"(src_bytes) : "memory");
}

// Copy R rows (row stride DK in global, LD in shared) starting at `src`; rows at or past nvalid are zero-filled.
template <int MODE, int D, int R>
__device__ __forceinline__ void copy_tile(typename Smem<MODE>::T* dst, const typename Smem<MODE>::T* src, int nvalid) {
    typedef typename Smem<MODE>::T ST;
    constexpr int DK = Dims<D>::DK, LD = Layout<MODE, D>::LD, CH = DK * (int)sizeof(ST) / 16;
    for (int c = threadIdx.x; c < R * CH; c += NWARP * 32) {
        const int r = c / CH, k = c - r * CH;
        const bool v = r < nvalid;
        cp_async16(reinterpret_cast<char*>(dst + r * LD) + 16 * k,
                   reinterpret_cast<const char*>(src + (v ? r : 0) * DK) + 16 * k, v ? 16 : 0);
    }
}

// Two consecutive shared-memory operand elements as floats.
template <int MODE> __device__ __forceinline__ float2 smem_pair(const typename Smem<MODE>::T* p) {
    if constexpr (MODE == 2) return unpack2<BF16>(*reinterpret_cast<const u32*>(p));
    else return *reinterpret_cast<const float2*>(p);
}

struct FMax { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct FAdd { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
// Warps whose 16 rows all lie past the tile's last row skip the products (they still copy tiles and meet the
// barriers): measured 4-14% faster kernels on sequences that end in a short tile in fp32 and tf32; in bf16
// (two blocks per SM) 3-7% slower, so bf16 keeps computing them.
template <int MODE> struct SkipIdle { static constexpr bool value = MODE != 2; };
static_assert(BN == 32, "score tiles are 16 x 32 (NTS = 4)");

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <class OT> __device__ __forceinline__ void store2(typename OT::T* p, float a, float b);
template <> __device__ __forceinline__ void store2<F32>(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2<BF16>(u16* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = pack2<BF16>(a, b);
}
template <class OT> __device__ __forceinline__ void store4(typename OT::T* p, const float* v);
template <> __device__ __forceinline__ void store4<F32>(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <> __device__ __forceinline__ void store4<BF16>(u16* p, const float* v) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2<BF16>(v[0], v[1]), pack2<BF16>(v[2], v[3]));
}

// Epilogue shared by both kernels: the block's BM x D fp32 gradient tile sits in `st` (row stride LDST).
// Apply the RoPE backward if asked (dx = g*cos + rotate_half_inverse(g*sin), rotate_half_inverse([y1, y2])
// = [y2, -y1]), write valid rows to out (row stride out_ld), and write the tile's column sums (the bias
// gradient's share of this tile; invalid rows count as zero) to part[0, D).
// If outT is given, the tile is also written transposed: outT[c * ldt + token] (a K-major GEMM operand); the
// block holding the last token also zeroes the row padding [T, ldt).
template <class OT, int D, bool ROPE>
__device__ __forceinline__ void write_grad_tile(float* st, typename OT::T* __restrict__ out, i64 out_ld,
                                                const float* __restrict__ cs, const float* __restrict__ sn,
                                                int tok0, int nvalid, float* __restrict__ part,
                                                float* __restrict__ outT, int T, int ldt) {
    constexpr int H2 = D / 2, G = H2 / 4, LDST = D + 4;
    __syncthreads();
#pragma unroll 2
    for (int u = threadIdx.x; u < BM * G; u += NWARP * 32) {
        const int r = u / G, d = (u - r * G) * 4;
        float* p = st + r * LDST + d;
        float lo[4], hi[4];
        if (r < nvalid) {
            const i64 tok = tok0 + r;
#pragma unroll
            for (int e = 0; e < 4; ++e) { lo[e] = p[e]; hi[e] = p[H2 + e]; }
            if (ROPE) {
                const float4 cl = *reinterpret_cast<const float4*>(cs + tok * D + d);
                const float4 ch = *reinterpret_cast<const float4*>(cs + tok * D + d + H2);
                const float4 sl = *reinterpret_cast<const float4*>(sn + tok * D + d);
                const float4 sh = *reinterpret_cast<const float4*>(sn + tok * D + d + H2);
                const float c1[4] = {cl.x, cl.y, cl.z, cl.w}, c2[4] = {ch.x, ch.y, ch.z, ch.w};
                const float s1[4] = {sl.x, sl.y, sl.z, sl.w}, s2[4] = {sh.x, sh.y, sh.z, sh.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float g1 = lo[e], g2 = hi[e];
                    lo[e] = g1 * c1[e] + g2 * s2[e];
                    hi[e] = g2 * c2[e] - g1 * s1[e];
                }
            }
            store4<OT>(out + tok * out_ld + d, lo);
            store4<OT>(out + tok * out_ld + d + H2, hi);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) lo[e] = hi[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) { p[e] = lo[e]; p[H2 + e] = hi[e]; }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += NWARP * 32) {
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;  // four chains: fixed order, more loads in flight
#pragma unroll 4
        for (int r = 0; r < BM; r += 4) {
            s0 += st[r * LDST + c];
            s1 += st[(r + 1) * LDST + c];
            s2 += st[(r + 2) * LDST + c];
            s3 += st[(r + 3) * LDST + c];
        }
        part[c] = (s0 + s1) + (s2 + s3);
    }
    if (outT) {
        for (int u = threadIdx.x; u < BM * D; u += NWARP * 32) {
            const int c = u / BM, r = u - c * BM;
            if (r < nvalid) outT[(i64)c * ldt + tok0 + r] = st[r * LDST + c];
        }
        if (tok0 + nvalid == T)
            for (int u = threadIdx.x; u < D * (ldt - T); u += NWARP * 32)
                outT[(i64)(u / (ldt - T)) * ldt + T + u % (ldt - T)] = 0.f;
    }
}

// Write a warp's 16 x D accumulator strip (C layout, or blocked if BLK) into an fp32 tile of row stride LDST.
template <int D, bool BLK, int LDST = D + 4>
__device__ __forceinline__ void stage_acc(float* st, const float (&acc)[D / 8][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = threadIdx.x >> 5;
    if constexpr (BLK) {
        const int rg = lane >> 4, cg = lane & 15;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int c = 0; c < D / 16; ++c) st[(w * 16 + 8 * rg + i) * LDST + cg + 16 * c] = BLK_AT(acc, D / 8, i, c);
        return;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<float2*>(st + (w * 16 + g) * LDST + 8 * j + 2 * t) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(st + (w * 16 + g + 8) * LDST + 8 * j + 2 * t) = make_float2(acc[j][2], acc[j][3]);
    }
}

// ---- kernel 1: forward + dQ. Block (x, y) owns query tile tiles[x] (BM rows) of head y. --------------------
// Pass 1 streams K/V tiles (double-buffered cp.async) with an online softmax: O, lse2, delta = rowsum(dO * O).
// Pass 2 streams them again: P = exp2(S2 - lse2), dP = dO V^T, dS = scaling * P * (dP - delta), dQ += dS K.
// Writes O (OT) [T, H], lse2 and delta [NH, T], RoPE-backwarded dq into gqkv[:, 0:H] and its column sums.
// STAGE 0 stops after O (the forward op), STAGE 1 after lse2 and delta (dQ then comes from attn_dkdv's partials).
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

    // ---- pass 1: online softmax and O
    float o[DN][4];
#pragma unroll
    for (int j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[NR], l[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) { m[r] = NEG_INF; l[r] = 0.f; }
    issue_kv(0);
    for (int it = 0; it < nit; ++it) {
        if (it + 1 < nit) { issue_kv(it + 1); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
        __syncthreads();
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
                a[r] = exp2f(m[r] - n);
                m[r] = n;
            }
#pragma unroll
            for (int x = 0; x < NTS; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    s[x][y] = exp2f(s[x][y] - m[SC::slot(x, y)]);
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
    if constexpr (STAGE == 0) return;
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

    // ---- pass 2: dQ
    float dq[DN][4];
#pragma unroll
    for (int j = 0; j < DN; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
    issue_kv(0);
    for (int it = 0; it < nit; ++it) {
        if (it + 1 < nit) { issue_kv(it + 1); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
        __syncthreads();
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
                    const float p = SC::col(x, y) < nk ? exp2f(s[x][y] * scale_log2 - lr[r]) : 0.f;
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
}

// dQ rows [nq] x [D] of the streamed query tile over the block's first nkp keys (a multiple of 16: the active
// warps'), from dS in the warps' scratch (warp w: dS[q][16w + k] at scratch0 + w * SCR + q * LDPT + k) and the
// resident fp32 K tile (row stride LD), stored at out[q * ld + d]. Thread unit: 4 query rows 4 (lane / 4) + i
// by 4 head columns 16 w + 4 (lane % 4) + c; 0.5 shared-memory wavefronts per FMA, as the score products.
template <int D>
__device__ __forceinline__ void dq_partial(const float* sK, const float* scratch0, int nkp, int nq,
                                           float* __restrict__ out, int ld) {
    constexpr int LD = Layout<0, D>::LD, LDPT = RsScratch<NTS>::LDPT, SCR = RsScratch<NTS>::value;
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
        if (4 * qa + i < nq)
            *reinterpret_cast<float4*>(out + (i64)(4 * qa + i) * ld + col) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
}

// ---- kernel 3 (with DQP): dQ. Block (x, y) owns query tile tiles[x] (BM rows) of head y: sums the sequence's
// key-tile partials in order (deterministic), then the RoPE backward, column sums and writes as in attn_fwd_dq.
template <int D, class OT>
__device__ void attn_dq_reduce(const float* __restrict__ dqp, const float* __restrict__ cs,
                               const float* __restrict__ sn, const int* __restrict__ tiles,
                               typename OT::T* __restrict__ gqkv, float* __restrict__ gqkvT,
                               float* __restrict__ part, int T, int ldt, int H) {
    constexpr int LDST = D + 4, C4 = D / 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* st = reinterpret_cast<float*>(smem_raw);
    const int h = blockIdx.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nq = min(BM, s1 - row0), nkt = (s1 - s0 + BM - 1) / BM;
    for (int u = threadIdx.x; u < nq * C4; u += NWARP * 32) {
        const int r = u / C4, c = (u - r * C4) * 4;
        const float* src = dqp + (i64)(row0 + r) * H + h * D + c;
        float4 v = *reinterpret_cast<const float4*>(src);
        for (int kt = 1; kt < nkt; ++kt) {
            const float4 w = *reinterpret_cast<const float4*>(src + (i64)kt * T * H);
            v.x += w.x; v.y += w.y; v.z += w.z; v.w += w.w;
        }
        *reinterpret_cast<float4*>(st + r * LDST + c) = v;
    }
    const i64 ld3 = 3 * (i64)H;
    write_grad_tile<OT, D, true>(st, gqkv + h * D, ld3, cs, sn, row0, nq, part + (i64)tile * ld3 + h * D,
                                 gqkvT ? gqkvT + (i64)h * D * ldt : nullptr, T, ldt);
}

// ---- kernel 2: dK and dV. Block (x, y) owns key/value tile tiles[x] (BM rows) of head y. ------------------
// Streams the sequence's query tiles (double-buffered cp.async): S^T = K Q^T, P^T = exp2(S2^T - lse2),
// dV += P^T dO, dP^T = V dO^T, dS^T = scaling * P^T * (dP^T - delta), dK += dS^T Q.
// Writes RoPE-backwarded dk into gqkv[:, H:2H], dv into gqkv[:, 2H:3H], and their column sums.
// DQP (fp32 with blocked scores): also dQ of every streamed query row over this block's keys, dS K, written as
// partial kt = (first key - sequence start) / BM of dqp [kt][T][H]; attn_dq_reduce sums the partials.
template <int MODE, int D, class OT, bool DQP>
__device__ void attn_dkdv(const typename Smem<MODE>::T* __restrict__ P, const float* __restrict__ cs,
                          const float* __restrict__ sn, const int* __restrict__ tiles, const float* __restrict__ lse,
                          const float* __restrict__ delta, typename OT::T* __restrict__ gqkv,
                          float* __restrict__ gqkvT, float* __restrict__ part, float* __restrict__ dqp, int T,
                          int ldt, int H, float scale_log2, float scaling) {
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
        if (it + 1 < nit) { issue_q(it + 1); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
        __syncthreads();
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
                    s[x][y] = c < nq ? exp2f(s[x][y] * scale_log2 - bL[c]) : 0.f;
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
            __syncthreads();  // every active warp's dS is in its scratch
            dq_partial<D>(reinterpret_cast<const float*>(sK), sD + 2 * BN, (nkv + 15) & ~15, nq,
                          dqp + ((i64)((row0 - s0) / BM) * T + s0 + it * BN) * H + h * D, H);
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

// ---- exported entry points: one set per precision -------------------------------------------------------------
#define ATTN_ENTRIES(SUF, MODE, D, OT)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) attn_prep_##SUF(                                            \
        const float* qkv, const float* bqkv, const float* cs, const float* sn, const float* dO,                   \
        Smem<MODE>::T* P, int T, int H, int nwhich) {                                                              \
        attn_prep<MODE, D>(qkv, bqkv, cs, sn, dO, P, T, H, nwhich);                                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(NWARP * 32, MODE == 2 ? 2 : 1) attn_fwd_dq_##SUF(                                          \
        const Smem<MODE>::T* P, const float* cs, const float* sn, const float* dO, const int* tiles, OT::T* O,     \
        float* Ot, float* lse, float* delta, OT::T* gqkv, float* gqkvT, float* part, int T, int ldt, int H,       \
        float scale_log2, float scaling) {                                                                         \
        attn_fwd_dq<MODE, D, OT, 2>(P, cs, sn, dO, tiles, O, Ot, lse, delta, gqkv, gqkvT, part, T, ldt, H,        \
                                        scale_log2, scaling);                                                      \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(NWARP * 32, MODE == 2 ? 2 : 1) attn_fwd_##SUF(                                           \
        const Smem<MODE>::T* P, const int* tiles, OT::T* O, int T, int H, float scale_log2) {                     \
        attn_fwd_dq<MODE, D, OT, 0>(P, nullptr, nullptr, nullptr, tiles, O, nullptr, nullptr, nullptr, nullptr, \
                                       nullptr, nullptr, T, T, H, scale_log2, 0.f);                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dkdv_##SUF(                                            \
        const Smem<MODE>::T* P, const float* cs, const float* sn, const int* tiles, const float* lse,             \
        const float* delta, OT::T* gqkv, float* gqkvT, float* part, int T, int ldt, int H, float scale_log2,       \
        float scaling) {                                                                                           \
        attn_dkdv<MODE, D, OT, false>(P, cs, sn, tiles, lse, delta, gqkv, gqkvT, part, nullptr, T, ldt, H,        \
                                      scale_log2, scaling);                                                        \
    }

// The module is compiled once per head dimension: -DATTN_HEAD_DIM=<D> (default 128).
#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 128
#endif
ATTN_ENTRIES(fp32, 0, ATTN_HEAD_DIM, F32)
ATTN_ENTRIES(tf32, 1, ATTN_HEAD_DIM, F32)
ATTN_ENTRIES(bf16, 2, ATTN_HEAD_DIM, BF16)

// fp32 with dQ from the key-tile kernel (head dims with blocked scores: a multiple of 16): forward with lse2 and
// delta only, dK/dV with dQ partials, and their reduction.
#if ATTN_HEAD_DIM % 16 == 0
extern "C" __global__ void __launch_bounds__(NWARP * 32, 1) attn_fwd_stats_fp32(
    const float* P, const float* cs, const float* sn, const float* dO, const int* tiles, float* O, float* Ot,
    float* lse, float* delta, float* gqkv, float* gqkvT, float* part, int T, int ldt, int H, float scale_log2,
    float scaling) {
    attn_fwd_dq<0, ATTN_HEAD_DIM, F32, 1>(P, cs, sn, dO, tiles, O, Ot, lse, delta, gqkv, gqkvT, part, T, ldt, H,
                                         scale_log2, scaling);
}
extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dkdv_dqp_fp32(
    const float* P, const float* cs, const float* sn, const int* tiles, const float* lse, const float* delta,
    float* gqkv, float* gqkvT, float* part, float* dqp, int T, int ldt, int H, float scale_log2, float scaling) {
    attn_dkdv<0, ATTN_HEAD_DIM, F32, true>(P, cs, sn, tiles, lse, delta, gqkv, gqkvT, part, dqp, T, ldt, H,
                                           scale_log2, scaling);
}
extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dq_reduce_fp32(
    const float* dqp, const float* cs, const float* sn, const int* tiles, float* gqkv, float* gqkvT, float* part,
    int T, int ldt, int H) {
    attn_dq_reduce<ATTN_HEAD_DIM, F32>(dqp, cs, sn, tiles, gqkv, gqkvT, part, T, ldt, H);
}
#endif
