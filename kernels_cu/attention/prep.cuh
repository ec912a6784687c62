// Kernel 0, attn_prep: the GEMM outputs (qkv without its bias, dO) become the attention operands, with bias and
// RoPE applied once here instead of in every tile load of the attention kernels (layout: attention.cu).
#pragma once
#include "attention/config.cuh"

// rope(x) = x*cos + rotate_half(x)*sin, rotate_half([x1, x2]) = [-x2, x1], on 4 columns d..d+3 (lo) and their
// partners d+D/2..d+D/2+3 (hi) of token ``tok``, in place; cs / sn: the [T, D] fp32 tables.
template <int D>
__device__ __forceinline__ void rope4(float (&lo)[4], float (&hi)[4], const float* __restrict__ cs,
                                      const float* __restrict__ sn, int tok, int d) {
    constexpr int H2 = D / 2;
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

// ---- kernel 0: operand preparation. Thread unit = (which, token, head, 4 columns d..d+3 and their RoPE
// partners d+D/2..d+D/2+3); consecutive threads take consecutive units along a row (coalesced both ways).
// q, k and v are read from three bases with one row stride ``ld`` (the block: the columns of qkv [T, 3H], ld 3H;
// the varlen API: three [T, H] arrays as given, ld H). ``map``: null for the layout P[which][NH][T][DK], else the
// dense form's rows (attention/dense.cuh): token t of head h is row which * NH * T + map[t].x + h * map[t].y.
template <int MODE, int D>
__device__ void attn_prep(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                          int ld, const float* __restrict__ bqkv,
                          const float* __restrict__ cs, const float* __restrict__ sn, const float* __restrict__ dO,
                          typename Smem<MODE>::T* __restrict__ P, int T, int H, int nwhich,
                          const int2* __restrict__ map) {
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
        const float* src = which == 3 ? dO + (i64)tok * H + head * D
                                      : (which == 0 ? q : which == 1 ? k : v) + (i64)tok * ld + head * D;
        float4 a = *reinterpret_cast<const float4*>(src + d), b = *reinterpret_cast<const float4*>(src + d + H2);
        float lo[4] = {a.x, a.y, a.z, a.w}, hi[4] = {b.x, b.y, b.z, b.w};
        if (which < 3) {
            const float* bias = bqkv + which * H + head * D;
            float4 ba = *reinterpret_cast<const float4*>(bias + d);
            float4 bb = *reinterpret_cast<const float4*>(bias + d + H2);
            lo[0] += ba.x; lo[1] += ba.y; lo[2] += ba.z; lo[3] += ba.w;
            hi[0] += bb.x; hi[1] += bb.y; hi[2] += bb.z; hi[3] += bb.w;
        }
        if (which < 2) rope4<D>(lo, hi, cs, sn, tok, d);
        i64 row = ((i64)which * NH + head) * T + tok;
        if (map) {
            const int2 mp = map[tok];
            row = (i64)which * NH * T + mp.x + (i64)head * mp.y;
        }
        ST* dst = P + row * DK;
        if constexpr (MODE == MODE_BF16) {
            *reinterpret_cast<uint2*>(dst + d) = make_uint2(pack2<BF16>(lo[0], lo[1]), pack2<BF16>(lo[2], lo[3]));
            *reinterpret_cast<uint2*>(dst + d + H2) =
                make_uint2(pack2<BF16>(hi[0], hi[1]), pack2<BF16>(hi[2], hi[3]));
        } else {
            *reinterpret_cast<float4*>(dst + d) =
                make_float4(to_smem<MODE>(lo[0]), to_smem<MODE>(lo[1]), to_smem<MODE>(lo[2]), to_smem<MODE>(lo[3]));
            *reinterpret_cast<float4*>(dst + d + H2) =
                make_float4(to_smem<MODE>(hi[0]), to_smem<MODE>(hi[1]), to_smem<MODE>(hi[2]), to_smem<MODE>(hi[3]));
        }
        if (DK > D && grp == G - 1)
            for (int c = D; c < DK; ++c) dst[c] = to_smem<MODE>(0.f);
    }
}

// ---- the sm_90a kernels' operands where the products leave them (bf16 only). The QK product writes fp32 qk
// [T, 2H] without its bias (q, k of head h: columns {0,1}*H + h*D + [0, D)), the V product bf16 v [T, H] with its
// bias (cuBLASLt's epilogue, before the one rounding) and the dO product bf16 dO [T, H]; the kernels read v, dO and
// this kernel's bf16 qk' [T, 2H] through tensor maps with those row strides (attention/hopper.py), so no packed
// per-head copy is made. Here q and k get their bias and RoPE in fp32 and are rounded once, as in attn_prep.
// Thread unit = (token, which = q or k, head, 4 columns d..d+3 and d+D/2..d+D/2+3), consecutive along a row.
template <int D>
__device__ void attn_prep_qk(const float* __restrict__ qk, const float* __restrict__ bqk,
                             const float* __restrict__ cs, const float* __restrict__ sn, u16* __restrict__ out,
                             int T, int H) {
    constexpr int H2 = D / 2, G = H2 / 4;
    static_assert(H2 % 4 == 0, "attn_prep_qk: D / 2 must be a multiple of 4");
    const int NH = H / D;
    const i64 per_token = (i64)2 * NH * G;
    const i64 total = per_token * T;
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (i64)gridDim.x * blockDim.x) {
        const int tok = (int)(u / per_token);
        int rest = (int)(u - tok * per_token);
        const int grp = rest % G;
        rest /= G;
        const int col = rest * D;  // (which * NH + head) * D = which * H + head * D
        const int d = grp * 4;
        const float* src = qk + (i64)tok * 2 * H + col;
        const float4 a = *reinterpret_cast<const float4*>(src + d), b = *reinterpret_cast<const float4*>(src + d + H2);
        const float4 ba = *reinterpret_cast<const float4*>(bqk + col + d);
        const float4 bb = *reinterpret_cast<const float4*>(bqk + col + d + H2);
        float lo[4] = {a.x + ba.x, a.y + ba.y, a.z + ba.z, a.w + ba.w};
        float hi[4] = {b.x + bb.x, b.y + bb.y, b.z + bb.z, b.w + bb.w};
        rope4<D>(lo, hi, cs, sn, tok, d);
        u16* dst = out + (i64)tok * 2 * H + col;
        *reinterpret_cast<uint2*>(dst + d) = make_uint2(pack2<BF16>(lo[0], lo[1]), pack2<BF16>(lo[2], lo[3]));
        *reinterpret_cast<uint2*>(dst + d + H2) = make_uint2(pack2<BF16>(hi[0], hi[1]), pack2<BF16>(hi[2], hi[3]));
    }
}
