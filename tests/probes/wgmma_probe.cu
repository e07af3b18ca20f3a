// Probe of wgmma.cuh and wgmma_fp8.cuh, run by tests/test_primitives.py: one warpgroup (128
// threads) runs the products of the Hopper kernel's two GEMMs on operands given row-major in
// global memory, which it first copies into shared memory in the layout TMA writes (1024-byte
// aligned slabs of rows of one swizzle span, kRowBytes = min(row bytes, 128), chunks placed by
// swizzled_offset). Results are stored row-major in fp32 (the accumulator layout of wgmma.cuh).
//
// wgmma16_probe<kHeadDim, kBlockN, kBf16>: q [64 x kHeadDim], k [kBlockN x kHeadDim],
// v [kBlockN x kHeadDim], 16-bit (bf16 or fp16) as raw uint16 bits.
//   s [64 x kBlockN]  = q k^T        Wgmma16<kBlockN>::ss, both operands K-major
//                                    (wgmma_desc_kmajor<128>, advanced per 32-byte k-step and
//                                    per slab as mainloops/fwd_sm90.cuh's issue_qk does); s starts
//                                    as NaN, the first k-step overwrites it (accumulate = 0);
//   o [64 x kHeadDim] = 1 + p v      p = s packed to 16 bits by pack_f32x2 as the A fragments of
//                                    Wgmma16<kHeadDim>::rs, v MN-major through
//                                    wgmma_desc_sw128(v, slab bytes, 1024) advanced 16 rows per
//                                    k-step (mma_pv); o starts as 1 and every k-step accumulates.
// wgmma16_dq_probe<kHeadDim, kBf16>: the backward's dQ = dS K. st [128 x 64] fp32 (dS^T: rows
// keys, columns queries), k [128 x kHeadDim] 16-bit.
//   ds [64 x 128] 16-bit  dS as stmatrix_x4_trans writes it: each 64-key half of st loaded into
//                         the accumulator layout of an m64n64 tile (the S^T tile of the
//                         backward), packed by pack_f32x2 and stored transposed into one
//                         128-byte-swizzled K-major slab of dS (keys 0-63 slab 0, 64-127 slab 1),
//                         then read back un-swizzled, so the layout shows apart from the GEMM;
//   dq [kHeadDim / 64][64 x 64] = dS K[:, 64 half ..]  Wgmma16<64>::ss<kBf16, true>: A = dS
//                         (wgmma_desc_kmajor<128>, advanced per 16-key k-step by slab and 32
//                         bytes), B = K MN-major as TMA stores it (wgmma_desc_sw128(slab `half`,
//                         slab bytes, 1024) advanced 16 rows per k-step, as mma_pv reads V);
//                         dq starts as NaN, the first k-step overwrites it.
//   dqt [kHeadDim / 64][64 x 64] = (dS K[:, 64 half ..])^T = K^T dS^T  Wgmma16<64>::ss<kBf16,
//                         false, true>: the same two descriptors with their roles swapped, A =
//                         K's slab MN-major (imm-trans-a), B = dS K-major, as the head_dim 128
//                         backward computes dQ transposed; from NaN likewise.
// wgmma_e4m3_probe<kHeadDim, N>: q [64 x kHeadDim], k [N x kHeadDim], e4m3 bytes.
//   s [64 x N] = q k^T   WgmmaE4m3<N>::ss, K-major (wgmma_desc_kmajor<kRowBytes>), s from NaN;
//   t [64 x N] = q k^T   WgmmaE4m3<N>::rs, A fragments read from global memory in the layout
//                        wgmma_fp8.cuh documents, B as for s.
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma_sync.cuh"
#include "probe_tiles.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "ptx/wgmma_fp8.cuh"

namespace ptxattn {
namespace probe {

template <int N>
__device__ __forceinline__ void fill(float (&d)[N], float value) {
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = value;
}

// Dynamic shared memory: (64 + 2 * kBlockN) * kHeadDim * 2 + 1024 bytes.
template <int kHeadDim, int kBlockN, bool kBf16>
__global__ void __launch_bounds__(128)
wgmma16_probe(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
              const uint16_t* __restrict__ v, float* __restrict__ s_out,
              float* __restrict__ o_out) {
    constexpr int kSlabs = kHeadDim / 64;
    constexpr uint32_t kQSlabBytes = 64 * 128;
    constexpr uint32_t kKVSlabBytes = kBlockN * 128;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* q_tile = align_smem<1024>(smem_raw);
    uint8_t* k_tile = q_tile + kSlabs * kQSlabBytes;
    uint8_t* v_tile = k_tile + kSlabs * kKVSlabBytes;
    stage_tile<128, kSlabs>(q_tile, reinterpret_cast<const uint8_t*>(q), 64);
    stage_tile<128, kSlabs>(k_tile, reinterpret_cast<const uint8_t*>(k), kBlockN);
    stage_tile<128, kSlabs>(v_tile, reinterpret_cast<const uint8_t*>(v), kBlockN);
    fence_proxy_async();
    __syncthreads();

    float s[kBlockN / 2];
    fill(s, __int_as_float(0x7fc00000));
    const uint64_t q_desc = wgmma_desc_kmajor<128>(smem_addr(q_tile));
    const uint64_t k_desc = wgmma_desc_kmajor<128>(smem_addr(k_tile));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint32_t slab = kk / 4;
        const uint32_t step = (kk % 4) * 32;
        Wgmma16<kBlockN>::template ss<kBf16>(
            s, wgmma_desc_advance(q_desc, slab * kQSlabBytes + step),
            wgmma_desc_advance(k_desc, slab * kKVSlabBytes + step), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    store_accumulator<kBlockN>(s_out, s);

    uint32_t p[kBlockN / 4];
#pragma unroll
    for (int j = 0; j < kBlockN / 4; ++j) p[j] = pack_f32x2<kBf16>(s[2 * j], s[2 * j + 1]);
    float o[kHeadDim / 2];
    fill(o, 1.0f);
    const uint64_t v_desc = wgmma_desc_sw128(smem_addr(v_tile), kKVSlabBytes, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
        Wgmma16<kHeadDim>::template rs<kBf16>(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2],
                                              p[4 * kk + 3],
                                              wgmma_desc_advance(v_desc, kk * 16 * 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    store_accumulator<kHeadDim>(o_out, o);
}

// Loads a row-major [64 x N] fp32 matrix into an m64nN accumulator of the warpgroup (the
// inverse of store_accumulator), where the backward's S^T tile would come from a wgmma.
template <int N>
__device__ __forceinline__ void load_accumulator(float (&d)[N / 2], const float* src) {
    const int lane = threadIdx.x % 32;
    const int row = (threadIdx.x / 32) * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        const int col = 8 * i + 2 * (lane % 4);
        d[4 * i] = src[row * N + col];
        d[4 * i + 1] = src[row * N + col + 1];
        d[4 * i + 2] = src[(row + 8) * N + col];
        d[4 * i + 3] = src[(row + 8) * N + col + 1];
    }
}

// Writes st, an m64n64 accumulator whose rows are 64 keys and columns 64 queries, as 16-bit
// dS = st^T [64 queries x 64 keys] into one 128-byte-swizzled K-major slab (one TMA box of
// 64 columns). Per warp, the 8x8 matrix (i, h) = (queries 8i.., keys 16 warp + 8h..) has the
// fragment pack_f32x2(st[4i + 2h], st[4i + 2h + 1]); x4 number j stores (2j, 0), (2j, 1),
// (2j + 1, 0), (2j + 1, 1), i.e. registers st[8j .. 8j + 7] in order, and lane 8m + r addresses
// row r of matrix m transposed: query row 8i + r, the 16-byte chunk 2 warp + h of its keys.
template <bool kBf16>
__device__ __forceinline__ void store_transposed(uint8_t* slab, const float (&st)[32]) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int m = lane / 8;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int query = 8 * (2 * j + m / 2) + lane % 8;
        stmatrix_x4_trans(smem_addr(slab + swizzled_offset<128>(query, 2 * warp + m % 2)),
                          pack_f32x2<kBf16>(st[8 * j], st[8 * j + 1]),
                          pack_f32x2<kBf16>(st[8 * j + 2], st[8 * j + 3]),
                          pack_f32x2<kBf16>(st[8 * j + 4], st[8 * j + 5]),
                          pack_f32x2<kBf16>(st[8 * j + 6], st[8 * j + 7]));
    }
}

// Dynamic shared memory: (64 + kHeadDim) * 128 * 2 + 1024 bytes (dS [64 x 128], K [128 x
// kHeadDim], 16-bit, and the 1024-byte alignment of the swizzle atoms).
template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(128)
wgmma16_dq_probe(const float* __restrict__ st, const uint16_t* __restrict__ k,
                 uint16_t* __restrict__ ds_out, float* __restrict__ dq_out,
                 float* __restrict__ dqt_out) {
    constexpr int kKeys = 128;
    constexpr int kSlabs = kHeadDim / 64;
    constexpr uint32_t kDsSlabBytes = 64 * 128;    // 64 query rows x 64 keys
    constexpr uint32_t kKSlabBytes = kKeys * 128;  // 128 key rows x 64 head_dim columns
    extern __shared__ uint8_t smem_raw[];
    uint8_t* ds_tile = align_smem<1024>(smem_raw);
    uint8_t* k_tile = ds_tile + (kKeys / 64) * kDsSlabBytes;
    stage_tile<128, kSlabs>(k_tile, reinterpret_cast<const uint8_t*>(k), kKeys);
#pragma unroll
    for (int slab = 0; slab < kKeys / 64; ++slab) {
        float s[32];
        load_accumulator<64>(s, st + slab * 64 * 64);
        store_transposed<kBf16>(ds_tile + slab * kDsSlabBytes, s);
    }
    // stmatrix writes through the generic proxy; wgmma reads dS through the async proxy.
    fence_proxy_async();
    __syncthreads();

    // dS back out row-major, each 16-byte chunk from where swizzled_offset puts it.
    for (int c = threadIdx.x; c < 64 * kKeys / 8; c += blockDim.x) {
        const int row = c / (kKeys / 8);
        const int chunk = c % (kKeys / 8);
        *reinterpret_cast<uint4*>(ds_out + 8 * c) = *reinterpret_cast<const uint4*>(
            ds_tile + (chunk / 8) * kDsSlabBytes + swizzled_offset<128>(row, chunk % 8));
    }

    const uint64_t ds_desc = wgmma_desc_kmajor<128>(smem_addr(ds_tile));
#pragma unroll
    for (int half = 0; half < kSlabs; ++half) {
        const uint64_t k_desc =
            wgmma_desc_sw128(smem_addr(k_tile + half * kKSlabBytes), kKSlabBytes, 1024);
        float dq[32];
        float dqt[32];
        fill(dq, __int_as_float(0x7fc00000));
        fill(dqt, __int_as_float(0x7fc00000));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk) {
            const uint32_t key = 16 * kk;
            const uint64_t ds_at =
                wgmma_desc_advance(ds_desc, (key / 64) * kDsSlabBytes + (key % 64) * 2);
            const uint64_t k_at = wgmma_desc_advance(k_desc, key * 128);
            Wgmma16<64>::template ss<kBf16, true>(dq, ds_at, k_at, kk > 0);
            Wgmma16<64>::template ss<kBf16, false, true>(dqt, k_at, ds_at, kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(dq);
        wgmma_fence_operand(dqt);
        store_accumulator<64>(dq_out + half * 64 * 64, dq);
        store_accumulator<64>(dqt_out + half * 64 * 64, dqt);
    }
}

// Dynamic shared memory: (64 + N) * kHeadDim + 1024 bytes.
template <int kHeadDim, int N>
__global__ void __launch_bounds__(128)
wgmma_e4m3_probe(const uint8_t* __restrict__ q, const uint8_t* __restrict__ k,
                 float* __restrict__ s_out, float* __restrict__ t_out) {
    constexpr int kRowBytes = kHeadDim < 128 ? kHeadDim : 128;
    constexpr int kSlabs = kHeadDim / kRowBytes;
    constexpr uint32_t kQSlabBytes = 64 * kRowBytes;
    constexpr uint32_t kKSlabBytes = N * kRowBytes;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* q_tile = align_smem<1024>(smem_raw);
    uint8_t* k_tile = q_tile + kSlabs * kQSlabBytes;
    stage_tile<kRowBytes, kSlabs>(q_tile, q, 64);
    stage_tile<kRowBytes, kSlabs>(k_tile, k, N);
    fence_proxy_async();
    __syncthreads();

    const uint64_t q_desc = wgmma_desc_kmajor<kRowBytes>(smem_addr(q_tile));
    const uint64_t k_desc = wgmma_desc_kmajor<kRowBytes>(smem_addr(k_tile));
    float s[N / 2];
    fill(s, __int_as_float(0x7fc00000));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 32; ++kk) {
        const uint32_t slab = kk * 32 / kRowBytes;
        const uint32_t step = (kk * 32) % kRowBytes;
        WgmmaE4m3<N>::ss(s, wgmma_desc_advance(q_desc, slab * kQSlabBytes + step),
                         wgmma_desc_advance(k_desc, slab * kKSlabBytes + step), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    store_accumulator<N>(s_out, s);

    // a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..] of each
    // 32-column k-step, rows relative to 16 * warp, the lowest byte the lowest column.
    const int lane = threadIdx.x % 32;
    const uint8_t* a_row = q + ((threadIdx.x / 32) * 16 + lane / 4) * kHeadDim + 4 * (lane % 4);
    uint32_t a[kHeadDim / 8];
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 32; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            a[4 * kk + r] = *reinterpret_cast<const uint32_t*>(a_row + (r % 2) * 8 * kHeadDim +
                                                               32 * kk + (r / 2) * 16);
        }
    }
    float t[N / 2];
    fill(t, __int_as_float(0x7fc00000));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 32; ++kk) {
        const uint32_t slab = kk * 32 / kRowBytes;
        const uint32_t step = (kk * 32) % kRowBytes;
        WgmmaE4m3<N>::rs(t, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3],
                         wgmma_desc_advance(k_desc, slab * kKSlabBytes + step), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(t);
    store_accumulator<N>(t_out, t);
}

}  // namespace probe
}  // namespace ptxattn
