// Multi-head latent attention decoding on mma.sync tensor cores (sm_80+, shared memory for a
// 576-column tile ring): DeepSeek-V3's and Kimi K2's decode step after weight absorption, with
// speculative tokens and split-KV.
//
// A block is (a tile of packed query rows, sequence) and one split of the key blocks those rows
// see. Rows are (token, head) pairs, heads fastest (kv_cache.cuh's PackedRows with one kv head),
// so a sequence's latent rows are read once for all the heads of its tile. The warps split each
// stage's keys for the scores and the value columns for the output (mainloops/mla_mma_sync.cuh).
// The keys come from a contiguous or paged cache, of the queries' dtype or e4m3, up to the
// sequence's filled length (seqused_k), masked bottom-right causal (mask.cuh). With one split the
// block writes the normalised output and LSE; with several, its partial state in float32 for
// combine.cu.
//
// Every runtime argument is in FwdParams (params.cuh): q (batch, seqlen_q, heads_q, kHeadDim);
// the cache as k (kv_cache.cuh's layouts, one head; v is not read: V is the first kHeadDimV
// columns of the same rows); out (batch, seqlen_q, heads_q, kHeadDimV). An e4m3 cache's descale
// (k_descale, per tensor or per sequence) scales the scores and the output; its rows are
// dequantized in registers by the f16 GEMMs of e4m3_gemms.cuh.
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "roles/kv_cache.cuh"
#include "mainloops/mla_mma_sync.cuh"
#include "roles/mask.cuh"
#include "roles/params.cuh"
#include "roles/softmax.cuh"

namespace ptxattn {

// Row h of an accumulator in E4m3Gemms' column order, times `factor`, into `dst` (the warp's
// first column of a float32 partial row, or of a 16-bit output row), one value at a time.
template <class Cfg, class Element>
__device__ __forceinline__ void store_permuted_row(Element* dst,
                                                   const float (&o)[Cfg::kOTiles][4], int h,
                                                   float factor, int lane) {
#pragma unroll
    for (int j = 0; j < Cfg::kOTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float value = o[j][2 * h + e] * factor;
            const int col = E4m3Gemms<Cfg>::output_column(j, 2 * (lane & 3) + e);
            if constexpr (sizeof(Element) == 4) {
                dst[col] = value;
            } else {
                dst[col] = static_cast<uint16_t>(pack_f32x2<Cfg::kBf16>(value, 0.0f) & 0xffff);
            }
        }
    }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
attn_fwd_mla(const __grid_constant__ FwdParams p) {
    using Mainloop = MmaSyncMainloop<Cfg>;
    using Mla = MlaMainloop<Cfg>;
    using Fp8Gemms = E4m3Gemms<Cfg>;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kStages = Cfg::kStages;
    constexpr int kRows = Cfg::kRows;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int split = blockIdx.x % p.num_splits;
    const int m_block = blockIdx.x / p.num_splits;
    const int batch = blockIdx.z;

    const SeqLens lens = SeqLens::of(p, batch);
    const int seqlen_k = lens.seqlen_k;
    const PackedRows packed{p.q_per_kv, 0};
    const int first_row = m_block * kRows;
    const int tile_rows = min(kRows, lens.seqlen_q * p.q_per_kv - first_row);
    if (tile_rows <= 0) return;

    // The key blocks the tile's tokens see, this split's share of them, and which need a mask.
    const SeqMask mask =
        SeqMask::make(lens.seqlen_q, seqlen_k, p.causal, p.window_left, p.window_right);
    const auto blocks = SplitKeyBlocks<kBlockN>::make(
        mask, packed.token(first_row), packed.token(first_row + tile_rows - 1), split,
        p.num_splits);
    const int n_begin = blocks.begin;
    const int n_blocks = blocks.count;

    float scale_log2 = p.scale_log2;
    float out_scale = 1.0f;
    if constexpr (Cfg::kKvFp8) {
        const float descale = p.k_descale[batch * p.k_descale_stride_b];
        scale_log2 *= descale;
        out_scale = descale;
    }

    const uint16_t* q_seq = static_cast<const uint16_t*>(p.q) + batch * p.q_stride_b +
                            lens.offset_q * p.q_stride_s;
    const KvRows kv = KvRows::of(p, batch, lens.offset_k);

    const uint32_t q_tile = smem_addr(smem);
    const uint32_t p_tile = q_tile + Cfg::kPTileOffset;
    float* exchange = reinterpret_cast<float*>(smem + Cfg::kExchangeOffset);
    const typename Cfg::Pages pages{reinterpret_cast<int*>(smem + Cfg::kPagesOffset)};
    const uint32_t ring = q_tile + Cfg::kRingOffset;
    // Ring stage `iter`'s rows (its pages staged) and the pages of stage iter + kStages - 1, in
    // one commit group.
    const auto load_stage = [&](int iter) {
        const int key0 = (n_begin + iter) * kBlockN;
        if (iter < n_blocks) {
            const uint32_t stage = ring + (iter % kStages) * Cfg::kStageBytes;
            if constexpr (Cfg::kKvFp8) {
                Mla::load_kv(stage, p, kv, pages.slot(iter), static_cast<const uint8_t*>(p.k),
                             key0, seqlen_k, warp, lane);
            } else {
                Mla::load_kv(stage, p, kv, pages.slot(iter), static_cast<const uint16_t*>(p.k),
                             key0, seqlen_k, warp, lane);
            }
        }
        if (iter + kStages - 1 < n_blocks) {
            pages.prefetch(kv, iter + kStages - 1, key0 + (kStages - 1) * kBlockN, seqlen_k, tid);
        }
        cp_async_commit();
    };
    Mla::load_q(q_tile, tile_rows, [&](int r) {
        const int row = first_row + r;
        return q_seq + packed.token(row) * p.q_stride_s + packed.head(row) * p.q_stride_h;
    }, tid);
    pages.prefetch_prologue(kv, n_begin, n_blocks, seqlen_k, tid);
#pragma unroll
    for (int iter = 0; iter < kStages - 1; ++iter) load_stage(iter);

    float q_row_scale[Cfg::kMTiles][2];  // e4m3 caches, bf16 queries (e4m3_gemms.cuh)
    if constexpr (Cfg::kKvFp8) {
        Fp8Gemms::template ready_q<kStages>(q_row_scale, smem,
                                            reinterpret_cast<float*>(smem + Cfg::kRowScaleOffset),
                                            warp, lane);
    }

    const auto q_lane = Mainloop::a_frag_lane(lane);
    const auto k_lane = Mainloop::k_frag_lane(lane);
    const auto v_lane = Mainloop::a_frag_lane(lane);
    const auto p_lane = Mla::PTile::rows_then_chunks(lane);
    const int warp_key0 = warp * Cfg::kWarpKeys;
    const uint32_t warp_v_cols = warp * Cfg::kWarpCols * 2;  // bytes into a row

    float o[Cfg::kMTiles][Cfg::kOTiles][4];
    zero_fill(o);
    OnlineSoftmax<Cfg::kMTiles> softmax;
    softmax.init();

#pragma unroll 1
    for (int iter = 0; iter < n_blocks; ++iter) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // the stage has landed; every warp is done with iter - 1's tiles
        load_stage(iter + kStages - 1);
        const uint32_t kv_tile = ring + (iter % kStages) * Cfg::kStageBytes;
        const int n_block = n_begin + iter;

        float s[Cfg::kMTiles][Cfg::kSTiles][4];
        if constexpr (Cfg::kKvFp8) {
            Fp8Gemms::gemm_qk(s, q_tile, kv_tile + warp_key0 * Cfg::kFp8RowBytes, lane);
            Fp8Gemms::unscale_scores(s, q_row_scale);
        } else {
            Mainloop::gemm_qk(s, q_tile, kv_tile + warp_key0 * Cfg::kRowBytes, 0, q_lane, k_lane);
        }
        if (n_block >= blocks.right_masked) {
            apply_mask<16>(s, mask, first_row + (lane >> 2),
                           n_block * kBlockN + warp_key0 + 2 * (lane & 3), AccumulatorColumns{},
                           p.q_per_kv);
        }
        Mla::share_row_max(exchange, s, warp, lane);
        __syncthreads();  // every warp's maxima are in
        float block_max[Cfg::kMTiles][2];
        Mla::combine_rows(block_max, exchange, lane, Max{});
        float rescale[Cfg::kMTiles][2];
        if (softmax.update_with_max(s, scale_log2, block_max, rescale)) scale_rows(o, rescale);
        Mla::store_probabilities(p_tile, s, warp, lane);
        __syncthreads();  // the P tile is whole (and every warp has read the maxima)

        uint32_t pa[Cfg::kMTiles][Cfg::kPSteps][4];
        Mla::load_probabilities(pa, p_tile, p_lane);
        if constexpr (Cfg::kKvFp8) {
            Fp8Gemms::gemm_pv(o, pa, kv_tile, warp * Cfg::kWarpCols / 16, lane);
        } else {
            Mainloop::gemm_pv(o, pa, kv_tile + warp_v_cols, v_lane);
        }
    }
    cp_async_wait<0>();

    // The rows' sums over the warps' keys (the last barrier above has every warp past its reads
    // of the maxima), then each warp's columns out.
#pragma unroll
    for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = quad_sum(softmax.row_sum[m][h]);
            if ((lane & 3) == 0) exchange[warp * kRows + 16 * m + (lane >> 2) + 8 * h] = sum;
        }
    }
    __syncthreads();
    float total[Cfg::kMTiles][2];
    Mla::combine_rows(total, exchange, lane, Sum{});

    constexpr float kLn2 = 0.693147180559945309f;
    const bool partial = p.num_splits > 1;
    const int global_token0 = batch * p.seqlen_q + lens.offset_q;
#pragma unroll
    for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * m + (lane >> 2) + 8 * h;
            if (r >= tile_rows) continue;
            const int token = packed.token(first_row + r);
            const int head = packed.head(first_row + r);
            const bool seen = total[m][h] > 0.0f;
            const float factor = seen ? out_scale / total[m][h] : 0.0f;
            const float lse = seen ? (softmax.row_max[m][h] + log2f(total[m][h])) * kLn2
                                   : -__int_as_float(0x7f800000);
            if (partial) {
                float* dst = partial_out_row(p, split, global_token0 + token, head,
                                             Cfg::kHeadDimV) + warp * Cfg::kWarpCols;
                if constexpr (Cfg::kKvFp8) {
                    store_permuted_row<Cfg>(dst, o[m], h, factor, lane);
                } else {
                    store_accumulator_row_f32(dst, o[m], h, factor, lane, Cfg::kWarpCols);
                }
                if (warp == 0 && (lane & 3) == 0) {
                    partial_lse(p, split, global_token0 + token, head) = lse;
                }
                continue;
            }
            uint16_t* dst = out_row(p, batch, head, lens.offset_q + token) + warp * Cfg::kWarpCols;
            if constexpr (Cfg::kKvFp8) {
                store_permuted_row<Cfg>(dst, o[m], h, factor, lane);
            } else {
                store_accumulator_row<Cfg::kBf16>(dst, o[m], h, factor, lane, Cfg::kWarpCols);
            }
            if (warp == 0 && (lane & 3) == 0) {
                write_lse(p, batch, head, lens.offset_q + token, lse);
            }
        }
    }
}

}  // namespace ptxattn
