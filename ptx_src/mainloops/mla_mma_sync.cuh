// Mainloop of the multi-head latent attention decode kernel (fwd_mla_mma_sync.cu; mma.sync).
//
// MLA (DeepSeek-V3, Kimi K2) decodes against one latent cache row per token, kHeadDim = 576
// columns (a 512-column latent and 64 rotary ones) shared by every query head: K is the whole
// row and V its first kHeadDimV = 512 columns, so a stage of kBlockN rows is loaded once and
// read as both. Every query head of a token is a row of the tile (PackedRows, one kv head).
//
// The decode kernel's split (every warp all rows, a slice of the keys, its own output) would
// give each warp a 512-column output; here the warps split the keys for S = Q K^T and the
// columns for O = P V:
//   1. warp w scores keys w kWarpKeys .. of the stage for all kRows rows (its S in registers);
//   2. the warps' row maxima meet in shared memory, so that all of them fold the block into the
//      same running max (OnlineSoftmax::update_with_max) and rescale alike;
//   3. each warp writes its probabilities into a shared P tile (kRows x kBlockN, 16-bit);
//   4. warp w accumulates O[:, w kWarpCols ..] += P V[:, w kWarpCols ..] over all the stage's
//      keys, P read back from shared memory and V from the stage.
// Each warp's row sums cover its keys; the epilogue adds them up across warps.
//
// Shared memory: [Q: kRows rows][P tile][row exchange][staged pages][Q row scales][ring], tiles
// of rows of kHeadDim 16-bit values swizzled as the forward's (smem_tile.cuh). An e4m3 cache
// lands in a ring of e4m3 rows (E4m3Tile, rows padded to 640 bytes for its swizzle), which the f16
// GEMMs of e4m3_gemms.cuh read and dequantize in registers; P is then f16 too.
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "mainloops/e4m3_gemms.cuh"
#include "mainloops/fwd_mma_sync.cuh"
#include "roles/kv_cache.cuh"
#include "roles/params.cuh"
#include "roles/smem_tile.cuh"
#include "roles/softmax.cuh"

namespace ptxattn {

// q/k head_dim, v head_dim (v the first columns of k's rows), 16-row groups of packed query
// rows per tile, keys per ring stage, warps, ring depth, bf16 (else fp16) queries, an e4m3 cache
// (else one of the queries' dtype), __launch_bounds__ minimum. The names MmaSyncMainloop reads
// describe one warp's share: kSTiles its keys' S tiles, kOTiles its columns' O tiles, kPSteps
// the stage's keys.
template <int HeadDim, int HeadDimV, int MTiles, int BlockN, int Warps, int Stages, bool Bf16,
          bool KvFp8, int MinBlocksPerSm>
struct MlaConfig {
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kHeadDimV = HeadDimV;
    static constexpr int kMTiles = MTiles;
    static constexpr int kRows = 16 * MTiles;
    static constexpr int kBlockN = BlockN;
    static constexpr int kWarps = Warps;
    static constexpr int kThreads = 32 * Warps;
    static constexpr int kStages = Stages;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kKvFp8 = KvFp8;
    static constexpr int kMinBlocksPerSm = MinBlocksPerSm;

    static constexpr int kWarpKeys = kBlockN / kWarps;   // S: this warp's keys of a stage
    static constexpr int kWarpCols = kHeadDimV / kWarps;  // O: this warp's columns
    static constexpr int kKSteps = kHeadDim / 16;
    static constexpr int kSTiles = kWarpKeys / 8;
    static constexpr int kPSteps = kBlockN / 16;
    static constexpr int kOTiles = kWarpCols / 8;
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunksPerRow = kHeadDim / 8;
    static constexpr int kQTileBytes = kRows * kRowBytes;
    static constexpr int kKVTileBytes = kBlockN * kRowBytes;
    static constexpr int kPRowBytes = kBlockN * 2;
    static constexpr int kPTileBytes = kRows * kPRowBytes;
    static constexpr int kExchangeBytes = kWarps * kRows * 4;
    static constexpr int kFp8ChunksPerRow = kHeadDim / 16;
    static constexpr int kFp8RowBytes = (kHeadDim + 127) / 128 * 128;
    static constexpr int kFp8StageBytes = kBlockN * kFp8RowBytes;
    static constexpr int kStageBytes = kKvFp8 ? kFp8StageBytes : kKVTileBytes;
    static constexpr int kRingBytes = kStages * kStageBytes;
    using Pages = StagedPages<kBlockN, kStages>;
    static constexpr int kPTileOffset = kQTileBytes;
    static constexpr int kExchangeOffset = kPTileOffset + kPTileBytes;
    static constexpr int kPagesOffset = kExchangeOffset + kExchangeBytes;
    static constexpr int kRowScaleOffset = kPagesOffset + Pages::kBytes;
    static constexpr int kRingOffset =
        (kRowScaleOffset + (kKvFp8 && kBf16 ? kRows * 4 : 0) + 127) / 128 * 128;
    static constexpr int kSmemBytes = kRingOffset + kRingBytes;
    // P's 16-bit format: the queries' for the 16-bit GEMMs, f16 for the e4m3 ones
    static constexpr bool kPBf16 = kBf16 && !kKvFp8;

    static_assert(kSTiles % 2 == 0 && kOTiles % 2 == 0,
                  "the GEMMs load B fragments of two 8-column tiles at a time");
    static_assert(kPRowBytes % 128 == 0, "the P tile's swizzle permutes 8 chunks of 16 bytes");
    static_assert(kHeadDim % 64 == 0 && kHeadDimV <= kHeadDim, "V is a prefix of K's rows");
    static_assert(kWarps <= 16, "a warp's first row of a stage is within one page step");
    static_assert(kStages >= 2, "the ring needs a stage in flight while one is computed");

    static_assert(!kKvFp8 || kWarpCols % 32 == 0, "e4m3 V columns come 32 at a time");
};

template <class Cfg>
struct MlaMainloop {
    static constexpr int kThreads = Cfg::kThreads;
    static constexpr int kChunksPerRow = Cfg::kChunksPerRow;
    using Tile = SwizzledTile<Cfg::kRowBytes>;
    using PTile = SwizzledTile<Cfg::kPRowBytes>;
    using Fp8Tile = E4m3Tile<Cfg::kFp8RowBytes>;

    // The packed Q tile: row r (< rows) from q_row(r), a pointer to its first element; rows past
    // `rows` zero-filled.
    template <class QRow>
    static __device__ __forceinline__ void load_q(uint32_t tile, int rows, QRow q_row, int tid) {
        for (int i = tid; i < Cfg::kRows * kChunksPerRow; i += kThreads) {
            const int row = i / kChunksPerRow;
            const int chunk = i % kChunksPerRow;
            const bool valid = row < rows;
            cp_async_16(tile + Tile::offset(row, chunk),
                        valid ? q_row(row) + chunk * 8 : nullptr, valid);
        }
    }

    // One ring stage: the cache rows of keys key0 .. key0 + kBlockN (located by `kv` from the
    // stage's staged pages; `cache` is row 0 of slot 0), zero-filled from `keys` on. Warp w
    // copies rows w, w + kWarps, ..., its lanes a row's 16-byte chunks; an e4m3 cache's rows
    // land in an E4m3Tile.
    template <class Element>
    static __device__ __forceinline__ void load_kv(uint32_t stage, const FwdParams& p,
                                                   const KvRows& kv, const int* staged,
                                                   const Element* cache, int key0, int keys,
                                                   int warp, int lane) {
        constexpr int kChunks = Cfg::kKvFp8 ? Cfg::kFp8ChunksPerRow : kChunksPerRow;
        constexpr int kPerChunk = 16 / sizeof(Element);
        KvRows::StageRows rows = kv.stage_rows(key0, warp, staged);
#pragma unroll 4
        for (int row = warp; row < Cfg::kBlockN; row += Cfg::kWarps) {
            const bool valid = key0 + row < keys;
            const Element* src = cache;
            if (valid) {
                const int2 at = rows.at();
                src += at.x * p.k_stride_b + at.y * p.k_stride_s;
            }
#pragma unroll
            for (int chunk = lane; chunk < kChunks; chunk += 32) {
                const uint32_t dst = Cfg::kKvFp8 ? stage + Fp8Tile::offset(row, chunk)
                                                 : stage + Tile::offset(row, chunk);
                cp_async_16(dst, src + chunk * kPerChunk, valid);
            }
            rows.advance(Cfg::kWarps);
        }
    }

    // Step 2: this warp's raw row maxima of its scores into exchange[warp][row] (one lane of
    // each quad writes).
    static __device__ __forceinline__ void share_row_max(
        float* exchange, const float (&s)[Cfg::kMTiles][Cfg::kSTiles][4], int warp, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float v = quad_max(row_reduce<Cfg::kSTiles>(s[m], h, Max{}));
                if ((lane & 3) == 0) exchange[warp * Cfg::kRows + 16 * m + (lane >> 2) + 8 * h] = v;
            }
        }
    }

    // After a barrier: each owned row's value combined over the warps, in warp order.
    template <class Op>
    static __device__ __forceinline__ void combine_rows(float (&out)[Cfg::kMTiles][2],
                                                        const float* exchange, int lane, Op op) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * m + (lane >> 2) + 8 * h;
                float v = exchange[row];
#pragma unroll
                for (int w = 1; w < Cfg::kWarps; ++w) v = op(v, exchange[w * Cfg::kRows + row]);
                out[m][h] = v;
            }
        }
    }

    // Step 3: this warp's probabilities (its keys' columns) into the P tile.
    static __device__ __forceinline__ void store_probabilities(
        uint32_t p_tile, const float (&s)[Cfg::kMTiles][Cfg::kSTiles][4], int warp, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = 16 * m + (lane >> 2) + 8 * h;
#pragma unroll
                for (int j = 0; j < Cfg::kSTiles; ++j) {
                    const int col = warp * Cfg::kWarpKeys + 8 * j + 2 * (lane & 3);
                    st_shared_b32(p_tile + PTile::element_offset(row, col),
                                  pack_f32x2<Cfg::kPBf16>(s[m][j][2 * h], s[m][j][2 * h + 1]));
                }
            }
        }
    }

    // Step 4's A operand: the P tile's fragments, all of the stage's keys.
    static __device__ __forceinline__ void load_probabilities(
        uint32_t (&a)[Cfg::kMTiles][Cfg::kPSteps][4], uint32_t p_tile,
        const typename PTile::LaneAddr& p_lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int ks = 0; ks < Cfg::kPSteps; ++ks) {
                ldmatrix_x4(a[m][ks], p_lane.at(p_tile, 16 * m, 2 * ks));
            }
        }
    }
};

}  // namespace ptxattn
