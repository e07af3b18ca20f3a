// FlashAttention-2 style forward pass on mma.sync tensor cores: the portable kernel (sm_80+).
//
// One block per tile of kBlockM query rows of one (batch, head) (tile_scheduler.cuh: the query
// blocks of a (batch, head) run next to each other so that they share K/V in L2, the longest
// causal ones first). Its warps load Q once, then stream the tile's key blocks (block_info.cuh),
// last to first, through the cp.async ring while running Q K^T, the mask where a block needs it
// (mask.cuh), the online softmax (softmax.cuh) and P V (mainloops/fwd_mma_sync.cuh); the epilogue
// stages the normalised output in each warp's own Q rows and stores it in 16-byte chunks
// (epilogue.cuh).
//
// The launcher (ptxattn/launchers/portable_forward.py) instantiates
// attn_fwd_mma_sync<MmaSyncConfig<...>> by name; every runtime argument is in FwdParams
// (params.cuh): q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out like q, through their pointers and
// element strides (unit stride in D, 16-byte aligned rows).
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "mainloops/fwd_mma_sync.cuh"
#include "roles/mask.cuh"
#include "roles/params.cuh"
#include "roles/softmax.cuh"
#include "roles/tile_scheduler.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
attn_fwd_mma_sync(const __grid_constant__ FwdParams p) {
    using Mainloop = MmaSyncMainloop<Cfg>;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kStages = Cfg::kStages;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp_row = (tid >> 5) * Cfg::kWarpRows;

    const TileOrder order{p.num_m_blocks, p.batch * p.heads_q, 1, p.heads_q};
    GridTiles tiles;
    const TileCoord c = order.decode(tiles.next(order.num_tiles()));
    const int kv_head = c.head / p.q_per_kv;
    const int first_row = c.m_block * Cfg::kBlockM;
    const BlockInfo<Cfg::kBlockM, kBlockN> info(p.seqlen_q, p.seqlen_k, Cfg::kCausal);
    const int n_blocks = info.n_max(c.m_block);
    const int n_first_masked = info.n_right_masked(c.m_block);

    const uint16_t* q_head = static_cast<const uint16_t*>(p.q) + c.batch * p.q_stride_b +
                             c.head * p.q_stride_h;
    const uint16_t* k_head = static_cast<const uint16_t*>(p.k) + c.batch * p.k_stride_b +
                             kv_head * p.k_stride_h;
    const uint16_t* v_head = static_cast<const uint16_t*>(p.v) + c.batch * p.v_stride_b +
                             kv_head * p.v_stride_h;

    const uint32_t q_tile = smem_addr(smem);
    const uint32_t ring = q_tile + Cfg::kQTileBytes;
    Mainloop::template load_tile<Cfg::kBlockM, true>(q_tile, q_head + first_row * p.q_stride_s,
                                                     p.q_stride_s, p.seqlen_q - first_row,
                                                     p.head_dim, tid);
#pragma unroll
    for (int iter = 0; iter < kStages - 1; ++iter) {
        if (iter < n_blocks) {
            Mainloop::template load_kv<true>(ring + iter * Cfg::kStageBytes, p, k_head, v_head,
                                             (n_blocks - 1 - iter) * kBlockN, tid);
        }
        cp_async_commit();
    }

    const auto q_lane = Mainloop::a_frag_lane(lane);
    const auto k_lane = Mainloop::k_frag_lane(lane);
    const auto v_lane = Mainloop::a_frag_lane(lane);

    float o[Cfg::kMTiles][Cfg::kOTiles][4];
    zero_fill(o);
    OnlineSoftmax<Cfg::kMTiles> softmax;
    softmax.init();

#pragma unroll 1
    for (int iter = 0; iter < n_blocks; ++iter) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // the block's data has landed and every warp is done with iter - 1
        const int next = iter + kStages - 1;
        if (next < n_blocks) {
            Mainloop::template load_kv<false>(ring + (next % kStages) * Cfg::kStageBytes, p,
                                              k_head, v_head, (n_blocks - 1 - next) * kBlockN,
                                              tid);
        }
        cp_async_commit();

        const uint32_t k_tile = ring + (iter % kStages) * Cfg::kStageBytes;
        const int n_block = n_blocks - 1 - iter;
        float s[Cfg::kMTiles][Cfg::kSTiles][4];
        Mainloop::gemm_qk(s, q_tile, k_tile, warp_row, q_lane, k_lane);
        if (n_block >= n_first_masked) {
            apply_mask<16>(s, info.mask, first_row + warp_row + (lane >> 2),
                           n_block * kBlockN + 2 * (lane & 3), AccumulatorColumns{});
        }
        float rescale[Cfg::kMTiles][2];
        if (softmax.update(s, p.scale_log2, rescale)) scale_rows(o, rescale);
        uint32_t pa[Cfg::kMTiles][Cfg::kPSteps][4];
        Mainloop::pack_probabilities(pa, s);
        Mainloop::gemm_pv(o, pa, k_tile + Cfg::kKVTileBytes, v_lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // every copy has landed (also when no block was visited) before Q is reused

    float inv_sum[Cfg::kMTiles][2];
    float row_lse[Cfg::kMTiles][2];
    softmax.finalize(inv_sum, row_lse);
    scale_rows(o, inv_sum);
    const auto tile_offset = [](int row, int chunk) { return Mainloop::tile_offset(row, chunk); };
    stage_accumulator_rows<Cfg::kBf16>(smem, tile_offset, o, warp_row, lane);
    if ((lane & 3) == 0) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = first_row + warp_row + 16 * m + (lane >> 2) + 8 * h;
                if (row < p.seqlen_q) write_lse(p, c.batch, c.head, row, row_lse[m][h]);
            }
        }
    }
    __syncwarp();
    uint16_t* out_head = out_row(p, c.batch, c.head, 0);
    store_staged_rows<Cfg::kWarpRows, Cfg::kChunksPerRow>(smem, tile_offset, out_head,
                                                           p.out_stride_s, first_row, warp_row,
                                                           p.seqlen_q, p.head_dim_v / 8, lane);
}

}  // namespace ptxattn
