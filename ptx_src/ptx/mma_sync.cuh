// ldmatrix + mma.sync: warp-level tensor-core tiles (PTX ISA 9.7.14.5.x), sm_80+.
//
// Fragment layouts (lane = 32 threads of one warp, g = lane / 4, t = lane % 4):
//   A, 16x16 row-major, 4 x b32 (two 16-bit values each):
//     a0 = A[g][2t..2t+1]   a1 = A[g+8][2t..2t+1]   a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
//   B, 16x8 (k x n, "col"), 2 x b32:  b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//   C/D, 16x8 fp32, 4 x f32:  c0,c1 = C[g][2t..2t+1]   c2,c3 = C[g+8][2t..2t+1]
// So each thread owns two rows (g and g+8) of every accumulator tile, and the four threads of a
// quad (same g) together own a row: row reductions are two xor-shuffles (1, 2) within the quad.
// A C fragment converted to 16-bit pairs is laid out exactly as half of an A fragment, which is
// how P = softmax(S) feeds the second GEMM from registers without a trip through shared memory.
//
// ldmatrix.x4 loads four 8x8 16-bit matrices: lanes 8i..8i+7 give the row addresses of matrix i,
// and every lane receives in register i the pair (row g, columns 2t..2t+1) of matrix i (.trans:
// of its transpose).
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// stmatrix.sync.aligned.m8n8.x4.shared.b16 (sm_90+): the store counterpart of ldmatrix.x4; lanes
// 8i..8i+7 give the row addresses of matrix i, every lane supplies in register i the pair
// (row g, columns 2t..2t+1) of matrix i, i.e. an accumulator tile's layout converted to 16 bits.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (sm_90+): as stmatrix_x4, each matrix stored
// transposed: the row that lane 8i + r addresses receives column r of matrix i. An accumulator
// tile [rows x cols] so lands in shared memory as [cols x rows] (the backward's dS^T -> dS).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// For an x4 ldmatrix / stmatrix over a warp's 16-row tile whose matrices are (rows 0-7, chunk
// c), (rows 8-15, c), (rows 0-7, c + 1), (rows 8-15, c + 1): the row (0-15) this lane
// addresses; its chunk is c + lane / 16. Registers 0-3 are then the A fragment (or accumulator
// tile pair) layout above.
__device__ __forceinline__ int x4_row(int lane) {
    return 8 * ((lane / 8) % 2) + lane % 8;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D = A * B + D in place.
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    if constexpr (kBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// One A fragment times the two 8-column halves of a B fragment loaded by ldmatrix.x4 (registers
// 0-1: columns 0-7, 2-3: columns 8-15): D0 += A B[:, 0:8], D1 += A B[:, 8:16].
template <bool kBf16>
__device__ __forceinline__ void mma_m16n16k16(float (&d0)[4], float (&d1)[4],
                                              const uint32_t (&a)[4], const uint32_t (&b)[4]) {
    const uint32_t b_lo[2] = {b[0], b[1]};
    const uint32_t b_hi[2] = {b[2], b[3]};
    mma_m16n8k16<kBf16>(d0, a, b_lo);
    mma_m16n8k16<kBf16>(d1, a, b_hi);
}

// Zeroes an accumulator of kMTiles x kNTiles C/D fragments (before its first mma).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero_fill(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[m][j][c] = 0.0f;
        }
    }
}

// Packs two floats into one b32 of 16-bit values, `lo` in the low half (the lower column):
// cvt.rn.{bf16x2,f16x2}.f32 d, hi, lo.
template <bool kBf16>
__device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
    uint32_t r;
    if constexpr (kBf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// The inverse of pack_f32x2: the two 16-bit values of a b32 as floats, low half first: bf16 is the top half of an FP32
// bit pattern; f16 converts with cvt.f32.f16.
template <bool kBf16>
__device__ __forceinline__ float2 unpack_f32x2(uint32_t x) {
    if constexpr (kBf16) {
        return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
    } else {
        float lo, hi;
        asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
            : "=f"(lo), "=f"(hi) : "r"(x));
        return make_float2(lo, hi);
    }
}

// A warp's acc += A B over kKSteps k steps of 16, A in kMTiles 16-row groups, B in kNTiles
// 8-column tiles: load_a(a, m, ks) gives the A fragment of row group m at k step ks,
// load_b(b, np, ks) the B fragments of column tiles 2 np and 2 np + 1 (registers as ldmatrix.x4
// gives them: see mma_m16n16k16). Where the operands come from (which tile, transposed or not)
// is the loaders' business.
template <bool kBf16, int kKSteps, int kMTiles, int kNTiles, class LoadA, class LoadB>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], LoadA load_a,
                                          LoadB load_b) {
    static_assert(kNTiles % 2 == 0, "B fragments come in pairs of 8-column tiles");
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) load_a(a[m], m, ks);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            uint32_t b[4];
            load_b(b, np, ks);
#pragma unroll
            for (int m = 0; m < kMTiles; ++m) {
                mma_m16n16k16<kBf16>(acc[m][2 * np], acc[m][2 * np + 1], a[m], b);
            }
        }
    }
}

}  // namespace ptxattn
