// Shared device helpers for cupy_rope kernels. No CUDA headers are included:
// every kernel compiles under NVRTC with nothing but this directory.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// A block-wide barrier. __syncthreads() is PTX's aligned form (bar.sync 0): every thread of the block must meet it
// at the same instruction. A warp-specialised kernel's producer warps match its consumers' epilogue barriers from a
// loop of their own, so there the barrier is the unaligned form (UNALIGNED), which threads may meet anywhere.
template <bool UNALIGNED = false> __device__ __forceinline__ void block_sync() {
    if constexpr (UNALIGNED) asm volatile("barrier.sync 0;" ::: "memory");
    else __syncthreads();
}
// Barrier over the `count` threads of named barrier `id` (1..15; 0 is block_sync). UNALIGNED where the threads
// that meet on it reach it from different instructions (barrier.sync without .aligned, as block_sync<true>).
template <bool UNALIGNED = false> __device__ __forceinline__ void named_barrier(int id, int count) {
    if constexpr (UNALIGNED) asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
    else asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Arrive at named barrier `id` without waiting (the producer side of a hand-over; the others bar.sync on it).
template <bool UNALIGNED = false> __device__ __forceinline__ void named_arrive(int id, int count) {
    if constexpr (UNALIGNED) asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
    else asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---- ordering between blocks: a count published with a release, acquired before the data it covers is read ----
// 16 bytes from global memory through L2 only (another block's reductions, published by a release this thread's
// block has acquired, are not in this SM's L1)
__device__ __forceinline__ float4 ld_cg_v4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- scalar conversions (no cuda_fp16.h / cuda_bf16.h needed) ----------------
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// bf16 rounding: from sm_80 the hardware's cvt (one instruction for two values), before it the same rounding on
// the bits (6-7 integer instructions per value, which an issue-bound attention loop pays for). Round to nearest
// even either way: the same bits for every number; a NaN stays a NaN (the hardware's canonical one).
// CUPY_ROPE_SOFT_BF16 builds the bit version everywhere (to compare).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(CUPY_ROPE_SOFT_BF16)
#define CUPY_ROPE_HW_BF16 1
#else
#define CUPY_ROPE_HW_BF16 0
#endif

__device__ __forceinline__ u16 f32_to_bf16(float f) {
#if CUPY_ROPE_HW_BF16
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
#endif
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// 2^x on the special-function unit alone (ex2.approx.ftz). exp2f adds a test and two multiplications per value
// to return results below 2^-126 unflushed, which the softmax then adds to sums of order 1; above 2^-126 both
// give the same bits. ex2(-inf) = +0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Element types are tagged so one template serves fp32, fp16 and bf16 storage.
struct F32 { typedef float T; };
struct F16 { typedef u16 T; };
struct BF16 { typedef u16 T; };

template <class E> __device__ __forceinline__ float load_f32(const typename E::T* p);
template <> __device__ __forceinline__ float load_f32<F32>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f32<F16>(const u16* p) { return f16_to_f32(*p); }
template <> __device__ __forceinline__ float load_f32<BF16>(const u16* p) { return bf16_to_f32(*p); }

template <class E> __device__ __forceinline__ typename E::T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<F32>(float f) { return f; }
template <> __device__ __forceinline__ u16 from_f32<F16>(float f) { return f32_to_f16(f); }
template <> __device__ __forceinline__ u16 from_f32<BF16>(float f) { return f32_to_bf16(f); }

// 16-bit pairs packed in a 32-bit word: low half = lower index.
template <class E> __device__ __forceinline__ float2 unpack2(u32 w);
template <> __device__ __forceinline__ float2 unpack2<BF16>(u32 w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<F16>(u32 w) {
    return make_float2(f16_to_f32((u16)(w & 0xffffu)), f16_to_f32((u16)(w >> 16)));
}
template <class E> __device__ __forceinline__ u32 pack2(float a, float b) {
    return (u32)from_f32<E>(a) | ((u32)from_f32<E>(b) << 16);
}
#if CUPY_ROPE_HW_BF16
template <> __device__ __forceinline__ u32 pack2<BF16>(float a, float b) {
    u32 w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));  // the first operand to the upper half
    return w;
}
#endif
