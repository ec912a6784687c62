// Kernel 3, attn_dq_reduce: dQ as the ordered sum of attn_dkdv's per-key-tile partials (fp32 with DQP).
#pragma once
#include "attention/config.cuh"
#include "attention/epilogue.cuh"

// ---- kernel 3 (with DQP): dQ. Block (x, y) owns query tile tiles[x] (BM rows) of head y: sums the sequence's
// key-tile partials in order (deterministic; with slots = 1, the one sum attn_dkdv added them into), then the RoPE
// backward, column sums and writes as in attn_fwd_dq.
template <int D, class OT>
__device__ void attn_dq_reduce(const float* __restrict__ dqp, const float* __restrict__ cs,
                               const float* __restrict__ sn, const int* __restrict__ tiles,
                               typename OT::T* __restrict__ gqkv, float* __restrict__ gqkvT,
                               float* __restrict__ part, int T, int ldt, int H, int slots) {
    constexpr int LDST = D + 4, C4 = D / 4;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* st = reinterpret_cast<float*>(smem_raw);
    const int h = blockIdx.y, tile = blockIdx.x;
    const int row0 = tiles[3 * tile], s0 = tiles[3 * tile + 1], s1 = tiles[3 * tile + 2];
    const int nq = min(BM, s1 - row0), nkt = slots == 1 ? 1 : (s1 - s0 + BM - 1) / BM;
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
