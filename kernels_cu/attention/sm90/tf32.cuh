// tf32 building blocks of the sm_90a attention kernels.
//
// wgmma reads tf32 operands K-major only (the reduction runs along the 128-byte shared-memory rows), so an operand
// whose reduction index is the token (V and dO in P V and P^T dO, Q in dS^T Q, K in dS K) comes from a transposed
// copy [NH][D][Tp] in global memory, written by hop_t32 (below) and loaded by TMA like the others.
//
// Tiles hold fp32 words: a 128-byte row is 32 elements, a column block [R][32], one k8 step +32 bytes.
//
// Permuted reduction order. The m64 accumulator gives lane (g, t) the columns 2t and 2t + 1 of each 8, while the
// tf32 A fragment of a k8 step wants columns t and t + 4. When P (an accumulator) is the A operand, the k8 step's
// logical index i is taken as token 8a + perm(i), perm = (0, 2, 4, 6, 1, 3, 5, 7): the A fragment is then the
// accumulator's own registers, and the transposed B copy stores its tokens in the same order within each aligned
// group of 8 (hop_t32 with PERM). The kernels align those tiles to a multiple of 8 tokens for this.
#pragma once
#include "attention/sm90/async.cuh"
#include "attention/sm90/wgmma_ops.cuh"

__device__ __forceinline__ u32 rna_tf32(float f) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

// The tf32 A fragment of k8 step kk of an m64 accumulator d, in the permuted order (rounded to nearest).
template <int N>
__device__ __forceinline__ void acc_to_a_tf32(u32 (&a)[4], const float (&d)[N], int kk) {
    a[0] = rna_tf32(d[4 * kk]);
    a[1] = rna_tf32(d[4 * kk + 2]);
    a[2] = rna_tf32(d[4 * kk + 1]);
    a[3] = rna_tf32(d[4 * kk + 3]);
}

// Rows [row0, row0 + R) of head h of a (D, NH, T) fp32 view, NB column blocks of 32, into dst [NB][R][32].
template <int NB, int R>
__device__ __forceinline__ void tma_rows32(float* dst, const TmaDesc* desc, u64* bar, int h, int row0) {
#pragma unroll
    for (int b = 0; b < NB; ++b) tma_load_3d(dst + b * R * 32, desc, bar, 32 * b, h, row0);
}
// Tokens [tok0, tok0 + 32 NK) of head h of a transposed (Tp, D, NH) view (boxes of 32 tokens x D rows) into
// dst [NK][RA][32] (RA >= D rows allocated per block).
template <int NK, int RA>
__device__ __forceinline__ void tma_cols32(float* dst, const TmaDesc* desc, u64* bar, int h, int tok0) {
#pragma unroll
    for (int b = 0; b < NK; ++b) tma_load_3d(dst + b * RA * 32, desc, bar, tok0 + 32 * b, 0, h);
}

// Operand offsets are added to a base descriptor inside each wgmma (wgmma_ops.cuh), in 16-byte units (shared
// memory addresses stay below 256 KB, so the 14-bit address field does not carry).
__host__ __device__ constexpr u32 u16b(int floats) { return (u32)(floats * 4 / 16); }  // a float offset

// Descriptor offset of k8 step kk in a transposed tile [2][D][32] (K-major: each k8 step is 8 tokens, 32 bytes
// on, the second 32-token block D * 128 bytes on).
template <int D> __host__ __device__ constexpr u32 hop32_token_step(int kk) {
    return u16b((kk >> 2) * D * 32 + (kk & 3) * 8);
}

// acc += A B over the tokens of a transposed tile (B = b0), A the token-indexed fragments a[kk] (KK of them);
// issued, not committed.
template <int D, int KK>
__device__ __forceinline__ void hop32_rs_tokens(float (&acc)[D / 2], const u32 (&a)[KK][4], u64 b0) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) wgmma_rs_tf32<D>(acc, a[kk], b0, 1, hop32_token_step<D>(kk));
}

// Byte offset of fp32 element (r, c) in a [rows][32] 128-byte-swizzled column block.
__device__ __forceinline__ u32 swz128w(int r, int c) {
    return (u32)(r * 128 + ((((c >> 2) ^ r) & 7) << 4) + ((c & 3) << 2));
}

// The tf32 A fragments of rows r0 + (g, g + 8) of a [NB][ROWS][32] 128-byte-swizzled tile (as tma_rows32 lays it),
// one per k8 step of the head dim: a[0] = (g, t), a[1] = (g + 8, t), a[2] = (g, t + 4), a[3] = (g + 8, t + 4).
// Volatile loads: the kernels reuse the tile's memory once it is read (the forward's Q as a K/V stage, the
// backward's K and V as a Q/dO stage), so the loads must not be repeated later. Each value is rounded to nearest
// here, so a tile copied from the operand as given (the varlen API's q, or k and v) gives the fragments of its
// rounded copy; on a tile that is rounded already the rounding changes nothing.
__device__ __forceinline__ u32 ld_rna_tf32(const unsigned char* p) {
    return rna_tf32(__uint_as_float(*reinterpret_cast<const volatile u32*>(p)));
}
template <int D, int ROWS>
__device__ __forceinline__ void hop32_rows_to_a(u32 (&a)[D / 8][4], const float* tile, int r0, int g, int t) {
    const unsigned char* base = reinterpret_cast<const unsigned char*>(tile);
    const int r = r0 + g;
#pragma unroll
    for (int ks = 0; ks < D / 8; ++ks) {
        const unsigned char* blk = base + (ks >> 2) * ROWS * 128;
        const int c = (ks & 3) * 8 + t;
        a[ks][0] = ld_rna_tf32(blk + swz128w(r, c));
        a[ks][1] = ld_rna_tf32(blk + swz128w(r + 8, c));
        a[ks][2] = ld_rna_tf32(blk + swz128w(r, c + 4));
        a[ks][3] = ld_rna_tf32(blk + swz128w(r + 8, c + 4));
    }
}

// out[h][d][p] = tf32(in[tok(p)][h][d]) for p < ldt (a multiple of 32), zero where tok(p) is not a token; with
// rows (not null), also rows[tok][h][d] = tf32(in[tok][h][d]) in in's layout (the same strides), for every token
// the copy reads (each once): the rounded row copy of the operand from the same reads.
//   tok(p) = p (< T), or with PERM the permuted order above;
//   with tiles (the tile table, 128-token tiles (first token, sequence start, sequence end)): tile p / 128's
//   first token + p % 128, while inside its sequence. The backward's K^T copy is laid out so: a 64-key block
//   then starts at 128 tile + 64 half, an aligned coordinate (TMA boxes start on 16-byte boundaries).
// in: token stride its, head stride ihs (elements; multiples of 4, in 16-byte aligned, as the tensor maps need
// anyway). Block of 256 threads: a 64-token x 64-column tile of one head (grid: ceil(ldt / 64), ceil(D / 64),
// NH). Each thread loads four float4 of token rows (D is a multiple of 4: a float4 is all in or all out) and
// stores four float4 of transposed rows, so that sixteen bytes a load are in flight rather than four: the copy
// is bound by the bytes in flight per SM. The three steps (t32_load, t32_stage, t32_store_transposed) are shared
// with hop_t32_delta.
struct T32Tile {
    int p0, tok0, end, h, c4, r0;  // positions p0.., tokens [tok0, tok0 + 64) below end; the thread's column, row
};
__device__ __forceinline__ T32Tile t32_tile(int T, const int* __restrict__ tiles) {
    T32Tile t;
    t.p0 = blockIdx.x * 64;
    t.h = blockIdx.z;
    t.c4 = 4 * (threadIdx.x & 15);
    t.r0 = threadIdx.x >> 4;
    t.tok0 = t.p0;
    t.end = T;
    if (tiles) {  // a 64-token tile lies within one 128-token tile
        t.tok0 = tiles[3 * (t.p0 >> 7)] + (t.p0 & 127);
        t.end = tiles[3 * (t.p0 >> 7) + 2];
    }
    return t;
}
// The thread's four float4 of token rows r0 + 16 i, columns d0 + c4 .. + 3 (zero outside the tokens or D).
__device__ __forceinline__ void t32_load(float4 (&x)[4], const float* __restrict__ in, i64 its, i64 ihs,
                                         const T32Tile& t, int d0, int D) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int tok = t.tok0 + t.r0 + 16 * i, d = d0 + t.c4;
        x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (tok < t.end && d < D) x[i] = *reinterpret_cast<const float4*>(in + tok * its + t.h * ihs + d);
    }
}
// ... into the shared tile (and rounded into rows, where not null).
__device__ __forceinline__ void t32_stage(float (&tile)[64][65], const float4 (&x)[4], float* __restrict__ rows,
                                          i64 its, i64 ihs, const T32Tile& t, int d0, int D) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = t.r0 + 16 * i, tok = t.tok0 + r, d = d0 + t.c4;
        tile[r][t.c4] = x[i].x;
        tile[r][t.c4 + 1] = x[i].y;
        tile[r][t.c4 + 2] = x[i].z;
        tile[r][t.c4 + 3] = x[i].w;
        if (rows && tok < t.end && d < D)
            *reinterpret_cast<float4*>(rows + tok * its + t.h * ihs + d) =
                make_float4(__uint_as_float(rna_tf32(x[i].x)), __uint_as_float(rna_tf32(x[i].y)),
                            __uint_as_float(rna_tf32(x[i].z)), __uint_as_float(rna_tf32(x[i].w)));
    }
}
// The staged tile's columns d0.. as rounded transposed rows: output positions p0 + c4 .. + 3 of column d0 + r,
// position p reading the tile's token src(p). After a barrier behind t32_stage.
template <bool PERM>
__device__ __forceinline__ void t32_store_transposed(const float (&tile)[64][65], float* __restrict__ out, int ldt,
                                                     const T32Tile& t, int d0, int D) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = t.r0 + 16 * i, d = d0 + r;
        if (d >= D || t.p0 + t.c4 >= ldt) continue;  // ldt is a multiple of 32: the tile's last 32 may lie past it
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int p = t.c4 + k, j = p & 7, src = (p & ~7) + (PERM ? (j < 4 ? 2 * j : 2 * j - 7) : j);
            v[k] = __uint_as_float(rna_tf32(tile[src][r]));
        }
        *reinterpret_cast<float4*>(out + ((i64)t.h * D + d) * ldt + t.p0 + t.c4) = make_float4(v[0], v[1], v[2], v[3]);
    }
}
template <bool PERM>
__device__ __forceinline__ void hop_t32(const float* __restrict__ in, i64 its, i64 ihs, float* __restrict__ out,
                                        int ldt, int T, int D, const int* __restrict__ tiles,
                                        float* __restrict__ rows) {
    __shared__ float tile[64][65];
    const T32Tile t = t32_tile(T, tiles);
    const int d0 = blockIdx.y * 64;
    float4 x[4];
    t32_load(x, in, its, ihs, t, d0, D);
    t32_stage(tile, x, rows, its, ihs, t, d0, D);
    __syncthreads();
    t32_store_transposed<PERM>(tile, out, ldt, t, d0, D);
}

// hop_t32 (token order: no tiles) over every column tile of the head in one block (grid: ceil(ldt / 64), 1, NH),
// with the delta pass of the varlen API's tf32 backward from the same reads of dO (in): delta[h][tok] =
// sum_d O[tok][h][d] in[tok][h][d], O as given (token stride ots, head stride ohs; 16-byte aligned), lse2[h][tok]
// = lse[h][tok] * lse_k (the one rounding of a multiply) and sem[h][tok] = 0 (the ordered dQ sum's counts), for
// every token < T. A token's sum is whole in its block, in a fixed order (each thread's four products in turn,
// a butterfly over the sixteen threads of the row, the column tiles in turn), so repeat runs give the same bits.
template <bool PERM>
__device__ __forceinline__ void hop_t32_delta(const float* __restrict__ in, i64 its, i64 ihs,
                                              float* __restrict__ out, int ldt, int T, int D,
                                              float* __restrict__ rows, const float* __restrict__ O, i64 ots,
                                              i64 ohs, float* __restrict__ delta, const float* __restrict__ lse,
                                              float* __restrict__ lse2, float lse_k, int* __restrict__ sem) {
    __shared__ float tile[64][65];
    __shared__ float sums[64];
    const T32Tile t = t32_tile(T, nullptr);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int d0 = 0; d0 < D; d0 += 64) {
        float4 x[4], o[4];
        t32_load(x, in, its, ihs, t, d0, D);
        t32_load(o, O, ots, ohs, t, d0, D);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = x[i].x * o[i].x;
            s = fmaf(x[i].y, o[i].y, s);
            s = fmaf(x[i].z, o[i].z, s);
            s = fmaf(x[i].w, o[i].w, s);
#pragma unroll
            for (int m = 8; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);  // the row's 16 threads
            acc[i] += s;
        }
        if (d0) __syncthreads();  // the previous column tile's stores have read the tile
        t32_stage(tile, x, rows, its, ihs, t, d0, D);
        __syncthreads();
        t32_store_transposed<PERM>(tile, out, ldt, t, d0, D);
    }
    if (t.c4 == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sums[t.r0 + 16 * i] = acc[i];
    }
    __syncthreads();
    if (threadIdx.x < 64) {  // one token a thread: each head's 64 sums as one run
        const int tok = t.p0 + threadIdx.x;
        if (tok < T) {
            const i64 at = (i64)t.h * T + tok;
            delta[at] = sums[threadIdx.x];
            lse2[at] = __fmul_rn(lse[at], lse_k);
            sem[at] = 0;
        }
    }
}

// out[i] = tf32(in[i]) for i < 4 n4 (16-byte aligned arrays): the rounded copy of an operand in its own layout.
__device__ __forceinline__ void round_tf32_copy(const float4* __restrict__ in, float4* __restrict__ out, i64 n4) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        const float4 x = in[i];
        out[i] = make_float4(__uint_as_float(rna_tf32(x.x)), __uint_as_float(rna_tf32(x.y)),
                             __uint_as_float(rna_tf32(x.z)), __uint_as_float(rna_tf32(x.w)));
    }
}
