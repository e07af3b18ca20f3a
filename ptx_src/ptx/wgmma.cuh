// wgmma: warpgroup-level asynchronous tensor-core MMA (PTX ISA 9.7.15), sm_90a.
//
// Wraps wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16} with A from shared
// memory (SS) or from registers (RS), B always from shared memory, and the fence / commit_group /
// wait_group instructions that order them. One instruction is issued by all 128 threads of a
// warpgroup (4 consecutive warps) and computes D[64 x N] (+)= A[64 x 16] * B[16 x N].
//
// Accumulator D, fp32, N/2 registers per thread (warp w of the warpgroup owns rows 16w..16w+15,
// g = lane / 4, t = lane % 4):
//     d[4i + 0], d[4i + 1] = D[16w + g    ][8i + 2t], D[16w + g    ][8i + 2t + 1]
//     d[4i + 2], d[4i + 3] = D[16w + g + 8][8i + 2t], D[16w + g + 8][8i + 2t + 1]
// i.e. per warp exactly the mma.sync m16n8 C layout repeated over N/8 column tiles.
// A from registers, k-step of 16 columns, four b32 each holding two 16-bit values (low = lower
// column):  a0 = A[g][2t..2t+1]  a1 = A[g+8][2t..2t+1]  a2 = A[g][2t+8..]  a3 = A[g+8][2t+8..]
// (rows relative to 16w). An accumulator tile converted to 16 bits pairwise, b32 j = d[2j],
// d[2j+1], is therefore the A fragment of the next product: registers 4k..4k+3 are k-step k.
//
// Shared-memory operands are described by a 64-bit matrix descriptor (PTX ISA 9.7.15.5.1.2):
//   bits  0-13 start address >> 4      bits 16-29 leading-dimension byte offset (LBO) >> 4
//   bits 32-45 stride-dimension byte offset (SBO) >> 4     bits 62-63 swizzle (1 = 128-byte)
// The 128-byte swizzle (FP8 head_dim 64 also takes the 64-byte one, below): rows of 128 bytes
// (64 16-bit values), 16-byte chunks XOR-permuted by (row % 8), atoms of 8 rows = 1024 bytes
// that must be 1024-byte aligned. That is exactly what a TMA load with
// CU_TENSOR_MAP_SWIZZLE_128B and a 64-element inner box writes.
//   K-major operand (rows indexed by M or N, 64 K-values per row): SBO = 1024 (next 8 rows),
//     LBO unused. A k-step of 16 within the 64-wide atom advances the start address by 32 bytes;
//     the hardware applies the swizzle to the absolute address, so this is exact.
//   A 64-byte swizzle (layout type 2) works the same way with 64-byte rows and 512-byte atoms
//   (SBO = 512); FP8 operands with 64-byte rows use it (wgmma_desc_kmajor).
//   MN-major operand (rows indexed by K, 64 M- or N-values per row, used with transpose-A or
//     transpose-B): SBO = 1024 (next 8 K-rows), LBO = distance between consecutive 64-column
//     atoms along M or N. A k-step of 16 advances the start address by 16 rows = 2048 bytes.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

// Descriptor of a 128-byte-swizzled operand starting at shared address `addr`.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t lbo_bytes,
                                                     uint32_t sbo_bytes) {
    return static_cast<uint64_t>((addr & 0x3ffff) >> 4) |
           static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fff) << 16 |
           static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fff) << 32 | 1ull << 62;
}

// Descriptor of a K-major operand with kRowBytes-byte rows (64 or 128) swizzled over the whole
// row, as TMA writes it with that swizzle span: 8-row atoms, SBO = 8 * kRowBytes, layout type 1
// (128-byte) or 2 (64-byte) in bits 62-63. For 128-byte rows this equals
// wgmma_desc_sw128(addr, 16, 1024).
template <int kRowBytes>
__device__ __forceinline__ uint64_t wgmma_desc_kmajor(uint32_t addr) {
    static_assert(kRowBytes == 64 || kRowBytes == 128, "64- or 128-byte rows");
    constexpr uint64_t kLayout = kRowBytes == 128 ? 1 : 2;
    return static_cast<uint64_t>((addr & 0x3ffff) >> 4) |
           static_cast<uint64_t>(1) << 16 |
           static_cast<uint64_t>((8 * kRowBytes) >> 4) << 32 | kLayout << 62;
}

// Moves a descriptor's start address by `bytes` (a multiple of 16 inside the same operand).
// A 32-bit add on the low word: the address field cannot carry out of it (shared memory is
// below 256 KB, so start + offset stays within bits 0-13's reach plus the reserved bits 14-15).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
    return (desc & 0xffffffff00000000ull) | lo;
}

// wgmma.fence.sync.aligned: orders earlier register writes (accumulators, A fragments) before
// the wgmma.mma_async instructions that follow.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// wgmma.commit_group.sync.aligned: closes the group of all uncommitted wgmma.mma_async.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// wgmma.wait_group.sync.aligned N: returns when at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins registers at this point of the program: the compiler may neither read an accumulator
// before the wgmma_wait that completes it nor sink a write below the wgmma that consumes it.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Inline-asm operand lists: accumulator registers %0..%(N/2 - 1), then the other operands.
#define PTXATTN_ACC8(i)                                                                     \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define PTXATTN_ACC_32 PTXATTN_ACC8(0), PTXATTN_ACC8(8), PTXATTN_ACC8(16), PTXATTN_ACC8(24)
#define PTXATTN_ACC_40 PTXATTN_ACC_32, PTXATTN_ACC8(32)
#define PTXATTN_ACC_48 PTXATTN_ACC_40, PTXATTN_ACC8(40)
#define PTXATTN_ACC_56 PTXATTN_ACC_48, PTXATTN_ACC8(48)
#define PTXATTN_ACC_64 PTXATTN_ACC_56, PTXATTN_ACC8(56)
#define PTXATTN_ACC_72 PTXATTN_ACC_64, PTXATTN_ACC8(64)
#define PTXATTN_ACC_80 PTXATTN_ACC_72, PTXATTN_ACC8(72)
#define PTXATTN_ACC_88 PTXATTN_ACC_80, PTXATTN_ACC8(80)
#define PTXATTN_ACC_96 PTXATTN_ACC_88, PTXATTN_ACC8(88)
#define PTXATTN_ACC_104 PTXATTN_ACC_96, PTXATTN_ACC8(96)
#define PTXATTN_ACC_112 PTXATTN_ACC_104, PTXATTN_ACC8(104)
#define PTXATTN_ACC_120 PTXATTN_ACC_112, PTXATTN_ACC8(112)
#define PTXATTN_ACC_128 PTXATTN_ACC_120, PTXATTN_ACC8(120)

#define PTXATTN_REG_32                                                                         \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PTXATTN_REG_40 PTXATTN_REG_32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define PTXATTN_REG_48 PTXATTN_REG_40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define PTXATTN_REG_56 PTXATTN_REG_48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define PTXATTN_REG_64 PTXATTN_REG_56 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define PTXATTN_REG_72 PTXATTN_REG_64 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define PTXATTN_REG_80 PTXATTN_REG_72 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define PTXATTN_REG_88 PTXATTN_REG_80 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define PTXATTN_REG_96 PTXATTN_REG_88 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define PTXATTN_REG_104 PTXATTN_REG_96 ", %96, %97, %98, %99, %100, %101, %102, %103"
#define PTXATTN_REG_112 PTXATTN_REG_104 ", %104, %105, %106, %107, %108, %109, %110, %111"
#define PTXATTN_REG_120 PTXATTN_REG_112 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define PTXATTN_REG_128 PTXATTN_REG_120 ", %120, %121, %122, %123, %124, %125, %126, %127"

// Wgmma16<N>: the m64nNk16 shape with fp32 accumulation.
//   ss<kBf16>(d, desc_a, desc_b, accumulate): A and B K-major in shared memory.
//   ss<kBf16, true>(...): A K-major, B MN-major (imm-trans-b = 1), as the backward's
//     dQ = dS K reads K: a row-major [keys x d] tile whose rows are the reduction dimension.
//   ss<kBf16, false, true>(...): A MN-major (imm-trans-a = 1), B K-major, as the backward's
//     dQ^T = K^T dS^T reads the same K tile as its A operand.
//   rs<kBf16>(d, a0..a3, desc_b, accumulate): A from registers, B MN-major (transposed) in
//     shared memory, as a row-major [K x N] tile such as V in P * V.
// `accumulate` = 0 overwrites D (scale-d predicate false), otherwise D += A * B.
// X0..X5 are the asm operand numbers that follow the N/2 accumulators.
template <int N>
struct Wgmma16;

#define PTXATTN_WGMMA16_SHAPE(N, REGS, ACCS, X0, X1, X2, X3, X4, X5)                            \
    template <>                                                                                  \
    struct Wgmma16<N> {                                                                          \
        template <bool kBf16, bool kTransB = false, bool kTransA = false>                        \
        static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a,            \
                                                  uint64_t desc_b, uint32_t accumulate) {        \
            if constexpr (kBf16) {                                                               \
                asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X2 ", 0;\n"                     \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS   \
                             "}, " X0 ", " X1 ", p, 1, 1, " X4 ", " X3 ";\n}\n"                  \
                             : ACCS                                                              \
                             : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(int(kTransB)),   \
                               "n"(int(kTransA))                                                 \
                             : "memory");                                                        \
            } else {                                                                             \
                asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X2 ", 0;\n"                     \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS     \
                             "}, " X0 ", " X1 ", p, 1, 1, " X4 ", " X3 ";\n}\n"                  \
                             : ACCS                                                              \
                             : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(int(kTransB)),   \
                               "n"(int(kTransA))                                                 \
                             : "memory");                                                        \
            }                                                                                    \
        }                                                                                        \
        template <bool kBf16>                                                                    \
        static __device__ __forceinline__ void rs(float (&d)[N / 2], uint32_t a0, uint32_t a1,   \
                                                  uint32_t a2, uint32_t a3, uint64_t desc_b,     \
                                                  uint32_t accumulate) {                         \
            if constexpr (kBf16) {                                                               \
                asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X5 ", 0;\n"                     \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS   \
                             "}, {" X0 ", " X1 ", " X2 ", " X3 "}, " X4 ", p, 1, 1, 1;\n}\n"     \
                             : ACCS                                                              \
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate)  \
                             : "memory");                                                        \
            } else {                                                                             \
                asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " X5 ", 0;\n"                     \
                             "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS     \
                             "}, {" X0 ", " X1 ", " X2 ", " X3 "}, " X4 ", p, 1, 1, 1;\n}\n"     \
                             : ACCS                                                              \
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(accumulate)  \
                             : "memory");                                                        \
            }                                                                                    \
        }                                                                                        \
    };

PTXATTN_WGMMA16_SHAPE(64, PTXATTN_REG_32, PTXATTN_ACC_32, "%32", "%33", "%34", "%35", "%36", "%37")
PTXATTN_WGMMA16_SHAPE(80, PTXATTN_REG_40, PTXATTN_ACC_40, "%40", "%41", "%42", "%43", "%44", "%45")
PTXATTN_WGMMA16_SHAPE(96, PTXATTN_REG_48, PTXATTN_ACC_48, "%48", "%49", "%50", "%51", "%52", "%53")
PTXATTN_WGMMA16_SHAPE(112, PTXATTN_REG_56, PTXATTN_ACC_56, "%56", "%57", "%58", "%59", "%60", "%61")
PTXATTN_WGMMA16_SHAPE(128, PTXATTN_REG_64, PTXATTN_ACC_64, "%64", "%65", "%66", "%67", "%68", "%69")
PTXATTN_WGMMA16_SHAPE(144, PTXATTN_REG_72, PTXATTN_ACC_72, "%72", "%73", "%74", "%75", "%76", "%77")
PTXATTN_WGMMA16_SHAPE(160, PTXATTN_REG_80, PTXATTN_ACC_80, "%80", "%81", "%82", "%83", "%84", "%85")
PTXATTN_WGMMA16_SHAPE(176, PTXATTN_REG_88, PTXATTN_ACC_88, "%88", "%89", "%90", "%91", "%92", "%93")
PTXATTN_WGMMA16_SHAPE(192, PTXATTN_REG_96, PTXATTN_ACC_96, "%96", "%97", "%98", "%99", "%100",
                      "%101")
PTXATTN_WGMMA16_SHAPE(208, PTXATTN_REG_104, PTXATTN_ACC_104, "%104", "%105", "%106", "%107",
                      "%108", "%109")
PTXATTN_WGMMA16_SHAPE(224, PTXATTN_REG_112, PTXATTN_ACC_112, "%112", "%113", "%114", "%115",
                      "%116", "%117")
PTXATTN_WGMMA16_SHAPE(240, PTXATTN_REG_120, PTXATTN_ACC_120, "%120", "%121", "%122", "%123",
                      "%124", "%125")
PTXATTN_WGMMA16_SHAPE(256, PTXATTN_REG_128, PTXATTN_ACC_128, "%128", "%129", "%130", "%131",
                      "%132", "%133")

}  // namespace ptxattn
