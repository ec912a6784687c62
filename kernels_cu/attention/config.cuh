// Attention kernel configuration: the precision modes, the block shape and the shared-memory row layout.
#pragma once

// The precision modes are named, never written as integers: the build defines them from the one table of their
// values (cupy_rope.precision.compile_defines(): -DMODE_FP32=0 -DMODE_TF32=1 -DMODE_BF16=2), so the Python enum
// and the templates instantiated here cannot disagree. mma.cuh says what each mode computes with.
#if !defined(MODE_FP32) || !defined(MODE_TF32) || !defined(MODE_BF16)
#error "MODE_FP32, MODE_TF32 and MODE_BF16 are not defined: compile with cupy_rope.precision.compile_defines()"
#endif

#include "mma.cuh"

#define NWARP 8
#define BM (16 * NWARP)  // rows a block owns: 16 per warp
#define BN 32  // rows of the tile streamed through the inner loop
#define NTS (BN / 8)
static_assert(BM <= 4 * BN, "the fp32 o conversion stages a [BM][LD] tile in the K/V buffers");
static_assert(BN == 32, "score tiles are 16 x 32 (NTS = 4)");

template <int D> struct Dims {
    static constexpr int DK = (D + 15) / 16 * 16;  // reduction length, zero-padded
    static constexpr int DN = D / 8;                // n8 tiles across the head dimension
};

template <int MODE, int D> struct Layout {
    static constexpr int DK = Dims<D>::DK;
    // smem row stride (elements): conflict-free fragments
    static constexpr int LD = MODE == MODE_BF16 ? DK + 8 : DK + 4;
    static constexpr int SCR = MODE == MODE_FP32 ? RsScratch<NTS>::value : 0;  // per-warp scratch floats (FFMA path)
};

// Warps whose 16 rows all lie past the tile's last row skip the products (they still copy tiles and meet the
// barriers): measured 4-14% faster kernels on sequences that end in a short tile in fp32 and tf32; in bf16
// (two blocks per SM) 3-7% slower, so bf16 keeps computing them.
template <int MODE> struct SkipIdle { static constexpr bool value = MODE != MODE_BF16; };

// The RoPE backward of four lanes of each half of one row: (lo, hi) hold columns d..d+3 and D/2+d..D/2+d+3 of the
// gradient with respect to the rotated row, and leave with the gradient with respect to the row before the rotation
// (cos / sin rows [T, D] at row `tok`). Every gradient epilogue that undoes the rotation goes through this.
template <int D>
__device__ __forceinline__ void rope_bwd4(const float* __restrict__ cs, const float* __restrict__ sn, long long tok,
                                          int d, float lo[4], float hi[4]) {
    constexpr int H2 = D / 2;
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

// The sum of column `col` over ROWS rows of a staged tile (row stride ld floats), in four chains of every fourth
// row, a fixed order (the same bits every run), with more loads in flight than one chain: the bias gradients'
// partial sums of every gradient epilogue.
template <int ROWS>
__device__ __forceinline__ float column_sum(const float* st, int ld, int col) {
    static_assert(ROWS % 4 == 0, "column_sum: four chains");
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 4
    for (int r = 0; r < ROWS; r += 4) {
        s0 += st[r * ld + col];
        s1 += st[(r + 1) * ld + col];
        s2 += st[(r + 2) * ld + col];
        s3 += st[(r + 3) * ld + col];
    }
    return (s0 + s1) + (s2 + s3);
}
