// The delta pass: delta = rowsum(dO * O) of every (token, head) row, the backward's row statistic, read from O and
// dO in memory (the varlen API's o and grad_o, or the block's); with lse, also the kernels' lse2 in the same pass.
#pragma once
#include "common.cuh"

// Eight consecutive elements of a row as fp32 (16 bytes of bf16 or 32 of fp32; D is a multiple of 8).
__device__ __forceinline__ void load8_f32(const u16* __restrict__ p, float* f) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load8_f32(const float* __restrict__ p, float* f) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// delta[h][t] = sum_d O[t][h][d] dO[t][h][d] (O of type OT at O + t ldo + h D, dO of type GT at dO + t ldg + h hsg:
// token-major, or head-major as the packed operands [NH][T][D] are; 16-byte aligned rows). Block (x, y) takes
// DELTA_TOKENS tokens from x DELTA_TOKENS and DELTA_HEADS heads from y DELTA_HEADS: half a warp per (token, head)
// row, lane c of the half taking elements 8c..8c+7 (D / 8 <= 16 lanes busy), each half-warp DELTA_ROWS rows of
// loads in flight; the sum is in a fixed order (eight products in turn, then a butterfly over the half-warp), so
// the same bits on every run. The block's sums meet in shared memory and leave as DELTA_TOKENS consecutive tokens
// of each head (one 32-byte sector), not one scattered word per row. With lse2 (the varlen API's backward), the
// same pass also writes lse2[h][t] = lse[h][t] * lse_k (the one rounding of a multiply: log2-domain sums for the
// kernels after it) and zeroes sem[h][t] (the ordered dQ sum's counts), so that neither needs a launch of its own.
// Both modules build it: the sm_90a backwards (hop_delta_*) and the mma.sync / FFMA ones (attn_delta_*, on the
// varlen API's o and lse as given).
// Lab switch: CUPY_ROPE_DELTA_ROWS, the rows of loads each half-warp has in flight (unset: 2).
#ifndef CUPY_ROPE_DELTA_ROWS
#define CUPY_ROPE_DELTA_ROWS 2
#endif
constexpr int DELTA_TOKENS = 8, DELTA_HEADS = 32, DELTA_ROWS = CUPY_ROPE_DELTA_ROWS;
template <class OT, class GT>
__device__ __forceinline__ void delta_pass(const typename OT::T* __restrict__ O, i64 ldo,
                                           const typename GT::T* __restrict__ dO, i64 ldg, i64 hsg,
                                           float* __restrict__ delta, int T, int NH, int D,
                                           const float* __restrict__ lse = nullptr,
                                           float* __restrict__ lse2 = nullptr, float lse_k = 1.f,
                                           int* __restrict__ sem = nullptr) {
    __shared__ float sums[DELTA_HEADS][DELTA_TOKENS];
    const int lane = threadIdx.x & 31, c = lane & 15;
    const int half = threadIdx.x >> 4, halves = blockDim.x >> 4;
    const int tok0 = blockIdx.x * DELTA_TOKENS, h0 = blockIdx.y * DELTA_HEADS;
    const int nt = min(DELTA_TOKENS, T - tok0), nh = min(DELTA_HEADS, NH - h0), rows = nt * nh;
    const bool busy = c < D / 8;
    // every half-warp runs the same number of rounds (the shuffles need the whole warp): as many as the block's
    // rows take, not as many as a block of DELTA_HEADS heads would
    const int step = halves * DELTA_ROWS, end = (rows + step - 1) / step * step;
    for (int r0 = half * DELTA_ROWS; r0 < end; r0 += step) {
        // every row's loads first, none behind a branch (a lane off the row, or a row past the block's, reads row
        // 0's elements and adds zero), so that all DELTA_ROWS rows are in flight at once
        float acc[DELTA_ROWS], a[DELTA_ROWS][8], g[DELTA_ROWS][8];
        bool on[DELTA_ROWS];
#pragma unroll
        for (int j = 0; j < DELTA_ROWS; ++j) {
            const int r = r0 + j;  // token-major within the block: r = i nh + hh
            const int i = r / nh, tok = tok0 + i, h = h0 + r - i * nh;
            on[j] = busy && r < rows;
            load8_f32(O + (on[j] ? tok * ldo + h * D + 8 * c : 0), a[j]);
            load8_f32(dO + (on[j] ? tok * ldg + h * hsg + 8 * c : 0), g[j]);
        }
#pragma unroll
        for (int j = 0; j < DELTA_ROWS; ++j) {
            acc[j] = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[j] = fmaf(a[j][e], g[j][e], acc[j]);
            if (!on[j]) acc[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < DELTA_ROWS; ++j) {
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
            const int r = r0 + j;
            if (c == 0 && r < rows) {
                const int i = r / nh;
                sums[r - i * nh][i] = acc[j];
            }
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < DELTA_TOKENS * DELTA_HEADS; k += blockDim.x) {
        const int hh = k / DELTA_TOKENS, i = k - hh * DELTA_TOKENS;
        if (hh < nh && i < nt) {
            const i64 at = (i64)(h0 + hh) * T + tok0 + i;
            delta[at] = sums[hh][i];
            if (lse2) lse2[at] = __fmul_rn(lse[at], lse_k);
            if (sem) sem[at] = 0;
        }
    }
}
