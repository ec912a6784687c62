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
