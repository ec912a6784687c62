// Hopper (sm_90a) building blocks of the attention kernels: tensor-memory-access (TMA) tile loads completing on
// mbarriers, wgmma shared-memory descriptors for 128-byte-swizzled tiles, and the fences between them.
//
// Tile layout in shared memory. A tile of R rows x D 16-bit columns is held as ceil(D / 64) column blocks, each
// [R][64] elements (R x 128 bytes), 1024-byte aligned, in the 128-byte swizzle that TMA writes and wgmma reads:
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8). One TMA box (64 columns x 1 head x R rows) fills one
// column block; columns past the head dim are zero-filled by TMA (out of the tensor's bounds).
#pragma once
#include "common.cuh"
typedef unsigned long long u64;

// The CUtensorMap of the driver API: 128 opaque bytes, passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaDesc { u64 w[16]; };

__device__ __forceinline__ u32 cvta_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// ---- programmatic dependent launch --------------------------------------------------------------------------
// Built with -DCUPY_ROPE_PDL=1 (a lab switch; the launcher then starts the module's kernels with programmatic
// stream serialisation: cupy_rope/_kernels.py, Launcher), a kernel's blocks may be placed on the SMs that the
// kernel ahead of it in the stream frees, before that kernel has ended. Every kernel entry calls hop_grid_entry()
// first: it waits until the kernels ahead of it have ended and their memory is visible (griddepcontrol.wait
// returns at once for a kernel launched without the attribute), then lets the next kernel in the stream be
// launched. A kernel touches global memory only after the wait, so it can neither read what is not yet written
// nor overwrite what is still read; the trigger comes after the wait, so a kernel that the next one overtakes has
// itself waited for every earlier kernel. The next kernel's launch and the placement of its blocks then happen
// beside this kernel's last wave instead of after it. The default build holds neither instruction.
#ifndef CUPY_ROPE_PDL
#define CUPY_ROPE_PDL 0
#endif
__device__ __forceinline__ void hop_grid_entry() {
#if CUPY_ROPE_PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- mbarriers -----------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(cvta_smem(bar)), "r"(count) : "memory");
}
// Make the barriers' initialisation visible to the copy engine (async proxy) before any TMA uses them.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// N barriers of one arrival each, initialised by thread 0 and visible to every thread and to TMA on return.
template <int N> __device__ __forceinline__ void mbar_setup(u64* bar) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) mbar_init(&bar[i], 1);
        mbar_init_fence();
    }
    __syncthreads();
}
// One arrival that also announces `bytes` of TMA traffic to wait for.
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(cvta_smem(bar)), "r"(bytes)
                 : "memory");
}
// One plain arrival (a consumer releasing a buffer to the producer).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(cvta_smem(bar)) : "memory");
}
// Wait for the completion of phase `parity` (0, 1, 0, ... for successive uses of the barrier).
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    const u32 a = cvta_smem(bar);
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
}

// ---- TMA: a 3-D box (64 elements x 1 x rows) at coordinates (c0, c1, c2) into shared memory -------------------
__device__ __forceinline__ void tma_load_3d(void* dst, const TmaDesc* desc, u64* bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
        ::"r"(cvta_smem(dst)), "l"(reinterpret_cast<u64>(desc)), "r"(cvta_smem(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
// Load rows [row0, row0 + R) of head h, all NB column blocks, into `dst` ([NB][R][64] swizzled); arrives on `bar`.
template <int NB, int R>
__device__ __forceinline__ void tma_tile(u16* dst, const TmaDesc* desc, u64* bar, int h, int row0) {
#pragma unroll
    for (int b = 0; b < NB; ++b) tma_load_3d(dst + b * R * 64, desc, bar, 64 * b, h, row0);
}

// ---- wgmma ---------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a 128-byte-swizzled operand starting at `p`:
//   K-major (the reduction runs along the 128-byte rows): 8-row groups 1024 bytes apart (SBO); a k16 step is
//   +32 bytes within the row;
//   MN-major (the rows run along the reduction): 8-row groups of the reduction 1024 bytes apart (SBO), the next
//   64 columns of M or N `lbo` bytes on (LBO, the column-block size); a k16 step is +2048 bytes.
__device__ __forceinline__ u64 smem_desc(const void* p, u32 lbo) {
    const u64 a = cvta_smem(p);
    return ((a & 0x3FFFFull) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keep the compiler from touching accumulator registers across the asynchronous wgmma (after the wait).
template <int N> __device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void reg_fence_u(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}
// Ordinary shared-memory stores that wgmma (the async proxy) reads next.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Warp-specialised register split: the producer warpgroup gives registers back, the consumers take them.
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// ---- the m64 accumulator layout ------------------------------------------------------------------------------
// Warp w (of the warpgroup) holds rows 16w .. 16w+15; lane (g = lane / 4, t = lane % 4) holds, for each n8 block
// j, d[4j] = (g, 8j+2t), d[4j+1] = (g, 8j+2t+1), d[4j+2] = (g+8, 8j+2t), d[4j+3] = (g+8, 8j+2t+1).
// The bf16 A fragment of a k16 step kk built from two such n8 blocks (2kk, 2kk+1) of an accumulator:
template <int N>
__device__ __forceinline__ void acc_to_a(u32 (&a)[4], const float (&d)[N], int kk) {
    a[0] = pack2<BF16>(d[8 * kk + 0], d[8 * kk + 1]);
    a[1] = pack2<BF16>(d[8 * kk + 2], d[8 * kk + 3]);
    a[2] = pack2<BF16>(d[8 * kk + 4], d[8 * kk + 5]);
    a[3] = pack2<BF16>(d[8 * kk + 6], d[8 * kk + 7]);
}

// Byte offset of element (r, c) (16-bit) in a [rows][64] 128-byte-swizzled column block.
__device__ __forceinline__ u32 swz128(int r, int c) {
    return (u32)(r * 128 + ((((c >> 3) ^ r) & 7) << 4) + ((c & 7) << 1));
}

// ---- TMA from shared to global memory: a 3-D box written or added (fp32) at (c0, c1, c2) -------------------
// Issued by one thread into its bulk group; the box's shared-memory tile is laid out as the tensor map's swizzle
// says. Ordinary stores into the tile must be fenced for the async proxy (fence_async_smem) before the issue.
__device__ __forceinline__ void tma_store_3d(const TmaDesc* desc, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(reinterpret_cast<u64>(desc)), "r"(cvta_smem(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_reduce_add_3d(const TmaDesc* desc, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(reinterpret_cast<u64>(desc)), "r"(cvta_smem(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The thread's bulk groups but the newest N have read their shared memory (the tile may be written again) ...
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// ... or have completed (their global writes performed).
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Order this thread's completed async-proxy global writes before its later generic ones (a release); and the
// generic-proxy writes it has acquired before its later async-proxy reads of them (bulk_load).
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory by the copy engine,
// completing on `bar` (whose expected bytes the caller has raised by as many)
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(cvta_smem(dst)), "l"(src), "r"(bytes), "r"(cvta_smem(bar)) : "memory");
}

// ---- ordered global reductions (deterministic dQ) -----------------------------------------------------------
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void red_add_v4(float* p, float a, float b, float c, float d) {  // p 16-byte aligned
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
                 : "memory");
}
// fp32 a + b rounded as red.global.add.f32 rounds (to nearest, subnormal inputs and result flushed to zero), so
// that a sum finished in registers has the bits the reduction would have left in memory
__device__ __forceinline__ float add_ftz(float a, float b) {
    float c;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
    return c;
}
