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
#include "ptx/atomics.cuh"
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma_sync.cuh"
#include "ptx/tma.cuh"
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "roles/mask.cuh"
#include "roles/params.cuh"
#include "roles/smem_tile.cuh"
#include "roles/softmax.cuh"
#include "roles/tile_scheduler.cuh"

namespace ptxattn {

// The compile-time shape of a portable backward kernel: head_dim, query rows per tile, keys per
// block, warps, the warp grid's row count in each phase (its columns are warps / rows), the
// (Q, dO) ring depth, overlapping steps (above; sm_90+: TMA and mbarriers), bf16 (else
// fp16), causal, deferred turns (deterministic sums only: each turn passed at the next step's
// score barrier; bwd_mma_sync.cu), the options build (a window, a softcap and packed sequences
// read from BwdParams, as the Hopper backward's kOptions), __launch_bounds__ minimum blocks/SM,
// and the dynamic shared memory the launcher requests (BwdTile.smem_bytes, checked against the
// layout).
template <int HeadDim, int BlockM, int BlockN, int Warps, int ScoreWarpRows, int DkvWarpRows,
          int DqWarpRows, int Stages, bool OverlapSteps, bool Bf16, bool Causal,
          bool DeferredTurns, bool Options, int MinBlocksPerSm, int SmemBytes>
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
    static constexpr bool kOptions = Options;
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
    // at head_dims 64 and 128 0.98-1.00x (H100 SXM, 2026-11-26;
    // docs/design/backward.md#portable-deterministic-mode).
    static constexpr bool kTurnWarpAlone = OverlapSteps && kDqPasses > 1;
    // Deferred turns leave the waiting warp arriving on kTurnWarpAlone's barrier and never
    // waiting on one; compute-sanitizer's racecheck then reports P's stores against phase 2's
    // reads of P (not analysed; docs/design/backward.md#portable-deterministic-mode).
    static_assert(!(DeferredTurns && kTurnWarpAlone), "deferred turns without kTurnWarpAlone");
    static constexpr int kScoreWarpRows = ScoreWarpRows;
    static constexpr int kDkvWarpRows = DkvWarpRows;
    static constexpr int kDqWarpRows = DqWarpRows;

    static constexpr int kRowBytes = HeadDim * 2;  // Q, K, V, dO tiles
    // With overlapping steps (sm_90+), one thread loads a step's Q and dO by TMA (SWIZZLE_128B, a
    // box per slab of the tiles) and its row values by bulk copies, all completing on the stage's
    // full mbarrier: the other threads' LSU queues then hold only the dQ adds, which the refill's
    // copies waited behind (docs/design/backward.md#portable-overlapping-steps). The tiles need the
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

    // Rows of q or dout, k or v: `head_dim` columns of them (BwdParams), zeros past them.
    template <int kRows>
    static __device__ __forceinline__ void load_rows(uint32_t tile, const uint16_t* rows,
                                                     int64_t seq_stride, int valid_rows,
                                                     int head_dim, int tid) {
        SlabbedTile<Cfg::kRowBytes, kRows>::template load<Cfg::kThreads, true>(
            tile, rows, seq_stride, valid_rows, head_dim / 8, tid);
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
    // each pass's first mma waiting only for K (head_dim 256: +1-3.5%,
    // docs/design/backward.md#portable-against-flashattention-2).
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

    // The block's dK and dV, out to global memory at the end of its walk.
    static __device__ __forceinline__ void store_dkv(
        const BwdParams& p, uint8_t* smem, float (&dk)[Cfg::kDkvRows / 16][Cfg::kDkvCols / 8][4],
        float (&dv)[Cfg::kDkvRows / 16][Cfg::kDkvCols / 8][4], int first_key, int kv_head,
        const BwdSeq& seq, int warp, int lane) {
        using Mainloop = BwdMmaSyncMainloop;
        constexpr int kBlockN = Cfg::kBlockN;
        const int dkv_key0 = (warp % Cfg::kDkvWarpRows) * Cfg::kDkvRows;
        const int dkv_d0 = (warp / Cfg::kDkvWarpRows) * Cfg::kDkvCols;
        // dK = softmax_scale dS^T Q and dV; keys past seqlen_k dropped. From head_dim 128 staged in
        // K's and V's tiles (free once every warp is past its last GEMM) and copied out a whole
        // 16-byte chunk a lane: stored from registers, 4 bytes of a row at a time, they cost 1-3%
        // (seqlen 2048). Head_dim 64 keeps the stores from registers: with the staging, ptxas moved
        // address arithmetic of the walk from uniform to vector registers (60 more IMADs a step) and
        // the non-causal rows lost 3-4% (H100 SXM, 2026-11-26;
        // docs/design/backward.md#portable-against-flashattention-2).
        // Keys from the sequence's first (packed: its offset), up to its seqlen_k.
        const int seqlen_k = seq.lens.seqlen_k;
        uint16_t* dk_head = static_cast<uint16_t*>(p.dk) + seq.batch_coord * p.dk_stride_b +
                            kv_head * p.dk_stride_h + seq.lens.offset_k * p.dk_stride_s;
        uint16_t* dv_head = static_cast<uint16_t*>(p.dv) + seq.batch_coord * p.dv_stride_b +
                            kv_head * p.dv_stride_h + seq.lens.offset_k * p.dv_stride_s;
        if constexpr (Cfg::kHeadDim >= 128) {
#pragma unroll
            for (int m = 0; m < Cfg::kDkvRows / 16; ++m) {
#pragma unroll
                for (int j = 0; j < Cfg::kDkvCols / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) dk[m][j][e] *= p.softmax_scale;
                }
            }
            __syncthreads();
            using KVTile = typename Mainloop::KVTile;
            const auto warp_chunks = [&](int row, int chunk) {
                return KVTile::offset(row, dkv_d0 / 8 + chunk);
            };
            stage_accumulator_rows<Cfg::kBf16>(smem, warp_chunks, dk, dkv_key0, lane);
            stage_accumulator_rows<Cfg::kBf16>(smem + Cfg::kKVTileBytes, warp_chunks, dv, dkv_key0,
                                               lane);
            __syncthreads();
            constexpr int kWarpKeys = kBlockN / Cfg::kWarps;
            const auto row_chunks = [](int row, int chunk) { return KVTile::offset(row, chunk); };
            store_staged_rows<kWarpKeys, KVTile::kChunksPerRow>(
                smem, row_chunks, dk_head, p.dk_stride_s, first_key, warp * kWarpKeys, seqlen_k,
                p.head_dim / 8, lane);
            store_staged_rows<kWarpKeys, KVTile::kChunksPerRow>(
                smem + Cfg::kKVTileBytes, row_chunks, dv_head, p.dv_stride_s, first_key,
                warp * kWarpKeys, seqlen_k, p.head_dim_v / 8, lane);
        } else {
#pragma unroll
            for (int m = 0; m < Cfg::kDkvRows / 16; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int key = first_key + dkv_key0 + 16 * m + (lane >> 2) + 8 * h;
                    if (key >= seqlen_k) continue;
#pragma unroll
                    for (int j = 0; j < Cfg::kDkvCols / 8; ++j) {
                        const int col = dkv_d0 + 8 * j + 2 * (lane & 3);
                        if (dkv_d0 + 8 * j < p.head_dim) {
                            *reinterpret_cast<uint32_t*>(dk_head + key * p.dk_stride_s + col) =
                                pack_f32x2<Cfg::kBf16>(dk[m][j][2 * h] * p.softmax_scale,
                                                       dk[m][j][2 * h + 1] * p.softmax_scale);
                        }
                        if (dkv_d0 + 8 * j < p.head_dim_v) {
                            *reinterpret_cast<uint32_t*>(dv_head + key * p.dv_stride_s + col) =
                                pack_f32x2<Cfg::kBf16>(dv[m][j][2 * h], dv[m][j][2 * h + 1]);
                        }
                    }
                }
            }
        }
    }

    static __device__ __forceinline__ void run(const BwdParams& p, int tid) {
        extern __shared__ __align__(128) uint8_t smem_raw[];
        using Mainloop = BwdMmaSyncMainloop;
        constexpr int kBlockM = Cfg::kBlockM;
        constexpr int kBlockN = Cfg::kBlockN;
        constexpr int kStages = Cfg::kStages;
        constexpr bool kOverlapSteps = Cfg::kOverlapSteps;
        constexpr int kScoreTiles = Cfg::kScoreCols / 8;
        // Named barriers of the deterministic sums with kTurnWarpAlone (0 is __syncthreads'): the
        // turn has come; every warp has added.
        constexpr uint32_t kTurnSeen = 1, kTurnAdded = 2;
        constexpr bool kDeferredTurns = Cfg::kDeferredTurns;
        uint8_t* const smem = kOverlapSteps ? align_smem<1024>(smem_raw) : smem_raw;
        const int lane = tid & 31;
        const int warp = tid >> 5;
        const int kv_head = blockIdx.y;
        const int batch = blockIdx.z;
        const BwdSeq seq = BwdSeq::of<Cfg::kOptions>(p, batch);
        // The options build: the grid covers the longest sequence's keys, and a packed
        // sequence's may end before this block; the window is the call's. Otherwise the grid is
        // the call's and nothing is windowed.
        const int n_blocks = Cfg::kOptions ? ceil_div(seq.lens.seqlen_k, kBlockN) : int(gridDim.x);
        if (Cfg::kOptions && static_cast<int>(blockIdx.x) >= n_blocks) return;
        const int m_blocks = Cfg::kOptions ? ceil_div(seq.lens.seqlen_q, kBlockM) : p.num_m_blocks;
        const int window_left = Cfg::kOptions ? p.window_left : -1;
        const int window_right = Cfg::kOptions ? p.window_right : -1;
        const bool banded = !Cfg::kCausal && (window_left >= 0 || window_right >= 0);

        const BlockInfo<kBlockM, kBlockN> info(seq.lens.seqlen_q, seq.lens.seqlen_k, Cfg::kCausal,
                                               window_left, window_right);
        const BwdWalk walk = BwdWalk::make(blockIdx.x, n_blocks, m_blocks, Cfg::kCausal,
                                           p.dq_semaphore != nullptr, p.dq_turn_group, false,
                                           banded);
        const int n_block = walk.n_block;
        const BwdSteps walk_steps = BwdSteps::make(info, walk, p.q_per_kv);
        const int steps = walk_steps.count;
        const int first_key = n_block * kBlockN;

        const uint32_t k_tile = smem_addr(smem);
        const uint32_t v_tile = k_tile + Cfg::kKVTileBytes;
        const uint32_t ring = v_tile + Cfg::kKVTileBytes;
        // P and dS of the first buffer: the stores add the step's buffer, ldmatrix's lane addresses
        // carry it (Lanes::next_score_buffer).
        const uint32_t p_tile = ring + kStages * Cfg::kStageBytes;
        const uint32_t ds_tile = p_tile + Cfg::kScoreTileBytes;
        const uint32_t row_values_ring = k_tile + Cfg::kRowValuesOffset;
        MBarrier* const landed = reinterpret_cast<MBarrier*>(smem + Cfg::kBarrierOffset);
        if constexpr (kOverlapSteps) {
            // A stage's copies land with their bytes (the loading thread's expect_tx arrival).
            if (tid == 0) {
#pragma unroll
                for (int stage = 0; stage < kStages; ++stage) landed[stage].init(1);
                fence_barrier_init();  // the TMA copies complete on these barriers
            }
            __syncthreads();
        }

        Mainloop::template load_rows<kBlockN>(
            k_tile,
            static_cast<const uint16_t*>(p.k) + seq.batch_coord * p.k_stride_b +
                kv_head * p.k_stride_h + (seq.lens.offset_k + first_key) * p.k_stride_s,
            p.k_stride_s, seq.lens.seqlen_k - first_key, p.head_dim, tid);
        Mainloop::template load_rows<kBlockN>(
            v_tile,
            static_cast<const uint16_t*>(p.v) + seq.batch_coord * p.v_stride_b +
                kv_head * p.v_stride_h + (seq.lens.offset_k + first_key) * p.v_stride_s,
            p.v_stride_s, seq.lens.seqlen_k - first_key, p.head_dim_v, tid);

        // Q and dO of the step at `cursor` into ring stage `stage`; the cursor moves to the next.
        // (The walk as a cursor, without head()'s and m_block()'s divisions at every step, leaves
        // head_dim 128 the registers for FlashAttention-2's warp grid without spills.) By TMA
        // (overlapping steps), only thread 0 calls it: rows past seqlen_q arrive zero-filled, as the
        // map ends there (packed sequences: the next sequence's rows, whose P is 0, as their
        // padded workspace rows give LSE +inf).
        const auto load_step = [&](BwdSteps::Cursor& cursor, int stage) {
            const int head = cursor.head;
            const int row0 = cursor.m_block * kBlockM;
            const uint32_t q_dst = ring + stage * Cfg::kStageBytes;
            const uint32_t values_dst = row_values_ring + stage * Cfg::kRowValuesBytes;
            if constexpr (kOverlapSteps) {
                MBarrier& full = landed[stage];
                full.arrive_expect_tx(2 * Cfg::kQTileBytes + Cfg::kRowValuesBytes);
                uint8_t* const tile = smem + (q_dst - k_tile);
                using QTile = typename Mainloop::QTile;
#pragma unroll
                for (int slab = 0; slab < QTile::kSlabs; ++slab) {
                    uint8_t* const q_slab = tile + slab * QTile::kSlabBytes;
                    tma_load_4d(q_slab, &p.q_map, full, 64 * slab, head, seq.lens.offset_q + row0,
                                seq.batch_coord);
                    tma_load_4d(q_slab + Cfg::kQTileBytes, &p.dout_map, full, 64 * slab, head,
                                seq.lens.offset_q + row0, seq.batch_coord);
                }
                // 32-bit: the launcher keeps the workspace rows below 2^31
                const int padded_row = static_cast<int>(seq.workspace_row(p, head, row0));
                uint8_t* const values = smem + (values_dst - k_tile);
                bulk_load(values, p.lse_log2 + padded_row, 4 * kBlockM, full);
                bulk_load(values + 4 * kBlockM, p.dpsum + padded_row, 4 * kBlockM, full);
                walk_steps.next(cursor);
                return;
            }
            Mainloop::template load_rows<kBlockM>(
                q_dst,
                static_cast<const uint16_t*>(p.q) + seq.batch_coord * p.q_stride_b +
                    head * p.q_stride_h + (seq.lens.offset_q + row0) * p.q_stride_s,
                p.q_stride_s, seq.lens.seqlen_q - row0, p.head_dim, tid);
            Mainloop::template load_rows<kBlockM>(
                q_dst + Cfg::kQTileBytes,
                static_cast<const uint16_t*>(p.dout) + seq.batch_coord * p.dout_stride_b +
                    head * p.dout_stride_h + (seq.lens.offset_q + row0) * p.dout_stride_s,
                p.dout_stride_s, seq.lens.seqlen_q - row0, p.head_dim_v, tid);
            Mainloop::load_row_values(values_dst, p.lse_log2, p.dpsum,
                                      seq.workspace_row(p, head, row0), tid);
            walk_steps.next(cursor);
        };
        BwdSteps::Cursor loading = walk_steps.start(kv_head, p.q_per_kv);
#pragma unroll
        for (int step = 0; step < (kStages > 1 ? kStages - 1 : 1); ++step) {
            if (step < steps && (!kOverlapSteps || tid == 0)) load_step(loading, step);
            cp_async_commit();  // K and V ride in the first group
        }
        if constexpr (kOverlapSteps) {
            cp_async_wait<0>();  // K and V, the block's only cp.async copies
            __syncthreads();
        }
        BwdSteps::Cursor at = walk_steps.start(kv_head, p.q_per_kv);  // the step computed

        typename Mainloop::Lanes lanes(lane);
        const int score_row0 = (warp % Cfg::kScoreWarpRows) * Cfg::kScoreRows;
        const int score_col0 = (warp / Cfg::kScoreWarpRows) * Cfg::kScoreCols;
        const int dkv_key0 = (warp % Cfg::kDkvWarpRows) * Cfg::kDkvRows;
        const int dkv_d0 = (warp / Cfg::kDkvWarpRows) * Cfg::kDkvCols;
        const int dq_row0 = (warp % Cfg::kDqWarpRows) * Cfg::kDqRows;
        const int dq_d0 = (warp / Cfg::kDqWarpRows) * Cfg::kDqCols;

        uint32_t score_buffer = 0;  // the step's P and dS buffer, as an offset from the first
        float dv[Cfg::kDkvRows / 16][Cfg::kDkvCols / 8][4];
        float dk[Cfg::kDkvRows / 16][Cfg::kDkvCols / 8][4];
        zero_fill(dv);
        zero_fill(dk);
        int* passing = nullptr;  // deferred turns: the last step's, passed at this step's barrier

#pragma unroll 1
        for (int step = 0; step < steps; ++step) {
            const int stage = kStages > 1 ? step % kStages : 0;
            if constexpr (kOverlapSteps) {
                landed[stage].wait((step / kStages) & 1);  // the stage's copies alone
            } else if constexpr (kStages > 1) {
                cp_async_wait<kStages - 2>();
                __syncthreads();  // this step's tiles landed; every warp is done with step - 1
                const int next = step + kStages - 1;
                if (next < steps) load_step(loading, next % kStages);
                cp_async_commit();
            } else {
                cp_async_wait<0>();
                __syncthreads();
            }
            const int head = at.head;
            const int m_block = at.m_block;
            walk_steps.next(at);
            const int first_row = m_block * kBlockM;
            const uint32_t q_tile = ring + stage * Cfg::kStageBytes;
            const uint32_t do_tile = q_tile + Cfg::kQTileBytes;

            // The rows' LSE log2(e) and D, in the stage's row values (a row that sees no key or
            // lies past seqlen_q has +inf and 0, so P = 0), each read once its GEMM is done (shared
            // memory's latency needs no hiding; read ahead, head_dim 128 spilled).
            const uint32_t row_values = row_values_ring + stage * Cfg::kRowValuesBytes;
            // Phase 1: S -> P, then dP -> dS, each into shared memory as 16-bit values.
            typename Mainloop::ScorePairs pairs;
            {
                float s[Cfg::kScoreRows / 16][kScoreTiles][4];
                Mainloop::gemm_abt(s, q_tile, k_tile, score_row0, score_col0, lanes);
                float lse_log2[Cfg::kScoreRows / 16][2];
                Mainloop::read_row_values(lse_log2, row_values, score_row0, lane);
                // The softcap before the mask, as in the forward: masked scores stay -inf.
                if (Cfg::kOptions && p.softcap_scale != 0.0f) apply_softcap(s, p.softcap_scale);
                if (info.needs_mask(m_block, n_block)) {
                    apply_mask<16>(s, info.mask, first_row + score_row0 + (lane >> 2),
                                   first_key + score_col0 + 2 * (lane & 3), AccumulatorColumns{});
                }
                recompute_probabilities(s, lse_log2, p.scale_log2);
                Mainloop::pack_scores(pairs, s);
            }
            Mainloop::store_scores(p_tile + score_buffer, pairs, score_row0, score_col0, lane);
            {
                float dp[Cfg::kScoreRows / 16][kScoreTiles][4];
                Mainloop::gemm_abt(dp, do_tile, v_tile, score_row0, score_col0, lanes);
                float dpsum[Cfg::kScoreRows / 16][2];
                Mainloop::read_row_values(dpsum, row_values + 4 * kBlockM, score_row0, lane);
                if (Cfg::kOptions && p.softcap_scale != 0.0f) {
                    float lse_log2[Cfg::kScoreRows / 16][2];
                    Mainloop::read_row_values(lse_log2, row_values, score_row0, lane);
                    score_gradient<Cfg::kBf16>(
                        dp, pairs, dpsum,
                        SoftcapRows<Cfg::kScoreRows / 16>{lse_log2,
                                                          SoftcapSlope{__frcp_rn(p.scale_log2)}});
                } else {
                    score_gradient<Cfg::kBf16>(dp, pairs, dpsum);
                }
                Mainloop::pack_scores(pairs, dp);
            }
            Mainloop::store_scores(ds_tile + score_buffer, pairs, score_row0, score_col0, lane);
            __syncthreads();
            if constexpr (kOverlapSteps) {
                // Every warp is done with step - 1: its stage takes the step kStages - 1 ahead.
                const int refill = step + kStages - 1;
                if (tid == 0 && refill < steps) load_step(loading, refill % kStages);
            }
            if constexpr (kDeferredTurns) {
                // Every warp is past the last step's adds: thread 0 passes its turn. Passed right
                // after the adds instead, it cost a block barrier, and the release's MEMBAR.GPU held
                // the waiting thread's warp 0.4-1 us (docs/design/backward.md#deterministic-turns,
                // docs/design/backward.md#portable-deterministic-mode).
                if (tid == 0 && passing != nullptr) pass_turn(passing);
            }

            // Phase 2: dV += P^T dO, dK += dS^T Q.
            Mainloop::gemm_atb(dv, p_tile, do_tile, dkv_key0, dkv_d0, lanes);
            Mainloop::gemm_atb(dk, ds_tile, q_tile, dkv_key0, dkv_d0, lanes);
            if constexpr (kStages == 1) {
                // Q and dO are done with: the next step's copies overlap phase 3.
                __syncthreads();
                if (step + 1 < steps) load_step(loading, 0);
                cp_async_commit();
            }

            // Phase 3: dQ += dS K into the FP32 accumulator.
            float* dq_rows = p.dq_accum + seq.workspace_row(p, head, first_row) * Cfg::kHeadDim;
            int* turn = p.dq_semaphore == nullptr
                            ? nullptr
                            : p.dq_semaphore + (static_cast<int64_t>(batch) * p.heads_q + head) *
                                                   p.num_m_blocks + m_block;
            // Several passes (head_dim 256) read the warp's rows of dS once, before the first.
            typename Mainloop::DsFragments ds;
            if constexpr (Cfg::kDqPasses > 1) {
                Mainloop::load_ds(ds, ds_tile, dq_row0, lanes);
            }
#pragma unroll 1
            for (int pass = 0; pass < Cfg::kDqPasses; ++pass) {
                const int d0 = dq_d0 + pass * Cfg::kDqPassCols;
                float dq[Cfg::kDqRows / 16][Cfg::kDqPassCols / 8][4];
                if constexpr (Cfg::kDqPasses > 1) {
                    Mainloop::gemm_ab(dq, ds, k_tile, d0, lanes);
                } else {
                    Mainloop::gemm_ab(dq, ds_tile, k_tile, dq_row0, d0, lanes);
                }
                if (pass == 0 && turn != nullptr) {
                    // The walk is made again rather than kept in registers (kept, fp16 head_dim 128
                    // spilled). The block's last thread waits: thread 0 issues the TMA refills of
                    // overlapping steps, and waiting for turns as well cost it 1-4%
                    // (docs/design/backward.md#portable-deterministic-mode).
                    const auto wait_for_turn = [&] {
                        const BwdWalk turns =
                            BwdWalk::make(blockIdx.x, n_blocks, m_blocks, Cfg::kCausal, true,
                                          p.dq_turn_group, false, banded);
                        wait_turn(turn, turns.turn(m_block, info.n_min(m_block),
                                                   info.n_max(m_block)));
                    };
                    if constexpr (Cfg::kTurnWarpAlone) {
                        if (warp == Cfg::kWarps - 1) {
                            if (lane == 31) wait_for_turn();
                            __syncwarp();  // the warp's own adds wait for the turn too
                            named_barrier_arrive(kTurnSeen, Cfg::kThreads);
                        } else {
                            named_barrier_sync(kTurnSeen, Cfg::kThreads);
                        }
                    } else {
                        if (tid == Cfg::kThreads - 1) wait_for_turn();
                        __syncthreads();
                    }
                }
#pragma unroll
                for (int m = 0; m < Cfg::kDqRows / 16; ++m) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = dq_row0 + 16 * m + (lane >> 2) + 8 * h;
                        if (first_row + row >= seq.lens.seqlen_q) continue;
#pragma unroll
                        for (int j = 0; j < Cfg::kDqPassCols / 8; ++j) {
                            float* dst = dq_rows + row * Cfg::kHeadDim + d0 + 8 * j + 2 * (lane & 3);
                            red_add_f32x2(dst, dq[m][j][2 * h], dq[m][j][2 * h + 1]);
                        }
                    }
                }
            }
            if constexpr (kDeferredTurns) {
                passing = turn;
            } else if (turn != nullptr) {
                // Every warp's adds precede the release (it is cumulative).
                if constexpr (Cfg::kTurnWarpAlone) {
                    if (warp == Cfg::kWarps - 1) {
                        named_barrier_sync(kTurnAdded, Cfg::kThreads);
                        if (lane == 31) pass_turn(turn);
                    } else {
                        named_barrier_arrive(kTurnAdded, Cfg::kThreads);
                    }
                } else {
                    __syncthreads();
                    if (tid == Cfg::kThreads - 1) pass_turn(turn);
                }
            }
            lanes.next_score_buffer(step);
            if constexpr (Cfg::kScoreBuffers == 2) score_buffer ^= Cfg::kScoreBufferBytes;
        }
        cp_async_wait<0>();
        if (kDeferredTurns && passing != nullptr) {
            __syncthreads();  // every warp's adds precede the release (it is cumulative)
            if (tid == 0) pass_turn(passing);
        }

        store_dkv(p, smem, dk, dv, first_key, kv_head, seq, warp, lane);
    }
};

}  // namespace ptxattn
