// Attention kernels for Hopper (sm_90a, bf16): TMA tile loads on mbarriers and wgmma products; the forward makes
// one pass over K/V per query tile, the backward one pass over the queries per key tile (key/value-stationary,
// deterministic dQ). Compiled for sm_90a only, once per head dim (-DATTN_HEAD_DIM=<D>: 64, 80, 96 or 128).
//
//   hop_fwd_bf16         O (bf16, row stride ldo) and lse2 [NH][T] of q, k, v given as tensor maps     sm90/forward.cuh
//   hop_delta_<o><g>     delta = rowsum(dO * O) [NH][T]; o, g = b (bf16) or f (fp32)                   sm90/backward.cuh
//   hop_bwd_bf16[_plain] dK, dV through the block epilogue, dQ into the ordered fp32 accumulator      sm90/backward.cuh
//   hop_dq_bf16[_plain]  dQ from the accumulator through the block epilogue
// The vision block's kernels (no suffix) write bf16 GEMM operands with the RoPE backward of dQ and dK; the
// _plain ones write fp32 gradients (varlen attention alone). Tensor maps (TmaDesc) are 3-D views (D, NH, T) of
// the bf16 operands, 64 x 1 x rows boxes, 128-byte swizzle (cupy_rope/attention/hopper.py builds them).
#include "attention/config.cuh"
#include "attention/epilogue.cuh"
#include "attention/sm90/backward.cuh"

#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 128
#endif
#define HD ATTN_HEAD_DIM

extern "C" __global__ void __launch_bounds__(256, 1) hop_fwd_bf16(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2) {
    hop_fwd<HD, BF16>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2);
}

#define HOP_BWD(NAME, OT, ROPE)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                                     \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, \
        const __grid_constant__ TmaDesc tdo, const int* tiles, const float* lse, const float* delta, float* dqacc, \
        int* sem, OT::T* dk_out, OT::T* dv_out, i64 out_ld, const float* cs, const float* sn, float* part,        \
        float* outT, int ldt, int T, float scale_log2, float scaling) {                                            \
        hop_bwd<HD, OT, ROPE>(&tq, &tk, &tv, &tdo, tiles, lse, delta, dqacc, sem, dk_out, dv_out, out_ld, cs, sn,  \
                              part, outT, ldt, T, scale_log2, scaling);                                            \
    }
HOP_BWD(hop_bwd_bf16, BF16, true)
HOP_BWD(hop_bwd_bf16_plain, F32, false)

#define HOP_DQ(NAME, OT, ROPE)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* dqacc, const int* tiles, OT::T* dq_out,    \
                                                          i64 out_ld, const float* cs, const float* sn,            \
                                                          float* part, float* outT, int ldt, int T) {              \
        hop_dq_finish<HD, OT, ROPE>(dqacc, tiles, dq_out, out_ld, cs, sn, part, outT, ldt, T);                    \
    }
HOP_DQ(hop_dq_bf16, BF16, true)
HOP_DQ(hop_dq_bf16_plain, F32, false)

#define HOP_DELTA(NAME, OT, GT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const OT::T* O, i64 ldo, const GT::T* dO, i64 ldg,     \
                                                          float* delta, int T, int NH) {                           \
        hop_delta<OT, GT>(O, ldo, dO, ldg, delta, T, NH, HD);                                                      \
    }
HOP_DELTA(hop_delta_bb, BF16, BF16)
HOP_DELTA(hop_delta_bf, BF16, F32)
HOP_DELTA(hop_delta_fb, F32, BF16)
HOP_DELTA(hop_delta_ff, F32, F32)
