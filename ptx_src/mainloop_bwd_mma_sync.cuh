// Mainloop of the portable backward (mma.sync, sm_80+): FlashAttention-2 style, per key block.
//
// A block owns kBlockN keys of one (batch, kv head): K and V stay in shared memory, dK and dV in
// its warps' registers. It walks the query tiles of kBlockM rows that see those keys (of every q
// head sharing the kv head) through a ring of (Q, dO) stages, and per tile runs five
// GEMMs in three phases, each over all warps with its own warp grid:
//   scores (kBlockM x kBlockN):  S = Q K^T and dP = dO V^T; P and dS = P (dP - D) (softmax.cuh)
//                                go to shared memory as 16-bit tiles;
//   dkv    (kBlockN x kHeadDim): dV += P^T dO and dK += dS^T Q, the transposed operands read
//                                with ldmatrix.trans;
//   dq     (kBlockM x kHeadDim): dQ = dS K, added into the FP32 accumulator in global memory,
//                                in passes of 32 or 64 columns to bound registers.
// Shared-memory tiles are swizzled rows (smem_tile.cuh): K, V, Q and dO in slabs of 128-byte rows
// (SlabbedTile, TMA's layout), P and dS as whole rows. Layout: [K][V][stage 0: Q, dO]...[P][dS]
// (twice with overlapping steps)[stage 0: the rows' LSE log2 and D]...[with overlapping steps,
// the stages' full mbarriers]. Tiles load by cp.async, except a step's Q, dO and row values
// with overlapping steps (sm_90+: TMA and bulk copies).
//
// Synchronisation. Two block barriers a step: one opens it (the step's copies have landed; every
// warp is done with the last step's tiles), one separates the score phase from the others. With
// overlapping steps (sm_90+) only the second remains: a step's copies complete on its stage's
// full mbarrier (TMA's bytes), and P and dS alternate between two buffers. A warp past the
// score barrier of step s has finished step s - 1, so there thread 0 refills step s - 1's stage
// (for step s + kStages - 1), and step s + 1 writes the buffers step s - 1 read: a warp may
// start the next step while others still compute and add this step's dQ.
#pragma once
#include "common.cuh"
#include "cp_async.cuh"
#include "mma_sync.cuh"
#include "mbarrier.cuh"
#include "smem_tile.cuh"

namespace ptxattn {

// The compile-time shape of a portable backward kernel: head_dim, query rows per tile, keys per
// block, warps, the warp grid's row count in each phase (its columns are warps / rows), the
// (Q, dO) ring depth, overlapping steps (above; sm_90+: TMA and mbarriers), bf16 (else
// fp16), causal, deferred turns (deterministic sums only: each turn passed at the next step's
// score barrier; bwd_mma_sync.cu), __launch_bounds__ minimum blocks/SM, and the dynamic shared
// memory the launcher requests (BwdTile.smem_bytes, checked against the layout).
template <int HeadDim, int BlockM, int BlockN, int Warps, int ScoreWarpRows, int DkvWarpRows,
          int DqWarpRows, int Stages, bool OverlapSteps, bool Bf16, bool Causal,
          bool DeferredTurns, int MinBlocksPerSm, int SmemBytes>
struct BwdMmaSyncConfig {
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kBlockM = BlockM;
    static constexpr int kBlockN = BlockN;
    static constexpr int kWarps = Warps;
    static constexpr int kThreads = 32 * Warps;
    static constexpr int kStages = Stages;
    static constexpr bool kOverlapSteps = OverlapSteps;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kCausal = Causal;
    static constexpr bool kDeferredTurns = DeferredTurns;
    static constexpr int kMinBlocksPerSm = MinBlocksPerSm;

    // Each warp's share of each phase: rows (16-row groups) and columns (8-column tiles).
    static constexpr int kScoreRows = BlockM / ScoreWarpRows;
    static constexpr int kScoreCols = BlockN / (Warps / ScoreWarpRows);
    static constexpr int kDkvRows = BlockN / DkvWarpRows;
    static constexpr int kDkvCols = HeadDim / (Warps / DkvWarpRows);
    static constexpr int kDqRows = BlockM / DqWarpRows;
    static constexpr int kDqCols = HeadDim / (Warps / DqWarpRows);
    // dQ columns per pass: 64, or 32 when dK and dV hold 128 or more registers of a thread
    static constexpr int kDqPassMax = 2 * kDkvRows * kDkvCols / 32 >= 128 ? 32 : 64;
    static constexpr int kDqPassCols = kDqCols < kDqPassMax ? kDqCols : kDqPassMax;
    static constexpr int kDqPasses = kDqCols / kDqPassCols;
    // Deterministic sums: only the warp that takes the turns waits at their two meetings, the
    // others arrive on named barriers (bar.arrive) and go on: with dQ in several passes and
    // overlapping steps (sm_90+, head_dim 256), 1.02-1.05x deterministic, level by default;
    // at head_dims 64 and 128 0.98-1.00x (docs/hopper-tuning.md, session 36).
    static constexpr bool kTurnWarpAlone = OverlapSteps && kDqPasses > 1;
    // Deferred turns leave the waiting warp arriving on kTurnWarpAlone's barrier and never
    // waiting on one; compute-sanitizer's racecheck then reports P's stores against phase 2's
    // reads of P (not analysed; docs/hopper-tuning.md, session 38).
    static_assert(!(DeferredTurns && kTurnWarpAlone), "deferred turns without kTurnWarpAlone");
    static constexpr int kScoreWarpRows = ScoreWarpRows;
    static constexpr int kDkvWarpRows = DkvWarpRows;
    static constexpr int kDqWarpRows = DqWarpRows;

    static constexpr int kRowBytes = HeadDim * 2;  // Q, K, V, dO tiles
    // With overlapping steps (sm_90+), one thread loads a step's Q and dO by TMA (SWIZZLE_128B,
    // a box per slab of the tiles) and its row values by bulk copies, all completing on the
    // stage's full mbarrier: the other threads' LSU queues then hold only the dQ adds, which the
    // refill's copies waited behind (docs/hopper-tuning.md, session 35). The tiles need the
    // 1024-byte alignment of the swizzle atom: aligning the base, which is 16-byte aligned, may
    // cost 1008 bytes (kAlignSlack); every tile before the score tiles is a multiple of 1024.
    static constexpr int kAlignSlack = OverlapSteps ? 1024 - 16 : 0;
    static constexpr int kScoreRowBytes = BlockN * 2;  // P, dS tiles
    static constexpr int kKVTileBytes = BlockN * kRowBytes;
    static constexpr int kQTileBytes = BlockM * kRowBytes;
    static constexpr int kStageBytes = 2 * kQTileBytes;  // Q, dO
    static constexpr int kScoreTileBytes = BlockM * kScoreRowBytes;
    // P and dS of consecutive steps in alternate buffers with overlapping steps (above).
    static constexpr int kScoreBuffers = OverlapSteps ? 2 : 1;
    static constexpr int kScoreBufferBytes = 2 * kScoreTileBytes;
    // A step's row values, copied with its Q and dO from the preprocess's padded rows (whole
    // tiles, so no row checks): LSE log2(e) (+inf where no key is seen or past seqlen_q, so P =
    // 0) and D (0 there). (Read from global memory at the step, their latency was the kernel's
    // largest stall: long scoreboard 1.5 cycles an instruction against FlashAttention-2's 0.8.)
    // Apart from the stages, the tiles need no padding to 1024 bytes.
    static constexpr int kRowValuesBytes = 2 * BlockM * 4;
    static constexpr int kRowValuesOffset =
        2 * kKVTileBytes + Stages * kStageBytes + kScoreBuffers * kScoreBufferBytes;
    static constexpr int kBarrierOffset = kRowValuesOffset + Stages * kRowValuesBytes;
    static constexpr int kSmemBytes =
        kBarrierOffset + (OverlapSteps ? Stages * static_cast<int>(sizeof(MBarrier)) : 0) +
        kAlignSlack;

    static_assert(Warps % ScoreWarpRows == 0 && Warps % DkvWarpRows == 0 &&
                      Warps % DqWarpRows == 0, "every phase's warp grid uses all warps");
    static_assert(kScoreRows % 16 == 0 && kDkvRows % 16 == 0 && kDqRows % 16 == 0,
                  "warps own whole 16-row mma tiles");
    static_assert(kScoreCols % 16 == 0 && kDkvCols % 16 == 0 && kDqPassCols % 16 == 0 &&
                      kDqCols % kDqPassCols == 0, "warps own whole pairs of 8-column tiles");
    static_assert(!OverlapSteps || (kKVTileBytes % 1024 == 0 && BlockM * 128 % 1024 == 0),
                  "TMA-loaded tiles start on the 1024-byte swizzle atom");
    static_assert(Stages >= 1, "at least one (Q, dO) stage");
    static_assert(!OverlapSteps || Stages >= 2, "overlapping steps refill a stage a step ahead");
    static_assert(kSmemBytes == SmemBytes,
                  "the launcher's shared memory (BwdTile.smem_bytes) differs from the layout");
};

template <class Cfg>
struct BwdMmaSyncMainloop {
    static constexpr bool kBf16 = Cfg::kBf16;
    using QTile = SlabbedTile<Cfg::kRowBytes, Cfg::kBlockM>;   // Q, dO
    using KVTile = SlabbedTile<Cfg::kRowBytes, Cfg::kBlockN>;  // K, V (and the staged dK, dV)
    using ScoreTile = SwizzledTile<Cfg::kScoreRowBytes>;

    // Per-lane ldmatrix addresses for both tile widths and both lane patterns.
    struct Lanes {
        typename QTile::LaneAddr head_rows;   // rows_then_chunks (of any SlabbedTile)
        typename QTile::LaneAddr head_cols;   // chunks_then_rows
        typename ScoreTile::LaneAddr score_rows;
        typename ScoreTile::LaneAddr score_cols;

        __device__ __forceinline__ explicit Lanes(int lane)
            : head_rows(QTile::Slab::rows_then_chunks(lane)),
              head_cols(QTile::Slab::chunks_then_rows(lane)),
              score_rows(ScoreTile::rows_then_chunks(lane)),
              score_cols(ScoreTile::chunks_then_rows(lane)) {}

        // From the step's P and dS buffer to the next step's (of two). The buffer's offset rides in
        // the lane addresses, so that ldmatrix keeps the score tiles' compile-time offsets: added
        // to the tiles' addresses instead, it cost head_dim 128 causal 8 bytes of spills. (XOR
        // instead of the add spilled 4 bytes with NVRTC 13.5: this kernel is at 255 registers.)
        __device__ __forceinline__ void next_score_buffer(int step) {
            if constexpr (Cfg::kScoreBuffers == 2) {
                constexpr uint32_t kBytes = Cfg::kScoreBufferBytes;
                const uint32_t move = step % 2 == 0 ? kBytes : 0u - kBytes;
                score_rows.row_bytes += move;
                score_cols.row_bytes += move;
            }
        }
    };

    template <int kRows>
    static __device__ __forceinline__ void load_rows(uint32_t tile, const uint16_t* rows,
                                                     int64_t seq_stride, int valid_rows, int tid) {
        SlabbedTile<Cfg::kRowBytes, kRows>::template load<Cfg::kThreads, true>(
            tile, rows, seq_stride, valid_rows, tid);
    }

    // The step's row values into `dst`: kBlockM floats of lse_log2, then of dpsum, from the
    // tile's first row (padded_row, below 2^31: the launcher checks) of the workspace, 16 bytes
    // a thread.
    static __device__ __forceinline__ void load_row_values(uint32_t dst, const float* lse_log2,
                                                           const float* dpsum, int padded_row,
                                                           int tid) {
        constexpr int kChunks = Cfg::kBlockM / 4;  // 16-byte chunks of one array
        static_assert(2 * kChunks <= Cfg::kThreads, "a chunk a thread");
        if (tid < 2 * kChunks) {
            const float* src =
                (tid < kChunks ? lse_log2 : dpsum) + padded_row + 4 * (tid % kChunks);
            cp_async_16(dst + 16 * tid, src, true);
        }
    }

    // The warp's score rows' values (row h of each 16-row group) from a step's row values.
    static __device__ __forceinline__ void read_row_values(float (&dst)[Cfg::kScoreRows / 16][2],
                                                           uint32_t values, int row0, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kScoreRows / 16; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                dst[m][h] = ld_shared_f32(values + 4 * (row0 + 16 * m + (lane >> 2) + 8 * h));
            }
        }
    }

    // X (rows row0.. of a kBlockM x kHeadDim tile) times Y^T (rows col0.. of a kBlockN x
    // kHeadDim tile): S = Q K^T, dP = dO V^T.
    static __device__ __forceinline__ void gemm_abt(
        float (&acc)[Cfg::kScoreRows / 16][Cfg::kScoreCols / 8][4], uint32_t x_tile,
        uint32_t y_tile, int row0, int col0, const Lanes& lanes) {
        zero_fill(acc);
        warp_gemm<kBf16, Cfg::kHeadDim / 16>(
            acc,
            [&](uint32_t(&a)[4], int m, int ks) {
                ldmatrix_x4(a, QTile::at(lanes.head_rows, x_tile, row0 + 16 * m, 2 * ks));
            },
            [&](uint32_t(&b)[4], int np, int ks) {
                ldmatrix_x4(b, KVTile::at(lanes.head_cols, y_tile, col0 + 16 * np, 2 * ks));
            });
    }

    using ScorePairs = uint32_t[Cfg::kScoreRows / 16][Cfg::kScoreCols / 8][2];

    // The warp's scores as 16-bit pairs (row h of each accumulator tile in pair h).
    static __device__ __forceinline__ void pack_scores(
        ScorePairs& pairs, const float (&x)[Cfg::kScoreRows / 16][Cfg::kScoreCols / 8][4]) {
#pragma unroll
        for (int m = 0; m < Cfg::kScoreRows / 16; ++m) {
#pragma unroll
            for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    pairs[m][j][h] = pack_f32x2<kBf16>(x[m][j][2 * h], x[m][j][2 * h + 1]);
                }
            }
        }
    }

    // The warp's packed scores into a kBlockM x kBlockN tile.
    static __device__ __forceinline__ void store_scores(uint32_t tile, const ScorePairs& pairs,
                                                        int row0, int col0, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kScoreRows / 16; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 16 * m + (lane >> 2) + 8 * h;
#pragma unroll
                for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * (lane & 3);
                    st_shared_b32(tile + ScoreTile::element_offset(row, col), pairs[m][j][h]);
                }
            }
        }
    }

    // acc (keys key0.., head columns d0..) += X^T Y: X a kBlockM x kBlockN score tile (P, dS),
    // Y a kBlockM x kHeadDim tile (dO, Q); the k dimension is the query rows.
    static __device__ __forceinline__ void gemm_atb(
        float (&acc)[Cfg::kDkvRows / 16][Cfg::kDkvCols / 8][4], uint32_t x_tile, uint32_t y_tile,
        int key0, int d0, const Lanes& lanes) {
        warp_gemm<kBf16, Cfg::kBlockM / 16>(
            acc,
            [&](uint32_t(&a)[4], int m, int ks) {
                ldmatrix_x4_trans(a, lanes.score_cols.at(x_tile, 16 * ks, key0 / 8 + 2 * m));
            },
            [&](uint32_t(&b)[4], int np, int ks) {
                ldmatrix_x4_trans(b, QTile::at(lanes.head_rows, y_tile, 16 * ks, d0 / 8 + 2 * np));
            });
    }

    // acc (query rows row0.., head columns d0..) = dS K: dS a kBlockM x kBlockN score tile,
    // K a kBlockN x kHeadDim tile; the k dimension is the keys.
    static __device__ __forceinline__ void gemm_ab(
        float (&acc)[Cfg::kDqRows / 16][Cfg::kDqPassCols / 8][4], uint32_t ds_tile,
        uint32_t k_tile, int row0, int d0, const Lanes& lanes) {
        zero_fill(acc);
        warp_gemm<kBf16, Cfg::kBlockN / 16>(
            acc,
            [&](uint32_t(&a)[4], int m, int ks) {
                ldmatrix_x4(a, lanes.score_rows.at(ds_tile, row0 + 16 * m, 2 * ks));
            },
            [&](uint32_t(&b)[4], int np, int ks) {
                ldmatrix_x4_trans(b, KVTile::at(lanes.head_rows, k_tile, 16 * ks, d0 / 8 + 2 * np));
            });
    }

    // The same with dS's A fragments loaded already (load_ds), for dQ in several passes, which
    // all read the same rows of dS: loaded once a step instead of once a pass, they also leave
    // each pass's first mma waiting only for K (head_dim 256: +1-3.5%, docs/hopper-tuning.md).
    using DsFragments = uint32_t[Cfg::kBlockN / 16][Cfg::kDqRows / 16][4];

    static __device__ __forceinline__ void load_ds(DsFragments& a, uint32_t ds_tile, int row0,
                                                   const Lanes& lanes) {
#pragma unroll
        for (int ks = 0; ks < Cfg::kBlockN / 16; ++ks) {
#pragma unroll
            for (int m = 0; m < Cfg::kDqRows / 16; ++m) {
                ldmatrix_x4(a[ks][m], lanes.score_rows.at(ds_tile, row0 + 16 * m, 2 * ks));
            }
        }
    }

    static __device__ __forceinline__ void gemm_ab(
        float (&acc)[Cfg::kDqRows / 16][Cfg::kDqPassCols / 8][4], const DsFragments& ds,
        uint32_t k_tile, int d0, const Lanes& lanes) {
        zero_fill(acc);
        warp_gemm<kBf16, Cfg::kBlockN / 16>(
            acc,
            [&](uint32_t(&a)[4], int m, int ks) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = ds[ks][m][i];
            },
            [&](uint32_t(&b)[4], int np, int ks) {
                ldmatrix_x4_trans(b, KVTile::at(lanes.head_rows, k_tile, 16 * ks, d0 / 8 + 2 * np));
            });
    }
};

}  // namespace ptxattn
