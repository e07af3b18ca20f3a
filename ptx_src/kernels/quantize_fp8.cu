// Quantizers bf16/fp16 -> FP8 e4m3 for the FP8 attention path (ptxattn/quant/fp8.py drives them).
//
// Input x (B, S, H, head_dim) of 16-bit floats with element strides (unit stride in head_dim),
// head_dim a multiple of 16 at most the compiled D. One warp owns one row x[b, s, h, :]; lane l
// holds the kPerLane = D / 32 consecutive values l * kPerLane .., read and written as one
// vector; a lane whose values lie past head_dim (a multiple of kPerLane) holds zeros and stores
// nothing. Two passes, two entry points:
//   fp8_amax       max |x| of every (batch, head, block of kScaleBlockRows rows of s), as the
//                  bits of a non-negative float (so atomicMax on unsigned orders them). The
//                  launcher derives per-head and per-tensor maxima from these and turns a
//                  maximum into a descale amax / 448.
//   fp8_quantize   e4m3(x / descale[b, h, s / kScaleBlockRows]), the descale read through
//                  element strides, 0 along the dimensions a coarser scale does not vary in;
//                  output (B, S, H, head_dim) contiguous bytes.
// Both optionally rotate each row first (signs != nullptr; head_dim = D): x <- H_D (signs * x) /
// sqrt(D),
// H_D the Sylvester Hadamard matrix, H[i][j] = (-1)^popcount(i & j). Applied with the same signs
// to Q and K it leaves Q K^T unchanged (the rotation is orthogonal) while spreading an outlier
// over the whole row. The transform is a butterfly per index bit: bits of i below log2(kPerLane)
// pair values inside a lane, the five above pair lanes (shfl.xor).
//
// Compile-time parameters (-D): HEAD_DIM (64, 128, 256: D), IS_BF16 (1: bfloat16, 0: float16).
#include "ptx/common.cuh"
#include "ptx/e4m3.cuh"

namespace ptxattn {
namespace quantize_fp8 {

constexpr int kHeadDim = HEAD_DIM;
constexpr bool kBf16 = IS_BF16 != 0;
constexpr int kPerLane = kHeadDim / 32;
constexpr int kScaleBlockRows = 128;
constexpr float kInvSqrtHeadDim =
    kHeadDim == 64 ? 0.125f : kHeadDim == 128 ? 0.0883883476483184406f : 0.0625f;
static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");

template <int N>
struct alignas(4 * N) Words {
    uint32_t w[N];
};

__device__ __forceinline__ float half_to_float(uint16_t h) {
    if constexpr (kBf16) {
        return __uint_as_float(static_cast<uint32_t>(h) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
}

struct Row {
    int batch;
    int seq;
    int head;
};

// Row index r = (b * S + s) * H + h, heads fastest, like a contiguous (B, S, H, D) array.
__device__ __forceinline__ Row decode_row(int64_t r, int seqlen, int heads) {
    const int head = static_cast<int>(r % heads);
    const int64_t bs = r / heads;
    return Row{static_cast<int>(bs / seqlen), static_cast<int>(bs % seqlen), head};
}

// This lane's values of the row, as floats (zeros past head_dim), rotated when `signs` is
// given.
__device__ __forceinline__ void load_row(float (&v)[kPerLane], const uint16_t* x, Row row,
                                         int64_t stride_b, int64_t stride_s, int64_t stride_h,
                                         const float* signs, int head_dim, int lane) {
    const uint16_t* src = x + row.batch * stride_b + row.seq * stride_s + row.head * stride_h +
                          lane * kPerLane;
    Words<kPerLane / 2> words = {};
    if (lane * kPerLane < head_dim) words = *reinterpret_cast<const Words<kPerLane / 2>*>(src);
#pragma unroll
    for (int i = 0; i < kPerLane / 2; ++i) {
        v[2 * i] = half_to_float(static_cast<uint16_t>(words.w[i] & 0xffff));
        v[2 * i + 1] = half_to_float(static_cast<uint16_t>(words.w[i] >> 16));
    }
    if (signs == nullptr) return;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] *= signs[lane * kPerLane + e];
#pragma unroll
    for (int bit = 1; bit < kPerLane; bit *= 2) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
            if (e & bit) continue;
            const float a = v[e], b = v[e | bit];
            v[e] = a + b;
            v[e | bit] = a - b;
        }
    }
#pragma unroll
    for (int bit = 1; bit < 32; bit *= 2) {
        const bool upper = (lane & bit) != 0;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, v[e], bit);
            v[e] = upper ? other - v[e] : v[e] + other;
        }
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] *= kInvSqrtHeadDim;
}

// e4m3(v / d) of this lane's values: kPerLane bytes in one store. IEEE division (not a multiply by
// 1 / d) so the bytes match a host float32 x / d exactly.
template <int kValues>
__device__ __forceinline__ void store_e4m3(uint8_t* dst, const float (&v)[kValues], float d) {
    if constexpr (kValues == 2) {
        *reinterpret_cast<uint16_t*>(dst) = e4m3x2(__fdiv_rn(v[0], d), __fdiv_rn(v[1], d));
    } else {
        Words<kValues / 4> packed;
#pragma unroll
        for (int i = 0; i < kValues / 4; ++i) {
            packed.w[i] = e4m3x4(__fdiv_rn(v[4 * i], d), __fdiv_rn(v[4 * i + 1], d),
                                 __fdiv_rn(v[4 * i + 2], d), __fdiv_rn(v[4 * i + 3], d));
        }
        *reinterpret_cast<Words<kValues / 4>*>(dst) = packed;
    }
}

}  // namespace quantize_fp8
}  // namespace ptxattn

using namespace ptxattn;
using namespace ptxattn::quantize_fp8;

// grid: ceil(rows / 8) blocks of 256 threads (8 warps, one row each), rows = B * S * H.
// amax: (B, H, ceil(S / 128)) unsigned, zeroed by the caller.
extern "C" __global__ void __launch_bounds__(256)
fp8_amax(const uint16_t* __restrict__ x, int64_t stride_b, int64_t stride_s, int64_t stride_h,
         int seqlen, int heads, int64_t rows, const float* __restrict__ signs,
         uint32_t* __restrict__ amax, int head_dim) {
    const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Row row = decode_row(r, seqlen, heads);
    float v[kPerLane];
    load_row(v, x, row, stride_b, stride_s, stride_h, signs, head_dim, lane);
    float m = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) m = fmaxf(m, fabsf(v[e]));
#pragma unroll
    for (int bit = 16; bit >= 1; bit /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, bit));
    if (lane == 0) {
        const int blocks = (seqlen + kScaleBlockRows - 1) / kScaleBlockRows;
        atomicMax(amax + (static_cast<int64_t>(row.batch) * heads + row.head) * blocks +
                      row.seq / kScaleBlockRows,
                  __float_as_uint(m));
    }
}

// out: (B, S, H, head_dim) e4m3 bytes, contiguous. descale strides are in elements.
extern "C" __global__ void __launch_bounds__(256)
fp8_quantize(const uint16_t* __restrict__ x, int64_t stride_b, int64_t stride_s,
             int64_t stride_h, int seqlen, int heads, int64_t rows,
             const float* __restrict__ signs, const float* __restrict__ descale,
             int64_t descale_stride_b, int64_t descale_stride_h, int64_t descale_stride_block,
             uint8_t* __restrict__ out, int head_dim) {
    const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Row row = decode_row(r, seqlen, heads);
    float v[kPerLane];
    load_row(v, x, row, stride_b, stride_s, stride_h, signs, head_dim, lane);
    if (lane * kPerLane >= head_dim) return;
    const float d = descale[row.batch * descale_stride_b + row.head * descale_stride_h +
                            (row.seq / kScaleBlockRows) * descale_stride_block];
    store_e4m3<kPerLane>(out + r * head_dim + lane * kPerLane, v, d);
}
