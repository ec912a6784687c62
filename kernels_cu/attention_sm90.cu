// Attention kernels for Hopper (sm_90a, bf16 and tf32): TMA tile loads on mbarriers and wgmma products; the forward makes
// one pass over K/V per query tile, the backward one pass over the queries per key tile (key/value-stationary,
// deterministic dQ). Compiled for sm_90a only, once per head dim (-DATTN_HEAD_DIM=<D>: 64, 80, 96 or 128) and part
// (HOP_PART, below).
//
//   hop_prep_bf16        the block's q and k (bf16, bias and RoPE) from the QK product's fp32 output  prep.cuh
//   hop_fwd_bf16         O (bf16, row stride ldo) and lse2 [NH][T] of q, k, v given as tensor maps     sm90/forward.cuh
//                        (with dO, the block's: delta and the zeroed dQ counts too, as hop_delta)
//   hop_fwd_bf16_ws_k192 the specialised forward over K/V tiles of 192 keys (head dim 128 only)      sm90/forward_ws.cuh
//   hop_fwd_bf16_ws_persist  the specialised forward, one block per SM walking (head, query tile) units
//   hop_delta_<o><g>     delta = rowsum(dO * O) [NH][T]; o, g = b (bf16) or f (fp32); optionally lse2
//                        from lse and the dQ counts zeroed                                     sm90/backward.cuh
//   hop_bwd_bf16[_plain] dK, dV through the block epilogue, dQ into the ordered fp32 accumulator      sm90/backward.cuh
//   hop_bwd_bf16_ws[_plain]  the same, warp-specialised over 384 threads                       sm90/backward_ws.cuh
//   hop_bwd_bf16_ws_plain_dq  and dQ (fp32) from each sequence's last key tile: no hop_dq after it
//   hop_bwd_bf16_ws[_plain]_q80  the specialised backward over query steps of 80 rows (head dim 128 only; tdq:
//                                the tensor map of dqacc its full steps add through, as the
//                                specialised kernels' at head dim 64)
//   hop_dq_bf16[_plain]  dQ from the accumulator through the block epilogue
// The vision block's kernels (no suffix) write bf16 GEMM operands with the RoPE backward of dQ and dK; the
// _plain ones write fp32 gradients (varlen attention alone). Tensor maps (TmaDesc) are 3-D views (D, NH, T) of
// the bf16 operands, 64 x 1 x rows boxes, 128-byte swizzle (cupy_rope/attention/hopper.py builds them).
//
//   hop_fwd_tf32         O (fp32) and lse2 of tf32-rounded fp32 q, k and the permuted v^T     sm90/forward_tf32.cuh
//   hop_fwd_tf32_ws      the same, warp-specialised over 384 threads (Q in registers)         sm90/forward_tf32.cuh
//   hop_fwd_tf32_ws_tail ... its last wave's units split over their keys, then _combine        sm90/forward_tf32.cuh
//   hop_bwd_tf32[_plain] as hop_bwd_bf16 with the transposed copies k^T, q^T, do^T            sm90/backward_tf32.cuh
//   hop_bwd_tf32_ws[_plain]  the same, warp-specialised over 384 threads                     sm90/backward_tf32_ws.cuh
//   hop_bwd_tf32_ws2[_plain][_split]  K and V in registers, two Q/dO stages; _split: the tail split
//                                                                                            sm90/backward_tf32_ws2.cuh
//   hop_dq_tf32[_plain]  dQ (fp32) from the transposed accumulator (two bias rows per tile)
//   hop_t32[_perm]       the transposed tf32 copies [NH][D][Tp], or [NH][D][128 tiles] by tile (tf32.cuh),
//                        optionally with the rounded row copy from the same reads
//   hop_t32_perm_delta   the permuted copy of dO with its rounded rows, and from the same reads the delta pass
//                        (delta with O, lse2 and the zeroed dQ counts) of the varlen API's backward (tf32.cuh)
//   hop_round32          the tf32-rounded copy of an fp32 array (tf32.cuh)
// fp32 tensor maps: (D, NH, T) views in 32 x 1 x rows boxes, transposed (Tp, D, NH) views in 32 x D x 1 boxes.
#include "attention/config.cuh"
#include "attention/epilogue.cuh"
#include "attention/prep.cuh"
#include "attention/delta.cuh"
#include "attention/sm90/backward.cuh"
#include "attention/sm90/backward_ws.cuh"
#include "attention/sm90/backward_tf32.cuh"
#include "attention/sm90/backward_tf32_ws.cuh"
#include "attention/sm90/backward_tf32_ws2.cuh"
#include "attention/sm90/forward_tf32.cuh"
#include "attention/sm90/forward_ws.cuh"

#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 128
#endif
#define HD ATTN_HEAD_DIM

// The host sizes each kernel's dynamic shared memory (hopper.smem_bytes). The compile test passes its figures as
// HOP_HOST_SMEM_<kernel>, so that a layout here which the host does not follow fails to compile.
#ifdef HOP_HOST_SMEM_hop_fwd_bf16
static_assert(HopFwdSmem<HD>::BYTES <= HOP_HOST_SMEM_hop_fwd_bf16, "hopper.smem_bytes: hop_fwd_bf16");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_bf16_ws
static_assert(HopFwdSmem<HD, HOP_FWD_STAGES>::BYTES <= HOP_HOST_SMEM_hop_fwd_bf16_ws,
              "hopper.smem_bytes: hop_fwd_bf16_ws");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_bf16_ws_persist
static_assert(HopFwdSmem<HD, HOP_FWD_STAGES>::BYTES <= HOP_HOST_SMEM_hop_fwd_bf16_ws_persist,
              "hopper.smem_bytes: hop_fwd_bf16_ws_persist");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_bf16_ws_persist_bulk
static_assert(HopFwdSmem<HD, HOP_FWD_STAGES>::BYTES <= HOP_HOST_SMEM_hop_fwd_bf16_ws_persist_bulk,
              "hopper.smem_bytes: hop_fwd_bf16_ws_persist_bulk");
#endif
#ifdef HOP_HOST_SMEM_hop_bwd_bf16
static_assert(HopBwdSmem<HD>::BYTES <= HOP_HOST_SMEM_hop_bwd_bf16, "hopper.smem_bytes: hop_bwd_bf16");
#endif
#ifdef HOP_HOST_SMEM_hop_bwd_bf16_ws
static_assert(HopBwdWs<HD>::BYTES <= HOP_HOST_SMEM_hop_bwd_bf16_ws, "hopper.smem_bytes: hop_bwd_bf16_ws");
#endif
#ifdef HOP_HOST_SMEM_hop_bwd_bf16_ws_plain_dq
static_assert(HopBwdWs<HD>::FUSED_BYTES <= HOP_HOST_SMEM_hop_bwd_bf16_ws_plain_dq,
              "hopper.smem_bytes: hop_bwd_bf16_ws_plain_dq");
#endif
#ifdef HOP_HOST_SMEM_hop_bwd_bf16_ws_plain_dq_split
static_assert(HopBwdWs<HD>::FUSED_BYTES <= HOP_HOST_SMEM_hop_bwd_bf16_ws_plain_dq_split,
              "hopper.smem_bytes: hop_bwd_bf16_ws_plain_dq_split");
#endif
#if defined(HOP_HOST_SMEM_hop_fwd_bf16_ws_k192) && HD == 128
static_assert(HopFwdSmem<HD, 2, 192>::BYTES <= HOP_HOST_SMEM_hop_fwd_bf16_ws_k192,
              "hopper.smem_bytes: hop_fwd_bf16_ws_k192");
#endif
#if defined(HOP_HOST_SMEM_hop_bwd_bf16_ws_q80) && HD == 128
static_assert(HopBwdWs<HD, 80>::BYTES <= HOP_HOST_SMEM_hop_bwd_bf16_ws_q80, "hopper.smem_bytes: hop_bwd_bf16_ws_q80");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_tf32
static_assert(Hop32Fwd<HD>::BYTES <= HOP_HOST_SMEM_hop_fwd_tf32, "hopper.smem_bytes: hop_fwd_tf32");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_tf32_ws
static_assert(Hop32Fwd<HD>::BYTES <= HOP_HOST_SMEM_hop_fwd_tf32_ws, "hopper.smem_bytes: hop_fwd_tf32_ws");
#endif
#ifdef HOP_HOST_SMEM_hop_fwd_tf32_ws_tail
static_assert(Hop32Fwd<HD>::BYTES <= HOP_HOST_SMEM_hop_fwd_tf32_ws_tail, "hopper.smem_bytes: hop_fwd_tf32_ws_tail");
#endif
#ifdef HOP_HOST_SMEM_hop_bwd_tf32
static_assert(Hop32Bwd<HD>::BYTES <= HOP_HOST_SMEM_hop_bwd_tf32, "hopper.smem_bytes: hop_bwd_tf32");
#endif

// ---- parts ----------------------------------------------------------------------------------------------------------
// The module is compiled in parts, each a cubin of its own (-DHOP_PART=HOP_PART_<NAME>; the kernels' parts are
// cupy_rope/attention/hopper.py's PART), so that a call compiles only the kernels of what it runs; without
// HOP_PART, every kernel in one build (the lab's tools). REFERENCE holds the kernels no plan of the library
// chooses: the forms the tests hold the specialised kernels to, bit for bit.
#define HOP_PART_BF16_FWD 1
#define HOP_PART_BF16_BWD 2
#define HOP_PART_TF32_FWD 3
#define HOP_PART_TF32_BWD 4
#define HOP_PART_PASSES 5
#define HOP_PART_REFERENCE 6
#ifdef HOP_PART
#if !(HOP_PART >= 1 && HOP_PART <= 6)  // a name that is none of the above reads as 0 here
#error "HOP_PART is one of HOP_PART_BF16_FWD, _BF16_BWD, _TF32_FWD, _TF32_BWD, _PASSES and _REFERENCE"
#endif
#define HOP_IN(NAME) (HOP_PART == HOP_PART_##NAME)
#else
#define HOP_IN(NAME) 1
#endif

// ---- part BF16_FWD --------------------------------------------------------------------------------------------------
#if HOP_IN(BF16_FWD)
extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_bf16_ws(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, const u16* dO, i64 ldg, i64 hsg, float* delta, int* sem) {
    hop_grid_entry();
    hop_fwd_ws<HD, BF16>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2, lse_scale, {dO, ldg, hsg, delta, sem});
}

extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_bf16_ws_persist(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, int ntiles, int units,
    const u16* dO, i64 ldg, i64 hsg, float* delta, int* sem) {
    hop_grid_entry();
    hop_fwd_ws_persist<HD, BF16>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2, lse_scale, ntiles, units,
                                 {dO, ldg, hsg, delta, sem});
}

// the same, O through the copy engine (to: O's tensor map, 64-row boxes)
extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_bf16_ws_persist_bulk(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, int ntiles, int units,
    const u16* dO, i64 ldg, i64 hsg, float* delta, int* sem, const __grid_constant__ TmaDesc to) {
    hop_grid_entry();
    hop_fwd_ws_persist<HD, BF16, true>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2, lse_scale, ntiles, units,
                                       {dO, ldg, hsg, delta, sem}, &to);
}

#if HD == 128
extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_bf16_ws_k192(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, const u16* dO, i64 ldg, i64 hsg, float* delta, int* sem) {
    hop_grid_entry();
    hop_fwd_ws_kv<HD, BF16, 192>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2, lse_scale,
                                 {dO, ldg, hsg, delta, sem});
}
#endif
#endif  // BF16_FWD

// ---- part BF16_BWD --------------------------------------------------------------------------------------------------
#if HOP_IN(BF16_BWD)
// the specialised backward (hop_bwd_ws, query steps of BQ rows): tdq, the tensor map of dqacc its full steps add
// through where dQ is made transposed (BQ 80, or head dim 64: HopBwdWs::DQ_TMA, T64)
#define HOP_BWD_WS(NAME, OT, ROPE, BQ)                                                                             \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                     \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, \
        const __grid_constant__ TmaDesc tdo, const int* tiles, const float* lse, const float* delta, float* dqacc, \
        int* sem, OT::T* dk_out, OT::T* dv_out, i64 out_ld, const float* cs, const float* sn, float* part,        \
        float* outT, int ldt, int T, float scale_log2, float scaling, int order,                                  \
        const __grid_constant__ TmaDesc tdq) {                                                                     \
        hop_grid_entry();                                                                                          \
        hop_bwd_ws<HD, OT, ROPE, false, false, BQ>(&tq, &tk, &tv, &tdo, tiles, lse, delta, dqacc, sem, dk_out,    \
                                                   dv_out, out_ld, cs, sn, part, outT, ldt, T, scale_log2, scaling, \
                                                   order, 0, 1, 0, nullptr, nullptr, nullptr, &tdq);              \
    }
HOP_BWD_WS(hop_bwd_bf16_ws, BF16, true, HOP_BQ)
HOP_BWD_WS(hop_bwd_bf16_ws_plain, F32, false, HOP_BQ)
// the plain specialised backward that also writes dQ (from each sequence's last key tile): no hop_dq after it
extern "C" __global__ void __launch_bounds__(384, 1) hop_bwd_bf16_ws_plain_dq(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const __grid_constant__ TmaDesc tdo, const int* tiles, const float* lse, const float* delta, float* dqacc,
    int* sem, float* dk_out, float* dv_out, i64 out_ld, const float* cs, const float* sn, float* part, float* outT,
    int ldt, int T, float scale_log2, float scaling, int order, float* dq_out) {
    hop_grid_entry();
    hop_bwd_ws<HD, F32, false, true>(&tq, &tk, &tv, &tdo, tiles, lse, delta, dqacc, sem, dk_out, dv_out, out_ld, cs,
                                     sn, part, outT, ldt, T, scale_log2, scaling, order, 0, 1, 0, nullptr, nullptr,
                                     dq_out);
}

// ..._q80: the specialised backward with query steps of 80 rows (HopBwdWs); head dim 128 only
#if HD == 128
HOP_BWD_WS(hop_bwd_bf16_ws_q80, BF16, true, 80)
HOP_BWD_WS(hop_bwd_bf16_ws_plain_q80, F32, false, 80)
#endif

// ..._split: the same with the tail split (split_units units in split_parts parts each, their partial dK and dV
// in split_buf, split_count[unit] parts done; ntiles key tiles, the grid's rows then more)
#define HOP_BWD_SPLIT(NAME, OT, ROPE, FUSED)                                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                     \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, \
        const __grid_constant__ TmaDesc tdo, const int* tiles, const float* lse, const float* delta, float* dqacc, \
        int* sem, OT::T* dk_out, OT::T* dv_out, i64 out_ld, const float* cs, const float* sn, float* part,        \
        float* outT, int ldt, int T, float scale_log2, float scaling, int order, int split_units, int split_parts, \
        int ntiles, float* split_buf, int* split_count, OT::T* dq_out, const __grid_constant__ TmaDesc tdq) {     \
        hop_grid_entry();                                                                                         \
        hop_bwd_ws<HD, OT, ROPE, FUSED, true>(&tq, &tk, &tv, &tdo, tiles, lse, delta, dqacc, sem, dk_out, dv_out,  \
                                              out_ld, cs, sn, part, outT, ldt, T, scale_log2, scaling, order,      \
                                              split_units, split_parts, ntiles, split_buf, split_count, dq_out,    \
                                              FUSED ? nullptr : &tdq);                                             \
    }
HOP_BWD_SPLIT(hop_bwd_bf16_ws_split, BF16, true, false)
HOP_BWD_SPLIT(hop_bwd_bf16_ws_plain_split, F32, false, false)
HOP_BWD_SPLIT(hop_bwd_bf16_ws_plain_dq_split, F32, false, true)
#endif  // BF16_BWD

// ---- part TF32_FWD --------------------------------------------------------------------------------------------------
#if HOP_IN(TF32_FWD)
extern "C" __global__ void __launch_bounds__(256, 1) hop_fwd_tf32(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tvt,
    const int* tiles, float* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale) {
    hop_grid_entry();
    hop_fwd_tf32<HD>(&tq, &tk, &tvt, tiles, O, ldo, lse, T, scale_log2, lse_scale);
}
extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_tf32_ws(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tvt,
    const int* tiles, float* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale) {
    hop_grid_entry();
    hop_fwd_tf32_ws<HD>(&tq, &tk, &tvt, tiles, O, ldo, lse, T, scale_log2, lse_scale);
}
// the last wave's units split over their key steps (TAIL in sm90/forward_tf32.cuh), then their parts combined
extern "C" __global__ void __launch_bounds__(384, 1) hop_fwd_tf32_ws_tail(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tvt,
    const int* tiles, float* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, int R, int P, int NT,
    float* opart, float* lpart) {
    hop_grid_entry();
    hop_fwd_tf32_ws<HD, true>(&tq, &tk, &tvt, tiles, O, ldo, lse, T, scale_log2, lse_scale, {R, P, NT, opart, lpart});
}
extern "C" __global__ void __launch_bounds__(256) hop_fwd_tf32_combine(const int* tiles, float* O, i64 ldo, float* lse,
                                                                      int T, float lse_scale, int P, int NT,
                                                                      float* opart, float* lpart) {
    hop_grid_entry();
    hop32_fwd_combine<HD>(tiles, {0, P, NT, opart, lpart}, O, ldo, lse, T, lse_scale);
}
#endif  // TF32_FWD

// FN: hop_bwd_tf32 (one consumer warpgroup, 256 threads) or hop_bwd_tf32_ws (two and a producer, 384)
// tdqt: the tensor map of dqacc^T (boxes of 32 queries x D rows), read by the two-stage kernel's copy-engine dQ^T
// (CUPY_ROPE_TF32_DQ_BULK) only; first_stores: the two-stage kernel's first key tiles store their dQ^T shares
// (hopper.first_tile_stores; the one-stage kernels ignore it and add into a zeroed accumulator)
#define HOP_BWD32(NAME, FN, THREADS, ROPE)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                                 \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, \
        const __grid_constant__ TmaDesc tdo, const __grid_constant__ TmaDesc tkt,                                  \
        const __grid_constant__ TmaDesc tqt, const __grid_constant__ TmaDesc tdot,                                 \
        const __grid_constant__ TmaDesc tdqt, const int* tiles, const float* lse, const float* delta,              \
        float* dqacc, int ldq, int* sem, float* dk_out, float* dv_out, i64 out_ld, const float* cs,                \
        const float* sn, float* part, float* outT, int ldt, int T, float scale_log2, float scaling, int order,      \
        int first_stores) {                                                                                        \
        hop_grid_entry();                                                                                          \
        FN<HD, F32, ROPE>(&tq, &tk, &tv, &tdo, &tkt, &tqt, &tdot, &tdqt, tiles, lse, delta, dqacc, ldq, sem,       \
                          dk_out, dv_out, out_ld, cs, sn, part, outT, ldt, T, scale_log2, scaling, order,          \
                          first_stores);                                                                           \
    }

// ---- part TF32_BWD --------------------------------------------------------------------------------------------------
#if HOP_IN(TF32_BWD)
HOP_BWD32(hop_bwd_tf32_ws2, hop_bwd_tf32_ws2, 384, true)
HOP_BWD32(hop_bwd_tf32_ws2_plain, hop_bwd_tf32_ws2, 384, false)
// the tail split (hopper.tail_split; backward_tf32_ws2.cuh's TAIL): the split's parameters after the others
extern "C" __global__ void __launch_bounds__(384, 1) hop_bwd_tf32_ws2_plain_split(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const __grid_constant__ TmaDesc tdo, const __grid_constant__ TmaDesc tkt, const __grid_constant__ TmaDesc tqt,
    const __grid_constant__ TmaDesc tdot, const __grid_constant__ TmaDesc tdqt, const int* tiles, const float* lse,
    const float* delta, float* dqacc, int ldq, int* sem, float* dk_out, float* dv_out, i64 out_ld, const float* cs,
    const float* sn, float* part, float* outT, int ldt, int T, float scale_log2, float scaling, int order,
    int first_stores, int split_units, int split_parts, int nunits, float* split_buf, int* split_count) {
    hop_grid_entry();
    hop_bwd_tf32_ws2<HD, F32, false, true>(&tq, &tk, &tv, &tdo, &tkt, &tqt, &tdot, &tdqt, tiles, lse, delta, dqacc,
                                           ldq, sem, dk_out, dv_out, out_ld, cs, sn, part, outT, ldt, T, scale_log2,
                                           scaling, order, first_stores, split_units, split_parts, nunits,
                                           split_buf, split_count);
}
#endif  // TF32_BWD

// ---- part PASSES ----------------------------------------------------------------------------------------------------
#if HOP_IN(PASSES)
#define HOP_DQ(NAME, OT, ROPE)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* dqacc, const int* tiles, OT::T* dq_out,    \
                                                          i64 out_ld, const float* cs, const float* sn,            \
                                                          float* part, float* outT, int ldt, int T) {              \
        hop_grid_entry();                                                                                          \
        hop_dq_finish<HD, OT, ROPE>(dqacc, tiles, dq_out, out_ld, cs, sn, part, outT, ldt, T);                    \
    }
HOP_DQ(hop_dq_bf16, BF16, true)
#if CUPY_ROPE_PROBE_BF16_GRADS  // the dQ write of the probe (backward_ws.cuh): bf16 into the fp32 output's bytes
HOP_DQ(hop_dq_bf16_plain, BF16, false)
#else
HOP_DQ(hop_dq_bf16_plain, F32, false)
#endif

extern "C" __global__ void __launch_bounds__(256) hop_prep_bf16(const float* qk, const float* bqk, const float* cs,
                                                               const float* sn, u16* out, int T, int H) {
    hop_grid_entry();
    attn_prep_qk<HD>(qk, bqk, cs, sn, out, T, H);
}

#define HOP_DELTA(NAME, OT, GT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const OT::T* O, i64 ldo, const GT::T* dO, i64 ldg,     \
                                                          i64 hsg, float* delta, int T, int NH, const float* lse,  \
                                                          float* lse2, float lse_k, int* sem) {                    \
        hop_grid_entry();                                                                                          \
        delta_pass<OT, GT>(O, ldo, dO, ldg, hsg, delta, T, NH, HD, lse, lse2, lse_k, sem);                         \
    }
HOP_DELTA(hop_delta_bb, BF16, BF16)
HOP_DELTA(hop_delta_bf, BF16, F32)
HOP_DELTA(hop_delta_fb, F32, BF16)
HOP_DELTA(hop_delta_ff, F32, F32)

#define HOP_DQ32(NAME, ROPE)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* dqacc, int ldq, const int* tiles,         \
                                                          float* dq_out, i64 out_ld, const float* cs,              \
                                                          const float* sn, float* part, float* outT, int ldt,      \
                                                          int T) {                                                 \
        hop_grid_entry();                                                                                          \
        hop_dq_finish_t<HD, F32, ROPE>(dqacc, ldq, tiles, dq_out, out_ld, cs, sn, part, outT, ldt, T);            \
    }
HOP_DQ32(hop_dq_tf32, true)
HOP_DQ32(hop_dq_tf32_plain, false)

#define HOP_T32(NAME, PERM)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* in, i64 its, i64 ihs, float* out, int ldt, \
                                                          int T, const int* tiles, float* rows) {                  \
        hop_grid_entry();                                                                                          \
        hop_t32<PERM>(in, its, ihs, out, ldt, T, HD, tiles, rows);                                                 \
    }
HOP_T32(hop_t32, false)
HOP_T32(hop_t32_perm, true)
extern "C" __global__ void __launch_bounds__(256) hop_t32_perm_delta(const float* in, i64 its, i64 ihs, float* out,
                                                                    int ldt, int T, float* rows, const float* O,
                                                                    i64 ots, i64 ohs, float* delta, const float* lse,
                                                                    float* lse2, float lse_k, int* sem) {
    hop_grid_entry();
    hop_t32_delta<true>(in, its, ihs, out, ldt, T, HD, rows, O, ots, ohs, delta, lse, lse2, lse_k, sem);
}
extern "C" __global__ void __launch_bounds__(256) hop_round32(const float4* in, float4* out, i64 n4) {
    hop_grid_entry();
    round_tf32_copy(in, out, n4);
}
#endif  // PASSES

// ---- part REFERENCE -------------------------------------------------------------------------------------------------
#if HOP_IN(REFERENCE)
extern "C" __global__ void __launch_bounds__(256, 1) hop_fwd_bf16(
    const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv,
    const int* tiles, u16* O, i64 ldo, float* lse, int T, float scale_log2, float lse_scale, const u16* dO, i64 ldg, i64 hsg, float* delta, int* sem) {
    hop_grid_entry();
    hop_fwd<HD, BF16>(&tq, &tk, &tv, tiles, O, ldo, lse, T, scale_log2, lse_scale, {dO, ldg, hsg, delta, sem});
}

// FN: hop_bwd (two warpgroups, 256 threads) or hop_bwd_ws (two consumer warpgroups, a producer and dQ writers, 384)
#define HOP_BWD(NAME, FN, THREADS, OT, ROPE)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                                 \
        const __grid_constant__ TmaDesc tq, const __grid_constant__ TmaDesc tk, const __grid_constant__ TmaDesc tv, \
        const __grid_constant__ TmaDesc tdo, const int* tiles, const float* lse, const float* delta, float* dqacc, \
        int* sem, OT::T* dk_out, OT::T* dv_out, i64 out_ld, const float* cs, const float* sn, float* part,        \
        float* outT, int ldt, int T, float scale_log2, float scaling, int order) {                                \
        hop_grid_entry();                                                                                         \
        FN<HD, OT, ROPE>(&tq, &tk, &tv, &tdo, tiles, lse, delta, dqacc, sem, dk_out, dv_out, out_ld, cs, sn, part, \
                         outT, ldt, T, scale_log2, scaling, order);                                                \
    }
HOP_BWD(hop_bwd_bf16, hop_bwd, 256, BF16, true)
HOP_BWD(hop_bwd_bf16_plain, hop_bwd, 256, F32, false)

HOP_BWD32(hop_bwd_tf32, hop_bwd_tf32, 256, true)
HOP_BWD32(hop_bwd_tf32_plain, hop_bwd_tf32, 256, false)
HOP_BWD32(hop_bwd_tf32_ws, hop_bwd_tf32_ws, 384, true)
HOP_BWD32(hop_bwd_tf32_ws_plain, hop_bwd_tf32_ws, 384, false)
#endif  // REFERENCE
