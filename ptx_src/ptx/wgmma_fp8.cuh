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
//     convert in place into the next product's A fragment: transpose_e4m3.cuh orders the keys
//     of Vt so that it does, with no data moving between threads.
// Descriptors and swizzles are wgmma.cuh's (the K-major rules hold per byte, so a row of 128
// e4m3 is laid out like a row of 64 bf16; FP8 head_dim 64 has 64-byte rows: wgmma_desc_kmajor).
#pragma once
#include "ptx/common.cuh"
#include "ptx/wgmma.cuh"

namespace ptxattn {

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
PTXATTN_WGMMA_E4M3_SHAPE(160, PTXATTN_REG_80, PTXATTN_ACC_80, "%80", "%81", "%82", "%83", "%84",
                         "%85")
PTXATTN_WGMMA_E4M3_SHAPE(192, PTXATTN_REG_96, PTXATTN_ACC_96, "%96", "%97", "%98", "%99", "%100",
                         "%101")
PTXATTN_WGMMA_E4M3_SHAPE(224, PTXATTN_REG_112, PTXATTN_ACC_112, "%112", "%113", "%114", "%115",
                         "%116", "%117")
PTXATTN_WGMMA_E4M3_SHAPE(256, PTXATTN_REG_128, PTXATTN_ACC_128, "%128", "%129", "%130", "%131",
                         "%132", "%133")

}  // namespace ptxattn
