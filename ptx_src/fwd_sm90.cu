// Attention forward for Hopper (sm_90a): TMA + mbarrier pipeline, wgmma, warp specialisation.
//
// A block has 1 + kConsumers warpgroups and computes tiles of kBlockM = 64 * kConsumers query
// rows of one (batch, head):
//   warpgroup 0   the producer: gives most of its registers away (setmaxnreg); one thread
//                 issues the TMA loads of Q, K and V (mainloop_sm90.cuh), and with FP8 three
//                 warps transpose V;
//   warpgroups 1.. the consumers: 64 query rows each, Q K^T, softmax and P V on wgmma
//                 (mainloop_sm90.cuh), then the epilogue (epilogue.cuh).
// Tiles come from PersistentTiles (tile_scheduler.cuh): a grid of one block per tile is its
// static order with one tile each; the producer takes each tile, the consumers receive it. The K/V rings and their phases run on
// across tiles; the producer loads the next tile's Q as soon as every consumer finished its last
// Q K^T, and the output leaves through a TMA store (or, where shared memory has no room to stage
// it, from registers), so nothing waits for it to drain.
//
// The launcher (ptxattn/hopper.py) instantiates attn_fwd_sm90<Sm90Config<...>> by name; every
// runtime argument is in FwdParams (params.cuh). Global layouts: q (B, Sq, Hq, D); k, v
// (B, Sk, Hkv, D), read through 4-d tensor maps with coordinates (d, head, row, batch) and a box
// of one swizzle span of columns; rows past the end are zero-filled. out (B, Sq, Hq, D) through
// out_map (a box of 64 rows x 64 columns, 128-byte swizzle; staged builds) or its strides.
#include "epilogue.cuh"
#include "mainloop_sm90.cuh"
#include "params.cuh"
#include "tile_scheduler.cuh"
#include "warpgroup.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
attn_fwd_sm90(const __grid_constant__ FwdParams p) {
    using Mainloop = Sm90Mainloop<Cfg>;
    using Barriers = typename Mainloop::Barriers;
    using Output = StagedTmaStore<Cfg::kHeadDim, Cfg::kBf16>;

    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((Cfg::kSwizzleAtomBytes -
                                 (smem_addr(smem_raw) % Cfg::kSwizzleAtomBytes)) %
                                Cfg::kSwizzleAtomBytes);
    Barriers& bars = *reinterpret_cast<Barriers*>(smem + Mainloop::kBarrierOffset);
    Pipeline<Cfg::kStages>& vt =
        *reinterpret_cast<Pipeline<Cfg::kStages>*>(smem + Mainloop::kVtBarrierOffset);
    const TileOrder order{p.num_m_blocks, p.batch * p.heads_q, p.section_heads, p.heads_q};

    if (threadIdx.x == 0) {
        bars.q_full.init(1);
        bars.q_empty.init(Cfg::kConsumerWarps);
        bars.k.init(1, Cfg::kConsumerWarps);
        // FP8: V is read by the transposing threads, Vt by the consumers.
        bars.v.init(1, Cfg::kFp8 ? 32 * Cfg::kTransposeWarps : Cfg::kConsumerWarps);
        if constexpr (Cfg::kFp8) vt.init(32 * Cfg::kTransposeWarps, Cfg::kConsumerWarps);
        bars.tiles.init(Cfg::kConsumerWarps);
        bars.v_end = -1;
        fence_barrier_init();
    }
    __syncthreads();
    PersistentTiles tiles{p.tile_counter, bars.tiles};

    if (threadIdx.x < 128) {
        warpgroup_reg_dealloc<Cfg::kProducerRegs>();
        if (threadIdx.x == 0) {
            Mainloop::load(p, smem, bars, order, tiles);
        } else if (threadIdx.x >= 32) {
            if constexpr (Cfg::kFp8) Mainloop::template transpose_v<Cfg::kBlockN>(smem, bars, vt);
        }
        return;
    }

    warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int wg = threadIdx.x / 128 - 1;
    const int lane = threadIdx.x % 32;
    const int row_in_tile = wg * Cfg::kRowsPerConsumer + ((threadIdx.x % 128) / 32) * 16 + lane / 4;
    typename Mainloop::Consumer consumer{smem, bars, vt, wg, lane, p.scale_log2};
#pragma unroll 1
    for (int tile = tiles.receive(order.num_tiles()); tile < order.num_tiles();
         tile = tiles.receive(order.num_tiles())) {
        const TileCoord c = order.decode(tile);
        consumer.start_tile(p, c, row_in_tile);
        consumer.mainloop(p, c.m_block);

        float inv_sum[1][2];
        float row_lse[1][2];
        consumer.softmax.finalize(inv_sum, row_lse);
        float factor[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            factor[h] = Cfg::kFp8 ? inv_sum[0][h] * consumer.v_descale : inv_sum[0][h];
        }
        const auto& o = reinterpret_cast<const float(&)[Cfg::kHeadDim / 8][4]>(consumer.o);
        // Made here, not before the loop, so that it holds no registers through the mainloop.
        const Output output{smem + Mainloop::kOutOffset + wg * Output::kBytes,
                            Mainloop::Consumer::kVoteBarrier + Cfg::kConsumers + wg};
        if constexpr (Cfg::kStagedOut) {
            output.store(o, factor, &p.out_map, c.head,
                         c.m_block * Cfg::kBlockM + wg * Cfg::kRowsPerConsumer, c.batch);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = consumer.row0 + 8 * h;
            if (row >= p.seqlen_q) continue;
            if constexpr (!Cfg::kStagedOut) {
                store_accumulator_row<Cfg::kBf16>(out_row(p, c.batch, c.head, row), o, h,
                                                  factor[h], lane);
            }
            if (lane % 4 == 0) write_lse(p, c.batch, c.head, row, row_lse[0][h]);
        }
    }
    if constexpr (Cfg::kStagedOut) {
        const Output output{smem + Mainloop::kOutOffset + wg * Output::kBytes, 0};
        output.finish();
    }
}

}  // namespace ptxattn
