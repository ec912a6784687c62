// The end of every kernel that writes a gradient: its fp32 accumulators are staged in shared memory, then
// written out (with the RoPE backward for dq and dk), transposed if asked, and summed by column for the bias.
#pragma once
#include "attention/config.cuh"

// One output element pair / quad in the output type (fp32, or bf16 packed).
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

// The epilogue's barrier: block-wide (BAR = 0; the unaligned form with UNALIGNED), or named barrier BAR of the
// tile's NWARP * 32 threads, for a warp-specialised kernel whose other warps do not take part in the epilogue.
template <bool UNALIGNED, int BAR> __device__ __forceinline__ void epi_sync() {
    if constexpr (BAR > 0) named_barrier(BAR, NWARP * 32);
    else block_sync<UNALIGNED>();
}

// Epilogue shared by attn_fwd_dq, attn_dkdv and attn_dq_reduce: the block's ROWS x D fp32 gradient tile sits in
// `st` (row stride LDST). Apply the RoPE backward if asked (dx = g*cos + rotate_half_inverse(g*sin),
// rotate_half_inverse([y1, y2]) = [y2, -y1]), write valid rows to out (row stride out_ld), and write the tile's
// column sums (the bias gradient's share of this tile; invalid rows count as zero) to part[0, D).
// If outT is given, the tile is also written transposed: outT[c * ldt + token] (a K-major GEMM operand); the
// block holding the last token also zeroes the row padding [T, ldt).
// BLOCK false (the varlen API's plain outputs): no column sums and no transposed copy (part and outT unused),
// so the tile is only read; the barriers are the same. UNALIGNED: the barriers in their unaligned form (block_sync),
// for warp-specialised kernels whose producer warps meet them elsewhere; BAR > 0: named barrier BAR instead
// (epi_sync). UNROLL: how far the row loop is unrolled (its global cos/sin loads in flight per thread; the
// mma.sync kernels' ATTN_EPI_UNROLL, a lab switch). ROWS: the tile's rows (at most BM; the sm_90a tf32 backwards'
// key blocks have 64): rows past it are neither read, stored nor summed.
#ifndef ATTN_EPI_UNROLL
#define ATTN_EPI_UNROLL 2
#endif
template <class OT, int D, bool ROPE, bool BLOCK = true, bool UNALIGNED = false, int BAR = 0,
          int UNROLL = ATTN_EPI_UNROLL, int ROWS = BM>
__device__ __forceinline__ void write_grad_tile(float* st, typename OT::T* __restrict__ out, i64 out_ld,
                                                const float* __restrict__ cs, const float* __restrict__ sn,
                                                int tok0, int nvalid, float* __restrict__ part,
                                                float* __restrict__ outT, int T, int ldt) {
    constexpr int H2 = D / 2, G = H2 / 4, LDST = D + 4;
    static_assert(ROWS <= BM && ROWS % 4 == 0, "write_grad_tile: at most BM rows, in fours");
    epi_sync<UNALIGNED, BAR>();
#pragma unroll UNROLL
    for (int u = threadIdx.x; u < ROWS * G; u += NWARP * 32) {
        const int r = u / G, d = (u - r * G) * 4;
        float* p = st + r * LDST + d;
        float lo[4], hi[4];
        if (r < nvalid) {
            const i64 tok = tok0 + r;
#pragma unroll
            for (int e = 0; e < 4; ++e) { lo[e] = p[e]; hi[e] = p[H2 + e]; }
            if (ROPE) rope_bwd4<D>(cs, sn, tok, d, lo, hi);
            store4<OT>(out + tok * out_ld + d, lo);
            store4<OT>(out + tok * out_ld + d + H2, hi);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) lo[e] = hi[e] = 0.f;
        }
        if constexpr (BLOCK) {
#pragma unroll
            for (int e = 0; e < 4; ++e) { p[e] = lo[e]; p[H2 + e] = hi[e]; }
        }
    }
    epi_sync<UNALIGNED, BAR>();
    if constexpr (!BLOCK) return;
    for (int c = threadIdx.x; c < D; c += NWARP * 32) part[c] = column_sum<ROWS>(st, LDST, c);
    if (outT) {
        for (int u = threadIdx.x; u < ROWS * D; u += NWARP * 32) {
            const int c = u / ROWS, r = u - c * ROWS;
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
            for (int c = 0; c < D / 16; ++c)
                st[(w * 16 + 8 * rg + i) * LDST + cg + 16 * c] = BLK_AT(acc, D / 8, i, c);
        return;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<float2*>(st + (w * 16 + g) * LDST + 8 * j + 2 * t) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(st + (w * 16 + g + 8) * LDST + 8 * j + 2 * t) = make_float2(acc[j][2], acc[j][3]);
    }
}
