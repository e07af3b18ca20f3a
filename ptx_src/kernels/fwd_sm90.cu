// Attention forward for Hopper (sm_90a): TMA + mbarrier pipeline, wgmma, warp specialisation.
//
// A block has 1 + kConsumers warpgroups and computes tiles of kBlockM = 64 * kConsumers query
// rows of one (batch, head):
//   warpgroup 0   the producer: gives most of its registers away (setmaxnreg); one thread
//                 issues the TMA loads of Q, K and V (mainloops/fwd_sm90.cuh), and with FP8 three
//                 warps transpose V;
//   warpgroups 1.. the consumers: 64 query rows each, Q K^T, softmax and P V on wgmma
//                 (mainloops/fwd_sm90.cuh), then the epilogue (epilogue.cuh).
// Tiles come from PersistentTiles (tile_scheduler.cuh): a grid of one block per tile is its
// static order with one tile each; the producer takes each tile and resolves it (TileWork:
// coordinates, the sequence's lengths, the key blocks), the consumers receive it through the
// mailbox and hold its slot until the tile's end. The K/V rings and their phases run on
// across tiles; the producer loads the next tile's Q as soon as every consumer finished its last
// Q K^T, and the output leaves through a TMA store (or, where shared memory has no room to stage
// it, from registers), so nothing waits for it to drain.
//
// The launcher (ptxattn/launchers/hopper_forward.py) instantiates attn_fwd_sm90<Sm90Config<...>> by
// name; every runtime argument is in FwdParams (params.cuh). Global layouts: q (B, Sq, Hq, D); k, v
// (B, Sk, Hkv, D), read through 4-d tensor maps with coordinates (d, head, row, batch) and a box of
// one swizzle span of columns; rows past the end are zero-filled. out (B, Sq, Hq, D) through
// out_map (a box of 64 rows x 64 columns, 128-byte swizzle; staged builds) or its strides. The
// serving build (Sm90Config::kServing; ptxattn/launchers/hopper_forward.py) reads a packed varlen
// batch as one batch of all its rows, q (1, total_q, Hq, D) and k, v (1, total_k, Hkv, D), each
// sequence's rows located by cu_seqlens, and KV caches (B, capacity, Hkv, D) up to each seqused_k.
#include "roles/epilogue.cuh"
#include "mainloops/fwd_sm90.cuh"
#include "roles/params.cuh"
#include "roles/tile_scheduler.cuh"
#include "ptx/warpgroup.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
attn_fwd_sm90(const __grid_constant__ FwdParams p) {
    using Mainloop = Sm90Mainloop<Cfg>;
    using Barriers = typename Mainloop::Barriers;
    using Output = typename Mainloop::Output;

    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = align_smem<Cfg::kSwizzleAtomBytes>(smem_raw);
    Barriers& bars = *reinterpret_cast<Barriers*>(smem + Mainloop::kBarrierOffset);
    Pipeline<Cfg::kStages>& vt =
        *reinterpret_cast<Pipeline<Cfg::kStages>*>(smem + Mainloop::kVtBarrierOffset);
    const int splits = Mainloop::splits(p);
    // Causal L2 sections in alternating order (tile_scheduler.cuh) where the tiles are long: at 32
    // query blocks and more, +2.2-2.6%; at 16 (seqlen 2048), head_dim 64 lost 1% (H100 SXM,
    // 2026-11-27; docs/design/scheduling.md#alternating-section-order). Not in serving builds,
    // whose tiles' lengths follow their sequences (and whose head_dim 64 producer then spills).
    constexpr int kAlternateMinBlocks = 32;
    const TileOrder order{p.num_m_blocks, p.batch * p.heads_q * splits, p.section_heads,
                          p.heads_q * splits,
                          Cfg::kCausal && !Cfg::kServing &&
                              p.num_m_blocks >= kAlternateMinBlocks};

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
    PersistentTiles<TileWork> tiles{p.tile_counter, bars.tiles};

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
    // 16-bit builds take the warpgroup index as warp-uniform (warpgroup_index: Q's descriptors in
    // uniform registers, +0.3-2.8% on an H100); FP8 builds ran 2-3% slower with it at head_dim 64
    // and no faster elsewhere, and the backward no faster (H100 SXM, 2026-11-27;
    // docs/design/pipelines.md#warpgroup-index).
    const int wg = (Cfg::kFp8 ? static_cast<int>(threadIdx.x / 128) : warpgroup_index()) - 1;
    const int lane = threadIdx.x % 32;
    const int row_in_tile = wg * Cfg::kRowsPerConsumer + ((threadIdx.x % 128) / 32) * 16 + lane / 4;
    typename Mainloop::Consumer consumer{smem, bars, vt, wg, lane, p.scale_log2};
#pragma unroll 1
    for (const TileWork* work = &tiles.receive(); work->tile < order.num_tiles();
         tiles.release(), work = &tiles.receive()) {
        consumer.start_tile(p, *work, row_in_tile);
        // Serving builds: a tile past its sequence's end has nothing to compute or store.
        if (Cfg::kServing && work->c.m_block * Cfg::kBlockM >= work->lens.seqlen_q) continue;
        consumer.mainloop(p);

        const TileCoord& c = work->c;
        float inv_sum[1][2];
        float row_lse[1][2];
        consumer.softmax.finalize(inv_sum, row_lse);
        float factor[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            factor[h] = Cfg::kFp8 ? inv_sum[0][h] * consumer.v_descale : inv_sum[0][h];
        }
        const auto& o = reinterpret_cast<const float(&)[Cfg::kHeadDimV / 8][4]>(consumer.o);
        const SeqLens lens = consumer.lens(p);
        // Split-KV (serving builds): this split's partial state, float32, for combine.cu.
        const bool partial = Cfg::kServing && splits > 1;
        if constexpr (Cfg::kServing) {
            if (!partial && p.sinks != nullptr) {
                const float sink = p.sinks[c.head];
#pragma unroll
                for (int h = 0; h < 2; ++h) fold_sink(row_lse[0][h], factor[h], sink);
            }
        }
        // Made here, not before the loop, so that it holds no registers through the mainloop.
        const Output output{smem + Mainloop::kOutOffset + wg * Output::kBytes,
                            Mainloop::Consumer::kVoteBarrier + Cfg::kConsumers + wg};
        const int wg_row0 = c.m_block * Cfg::kBlockM + wg * Cfg::kRowsPerConsumer;
        const int out_batch = Mainloop::q_batch(p, c.batch);
        // The TMA store clips rows at the array's end; packed sequences end before it, so a tile
        // that runs past its sequence's end stores from registers. (Decided per tile, not per
        // warpgroup: a condition on the warpgroup index, before ptxas could prove it warp-uniform,
        // moved the mainloop's wgmma descriptors out of uniform registers, 7% more instructions.)
        const bool staged = Cfg::kStagedOut && !partial &&
                            (!Cfg::kServing || p.cu_seqlens_q == nullptr ||
                             (c.m_block + 1) * Cfg::kBlockM <= lens.seqlen_q);
        if (staged) {
            output.store(o, factor, &p.out_map, c.head, lens.offset_q + wg_row0, out_batch);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = consumer.row0 + 8 * h;
            if (row >= lens.seqlen_q) continue;
            if (partial) {
                // Partial rows count over the batch (FwdParams::total_q).
                const int batch_row = (p.cu_seqlens_q != nullptr ? 0 : c.batch * p.seqlen_q) +
                                      lens.offset_q + row;
                if (lane % 4 == 0) partial_lse(p, c.split, batch_row, c.head) = row_lse[0][h];
                store_accumulator_row_f32(
                    partial_out_row(p, c.split, batch_row, c.head, Cfg::kHeadDimV), o, h,
                    factor[h], lane, p.head_dim_v);
                continue;
            }
            if (!staged) {
                store_accumulator_row<Cfg::kBf16>(
                    out_row(p, out_batch, c.head, lens.offset_q + row), o, h, factor[h], lane,
                    p.head_dim_v);
            }
            if (lane % 4 == 0) {
                write_lse(p, out_batch, c.head, lens.offset_q + row, row_lse[0][h]);
            }
        }
    }
    if constexpr (Cfg::kStagedOut) {
        const Output output{smem + Mainloop::kOutOffset + wg * Output::kBytes, 0};
        output.finish();
    }
}

}  // namespace ptxattn
