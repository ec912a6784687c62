// attn_stats: the row statistics of the backward from the forward's outputs, for the varlen API's backward on
// these kernels (which takes o and lse as given, as the sm_90a kernels do): lse2 = lse * log2(e) (the kernels'
// log2 domain) and delta = rowsum(dO * o), with dO as the products read it (the packed operand, in the mode's
// element type), the values dP = dO V^T is made of.
#pragma once
#include "attention/config.cuh"

// One warp per row (head h, token t) of the [NH, T] statistics, grid-stride. Pdo: the packed dO [NH][T][DK];
// o: [T, NH * D], fp32 (bf16 where o_bf16); lse: the natural log-sum-exp [NH, T]. Each lane sums every 32nd
// element of its row, then the warp's butterfly: a fixed order, the same bits every run.
template <int MODE, int D>
__device__ void attn_stats(const typename Smem<MODE>::T* __restrict__ Pdo, const void* __restrict__ o, int o_bf16,
                           const float* __restrict__ lse, float* __restrict__ lse2, float* __restrict__ delta,
                           int T, int NH) {
    constexpr int DK = Dims<D>::DK;
    constexpr float LOG2E_F = 1.4426950408889634f;
    const int lane = threadIdx.x & 31;
    const i64 rows = (i64)NH * T, warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const int h = (int)(r / T);
        const i64 tok = r - (i64)h * T, ob = (tok * NH + h) * D;
        const typename Smem<MODE>::T* y = Pdo + r * DK;
        float s = 0.f;
#pragma unroll
        for (int d = lane; d < D; d += 32) {
            float yv;
            if constexpr (MODE == MODE_BF16) yv = bf16_to_f32(y[d]);
            else yv = y[d];
            const float ov = o_bf16 ? bf16_to_f32(static_cast<const u16*>(o)[ob + d])
                                    : static_cast<const float*>(o)[ob + d];
            s = fmaf(yv, ov, s);
        }
#pragma unroll
        for (int x = 16; x >= 1; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);
        if (lane == 0) {
            delta[r] = s;
            lse2[r] = lse[r] * LOG2E_F;
        }
    }
}
