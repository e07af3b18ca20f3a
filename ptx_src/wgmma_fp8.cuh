// FP8 wgmma: wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3 (PTX ISA 9.7.15), sm_90a.
//
// Same warpgroup instruction as wgmma.cuh's 16-bit one, with 32 e4m3 values of K per step (32
// bytes, like 16 16-bit values) and FP32 accumulation. Differences that shape the callers:
//   * 8-bit operands must be K-major in shared memory: there is no transpose immediate, so a
//     row-major [K x N] operand such as V in P V has to be transposed first (transpose_e4m3.cuh).
//   * The accumulator D has exactly the 16-bit instruction's layout (wgmma.cuh).
//   * A from registers, per k-step four b32 of four e4m3 bytes each, lowest byte = lowest column
//     (rows relative to 16 * warp, g = lane / 4, t = lane % 4):
//         a0 = A[g][4t..4t+3]   a1 = A[g+8][4t..4t+3]   a2 = A[g][16+4t..]   a3 = A[g+8][16+4t..]
//     The accumulator gives a thread columns 8i+2t, 8i+2t+1 instead, so an S tile does not
//     convert in place into the next product's A fragment: see fwd_sm90.cu for the key order
//     that makes it do so without moving data between threads.
// Descriptors and the 128-byte swizzle are as in wgmma.cuh (the K-major rules hold per byte);
// 64-byte rows use the 64-byte swizzle, whose atoms are 8 rows = 512 bytes.
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

namespace ptxattn {

// Descriptor of a K-major operand with `row_bytes`-byte rows (64 or 128) swizzled over the
// whole row, as TMA writes it with that swizzle span: 8-row atoms, stride-dimension offset
// 8 * row_bytes, layout type 1 (128-byte) or 2 (64-byte) in bits 62-63.
template <int kRowBytes>
__device__ __forceinline__ uint64_t wgmma_desc_kmajor(uint32_t addr) {
    static_assert(kRowBytes == 64 || kRowBytes == 128, "64- or 128-byte rows");
    constexpr uint64_t kLayout = kRowBytes == 128 ? 1 : 2;
    return static_cast<uint64_t>((addr & 0x3ffff) >> 4) |
           static_cast<uint64_t>(1) << 16 |
           static_cast<uint64_t>((8 * kRowBytes) >> 4) << 32 | kLayout << 62;
}

// WgmmaE4m3<N>: m64nNk32, e4m3 x e4m3 -> f32. `accumulate` = 0 overwrites D.
//   ss(d, desc_a, desc_b, accumulate): A and B K-major in shared memory.
//   rs(d, a0..a3, desc_b, accumulate): A from registers (layout above), B K-major.
template <int N>
struct WgmmaE4m3;

#define PTXATTN_WGMMA_E4M3_SHAPE(N, REGS, ACCS, X0, X1, X2, X3, X4, X5)                         \
    template <>                                                                                  \
    struct WgmmaE4m3<N> {                                                                        \
        static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a,            \
                                                  uint64_t desc_b, uint32_t accumulate) {        \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X2 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS       \
                         "}, " X0 ", " X1 ", p, 1, 1;\n}\n"                                      \
                         : ACCS                                                                  \
                         : "l"(desc_a), "l"(desc_b), "r"(accumulate)                             \
                         : "memory");                                                            \
        }                                                                                        \
        static __device__ __forceinline__ void rs(float (&d)[N / 2], uint32_t a0, uint32_t a1,   \
                                                  uint32_t a2, uint32_t a3, uint64_t desc_b,     \
                                                  uint32_t accumulate) {                         \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X5 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS       \
                         "}, {" X0 ", " X1 ", " X2 ", " X3 "}, " X4 ", p, 1, 1;\n}\n"             \
                         : ACCS                                                                  \
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate)      \
                         : "memory");                                                            \
        }                                                                                        \
    };

PTXATTN_WGMMA_E4M3_SHAPE(64, PTXATTN_REG_32, PTXATTN_ACC_32, "%32", "%33", "%34", "%35", "%36",
                         "%37")
PTXATTN_WGMMA_E4M3_SHAPE(128, PTXATTN_REG_64, PTXATTN_ACC_64, "%64", "%65", "%66", "%67", "%68",
                         "%69")
PTXATTN_WGMMA_E4M3_SHAPE(256, PTXATTN_REG_128, PTXATTN_ACC_128, "%128", "%129", "%130", "%131",
                         "%132", "%133")

}  // namespace ptxattn
