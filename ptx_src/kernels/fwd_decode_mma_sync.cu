// Attention over a KV cache on mma.sync tensor cores (sm_80+): decoding, speculative decoding
// and chunked prefill, with split-KV.
//
// A block is (a tile of GQA-packed query rows, kv head, sequence) and one split of the key blocks
// those rows see: the query heads of a kv head share the tile (kv_cache.cuh), so K and V are read
// once for all of them, and when (tiles x kv heads x sequences) cannot fill the GPU the keys are
// split over num_splits blocks (the launcher, ptxattn/launchers/portable_decode.py, picks the
// count). The keys come from a contiguous or paged cache, up to the sequence's filled length
// (seqused_k), masked bottom-right causal and by a window (mask.cuh), after an optional softcap.
// The warps split each stage's keys and merge their softmax states at the end
// (mainloops/decode_mma_sync.cuh). With one split the block writes the normalised output (and LSE,
// sinks folded in); with several it writes its partial state in float32 for combine.cu.
//
// Every runtime argument is in FwdParams (params.cuh): q (batch, seqlen_q, heads_q, D), or
// (total_q, heads_q, D) with cu_seqlens_q; k and v caches per kv_cache.cuh; out like q. An e4m3
// cache (Cfg::kKvFp8) is dequantized in registers (decode_mma_sync.cuh) and its descales,
// one per (sequence, kv head) through k_descale's and v_descale's strides (0 for one per
// tensor), scale the scores (before the softcap) and the output.
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "roles/kv_cache.cuh"
#include "mainloops/decode_mma_sync.cuh"
#include "roles/mask.cuh"
#include "roles/params.cuh"
#include "roles/softmax.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
attn_fwd_decode(const __grid_constant__ FwdParams p) {
    using Mainloop = MmaSyncMainloop<Cfg>;
    using Loader = DecodeMainloop<Cfg>;
    using Fp8Gemms = E4m3Gemms<Cfg>;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kStages = Cfg::kStages;
    constexpr int kRows = Cfg::kRows;
    constexpr int kHeadDim = Cfg::kHeadDim;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int split = blockIdx.x % p.num_splits;
    const int m_block = blockIdx.x / p.num_splits;
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;

    const SeqLens lens = SeqLens::of(p, batch);
    const int seqlen_k = lens.seqlen_k;
    const PackedRows packed{p.q_per_kv, kv_head * p.q_per_kv};
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

    const uint16_t* q_seq = static_cast<const uint16_t*>(p.q) + batch * p.q_stride_b +
                            lens.offset_q * p.q_stride_s;
    const uint16_t* k_head = static_cast<const uint16_t*>(p.k) + kv_head * p.k_stride_h;
    const uint16_t* v_head = static_cast<const uint16_t*>(p.v) + kv_head * p.v_stride_h;
    const uint8_t* k_head_e4m3 = static_cast<const uint8_t*>(p.k) + kv_head * p.k_stride_h;
    const uint8_t* v_head_e4m3 = static_cast<const uint8_t*>(p.v) + kv_head * p.v_stride_h;
    // An e4m3 cache's descales: k's folded into the scores' scale (before the softcap), v's
    // into the output. The 16-bit builds read FwdParams' scales where they use them (copies
    // held from here on changed their code on sm_120a).
    float e4m3_scale_log2 = p.scale_log2;
    float e4m3_softcap_scale = p.softcap_scale;
    float v_descale = 1.0f;
    if constexpr (Cfg::kKvFp8) {
        const float k_descale =
            p.k_descale[batch * p.k_descale_stride_b + kv_head * p.k_descale_stride_h];
        if (e4m3_softcap_scale != 0.0f) {
            e4m3_softcap_scale *= k_descale;
        } else {
            e4m3_scale_log2 *= k_descale;
        }
        v_descale = p.v_descale[batch * p.v_descale_stride_b + kv_head * p.v_descale_stride_h];
    }
    const KvRows kv = KvRows::of(p, batch, lens.offset_k);

    const uint32_t q_tile = smem_addr(smem);
    const uint32_t ring = q_tile + Cfg::kQTileBytes;
    const typename Cfg::Pages pages{reinterpret_cast<int*>(smem + Cfg::kPagesOffset)};
    // Ring stage `iter`'s K and V (all of its pages staged) and the pages of stage
    // iter + kStages - 1, in one commit group.
    const auto load_stage = [&](int iter) {
        const int key0 = (n_begin + iter) * kBlockN;
        if (iter < n_blocks) {
            if constexpr (Cfg::kKvFp8) {
                Loader::load_kv_e4m3(Cfg::stage(ring, iter), p, kv, pages.slot(iter),
                                     k_head_e4m3, v_head_e4m3, key0, seqlen_k, tid);
            } else {
                Loader::load_kv(Cfg::stage(ring, iter), p, kv, pages.slot(iter), k_head, v_head,
                                key0, seqlen_k, tid);
            }
        }
        if (iter + kStages - 1 < n_blocks) {
            pages.prefetch(kv, iter + kStages - 1, key0 + (kStages - 1) * kBlockN, seqlen_k, tid);
        }
        cp_async_commit();
    };
    Loader::load_q(q_tile, tile_rows, p.head_dim, [&](int r) {
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
    const int warp_key0 = warp * Cfg::kWarpKeys;

    float o[Cfg::kMTiles][Cfg::kOTiles][4];
    zero_fill(o);
    OnlineSoftmax<Cfg::kMTiles> softmax;
    softmax.init();

#pragma unroll 1
    for (int iter = 0; iter < n_blocks; ++iter) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // the stage has landed and every warp is done with iter - 1
        load_stage(iter + kStages - 1);

        // this warp's keys of the stage
        const int n_block = n_begin + iter;
        float s[Cfg::kMTiles][Cfg::kSTiles][4];
        const uint32_t k_tile =
            Cfg::stage(ring, iter) + warp_key0 * (Cfg::kKvFp8 ? Cfg::kHeadDim : Cfg::kRowBytes);
        if constexpr (Cfg::kKvFp8) {
            Fp8Gemms::gemm_qk(s, q_tile, k_tile, lane);
            Fp8Gemms::unscale_scores(s, q_row_scale);
        } else {
            Mainloop::gemm_qk(s, q_tile, k_tile, 0, q_lane, k_lane);
        }
        const float softcap_scale = Cfg::kKvFp8 ? e4m3_softcap_scale : p.softcap_scale;
        if (softcap_scale != 0.0f) apply_softcap(s, softcap_scale);
        if (n_block >= blocks.right_masked || n_block < blocks.left_unmasked) {
            apply_mask<16>(s, mask, first_row + (lane >> 2),
                           n_block * kBlockN + warp_key0 + 2 * (lane & 3), AccumulatorColumns{},
                           p.q_per_kv);
        }
        float rescale[Cfg::kMTiles][2];
        const float scale_log2 = Cfg::kKvFp8 ? e4m3_scale_log2 : p.scale_log2;
        if (softmax.update(s, scale_log2, rescale)) scale_rows(o, rescale);
        uint32_t pa[Cfg::kMTiles][Cfg::kPSteps][4];
        if constexpr (Cfg::kKvFp8) {
            Fp8Gemms::pack_probabilities(pa, s);
        } else {
            Mainloop::pack_probabilities(pa, s);
        }
        if constexpr (Cfg::kKvFp8) {
            Fp8Gemms::gemm_pv(o, pa, k_tile + Cfg::kFp8TileBytes, 0, lane);
        } else {
            Mainloop::gemm_pv(o, pa, k_tile + Cfg::kKVTileBytes, v_lane);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring and Q are free for the merge

    float* row_lse = reinterpret_cast<float*>(smem);
    const float* merged = merge_warps<Cfg>(o, softmax, smem + Cfg::kQTileBytes, row_lse, warp, lane);

    // Rows out: 8 columns a thread at a time, head_dim_v of them (partial rows too: combine.cu
    // reads no more).
    const bool partial = p.num_splits > 1;
    const int global_token0 = (p.cu_seqlens_q != nullptr ? 0 : batch * p.seqlen_q) + lens.offset_q;
    constexpr int kChunks = kHeadDim / 8;
    for (int i = tid; i < tile_rows * kChunks; i += Cfg::kThreads) {
        const int r = i / kChunks;
        const int col = 8 * (i % kChunks);
        if (col >= p.head_dim_v) continue;
        const int row = first_row + r;
        const int token = packed.token(row);
        const int head = packed.head(row);
        float4 lo = *reinterpret_cast<const float4*>(merged + r * kHeadDim + col);
        float4 hi = *reinterpret_cast<const float4*>(merged + r * kHeadDim + col + 4);
        if constexpr (Cfg::kKvFp8) {
            lo = make_float4(lo.x * v_descale, lo.y * v_descale, lo.z * v_descale,
                             lo.w * v_descale);
            hi = make_float4(hi.x * v_descale, hi.y * v_descale, hi.z * v_descale,
                             hi.w * v_descale);
        }
        float lse = row_lse[r];
        if (partial) {
            float* dst = partial_out_row(p, split, global_token0 + token, head, kHeadDim) + col;
            *reinterpret_cast<float4*>(dst) = lo;
            *reinterpret_cast<float4*>(dst + 4) = hi;
            if (col == 0) partial_lse(p, split, global_token0 + token, head) = lse;
            continue;
        }
        float factor = 1.0f;
        fold_sink(lse, factor, p.sinks != nullptr ? p.sinks[head] : -__int_as_float(0x7f800000));
        uint4 packed_out;
        packed_out.x = pack_f32x2<Cfg::kBf16>(lo.x * factor, lo.y * factor);
        packed_out.y = pack_f32x2<Cfg::kBf16>(lo.z * factor, lo.w * factor);
        packed_out.z = pack_f32x2<Cfg::kBf16>(hi.x * factor, hi.y * factor);
        packed_out.w = pack_f32x2<Cfg::kBf16>(hi.z * factor, hi.w * factor);
        uint16_t* dst = static_cast<uint16_t*>(p.out) + batch * p.out_stride_b +
                        (lens.offset_q + token) * p.out_stride_s + head * p.out_stride_h + col;
        *reinterpret_cast<uint4*>(dst) = packed_out;
        if (col == 0) {
            p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + lens.offset_q + token] = lse;
        }
    }
}

}  // namespace ptxattn
