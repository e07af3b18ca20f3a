// Mainloop of the split-KV decode kernel (fwd_decode_mma_sync.cu; mma.sync, sm_80+).
//
// Decoding has few query rows per kv head (one token times the GQA group) and many keys, so the
// warps split the keys instead of the rows: every warp holds all kRows (GQA-packed) query rows
// and scores its own kWarpKeys of each kBlockN-key stage, with a softmax state of its own. The
// GEMMs are the forward's (mainloops/fwd_mma_sync.cuh), run on the warp's slice of the stage; at the
// end the warps' states are merged through shared memory (merge_warps). The kernel is bound by
// reading K and V, so the ring is deep and a thread steps through its rows of a stage, from the
// stage's staged page-table entries for a paged cache (kv_cache.cuh).
//
// Shared memory: [Q: kRows rows][stage 0: K, V: kBlockN rows each][stage 1]...[paged caches'
// staged table entries], the same swizzled row tiles as the forward (smem_tile.cuh). After the
// loop the ring holds the merge's per-warp row statistics and output slabs.
//
// An e4m3 cache (kKvFp8) lands in a ring of e4m3 rows (E4m3Tile: half the bytes of a 16-bit
// stage, so the ring is twice as deep) and the GEMMs read their B fragments from it as 4-byte
// words, dequantized in registers (DecodeE4m3Gemms): [Q][e4m3 stage 0][e4m3 stage 1]...[pages].
// The conversion is exact (e4m3x4_to_16bit); the cache's descales scale the scores and the
// output (fwd_decode_mma_sync.cu), never the data. (Dequantizing each stage into a 16-bit stage
// for the 16-bit GEMMs instead moved 6 bytes of shared memory per cache byte, and read a cache
// at 0.43 of copy bandwidth, below a bf16 cache's rate in tokens; H200, 2026-12-02.)
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/e4m3.cuh"
#include "roles/kv_cache.cuh"
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
    static constexpr int kFp8TileBytes = kBlockN * kHeadDim;
    static constexpr int kFp8StageBytes = 2 * kFp8TileBytes;
    static constexpr int kRingBytes = kStages * (kKvFp8 ? kFp8StageBytes : kStageBytes);
    // merge_warps: each warp's row max and sum, then its scaled output rows in float32
    static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
    static constexpr int kMergeBytes = kStatBytes + kWarps * kRows * kHeadDim * 4;
    using Pages = StagedPages<kBlockN, kStages>;
    static constexpr int kPagesOffset =
        kQTileBytes + (kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes);
    static constexpr int kSmemBytes = kPagesOffset + Pages::kBytes;

    static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole P V k steps");
    static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes: head_dim >= 64");
    static_assert(kThreads % kChunksPerRow == 0 && kBlockN % (kThreads / kChunksPerRow) == 0,
                  "stage loads give every thread the same number of whole chunks");
    static_assert(kStages >= 2, "the ring needs a stage in flight while one is computed");
    static_assert(!kKvFp8 || kThreads / kFp8ChunksPerRow <= 16,
                  "an e4m3 load pass steps at most one page (16 rows or more)");

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
    using Fp8Tile = E4m3Tile<Cfg::kHeadDim>;

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

// The GEMMs over an e4m3 stage (a warp's keys of it, rows from a multiple of 16), B fragments
// read as 4-byte words and dequantized in registers (e4m3x4_to_16bit); Q's A fragments come from
// the 16-bit Q tile. Fragment layouts: mma_sync.cuh; g = lane / 4, t = lane % 4.
//   S = Q K^T: a k step's 16 columns are summed in any order, so logical k = 2t, 2t+1 (b0) and
//     2t+8, 2t+9 (b1) are taken as columns 4t .. 4t+3 of the step: one word of K row g, one
//     8-byte load of each Q row for (a0, a2) and (a1, a3).
//   O += P V: P is S's accumulator as in the 16-bit kernel (keys 2t, 2t+1, 2t+8, 2t+9 of a
//     16-key step); thread (g, t) loads the word of columns 4g .. 4g+3 of a 32-column group in
//     each of those four keys' rows and transposes the 4 x 4 bytes (prmt) into the B fragments of
//     four 8-column tiles, so that tile 4c + q, column n of O holds V's column 32c + 4n + q.
//     output_column() maps an accumulator column back.
template <class Cfg>
struct DecodeE4m3Gemms {
    using QTile = SwizzledTile<Cfg::kRowBytes>;
    using Fp8Tile = E4m3Tile<Cfg::kHeadDim>;

    // Every load is issued before the conversions and MMAs that use it: ld.shared, like the
    // MMAs, is volatile asm, kept in program order, so a load placed after an MMA would wait for
    // that MMA's operands and each k step would pay a load's latency.
    static __device__ __forceinline__ uint32_t load_word(uint32_t addr) {
        uint32_t word;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(word) : "r"(addr));
        return word;
    }

    // Q's A fragments of k step ks: columns 4t .. 4t+3 of the step in rows g, g + 8.
    static __device__ __forceinline__ void load_q(uint32_t (&a)[Cfg::kMTiles][4], uint32_t q_tile,
                                                  int ks, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t at = q_tile + QTile::element_offset(16 * m + (lane >> 2) + 8 * h,
                                                                   16 * ks + 4 * (lane & 3));
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];"
                             : "=r"(a[m][h]), "=r"(a[m][h + 2]) : "r"(at));
            }
        }
    }

    static __device__ __forceinline__ void gemm_qk(float (&s)[Cfg::kMTiles][Cfg::kSTiles][4],
                                                   uint32_t q_tile, uint32_t k_tile, int lane) {
        const int g = lane >> 2;
        const int t = lane & 3;
        uint32_t k_words[Cfg::kKSteps][Cfg::kSTiles];  // this warp's keys, all k steps
#pragma unroll
        for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
#pragma unroll
            for (int j = 0; j < Cfg::kSTiles; ++j) {
                k_words[ks][j] = load_word(k_tile + Fp8Tile::offset(8 * j + g, ks) + 4 * t);
            }
        }
        zero_fill(s);
        uint32_t a[2][Cfg::kMTiles][4];  // k steps ks and ks + 1
        load_q(a[0], q_tile, 0, lane);
#pragma unroll
        for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
            if (ks + 1 < Cfg::kKSteps) load_q(a[(ks + 1) % 2], q_tile, ks + 1, lane);
#pragma unroll
            for (int j = 0; j < Cfg::kSTiles; ++j) {
                const uint2 b = e4m3x4_to_16bit<Cfg::kBf16>(k_words[ks][j]);
                const uint32_t b_frag[2] = {b.x, b.y};
#pragma unroll
                for (int m = 0; m < Cfg::kMTiles; ++m) {
                    mma_m16n8k16<Cfg::kBf16>(s[m][j], a[ks % 2][m], b_frag);
                }
            }
        }
    }

    static __device__ __forceinline__ void gemm_pv(float (&o)[Cfg::kMTiles][Cfg::kOTiles][4],
                                                   const uint32_t (&p)[Cfg::kMTiles][Cfg::kPSteps][4],
                                                   uint32_t v_tile, int lane) {
        const int g = lane >> 2;
        const int t = lane & 3;
#pragma unroll
        for (int ks = 0; ks < Cfg::kPSteps; ++ks) {
            // columns 32c + 4g .. + 3 of keys 16ks + 2t, +1, +8, +9, every group c
            uint32_t w[Cfg::kOTiles / 4][4];
#pragma unroll
            for (int c = 0; c < Cfg::kOTiles / 4; ++c) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = 16 * ks + 2 * t + (i & 1) + 8 * (i >> 1);
                    w[c][i] = load_word(v_tile + Fp8Tile::offset(row, 2 * c + (g >> 2)) +
                                        4 * (g & 3));
                }
            }
#pragma unroll
            for (int c = 0; c < Cfg::kOTiles / 4; ++c) {
                const uint32_t lo01 = __byte_perm(w[c][0], w[c][1], 0x5140);
                const uint32_t hi01 = __byte_perm(w[c][0], w[c][1], 0x7362);
                const uint32_t lo23 = __byte_perm(w[c][2], w[c][3], 0x5140);
                const uint32_t hi23 = __byte_perm(w[c][2], w[c][3], 0x7362);
                const uint32_t column[4] = {
                    __byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                    __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const uint2 b = e4m3x4_to_16bit<Cfg::kBf16>(column[q]);
                    const uint32_t b_frag[2] = {b.x, b.y};
#pragma unroll
                    for (int m = 0; m < Cfg::kMTiles; ++m) {
                        mma_m16n8k16<Cfg::kBf16>(o[m][4 * c + q], p[m][ks], b_frag);
                    }
                }
            }
        }
    }

    // V's column of accumulator tile j, column `col` (< 8).
    static __device__ __forceinline__ constexpr int output_column(int j, int col) {
        return 32 * (j >> 2) + 4 * col + (j & 3);
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
                if constexpr (Cfg::kKvFp8) {  // DecodeE4m3Gemms' column order
                    using Gemms = DecodeE4m3Gemms<Cfg>;
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
