// Global -> shared copies of the attention operand tiles with cp.async, so that the next tile streams in while
// the current one is multiplied (the kernels double-buffer the streamed tiles).
#pragma once
#include "attention/config.cuh"

// ---- asynchronous copies (cp.async, 16 or 4 bytes per request) ---------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(a), "l"(gmem), "r"(src_bytes) : "memory");
}

// Copy R rows (row stride DK in global, LD in shared) starting at `src`; rows at or past nvalid are zero-filled.
template <int MODE, int D, int R>
__device__ __forceinline__ void copy_tile(typename Smem<MODE>::T* dst, const typename Smem<MODE>::T* src,
                                          int nvalid) {
    typedef typename Smem<MODE>::T ST;
    constexpr int DK = Dims<D>::DK, LD = Layout<MODE, D>::LD, CH = DK * (int)sizeof(ST) / 16;
    for (int c = threadIdx.x; c < R * CH; c += NWARP * 32) {
        const int r = c / CH, k = c - r * CH;
        const bool v = r < nvalid;
        cp_async16(reinterpret_cast<char*>(dst + r * LD) + 16 * k,
                   reinterpret_cast<const char*>(src + (v ? r : 0) * DK) + 16 * k, v ? 16 : 0);
    }
}

// The head of step `it` of a loop over `nit` double-buffered streamed tiles: the next tile's copies are issued
// (issue(it + 1), one commit group) before this tile's are waited for, then the block meets, so that every thread
// sees tile `it` in its buffer and the copy of `it + 1` runs beside the step's products.
template <class Issue>
__device__ __forceinline__ void stream_step(int it, int nit, const Issue& issue) {
    if (it + 1 < nit) { issue(it + 1); cp_async_wait<1>(); } else { cp_async_wait<0>(); }
    __syncthreads();
}
