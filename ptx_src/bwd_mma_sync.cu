// FlashAttention-2 style backward pass on mma.sync tensor cores: the portable kernel (sm_80+).
//
// Runs between bwd_preprocess (dpsum = rowsum(dO * O), dq_accum zeroed) and bwd_postprocess
// (dq = softmax_scale * dq_accum in the input dtype), both in bwd_prepost.cu.
//
// Grid (key blocks, kv heads, batch): block (n, kv head, b) loads its kBlockN keys of K and V
// once, then for every q head sharing the kv head walks the query tiles that see those keys
// (block_info.cuh), first to last, through a ring of (Q, dO) stages, and runs the
// three phases of mainloop_bwd_mma_sync.cuh (whose header also says how warps synchronise). dK
// and dV are sums over the block's own walk (GQA heads included) and stay in registers until the
// end; dQ crosses key blocks, so each block adds its part into the FP32 accumulator: with
// red.global.add in any order, or, with dq_semaphore, in key-block order (atomics.cuh) so that
// the sums are bit-reproducible. A block passes its turn at a tile right after its adds, or in
// builds with deferred turns (sm_90+ deterministic) at the next step's score barrier.
// Q, dO and the rows' values reach the ring by cp.async from every thread, or with overlapping
// steps (sm_90+) by one thread's TMA and bulk copies, issued once every warp is past the step
// before (P and dS then alternate between two buffers).
// The order of the walk and of the deterministic sums is BwdWalk's (tile_scheduler.cuh).
//
// The launcher (ptxattn/portable.py) instantiates attn_bwd_mma_sync<BwdMmaSyncConfig<...>> by
// name; every runtime argument is in BwdParams (params.cuh).
#include "block_info.cuh"
#include "epilogue.cuh"
#include "mainloop_bwd_mma_sync.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "atomics.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
attn_bwd_mma_sync(const __grid_constant__ BwdParams p) {
    using Mainloop = BwdMmaSyncMainloop<Cfg>;
    constexpr int kBlockM = Cfg::kBlockM;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kStages = Cfg::kStages;
    constexpr bool kOverlapSteps = Cfg::kOverlapSteps;
    constexpr int kScoreTiles = Cfg::kScoreCols / 8;
    // Named barriers of the deterministic sums with kTurnWarpAlone (0 is __syncthreads'): the
    // turn has come; every warp has added.
    constexpr uint32_t kTurnSeen = 1, kTurnAdded = 2;
    constexpr bool kDeferredTurns = Cfg::kDeferredTurns;
    extern __shared__ __align__(128) uint8_t smem_raw[];
    uint8_t* const smem = kOverlapSteps ? align_smem<1024>(smem_raw) : smem_raw;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;

    const BlockInfo<kBlockM, kBlockN> info(p.seqlen_q, p.seqlen_k, Cfg::kCausal);
    const BwdWalk walk = BwdWalk::make(blockIdx.x, gridDim.x, p.num_m_blocks, Cfg::kCausal,
                                       p.dq_semaphore != nullptr, p.dq_turn_group);
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
        static_cast<const uint16_t*>(p.k) + batch * p.k_stride_b + kv_head * p.k_stride_h +
            first_key * p.k_stride_s,
        p.k_stride_s, p.seqlen_k - first_key, tid);
    Mainloop::template load_rows<kBlockN>(
        v_tile,
        static_cast<const uint16_t*>(p.v) + batch * p.v_stride_b + kv_head * p.v_stride_h +
            first_key * p.v_stride_s,
        p.v_stride_s, p.seqlen_k - first_key, tid);

    // Q and dO of the step at `cursor` into ring stage `stage`; the cursor moves to the next.
    // (The walk as a cursor, without head()'s and m_block()'s divisions at every step, leaves
    // head_dim 128 the registers for FlashAttention-2's warp grid without spills.) By TMA
    // (overlapping steps), only thread 0 calls it: rows past seqlen_q arrive zero-filled, as the
    // map ends there.
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
                tma_load_4d(q_slab, &p.q_map, full, 64 * slab, head, row0, batch);
                tma_load_4d(q_slab + Cfg::kQTileBytes, &p.dout_map, full, 64 * slab, head, row0,
                            batch);
            }
            const int padded_row = (batch * p.heads_q + head) * p.seqlen_q_rounded + row0;
            uint8_t* const values = smem + (values_dst - k_tile);
            bulk_load(values, p.lse_log2 + padded_row, 4 * kBlockM, full);
            bulk_load(values + 4 * kBlockM, p.dpsum + padded_row, 4 * kBlockM, full);
            walk_steps.next(cursor);
            return;
        }
        Mainloop::template load_rows<kBlockM>(
            q_dst,
            static_cast<const uint16_t*>(p.q) + batch * p.q_stride_b + head * p.q_stride_h +
                row0 * p.q_stride_s,
            p.q_stride_s, p.seqlen_q - row0, tid);
        Mainloop::template load_rows<kBlockM>(
            q_dst + Cfg::kQTileBytes,
            static_cast<const uint16_t*>(p.dout) + batch * p.dout_stride_b +
                head * p.dout_stride_h + row0 * p.dout_stride_s,
            p.dout_stride_s, p.seqlen_q - row0, tid);
        Mainloop::load_row_values(values_dst, p.lse_log2, p.dpsum,
                                  (batch * p.heads_q + head) * p.seqlen_q_rounded + row0, tid);
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
        const int64_t row_base = (static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q;
        // Phase 1: S -> P, then dP -> dS, each into shared memory as 16-bit values.
        typename Mainloop::ScorePairs pairs;
        {
            float s[Cfg::kScoreRows / 16][kScoreTiles][4];
            Mainloop::gemm_abt(s, q_tile, k_tile, score_row0, score_col0, lanes);
            float lse_log2[Cfg::kScoreRows / 16][2];
            Mainloop::read_row_values(lse_log2, row_values, score_row0, lane);
            if (n_block >= info.n_right_masked(m_block)) {
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
            score_gradient<Cfg::kBf16>(dp, pairs, dpsum);
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
            // the waiting thread's warp 0.4-1 us (docs/hopper-tuning.md, sessions 27 and 38).
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
        float* dq_rows = p.dq_accum + (row_base + first_row) * Cfg::kHeadDim;
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
                // (docs/hopper-tuning.md, session 35).
                const auto wait_for_turn = [&] {
                    const BwdWalk turns = BwdWalk::make(blockIdx.x, gridDim.x, p.num_m_blocks,
                                                        Cfg::kCausal, true, p.dq_turn_group);
                    wait_turn(turn, turns.turn(m_block, info.n_max(m_block)));
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
                    if (first_row + row >= p.seqlen_q) continue;
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

    // dK = softmax_scale dS^T Q and dV; keys past seqlen_k dropped. From head_dim 128 staged in
    // K's and V's tiles (free once every warp is past its last GEMM) and copied out a whole
    // 16-byte chunk a lane: stored from registers, 4 bytes of a row at a time, they cost 1-3%
    // (seqlen 2048). Head_dim 64 keeps the stores from registers: with the staging, ptxas moved
    // address arithmetic of the walk from uniform to vector registers (60 more IMADs a step) and
    // the non-causal rows lost 3-4% (docs/hopper-tuning.md, session 30).
    uint16_t* dk_head = static_cast<uint16_t*>(p.dk) + batch * p.dk_stride_b +
                        kv_head * p.dk_stride_h;
    uint16_t* dv_head = static_cast<uint16_t*>(p.dv) + batch * p.dv_stride_b +
                        kv_head * p.dv_stride_h;
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
            smem, row_chunks, dk_head, p.dk_stride_s, first_key, warp * kWarpKeys, p.seqlen_k,
            lane);
        store_staged_rows<kWarpKeys, KVTile::kChunksPerRow>(
            smem + Cfg::kKVTileBytes, row_chunks, dv_head, p.dv_stride_s, first_key,
            warp * kWarpKeys, p.seqlen_k, lane);
    } else {
#pragma unroll
        for (int m = 0; m < Cfg::kDkvRows / 16; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = first_key + dkv_key0 + 16 * m + (lane >> 2) + 8 * h;
                if (key >= p.seqlen_k) continue;
#pragma unroll
                for (int j = 0; j < Cfg::kDkvCols / 8; ++j) {
                    const int col = dkv_d0 + 8 * j + 2 * (lane & 3);
                    *reinterpret_cast<uint32_t*>(dk_head + key * p.dk_stride_s + col) =
                        pack_f32x2<Cfg::kBf16>(dk[m][j][2 * h] * p.softmax_scale,
                                               dk[m][j][2 * h + 1] * p.softmax_scale);
                    *reinterpret_cast<uint32_t*>(dv_head + key * p.dv_stride_s + col) =
                        pack_f32x2<Cfg::kBf16>(dv[m][j][2 * h], dv[m][j][2 * h + 1]);
                }
            }
        }
    }
}

}  // namespace ptxattn
