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
// The flash kernels keep no L x L matrix outside registers (the dense form, for sequences of at most 256 tokens,
// stores it); the kernels write disjoint outputs and add nothing atomically (the fp32 dQ partials are summed in a
// fixed order), so the results are bit-identical from run to run.
// Blocks are NWARP warps; each warp owns 16 rows of the block's tile.
//
// The kernels (attn_<kernel>_<precision>, precision fp32 / tf32 / bf16; grid (tiles, heads) but for attn_prep):
//   prep       operands P from q, k, v (qkv's columns), bias, cos/sin and dO                   attention/prep.cuh
//   fwd_dq     per query tile: O, lse2, delta = rowsum(dO * O), then dQ (RoPE-backwarded)     attention/forward.cuh
//   fwd        the forward alone: O (and lse2, where asked)
//   dq         fwd_dq's dQ pass alone, on given lse2 and delta
//   delta      delta and lse2 from the forward's o and lse (the varlen API's backward)         attention/delta.cuh
//   dkdv       per key/value tile: dK (RoPE-backwarded) and dV                                attention/dkdv.cuh
// and, fp32 only, for head dims that are a multiple of 16 (dQ from the key-tile kernel instead):
//   fwd_stats  fwd_dq without its dQ pass: O, lse2 and delta                                  attention/forward.cuh
//   dkdv_dqp   dkdv that also writes dQ partials dqp [key tile][T][H], or adds them into one in key-tile order
//                                                                                             attention/dkdv.cuh
//   dq_reduce  dQ as the ordered sum of the partials (or the one sum)                         attention/dq.cuh
// and the kernels between the batched cuBLAS products of the dense form (short sequences; fp32 and tf32):
//   dense_softmax, dense_softmax_dscores, dense_scatter, dense_pointers                      attention/dense.cuh
// Every gradient kernel also writes its tile's column sums (the bias gradients' partial sums) to part, and
// optionally a transposed copy (gqkvT) for the weight-gradient GEMMs (attention/epilogue.cuh). The block shape,
// the precision modes and the shared-memory row layout are in attention/config.cuh, the cp.async copies in
// attention/cp_async.cuh, the warp-level products in mma.cuh.
#include "attention/config.cuh"
#include "attention/cp_async.cuh"
#include "attention/epilogue.cuh"
#include "attention/prep.cuh"
#include "attention/forward.cuh"
#include "attention/dkdv.cuh"
#include "attention/dq.cuh"
#include "attention/delta.cuh"
#include "attention/dense.cuh"

// ---- exported entry points: one set per precision ----------------------------------------------------------
// The forward kernels are built for two resident blocks per SM in bf16, one in fp32 and tf32.
#define ATTN_ENTRIES(SUF, MODE, D, OT)                                                                           \
    extern "C" __global__ void __launch_bounds__(256) attn_prep_##SUF(                                           \
        const float* q, const float* k, const float* v, int ld, const float* bqkv, const float* cs,             \
        const float* sn, const float* dO, Smem<MODE>::T* P, int T, int H, int nwhich, const int* map) {           \
        attn_prep<MODE, D>(q, k, v, ld, bqkv, cs, sn, dO, P, T, H, nwhich, reinterpret_cast<const int2*>(map));  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) attn_dense_softmax_##SUF(                                  \
        const float* S, float* P, i64 rows, int L, float scale_log2, float* lse, float lse_scale, int t0, int NH, \
        int T) {                                                                                                  \
        dense_softmax(S, P, rows, L, scale_log2, lse, lse_scale, t0, NH, T);                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) attn_dense_softmax_dscores_##SUF(                          \
        float* S, float* dP, i64 rows, int L, float scale_log2, float scaling) {                                  \
        dense_softmax_dscores(S, dP, rows, L, scale_log2, scaling);                                               \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) attn_dense_scatter_##SUF(                                   \
        const float* src, const int* map, const float* cs, const float* sn, const float* bias, int rope_slices,   \
        float* out, int out_ld, float* outT, int ldt, float* part, int T, int NH) {                               \
        dense_scatter<D>(src, reinterpret_cast<const int2*>(map), cs, sn, bias, rope_slices, out, out_ld, outT,   \
                         ldt, part, T, NH);                                                                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) attn_dense_pointers_##SUF(                                  \
        const long long* off, long long E, char** out, char* b0, char* b1, char* b2, char* b3, char* b4,          \
        char* b5, float* ot, int ot_ld, int T, int H, const float* bias) {                                        \
        dense_pointers(off, E, out, b0, b1, b2, b3, b4, b5, ot, ot_ld, T, H, bias);                               \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NWARP * 32, MODE == MODE_BF16 ? 2 : 1) attn_fwd_dq_##SUF(       \
        const Smem<MODE>::T* P, const float* cs, const float* sn, const float* dO, const int* tiles, OT::T* O,    \
        float* Ot, float* lse, float* delta, OT::T* gqkv, float* gqkvT, float* part, int T, int ldt, int H,      \
        float scale_log2, float scaling) {                                                                        \
        attn_fwd_dq<MODE, D, OT, 2>(P, cs, sn, dO, tiles, O, Ot, lse, delta, gqkv, gqkvT, part, T, ldt, H,       \
                                    scale_log2, scaling);                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NWARP * 32, MODE == MODE_BF16 ? 2 : 1) attn_fwd_##SUF(          \
        const Smem<MODE>::T* P, const int* tiles, OT::T* O, float* lse, int T, int H, float scale_log2) {        \
        attn_fwd_dq<MODE, D, OT, 0>(P, nullptr, nullptr, nullptr, tiles, O, nullptr, lse, nullptr, nullptr,      \
                                    nullptr, nullptr, T, T, H, scale_log2, 0.f);                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NWARP * 32, MODE == MODE_BF16 ? 2 : 1) attn_dq_##SUF(           \
        const Smem<MODE>::T* P, const float* cs, const float* sn, const int* tiles, float* lse, float* delta,    \
        OT::T* gqkv, float* gqkvT, float* part, int T, int ldt, int H, float scale_log2, float scaling) {         \
        attn_fwd_dq<MODE, D, OT, 3>(P, cs, sn, nullptr, tiles, nullptr, nullptr, lse, delta, gqkv, gqkvT, part,  \
                                    T, ldt, H, scale_log2, scaling);                                              \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) attn_delta_##SUF(                                          \
        const void* O, int o_bf16, i64 ldo, const OT::T* dO, i64 ldg, i64 hsg, float* delta, int T, int NH,      \
        const float* lse, float* lse2, float lse_k, int* sem) {                                                   \
        if (o_bf16)                                                                                               \
            delta_pass<BF16, OT>(static_cast<const u16*>(O), ldo, dO, ldg, hsg, delta, T, NH, D, lse, lse2, lse_k, \
                                 sem);                                                                            \
        else                                                                                                      \
            delta_pass<F32, OT>(static_cast<const float*>(O), ldo, dO, ldg, hsg, delta, T, NH, D, lse, lse2,      \
                                lse_k, sem);                                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dkdv_##SUF(                                    \
        const Smem<MODE>::T* P, const float* cs, const float* sn, const int* tiles, const float* lse,            \
        const float* delta, OT::T* gqkv, float* gqkvT, float* part, int T, int ldt, int H, float scale_log2,      \
        float scaling) {                                                                                          \
        attn_dkdv<MODE, D, OT, false>(P, cs, sn, tiles, lse, delta, gqkv, gqkvT, part, nullptr, nullptr, T, ldt, \
                                      H, scale_log2, scaling);                                                    \
    }

// The module is compiled once per head dimension (-DATTN_HEAD_DIM=<D>, default 128) and precision:
// -DATTN_MODES=<1 << MODE_P> builds the entry points of that mode alone (cupy_rope/attention/kernels.py,
// build_options), so that a call compiles the kernels of its precision and no more; by default every mode (one
// build for the lab's tools).
#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 128
#endif
#ifndef ATTN_MODES
#define ATTN_MODES ((1 << MODE_FP32) | (1 << MODE_TF32) | (1 << MODE_BF16))
#endif
#if ATTN_MODES <= 0 || ATTN_MODES >= (1 << 3)
#error "ATTN_MODES is a mask of 1 << MODE_FP32, 1 << MODE_TF32 and 1 << MODE_BF16"
#endif
#define ATTN_BUILDS(MODE) ((ATTN_MODES >> (MODE)) & 1)
#if ATTN_BUILDS(MODE_FP32)
ATTN_ENTRIES(fp32, MODE_FP32, ATTN_HEAD_DIM, F32)
#endif
#if ATTN_BUILDS(MODE_TF32)
ATTN_ENTRIES(tf32, MODE_TF32, ATTN_HEAD_DIM, F32)
#endif
#if ATTN_BUILDS(MODE_BF16)
ATTN_ENTRIES(bf16, MODE_BF16, ATTN_HEAD_DIM, BF16)
#endif

// fp32 with dQ from the key-tile kernel (head dims with blocked scores: a multiple of 16): forward with lse2 and
// delta only, dK/dV with dQ partials, and their reduction.
#if ATTN_HEAD_DIM % 16 == 0 && ATTN_BUILDS(MODE_FP32)
extern "C" __global__ void __launch_bounds__(NWARP * 32, 1) attn_fwd_stats_fp32(
    const float* P, const float* cs, const float* sn, const float* dO, const int* tiles, float* O, float* Ot,
    float* lse, float* delta, float* gqkv, float* gqkvT, float* part, int T, int ldt, int H, float scale_log2,
    float scaling) {
    attn_fwd_dq<MODE_FP32, ATTN_HEAD_DIM, F32, 1>(P, cs, sn, dO, tiles, O, Ot, lse, delta, gqkv, gqkvT, part, T,
                                                  ldt, H, scale_log2, scaling);
}
extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dkdv_dqp_fp32(
    const float* P, const float* cs, const float* sn, const int* tiles, const float* lse, const float* delta,
    float* gqkv, float* gqkvT, float* part, float* dqp, int* sem, int T, int ldt, int H, float scale_log2,
    float scaling) {
    attn_dkdv<MODE_FP32, ATTN_HEAD_DIM, F32, true>(P, cs, sn, tiles, lse, delta, gqkv, gqkvT, part, dqp, sem, T,
                                                   ldt, H, scale_log2, scaling);
}
extern "C" __global__ void __launch_bounds__(NWARP * 32) attn_dq_reduce_fp32(
    const float* dqp, const float* cs, const float* sn, const int* tiles, float* gqkv, float* gqkvT, float* part,
    int T, int ldt, int H, int slots) {
    attn_dq_reduce<ATTN_HEAD_DIM, F32>(dqp, cs, sn, tiles, gqkv, gqkvT, part, T, ldt, H, slots);
}
#endif
