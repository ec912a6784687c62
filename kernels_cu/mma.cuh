// Warp-level matrix products on shared-memory tiles, in three precisions that share one accumulator
// layout (the m16n8 "C" fragment of mma.sync): a warp owns a 16-row strip; lane (g = lane / 4,
// t = lane % 4) holds acc[j][0..3] = C(g, 8j+2t), C(g, 8j+2t+1), C(g+8, 8j+2t), C(g+8, 8j+2t+1).
//   MODE_FP32  exact FFMA, no tensor cores (smem holds float)
//   MODE_TF32  mma.sync m16n8k8 tf32, fp32 accumulate (smem holds tf32-rounded float)
//   MODE_BF16  mma.sync m16n8k16 bf16, fp32 accumulate (smem holds bf16)
// The exception: in fp32 with an even n8 count (Blocked below), the score tiles of mm_ss and the accumulators
// of mm_rs (P * B products) are register-blocked instead.
// The modes' values come from the build (cupy_rope.precision.compile_defines()), never from this text.
#pragma once
#if !defined(MODE_FP32) || !defined(MODE_TF32) || !defined(MODE_BF16)
#error "MODE_FP32, MODE_TF32 and MODE_BF16 are not defined: compile with cupy_rope.precision.compile_defines()"
#endif
#include "common.cuh"

template <int MODE> struct Smem { typedef float T; };
template <> struct Smem<MODE_BF16> { typedef u16 T; };

__device__ __forceinline__ u32 f32_to_tf32(float f) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

template <int MODE> __device__ __forceinline__ typename Smem<MODE>::T to_smem(float f);
template <> __device__ __forceinline__ float to_smem<MODE_FP32>(float f) { return f; }
template <> __device__ __forceinline__ float to_smem<MODE_TF32>(float f) { return __uint_as_float(f32_to_tf32(f)); }
template <> __device__ __forceinline__ u16 to_smem<MODE_BF16>(float f) { return f32_to_bf16(f); }

__device__ __forceinline__ void mma_tf32(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 matrices of 16-bit elements (rows of 16 bytes; lane L gives the row address of matrix L / 8):
// lane (g, t) receives element pair (g, 2t..2t+1) of each matrix, i.e. for 32-bit data element (g, t).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// The same, transposed: lane (g, t) receives elements (2t, g) and (2t+1, g) of each matrix.
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// fp32 (MODE_FP32) products are register-blocked when the head's n8 count DN is even:
// * score tiles (the 16 x 32 products of mm_ss) are 4 x 4 blocks: lane (a = lane / 8, b = lane % 8) holds
//   s[i][j] = S(4a + i, b + 8j). Each 4-step of the reduction reads 4 + 4 16-byte rows for 64 FMAs (the C layout
//   reads 2 + 8); a 16-byte shared-memory load costs 4 wavefronts whatever the broadcast, so that is 0.5
//   wavefronts per FMA, not 0.625;
// * the accumulators of the P * B products (mm_rs, acc[16 x 8DN]): see BLK_AT below.
template <int MODE, int DN> struct Blocked {
    static constexpr bool value = MODE == MODE_FP32 && DN % 2 == 0;
};

// The lane's view of a 16 x 32 score tile float[4][4]: element (x, y) is in the lane's row slot(x, y) (of NR) and
// at column col(x, y) of the warp's strip; reduce(...) combines the lanes that share the lane's rows.
template <bool BLOCKED> struct Score {  // the mma C layout: s[j][e] = S(g + 8 (e / 2), 8j + 2t + e % 2)
    static constexpr int NR = 2;
    __device__ static __forceinline__ int slot(int, int e) { return e >> 1; }
    __device__ static __forceinline__ int col(int j, int e) { return 8 * j + 2 * (threadIdx.x & 3) + (e & 1); }
    template <class F> __device__ static __forceinline__ float reduce(float x, F f) {
        x = f(x, __shfl_xor_sync(0xffffffffu, x, 1));
        return f(x, __shfl_xor_sync(0xffffffffu, x, 2));
    }
};
template <> struct Score<true> {  // 4 x 4 blocks: s[i][j] = S(4a + i, b + 8j); row() and leader() for exchanges
    // through the warp's scratch (one lane of each 8 writes the values of its rows 4a .. 4a + 3)
    static constexpr int NR = 4;
    __device__ static __forceinline__ int slot(int i, int) { return i; }
    __device__ static __forceinline__ int col(int, int j) { return (threadIdx.x & 7) + 8 * j; }
    __device__ static __forceinline__ int row(int r) { return 4 * ((threadIdx.x & 31) >> 3) + r; }
    __device__ static __forceinline__ bool leader() { return (threadIdx.x & 7) == 0; }
    template <class F> __device__ static __forceinline__ float reduce(float x, F f) {
        x = f(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = f(x, __shfl_xor_sync(0xffffffffu, x, 2));
        return f(x, __shfl_xor_sync(0xffffffffu, x, 4));
    }
};

// acc[16 x 8NT] += A[16 x KD] * B^T, with A rows at A + r*lda and B stored as rows of n: B + n*ldb.
// KD is a multiple of 16 (tiles are zero-padded up to it). Rows must be 16-byte aligned (ldmatrix); B must have
// 8 * round_up(NT, 2) readable rows. acc is in the C layout, or (BLOCKED: MODE_FP32, NT = 4 only) blocked as
// Score<true>.
template <int MODE, int NT, int KD, bool BLOCKED = false>
__device__ __forceinline__ void mm_ss(float (&acc)[NT][4], const typename Smem<MODE>::T* A, int lda,
                                      const typename Smem<MODE>::T* B, int ldb) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    static_assert(!BLOCKED || (MODE == MODE_FP32 && NT == 4), "blocked scores are fp32 16 x 32 tiles");
    if constexpr (BLOCKED) {
        const float* pa = A + 4 * (lane >> 3) * lda;  // rows 4a .. 4a + 3
        const float* pb = B + (lane & 7) * ldb;       // rows b, b + 8, b + 16, b + 24 (conflict-free: bank 4b)
#pragma unroll 2
        for (int k = 0; k < KD; k += 4) {
            float4 x[4], y[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) x[i] = *reinterpret_cast<const float4*>(pa + i * lda + k);
#pragma unroll
            for (int j = 0; j < 4; ++j) y[j] = *reinterpret_cast<const float4*>(pb + 8 * j * ldb + k);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    acc[i][j] = fmaf(x[i].x, y[j].x,
                                     fmaf(x[i].y, y[j].y, fmaf(x[i].z, y[j].z, fmaf(x[i].w, y[j].w, acc[i][j]))));
        }
    } else if constexpr (MODE == MODE_TF32 || MODE == MODE_BF16) {
        // One k step covers 16 bytes of each row (8 tf32 or 16 bf16 elements). ldmatrix.x4 gives the whole A
        // fragment (rows 0-7 / 8-15 x the two 16-byte column halves) and the B fragments of two n8 tiles.
        typedef typename Smem<MODE>::T ST;
        constexpr int KSTEP = 32 / (int)sizeof(ST);  // elements per k step: 8 (tf32) or 16 (bf16)
        constexpr int HALF = KSTEP / 2;
        const int lr = lane & 7, lm = lane >> 3;
        const u32 a_base = smem_addr(A + (lr + 8 * (lm & 1)) * lda + HALF * (lm >> 1));
        const u32 b_base = smem_addr(B + (lr + 8 * (lm >> 1)) * ldb + HALF * (lm & 1));
#pragma unroll
        for (int k = 0; k < KD; k += KSTEP) {
            u32 a[4];
            ldsm_x4(a, a_base + k * (int)sizeof(ST));
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 b[4];
                ldsm_x4(b, b_base + (8 * j * ldb + k) * (int)sizeof(ST));
                if constexpr (MODE == MODE_TF32) {
                    mma_tf32(acc[j], a[0], a[1], a[2], a[3], b[0], b[1]);
                    if (j + 1 < NT) mma_tf32(acc[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                } else {
                    mma_bf16(acc[j], a[0], a[1], a[2], a[3], b[0], b[1]);
                    if (j + 1 < NT) mma_bf16(acc[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
    } else {
#pragma unroll 2
        for (int k = 0; k < KD; k += 4) {
            float4 x0 = *reinterpret_cast<const float4*>(A + g * lda + k);
            float4 x1 = *reinterpret_cast<const float4*>(A + (g + 8) * lda + k);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float4 y0 = *reinterpret_cast<const float4*>(B + (8 * j + 2 * t) * ldb + k);
                float4 y1 = *reinterpret_cast<const float4*>(B + (8 * j + 2 * t + 1) * ldb + k);
                acc[j][0] = fmaf(x0.x, y0.x, fmaf(x0.y, y0.y, fmaf(x0.z, y0.z, fmaf(x0.w, y0.w, acc[j][0]))));
                acc[j][1] = fmaf(x0.x, y1.x, fmaf(x0.y, y1.y, fmaf(x0.z, y1.z, fmaf(x0.w, y1.w, acc[j][1]))));
                acc[j][2] = fmaf(x1.x, y0.x, fmaf(x1.y, y0.y, fmaf(x1.z, y0.z, fmaf(x1.w, y0.w, acc[j][2]))));
                acc[j][3] = fmaf(x1.x, y1.x, fmaf(x1.y, y1.y, fmaf(x1.z, y1.z, fmaf(x1.w, y1.w, acc[j][3]))));
            }
        }
    }
}

// Blocked accumulators of the P * B products (acc[16 x 8NT], fp32, NT even) instead of the C layout: lane
// (rg = lane / 16, cg = lane % 16) holds the 8 x NT/2 block of rows 8rg + i and columns cg + 16c at flat index
// i * NT/2 + c of the same float[NT][4] array (8 * NT/2 = 4 * NT values). Each step of the reduction then reads
// 8 + NT/2 operands from shared memory for 4 * NT FMAs (the C layout needs 2 + 2NT).
#define BLK_AT(acc, NT, i, c) acc[((i) * ((NT) / 2) + (c)) >> 2][((i) * ((NT) / 2) + (c)) & 3]

// Scratch floats per warp for mm_rs in MODE_FP32: P^T [8KT][20] (blocked) or P [16][8KT+4] (C layout).
template <int KT> struct RsScratch {
    static constexpr int LDPT = 20;
    static constexpr int value = 8 * KT * LDPT > 16 * (8 * KT + 4) ? 8 * KT * LDPT : 16 * (8 * KT + 4);
};

// acc[16 x 8NT] += P[16 x 8KT] * B, with P in registers and B stored row-major [k][n]: B + k*ldb. MODE_FP32
// goes through `scratch`, this warp's private RsScratch<KT> float buffer; when Blocked<MODE, NT>, P is a blocked
// score tile (Score<true>, KT = 4) and acc is blocked (BLK_AT); otherwise both are in the C layout.
template <int MODE, int NT, int KT>
__device__ __forceinline__ void mm_rs(float (&acc)[NT][4], const float (&p)[KT][4],
                                      const typename Smem<MODE>::T* B, int ldb, float* scratch) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if constexpr (Blocked<MODE, NT>::value) {
        static_assert(KT == 4, "a blocked P is a 16 x 32 score tile");
        constexpr int LDPT = RsScratch<KT>::LDPT, NC = NT / 2;
        __syncwarp();
#pragma unroll
        for (int j = 0; j < KT; ++j)  // P^T row b + 8j, rows 4a .. 4a + 3 (conflict-free: banks 20b + 4a)
            *reinterpret_cast<float4*>(scratch + ((lane & 7) + 8 * j) * LDPT + 4 * (lane >> 3)) =
                make_float4(p[0][j], p[1][j], p[2][j], p[3][j]);
        __syncwarp();
        const int rg = lane >> 4, cg = lane & 15;
        const float* pa = scratch + 8 * rg;
        const float* pb = B + cg;
#pragma unroll 4
        for (int k = 0; k < 8 * KT; ++k) {
            const float4 x0 = *reinterpret_cast<const float4*>(pa + k * LDPT);
            const float4 x1 = *reinterpret_cast<const float4*>(pa + k * LDPT + 4);
            const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            float y[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) y[c] = pb[k * ldb + 16 * c];
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int c = 0; c < NC; ++c) BLK_AT(acc, NT, i, c) = fmaf(x[i], y[c], BLK_AT(acc, NT, i, c));
        }
    } else if constexpr (MODE == MODE_TF32) {
        // k slots t and t+4 of each k8 step carry columns 2t and 2t+1 of P: B rows are permuted to match.
#pragma unroll
        for (int s = 0; s < KT; ++s) {
            u32 a0 = f32_to_tf32(p[s][0]), a1 = f32_to_tf32(p[s][2]);
            u32 a2 = f32_to_tf32(p[s][1]), a3 = f32_to_tf32(p[s][3]);
            const float* b = B + (8 * s + 2 * t) * ldb + g;
#pragma unroll
            for (int j = 0; j < NT; ++j)
                mma_tf32(acc[j], a0, a1, a2, a3, __float_as_uint(b[8 * j]), __float_as_uint(b[ldb + 8 * j]));
        }
    } else if constexpr (MODE == MODE_BF16) {
        // B rows are k: ldmatrix.trans of [16 k x 8 n] pairs gives the B fragments of two n8 tiles at once.
        const int lr = lane & 7, lm = lane >> 3;
        const u32 b_base = smem_addr(B + (lr + 8 * (lm & 1)) * ldb + 8 * (lm >> 1));
#pragma unroll
        for (int s = 0; s < KT; s += 2) {
            u32 a0 = pack2<BF16>(p[s][0], p[s][1]), a1 = pack2<BF16>(p[s][2], p[s][3]);
            u32 a2 = pack2<BF16>(p[s + 1][0], p[s + 1][1]), a3 = pack2<BF16>(p[s + 1][2], p[s + 1][3]);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 b[4];
                ldsm_x4_t(b, b_base + (8 * s * ldb + 8 * j) * 2);  // odd NT: the last pair's second half
                mma_bf16(acc[j], a0, a1, a2, a3, b[0], b[1]);      // reads the zero padding, unused
                if (j + 1 < NT) mma_bf16(acc[j + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
    } else {
        constexpr int LDP = 8 * KT + 4;
        __syncwarp();
#pragma unroll
        for (int s = 0; s < KT; ++s) {
            *reinterpret_cast<float2*>(scratch + g * LDP + 8 * s + 2 * t) = make_float2(p[s][0], p[s][1]);
            *reinterpret_cast<float2*>(scratch + (g + 8) * LDP + 8 * s + 2 * t) = make_float2(p[s][2], p[s][3]);
        }
        __syncwarp();
#pragma unroll 2
        for (int k = 0; k < 8 * KT; k += 4) {
            float4 x0 = *reinterpret_cast<const float4*>(scratch + g * LDP + k);
            float4 x1 = *reinterpret_cast<const float4*>(scratch + (g + 8) * LDP + k);
            const float xa[4] = {x0.x, x0.y, x0.z, x0.w}, xb[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    float2 y = *reinterpret_cast<const float2*>(B + (k + u) * ldb + 8 * j + 2 * t);
                    acc[j][0] = fmaf(xa[u], y.x, acc[j][0]);
                    acc[j][1] = fmaf(xa[u], y.y, acc[j][1]);
                    acc[j][2] = fmaf(xb[u], y.x, acc[j][2]);
                    acc[j][3] = fmaf(xb[u], y.y, acc[j][3]);
                }
            }
        }
    }
}
