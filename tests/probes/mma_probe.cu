// Probe of mma_sync.cuh, run by tests/test_primitives.py: one warp, three products of 16-bit
// (kBf16: bf16, else fp16) row-major matrices given as raw uint16 bits.
//   d8 [16 x 8]  = A [16 x 32] * Kt[0:8]^T   mma_m16n8k16, fragments read straight from global
//                  memory in the layouts mma_sync.cuh documents (no ldmatrix);
//   d  [16 x 16] = A * Kt^T                   mma_m16n16k16 on ldmatrix_x4 fragments of A and of
//                  Kt [16 x 32] (K-major B, as K in Q K^T, addressed like mainloops/fwd_mma_sync.cuh);
//   o  [16 x 16] = 16-bit(d) * V [16 x 16]    d packed by pack_f32x2 as the A fragment (C -> A,
//                  as P in P V), V through ldmatrix_x4_trans (MN-major B).
// A, Kt and V are staged unswizzled in shared memory. Accumulators start from zero_fill.
#include "ptx/mma_sync.cuh"

namespace ptxattn {
namespace probe {

// Stores a 16 x 8 C fragment at columns col0.. of a row-major fp32 matrix of `ld` columns.
__device__ __forceinline__ void store_c(float* dst, int ld, int col0, const float (&c)[4],
                                        int lane) {
    const int row = lane / 4;
    const int col = col0 + 2 * (lane % 4);
    dst[row * ld + col] = c[0];
    dst[row * ld + col + 1] = c[1];
    dst[(row + 8) * ld + col] = c[2];
    dst[(row + 8) * ld + col + 1] = c[3];
}

// The b32 holding elements [row][col], [row][col + 1] of a row-major uint16 matrix.
__device__ __forceinline__ uint32_t pair(const uint16_t* m, int ld, int row, int col) {
    return *reinterpret_cast<const uint32_t*>(m + row * ld + col);
}

template <bool kBf16>
__global__ void __launch_bounds__(32)
mma_probe(const uint16_t* __restrict__ a, const uint16_t* __restrict__ kt,
          const uint16_t* __restrict__ v, float* __restrict__ d8, float* __restrict__ d,
          float* __restrict__ o) {
    constexpr int kK = 32;
    __shared__ __align__(16) uint16_t a_s[16 * kK];
    __shared__ __align__(16) uint16_t kt_s[16 * kK];
    __shared__ __align__(16) uint16_t v_s[16 * 16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 16 * kK; i += 32) {
        a_s[i] = a[i];
        kt_s[i] = kt[i];
    }
    for (int i = lane; i < 16 * 16; i += 32) v_s[i] = v[i];
    __syncwarp();

    const int g = lane / 4;
    const int t = lane % 4;
    float acc8[1][1][4];
    zero_fill(acc8);
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
        const int k0 = 16 * ks;
        const uint32_t af[4] = {pair(a, kK, g, k0 + 2 * t), pair(a, kK, g + 8, k0 + 2 * t),
                                pair(a, kK, g, k0 + 2 * t + 8), pair(a, kK, g + 8, k0 + 2 * t + 8)};
        // B = Kt^T, so B[k][n] pairs along k are Kt[n][k], Kt[n][k + 1].
        const uint32_t bf[2] = {pair(kt, kK, g, k0 + 2 * t), pair(kt, kK, g, k0 + 2 * t + 8)};
        mma_m16n8k16<kBf16>(acc8[0][0], af, bf);
    }
    store_c(d8, 8, 0, acc8[0][0], lane);

    float acc[1][2][4];
    zero_fill(acc);
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
        uint32_t af[4];
        uint32_t bf[4];
        // A: rows x4_row(lane), chunk 2 ks + lane / 16. Kt: lanes 0-7 keys 0-7 left chunk, 8-15
        // keys 0-7 right, 16-23 keys 8-15 left, 24-31 keys 8-15 right.
        ldmatrix_x4(af, smem_addr(a_s + x4_row(lane) * kK + 8 * (2 * ks + lane / 16)));
        ldmatrix_x4(bf, smem_addr(kt_s + (lane % 8 + 8 * (lane / 16)) * kK +
                                  8 * (2 * ks + (lane / 8) % 2)));
        mma_m16n16k16<kBf16>(acc[0][0], acc[0][1], af, bf);
    }
    store_c(d, 16, 0, acc[0][0], lane);
    store_c(d, 16, 8, acc[0][1], lane);

    const uint32_t pf[4] = {pack_f32x2<kBf16>(acc[0][0][0], acc[0][0][1]),
                            pack_f32x2<kBf16>(acc[0][0][2], acc[0][0][3]),
                            pack_f32x2<kBf16>(acc[0][1][0], acc[0][1][1]),
                            pack_f32x2<kBf16>(acc[0][1][2], acc[0][1][3])};
    uint32_t vf[4];
    // V [keys x 16]: rows (keys) x4_row(lane), column chunk lane / 16.
    ldmatrix_x4_trans(vf, smem_addr(v_s + x4_row(lane) * 16 + 8 * (lane / 16)));
    float out[1][2][4];
    zero_fill(out);
    mma_m16n16k16<kBf16>(out[0][0], out[0][1], pf, vf);
    store_c(o, 16, 0, out[0][0], lane);
    store_c(o, 16, 8, out[0][1], lane);
}

}  // namespace probe
}  // namespace ptxattn
