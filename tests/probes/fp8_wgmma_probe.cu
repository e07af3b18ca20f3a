// Probe of the FP8 building blocks the Hopper kernel composes, run by tests/test_fp8.py: one
// warpgroup computes S = Q K^T (WgmmaE4m3 SS, e4m3 Q [64 x D], K [128 x D]), transposes V
// [128 x D] in shared memory (transpose_e4m3.cuh), and computes O = e4m3(S) Vt (WgmmaE4m3 RS
// with the permuted A fragments). Operands are copied into shared memory with the layout TMA
// writes (rows of min(D, 128) bytes in slabs, swizzled over the row). Compile-time: HEAD_DIM.
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"
#include "probe_tiles.cuh"
#include "roles/transpose_e4m3.cuh"
#include "ptx/wgmma_fp8.cuh"

namespace ptxattn {
namespace fp8_probe {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kRowBytes = kHeadDim < 128 ? kHeadDim : 128;
constexpr int kSlabs = kHeadDim / kRowBytes;
constexpr int kQRows = 64;
constexpr int kKeys = 128;
constexpr uint32_t kQBytes = kQRows * kHeadDim;
constexpr uint32_t kKVBytes = kKeys * kHeadDim;

}  // namespace fp8_probe
}  // namespace ptxattn

using namespace ptxattn;
using namespace ptxattn::fp8_probe;
using ptxattn::probe::stage_tile;
using ptxattn::probe::store_accumulator;

// One block of 128 threads; dynamic smem kQBytes + 3 * kKVBytes + 1024.
// q (64, D), k (128, D), v (128, D) e4m3 row-major; s (64, 128), o (64, D) fp32.
extern "C" __global__ void __launch_bounds__(128)
fp8_wgmma_probe(const uint8_t* __restrict__ q, const uint8_t* __restrict__ k,
                const uint8_t* __restrict__ v, float* __restrict__ s_out,
                float* __restrict__ o_out) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = align_smem<1024>(smem_raw);
    uint8_t* q_tile = smem;
    uint8_t* k_tile = q_tile + kQBytes;
    uint8_t* v_tile = k_tile + kKVBytes;
    uint8_t* vt_tile = v_tile + kKVBytes;
    stage_tile<kRowBytes, kSlabs>(q_tile, q, kQRows);
    stage_tile<kRowBytes, kSlabs>(k_tile, k, kKeys);
    stage_tile<kRowBytes, kSlabs>(v_tile, v, kKeys);
    __syncthreads();
    const TransposeE4m3<kKeys, kHeadDim, kRowBytes, kKeys, 4> transpose(threadIdx.x / 32,
                                                                         threadIdx.x % 32);
    transpose(smem_addr(v_tile), smem_addr(vt_tile));
    fence_proxy_async();
    __syncthreads();

    float s[kKeys / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 32; ++kk) {
        const uint32_t offset = (kk * 32) % kRowBytes;
        const int slab = kk * 32 / kRowBytes;
        WgmmaE4m3<kKeys>::ss(
            s, wgmma_desc_kmajor<kRowBytes>(smem_addr(q_tile + slab * kQRows * kRowBytes) + offset),
            wgmma_desc_kmajor<kRowBytes>(smem_addr(k_tile + slab * kKeys * kRowBytes) + offset),
            kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    store_accumulator<kKeys>(s_out, s);

    uint32_t p[kKeys / 8];
    accumulator_to_e4m3_a<kKeys>(p, s);
    float o[kHeadDim / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 32; ++kk) {
        WgmmaE4m3<kHeadDim>::rs(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],
                                wgmma_desc_kmajor<kKeys>(smem_addr(vt_tile) + 32 * kk), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    store_accumulator<kHeadDim>(o_out, o);
}
