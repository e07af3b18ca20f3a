// GPU quantizers from bf16 / fp16 to the block-scaled operand formats of fwd_blockscaled.cu.
// ptxattn/quant/blockscaled.py holds NumPy encoders that compute the same bits; every
// floating-point step here is an explicitly rounded IEEE operation (__fmul_rn, __fdiv_rn, no
// contraction) so that the two agree bit for bit.
//
// MXFP8 (e4m3 + one UE8M0 per 32 elements): the block scale is the smallest power of two 2^e
// with amax / 2^e <= 448, so the block never saturates; e = -127 (byte 0) for blocks whose amax
// is 0 or an FP32 subnormal. Elements are x * 2^-e rounded to nearest even e4m3.
//   mxfp8_quantize_rows: blocks along contiguous rows (Q, K: along head_dim).
//   mxfp8_quantize_v:    blocks along the sequence of V (batch, seqlen, heads, head_dim), written
//                        transposed as V^T (batch, heads, head_dim, padded) with scales
//                        (batch, heads, head_dim, padded / 32); keys past seqlen are zeros.
// NVFP4 (e2m1 + one UE4M3 per 16 elements + one FP32 per tensor): tensor_amax gives the tensor's
// amax A; the tensor scale is g = A / (6 * 448) (1 if that is 0); a block's scale is the e4m3
// rounding of (amax_block / 6) / g, and its elements are x / (scale * g) rounded to nearest even
// e2m1 (saturating at 6), packed two per byte with the even element in the low nibble. A block
// whose scale * g is 0 is all zeros.
//   nvfp4_quantize_rows: blocks along contiguous rows (Q, K: along head_dim).
#include "ptx/common.cuh"
#include "ptx/block_scale_mma.cuh"

namespace ptxattn {
namespace {

__device__ __forceinline__ float half_to_float(uint32_t bits, int is_bf16) {
    if (is_bf16) return __uint_as_float(bits << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(bits)));
    return f;
}

// n 16-bit values from 16-byte aligned global memory, as floats.
template <int kN>
__device__ __forceinline__ void load_halves(float (&x)[kN], const uint16_t* src, int is_bf16) {
    const uint4* vec = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
        const uint4 v = vec[i];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            x[8 * i + 2 * w] = half_to_float(words[w] & 0xffff, is_bf16);
            x[8 * i + 2 * w + 1] = half_to_float(words[w] >> 16, is_bf16);
        }
    }
}

// UE8M0 byte of the MXFP8 scale of a block with maximum magnitude `amax`.
__device__ __forceinline__ uint32_t mxfp8_scale_byte(float amax) {
    const uint32_t bits = __float_as_uint(amax);
    const int biased = static_cast<int>(bits >> 23);
    // amax = m 2^E with m in [1, 2): 448 = 1.75 * 2^8, so e = E - 8, or E - 7 when m > 1.75.
    const int e = biased == 0 ? -127 : biased - 135 + ((bits & 0x7fffff) > 0x600000 ? 1 : 0);
    return static_cast<uint32_t>(max(e, -127) + 127);
}

// 32 floats times 2^-e (exact) as e4m3 bytes.
__device__ __forceinline__ void store_mxfp8_block(uint8_t* dst, const float (&x)[32],
                                                  uint32_t scale_byte) {
    const float inv = __uint_as_float((254 - scale_byte) << 23);  // 2^-e, e <= 120: normal
    uint32_t words[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        words[w] = e4m3x4(__fmul_rn(x[4 * w], inv), __fmul_rn(x[4 * w + 1], inv),
                               __fmul_rn(x[4 * w + 2], inv), __fmul_rn(x[4 * w + 3], inv));
    }
    uint4* out = reinterpret_cast<uint4*>(dst);
    out[0] = make_uint4(words[0], words[1], words[2], words[3]);
    out[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

__device__ __forceinline__ float block_amax(const float* x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

// e2m1 code of y, rounding to nearest even and saturating: magnitudes 0 .5 1 1.5 2 3 4 6 are
// codes 0..7; ties (.25 .75 1.25 1.75 2.5 3.5 5) go to the even code.
__device__ __forceinline__ uint32_t e2m1_code(float y) {
    const float a = fabsf(y);
    const uint32_t magnitude = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                               (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return magnitude | ((__float_as_uint(y) >> 31) << 3);
}

__device__ __forceinline__ float nvfp4_tensor_scale(uint32_t amax_bits) {
    const float g = __fdiv_rn(__uint_as_float(amax_bits), 2688.0f);
    return g == 0.0f ? 1.0f : g;
}

}  // namespace
}  // namespace ptxattn

using namespace ptxattn;

// x: n_blocks * 32 contiguous values; data: same count of e4m3 bytes; scales: n_blocks bytes.
extern "C" __global__ void __launch_bounds__(256)
mxfp8_quantize_rows(const uint16_t* __restrict__ x, uint8_t* __restrict__ data,
                    uint8_t* __restrict__ scales, int64_t n_blocks, int is_bf16) {
    const int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (block >= n_blocks) return;
    float v[32];
    load_halves(v, x + block * 32, is_bf16);
    const uint32_t scale = mxfp8_scale_byte(block_amax(v, 32));
    store_mxfp8_block(data + block * 32, v, scale);
    scales[block] = static_cast<uint8_t>(scale);
}

// v: (batch, seqlen, heads, head_dim) contiguous. Grid (ceil(heads * head_dim / 256),
// padded / 32, batch): one thread per (head, d) of one key block, d fastest so that a warp reads
// consecutive values of each key.
extern "C" __global__ void __launch_bounds__(256)
mxfp8_quantize_v(const uint16_t* __restrict__ v, uint8_t* __restrict__ vt,
                 uint8_t* __restrict__ scales, int seqlen, int heads, int head_dim, int padded,
                 int is_bf16) {
    const int column = blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= heads * head_dim) return;
    const int h = column / head_dim;
    const int d = column % head_dim;
    const int kb = blockIdx.y;
    const int b = blockIdx.z;
    const int key_blocks = padded / 32;

    float x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int s = kb * 32 + i;
        const int64_t index = ((static_cast<int64_t>(b) * seqlen + s) * heads + h) * head_dim + d;
        x[i] = s < seqlen ? half_to_float(v[index], is_bf16) : 0.0f;
    }
    const uint32_t scale = mxfp8_scale_byte(block_amax(x, 32));
    const int64_t row = (static_cast<int64_t>(b) * heads + h) * head_dim + d;
    store_mxfp8_block(vt + row * padded + kb * 32, x, scale);
    scales[row * key_blocks + kb] = static_cast<uint8_t>(scale);
}

// *amax_bits = max |x| over n values (a multiple of 8), as FP32 bits; must start at 0.
extern "C" __global__ void __launch_bounds__(256)
tensor_amax(const uint16_t* __restrict__ x, int64_t n, int is_bf16, uint32_t* amax_bits) {
    float amax = 0.0f;
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
        float v[8];
        load_halves(v, x + i, is_bf16);
        amax = fmaxf(amax, block_amax(v, 8));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    // Non-negative floats order like their bit patterns.
    if (threadIdx.x % 32 == 0) atomicMax(amax_bits, __float_as_uint(amax));
}

// x: n_blocks * 16 contiguous values; data: n_blocks * 8 bytes; scales: n_blocks UE4M3 bytes;
// tensor_scale receives g.
extern "C" __global__ void __launch_bounds__(256)
nvfp4_quantize_rows(const uint16_t* __restrict__ x, uint8_t* __restrict__ data,
                    uint8_t* __restrict__ scales, const uint32_t* __restrict__ amax_bits,
                    float* __restrict__ tensor_scale, int64_t n_blocks, int is_bf16) {
    const int64_t block = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (block >= n_blocks) return;
    const float g = nvfp4_tensor_scale(*amax_bits);
    if (block == 0) *tensor_scale = g;
    float v[16];
    load_halves(v, x + block * 16, is_bf16);
    const float s = __fdiv_rn(__fdiv_rn(block_amax(v, 16), 6.0f), g);
    const uint32_t scale = e4m3x4(s, 0.0f, 0.0f, 0.0f) & 0xff;
    const float denom = __fmul_rn(e4m3_to_float(scale), g);
    uint32_t words[2] = {0, 0};
    if (denom > 0.0f) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            words[i / 8] |= e2m1_code(__fdiv_rn(v[i], denom)) << (4 * (i % 8));
        }
    }
    reinterpret_cast<uint2*>(data)[block] = make_uint2(words[0], words[1]);
    scales[block] = static_cast<uint8_t>(scale);
}
