// Block-scaled attention forward: MXFP8 or NVFP4 Q and K, MXFP8 V, bf16 output and LSE.
// Native on sm_120a (block-scaled mma.sync); built for sm_90a with PTXATTN_EMULATE_BLOCK_SCALE=1
// it runs the same code with block_scale_mma.cuh's exact emulation of each MMA.
//
// One block of 8 warps per tile of 128 query rows of one (batch, head) (tile_scheduler.cuh).
// Thread 0 streams tiles of 128 keys (K and V^T) through a 2-stage TMA ring (pipeline.cuh; full
// barrier: TMA bytes; empty barrier: one arrival per warp); Q comes once by TMA and is re-read
// from shared memory one head_dim step at a time. Each tile is two softmax steps
// (mainloops/fwd_blockscaled.cuh); the output is stored straight from registers (epilogue.cuh).
//
// Operands in global memory (uint8; ptxattn/blockscaled.py documents and checks the shapes):
//   Q, K    rows of head_dim: e4m3 bytes (MXFP8) or e2m1 pairs, low nibble first (NVFP4);
//           row scales: one UE8M0 per 32 (MXFP8) or one UE4M3 per 16 (NVFP4) along head_dim,
//           NVFP4 also one FP32 scale per tensor (q_tensor_scale, k_tensor_scale; 1 for MXFP8).
//   V^T     (batch, heads_kv, head_dim, seqlen padded to 128) e4m3, so a tile is head_dim rows
//           of 128 keys, K-major like K; scales (batch, heads_kv, head_dim, padded / 32) UE8M0.
// The launcher instantiates attn_fwd_blockscaled<HeadDim, Nvfp4> by name; every runtime
// argument is in FwdParams (params.cuh). out is (B, Sq, Hq, D) bf16 through its strides.
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "mainloops/fwd_blockscaled.cuh"
#include "ptx/mbarrier.cuh"
#include "roles/params.cuh"
#include "roles/pipeline.cuh"
#include "roles/tile_scheduler.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {

template <int HeadDim, bool Nvfp4>
__global__ void __launch_bounds__(BlockScaledMainloop<HeadDim, Nvfp4>::kThreads, 1)
attn_fwd_blockscaled(const __grid_constant__ FwdParams p) {
    using M = BlockScaledMainloop<HeadDim, Nvfp4>;
    constexpr int kBlockM = M::kBlockM;
    constexpr int kBlockN = M::kBlockN;
    constexpr int kStages = M::kStages;
    static_assert(kBlockN == 2 * M::kStepN, "a K/V tile is two softmax steps");
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uint64_t>(smem_raw) + 1023) & ~static_cast<uint64_t>(1023));
    Pipeline<kStages>& kv = *reinterpret_cast<Pipeline<kStages>*>(smem + M::kBarrierOffset);
    MBarrier& q_full = *reinterpret_cast<MBarrier*>(smem + M::kBarrierOffset + sizeof(kv));

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const TileOrder order{p.num_m_blocks, p.batch * p.heads_q, 1, p.heads_q};
    GridTiles tiles;
    const TileCoord c = order.decode(tiles.next(order.num_tiles()));
    const int head_kv = c.head / p.q_per_kv;
    const int row0 = c.m_block * kBlockM;
    const BlockInfo<kBlockM, M::kStepN> info(p.seqlen_q, p.seqlen_k, p.causal != 0);
    const int n_tiles = ceil_div(info.n_max(c.m_block), 2);

    const auto load_kv = [&](const PipelineState<kStages>& slot, int tile) {
        MBarrier& full = kv.full_barrier(slot);
        full.arrive_expect_tx(M::kKTileBytes + M::kVTileBytes);
        tma_load_4d(smem + M::kKOffset + slot.stage() * M::kKTileBytes, &p.k_map, full, 0,
                    head_kv, tile * kBlockN, c.batch);
        tma_load_4d(smem + M::kVOffset + slot.stage() * M::kVTileBytes, &p.v_map, full,
                    tile * kBlockN, 0, head_kv, c.batch);
    };
    if (tid == 0) {
        kv.init(1, M::kWarps);
        q_full.init(1);
        fence_barrier_init();
        tma_prefetch(&p.q_map);
        tma_prefetch(&p.k_map);
        tma_prefetch(&p.v_map);
    }
    __syncthreads();
    if (tid == 0) {
        q_full.arrive_expect_tx(M::kQTileBytes);
        tma_load_4d(smem, &p.q_map, q_full, 0, c.head, row0, c.batch);
        for (PipelineState<kStages> slot; slot.count < kStages && slot.count < n_tiles;
             ++slot.count) {
            load_kv(slot, slot.count);
        }
    }

    typename M::StepContext sc{};
    {
        // scale_A from lane l is row l/4 + 8 (l%2), which serves thread-id-a 0 and 1 alike.
        const int row = row0 + warp * 16 + g + 8 * (lane % 2);
        M::load_row_scales(sc.q_sf, p.q_scale,
                           (static_cast<int64_t>(c.batch) * p.seqlen_q + row) * p.heads_q + c.head,
                           row < p.seqlen_q);
    }
    // ldmatrix lanes 8i..8i+7 address the rows of matrix i. Q (m16 A operand): matrices (rows
    // 0-7, bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31). K and V^T (B operands of two
    // 8-wide tiles): (tile 0, bytes 0-15), (0, 16-31), (1, 0-15), (1, 16-31), K's rows permuted
    // by key_of. One offset per head_dim step or key chunk; 16-row groups add an immediate.
    const int half_col = 16 * ((lane / 8) % 2);
    const int q_row = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
    const int k_row = M::key_of(lane / 16, lane % 8);
    const int v_row = 8 * (lane / 16) + lane % 8;
#pragma unroll
    for (int step = 0; step < M::kQKSteps; ++step) {
        sc.q_lane[step] = M::template swizzled_col<M::kQKRowBytes>(q_row, 32 * step + 16 * (lane / 16));
        sc.k_lane[step] = M::template swizzled_col<M::kQKRowBytes>(k_row, 32 * step + half_col);
    }
#pragma unroll
    for (int chunk = 0; chunk < kBlockN / 32; ++chunk) {
        sc.v_lane[chunk] = M::template swizzled_col<M::kVRowBytes>(v_row, 32 * chunk + half_col);
    }
    sc.q_tile = smem_addr(smem);
    sc.k_scale = p.k_scale;
    sc.k_scale_row0 = static_cast<int64_t>(c.batch) * p.seqlen_k;
    sc.heads_kv = p.heads_kv;
    sc.head_kv = head_kv;
    sc.seqlen_k = p.seqlen_k;
    // scale_B of S tile j (key_of(j, n) for n = lane/4) sits in register j / 4 of the lanes
    // with t = j % 4, and so does that of O tile j (d = 8j + lane/4).
    sc.k_sf_key = M::key_of(t, g);
    sc.first_row = row0 + warp * 16 + g;
    sc.n_step_masked = info.n_right_masked(c.m_block);
    sc.mask = info.mask;
    sc.t = t;
    sc.scale_log2 = p.scale_log2 * *p.q_tensor_scale * *p.k_tensor_scale;
    const int v_sf_dim = 8 * t + g;
    const uint8_t* v_scale_head =
        p.v_scale + (static_cast<int64_t>(c.batch) * p.heads_kv + head_kv) * HeadDim * p.v_scale_row;

    typename M::RowSoftmax softmax;
    softmax.init();
    float o[M::kOTiles][4];
    zero_fill(reinterpret_cast<float(&)[1][M::kOTiles][4]>(o));
    q_full.wait(0);

    PipelineState<kStages> slot;
    for (int tile = 0; tile < n_tiles; ++tile, ++slot.count) {
        const uint32_t k_tile = smem_addr(smem + M::kKOffset + slot.stage() * M::kKTileBytes);
        const uint32_t v_tile = smem_addr(smem + M::kVOffset + slot.stage() * M::kVTileBytes);

        // V scales: byte n of a register scales key chunk n of the tile (both softmax steps).
        uint32_t v_sf[M::kOTiles / 4];
#pragma unroll
        for (int r = 0; r < M::kOTiles / 4; ++r) {
            const int64_t row = 32 * r + v_sf_dim;
            v_sf[r] = __ldg(reinterpret_cast<const uint32_t*>(v_scale_head + row * p.v_scale_row) +
                            tile);
        }
        kv.consumer_wait(slot);
        M::template softmax_step<0>(sc, tile, k_tile, v_tile, v_sf, softmax, o);
        M::template softmax_step<1>(sc, tile, k_tile, v_tile, v_sf, softmax, o);

        __syncwarp();
        if (lane == 0) kv.consumer_release(slot);
        if (tid == 0 && tile + kStages < n_tiles) {
            kv.producer_acquire(PipelineState<kStages>{slot.count + kStages});
            load_kv(PipelineState<kStages>{slot.count + kStages}, tile + kStages);
        }
    }

    float inv_sum[1][2], row_lse[1][2];
    softmax.finalize(inv_sum, row_lse);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = sc.first_row + 8 * h;
        if (row >= p.seqlen_q) continue;
        store_accumulator_row<true>(out_row(p, c.batch, c.head, row), o, h, inv_sum[0][h], lane,
                                    HeadDim);
        if (t == 0) write_lse(p, c.batch, c.head, row, row_lse[0][h]);
    }
}

}  // namespace ptxattn
