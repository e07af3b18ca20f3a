// Block-scaled mma.sync (PTX ISA 9.7.14.3 "Block Scaling for mma.sync"): native on sm_120a,
// and an exact emulation that Hopper (sm_90a) can run, chosen at compile time.
//
//   mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X
//       .f32.e4m3.e4m3.f32.ue8m0
//       d, a, b, c, sfa, {byte-id-a, thread-id-a}, sfb, {byte-id-b, thread-id-b}
//   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//       .f32.e2m1.e2m1.f32.ue4m3      (same operands)
//
// Both compute D = (A * scale_A) (B * scale_B) + C with scale_A of shape 16 x (K / V) and
// scale_B of shape (K / V) x 8, V the scale vector length: 32 for MXFP8 (1X: one UE8M0 per row
// of A and per column of B), 16 for NVFP4 (4X: four UE4M3 per row / column, one per 16 k).
//
// Data fragments. Both shapes take 32 bytes of k per row of A and per column of B (32 e4m3, or
// 64 e2m1 packed two per byte, element k in the low nibble of its byte), so with g = lane / 4,
// t = lane % 4 the byte layout is the same for both (it is also the 16-bit ldmatrix layout):
//   a0 = A[g][bytes 4t..4t+3]  a1 = A[g+8][4t..]  a2 = A[g][16+4t..]  a3 = A[g+8][16+4t..]
//   b0 = B^T[g][bytes 4t..4t+3]                   b1 = B^T[g][16+4t..]
//   c0, c1 = C[g][2t, 2t+1]    c2, c3 = C[g+8][2t, 2t+1]
//
// Scale registers. sfa and sfb are one b32 per lane; the immediates pick which lanes and which
// bytes the instruction reads (ISA figures 43-45, table 37):
//   thread-id-a in {0,1}: the lane pair {0,1} or {2,3} of every quad supplies scale_A; row m of
//     A takes its scales from lane 4 * (m % 8) + 2 * thread-id-a + m / 8 (rows 0-7 from the
//     first lane of the pair, rows 8-15 from the second).
//   thread-id-b in {0..3}: lane 4 * n + thread-id-b supplies the scales of column n of B.
//   byte-id: 1X reads the one byte byte-id (0..3), so a register can carry the scales of four
//     different k blocks; 4X reads all four bytes (byte j scales k = 16j..16j+15) and byte-id
//     must be 0.
// Because thread-id-b has four values, one register per lane can also carry the column scales
// of four different n tiles; the attention kernel packs its K and V scales that way.
//
// Emulation (PTXATTN_EMULATE_BLOCK_SCALE=1) takes the same registers and immediates and gathers
// each lane's scales with shuffles following the rules above:
//   MXFP8: the unscaled e4m3 mma.m16n8k32 (sm_89+) per 32-wide k block, with the row and column
//     scales (powers of two) applied around it: C is divided by them, A B accumulated, and the
//     sum multiplied back, so D = C + 2^(ea+eb-254) A B exactly, with one FP32 rounding by the
//     tensor core like the native instruction. Where C / scale would not be exact (scales beyond
//     2^+-126, or a tiny C) the warp instead scales a separate product and adds it to C.
//   NVFP4: every e2m1 value times its UE4M3 scale is exact in bf16 (at most 6 significant bits,
//     2^-10 <= |x| <= 2688), so each lane converts its own elements and runs four bf16
//     m16n8k16 MMAs. The k order inside an MMA is free as long as A and B agree, so sub-MMA s
//     takes elements 2s, 2s+1 of every data register: no data moves between lanes.
// Selectors are PTX immediates, so callers choose them with template arguments; the kernels
// walk their k blocks and n tiles with recursive __forceinline__ templates rather than lambdas,
// which the inliner may leave as calls (moving captured accumulators to local memory) once
// emulated MMAs make their bodies large.
#pragma once
#include "ptx/common.cuh"
#include "ptx/e4m3.cuh"

#ifndef PTXATTN_EMULATE_BLOCK_SCALE
#define PTXATTN_EMULATE_BLOCK_SCALE 0
#endif
#if !defined(PTXATTN_ARCH) || PTXATTN_ARCH == 120 || PTXATTN_ARCH == 121
#define PTXATTN_NATIVE_BLOCK_SCALE_ARCH 1
#else
#define PTXATTN_NATIVE_BLOCK_SCALE_ARCH 0
#endif

namespace ptxattn {

// UE8M0: 2^(byte - 127); byte 0 is 2^-127 (an FP32 subnormal), byte 255 is NaN.
__device__ __forceinline__ float ue8m0_to_float(uint32_t byte) {
    const uint32_t bits = byte == 0 ? 0x00400000u : byte == 255 ? 0x7fffffffu : byte << 23;
    return __uint_as_float(bits);
}

#if PTXATTN_EMULATE_BLOCK_SCALE

namespace emulation {

constexpr float kMinNormal = 1.17549435e-38f;      // 2^-126
constexpr float kMaxPowerOfTwo = 1.70141183e38f;  // 2^127

// The unscaled e4m3 MMA (sm_89+): d += A B.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Byte k of a scale register.
template <int kByte>
__device__ __forceinline__ uint32_t scale_byte(uint32_t reg) {
    return (reg >> (8 * kByte)) & 0xff;
}

// The scale registers of the lanes that supply rows g and g+8 of A, the rows this lane's
// accumulator and A fragment hold.
template <int kThreadA>
__device__ __forceinline__ void gather_row_scales(uint32_t sfa, uint32_t& row_g,
                                                  uint32_t& row_g8) {
    const int lane = threadIdx.x % 32;
    const int src = 4 * (lane / 4) + 2 * kThreadA;
    row_g = __shfl_sync(0xffffffffu, sfa, src);
    row_g8 = __shfl_sync(0xffffffffu, sfa, src + 1);
}

// 2 * |e2m1 value| for the three magnitude bits, as eight nibbles: 0 1 2 3 4 6 8 12.
constexpr uint32_t kTwiceE2m1 = 0xc8643210u;

// e2m1 nibble `code` times a scale given halved (so the table can hold integers): exact.
__device__ __forceinline__ float e2m1_times(uint32_t code, float half_scale) {
    const float twice = static_cast<float>((kTwiceE2m1 >> (4 * (code & 7))) & 0xf);
    return __uint_as_float(__float_as_uint(twice * half_scale) | ((code & 8) << 28));
}

// bf16x2 of nibbles 2s, 2s+1 of `reg`, each times the halved scale.
template <int kPair>
__device__ __forceinline__ uint32_t e2m1_pair_bf16(uint32_t reg, float half_scale) {
    const uint32_t lo = (reg >> (8 * kPair)) & 0xf;
    const uint32_t hi = (reg >> (8 * kPair + 4)) & 0xf;
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;"
        : "=r"(packed) : "f"(e2m1_times(hi, half_scale)), "f"(e2m1_times(lo, half_scale)));
    return packed;
}

// Sub-MMA kPair of the NVFP4 emulation: nibbles 2 kPair, 2 kPair + 1 of every data register,
// times their halved scales (row g, row g+8, column; low and high k halves), as bf16 m16n8k16.
template <int kPair>
__device__ __forceinline__ void bf16_sub_mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&sa_g)[2],
                                             const float (&sa_g8)[2], const float (&sb)[2]) {
    const uint32_t a16[4] = {
        e2m1_pair_bf16<kPair>(a[0], sa_g[0]), e2m1_pair_bf16<kPair>(a[1], sa_g8[0]),
        e2m1_pair_bf16<kPair>(a[2], sa_g[1]), e2m1_pair_bf16<kPair>(a[3], sa_g8[1])};
    const uint32_t b16[2] = {e2m1_pair_bf16<kPair>(b[0], sb[0]),
                             e2m1_pair_bf16<kPair>(b[1], sb[1])};
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a16[0]), "r"(a16[1]), "r"(a16[2]), "r"(a16[3]), "r"(b16[0]), "r"(b16[1]));
}

}  // namespace emulation

#endif  // PTXATTN_EMULATE_BLOCK_SCALE

// MXFP8: D = (A * 2^(sfa-127)) (B * 2^(sfb-127)) + D, A 16x32 and B 32x8 e4m3, UE8M0 scales.
template <int kByteA, int kThreadA, int kByteB, int kThreadB>
__device__ __forceinline__ void mma_mxfp8(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(0 <= kByteA && kByteA < 4 && 0 <= kByteB && kByteB < 4, "1X byte-id is 0..3");
    static_assert(0 <= kThreadA && kThreadA < 2 && 0 <= kThreadB && kThreadB < 4,
                  "thread-id-a is 0..1, thread-id-b is 0..3");
#if PTXATTN_EMULATE_BLOCK_SCALE
    using namespace emulation;
    uint32_t row_g, row_g8;
    gather_row_scales<kThreadA>(sfa, row_g, row_g8);
    const int t = threadIdx.x % 4;
    const uint32_t col0 = __shfl_sync(0xffffffffu, sfb, 8 * t + kThreadB);
    const uint32_t col1 = __shfl_sync(0xffffffffu, sfb, 8 * t + 4 + kThreadB);
    const uint32_t ea[2] = {scale_byte<kByteA>(row_g), scale_byte<kByteA>(row_g8)};
    const uint32_t eb[2] = {scale_byte<kByteB>(col0), scale_byte<kByteB>(col1)};
    // Scaled in place: d = (d / s + A B) s with s = 2^(ea+eb-254) exactly, one rounding by the
    // tensor core like the native instruction, provided s is a normal float and d / s is exact.
    float scale[4], scaled[4];
    bool exact = true;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        scale[i] = __fmul_rn(ue8m0_to_float(ea[i / 2]), ue8m0_to_float(eb[i % 2]));
        scaled[i] = __fmul_rn(__fmul_rn(d[i], ue8m0_to_float(254 - ea[i / 2])),
                              ue8m0_to_float(254 - eb[i % 2]));
        exact = exact && scale[i] >= kMinNormal && scale[i] <= kMaxPowerOfTwo &&
                __fmul_rn(scaled[i], scale[i]) == d[i];
    }
    if (__all_sync(0xffffffffu, exact)) {
        mma_e4m3(scaled, a, b);
#pragma unroll
        for (int i = 0; i < 4; ++i) d[i] = __fmul_rn(scaled[i], scale[i]);
    } else {
        float prod[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_e4m3(prod, a, b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            d[i] = __fadd_rn(d[i], __fmul_rn(__fmul_rn(prod[i], ue8m0_to_float(ea[i / 2])),
                                             ue8m0_to_float(eb[i % 2])));
        }
    }
#else
    static_assert(kByteA < 0 || PTXATTN_NATIVE_BLOCK_SCALE_ARCH,
                  "native block-scaled mma.sync needs sm_120a; on sm_90a build with "
                  "-DPTXATTN_EMULATE_BLOCK_SCALE=1");
    asm("mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X"
        ".f32.e4m3.e4m3.f32.ue8m0 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
        "%10, {%11, %12}, %13, {%14, %15};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "r"(sfa), "n"(kByteA), "n"(kThreadA), "r"(sfb), "n"(kByteB), "n"(kThreadB));
#endif
}

// NVFP4: D = (A * scale_A) (B * scale_B) + D, A 16x64 and B 64x8 e2m1, UE4M3 scales per 16 k
// (scale_vec::4X, byte-ids 0). The per-tensor FP32 scale of NVFP4 is the caller's to apply.
template <int kThreadA, int kThreadB>
__device__ __forceinline__ void mma_nvfp4(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(0 <= kThreadA && kThreadA < 2 && 0 <= kThreadB && kThreadB < 4,
                  "thread-id-a is 0..1, thread-id-b is 0..3");
#if PTXATTN_EMULATE_BLOCK_SCALE
    using namespace emulation;
    uint32_t row_g, row_g8;
    gather_row_scales<kThreadA>(sfa, row_g, row_g8);
    const int lane = threadIdx.x % 32;
    const uint32_t col_g = __shfl_sync(0xffffffffu, sfb, 4 * (lane / 4) + kThreadB);
    // Registers 0/1 (A) and 0 (B) hold k = 8t..8t+7, block t/2; registers 2/3 and 1 hold
    // k = 32+8t.., block 2 + t/2. UE4M3 is unsigned: bit 7 is ignored.
    const int low_block = (lane % 4) / 2;
    const auto half = [](uint32_t reg, int block) {
        return 0.5f * e4m3_to_float((reg >> (8 * block)) & 0x7f);
    };
    const float sa_g[2] = {half(row_g, low_block), half(row_g, low_block + 2)};
    const float sa_g8[2] = {half(row_g8, low_block), half(row_g8, low_block + 2)};
    const float sb[2] = {half(col_g, low_block), half(col_g, low_block + 2)};
    bf16_sub_mma<0>(d, a, b, sa_g, sa_g8, sb);
    bf16_sub_mma<1>(d, a, b, sa_g, sa_g8, sb);
    bf16_sub_mma<2>(d, a, b, sa_g, sa_g8, sb);
    bf16_sub_mma<3>(d, a, b, sa_g, sa_g8, sb);
#else
    static_assert(kThreadA < 0 || PTXATTN_NATIVE_BLOCK_SCALE_ARCH,
                  "native block-scaled mma.sync needs sm_120a; on sm_90a build with "
                  "-DPTXATTN_EMULATE_BLOCK_SCALE=1");
    asm("mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X"
        ".f32.e2m1.e2m1.f32.ue4m3 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
        "%10, {%11, %12}, %13, {%14, %15};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "r"(sfa), "n"(0), "n"(kThreadA), "r"(sfb), "n"(0), "n"(kThreadB));
#endif
}

}  // namespace ptxattn
