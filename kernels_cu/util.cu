// Small utility kernels shared by both ops and by the benchmark.
#include "common.cuh"

// Does nothing: the benchmark times it to measure launch latency on the GPU.
extern "C" __global__ void empty_kernel() {}

// Busy for `ns` nanoseconds of the global timer (launched as one warp): the benchmark's hold, which keeps the GPU
// occupied after the L2 flush until the host has issued the call being timed. Touches no memory.
extern "C" __global__ void spin_ns(i64 ns) {
    i64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// The SM clock in MHz, from `ns` nanoseconds of the global timer against the SM's cycle counter (launched as one
// warp; lane 0 writes out[0]): the benchmark reads it right after each timed call, so that a figure taken with
// the clocks lowered (the power cap under a long tensor-core load) says so.
extern "C" __global__ void sm_clock_mhz(i64 ns, float* out) {
    i64 t0, t, c0, c;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    c0 = clock64();
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    c = clock64();
    if (threadIdx.x == 0) out[0] = (float)((double)(c - c0) * 1e3 / (double)(t - t0));
}

// dst = bf16(src) for up to three contiguous fp32 arrays in one launch (n2, n3 may be 0); 16-byte aligned base
// pointers. Each thread owns 8 consecutive elements (the tail by the last thread); blocks [0, b1) cast the first
// array (b1 = ceil(n1 / 2048)), the next ceil(n2 / 2048) the second, the rest the third.
extern "C" __global__ void __launch_bounds__(256) cast_f32_bf16_x3(const float* __restrict__ s1, u16* __restrict__ d1,
                                                                   i64 n1, const float* __restrict__ s2,
                                                                   u16* __restrict__ d2, i64 n2,
                                                                   const float* __restrict__ s3,
                                                                   u16* __restrict__ d3, i64 n3) {
    i64 b = blockIdx.x;
    const i64 b1 = (n1 + 2047) / 2048, b2 = (n2 + 2047) / 2048;
    const float* src = s1;
    u16* dst = d1;
    i64 n = n1;
    if (b >= b1 + b2) { b -= b1 + b2; src = s3; dst = d3; n = n3; }
    else if (b >= b1) { b -= b1; src = s2; dst = d2; n = n2; }
    const i64 base = (b * blockDim.x + threadIdx.x) * 8;
    if (base + 8 <= n) {
        float4 a = reinterpret_cast<const float4*>(src + base)[0];
        float4 c = reinterpret_cast<const float4*>(src + base)[1];
        uint4 w;
        w.x = pack2<BF16>(a.x, a.y); w.y = pack2<BF16>(a.z, a.w);
        w.z = pack2<BF16>(c.x, c.y); w.w = pack2<BF16>(c.z, c.w);
        *reinterpret_cast<uint4*>(dst + base) = w;
    } else {
        for (i64 i = base; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
    }
}

// dst[i] = src[i] * k (fp32, rounded once: what an elementwise multiply gives); src may be dst.
extern "C" __global__ void __launch_bounds__(256) scale_f32(const float* src, float* dst, float k, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = __fmul_rn(src[i], k);
}

// Column sums of a row-major [rows, cols] fp32 matrix (row stride ld), in two deterministic stages: colsum_partial
// (or the casts and transposes that sum as they go) per chunk of rows, then colsum_finish over the chunks.
//
// The sum over rows [r0, r1) of column c (< cols) of src (row stride ld), by a block of 8 warps with lanes on
// consecutive columns: warp g adds rows r0 + g, r0 + g + 8, ..., then warp 0 adds the 8 sums in order (a fixed
// order, the same bits every run and grid). The sum is returned to warp 0; the caller synchronises before acc_s
// is used again.
__device__ __forceinline__ float block_column_sum(const float* __restrict__ src, i64 ld, int r0, int r1, int c,
                                                  int cols, float (*acc_s)[33]) {
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
    float acc = 0.f;
    if (c < cols) {
#pragma unroll 4
        for (int r = r0 + g; r < r1; r += 8) acc += src[(i64)r * ld + c];
    }
    acc_s[g][lane] = acc;
    __syncthreads();
    float s = 0.f;
    if (g == 0) {
#pragma unroll
        for (int k = 0; k < 8; ++k) s += acc_s[k][lane];
    }
    return s;
}

// colsum_partial: block x owns 32 columns; chunk y (of `chunk` rows; max(1, ceil(rows / chunk)) chunks, the
// rows of part) goes to block row y, y + gridDim.y, ... so that grid y can stay within its 65535 limit (the
// host launches min(chunks, 65535)). Per chunk block_column_sum: part[y * cols + c]. Each chunk's sum does not
// depend on the grid.
extern "C" __global__ void __launch_bounds__(256) colsum_partial(const float* __restrict__ src,
                                                                 float* __restrict__ part, int rows, int cols, i64 ld,
                                                                 int chunk) {
    __shared__ float acc_s[8][33];
    const int c = blockIdx.x * 32 + (threadIdx.x & 31);
    const int nchunk = rows > 0 ? (rows - 1) / chunk + 1 : 1;  // no overflow near INT_MAX rows
    for (int y = blockIdx.y; y < nchunk; y += gridDim.y) {
        if (y != blockIdx.y) __syncthreads();  // warp 0 has read the previous chunk's acc_s
        const int r0 = y * chunk, r1 = r0 + min(rows - r0, chunk);
        const float s = block_column_sum(src, ld, r0, r1, c, cols, acc_s);
        if (threadIdx.x < 32 && c < cols) part[(i64)y * cols + c] = s;
    }
}

// colsum_partial's column sums (the same chunks, rows and order: the same bits) and, from the same reads, dst =
// bf16(src) (row-major [rows, cols], row stride cols): one pass where a bf16 copy and the bias gradient are both
// wanted. V consecutive columns a lane (4: cols % 4 == 0, 16-byte aligned rows; else 1), 32 V columns a block.
template <int V>
__device__ __forceinline__ void cast_colsum(const float* __restrict__ src, u16* __restrict__ dst,
                                            float* __restrict__ part, int rows, int cols, int chunk) {
    __shared__ float acc_s[8][32 * V + 1];
    const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
    const int c = (blockIdx.x * 32 + lane) * V;
    const int nchunk = rows > 0 ? (rows - 1) / chunk + 1 : 1;
    for (int y = blockIdx.y; y < nchunk; y += gridDim.y) {
        if (y != blockIdx.y) __syncthreads();
        const int r0 = y * chunk, r1 = r0 + min(rows - r0, chunk);
        float acc[V];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = 0.f;
        if (c < cols) {
#pragma unroll 4
            for (int r = r0 + g; r < r1; r += 8) {
                const i64 at = (i64)r * cols + c;
                if constexpr (V == 4) {
                    const float4 x = *reinterpret_cast<const float4*>(src + at);
                    acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
                    *reinterpret_cast<uint2*>(dst + at) = make_uint2(pack2<BF16>(x.x, x.y), pack2<BF16>(x.z, x.w));
                } else {
                    const float x = src[at];
                    acc[0] += x;
                    dst[at] = f32_to_bf16(x);
                }
            }
        }
#pragma unroll
        for (int v = 0; v < V; ++v) acc_s[g][lane * V + v] = acc[v];
        __syncthreads();
        if (g == 0 && c < cols) {
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < 8; ++k) s += acc_s[k][lane * V + v];
                part[(i64)y * cols + c + v] = s;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) cast_colsum_bf16(const float* __restrict__ src, u16* __restrict__ dst,
                                                                   float* __restrict__ part, int rows, int cols,
                                                                   int chunk) {
    cast_colsum<1>(src, dst, part, rows, cols, chunk);
}

extern "C" __global__ void __launch_bounds__(256) cast_colsum_bf16_v4(const float* __restrict__ src,
                                                                      u16* __restrict__ dst, float* __restrict__ part,
                                                                      int rows, int cols, int chunk) {
    cast_colsum<4>(src, dst, part, rows, cols, chunk);
}

// colsum_finish: out[c] = the sum over n partial rows of part[k * cols + c] (block_column_sum: 8 loads in flight
// per column where one thread a column would wait on each). Where out2 is given, the sum also goes to
// out2[c * ld2]: a column of a K-major operand (transpose_colsum's first pad column).
extern "C" __global__ void __launch_bounds__(256) colsum_finish(const float* __restrict__ part, float* __restrict__ out,
                                                                int n, int cols, float* __restrict__ out2, i64 ld2) {
    __shared__ float acc_s[8][33];
    const int c = blockIdx.x * 32 + (threadIdx.x & 31);
    const float s = block_column_sum(part, cols, 0, n, c, cols, acc_s);
    if (threadIdx.x < 32 && c < cols) {
        out[c] = s;
        if (out2) out2[(i64)c * ld2] = s;
    }
}

// dst[c, r] = src[r, c] for a row-major fp32 [rows, cols] matrix, dst row stride dst_ld >= rows with columns
// [rows, dst_ld) zero-filled: a K-major GEMM operand (tf32 tensor cores read both operands along the
// contraction) whose rows stay 16-byte aligned. Block x owns 32 columns of src; the ceil(dst_ld / 32) tiles
// along dst's rows go to block row y, y + gridDim.y, ... (the host launches grid y = min(tiles, 65535), the
// hardware limit; below it every block moves one tile, as it always did); 32 x 8 threads.
// The same for cols a multiple of 4 (16-byte rows) with 16-byte accesses both ways: 64 x 64 tiles, grid y =
// min(ceil(dst_ld / 64), 65535); each of 256 threads moves four float4 in and four out per tile. With SUMS, also
// the column sums of each 64-row tile of src: part[by * cols + c] for tile by (rows 64 by .. 64 by + 63, zeros
// past `rows`; ceil(dst_ld / 64) partial rows), each the sum of the four rows a lane holds, then of the 16 lanes
// of a half-warp in a fixed butterfly (the same bits every run and grid): one read of src for a K-major operand
// and its bias gradient (colsum_finish adds the partial rows in order).
template <bool SUMS>
__device__ __forceinline__ void transpose_v4(const float* __restrict__ src, float* __restrict__ dst,
                                             float* __restrict__ part, int rows, int cols, int dst_ld) {
    __shared__ float tile[64][65];  // [src row][src col]
    const int c0 = blockIdx.x * 64;
    const int q = threadIdx.x & 15, k0 = threadIdx.x >> 4;  // float4 q of a 64-float row; rows k0 + 16 i
    const int ny = dst_ld / 64 + (dst_ld % 64 != 0);
    for (int by = blockIdx.y; by < ny; by += gridDim.y) {
        const int r0 = by * 64;
        if (by != blockIdx.y) __syncthreads();  // every thread has read the previous tile
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = k0 + 16 * i, r = r0 + k, c = c0 + 4 * q;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < rows && c < cols) v = *reinterpret_cast<const float4*>(src + (i64)r * cols + c);
            tile[k][4 * q] = v.x; tile[k][4 * q + 1] = v.y; tile[k][4 * q + 2] = v.z; tile[k][4 * q + 3] = v.w;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = k0 + 16 * i, c = c0 + k, r = r0 + 4 * q;  // dst row c, columns r .. r + 3
            const float4 v = make_float4(tile[4 * q][k], tile[4 * q + 1][k], tile[4 * q + 2][k], tile[4 * q + 3][k]);
            if (c < cols && r < dst_ld)  // rows past `rows` read the zeros staged above
                *reinterpret_cast<float4*>(dst + (i64)c * dst_ld + r) = v;
            if constexpr (SUMS) {
                float sum = (v.x + v.y) + (v.z + v.w);
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);  // the half-warp's
                if (q == 0 && c < cols) part[(i64)by * cols + c] = sum;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) transpose_f32_v4(const float* __restrict__ src,
                                                                   float* __restrict__ dst, int rows, int cols,
                                                                   int dst_ld) {
    transpose_v4<false>(src, dst, nullptr, rows, cols, dst_ld);
}

extern "C" __global__ void __launch_bounds__(256) transpose_colsum_f32_v4(const float* __restrict__ src,
                                                                          float* __restrict__ dst,
                                                                          float* __restrict__ part, int rows,
                                                                          int cols, int dst_ld) {
    transpose_v4<true>(src, dst, part, rows, cols, dst_ld);
}

extern "C" __global__ void __launch_bounds__(256) transpose_f32(const float* __restrict__ src, float* __restrict__ dst,
                                                                int rows, int cols, int dst_ld) {
    __shared__ float tile[32][33];
    const int c0 = blockIdx.x * 32;
    const int ny = dst_ld / 32 + (dst_ld % 32 != 0);
    for (int by = blockIdx.y; by < ny; by += gridDim.y) {
        const int r0 = by * 32;
        if (by != blockIdx.y) __syncthreads();  // every thread has read the previous tile
        for (int k = threadIdx.y; k < 32; k += 8) {
            const int r = r0 + k, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[k][threadIdx.x] = src[(i64)r * cols + c];
        }
        __syncthreads();
        for (int k = threadIdx.y; k < 32; k += 8) {
            const int c = c0 + k, r = r0 + threadIdx.x;
            if (c < cols && r < dst_ld) dst[(i64)c * dst_ld + r] = r < rows ? tile[threadIdx.x][k] : 0.f;
        }
    }
}
