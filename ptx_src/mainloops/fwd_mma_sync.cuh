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
// row % 8 (smem_tile.cuh), which keeps ldmatrix, cp.async and the epilogue's stores free of bank
// conflicts. Layout: [Q: kBlockM rows][stage 0: K, V: kBlockN rows each][stage 1]...
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"
#include "roles/smem_tile.cuh"

namespace ptxattn {

// The compile-time shape of a portable forward kernel: head_dim, query rows and keys per tile,
// warps, cp.async ring depth, bf16 (else fp16), causal, __launch_bounds__ minimum blocks/SM, and
// the dynamic shared memory the launcher requests (Tile.smem_bytes, checked against the layout).
template <int HeadDim, int BlockM, int BlockN, int Warps, int Stages, bool Bf16, bool Causal,
          int MinBlocksPerSm, int SmemBytes>
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
    static constexpr int kSmemBytes = kQTileBytes + kStages * kStageBytes;  // [Q][K, V stages]

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
    static_assert(kSmemBytes == SmemBytes,
                  "the launcher's shared memory (Tile.smem_bytes) differs from the layout");
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

    using Tile = SwizzledTile<kRowBytes>;
    using LaneAddr = typename Tile::LaneAddr;

    static __device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
        return Tile::offset(row, chunk);
    }

    // Tile rows [0, kRows) of one head from `rows` (smem_tile.cuh); only the Q block and the
    // first K/V block visited can be partial, so only they check rows.
    template <int kRows, bool kCheckRows>
    static __device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* rows,
                                                     int64_t seq_stride, int valid_rows,
                                                     int head_dim, int tid) {
        Tile::template load<kRows, kThreads, kCheckRows>(tile, rows, seq_stride, valid_rows,
                                                         head_dim / 8, tid);
    }

    // The K and V tiles of one ring stage, keys first_key.. of the K/V head: k's head_dim and
    // v's head_dim_v columns (FwdParams), zeros past them.
    template <bool kCheckRows>
    static __device__ __forceinline__ void load_kv(uint32_t stage, const FwdParams& p,
                                                   const uint16_t* k_head,
                                                   const uint16_t* v_head, int first_key,
                                                   int tid) {
        load_tile<Cfg::kBlockN, kCheckRows>(stage, k_head + first_key * p.k_stride_s,
                                            p.k_stride_s, p.seqlen_k - first_key, p.head_dim,
                                            tid);
        load_tile<Cfg::kBlockN, kCheckRows>(stage + Cfg::kKVTileBytes,
                                            v_head + first_key * p.v_stride_s, p.v_stride_s,
                                            p.seqlen_k - first_key, p.head_dim_v, tid);
    }

    // Q's A fragments, and V's B fragments read with .trans (16 keys, head-dim tiles of 8).
    static __device__ __forceinline__ LaneAddr a_frag_lane(int lane) {
        return Tile::rows_then_chunks(lane);
    }

    // Two K-side B fragments (8 keys each, 16 head columns).
    static __device__ __forceinline__ LaneAddr k_frag_lane(int lane) {
        return Tile::chunks_then_rows(lane);
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
