// The dense form of the attention core for short sequences (cupy_rope/attention/dense.py): the products
// S = Q K^T, O = P V, dP = dO V^T, dV = P^T dO, dK = dS^T Q and dQ = dS K run as batched cuBLAS products over
// each run of equal-length sequences, one batch entry per (sequence, head); these kernels do the rest.
//
// Dense layout. A run of n sequences of L tokens starting at token t0 holds, per operand, n * NH consecutive
// L-row blocks (sequence-major, then head) from row NH * t0; token t of sequence s (head h) is row
//   map[t].x + h * map[t].y,   map[t] = (NH * t0 + (s - s0) * NH * L + (t - start of s), L),
// so every operand of a run is one strided batch, and the rows of all runs fill NH * T rows with no padding.
// Score rows (S, P, dS) are L floats, consecutive; they too fill the run's blocks in the same order.
#pragma once
#include "attention/config.cuh"

#define DENSE_MAX_LEN 256  // the longest sequence of the dense form: a score row is at most 8 floats a lane
#define DENSE_PER_LANE (DENSE_MAX_LEN / 32)
#define DENSE_ROWS 64  // tokens per block of dense_scatter

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {  // a fixed butterfly: the same bits every run
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// P = softmax(scaling S) of each of `rows` score rows of L <= DENSE_MAX_LEN floats, one warp a row, in the log2
// domain (scale_log2 = scaling * log2 e), as the flash kernels compute it. With lse, also each row's log-sum-exp
// times lse_scale (ln 2: the natural one) at lse[h * T + token], the launch being the run of L-token sequences
// from token t0 (row r: entry b = r / L = (sequence - first) * NH + h, token t0 + (b / NH) * L + r % L).
__device__ __forceinline__ void dense_softmax(const float* __restrict__ S, float* __restrict__ P, i64 rows, int L,
                                              float scale_log2, float* __restrict__ lse, float lse_scale, int t0,
                                              int NH, int T) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* s = S + row * L;
    float v[DENSE_PER_LANE], m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i) {
        const int j = lane + 32 * i;
        v[i] = j < L ? s[j] * scale_log2 : -__int_as_float(0x7f800000);
        m = fmaxf(m, v[i]);
    }
    m = warp_max(m);
    float l = 0.f;
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i) {
        v[i] = exp2_ftz(v[i] - m);  // ex2(-inf) = +0 past the row's end
        l += v[i];
    }
    l = warp_sum(l);
    const float inv = 1.f / l;
    if (lse && lane == 0) {
        const i64 b = row / L;
        const int h = (int)(b % NH);
        lse[(i64)h * T + t0 + (b / NH) * L + (row - b * L)] = (m + log2f(l)) * lse_scale;
    }
    float* p = P + row * L;
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i)
        if (lane + 32 * i < L) p[lane + 32 * i] = v[i] * inv;
}

// The backward's pass over the scores, from S and dP (dO is known before the attention in the block): P =
// softmax(scaling S) as dense_softmax computes it, then dS = scaling * P * (dP - delta), delta = rowsum(P * dP)
// (= rowsum(dO * O)); P in place of S, dS in place of dP. One warp a row.
__device__ __forceinline__ void dense_softmax_dscores(float* __restrict__ S, float* __restrict__ dP, i64 rows,
                                                      int L, float scale_log2, float scaling) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    float* s = S + row * L;
    float* g = dP + row * L;
    float v[DENSE_PER_LANE], gv[DENSE_PER_LANE], m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i) {
        const int j = lane + 32 * i;
        v[i] = j < L ? s[j] * scale_log2 : -__int_as_float(0x7f800000);
        gv[i] = j < L ? g[j] : 0.f;
        m = fmaxf(m, v[i]);
    }
    m = warp_max(m);
    float l = 0.f;
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i) {
        v[i] = exp2_ftz(v[i] - m);
        l += v[i];
    }
    const float inv = 1.f / warp_sum(l);
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i) {
        v[i] *= inv;
        d += v[i] * gv[i];
    }
    d = warp_sum(d);
#pragma unroll
    for (int i = 0; i < DENSE_PER_LANE; ++i)
        if (lane + 32 * i < L) {
            s[lane + 32 * i] = v[i];
            g[lane + 32 * i] = scaling * v[i] * (gv[i] - d);
        }
}

// Dense rows back to token-major outputs. Block (x, y): tokens [DENSE_ROWS x, DENSE_ROWS (x + 1)) of slice
// y = c * NH + h, c the operand (dq, dk, dv; or O alone), from src + c * NH * T * D (rows of D floats). Slices
// c < rope_slices get the RoPE backward (dx = g cos + rotate_half_inverse(g sin), as write_grad_tile). Each of
// out (row stride out_ld, columns y * D + [0, D)), outT (transposed, row stride ldt, the pad [T, ldt) zeroed) and
// part (the block's column sums, part[x][y * D + c], a fixed order) is written where given. bias (where given,
// columns y * D + [0, D)) is added first: V's bias, when O = P V was made from V without it (rows of P sum to 1).
template <int D>
__device__ __forceinline__ void dense_scatter(const float* __restrict__ src, const int2* __restrict__ map,
                                              const float* __restrict__ cs, const float* __restrict__ sn,
                                              const float* __restrict__ bias, int rope_slices,
                                              float* __restrict__ out, int out_ld,
                                              float* __restrict__ outT, int ldt, float* __restrict__ part, int T,
                                              int NH) {
    constexpr int H2 = D / 2, G = H2 / 4, R = DENSE_ROWS, LDS = D + 1;
    __shared__ float st[R * LDS];
    const int y = blockIdx.y, c = y / NH, h = y - c * NH, t0 = blockIdx.x * R;
    const bool rope = c < rope_slices, keep = outT != nullptr || part != nullptr;
    const float* base = src + (i64)c * NH * T * D;
#pragma unroll 4
    for (int u = threadIdx.x; u < R * G; u += blockDim.x) {
        const int r = u / G, d = (u - r * G) * 4, t = t0 + r;
        float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
        if (t < T) {
            const int2 mp = map[t];
            const float* p = base + ((i64)mp.x + (i64)h * mp.y) * D;
            const float4 a = *reinterpret_cast<const float4*>(p + d), b = *reinterpret_cast<const float4*>(p + d + H2);
            lo[0] = a.x; lo[1] = a.y; lo[2] = a.z; lo[3] = a.w;
            hi[0] = b.x; hi[1] = b.y; hi[2] = b.z; hi[3] = b.w;
            if (bias) {
                const float4 ba = *reinterpret_cast<const float4*>(bias + y * D + d);
                const float4 bb = *reinterpret_cast<const float4*>(bias + y * D + d + H2);
                lo[0] += ba.x; lo[1] += ba.y; lo[2] += ba.z; lo[3] += ba.w;
                hi[0] += bb.x; hi[1] += bb.y; hi[2] += bb.z; hi[3] += bb.w;
            }
            if (rope) rope_bwd4<D>(cs, sn, t, d, lo, hi);
            if (out) {
                float* q = out + (i64)t * out_ld + y * D;
                *reinterpret_cast<float4*>(q + d) = make_float4(lo[0], lo[1], lo[2], lo[3]);
                *reinterpret_cast<float4*>(q + d + H2) = make_float4(hi[0], hi[1], hi[2], hi[3]);
            }
        }
        if (keep)
#pragma unroll
            for (int e = 0; e < 4; ++e) { st[r * LDS + d + e] = lo[e]; st[r * LDS + d + H2 + e] = hi[e]; }
    }
    if (!keep) return;
    __syncthreads();
    if (part)
        for (int col = threadIdx.x; col < D; col += blockDim.x)
            part[(i64)blockIdx.x * gridDim.y * D + y * D + col] = column_sum<R>(st, LDS, col);
    if (outT)
        for (int u = threadIdx.x; u < D * R; u += blockDim.x) {
            const int col = u / R, r = u - col * R, t = t0 + r;
            if (t < ldt) outT[(i64)(y * D + col) * ldt + t] = st[r * LDS + col];  // zero from t = T on
        }
}

// The pointer arrays of the batched products that read V and dO where their products left them (the block's
// dense form in place, attention/dense.py): out[i] = bases[i / E] + off[i] for i < 6 E, the offsets (bytes) made
// once per layout on the host, six kinds of E entries: V, dO, the two score buffers, the dense O and dV. Where the
// O product writes O^T [H, ot_ld] itself (ot given, ot_ld > T), also that operand's pad columns: column T holds
// V's bias (bias[H]), the rest zero, so that a product contracting O^T over its ot_ld columns against a dY^T
// whose column T holds dY's column sums adds colsum(dY) bias^T, the bias O = P V left out (rows of P sum to 1).
__device__ __forceinline__ void dense_pointers(const long long* __restrict__ off, long long E,
                                               char** __restrict__ out, char* b0, char* b1, char* b2, char* b3,
                                               char* b4, char* b5, float* __restrict__ ot, int ot_ld, int T, int H,
                                               const float* __restrict__ bias) {
    const long long n = 6 * E, stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n; i += stride) {
        const int kind = (int)(i / E);
        char* b = kind == 0 ? b0 : kind == 1 ? b1 : kind == 2 ? b2 : kind == 3 ? b3 : kind == 4 ? b4 : b5;
        out[i] = b + off[i];
    }
    if (ot == nullptr) return;
    const int w = ot_ld - T;  // pad columns per row
    for (long long i = first; i < (long long)H * w; i += stride) {
        const long long row = i / w;
        const int j = (int)(i - row * w);
        ot[row * ot_ld + T + j] = j == 0 ? bias[row] : 0.f;
    }
}
