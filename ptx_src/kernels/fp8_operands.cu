// The FP8 backward's operands that its inputs do not give as they are (launchers/hopper_backward.py
// drives them): Q and dO transposed for the e4m3 wgmmas whose K is the queries, and K in 16 bits
// for dQ's GEMM.
//
//   fp8_transpose_rows  e4m3 bytes x (B, S, H, head_dim), byte strides, as (B, H, head_dim, P):
//                       P = S rounded up to whole query tiles, zeros past S, each 32 rows in the
//                       key order of roles/transpose_e4m3.cuh (byte 16 h + 4 t + j of a group
//                       holds row 16 h + 8 (j / 2) + 2 t + j % 2), the order in which a wgmma
//                       accumulator converts into e4m3 A fragments in place. A block moves one
//                       group of 32 rows of one (batch, head): 16-byte loads into shared memory,
//                       then each thread gathers 4 bytes of one output row (one column) and
//                       stores them as a word, eight threads a 32-byte row segment.
//   fp8_dequantize      e4m3 x (B, S, H, head_dim) times its descale (read through element
//                       strides over (batch, head, 128-row block), 0 where it does not vary), as
//                       contiguous 16-bit values (IS_BF16: bfloat16, else float16), rounded to
//                       nearest even; 16 bytes a thread.
//
// Compile-time parameters (-D): HEAD_DIM (64, 128 or 256), IS_BF16 (fp8_dequantize's output).
#include "ptx/common.cuh"
#include "ptx/e4m3.cuh"
#include "ptx/mma_sync.cuh"

namespace ptxattn {
namespace fp8_operands {

constexpr int kHeadDim = HEAD_DIM;
constexpr bool kBf16 = IS_BF16 != 0;
constexpr int kGroupRows = 32;
constexpr int kThreads = 256;
constexpr int kScaleBlockRows = 128;
// a shared row of head_dim bytes plus 16: rows 2 t apart fall on different banks
constexpr int kTileRowBytes = kHeadDim + 16;
static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");

}  // namespace fp8_operands

extern "C" __global__ void __launch_bounds__(fp8_operands::kThreads)
fp8_transpose_rows(const uint8_t* __restrict__ x, int64_t stride_b, int64_t stride_s,
                   int64_t stride_h, int seqlen, int padded, uint8_t* __restrict__ out) {
    using namespace fp8_operands;
    __shared__ alignas(16) uint8_t tile[kGroupRows * kTileRowBytes];
    const int row0 = blockIdx.x * kGroupRows;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const uint8_t* src = x + batch * stride_b + head * stride_h;
    constexpr int kChunksPerRow = kHeadDim / 16;
    for (int c = threadIdx.x; c < kGroupRows * kChunksPerRow; c += kThreads) {
        const int row = c / kChunksPerRow;
        const int chunk = c % kChunksPerRow;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row0 + row < seqlen) {
            v = *reinterpret_cast<const uint4*>(src + (row0 + row) * stride_s + 16 * chunk);
        }
        *reinterpret_cast<uint4*>(tile + row * kTileRowBytes + 16 * chunk) = v;
    }
    __syncthreads();
    uint8_t* dst =
        out + (static_cast<int64_t>(batch) * gridDim.y + head) * kHeadDim * padded + row0;
    for (int w = threadIdx.x; w < kHeadDim * (kGroupRows / 4); w += kThreads) {
        const int col = w / (kGroupRows / 4);
        const int word = w % (kGroupRows / 4);  // bytes 4 word.. = 16 h + 4 t + j
        const int first = 16 * (word / 4) + 2 * (word % 4);
        const uint32_t b0 = tile[first * kTileRowBytes + col];
        const uint32_t b1 = tile[(first + 1) * kTileRowBytes + col];
        const uint32_t b2 = tile[(first + 8) * kTileRowBytes + col];
        const uint32_t b3 = tile[(first + 9) * kTileRowBytes + col];
        *reinterpret_cast<uint32_t*>(dst + static_cast<int64_t>(col) * padded + 4 * word) =
            b0 | b1 << 8 | b2 << 16 | b3 << 24;
    }
}

extern "C" __global__ void __launch_bounds__(fp8_operands::kThreads)
fp8_dequantize(const uint8_t* __restrict__ x, int64_t stride_b, int64_t stride_s,
               int64_t stride_h, int seqlen, int heads, int64_t rows,
               const float* __restrict__ descale, int64_t descale_stride_b,
               int64_t descale_stride_h, int64_t descale_stride_block,
               uint16_t* __restrict__ out) {
    using namespace fp8_operands;
    constexpr int kChunksPerRow = kHeadDim / 16;
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (chunk >= rows * kChunksPerRow) return;
    const int64_t r = chunk / kChunksPerRow;  // (b * S + s) * H + h
    const int head = static_cast<int>(r % heads);
    const int64_t bs = r / heads;
    const int seq = static_cast<int>(bs % seqlen);
    const int batch = static_cast<int>(bs / seqlen);
    const int col = 16 * static_cast<int>(chunk % kChunksPerRow);
    const float d = __ldg(descale + batch * descale_stride_b + head * descale_stride_h +
                          (seq / kScaleBlockRows) * descale_stride_block);
    const uint4 bytes = *reinterpret_cast<const uint4*>(x + batch * stride_b + seq * stride_s +
                                                        head * stride_h + col);
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    uint32_t halves[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = e4m3_to_float(words[i] >> (8 * j)) * d;
        halves[2 * i] = pack_f32x2<kBf16>(v[0], v[1]);
        halves[2 * i + 1] = pack_f32x2<kBf16>(v[2], v[3]);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + r * kHeadDim + col);
    dst[0] = make_uint4(halves[0], halves[1], halves[2], halves[3]);
    dst[1] = make_uint4(halves[4], halves[5], halves[6], halves[7]);
}

}  // namespace ptxattn
