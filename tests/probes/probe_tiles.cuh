// Operand staging for the wgmma probes (wgmma_probe.cu, fp8_wgmma_probe.cu): row-major byte
// matrices from global memory into shared memory in the layout TMA writes, and the m64nN
// accumulator of a warpgroup back out as a row-major fp32 matrix.
#pragma once
#include "ptx/common.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {
namespace probe {

// Copies a row-major [rows x kRowBytes * kSlabs] byte matrix into kSlabs slabs of `rows`
// swizzled kRowBytes-byte rows, as TMA boxes of one swizzle span of columns land.
template <int kRowBytes, int kSlabs>
__device__ __forceinline__ void stage_tile(uint8_t* dst, const uint8_t* src, int rows) {
    constexpr int kChunks = kRowBytes / 16;
    for (int c = threadIdx.x; c < rows * kChunks * kSlabs; c += blockDim.x) {
        const int row = c / (kChunks * kSlabs);
        const int chunk = c % (kChunks * kSlabs);
        *reinterpret_cast<uint4*>(dst + (chunk / kChunks) * rows * kRowBytes +
                                  swizzled_offset<kRowBytes>(row, chunk % kChunks)) =
            *reinterpret_cast<const uint4*>(src + c * 16);
    }
}

// Stores an m64nN accumulator of the warpgroup as a row-major [64 x N] fp32 matrix.
template <int N>
__device__ __forceinline__ void store_accumulator(float* dst, const float (&d)[N / 2]) {
    const int lane = threadIdx.x % 32;
    const int row = (threadIdx.x / 32) * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        const int col = 8 * i + 2 * (lane % 4);
        dst[row * N + col] = d[4 * i];
        dst[row * N + col + 1] = d[4 * i + 1];
        dst[(row + 8) * N + col] = d[4 * i + 2];
        dst[(row + 8) * N + col + 1] = d[4 * i + 3];
    }
}

}  // namespace probe
}  // namespace ptxattn
