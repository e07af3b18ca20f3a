// Mainloop of the Hopper (sm_90a) forward: the producer's TMA loads, FP8's V transpose, and the
// consumer warpgroups' GEMMs and softmax over the key blocks of one tile.
//
// Producer (one thread of warpgroup 0): per tile Q, then K of the first key block, then per
// block the K of the next block before the V of this one, since consumers need K(j+1) (for S)
// before V(j) (for P V); the K and V rings (pipeline.cuh) run on across tiles.
// Consumers (warpgroups 1..): each owns 64 query rows. S = Q K^T is a wgmma with K in shared
// memory and Q there too, or (kQInRegisters) in registers; P = softmax(S) stays in registers and
// O += P V is a wgmma with A from registers and V from shared memory (16-bit: read transposed,
// MN-major; FP8: the transposed copy Vt). Within a warpgroup the GEMMs of key block j+1 (Q K^T)
// and of block j (P V) are issued together and the softmax of block j+1 runs while P V is in
// flight (FlashAttention-3's intra-warpgroup overlap); softmax.cuh asks for O to be rescaled
// only when a row max grew enough to matter. Without that overlap (kIntraOverlap false, a
// schedule the tuner may pick) each block runs Q K^T, the softmax and P V in turn, and P lives
// only from the softmax to its P V, in registers S has given up. The consumer warpgroups run
// free of each other, so one's softmax overlaps the others' GEMMs (ordering them strictly, as
// FlashAttention-3 does with named barriers, cost 2-12% on an H100;
// docs/design/pipelines.md#consumers-run-free).
// Key blocks are visited from the last to the first (block_info.cuh), so the masked blocks come
// first and the rest run mask-free.
//
// FP8 (kFp8): both GEMMs are e4m3 wgmmas (k-steps of 32) with FP32 accumulation. FP8 wgmma
// reads B only K-major, so the producer warpgroup's three idle warps transpose each landed V
// tile [keys x d] into Vt [d x keys] (transpose_e4m3.cuh) through one more ring. The FP8 wgmma
// keeps about 14 bits of its accumulator (and truncates), so each 128-column slab of head_dim
// accumulates S into its own registers and the slabs are summed in FP32 ("promotion").
// Descales are applied in FP32: q's and k's fold into the softmax's score scale, v's into the
// epilogue's normalisation.
#pragma once
#include "roles/block_info.cuh"
#include "roles/epilogue.cuh"
#include "ptx/common.cuh"
#include "roles/mask.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"
#include "roles/pipeline.cuh"
#include "roles/softmax.cuh"
#include "roles/tile_scheduler.cuh"
#include "ptx/tma.cuh"
#include "roles/transpose_e4m3.cuh"
#include "ptx/warpgroup.cuh"
#include "ptx/wgmma.cuh"
#include "ptx/wgmma_fp8.cuh"

namespace ptxattn {

// The compile-time shape of a Hopper forward kernel and everything derived from it.
//   kHeadDim 64/128/192/256 (q and k), kHeadDimV (v and out: kHeadDim, or narrower in
//   16-bit builds, e.g. 192/128); kBlockN keys per K/V tile (multiple of 16, FP8 of 32); kStages ring
//   depth; kFp8 e4m3 inputs; kBf16 the 16-bit type (of the inputs, or of FP8's output);
//   kCausal; kConsumers consumer warpgroups (2 or 3); kOutRoundCols the output's columns a
//   consumer stages in shared memory at a time for TMA stores (kStagedOut; 0: stored from
//   registers); kStaleMaxFirst the softmax's no-max-pass fast path (Sm90Mainloop::step);
//   kQInRegisters (FP8) Q K^T takes Q from registers; kServing the serving build (below);
//   ProducerRegs (FP8) the registers the producer warpgroup keeps, 0 for the split below;
//   kIntraOverlap the softmax of key block j + 1 runs while P V of block j is in flight;
//   kSmemBytes the dynamic shared memory the launcher requests (checked against the layout).
//
// The serving build (16-bit only) takes each sequence's lengths and offsets from the serving
// fields of FwdParams (SeqLens::of: cu_seqlens_q/k for packed varlen batches, seqused_k for a
// KV cache's filled lengths) and the window: its tiles skip the key blocks outside the window and
// mask those on its left edge, tiles past a sequence's end are skipped, V rows past the last key
// are zeroed before P V reads them (a cache's unfilled rows may hold NaN, and 0 * NaN is NaN),
// and a warpgroup whose 64 rows run past a packed sequence's end stores from registers, since a
// TMA store would overwrite the next sequence's rows. It takes the logit softcap as a run-time
// field too (Consumer::finish_qk). Fixed-length builds compile none of it.
template <int HeadDim, int HeadDimV, int BlockN, int Stages, bool Fp8, bool Bf16, bool Causal,
          int Consumers, int OutRoundCols, bool StaleMaxFirst, bool QInRegisters, bool Serving,
          int ProducerRegs, bool IntraOverlap, int SmemBytes>
struct Sm90Config {
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kHeadDimV = HeadDimV;
    static constexpr int kBlockN = BlockN;
    static constexpr int kStages = Stages;
    static constexpr bool kFp8 = Fp8;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kCausal = Causal;
    static constexpr int kConsumers = Consumers;
    static constexpr int kOutRoundCols = OutRoundCols;
    static constexpr bool kStagedOut = OutRoundCols > 0;
    static constexpr bool kStaleMaxFirst = StaleMaxFirst;
    static constexpr bool kQInRegisters = QInRegisters;
    static constexpr bool kServing = Serving;
    static constexpr bool kIntraOverlap = IntraOverlap;
    static constexpr uint32_t kSmemBytes = SmemBytes;

    static constexpr int kRowsPerConsumer = 64;  // one wgmma M
    static constexpr int kBlockM = kConsumers * kRowsPerConsumer;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    static constexpr int kConsumerWarps = 4 * kConsumers;
    static constexpr int kTransposeWarps = 3;  // FP8: the producer warpgroup's other warps

    // Tiles in shared memory: rows of head_dim in slabs of one swizzle span (128 bytes, or FP8
    // head_dim 64's whole 64-byte row), one TMA box each.
    static constexpr int kElemBytes = kFp8 ? 1 : 2;
    static constexpr uint32_t kRowBytes = kHeadDim * kElemBytes;
    static constexpr uint32_t kSlabRowBytes = kRowBytes < 128 ? kRowBytes : 128;
    static constexpr int kSlabs = kRowBytes / kSlabRowBytes;
    static constexpr int kSlabCols = kSlabRowBytes / kElemBytes;
    static constexpr uint32_t kQSlabBytes = kBlockM * kSlabRowBytes;
    static constexpr uint32_t kQBytes = kQSlabBytes * kSlabs;
    static constexpr uint32_t kKVSlabBytes = kBlockN * kSlabRowBytes;
    static constexpr uint32_t kKVBytes = kKVSlabBytes * kSlabs;  // a K tile
    static constexpr int kVSlabs = kHeadDimV * kElemBytes / kSlabRowBytes;
    static constexpr uint32_t kVBytes = kKVSlabBytes * kVSlabs;  // a V tile
    // FP8 Vt: head_dim rows of keys, in regions of one swizzle span of keys.
    static constexpr uint32_t kVtRowBytes = kBlockN < 128 ? kBlockN : 128;
    static constexpr uint32_t kVtRegionBytes = kHeadDim * kVtRowBytes;
    static constexpr uint32_t kVtBytes = kFp8 ? kVtRegionBytes * ((kBlockN + 127) / 128) : 0;
    static constexpr uint32_t kSwizzleAtomBytes = 1024;
    static constexpr int kScaleBlockRows = 128;  // rows sharing one FP8 "block" descale

    // S accumulators: one, or with FP8 one per slab of head_dim, summed once complete.
    static constexpr int kScoreAccs = kFp8 ? kSlabs : 1;
    // P as A fragments (b32 per thread).
    static constexpr int kPRegs = kFp8 ? kBlockN / 8 : kBlockN / 4;
    // Launched at 65536 / kThreads registers per thread (rounded down to 8: 168 with two
    // consumer warpgroups, 128 with three); the producer keeps 24, or with FP8, where three of
    // its warps transpose V, 56, or 40 when the consumers' S, O, P (and Q) fragments alone take
    // 200 registers or more, unless the schedule says (ProducerRegs; the tuner searches it, and
    // below 32 the transposer spills). The consumers share what the producer gives up.
    static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
    static constexpr int kQRegs = kQInRegisters ? kHeadDim / 8 : 0;
    static constexpr int kFragmentRegs =
        kScoreAccs * kBlockN / 2 + kHeadDimV / 2 + kPRegs + kQRegs;
    static constexpr int kProducerRegs =
        ProducerRegs > 0 ? ProducerRegs : !kFp8 ? 24 : kFragmentRegs >= 200 ? 40 : 56;
    static constexpr int kConsumerRegs =
        ((1 + kConsumers) * kLaunchRegs - kProducerRegs) / kConsumers / 8 * 8;

    static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
    static_assert(!kQInRegisters || kFp8, "Q in registers: FP8 builds only (its A fragment layout)");
    static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head_dim: whole swizzle spans, <= 256");
    static_assert(kHeadDimV % 64 == 0 && kHeadDimV <= kHeadDim && (!kFp8 || kHeadDimV == kHeadDim),
                  "head_dim_v: whole swizzle spans, at most head_dim; FP8: head_dim");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN: a multiple of 16, <= 256");
    static_assert(kKVSlabBytes % kSwizzleAtomBytes == 0, "tiles must stay 1024-byte aligned");
    static_assert(!kFp8 || (kBlockN % 32 == 0 && (kBlockN >= 128 || kBlockN == 64)),
                  "FP8: k-steps of 32 keys; Vt rows of 64 or 128 keys (one swizzle span)");
    static_assert(kScoreAccs <= 2, "the registers of one extra S accumulator at most");
    static_assert(ProducerRegs == 0 || (kFp8 && ProducerRegs % 8 == 0 && ProducerRegs >= 24 &&
                                        ProducerRegs <= kLaunchRegs),
                  "a producer register count of its own: FP8, a multiple of 8 in [24, launch]");
    static_assert(!kServing || !kFp8, "the serving build takes 16-bit inputs");
    static_assert(kIntraOverlap || (!kServing && !kStaleMaxFirst),
                  "blocks in turn: fixed-length builds with the max pass only");
};

// A tile as the producer resolved it for the consumers (tile_scheduler.cuh's mailbox): its
// coordinates, its sequence's lengths and offsets (fixed-length builds: the call's), and the key
// blocks [n_begin, n_end) it visits (Sm90Mainloop::key_blocks).
struct TileWork {
    int tile;
    TileCoord c;
    SeqLens lens;
    int n_begin;
    int n_end;
};

// The barriers of the Q slot, the K and V rings and the tile mailbox. FP8's Vt ring is a
// separate Pipeline, so 16-bit builds spend no shared memory on it.
template <int kStages>
struct Sm90Barriers {
    MBarrier q_full;
    MBarrier q_empty;
    Pipeline<kStages> k;
    Pipeline<kStages> v;
    TileMailbox<TileWork> tiles;
    // FP8: the number of V tiles the producer loaded in all, set before its closing arrive on
    // the v full barrier of the next ring position, which carries no tile: the V transposers
    // stop at that position (they follow the V ring alone). Comparing positions, not testing a
    // flag, keeps a transposer still short of the last tile from stopping early. A transposer
    // reads it while the producer may write it, so both access it atomically.
    int v_end;
};

template <class Cfg>
struct Sm90Mainloop {
    static constexpr int kHeadDim = Cfg::kHeadDim;
    static constexpr int kHeadDimV = Cfg::kHeadDimV;
    static constexpr int kBlockN = Cfg::kBlockN;
    static constexpr int kBlockM = Cfg::kBlockM;
    static constexpr int kStages = Cfg::kStages;
    static constexpr bool kFp8 = Cfg::kFp8;
    static constexpr bool kBf16 = Cfg::kBf16;
    static constexpr bool kCausal = Cfg::kCausal;
    static constexpr bool kQInRegisters = Cfg::kQInRegisters;
    static constexpr bool kServing = Cfg::kServing;
    static constexpr int kRowsPerConsumer = Cfg::kRowsPerConsumer;
    static constexpr int kSlabs = Cfg::kSlabs;
    static constexpr int kSlabCols = Cfg::kSlabCols;
    static constexpr uint32_t kSlabRowBytes = Cfg::kSlabRowBytes;
    static constexpr uint32_t kQSlabBytes = Cfg::kQSlabBytes;
    static constexpr uint32_t kQBytes = Cfg::kQBytes;
    static constexpr uint32_t kKVSlabBytes = Cfg::kKVSlabBytes;
    static constexpr uint32_t kKVBytes = Cfg::kKVBytes;
    static constexpr int kVSlabs = Cfg::kVSlabs;
    static constexpr uint32_t kVBytes = Cfg::kVBytes;
    static constexpr uint32_t kVtRowBytes = Cfg::kVtRowBytes;
    static constexpr uint32_t kVtRegionBytes = Cfg::kVtRegionBytes;
    static constexpr uint32_t kVtBytes = Cfg::kVtBytes;
    static constexpr int kScoreAccs = Cfg::kScoreAccs;
    static constexpr int kPRegs = Cfg::kPRegs;
    static constexpr int kQRegs = Cfg::kQRegs;

    using Barriers = Sm90Barriers<kStages>;
    using Ring = PipelineState<kStages>;
    using Info = BlockInfo<kBlockM, kBlockN>;

    // Shared memory: [Q | K stage 0..S-1 | V stage 0..S-1 | (FP8) Vt stage 0..S-1 | (staged
    // output) one tile per consumer | barriers | (FP8) Vt barriers], from a 1024-byte aligned
    // base (the swizzle atom), which may cost up to 1024 bytes of the allocation.
    static constexpr uint32_t kKOffset = kQBytes;
    static constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
    static constexpr uint32_t kVtOffset = kVOffset + kStages * kVBytes;
    using Output =
        StagedTmaStore<kHeadDimV, kBf16, Cfg::kStagedOut ? Cfg::kOutRoundCols : kHeadDimV>;
    static constexpr uint32_t kOutBytes = Output::kBytes;
    static constexpr uint32_t kOutOffset = kVtOffset + kStages * kVtBytes;
    static constexpr uint32_t kBarrierOffset =
        kOutOffset + (Cfg::kStagedOut ? Cfg::kConsumers * kOutBytes : 0);
    static constexpr uint32_t kVtBarrierOffset = kBarrierOffset + sizeof(Barriers);
    static_assert(kVtBarrierOffset + (kFp8 ? sizeof(Pipeline<kStages>) : 0) +
                          Cfg::kSwizzleAtomBytes <= Cfg::kSmemBytes,
                  "kSmemBytes too small for this tile configuration");

    // The lengths of the tile's sequence: the call's, or in serving builds the sequence's own.
    static __device__ __forceinline__ SeqLens seq_lens(const FwdParams& p, int batch) {
        if constexpr (kServing) {
            return SeqLens::of(p, batch);
        } else {
            return {p.seqlen_q, p.seqlen_k, 0, 0};
        }
    }

    static __device__ __forceinline__ Info block_info(const FwdParams& p, const SeqLens& lens) {
        if constexpr (kServing) {
            return Info(lens.seqlen_q, lens.seqlen_k, kCausal, p.window_left, p.window_right);
        } else {
            return Info(p.seqlen_q, p.seqlen_k, kCausal);
        }
    }

    // Split-KV (serving builds): tile numbers count (query block, head x split, batch) tiles,
    // TileOrder's heads being heads_q * num_splits, split the minor part.
    static __device__ __forceinline__ int splits(const FwdParams& p) {
        return kServing ? p.num_splits : 1;
    }
    static __device__ __forceinline__ TileCoord tile_coord(const FwdParams& p,
                                                           const TileOrder& order, int tile) {
        TileCoord c = order.decode(tile);
        if constexpr (kServing) {
            c.split = c.head % p.num_splits;
            c.head /= p.num_splits;
        }
        return c;
    }

    // The key blocks [n_begin, n_end) the tile visits (n_begin == n_end: none, as for a serving
    // tile past its sequence's end, or a split left without blocks). Split s of S takes the s-th
    // of S runs of ceil(blocks / S) blocks.
    static __device__ __forceinline__ int2 key_blocks(const FwdParams& p, const Info& info,
                                                      const SeqLens& lens, const TileCoord& c) {
        const int m_block = c.m_block;
        if constexpr (kServing) {
            if (m_block * kBlockM >= lens.seqlen_q) return {0, 0};
            const int n_end = info.n_max(m_block);
            const int n_begin = min(info.n_min(m_block), n_end);
            const int per_split = ceil_div(n_end - n_begin, p.num_splits);
            const int lo = min(n_end, n_begin + c.split * per_split);
            return {lo, min(n_end, lo + per_split)};
        } else {
            return {0, info.n_max(m_block)};
        }
    }

    // The batch coordinate of the tensor maps: packed varlen arrays are one batch of all rows.
    static __device__ __forceinline__ int q_batch(const FwdParams& p, int batch) {
        return kServing && p.cu_seqlens_q != nullptr ? 0 : batch;
    }
    static __device__ __forceinline__ int kv_batch(const FwdParams& p, int batch) {
        return kServing && p.cu_seqlens_k != nullptr ? 0 : batch;
    }

    // ---- Producer ---------------------------------------------------------------------------

    // A K tile (kTileSlabs = kSlabs) or a V tile (kVSlabs).
    template <int kTileSlabs>
    static __device__ __forceinline__ void load_kv_tile(uint8_t* tile, const TensorMap* map,
                                                        MBarrier& full, int kv_head, int row,
                                                        int batch) {
        full.arrive_expect_tx(kKVSlabBytes * kTileSlabs);
#pragma unroll
        for (int j = 0; j < kTileSlabs; ++j) {
            tma_load_4d(tile + j * kKVSlabBytes, map, full, kSlabCols * j, kv_head, row, batch);
        }
    }

    // The producer thread: every tile of `tiles`, in order, each resolved for the consumers.
    template <class Tiles>
    static __device__ __forceinline__ void load(const FwdParams& p, uint8_t* smem, Barriers& bars,
                                                const TileOrder& order, Tiles& tiles) {
        tma_prefetch(&p.q_map);
        tma_prefetch(&p.k_map);
        tma_prefetch(&p.v_map);
        // Fixed-length builds: every tile's, made once.
        const Info call_info = block_info(p, seq_lens(p, 0));
        const auto resolve = [&](int tile) {
            TileWork w;
            w.c = tile_coord(p, order, tile);
            w.lens = seq_lens(p, w.c.batch);
            const int2 n_range =
                key_blocks(p, kServing ? block_info(p, w.lens) : call_info, w.lens, w.c);
            w.n_begin = n_range.x;
            w.n_end = n_range.y;
            return w;
        };
        Ring k_ring;
        Ring v_ring;
        int q_loads = 0;
#pragma unroll 1
        for (TileWork w = tiles.next(order.num_tiles(), resolve); w.tile < order.num_tiles();
             w = tiles.next(order.num_tiles(), resolve)) {
            const TileCoord& c = w.c;
            const SeqLens& lens = w.lens;
            const int n_begin = w.n_begin;
            const int n_end = w.n_end;
            if (n_end == n_begin) continue;
            const int kv_head = c.head / p.q_per_kv;
            const int kv_b = kv_batch(p, c.batch);
            // The previous tile's Q is free once every consumer finished its last Q K^T.
            bars.q_empty.wait((q_loads & 1) ^ 1);
            bars.q_full.arrive_expect_tx(kQBytes);
#pragma unroll
            for (int j = 0; j < kSlabs; ++j) {
                tma_load_4d(smem + j * kQSlabBytes, &p.q_map, bars.q_full, kSlabCols * j, c.head,
                            lens.offset_q + c.m_block * kBlockM, q_batch(p, c.batch));
            }
            ++q_loads;
            bars.k.producer_acquire(k_ring);
            load_kv_tile<kSlabs>(smem + kKOffset + k_ring.stage() * kKVBytes, &p.k_map,
                                 bars.k.full_barrier(k_ring), kv_head,
                                 lens.offset_k + (n_end - 1) * kBlockN, kv_b);
            ++k_ring.count;
#pragma unroll 1
            for (int n_block = n_end - 1; n_block >= n_begin; --n_block) {
                if (n_block > n_begin) {
                    bars.k.producer_acquire(k_ring);
                    load_kv_tile<kSlabs>(smem + kKOffset + k_ring.stage() * kKVBytes,
                                         &p.k_map, bars.k.full_barrier(k_ring), kv_head,
                                         lens.offset_k + (n_block - 1) * kBlockN, kv_b);
                    ++k_ring.count;
                }
                bars.v.producer_acquire(v_ring);
                load_kv_tile<kVSlabs>(smem + kVOffset + v_ring.stage() * kVBytes, &p.v_map,
                                      bars.v.full_barrier(v_ring), kv_head,
                                      lens.offset_k + n_block * kBlockN, kv_b);
                ++v_ring.count;
            }
        }
        if constexpr (kFp8) {
            bars.v.producer_acquire(v_ring);
            atomicExch(&bars.v_end, static_cast<int>(v_ring.count));
            bars.v.full_barrier(v_ring).arrive();
        }
    }

    // FP8: warps 1-3 of the producer warpgroup transpose every V tile the producer loads into the
    // Vt ring (same slots and phases), in ring order up to the producer's closing arrive (v_end),
    // so they need no tile schedule. Each thread arrives on v empty / vt full itself, after its
    // fence.proxy.async, so the consumers' wgmmas (async proxy) see all of Vt and TMA may
    // overwrite V as soon as all reads are done. A template (kKeys = kBlockN) so that 16-bit
    // builds, which never call it, never instantiate the transposer.
    template <int kKeys>
    static __device__ __forceinline__ void transpose_v(uint8_t* smem, Barriers& bars,
                                                       Pipeline<kStages>& vt) {
        const TransposeE4m3<kKeys, kHeadDim, kSlabRowBytes, kVtRowBytes, Cfg::kTransposeWarps>
            transpose(threadIdx.x / 32 - 1, threadIdx.x % 32);
#pragma unroll 1
        for (Ring ring;; ++ring.count) {
            bars.v.consumer_wait(ring);
            int v_end = 0;
            if (threadIdx.x % 32 == 0) v_end = atomicAdd(&bars.v_end, 0);
            if (__shfl_sync(0xffffffffu, v_end, 0) == ring.count) return;
            vt.producer_acquire(ring);
            transpose(smem_addr(smem + kVOffset + ring.stage() * kVBytes),
                      smem_addr(smem + kVtOffset + ring.stage() * kVtBytes));
            fence_proxy_async();
            bars.v.consumer_release(ring);
            vt.full_barrier(ring).arrive();
        }
    }

    // ---- Consumer GEMMs -----------------------------------------------------------------------

    template <int N>
    static __device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t desc_a,
                                                  uint64_t desc_b, uint32_t accumulate) {
        if constexpr (kFp8) {
            WgmmaE4m3<N>::ss(d, desc_a, desc_b, accumulate);
        } else {
            Wgmma16<N>::template ss<kBf16>(d, desc_a, desc_b, accumulate);
        }
    }

    template <int N>
    static __device__ __forceinline__ void accumulator_to_p(uint32_t (&p)[kPRegs],
                                                            const float (&s)[N / 2]) {
        if constexpr (kFp8) {
            accumulator_to_e4m3_a<N>(p, s);
        } else {
#pragma unroll
            for (int j = 0; j < N / 4; ++j) p[j] = pack_f32x2<kBf16>(s[2 * j], s[2 * j + 1]);
        }
    }

    // O += P V over one key block. 16-bit: V as stored ([keys x d], MN-major, transposed by the
    // instruction; 64-column slabs kKVSlabBytes apart), k-steps of 16 keys. FP8: Vt ([d x keys],
    // K-major, regions of kVtRowBytes keys), k-steps of 32 keys.
    template <int N>
    static __device__ __forceinline__ void mma_pv(float (&o)[N / 2], const uint32_t (&p)[kPRegs],
                                                  uint32_t v_tile) {
        if constexpr (kFp8) {
            const uint64_t vt_desc = wgmma_desc_kmajor<kVtRowBytes>(v_tile);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 32; ++kk) {
                const uint32_t key = 32 * kk;
                WgmmaE4m3<N>::rs(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],
                                 wgmma_desc_advance(vt_desc, (key / kVtRowBytes) * kVtRegionBytes +
                                                                 key % kVtRowBytes),
                                 1);
            }
        } else {
            const uint64_t v_desc =
                wgmma_desc_sw128(v_tile, kKVSlabBytes, Cfg::kSwizzleAtomBytes);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                Wgmma16<N>::template rs<kBf16>(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2],
                                               p[4 * kk + 3],
                                               wgmma_desc_advance(v_desc, kk * 16 * kSlabRowBytes),
                                               1);
            }
        }
    }

    // ---- Consumer -----------------------------------------------------------------------------

    // Everything one consumer warpgroup needs to run its 64 rows through the key blocks.
    struct Consumer {
        using ScoreTiles = float[1][kBlockN / 8][4];
        using OutTiles = float[1][kHeadDimV / 8][4];

        uint8_t* smem;
        Barriers& bars;
        Pipeline<kStages>& vt;
        int wg;    // which consumer warpgroup
        int lane;
        float scale_log2;  // softmax_scale * log2(e), times q's descale with FP8
        int row0;  // query row of this thread's first accumulator row in the tile (second: + 8)
        // The tile, as the producer resolved it: its mailbox slot, held until the tile's end, so
        // that what the mainloop and epilogue read of it holds no registers in between.
        const TileWork* work = nullptr;
        // FP8: this tile's k descales (one per 128 keys, k_descale_step apart) and v descale.
        const float* k_descale = nullptr;
        int64_t k_descale_step = 0;
        float v_descale = 1.0f;

        float o[kHeadDimV / 2];
        uint32_t q[kQInRegisters ? kQRegs : 1];  // kQInRegisters: this tile's Q as A fragments
        uint32_t p[kPRegs];  // P of the block whose P V is pending, as A fragments
        // FP8 keeps the exact running max. With a stale one (softmax.cuh lets a row's max grow by
        // 2^8 before its reference moves), a row's dominant probability is 2^d for a fractional d,
        // which e4m3 rounds by up to 6%, while the row sum adds the unrounded value (3x the naive
        // FP8 error on rows one key dominates; docs/design/softmax.md#exact-running-max). With the
        // exact max it is 1, which e4m3 holds exactly.
        OnlineSoftmax<1, kFp8 ? 0 : 8> softmax;
        Ring ring;
        int q_loads = 0;

        // Named barriers (0 is __syncthreads): per consumer warpgroup, the vote on whether a key
        // block keeps the row maxima (kStaleMaxFirst); the epilogue's come after these.
        static constexpr uint32_t kVoteBarrier = 1;

        __device__ __forceinline__ uint32_t q_addr() const {
            return smem_addr(smem) + wg * kRowsPerConsumer * kSlabRowBytes;
        }

        __device__ __forceinline__ void release(MBarrier& bar) const {
            if (lane == 0) bar.arrive();
        }

        // The tile's per-row and per-head values: the FP8 descales and the thread's first row.
        // Descales are read with __ldg (ld.global.nc): a plain ld.global may not move across the
        // barrier and wgmma-wait asm, and pinned there it moved the P V wait ahead of the
        // softmax, costing FP8 head_dim 128 up to 10% (docs/design/pipelines.md#the-p-v-wait).
        __device__ __forceinline__ void start_tile(const FwdParams& p, const TileWork& tile,
                                                   int row_in_tile) {
            work = &tile;
            const TileCoord& c = tile.c;
            const int m0 = c.m_block * kBlockM;
            row0 = m0 + row_in_tile;
            if constexpr (kFp8) {
                const int kv_head = c.head / p.q_per_kv;
                // This warpgroup's 64 rows lie in one 128-row q descale block.
                const int q_block = (m0 + wg * kRowsPerConsumer) / Cfg::kScaleBlockRows;
                scale_log2 = p.scale_log2 * __ldg(p.q_descale + c.batch * p.q_descale_stride_b +
                                                  c.head * p.q_descale_stride_h +
                                                  q_block * p.q_descale_stride_block);
                k_descale =
                    p.k_descale + c.batch * p.k_descale_stride_b + kv_head * p.k_descale_stride_h;
                k_descale_step = p.k_descale_stride_block;
                v_descale = __ldg(p.v_descale + c.batch * p.v_descale_stride_b +
                                  kv_head * p.v_descale_stride_h);
            }
#pragma unroll
            for (int i = 0; i < kHeadDimV / 2; ++i) o[i] = 0.0f;
            softmax.init();
        }

        // kQInRegisters: this warpgroup's Q tile from shared memory into the A fragments of the
        // e4m3 wgmma (wgmma_fp8.cuh), once per tile, so that Q K^T reads only K from shared memory,
        // which the FP8 kernel keeps about as busy as the tensor cores (+0.2-2.6% at head_dim 128;
        // docs/design/fp8.md#q-in-registers). ldmatrix.x4 of the 8-row x 16-byte matrices (rows
        // 0-7, chunk c), (8-15, c), (0-7, c+1), (8-15, c+1) of the warp's 16 rows gives a0..a3 of
        // the k-step whose 32 bytes are chunks c, c+1. Q is then free, and the producer may load
        // the next tile's.
        __device__ __forceinline__ void load_q() {
            constexpr int kStepsPerSlab = kSlabRowBytes / 32;
            const int row = wg * kRowsPerConsumer + ((threadIdx.x % 128) / 32) * 16 + x4_row(lane);
#pragma unroll
            for (int kk = 0; kk < kQRegs / 4; ++kk) {
                const int chunk = (kk % kStepsPerSlab) * 2 + lane / 16;
                uint32_t r[4];
                ldmatrix_x4(r, smem_addr(smem) + (kk / kStepsPerSlab) * kQSlabBytes +
                                   swizzled_offset<kSlabRowBytes>(row, chunk));
#pragma unroll
                for (int i = 0; i < 4; ++i) q[4 * kk + i] = r[i];
            }
            __syncwarp();
            release(bars.q_empty);
        }

        // S = Q K^T over head_dim in k-steps of 32 bytes (16 bf16/fp16 or 32 e4m3 values): four
        // per 128-byte slab, two in FP8 head_dim 64's 64-byte rows. Slab j goes into s[j] when
        // there are several accumulators; finish_qk sums them.
        __device__ __forceinline__ void issue_qk(float (&s)[kScoreAccs][kBlockN / 2],
                                                int stage) const {
            constexpr int kStepsPerSlab = kSlabRowBytes / 32;
            const uint64_t q_desc = wgmma_desc_kmajor<kSlabRowBytes>(q_addr());
            const uint64_t k_desc =
                wgmma_desc_kmajor<kSlabRowBytes>(smem_addr(smem + kKOffset + stage * kKVBytes));
#pragma unroll
            for (int kk = 0; kk < kSlabs * kStepsPerSlab; ++kk) {
                const uint32_t slab = kk / kStepsPerSlab;
                const uint32_t step = (kk % kStepsPerSlab) * 32;
                const int acc = kScoreAccs > 1 ? slab : 0;
                const bool accumulate = kScoreAccs > 1 ? step > 0 : kk > 0;
                if constexpr (kQInRegisters) {
                    WgmmaE4m3<kBlockN>::rs(s[acc], q[4 * kk], q[4 * kk + 1], q[4 * kk + 2],
                                           q[4 * kk + 3],
                                           wgmma_desc_advance(k_desc, slab * kKVSlabBytes + step),
                                           accumulate);
                } else {
                    mma_ss<kBlockN>(s[acc], wgmma_desc_advance(q_desc, slab * kQSlabBytes + step),
                                    wgmma_desc_advance(k_desc, slab * kKVSlabBytes + step),
                                    accumulate);
                }
            }
        }

        // After the wait that completes Q K^T: S in s[0], the other slabs' sums added in FP32.
        // Serving builds under a logit softcap (FwdParams::softcap_scale != 0, a run-time field):
        // S <- tanh(softcap_scale S), before any mask, so that masked scores stay -inf; the
        // softmax's scale_log2 is then softcap log2(e). Every Q K^T of the tile ends here, so the
        // Q K^T that step() repeats when the stale-max fast path fails gives the same scores again,
        // and the fast path's results stay those of the max pass.
        __device__ __forceinline__ void finish_qk(const FwdParams& params,
                                                  float (&s)[kScoreAccs][kBlockN / 2]) const {
#pragma unroll
            for (int a = 0; a < kScoreAccs; ++a) wgmma_fence_operand(s[a]);
#pragma unroll
            for (int a = 1; a < kScoreAccs; ++a) {
#pragma unroll
                for (int i = 0; i < kBlockN / 2; ++i) s[0][i] += s[a][i];
            }
            if constexpr (kServing) {
                if (params.softcap_scale != 0.0f) {
                    apply_softcap(reinterpret_cast<ScoreTiles&>(s[0]), params.softcap_scale);
                }
            }
        }

        __device__ __forceinline__ void issue_pv(int stage) {
            mma_pv<kHeadDimV>(o, p, smem_addr(smem + (kFp8 ? kVtOffset + stage * kVtBytes
                                                           : kVOffset + stage * kVBytes)));
        }

        // The ring P V reads: Vt (FP8) or V.
        __device__ __forceinline__ Pipeline<kStages>& pv_ring() const {
            return kFp8 ? vt : bars.v;
        }

        // The score scale of key block n_block: with FP8 times k's descale of its (first) 128
        // keys.
        __device__ __forceinline__ float block_scale_log2(int n_block) const {
            if constexpr (kFp8) {
                return scale_log2 *
                       __ldg(k_descale + (n_block * kBlockN / Cfg::kScaleBlockRows) * k_descale_step);
            } else {
                return scale_log2;
            }
        }

        // The block info is rebuilt from the parameters where it is used rather than kept in the
        // consumer: values kept live through the mainloop cost FP8 head_dim 128, which runs at the
        // register cap, up to 10% (docs/design/measurement.md#restructures-and-ptxas-scheduling).
        // Serving builds without a left window (most prefill calls) mask with window_left a
        // constant -1, so the left test folds away: run for every element it made the masked step
        // 707 instructions against the fixed-length build's 635.
        __device__ __forceinline__ void mask(const FwdParams& p, float (&s)[kBlockN / 2],
                                             int n_block) const {
            const SeqMask seq_mask = block_info(p, lens(p)).mask;
            const int key0 = n_block * kBlockN + 2 * (lane % 4);
            if constexpr (kServing) {
                if (seq_mask.window_left < 0) {
                    const SeqMask right_only{seq_mask.seqlen_k, seq_mask.diag, -1,
                                             seq_mask.window_right};
                    apply_mask<16>(reinterpret_cast<ScoreTiles&>(s), right_only, row0, key0,
                                   AccumulatorColumns{});
                    return;
                }
            }
            apply_mask<16>(reinterpret_cast<ScoreTiles&>(s), seq_mask, row0, key0,
                           AccumulatorColumns{});
        }

        // One step: S for key block n_block, P V for the block before it (ring position `prev`).
        // kStaleMax: try the softmax's fast path first (kStaleMaxFirst builds).
        template <bool kMasked, bool kStaleMax = false>
        __device__ __forceinline__ void step(const FwdParams& params, int n_block, float (&s)[kScoreAccs][kBlockN / 2],
                                             float (&rescale)[1][2]) {
            static_assert(!(kMasked && kStaleMax), "masked blocks take the max pass");
            const Ring prev = ring;
            ++ring.count;
            const float block_scale = block_scale_log2(n_block);
            bars.k.consumer_wait(ring);
            wgmma_fence_operand(o);
            wgmma_fence();
            issue_qk(s, ring.stage());
            wgmma_commit();
            pv_ring().consumer_wait(prev);
            issue_pv(prev.stage());
            wgmma_commit();
            wgmma_wait<1>();
            finish_qk(params, s);
            // K is released once no Q K^T of this block can follow.
            if constexpr (!kStaleMax) release(bars.k.empty[ring.stage()]);
            if constexpr (kMasked) mask(params, s[0], n_block);
            bool rescale_o = false;
            float block_sum[1][2];
            if (kStaleMax &&
                named_barrier_all(kVoteBarrier + wg, 128,
                                  softmax.exp_with_stale_max(reinterpret_cast<ScoreTiles&>(s[0]),
                                                             block_scale, block_sum))) {
                softmax.add_block_sums(block_sum);
            } else {
                if constexpr (kStaleMax) {
                    // The fast path spoiled S: Q K^T again, by the whole warpgroup (hence the
                    // vote), on its own (ptxas keeps wgmmas asynchronous only if none is issued
                    // conditionally while another is in flight).
                    wgmma_wait<0>();
                    wgmma_fence();
                    issue_qk(s, ring.stage());
                    wgmma_commit();
                    wgmma_wait<0>();
                    finish_qk(params, s);
                }
                rescale_o =
                    softmax.update(reinterpret_cast<ScoreTiles&>(s[0]), block_scale, rescale);
            }
            if constexpr (kStaleMax) release(bars.k.empty[ring.stage()]);
            wgmma_wait<0>();
            wgmma_fence_operand(o);
            release(pv_ring().empty[prev.stage()]);
            accumulator_to_p<kBlockN>(p, s[0]);
            if (rescale_o) scale_rows(reinterpret_cast<OutTiles&>(o), rescale);
        }

        // Q K^T of the block at the ring's position, waited for; frees its K slot.
        __device__ __forceinline__ void qk_in_turn(const FwdParams& params,
                                                   float (&s)[kScoreAccs][kBlockN / 2]) {
            bars.k.consumer_wait(ring);
            wgmma_fence();
            issue_qk(s, ring.stage());
            wgmma_commit();
            wgmma_wait<0>();
            finish_qk(params, s);
            release(bars.k.empty[ring.stage()]);
        }

        // P V of the block at the ring's position, waited for; frees its slot and moves on.
        __device__ __forceinline__ void pv_in_turn() {
            pv_ring().consumer_wait(ring);
            wgmma_fence_operand(o);
            wgmma_fence();
            issue_pv(ring.stage());
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operand(o);
            release(pv_ring().empty[ring.stage()]);
            ++ring.count;
        }

        // !kIntraOverlap: key block n_block on its own: Q K^T, the softmax, then P V.
        template <bool kMasked>
        __device__ __forceinline__ void step_in_turn(const FwdParams& params, int n_block,
                                                     float (&s)[kScoreAccs][kBlockN / 2],
                                                     float (&rescale)[1][2]) {
            const float block_scale = block_scale_log2(n_block);
            qk_in_turn(params, s);
            if constexpr (kMasked) mask(params, s[0], n_block);
            // O is zero before a tile's first block, where a rescale changes nothing.
            if (softmax.update(reinterpret_cast<ScoreTiles&>(s[0]), block_scale, rescale)) {
                scale_rows(reinterpret_cast<OutTiles&>(o), rescale);
            }
            accumulator_to_p<kBlockN>(p, s[0]);
            pv_in_turn();
        }

        // Serving builds: zeroes the rows of the V tile at `stage` from key `valid` on (the
        // block holding the last key), before any P V reads it. Each thread zeroes 16-byte
        // chunks of whole 128-byte slab rows, which the swizzle only permutes within the row;
        // both consumer warpgroups may write the same zeros, and each makes its own writes
        // visible to its wgmmas (fence.proxy.async, then the warpgroup's barrier).
        __device__ __forceinline__ void zero_v_rows(int stage, int valid) const {
            uint8_t* tile = smem + kVOffset + stage * kVBytes;
            constexpr int kChunksPerRow = kSlabRowBytes / 16;
            const int chunks = (kBlockN - valid) * kChunksPerRow;
#pragma unroll 1
            for (int i = threadIdx.x % 128; i < chunks * kVSlabs; i += 128) {
                const int slab = i / chunks;
                const int in_slab = i % chunks;
                *reinterpret_cast<uint4*>(tile + slab * kKVSlabBytes +
                                          (valid + in_slab / kChunksPerRow) * kSlabRowBytes +
                                          (in_slab % kChunksPerRow) * 16) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async();
            named_barrier_sync(kVoteBarrier + wg, 128);
        }

        // The tile's sequence: the call's lengths in fixed-length builds (from the parameters,
        // holding no registers), the producer's in serving builds.
        __device__ __forceinline__ SeqLens lens(const FwdParams& p) const {
            return kServing ? work->lens : seq_lens(p, 0);
        }

        // Runs key blocks n_end-1 .. n_begin of the tile; leaves the ring past its last slot.
        __device__ __forceinline__ void mainloop(const FwdParams& params) {
            const int m_block = work->c.m_block;
            const Info info = block_info(params, lens(params));
            const int n_begin = work->n_begin;
            const int n_end = work->n_end;
            if (n_end == n_begin) return;
            const int n_first_masked = info.n_right_masked(m_block);
            // Blocks below n_left_unmasked need the window's left mask (serving builds); the
            // unmasked run also ends at the split's first block.
            const int n_left = kServing ? max(info.n_left_unmasked(m_block), n_begin) : 0;
            float s[kScoreAccs][kBlockN / 2];
            float rescale[1][2];
            const float first_scale = block_scale_log2(n_end - 1);
            bars.q_full.wait(q_loads & 1);
            ++q_loads;
            if constexpr (kQInRegisters) load_q();
            if constexpr (!Cfg::kIntraOverlap) {
                int n_block = n_end - 1;
#pragma unroll 1
                for (; n_block >= n_begin && n_block >= n_first_masked; --n_block) {
                    step_in_turn<true>(params, n_block, s, rescale);
                }
#pragma unroll 1
                for (; n_block >= n_begin; --n_block) {
                    step_in_turn<false>(params, n_block, s, rescale);
                }
                if constexpr (!kQInRegisters) release(bars.q_empty);
                return;
            }
            qk_in_turn(params, s);
            if (n_end - 1 >= n_first_masked || (kServing && n_end - 1 < n_left)) {
                mask(params, s[0], n_end - 1);
            }
            // O is still zero, so whether it would need rescaling does not matter.
            softmax.update(reinterpret_cast<ScoreTiles&>(s[0]), first_scale, rescale);
            accumulator_to_p<kBlockN>(p, s[0]);
            if constexpr (kServing) {
                // Keys past the sequence's last lie only in the first block visited.
                const int valid = lens(params).seqlen_k - (n_end - 1) * kBlockN;
                if (valid < kBlockN) {
                    bars.v.consumer_wait(ring);
                    zero_v_rows(ring.stage(), valid);
                }
            }

            int n_block = n_end - 2;
#pragma unroll 1
            for (; n_block >= n_begin && n_block >= n_first_masked; --n_block) {
                step<true>(params, n_block, s, rescale);
            }
            if constexpr (Cfg::kStaleMaxFirst) {
                // The masked blocks and the first unmasked one go through the max pass: that is
                // where a row max still grows (a causal row that saw few keys on the diagonal).
                if (n_block >= n_left) step<false>(params, n_block--, s, rescale);
#pragma unroll 1
                for (; n_block >= n_left; --n_block) step<false, true>(params, n_block, s, rescale);
            } else {
#pragma unroll 1
                for (; n_block >= n_left; --n_block) step<false>(params, n_block, s, rescale);
            }
            if constexpr (kServing) {
#pragma unroll 1
                for (; n_block >= n_begin; --n_block) step<true>(params, n_block, s, rescale);
            }
            // Every Q K^T of this tile has completed: the producer may load the next tile's Q
            // (with Q in registers, load_q freed it already).
            if constexpr (!kQInRegisters) release(bars.q_empty);

            pv_in_turn();
        }
    };
};

}  // namespace ptxattn
