// Epilogue: the normalised output and the log-sum-exp of each row, written to global memory.
//
// Three paths for the output, all from the mma.sync / wgmma accumulator layout (a thread holds
// rows r and r + 8, columns 8 i + 2 t and + 1 of every 8-column tile, t = lane % 4):
//   direct:       each thread stores its column pairs of a row straight from registers; rows past
//                 seqlen_q are skipped, so it handles partial tiles with any strides;
//   staged (shared memory): each warp writes its rows into its own rows of a swizzled tile in
//                 shared memory, then copies whole 16-byte chunks of each row out, rows past
//                 seqlen_q skipped (the portable kernel: coalesced stores without TMA);
//   staged (TMA): a warpgroup writes its 64-row tile into shared memory with stmatrix, in
//                 128-byte swizzled slabs of 64 columns (the layout a TMA box with the 128-byte
//                 swizzle has), and one thread stores each slab with a TMA store that clips rows
//                 past the end; the warpgroup goes on while the copy drains.
#pragma once
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {

__device__ __forceinline__ void write_lse(const FwdParams& p, int batch, int head, int row,
                                          float value) {
    p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + row] = value;
}

// The row of `out` (16-bit elements) for query row `row` of (batch, head).
__device__ __forceinline__ uint16_t* out_row(const FwdParams& p, int batch, int head, int row) {
    return static_cast<uint16_t*>(p.out) + batch * p.out_stride_b + row * p.out_stride_s +
           head * p.out_stride_h;
}

// Split-KV partials (FwdParams::num_splits > 1): split `split`'s float32 output row and LSE of
// query row `row` (counted over the whole batch: FwdParams::total_q rows) of head `head`.
__device__ __forceinline__ float* partial_out_row(const FwdParams& p, int split, int row,
                                                 int head, int head_dim) {
    return p.out_accum + ((static_cast<int64_t>(split) * p.total_q + row) * p.heads_q + head) *
                             head_dim;
}

__device__ __forceinline__ float& partial_lse(const FwdParams& p, int split, int row, int head) {
    return p.lse_accum[(static_cast<int64_t>(split) * p.heads_q + head) * p.total_q + row];
}

// Row h of accumulator o, times `factor`, as float32 into `dst` (a partial output row), its
// first `cols` columns (a multiple of 8: the row's head_dim_v).
template <int kTiles>
__device__ __forceinline__ void store_accumulator_row_f32(float* dst, const float (&o)[kTiles][4],
                                                          int h, float factor, int lane,
                                                          int cols) {
    const int t = lane % 4;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
        if (8 * i >= cols) break;
        *reinterpret_cast<float2*>(dst + 8 * i + 2 * t) =
            make_float2(o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
    }
}

// Direct path: row h (0: r, 1: r + 8) of accumulator o, times `factor`, into `dst` (that row of
// out), 4 bytes per 8-column tile, its first `cols` columns (a multiple of 8: the array's head
// dim from dst on, where it is narrower than the kernel's).
template <bool kBf16, int kTiles>
__device__ __forceinline__ void store_accumulator_row(uint16_t* dst, const float (&o)[kTiles][4],
                                                      int h, float factor, int lane, int cols) {
    const int t = lane % 4;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
        if (8 * i >= cols) break;
        *reinterpret_cast<uint32_t*>(dst + 8 * i + 2 * t) =
            pack_f32x2<kBf16>(o[i][2 * h] * factor, o[i][2 * h + 1] * factor);
    }
}

// Shared-memory staged path, first half: the warp's kRowGroups x 16 rows of o (rows warp_row..
// of the tile) into the tile at smem, chunk `chunk` of row `row` at tile_offset(row, chunk).
template <bool kBf16, int kRowGroups, int kTiles, class TileOffset>
__device__ __forceinline__ void stage_accumulator_rows(uint8_t* smem, TileOffset tile_offset,
                                                       const float (&o)[kRowGroups][kTiles][4],
                                                       int warp_row, int lane) {
#pragma unroll
    for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row + 16 * m + (lane >> 2) + 8 * h;
#pragma unroll
            for (int j = 0; j < kTiles; ++j) {
                *reinterpret_cast<uint32_t*>(smem + tile_offset(row, j) + 4 * (lane & 3)) =
                    pack_f32x2<kBf16>(o[m][j][2 * h], o[m][j][2 * h + 1]);
            }
        }
    }
}

// Second half, after a __syncwarp: the warp's kWarpRows staged rows of kChunks 16-byte chunks to
// rows first_row + warp_row.. of `out_head` (row stride `seq_stride` elements), rows at or past
// seqlen_q skipped, and chunks at or past `valid_chunks` (the array's head dim / 8).
template <int kWarpRows, int kChunks, class TileOffset>
__device__ __forceinline__ void store_staged_rows(const uint8_t* smem, TileOffset tile_offset,
                                                  uint16_t* out_head, int64_t seq_stride,
                                                  int first_row, int warp_row, int seqlen_q,
                                                  int valid_chunks, int lane) {
    constexpr int kLanesPerRow = kChunks < 32 ? kChunks : 32;
    constexpr int kRowsPerPass = 32 / kLanesPerRow;
    static_assert(kWarpRows % kRowsPerPass == 0, "the passes cover the warp's rows exactly");
#pragma unroll
    for (int pass = 0; pass < kWarpRows / kRowsPerPass; ++pass) {
        const int row = warp_row + pass * kRowsPerPass + lane / kLanesPerRow;
        if (first_row + row < seqlen_q) {
#pragma unroll
            for (int chunk = lane % kLanesPerRow; chunk < kChunks; chunk += kLanesPerRow) {
                if (chunk >= valid_chunks) break;
                *reinterpret_cast<uint4*>(out_head + (first_row + row) * seq_stride + chunk * 8) =
                    *reinterpret_cast<const uint4*>(smem + tile_offset(row, chunk));
            }
        }
    }
}

// Staged path for one warpgroup's 64 x kCols output tile, in `staging` (kBytes of shared
// memory, 1024-byte aligned), kRoundCols columns at a time: where shared memory has no room for
// the whole tile (head_dim 256 with two stages of 64-key tiles), in rounds, each waiting until
// the one before has been read. (Stored straight from registers instead, the 4-byte stores of
// 16-byte row pieces cost bf16 head_dim 256 11-27% of its time;
// docs/design/pipelines.md#output-epilogue.)
// `barrier_id` is a named barrier for the warpgroup's 128 threads.
template <int kCols, bool kBf16, int kRoundCols = kCols>
struct StagedTmaStore {
    static_assert(kRoundCols % 64 == 0 && kCols % kRoundCols == 0, "rounds of whole slabs");
    static constexpr uint32_t kSlabBytes = 64 * 128;
    static constexpr uint32_t kBytes = kSlabBytes * (kRoundCols / 64);

    uint8_t* staging;
    uint32_t barrier_id;

    // o in the accumulator layout of a 64-row wgmma tile; row h of the thread scaled by
    // factor[h]. The thread of warpgroup index 0 then issues the stores at (row0 of the tile,
    // column col0).
    __device__ __forceinline__ void store(const float (&o)[kCols / 8][4],
                                          const float (&factor)[2], const TensorMap* map,
                                          int head, int tile_row0, int batch,
                                          int col0 = 0) const {
        const int wg_thread = threadIdx.x % 128;
        const int lane = threadIdx.x % 32;
        const bool issuer = wg_thread == 0;
        // Column chunks i and i + 1 of the warp's 16 rows (x4_row); 8 chunks a 64-column slab.
        const int row = 16 * (wg_thread / 32) + x4_row(lane);
#pragma unroll
        for (int round = 0; round < kCols / kRoundCols; ++round) {
            // The previous round's (or tile's) store must have read the staging buffer.
            if (issuer) tma_store_wait_read<0>();
            named_barrier_sync(barrier_id, 128);
#pragma unroll
            for (int i = round * (kRoundCols / 8); i < (round + 1) * (kRoundCols / 8); i += 2) {
                const int chunk = i % (kRoundCols / 8) + lane / 16;
                const uint32_t addr = smem_addr(staging + (chunk / 8) * kSlabBytes +
                                                swizzled_offset<128>(row, chunk % 8));
                stmatrix_x4(addr, pack_f32x2<kBf16>(o[i][0] * factor[0], o[i][1] * factor[0]),
                            pack_f32x2<kBf16>(o[i][2] * factor[1], o[i][3] * factor[1]),
                            pack_f32x2<kBf16>(o[i + 1][0] * factor[0], o[i + 1][1] * factor[0]),
                            pack_f32x2<kBf16>(o[i + 1][2] * factor[1], o[i + 1][3] * factor[1]));
            }
            fence_proxy_async();
            named_barrier_sync(barrier_id, 128);
            if (issuer) {
#pragma unroll
                for (int slab = 0; slab < kRoundCols / 64; ++slab) {
                    tma_store_4d(map, staging + slab * kSlabBytes,
                                 col0 + round * kRoundCols + 64 * slab, head, tile_row0, batch);
                }
                tma_store_commit();
            }
        }
    }

    // The last store must have read shared memory before the block exits.
    __device__ __forceinline__ void finish() const {
        if (threadIdx.x % 128 == 0) tma_store_wait_read<0>();
    }
};

}  // namespace ptxattn
