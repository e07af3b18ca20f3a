// Mainloop of the portable forward (mma.sync, sm_80+): FlashAttention-2 style.
//
// A block computes kBlockM query rows of one (batch, head); its kWarps warps each own
// kBlockM / kWarps consecutive rows (a multiple of 16, one mma M tile per 16). K/V blocks of
// kBlockN keys stream through a kStages-deep cp.async ring in shared memory while the warps run
// S = Q K^T, the online softmax and O += P V with P kept in registers (C fragment -> A
// fragment). Q is loaded once and its A fragments are re-read from shared memory for every
// block: a warp owning 32 rows has no registers to spare for them next to O and S.
//
// Shared-memory tiles hold rows of kHeadDim 16-bit values, 16-byte chunks XOR-swizzled by
// row % 8 (tile_offset), which keeps ldmatrix, cp.async and the epilogue's stores free of bank
// conflicts. Layout: [Q: kBlockM rows][stage 0: K, V: kBlockN rows each][stage 1]...
#pragma once
#include "common.cuh"
#include "cp_async.cuh"
#include "mma_sync.cuh"

namespace ptxattn {

// The compile-time shape of a portable forward kernel: head_dim, query rows and keys per tile,
// warps, cp.async ring depth, bf16 (else fp16), causal, __launch_bounds__ minimum blocks/SM.
template <int HeadDim, int BlockM, int BlockN, int Warps, int Stages, bool Bf16, bool Causal,
          int MinBlocksPerSm>
struct MmaSyncConfig {
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kBlockM = BlockM;
    static constexpr int kBlockN = BlockN;
    static constexpr int kWarps = Warps;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kStages = Stages;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kCausal = Causal;
    static constexpr int kMinBlocksPerSm = MinBlocksPerSm;

    static constexpr int kWarpRows = kBlockM / kWarps;
    static constexpr int kMTiles = kWarpRows / 16;      // 16-row mma tiles per warp
    static constexpr int kKSteps = kHeadDim / 16;       // k steps of S = Q K^T
    static constexpr int kSTiles = kBlockN / 8;         // 8-column tiles of S
    static constexpr int kPSteps = kBlockN / 16;        // k steps of O += P V
    static constexpr int kOTiles = kHeadDim / 8;        // 8-column tiles of O
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row
    static constexpr int kQTileBytes = kBlockM * kRowBytes;
    static constexpr int kKVTileBytes = kBlockN * kRowBytes;
    static constexpr int kStageBytes = 2 * kKVTileBytes;

    static_assert(kWarpRows % 16 == 0, "each warp owns whole 16-row mma tiles");
    static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes: head_dim >= 64");
    static_assert(kBlockN % 16 == 0, "kBlockN is a whole number of P V k steps");
    static_assert(kThreads % kChunksPerRow == 0 && kBlockN % (kThreads / kChunksPerRow) == 0 &&
                      kBlockM % (kThreads / kChunksPerRow) == 0,
                  "tile loads give every thread the same number of whole chunks");
    static_assert(kThreads / kChunksPerRow <= 32,
                  "a thread's row within a load pass times the seq stride (< 2^26, checked by the "
                  "launcher) must fit in 32 bits");
    static_assert(32 % kChunksPerRow == 0 || kChunksPerRow % 32 == 0, "epilogue row split");
    static_assert(kStages >= 2, "the ring needs a stage in flight while one is computed");
};

template <class Cfg>
struct MmaSyncMainloop {
    static constexpr int kThreads = Cfg::kThreads;
    static constexpr int kRowBytes = Cfg::kRowBytes;
    static constexpr int kChunksPerRow = Cfg::kChunksPerRow;
    static constexpr int kMTiles = Cfg::kMTiles;
    static constexpr int kSTiles = Cfg::kSTiles;
    static constexpr int kPSteps = Cfg::kPSteps;
    static constexpr int kOTiles = Cfg::kOTiles;
    static constexpr bool kBf16 = Cfg::kBf16;

    // Byte offset of 16-byte chunk `chunk` of tile row `row`: the chunk index is XORed with
    // row % 8 so that one logical chunk of eight consecutive rows falls into eight bank groups.
    static __device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
        return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
    }

    // cp.async of tile rows [0, kRows) from consecutive sequence positions of one head, `rows`
    // pointing at the first. Each thread moves one 16-byte column chunk of every
    // (kThreads / kChunksPerRow)-th row. With kCheckRows, rows at or past `valid_rows` are
    // zero-filled and never read; only the Q block and the first K/V block visited can be
    // partial.
    template <int kRows, bool kCheckRows>
    static __device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* rows,
                                                     int64_t seq_stride, int valid_rows, int tid) {
        constexpr int kRowsPerPass = kThreads / kChunksPerRow;
        const int chunk = tid % kChunksPerRow;
        const int first = tid / kChunksPerRow;
        // a 32-bit per-thread offset is cheap to recompute per block, where 64-bit per-thread
        // pointers would stay live through the main loop and cost registers
        const int thread_offset = first * static_cast<int>(seq_stride) + chunk * 8;
#pragma unroll
        for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
            const int row = first + pass * kRowsPerPass;
            const bool valid = !kCheckRows || row < valid_rows;
            const uint16_t* src = rows + pass * kRowsPerPass * seq_stride + thread_offset;
            cp_async_16(tile + tile_offset(row, chunk), valid ? src : rows, valid);
        }
    }

    // The K and V tiles of one ring stage, keys first_key.. of the K/V head.
    template <bool kCheckRows>
    static __device__ __forceinline__ void load_kv(uint32_t stage, const uint16_t* k_head,
                                                   const uint16_t* v_head, int64_t k_seq_stride,
                                                   int64_t v_seq_stride, int first_key,
                                                   int seq_len_k, int tid) {
        load_tile<Cfg::kBlockN, kCheckRows>(stage, k_head + first_key * k_seq_stride,
                                            k_seq_stride, seq_len_k - first_key, tid);
        load_tile<Cfg::kBlockN, kCheckRows>(stage + Cfg::kKVTileBytes,
                                            v_head + first_key * v_seq_stride, v_seq_stride,
                                            seq_len_k - first_key, tid);
    }

    // ldmatrix addressing. Every fragment load starts at a tile row that is a multiple of 8 and
    // at an even chunk, so a lane's address splits into a per-lane part fixed for the whole
    // kernel (its row within the 16-row group, and `swizzle` = its chunk bit ^ row % 8) plus
    // compile-time row and chunk offsets after unrolling. Writing the XOR on the low three chunk
    // bits only lets the compiler keep four per-lane offsets per operand instead of one per
    // chunk.
    struct LaneAddr {
        uint32_t row_bytes;
        uint32_t swizzle;

        __device__ __forceinline__ uint32_t at(uint32_t tile, int row, int chunk) const {
            return tile + row_bytes + row * kRowBytes + ((chunk & ~7) << 4) +
                   (((chunk & 7) ^ swizzle) << 4);
        }
    };

    // A fragment, 16 rows x 16 columns: lanes 0-15 address rows 0-15 of the left 8 columns,
    // lanes 16-31 the right ones (registers: rows 0-7 left, 8-15 left, 0-7 right, 8-15 right).
    // V's B fragments read with .trans (16 keys, head-dim tiles of 8) split the same way.
    static __device__ __forceinline__ LaneAddr a_frag_lane(int lane) {
        return {static_cast<uint32_t>((lane & 15) * kRowBytes),
                static_cast<uint32_t>((lane >> 4) ^ (lane & 7))};
    }

    // Two K-side B fragments (8 keys each, 16 head columns): lanes 0-7 address keys 0-7 left,
    // 8-15 keys 0-7 right, 16-23 keys 8-15 left, 24-31 keys 8-15 right.
    static __device__ __forceinline__ LaneAddr k_frag_lane(int lane) {
        return {static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * kRowBytes),
                static_cast<uint32_t>(((lane >> 3) & 1) ^ (lane & 7))};
    }

    // S (this warp's rows x kBlockN keys) = Q K^T, scores raw.
    static __device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kSTiles][4],
                                                   uint32_t q_tile, uint32_t k_tile, int warp_row,
                                                   const LaneAddr& q_lane,
                                                   const LaneAddr& k_lane) {
        zero_fill(s);
#pragma unroll
        for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
            uint32_t a[kMTiles][4];
#pragma unroll
            for (int m = 0; m < kMTiles; ++m) {
                ldmatrix_x4(a[m], q_lane.at(q_tile, warp_row + 16 * m, 2 * ks));
            }
#pragma unroll
            for (int p = 0; p < kSTiles / 2; ++p) {
                uint32_t b[4];
                ldmatrix_x4(b, k_lane.at(k_tile, 16 * p, 2 * ks));
#pragma unroll
                for (int m = 0; m < kMTiles; ++m) {
                    mma_m16n16k16<kBf16>(s[m][2 * p], s[m][2 * p + 1], a[m], b);
                }
            }
        }
    }

    // Probabilities as the A fragments of O += P V: S tiles 2k, 2k+1 of a 16-row group are
    // exactly the A fragment of k step k once packed to 16-bit pairs.
    static __device__ __forceinline__ void pack_probabilities(
        uint32_t (&a)[kMTiles][kPSteps][4], const float (&p)[kMTiles][kSTiles][4]) {
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
            for (int ks = 0; ks < kPSteps; ++ks) {
                a[m][ks][0] = pack_f32x2<kBf16>(p[m][2 * ks][0], p[m][2 * ks][1]);
                a[m][ks][1] = pack_f32x2<kBf16>(p[m][2 * ks][2], p[m][2 * ks][3]);
                a[m][ks][2] = pack_f32x2<kBf16>(p[m][2 * ks + 1][0], p[m][2 * ks + 1][1]);
                a[m][ks][3] = pack_f32x2<kBf16>(p[m][2 * ks + 1][2], p[m][2 * ks + 1][3]);
            }
        }
    }

    static __device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kOTiles][4],
                                                   const uint32_t (&p)[kMTiles][kPSteps][4],
                                                   uint32_t v_tile, const LaneAddr& v_lane) {
#pragma unroll
        for (int ks = 0; ks < kPSteps; ++ks) {
#pragma unroll
            for (int dp = 0; dp < kOTiles / 2; ++dp) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, v_lane.at(v_tile, 16 * ks, 2 * dp));
#pragma unroll
                for (int m = 0; m < kMTiles; ++m) {
                    mma_m16n16k16<kBf16>(o[m][2 * dp], o[m][2 * dp + 1], p[m][ks], b);
                }
            }
        }
    }
};

}  // namespace ptxattn
