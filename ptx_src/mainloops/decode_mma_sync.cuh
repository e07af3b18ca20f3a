// Mainloop of the split-KV decode kernel (fwd_decode_mma_sync.cu; mma.sync, sm_80+).
//
// Decoding has few query rows per kv head (one token times the GQA group) and many keys, so the
// warps split the keys instead of the rows: every warp holds all kRows (GQA-packed) query rows
// and scores its own kWarpKeys of each kBlockN-key stage, with a softmax state of its own. The
// GEMMs are the forward's (mainloops/fwd_mma_sync.cuh), run on the warp's slice of the stage; at
// the end the warps' states are merged through shared memory (merge_warps). The kernel is bound by
// reading K and V, so the ring is deep and a thread steps through its rows of a stage, from the
// stage's staged page-table entries for a paged cache (kv_cache.cuh).
//
// Shared memory: [Q: kRows rows][stage 0: K, V: kBlockN rows each][stage 1]...[paged caches'
// staged table entries], the same swizzled row tiles as the forward (smem_tile.cuh). After the
// loop the ring holds the merge's per-warp row statistics and output slabs.
//
// An e4m3 cache (kKvFp8) lands in a ring of e4m3 rows (E4m3Tile: half the bytes of a 16-bit
// stage, so the ring is twice as deep), which the f16 GEMMs of mainloops/e4m3_gemms.cuh read and
// dequantize in registers: [Q][e4m3 stage 0][e4m3 stage 1]...[pages][bf16 queries: Q's row
// scales]. The cache's descales scale the scores and the output (fwd_decode_mma_sync.cu), never
// the data; what was tried first is in docs/design/serving.md#fp8-caches.
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "roles/kv_cache.cuh"
#include "mainloops/e4m3_gemms.cuh"
#include "mainloops/fwd_mma_sync.cuh"
#include "roles/params.cuh"
#include "roles/smem_tile.cuh"
#include "roles/softmax.cuh"

namespace ptxattn {

// head_dim, 16-row query groups per tile, keys per ring stage, warps (each scores
// kBlockN / kWarps keys of a stage), ring depth, bf16 (else fp16) queries, an e4m3 cache (else
// one of the queries' dtype), __launch_bounds__ minimum. The names MmaSyncMainloop reads
// (kMTiles, kSTiles, ...) describe one warp's share.
template <int HeadDim, int MTiles, int BlockN, int Warps, int Stages, bool Bf16, bool KvFp8,
          int MinBlocksPerSm>
struct DecodeConfig {
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kMTiles = MTiles;
    static constexpr int kRows = 16 * MTiles;
    static constexpr int kBlockN = BlockN;
    static constexpr int kWarps = Warps;
    static constexpr int kThreads = 32 * Warps;
    static constexpr int kStages = Stages;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kKvFp8 = KvFp8;
    static constexpr int kMinBlocksPerSm = MinBlocksPerSm;

    static constexpr int kWarpKeys = kBlockN / kWarps;
    static constexpr int kKSteps = kHeadDim / 16;
    static constexpr int kSTiles = kWarpKeys / 8;
    static constexpr int kPSteps = kWarpKeys / 16;
    static constexpr int kOTiles = kHeadDim / 8;
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunksPerRow = kHeadDim / 8;
    static constexpr int kQTileBytes = kRows * kRowBytes;
    static constexpr int kKVTileBytes = kBlockN * kRowBytes;
    static constexpr int kStageBytes = 2 * kKVTileBytes;
    // e4m3 rows land in chunks of 16 bytes, or of 8 for head_dim 64, so that a load pass of the
    // block's threads spans at most 16 rows (one page step, kv_cache.cuh)
    static constexpr int kFp8ChunkBytes = kHeadDim >= 128 ? 16 : 8;
    static constexpr int kFp8ChunksPerRow = kHeadDim / kFp8ChunkBytes;
    static constexpr int kFp8RowBytes = kHeadDim;
    static constexpr int kFp8TileBytes = kBlockN * kHeadDim;
    static constexpr int kFp8StageBytes = 2 * kFp8TileBytes;
    static constexpr int kRingBytes = kStages * (kKvFp8 ? kFp8StageBytes : kStageBytes);
    // merge_warps: each warp's row max and sum, then its scaled output rows in float32
    static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
    static constexpr int kMergeBytes = kStatBytes + kWarps * kRows * kHeadDim * 4;
    using Pages = StagedPages<kBlockN, kStages>;
    static constexpr int kPagesOffset =
        kQTileBytes + (kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes);
    // e4m3 caches with bf16 queries: each Q row's power-of-two scale (E4m3Gemms, e4m3_gemms.cuh)
    static constexpr int kRowScaleOffset = kPagesOffset + Pages::kBytes;
    static constexpr int kSmemBytes = kRowScaleOffset + (kKvFp8 && kBf16 ? kRows * 4 : 0);

    static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole P V k steps");
    static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes: head_dim >= 64");
    static_assert(kThreads % kChunksPerRow == 0 && kBlockN % (kThreads / kChunksPerRow) == 0,
                  "stage loads give every thread the same number of whole chunks");
    static_assert(kStages >= 2, "the ring needs a stage in flight while one is computed");
    static_assert(!kKvFp8 || kThreads / kFp8ChunksPerRow <= 16,
                  "an e4m3 load pass steps at most one page (16 rows or more)");
    static_assert(!kKvFp8 || (kThreads % kFp8ChunksPerRow == 0 &&
                              kBlockN % (kThreads / kFp8ChunksPerRow) == 0),
                  "e4m3 stage loads give every thread the same number of whole chunks");

    static_assert(!kKvFp8 || (kOTiles % 4 == 0 && kSTiles % 2 == 0),
                  "e4m3 V fragments come four 8-column tiles at a time");

    // Ring stage `iter`: its K tile, V's following it (kKVTileBytes or kFp8TileBytes on).
    static __device__ __forceinline__ uint32_t stage(uint32_t ring, int iter) {
        return ring + (iter % kStages) * (kKvFp8 ? kFp8StageBytes : kStageBytes);
    }
};

template <class Cfg>
struct DecodeMainloop {
    static constexpr int kThreads = Cfg::kThreads;
    static constexpr int kChunksPerRow = Cfg::kChunksPerRow;
    static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    static_assert(kRowsPerPass <= 16, "a thread's rows step at most one page (16 rows or more)");
    using Tile = SwizzledTile<Cfg::kRowBytes>;
    using Fp8Tile = E4m3Tile<Cfg::kFp8RowBytes>;

    // The packed Q tile: row r (< rows) from q_row(r), a pointer to its first element; rows past
    // `rows` and columns past `head_dim` zero-filled.
    template <class QRow>
    static __device__ __forceinline__ void load_q(uint32_t tile, int rows, int head_dim,
                                                  QRow q_row, int tid) {
        const int chunk = tid % kChunksPerRow;
        const bool column = chunk < head_dim / 8;
#pragma unroll
        for (int row = tid / kChunksPerRow; row < Cfg::kRows; row += kRowsPerPass) {
            const bool valid = column && row < rows;
            const uint16_t* src = valid ? q_row(row) + chunk * 8 : nullptr;
            cp_async_16(tile + Tile::offset(row, chunk), src, valid);
        }
    }

    // One ring stage: the K and V rows of keys key0 .. key0 + kBlockN of the sequence (located
    // by `kv` from the stage's staged pages; k_head and v_head point at the kv head's column of
    // slot 0, row 0), zero-filled from `keys` on and past p.head_dim (K) and p.head_dim_v (V).
    static __device__ __forceinline__ void load_kv(uint32_t stage, const FwdParams& p,
                                                   const KvRows& kv, const int* staged,
                                                   const uint16_t* k_head,
                                                   const uint16_t* v_head, int key0, int keys,
                                                   int tid) {
        const int chunk = tid % kChunksPerRow;
        const bool k_column = chunk < p.head_dim / 8;
        const bool v_column = chunk < p.head_dim_v / 8;
        KvRows::StageRows rows = kv.stage_rows(key0, tid / kChunksPerRow, staged);
#pragma unroll
        for (int pass = 0; pass < Cfg::kBlockN / kRowsPerPass; ++pass) {
            const int row = tid / kChunksPerRow + pass * kRowsPerPass;
            const bool valid = key0 + row < keys;
            const uint16_t* k_src = k_head;
            const uint16_t* v_src = v_head;
            if (valid) {
                const int2 at = rows.at();
                k_src += at.x * p.k_stride_b + at.y * p.k_stride_s + chunk * 8;
                v_src += at.x * p.v_stride_b + at.y * p.v_stride_s + chunk * 8;
            }
            cp_async_16(stage + Tile::offset(row, chunk), k_src, valid && k_column);
            cp_async_16(stage + Cfg::kKVTileBytes + Tile::offset(row, chunk), v_src,
                        valid && v_column);
            rows.advance(kRowsPerPass);
        }
    }

    // load_kv for an e4m3 cache: the same rows as bytes, into an E4m3Tile of K and V's after it
    // (k_head, v_head: byte pointers like load_kv's).
    static __device__ __forceinline__ void load_kv_e4m3(uint32_t stage, const FwdParams& p,
                                                        const KvRows& kv, const int* staged,
                                                        const uint8_t* k_head,
                                                        const uint8_t* v_head, int key0,
                                                        int keys, int tid) {
        constexpr int kChunk = Cfg::kFp8ChunkBytes;
        constexpr int kChunks = Cfg::kFp8ChunksPerRow;
        constexpr int kPassRows = kThreads / kChunks;
        const int chunk = tid % kChunks;
        const bool k_column = chunk * kChunk < p.head_dim;
        const bool v_column = chunk * kChunk < p.head_dim_v;
        KvRows::StageRows rows = kv.stage_rows(key0, tid / kChunks, staged);
#pragma unroll
        for (int pass = 0; pass < Cfg::kBlockN / kPassRows; ++pass) {
            const int row = tid / kChunks + pass * kPassRows;
            const bool valid = key0 + row < keys;
            const uint8_t* k_src = k_head;
            const uint8_t* v_src = v_head;
            if (valid) {
                const int2 at = rows.at();
                k_src += at.x * p.k_stride_b + at.y * p.k_stride_s + chunk * kChunk;
                v_src += at.x * p.v_stride_b + at.y * p.v_stride_s + chunk * kChunk;
            }
            const uint32_t k_dst = stage + Fp8Tile::offset(row, chunk * kChunk / 16) +
                                   chunk * kChunk % 16;
            const uint32_t v_dst = k_dst + Cfg::kFp8TileBytes;
            if constexpr (kChunk == 16) {
                cp_async_16(k_dst, k_src, valid && k_column);
                cp_async_16(v_dst, v_src, valid && v_column);
            } else {
                cp_async_8(k_dst, k_src, valid && k_column);
                cp_async_8(v_dst, v_src, valid && v_column);
            }
            rows.advance(kPassRows);
        }
    }
};

// The merge of the warps' softmax states (every warp saw other keys of the same rows): with
// m_w a warp's reference max and l_w its row sum, M = max_w m_w and L = sum_w l_w 2^(m_w - M);
// the output is sum_w o_w 2^(m_w - M) / L, summed in warp order so that it is deterministic,
// and the row's LSE is (M + log2 L) ln 2 (-inf, with zeros out, when no warp saw a key). Returns
// the normalised rows (shared memory, kRows x kHeadDim float32, inside `scratch`) and leaves
// their LSEs in `row_lse` (kRows floats, outside it). Call after the ring is drained; uses
// `scratch` (kMergeBytes).
template <class Cfg, class Softmax>
__device__ __forceinline__ const float* merge_warps(float (&o)[Cfg::kMTiles][Cfg::kOTiles][4],
                                            const Softmax& softmax, uint8_t* scratch,
                                            float* row_lse, int warp, int lane) {
    constexpr int kRows = Cfg::kRows;
    constexpr float kLn2 = 0.693147180559945309f;
    const float neg_inf = -__int_as_float(0x7f800000);
    float* warp_max = reinterpret_cast<float*>(scratch);  // [warp][row]
    float* warp_sum = warp_max + Cfg::kWarps * kRows;
    float* slabs = warp_sum + Cfg::kWarps * kRows;        // [warp][row][column]
#pragma unroll
    for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = quad_sum(softmax.row_sum[m][h]);
            const int row = 16 * m + (lane >> 2) + 8 * h;
            if ((lane & 3) == 0) {
                warp_max[warp * kRows + row] = softmax.row_max[m][h];
                warp_sum[warp * kRows + row] = sum;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * m + (lane >> 2) + 8 * h;
            float row_max = neg_inf;
#pragma unroll
            for (int w = 0; w < Cfg::kWarps; ++w) row_max = fmaxf(row_max, warp_max[w * kRows + row]);
            const float bias = row_max == neg_inf ? 0.0f : row_max;
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < Cfg::kWarps; ++w) {
                total += warp_sum[w * kRows + row] * exp2f(warp_max[w * kRows + row] - bias);
            }
            const float factor =
                total > 0.0f ? exp2f(softmax.row_max[m][h] - bias) / total : 0.0f;
            if (warp == 0 && (lane & 3) == 0) {
                row_lse[row] = total > 0.0f ? (row_max + log2f(total)) * kLn2 : neg_inf;
            }
            float* slab_row = slabs + (warp * kRows + row) * Cfg::kHeadDim;
#pragma unroll
            for (int j = 0; j < Cfg::kOTiles; ++j) {
                const int col = 2 * (lane & 3);
                if constexpr (Cfg::kKvFp8) {  // E4m3Gemms' column order
                    using Gemms = E4m3Gemms<Cfg>;
                    slab_row[Gemms::output_column(j, col)] = o[m][j][2 * h] * factor;
                    slab_row[Gemms::output_column(j, col + 1)] = o[m][j][2 * h + 1] * factor;
                } else {
                    *reinterpret_cast<float2*>(slab_row + 8 * j + col) =
                        make_float2(o[m][j][2 * h] * factor, o[m][j][2 * h + 1] * factor);
                }
            }
        }
    }
    __syncthreads();
    // slab 0 <- the sum over warps, four columns a thread at a time
    for (int i = 4 * static_cast<int>(threadIdx.x); i < kRows * Cfg::kHeadDim; i += 4 * Cfg::kThreads) {
        float4 acc = *reinterpret_cast<const float4*>(slabs + i);
#pragma unroll
        for (int w = 1; w < Cfg::kWarps; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(slabs + w * kRows * Cfg::kHeadDim + i);
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        *reinterpret_cast<float4*>(slabs + i) = acc;
    }
    __syncthreads();
    return slabs;
}

}  // namespace ptxattn
