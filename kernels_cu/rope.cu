// 2D RoPE position encoding: forward (cos, sin of idx_theta) and backward
//   grad_idx_theta = -float(grad_cos) * sin(idx_theta) + float(grad_sin) * cos(idx_theta)
// sin/cos come from sincosf (IEEE-accurate, Payne-Hanek reduction for large |theta|);
// no fast-math intrinsics, so |theta| up to 1e5 and beyond stays at fp32 accuracy.
#include "common.cuh"

#define MAXDIM 6

// Element strides of one tensor after the host collapsed contiguous dimensions.
struct Strides { i64 s[MAXDIM]; };

// Offset of flat (row-major) index i for a tensor of `shape` with element strides `st`.
__device__ __forceinline__ void offsets4(i64 i, int ndim, const i64* shape, const i64* a, const i64* b,
                                         const i64* c, const i64* d, i64& oa, i64& ob, i64& oc, i64& od) {
    oa = ob = oc = od = 0;
    for (int k = ndim - 1; k >= 0; --k) {
        i64 q = i / shape[k];
        i64 r = i - q * shape[k];
        i = q;
        oa += r * a[k]; ob += r * b[k]; oc += r * c[k]; od += r * d[k];
    }
}

__device__ __forceinline__ float rope_grad(float gc, float gs, float th) {
    float s, c;
    sincosf(th, &s, &c);
    return fmaf(gs, c, -gc * s);
}

// ---- backward, vectorised: each thread owns 8 consecutive elements ------------------------
// Preconditions (checked on the host): every tensor C-contiguous, base pointers 16-byte aligned.
// The thread owning the last, partial group finishes it element by element.
template <class E>
__device__ __forceinline__ void load8(const typename E::T* p, float* v) {
    uint4 w = *reinterpret_cast<const uint4*>(p);
    float2 a = unpack2<E>(w.x), b = unpack2<E>(w.y), c = unpack2<E>(w.z), d = unpack2<E>(w.w);
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y; v[4] = c.x; v[5] = c.y; v[6] = d.x; v[7] = d.y;
}
template <>
__device__ __forceinline__ void load8<F32>(const float* p, float* v) {
    float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <class E>
__device__ __forceinline__ void store8(typename E::T* p, const float* v) {
    uint4 w;
    w.x = pack2<E>(v[0], v[1]); w.y = pack2<E>(v[2], v[3]); w.z = pack2<E>(v[4], v[5]); w.w = pack2<E>(v[6], v[7]);
    *reinterpret_cast<uint4*>(p) = w;
}
template <>
__device__ __forceinline__ void store8<F32>(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <class E>
__device__ void rope_bwd_vec(const typename E::T* __restrict__ gc, const typename E::T* __restrict__ gs,
                             const float* __restrict__ th, float* __restrict__ out, i64 n) {
    i64 base = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (base + 8 <= n) {
        float a[8], b[8], t[8], o[8];
        load8<E>(gc + base, a);
        load8<E>(gs + base, b);
        load8<F32>(th + base, t);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = rope_grad(a[k], b[k], t[k]);
        store8<F32>(out + base, o);
    } else {
        for (i64 i = base; i < n; ++i) out[i] = rope_grad(load_f32<E>(gc + i), load_f32<E>(gs + i), th[i]);
    }
}

// ---- backward, vectorised by pairs: each thread owns 2 consecutive elements ------------------
// Same preconditions as rope_bwd_vec. Used for small tensors, where the time is latency (one DRAM
// round trip and one sincosf per thread) rather than bandwidth: four times the threads of the
// 8-element path, each with a quarter of the dependent work.
template <class E>
__device__ __forceinline__ float2 load2(const typename E::T* p) {
    return unpack2<E>(*reinterpret_cast<const u32*>(p));
}
template <>
__device__ __forceinline__ float2 load2<F32>(const float* p) {
    return *reinterpret_cast<const float2*>(p);
}

template <class E>
__device__ void rope_bwd_vec2(const typename E::T* __restrict__ gc, const typename E::T* __restrict__ gs,
                              const float* __restrict__ th, float* __restrict__ out, i64 n) {
    i64 base = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (base + 2 <= n) {
        float2 a = load2<E>(gc + base), b = load2<E>(gs + base), t = load2<F32>(th + base);
        *reinterpret_cast<float2*>(out + base) = make_float2(rope_grad(a.x, b.x, t.x), rope_grad(a.y, b.y, t.y));
    } else if (base < n) {
        out[base] = rope_grad(load_f32<E>(gc + base), load_f32<E>(gs + base), th[base]);
    }
}

// ---- backward, general: one element per thread, any strides (ndim <= 6 after collapsing) -----
template <class E>
__device__ void rope_bwd_strided(const typename E::T* __restrict__ gc, const typename E::T* __restrict__ gs,
                                 const float* __restrict__ th, float* __restrict__ out, i64 n, int ndim,
                                 Strides shape, Strides sgc, Strides sgs, Strides sth, Strides sout) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 a, b, c, d;
        offsets4(i, ndim, shape.s, sgc.s, sgs.s, sth.s, sout.s, a, b, c, d);
        out[d] = rope_grad(load_f32<E>(gc + a), load_f32<E>(gs + b), th[c]);
    }
}

// ---- forward: cos and sin of idx_theta, stored in E --------------------------------------
template <class E>
__device__ void rope_fwd_vec(const float* __restrict__ th, typename E::T* __restrict__ cs,
                             typename E::T* __restrict__ sn, i64 n) {
    i64 base = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (base + 8 <= n) {
        float t[8], c[8], s[8];
        load8<F32>(th + base, t);
#pragma unroll
        for (int k = 0; k < 8; ++k) sincosf(t[k], &s[k], &c[k]);
        store8<E>(cs + base, c);
        store8<E>(sn + base, s);
    } else {
        for (i64 i = base; i < n; ++i) {
            float s, c;
            sincosf(th[i], &s, &c);
            cs[i] = from_f32<E>(c);
            sn[i] = from_f32<E>(s);
        }
    }
}

template <class E>
__device__ void rope_fwd_strided(const float* __restrict__ th, typename E::T* __restrict__ cs,
                                 typename E::T* __restrict__ sn, i64 n, int ndim, Strides shape, Strides sth) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 a, b, c, d;
        offsets4(i, ndim, shape.s, sth.s, sth.s, sth.s, sth.s, a, b, c, d);
        float s, co;
        sincosf(th[a], &s, &co);
        cs[i] = from_f32<E>(co);  // outputs are freshly allocated and contiguous
        sn[i] = from_f32<E>(s);
    }
}

// ---- exported entry points (looked up by name from Python) --------------------------------
#define ROPE_ENTRIES(SUF, E)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) rope_bwd_vec_##SUF(                                 \
        const E::T* gc, const E::T* gs, const float* th, float* out, i64 n) {                             \
        rope_bwd_vec<E>(gc, gs, th, out, n);                                                               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) rope_bwd_vec2_##SUF(                                \
        const E::T* gc, const E::T* gs, const float* th, float* out, i64 n) {                             \
        rope_bwd_vec2<E>(gc, gs, th, out, n);                                                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) rope_bwd_strided_##SUF(                             \
        const E::T* gc, const E::T* gs, const float* th, float* out, i64 n, int ndim, Strides shape,       \
        Strides sgc, Strides sgs, Strides sth, Strides sout) {                                             \
        rope_bwd_strided<E>(gc, gs, th, out, n, ndim, shape, sgc, sgs, sth, sout);                         \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) rope_fwd_vec_##SUF(                                 \
        const float* th, E::T* cs, E::T* sn, i64 n) {                                                      \
        rope_fwd_vec<E>(th, cs, sn, n);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) rope_fwd_strided_##SUF(                             \
        const float* th, E::T* cs, E::T* sn, i64 n, int ndim, Strides shape, Strides sth) {                \
        rope_fwd_strided<E>(th, cs, sn, n, ndim, shape, sth);                                              \
    }

ROPE_ENTRIES(f32, F32)
ROPE_ENTRIES(f16, F16)
ROPE_ENTRIES(bf16, BF16)
