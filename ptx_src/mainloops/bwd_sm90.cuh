// Mainloop of the Hopper (sm_90a) backward: the producer's TMA loads and the consumer
// warpgroups' five GEMMs per query tile, on wgmma.
//
// A block owns kBlockN = 128 keys of one (batch, kv head); each of its two consumer warpgroups
// holds 64 of them (one wgmma M) and keeps their dK and dV in registers. At head_dim 256 a block
// owns 64 keys, which both warpgroups hold, each keeping dK and dV for half of the columns
// (BwdSm90Config::kSharedKeys). The producer thread
// loads K and V once, then the (Q, dO) tile pair of every step (BwdSteps: each q head sharing
// the kv head, over the query tiles that see the block's keys) into a ring of kStages slots.
// Per step a warpgroup computes, with rows = its keys and columns = the tile's kBlockM queries:
//   S^T  = K Q^T                 SS, both K-major (as the forward's Q K^T)
//   dP^T = V dO^T                SS, both K-major
//   P^T  = exp2(S^T scale_log2 - LSE log2(e)) in registers (masked first where the tile needs it)
//   dV  += P^T dO                RS: P^T as A fragments, dO MN-major (as the forward's P V)
//   dS^T = P^T (dP^T - D)        in registers, P rounded to 16 bits as dV's GEMM saw it
//   dQ   = dS K                  SS with transposed B: dS from shared memory, where each
//                                warpgroup stores its dS^T transposed (stmatrix .trans), K
//                                MN-major (at head_dim 128 computed as dQ^T = K^T dS^T, K the
//                                MN-major A); then added into the FP32 accumulator: staged in
//                                shared memory and added by a TMA reduce (cp.reduce.async.bulk),
//                                which runs on while the next step computes (issued by the
//                                producer's writer warps at head_dims 64 and 128 and for
//                                deterministic sums, there in the tile's turns, else by the
//                                consumer; at head_dim 256 in two rounds of 64 columns)
//   dK  += dS^T Q                RS: dS^T as A fragments, Q MN-major; issued after dQ's GEMM
//                                and running on while dQ is staged
// Computing S^T rather than S keeps both dV's and dK's A operand in registers, straight from
// the accumulators; only dQ needs dS in shared memory. For dQ, head_dim 128 splits the columns
// (each warpgroup 64, over all the block's keys), head_dim 64 the query rows (each warpgroup 64
// rows of all 64 columns, over all keys): each warpgroup reads both warpgroups' dS, so they meet
// at a named barrier, and adds into rows and columns of its own. Head_dim 256 gives each
// warpgroup 128 columns over the keys both hold (each reads the dS it wrote itself). Where both
// read both, dS is double-buffered: a warpgroup writes step i's buffer only after the barrier of
// step i - 1, which both passed after finishing step i - 2's dQ, the last reader.
// Each step's LSE (in log2 units) and D arrive with its Q and dO: the producer copies their
// kBlockM rows from the workspace (bulk copies; the rows are padded to whole tiles and to 128
// there), so no consumer waits on a global load (reading them with __ldg per thread cost 25% at
// head_dim 128).
#pragma once
#include "ptx/atomics.cuh"
#include "roles/block_info.cuh"
#include "ptx/common.cuh"
#include "roles/epilogue.cuh"
#include "roles/mask.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"
#include "roles/pipeline.cuh"
#include "roles/smem_tile.cuh"
#include "roles/softmax.cuh"
#include "roles/tile_scheduler.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "ptx/wgmma_fp8.cuh"
#include "roles/transpose_e4m3.cuh"

namespace ptxattn {

// kCount float2 values at a thread's columns of one of a step's row-value rows (the LSE or D of
// columns 8 i + 2 t, + 1; `addr` the thread's first, in shared memory): read into registers
// ahead of their use (kAhead, read_ahead) or from shared memory at it.
template <bool kAhead, int kCount>
struct ColumnValues {
    uint32_t addr;
    float2 held[kAhead ? kCount : 1];

    __device__ __forceinline__ void read_ahead() {
        if constexpr (kAhead) {
#pragma unroll
            for (int i = 0; i < kCount; ++i) held[i] = ld_shared_f32x2(addr + 32 * i);
        }
    }
    __device__ __forceinline__ float2 operator()(int i) const {
        if constexpr (kAhead) {
            return held[i];
        } else {
            return ld_shared_f32x2(addr + 32 * i);
        }
    }
};

// The compile-time shape of a Hopper backward kernel: kHeadDim 64, 128 or 256; kBf16 the 16-bit
// type; kCausal; kBlockM query rows per step (64, 80 or 128: the N of S^T and dP^T, whose SS
// wgmmas read shared memory at the tensor cores' pace at N = 64 and at 3/4 of it at N = 128);
// kStages the depth of the (Q, dO) ring; kDeterministic: dQ summed in a fixed order by the
// writer warps (a build of its own: one kernel with both ways of summing ran 2-5% slower without,
// and spilled at head_dim 64); kOptions: the options build, which reads a window, a softcap and
// packed sequences from BwdParams (a build of its own: read in every build, they cost the plain
// backward 1-5%, H200, 2026-12-02, docs/design/backward.md#options-build); kFp8: the FP8
// backward (below); kSmemBytes the dynamic shared memory the launcher requests (equal to the
// layout below, checked).
//
// The FP8 backward (kFp8) takes e4m3 Q, K, V (the forward's) and dO (quantized per 128 rows by
// the launcher), and runs four of the five GEMMs as e4m3 wgmmas (wgmma_fp8.cuh), which read
// both operands K-major: S^T = K Q^T and dP^T = V dO^T from the e4m3 tiles as the 16-bit ones,
// dV += P^T dO and dK += dS^T Q with P^T and dS^T as e4m3 A fragments and the B operands from
// transposed copies Q^T and dO^T [head_dim x queries] the launcher writes, their queries in
// transpose_e4m3.cuh's order so that the accumulators convert in place. P^T goes in as 256 P
// (P <= 1), dS^T scaled per key row and step to its amax (448 at the largest); dV's and dK's
// accumulators are kept in units of the step's scales (dO's descale, dS's row scale times Q's),
// rescaled when a step's differ, as the forward's O is by its row maxima. dQ = dS K stays a
// 16-bit GEMM: dS from the 16-bit dS^T (its rounding is 16-bit, not e4m3's) and a 16-bit K the
// launcher dequantizes. The tiles take the 16-bit build's bytes: the V region holds K and V in
// e4m3, each (Q, dO) slot an e4m3 tile and its transpose. FP8 takes 64 or 128 query rows a step
// (k-steps of 32 bytes over whole swizzle spans) and no options build.
template <int HeadDim, bool Bf16, bool Causal, int BlockM, int Stages, bool Deterministic,
          bool Options, bool Fp8, int SmemBytes>
struct BwdSm90Config {
    static constexpr int kHeadDim = HeadDim;
    static constexpr bool kBf16 = Bf16;
    static constexpr bool kCausal = Causal;
    static constexpr int kBlockM = BlockM;
    static constexpr int kStages = Stages;
    static constexpr bool kDeterministic = Deterministic;
    static constexpr bool kOptions = Options;
    static constexpr bool kFp8 = Fp8;
    static constexpr uint32_t kSmemBytes = SmemBytes;

    static constexpr int kConsumers = 2;
    // head_dim 256 (kSharedKeys): dK and dV of 64 keys take 256 registers a thread at that
    // width, so both consumer warpgroups work on the same 64 keys, each computing the same S^T
    // and dP^T (7 GEMM units a step where 5 would do) and holding dK and dV, and adding dQ, for
    // half of the columns. Otherwise each warpgroup owns 64 keys of the block, all columns.
    static constexpr bool kSharedKeys = kHeadDim == 256;
    static constexpr int kBlockN = kSharedKeys ? 64 : 64 * kConsumers;
    static constexpr int kDkvCols = kSharedKeys ? kHeadDim / kConsumers : kHeadDim;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    static constexpr int kConsumerWarps = 4 * kConsumers;

    // Tiles in shared memory: rows of head_dim in 128-byte swizzled slabs of 64 columns, one TMA
    // box each; dS [kBlockM x 64 keys] a slab per warpgroup, each written by it.
    static constexpr int kSlabs = kHeadDim / 64;
    static constexpr uint32_t kQSlabBytes = kBlockM * 128;
    static constexpr uint32_t kQBytes = kQSlabBytes * kSlabs;
    static constexpr uint32_t kKVSlabBytes = kBlockN * 128;
    static constexpr uint32_t kKVBytes = kKVSlabBytes * kSlabs;
    static constexpr uint32_t kDsSlabBytes = kBlockM * 128;
    static constexpr uint32_t kDsBytes = kDsSlabBytes * kConsumers;
    static constexpr uint32_t kSwizzleAtomBytes = 1024;
    // A step's LSE log2 and D: kBlockM floats each, after the ring's (Q, dO) tiles.
    // FP8: and the step's four scales (Fp8Scales), which the producer writes.
    static constexpr uint32_t kRowValuesBytes = 2 * kBlockM * 4 + (Fp8 ? 16 : 0);

    // dQ per warpgroup: 64 query rows x all 64 columns (head_dim 64, kDqSplitRows) or all rows
    // x 64 columns (128), both over all keys, or all rows x its 128 columns over the shared keys
    // (256); in one wgmma of 64 rows, or transposed (below) in one of kBlockM columns. (Split by
    // keys instead, each warpgroup over its own 64 keys and both adding all rows, head_dim 64
    // read only its own dS but reduced twice the bytes into L2 a step: 0.91-0.97 of the row
    // split, and 0.82-0.90 with deterministic sums, whose hand-off summed the two first.)
    // Reading only the dS it wrote, a warpgroup needs one dS buffer (kOwnDs); otherwise both
    // read both, and dS is double-buffered. Split by columns, dQ is computed transposed
    // (kDqTransposed): dQ^T = K^T dS^T, the warpgroup's 64 columns the wgmma's M and the step's
    // queries its N, in one wgmma of kBlockM columns, so kBlockM may be 80 (a fourth more work a
    // step for the same per-step waits, barriers and loads; FlashAttention-3 takes 80 at head_dim
    // 128 without causal masking).
    static constexpr bool kDqSplitRows = kHeadDim == 64;
    static constexpr bool kOwnDs = kSharedKeys;
    static constexpr bool kDqTransposed = !kOwnDs && !kDqSplitRows;
    static constexpr int kDqCols = kSharedKeys ? kDkvCols : 64;
    static constexpr int kDqKeys = kOwnDs ? 64 : kBlockN;
    static constexpr int kDqRowBlocks = kDqTransposed || kDqSplitRows ? 1 : kBlockM / 64;
    // Rows a warpgroup's dQ covers, the height of the accumulator map's box.
    static constexpr int kDqRows = kDqSplitRows ? 64 : kBlockM;
    // A thread's dQ accumulators per row block: 64 rows x kDqCols, or kDqCols x kBlockM (dQ^T).
    // (kBlockM / 64 row blocks where a warpgroup covers all rows untransposed: head_dim 256.)
    static constexpr int kDqValues = (kDqTransposed ? kBlockM : kDqCols) / 2;
    static constexpr int kDsBuffers = kOwnDs ? 1 : 2;
    // dQ staging per consumer warpgroup for the TMA reduces: [kDqRows x 32] float32 boxes
    // (128-byte rows, 128-byte swizzle), two a round. head_dim 256 stages its 128 columns in two
    // rounds (kDqRounds), in the warpgroup's dS slab (free once dQ's GEMM has read it) and one
    // box of its own: K, V, two (Q, dO) stages and dS fill 210 KB and leave no room for 2 x 32 KB.
    // (Added from registers by red.global adds instead, dQ's sums doubled the kernel's time, with
    // L2 at 72% of its peak.)
    static constexpr int kDqRounds = kSharedKeys ? 2 : 1;
    static constexpr int kDqRoundCols = kDqCols / kDqRounds;
    static constexpr uint32_t kDqBoxBytes = kDqRows * 128;
    static constexpr uint32_t kDqStageBytes = (kSharedKeys ? 1 : 2) * kDqBoxBytes;
    // Non-causal blocks walk the query tiles from staggered starts (BwdWalk) even without
    // deterministic sums at head_dim 64, where it measured +5-7% at seqlen 16384 (two A/B runs);
    // at 128 it cost 2%.
    static constexpr bool kStaggeredWalk = kDeterministic || kHeadDim == 64;
    // The producer's writer warps issue the dQ reduces (write_dq; without deterministic sums they
    // take no turns), so that no consumer waits for its staging to be read (head_dim 64 and
    // 128) or for its reduces' completion before passing the tile's turn (deterministic sums):
    // always with deterministic sums, and at head_dims 64 and 128. (At head_dim 256, where the
    // dS slab, the consumers still wait for the turn within the step, since round 1 and the next
    // dS reuse round 0's staging; taking the turns themselves there cost 20-32%.)
    static constexpr bool kDqWriter = kDeterministic || !kSharedKeys;

    // Launched at 168 registers a thread; the producer keeps 24 and each consumer warpgroup
    // takes 240: dK and dV (kDkvCols each), S^T and dP^T (kBlockM / 2 each), dQ and the A
    // fragments.
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;

    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128, 256");
    static_assert(!kFp8 || (!kOptions && (kBlockM == 64 || kBlockM == 128)),
                  "FP8: 64 or 128 query rows a step, no options build");

    // FP8 tiles: K-major e4m3 rows of head_dim bytes in swizzle spans of up to 128 (slabs of
    // kRow8Bytes columns, as the 16-bit tiles' 64), and the transposed Q^T, dO^T rows of kBlockM
    // bytes, after the e4m3 Q and dO in their (Q, dO) slots.
    static constexpr int kRow8Bytes = kHeadDim < 128 ? kHeadDim : 128;
    static constexpr int kSlabs8 = kHeadDim / kRow8Bytes;
    static constexpr uint32_t kK8SlabBytes = kBlockN * kRow8Bytes;
    static constexpr uint32_t kK8Bytes = kBlockN * kHeadDim;
    static constexpr uint32_t kQ8SlabBytes = kBlockM * kRow8Bytes;
    static constexpr uint32_t kQ8Bytes = kBlockM * kHeadDim;
    // P^T enters dV's GEMM as e4m3(256 P): P <= 1, and a power of two leaves P's rounding e4m3's.
    static constexpr float kPScale = 256.0f;
    // FP32's least normal value, the least scale of a row of dS (quantize_score_gradient)
    static constexpr float kLeastNormal = 1.17549435e-38f;
    static_assert(kBlockM == 64 || kBlockM == 128 || (kBlockM == 80 && kDqTransposed),
                  "64 or 128 query rows a step, or 80 with dQ transposed");
    static_assert(kDqSplitRows ? kDqCols == kHeadDim : kDqCols * kConsumers == kHeadDim,
                  "dQ: all columns of half the rows a warpgroup, or half of the columns");
    static_assert((65536 / kThreads / 8 * 8) * (1 + kConsumers) >=
                      kProducerRegs + kConsumers * kConsumerRegs,
                  "setmaxnreg: the consumers take more than the block was launched with");
};

template <int kStages>
struct BwdSm90Barriers {
    MBarrier kv_full;         // K and V of the block, loaded once
    Pipeline<kStages> q_do;   // the (Q, dO) ring: one TMA arrival, every consumer warp frees
};

template <class Cfg>
struct BwdSm90Mainloop {
    static constexpr int kHeadDim = Cfg::kHeadDim;
    static constexpr int kBlockM = Cfg::kBlockM;
    static constexpr int kBlockN = Cfg::kBlockN;
    static constexpr int kStages = Cfg::kStages;
    static constexpr bool kBf16 = Cfg::kBf16;
    static constexpr int kSlabs = Cfg::kSlabs;
    static constexpr uint32_t kQSlabBytes = Cfg::kQSlabBytes;
    static constexpr uint32_t kQBytes = Cfg::kQBytes;
    static constexpr uint32_t kKVSlabBytes = Cfg::kKVSlabBytes;
    static constexpr uint32_t kKVBytes = Cfg::kKVBytes;
    static constexpr uint32_t kDsSlabBytes = Cfg::kDsSlabBytes;
    static constexpr uint32_t kDsBytes = Cfg::kDsBytes;

    using Barriers = BwdSm90Barriers<kStages>;
    using Ring = PipelineState<kStages>;
    using Info = BlockInfo<kBlockM, kBlockN>;

    // Shared memory: [K | V | Q stage 0..S-1 | dO stage 0..S-1 | dS x 1-2 | dQ staging per
    // consumer | LSE, D stage 0..S-1 | barriers], from a 1024-byte aligned base (the swizzle
    // atom), which may cost up to 1024 bytes. Every tile is a multiple of 1024 bytes, so each
    // swizzled one starts on an atom; the row values come last, where they need no padding (80
    // query rows a step at head_dim 128 leave 728 bytes free; padded, they would not fit).
    static constexpr uint32_t kKOffset = 0;
    static constexpr uint32_t kVOffset = kKVBytes;
    static constexpr uint32_t kQOffset = 2 * kKVBytes;
    static constexpr uint32_t kDoOffset = kQOffset + kStages * kQBytes;
    static constexpr uint32_t kDsOffset = kDoOffset + kStages * kQBytes;
    static constexpr uint32_t kDqOffset = kDsOffset + Cfg::kDsBuffers * kDsBytes;
    static constexpr uint32_t kRowValuesOffset = kDqOffset + Cfg::kConsumers * Cfg::kDqStageBytes;
    static constexpr uint32_t kBarrierOffset = kRowValuesOffset + kStages * Cfg::kRowValuesBytes;
    // FP8: e4m3 K and V in the V region (the 16-bit K for dQ stays in the K region), each
    // (Q, dO) slot's e4m3 tile followed by its transpose.
    static constexpr uint32_t kK8Offset = kVOffset;
    static constexpr uint32_t kV8Offset = kVOffset + Cfg::kK8Bytes;
    static_assert(!Cfg::kFp8 || (2 * Cfg::kK8Bytes == kKVBytes && 2 * Cfg::kQ8Bytes == kQBytes &&
                                 Cfg::kQ8Bytes % 1024 == 0),
                  "FP8: the e4m3 tiles fill the 16-bit ones' bytes, on swizzle atoms");
    static_assert(kQBytes % 1024 == 0 && kDsBytes % 1024 == 0 && Cfg::kDqBoxBytes % 1024 == 0,
                  "swizzled tiles start on 1024-byte atoms");
    // A warpgroup's dQ staging: its boxes from kDqOffset on, or (kSharedKeys) its dS slab and then
    // its box from kDqOffset, the same distance further for both warpgroups.
    static constexpr uint32_t kDqStagingOffset = Cfg::kSharedKeys ? kDsOffset : kDqOffset;
    static constexpr uint32_t kDqStagingStride =
        Cfg::kSharedKeys ? kDsSlabBytes : Cfg::kDqStageBytes;
    static constexpr uint32_t kDqBoxStride =
        Cfg::kSharedKeys ? kDqOffset - kDsOffset : Cfg::kDqBoxBytes;
    static_assert(!Cfg::kSharedKeys || Cfg::kDsBuffers == 1, "one dS slab a warpgroup");
    // The launcher's mirror of this layout (hopper_backward.Variant.smem_bytes) must give the
    // same size: a smaller one would overrun the block's shared memory, a larger one waste it.
    static_assert(kBarrierOffset + sizeof(Barriers) + Cfg::kSwizzleAtomBytes == Cfg::kSmemBytes,
                  "kSmemBytes differs from this tile configuration's layout");

    // Named barriers (0 is __syncthreads): dS complete, for both warpgroups (head_dim 64, 128)
    // or per warpgroup (256); dQ staged, per warpgroup; and with the writer warps (kDqWriter)
    // the hand-offs of each round of the staged dQ to its writer (full, then free again), one
    // pair per consumer warpgroup and round.
    static constexpr uint32_t kDsBarrier = 1;      // + warpgroup when it reads its own dS
    static constexpr uint32_t kDqBarrier = 5;      // + warpgroup: its dQ staged
    // kSharedKeys: both consumer warpgroups done with every step, so the ring can stage dK / dV.
    static constexpr uint32_t kConsumersDone = 11;
    static __device__ __forceinline__ constexpr uint32_t writer_full(int wg, int round) {
        return (round == 0 ? 3 : 7) + wg;
    }
    static __device__ __forceinline__ constexpr uint32_t writer_free(int wg, int round) {
        return (round == 0 ? 9 : 12) + wg;
    }
    // Each consumer warpgroup stages each round of its dQ for that round's writer warp through
    // its own pair of barriers with it. A writer serves them in warpgroup order: it reduces the
    // first's staging as soon as that is full, without waiting for the second's, and frees each
    // as soon as its own reduce has read it.
    static constexpr int kWriterLanes = Cfg::kConsumers;
    static constexpr uint32_t kWriterSyncThreads = 128 + 32;
    // Writer warps (warps 1.. of the producer warpgroup): over the shared keys (head_dim 256,
    // deterministic sums) one a round; at head_dims 64 and 128 one, or with deterministic sums
    // one a consumer warpgroup (write_dq). (Without deterministic sums, one a warpgroup measured
    // 0.96-0.995 at head_dim 128 and 1.00-1.03 at 64.)
    static constexpr int kWriterWarps =
        Cfg::kSharedKeys ? Cfg::kDqRounds : Cfg::kDeterministic ? Cfg::kConsumers : 1;
    static_assert(Cfg::kConsumers <= 2 && kWriterWarps <= 2,
                  "barrier ids for two warpgroups and two rounds");

    // ---- Producer ---------------------------------------------------------------------------

    // The producer thread: K and V of the block, then (Q, dO) of every step.
    static __device__ __forceinline__ void load(const BwdParams& p, uint8_t* smem, Barriers& bars,
                                                const BwdSteps& steps, int n_block, int kv_head,
                                                const BwdSeq& seq) {
        tma_prefetch(&p.q_map);
        tma_prefetch(&p.k_map);
        tma_prefetch(&p.v_map);
        tma_prefetch(&p.dout_map);
        bars.kv_full.arrive_expect_tx(2 * kKVBytes);
        const int first_key = seq.lens.offset_k + n_block * kBlockN;
#pragma unroll
        for (int j = 0; j < kSlabs; ++j) {
            tma_load_4d(smem + kKOffset + j * kKVSlabBytes, &p.k_map, bars.kv_full, 64 * j,
                        kv_head, first_key, seq.batch_coord);
            if constexpr (!Cfg::kFp8) {
                tma_load_4d(smem + kVOffset + j * kKVSlabBytes, &p.v_map, bars.kv_full, 64 * j,
                            kv_head, first_key, seq.batch_coord);
            }
        }
        if constexpr (Cfg::kFp8) {
            tma_prefetch(&p.k8_map);
            tma_prefetch(&p.qt_map);
            tma_prefetch(&p.doutt_map);
#pragma unroll
            for (int j = 0; j < Cfg::kSlabs8; ++j) {
                tma_load_4d(smem + kK8Offset + j * Cfg::kK8SlabBytes, &p.k8_map, bars.kv_full,
                            Cfg::kRow8Bytes * j, kv_head, first_key, seq.batch_coord);
                tma_load_4d(smem + kV8Offset + j * Cfg::kK8SlabBytes, &p.v_map, bars.kv_full,
                            Cfg::kRow8Bytes * j, kv_head, first_key, seq.batch_coord);
            }
        }
        Ring ring;
#pragma unroll 1
        for (int step = 0; step < steps.count; ++step, ++ring.count) {
            const int head = steps.head(step, kv_head, p.q_per_kv);
            const int row = steps.m_block(step) * kBlockM;
            bars.q_do.producer_acquire(ring);
            MBarrier& full = bars.q_do.full_barrier(ring);
            if constexpr (Cfg::kFp8) {
                // before the arrival that completes the stage with its loads, which releases
                // these stores to the consumers
                *reinterpret_cast<Fp8Scales*>(smem + kRowValuesOffset +
                                              ring.stage() * Cfg::kRowValuesBytes +
                                              2 * kBlockM * 4) =
                    Fp8Scales::of(p, seq.batch_coord, head, kv_head, steps.m_block(step), n_block);
            }
            full.arrive_expect_tx(2 * kQBytes + 2 * kBlockM * 4);
            const int64_t padded_row = seq.workspace_row(p, head, row);
            float* row_values = reinterpret_cast<float*>(smem + kRowValuesOffset +
                                                         ring.stage() * Cfg::kRowValuesBytes);
            bulk_load(row_values, p.lse_log2 + padded_row, kBlockM * 4, full);
            bulk_load(row_values + kBlockM, p.dpsum + padded_row, kBlockM * 4, full);
            uint8_t* q_tile = smem + kQOffset + ring.stage() * kQBytes;
            uint8_t* do_tile = smem + kDoOffset + ring.stage() * kQBytes;
            if constexpr (Cfg::kFp8) {
#pragma unroll
                for (int j = 0; j < Cfg::kSlabs8; ++j) {
                    tma_load_4d(q_tile + j * Cfg::kQ8SlabBytes, &p.q_map, full,
                                Cfg::kRow8Bytes * j, head, seq.lens.offset_q + row,
                                seq.batch_coord);
                    tma_load_4d(do_tile + j * Cfg::kQ8SlabBytes, &p.dout_map, full,
                                Cfg::kRow8Bytes * j, head, seq.lens.offset_q + row,
                                seq.batch_coord);
                }
                // Q^T and dO^T: coordinates (query, column, head, batch), one box of all columns
                tma_load_4d(q_tile + Cfg::kQ8Bytes, &p.qt_map, full, row, 0, head,
                            seq.batch_coord);
                tma_load_4d(do_tile + Cfg::kQ8Bytes, &p.doutt_map, full, row, 0, head,
                            seq.batch_coord);
            } else {
#pragma unroll
                for (int j = 0; j < kSlabs; ++j) {
                    tma_load_4d(q_tile + j * kQSlabBytes, &p.q_map, full, 64 * j, head,
                                seq.lens.offset_q + row, seq.batch_coord);
                    tma_load_4d(do_tile + j * kQSlabBytes, &p.dout_map, full, 64 * j, head,
                                seq.lens.offset_q + row, seq.batch_coord);
                }
            }
        }
    }

    // The TMA reduces of one staged round of a warpgroup's dQ (columns col0.., query rows
    // row0.. of the sequence) into the accumulator, by the issuing thread: a consumer's
    // (reduce_dq) or the writer warp's. The map is (batch_coord * heads_q + head, workspace row,
    // column): rows past the sequence land in its padding.
    static __device__ __forceinline__ void issue_dq_reduce(const BwdParams& p,
                                                           const uint8_t* staging, int col0,
                                                           int row0, int head,
                                                           const BwdSeq& seq) {
#pragma unroll
        for (int box = 0; box < Cfg::kDqRoundCols / 32; ++box) {
            tma_reduce_add_3d(&p.dq_accum_map, staging + box * kDqBoxStride, col0 + 32 * box,
                              seq.workspace_row0 + row0, seq.batch_coord * p.heads_q + head);
        }
    }

    // Writer warp kWriter (kDqWriter): per step, once the consumers staged the block's dQ (its
    // share: every warpgroup's, or one warpgroup's, kWriterWarps; at head_dim 256 one round of
    // it), its lane 0 adds the staging into the accumulator with TMA reduces and frees the
    // staging once they have read it; with deterministic sums it first waits for the tile's
    // turn (BwdWalk), while the consumers still compute the step, and passes the turn once the
    // step's reduces have completed. Waiting here rather than in a consumer keeps the waits off
    // the wgmma pipeline: where the staging is its own (head_dims 64 and 128) the consumers run
    // up to a step ahead. Each writer has turns of its own (a semaphore per tile and writer). A
    // tile's turns pass from block to block (causal: each block a step behind the one before
    // it, BwdWalk), so a link of that chain (the turn seen, the reduces issued and completed, the
    // release's gpu-scope fence, about 1 us of it) must fit in a step: one writer carrying both
    // head_dim 256 rounds took 3.6 us a link against a 3.2 us step (%globaltimer stamps), and
    // the chain set the pace. Two chains of half the bytes each, on two warps, overlap.
    // Every lane calls it.
    template <int kWriter>
    static __device__ __forceinline__ void write_dq(const BwdParams& p, uint8_t* smem,
                                                    const Info& info, const BwdWalk& walk,
                                                    const BwdSteps& steps, int kv_head,
                                                    int batch, const BwdSeq& seq) {
        constexpr bool kOwnLane = !Cfg::kSharedKeys && kWriterWarps > 1;
        constexpr int kRound = Cfg::kSharedKeys ? kWriter : 0;
        constexpr int kFirstLane = kOwnLane ? kWriter : 0;
        constexpr int kLanes = kOwnLane ? 1 : kWriterLanes;
        const bool leader = threadIdx.x % 32 == 0;
#pragma unroll 1
        for (int i = 0; i < steps.count; ++i) {
            const int head = steps.head(i, kv_head, p.q_per_kv);
            const int m_block = steps.m_block(i);
            // The semaphore as an index (32 bits: the tiles times the writers are far fewer than
            // 2^31): a pointer held across the step spilled the writer's 24 registers.
            const int turn =
                ((batch * p.heads_q + head) * p.num_m_blocks + m_block) * kWriterWarps + kWriter;
            if (Cfg::kDeterministic && leader) {
                wait_turn(p.dq_semaphore + turn,
                          walk.turn(m_block, info.n_min(m_block), info.n_max(m_block)));
            }
#pragma unroll
            for (int w = kFirstLane; w < kFirstLane + kLanes; ++w) {
                __syncwarp();
                named_barrier_sync(writer_full(w, kRound), kWriterSyncThreads);
                if (leader) {
                    issue_dq_reduce(p, smem + kDqStagingOffset + w * kDqStagingStride,
                                    (Cfg::kDqSplitRows ? 0 : Cfg::kDqCols * w) +
                                        kRound * Cfg::kDqRoundCols,
                                    m_block * kBlockM + (Cfg::kDqSplitRows ? 64 * w : 0), head,
                                    seq);
                    tma_store_commit();
                }
            }
#pragma unroll
            for (int w = kFirstLane; w < kFirstLane + kLanes; ++w) {
                if (leader) {
                    if (w + 1 < kFirstLane + kLanes) {
                        tma_store_wait_read<1>();
                    } else {
                        tma_store_wait_read<0>();
                    }
                }
                __syncwarp();
                named_barrier_arrive(writer_free(w, kRound), kWriterSyncThreads);
            }
            if (Cfg::kDeterministic && leader) {
                tma_store_wait<0>();
                pass_turn(p.dq_semaphore + turn);
            }
        }
        // The last reduces must be done before the block exits (and the postprocess reads).
        if (leader) tma_store_wait<0>();
    }

    // ---- Consumer GEMMs -----------------------------------------------------------------------

    // acc[64 x kBlockM] = A B^T over head_dim: A the warpgroup's 64 rows of K or V, B the kBlockM
    // rows of a Q or dO tile, both K-major (k-steps of 32 bytes, four per 128-byte slab).
    static __device__ __forceinline__ void gemm_rows(float (&acc)[kBlockM / 2], uint32_t a_rows,
                                                     uint32_t b_rows) {
        const uint64_t a_desc = wgmma_desc_kmajor<128>(a_rows);
        const uint64_t b_desc = wgmma_desc_kmajor<128>(b_rows);
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            const uint32_t slab = kk / 4;
            const uint32_t step = (kk % 4) * 32;
            Wgmma16<kBlockM>::template ss<kBf16>(
                acc, wgmma_desc_advance(a_desc, slab * kKVSlabBytes + step),
                wgmma_desc_advance(b_desc, slab * kQSlabBytes + step), kk > 0);
        }
    }

    // acc[64 x kDkvCols] += A B over the tile's queries: A as fragments (P^T or dS^T), B the
    // columns of a Q or dO tile from its slab b_tile, read MN-major (k-steps of 16 rows).
    static __device__ __forceinline__ void gemm_fragments(float (&acc)[Cfg::kDkvCols / 2],
                                                          const uint32_t (&a)[kBlockM / 4],
                                                          uint32_t b_tile) {
        const uint64_t b_desc = wgmma_desc_sw128(b_tile, kQSlabBytes, Cfg::kSwizzleAtomBytes);
#pragma unroll
        for (int kk = 0; kk < kBlockM / 16; ++kk) {
            Wgmma16<Cfg::kDkvCols>::template rs<kBf16>(
                acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3],
                wgmma_desc_advance(b_desc, kk * 16 * 128), 1);
        }
    }

    // FP8: acc[64 x kBlockM] = A B^T over head_dim, gemm_rows' product on e4m3 tiles (k-steps of
    // 32 bytes, kRow8Bytes / 32 per swizzle span).
    static __device__ __forceinline__ void gemm_rows_e4m3(float (&acc)[kBlockM / 2],
                                                          uint32_t a_rows, uint32_t b_rows) {
        constexpr int kStepsPerSlab = Cfg::kRow8Bytes / 32;
        const uint64_t a_desc = wgmma_desc_kmajor<Cfg::kRow8Bytes>(a_rows);
        const uint64_t b_desc = wgmma_desc_kmajor<Cfg::kRow8Bytes>(b_rows);
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) {
            const uint32_t slab = kk / kStepsPerSlab;
            const uint32_t step = (kk % kStepsPerSlab) * 32;
            WgmmaE4m3<kBlockM>::ss(acc, wgmma_desc_advance(a_desc, slab * Cfg::kK8SlabBytes + step),
                                   wgmma_desc_advance(b_desc, slab * Cfg::kQ8SlabBytes + step),
                                   kk > 0);
        }
    }

    // FP8: acc[64 x kDkvCols] += A B over the tile's queries, A as e4m3 fragments (P^T or dS^T,
    // accumulator_to_e4m3_a's order), B the warpgroup's rows of a transposed tile (Q^T, dO^T:
    // kBlockM-byte rows, K-major), k-steps of 32 queries.
    static __device__ __forceinline__ void gemm_fragments_e4m3(
        float (&acc)[Cfg::kDkvCols / 2], const uint32_t (&a)[kBlockM / 8], uint32_t bt_rows) {
        const uint64_t b_desc = wgmma_desc_kmajor<kBlockM>(bt_rows);
#pragma unroll
        for (int kk = 0; kk < kBlockM / 32; ++kk) {
            WgmmaE4m3<Cfg::kDkvCols>::rs(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2],
                                         a[4 * kk + 3], wgmma_desc_advance(b_desc, 32 * kk), 1);
        }
    }

    // FP8: the descales a step needs: Q's and dO's of the query tile (per 128 rows at most), K's
    // of the block, V's. The producer reads them ahead and puts them with the step's row values
    // (read by every consumer thread at its step's start, their latency stalled the first
    // GEMMs' results: the kernel ran at 0.89 of the 16-bit one's time).
    struct alignas(16) Fp8Scales {
        float q;
        float qk;
        float dout;
        float dp;  // dP's: V's times dO's

        // (32-bit index arithmetic: the descale arrays are small, and the producer thread that
        // reads them has 24 registers; with 64-bit products it spilled up to 68 bytes.)
        static __device__ __forceinline__ Fp8Scales of(const BwdParams& p, int batch, int head,
                                                       int kv_head, int m_block, int n_block) {
            const int q_block = m_block * kBlockM / 128;
            const int k_block = n_block * kBlockN / 128;
            const float q = __ldg(p.q_descale + (batch * int(p.q_descale_stride_b) +
                                                 head * int(p.q_descale_stride_h) +
                                                 q_block * int(p.q_descale_stride_block)));
            const float k = __ldg(p.k_descale + (batch * int(p.k_descale_stride_b) +
                                                 kv_head * int(p.k_descale_stride_h) +
                                                 k_block * int(p.k_descale_stride_block)));
            const float dout = __ldg(p.dout_descale + (batch * int(p.dout_descale_stride_b) +
                                                       head * int(p.dout_descale_stride_h) +
                                                       q_block * int(p.dout_descale_stride_block)));
            const float v = __ldg(p.v_descale + (batch * int(p.v_descale_stride_b) +
                                                 kv_head * int(p.v_descale_stride_h)));
            return {q, q * k, dout, v * dout};
        }
    };

    // dq[64 r.. x kDqCols] = dS[64 r.., keys] K[keys, columns] for each 64-row block r of `ds`
    // (the warpgroup's first row there): dS K-major from its buffer's key ds_key0 on (slabs of
    // 64 keys), K's rows MN-major from its slab `col_slab` on (16-key k-steps of 16 rows). dS
    // starts at key ds_key0 where both warpgroups hold the same keys and each reads the dS slab
    // it wrote (kSharedKeys).
    // kDqTransposed: dq[0] = dQ^T[64 columns x kBlockM queries] = K^T dS^T, the same two tiles
    // with their roles swapped: K's slab the MN-major A, dS the K-major B.
    using DqTiles = float[Cfg::kDqRowBlocks][Cfg::kDqValues];
    static __device__ __forceinline__ void gemm_dq(DqTiles& dq, uint32_t ds, uint32_t k_tile,
                                                   int ds_key0, int col_slab) {
        const uint64_t ds_desc = wgmma_desc_kmajor<128>(ds);
        const uint64_t k_desc = wgmma_desc_sw128(k_tile + col_slab * kKVSlabBytes, kKVSlabBytes,
                                                 Cfg::kSwizzleAtomBytes);
#pragma unroll
        for (int r = 0; r < Cfg::kDqRowBlocks; ++r) {
#pragma unroll
            for (int kk = 0; kk < Cfg::kDqKeys / 16; ++kk) {
                const uint32_t ds_key = ds_key0 + 16 * kk;
                const uint64_t ds_at = wgmma_desc_advance(
                    ds_desc, r * 64 * 128 + (ds_key / 64) * kDsSlabBytes + (ds_key % 64) * 2);
                const uint64_t k_at = wgmma_desc_advance(k_desc, 16 * kk * 128);
                if constexpr (Cfg::kDqTransposed) {
                    Wgmma16<kBlockM>::template ss<kBf16, false, true>(dq[r], k_at, ds_at, kk > 0);
                } else {
                    Wgmma16<Cfg::kDqCols>::template ss<kBf16, true>(dq[r], ds_at, k_at, kk > 0);
                }
            }
        }
    }

    // ---- Consumer -----------------------------------------------------------------------------

    struct Consumer {
        using Tiles = float[kBlockM / 8][4];

        uint8_t* smem;
        Barriers& bars;
        int wg;    // which consumer warpgroup: keys 64 wg.. of the block, or columns (kSharedKeys)
        int warp;  // warp within the warpgroup: keys 16 warp.. of the warpgroup's
        int lane;
        float dk[Cfg::kDkvCols / 2];
        float dv[Cfg::kDkvCols / 2];
        // FP8: the units of dK's accumulator rows (h = 0, 1 of the thread's) and of dV's, the
        // last step's scales; 0 before the first.
        float dk_unit[2];
        float dv_unit;
        Ring ring;

        __device__ __forceinline__ void release() const {
            if (lane == 0) bars.q_do.consumer_release(ring);
        }

        // One step: query tile m_block of q head `head` (its (Q, dO) in the ring's next slot).
        __device__ __forceinline__ void step(const BwdParams& p, const Info& info,
                                             const BwdWalk& walk, int kv_head, int head,
                                             int m_block, const BwdSeq& seq, int step_index) {
            const int query0 = m_block * kBlockM + 2 * (lane % 4);  // the thread's first column
            const int first_key = walk.n_block * kBlockN + key0() + 16 * warp + lane / 4;
            // The step's LSE log2 (then D) at the thread's columns 8 i + 2 t, + 1.
            const uint32_t row_values = smem_addr(smem + kRowValuesOffset) +
                                        ring.stage() * Cfg::kRowValuesBytes + 8 * (lane % 4);
            const uint32_t k_tile = smem_addr(smem + kKOffset);
            const uint32_t v_tile = smem_addr(smem + kVOffset);
            const uint32_t q_tile = smem_addr(smem + kQOffset + ring.stage() * kQBytes);
            const uint32_t do_tile = smem_addr(smem + kDoOffset + ring.stage() * kQBytes);
            const uint32_t rows = key0() * 128;  // this warpgroup's keys within a K / V slab
            // this warpgroup's dK / dV columns within a Q / dO tile
            const uint32_t dkv_cols =
                Cfg::kSharedKeys ? wg * (Cfg::kDkvCols / 64) * kQSlabBytes : 0;

            float s[kBlockM / 2];
            float dp[kBlockM / 2];
            Fp8Scales scales{};
            float scale_log2 = p.scale_log2;
            bars.q_do.consumer_wait(ring);
            if constexpr (Cfg::kFp8) {
                scales = *reinterpret_cast<const Fp8Scales*>(
                    smem + kRowValuesOffset + ring.stage() * Cfg::kRowValuesBytes +
                    2 * kBlockM * 4);
            }
            wgmma_fence();
            if constexpr (Cfg::kFp8) {
                const uint32_t rows8 = key0() * Cfg::kRow8Bytes;
                gemm_rows_e4m3(s, smem_addr(smem + kK8Offset) + rows8, q_tile);
                wgmma_commit();
                gemm_rows_e4m3(dp, smem_addr(smem + kV8Offset) + rows8, do_tile);
                wgmma_commit();
                scale_log2 *= scales.qk;
            } else {
                gemm_rows(s, k_tile + rows, q_tile);
                wgmma_commit();
                gemm_rows(dp, v_tile + rows, do_tile);
                wgmma_commit();
            }
            // The step's LSE at the thread's columns, read while the GEMMs run: read where it is
            // used, its latency stalled the exponents' arithmetic (ncu, head_dim 128 at 64 rows:
            // 8% of the stall samples). At 64 query rows a step only (now head_dim 256): at 80
            // (head_dim 128) it spills 92 bytes, and reading part of it ahead measured level; at
            // 128 (head_dim 64) it spills.
            constexpr bool kEarly = kBlockM == 64;
            ColumnValues<kEarly, kBlockM / 8> lse_log2{row_values};
            lse_log2.read_ahead();
            wgmma_wait<1>();
            wgmma_fence_operand(s);

            // P^T, rounded to the A fragments of dV's GEMM; the softcap before the mask, as in the
            // forward, so that masked scores stay -inf.
            if (Cfg::kOptions && p.softcap_scale != 0.0f) {
                apply_softcap(reinterpret_cast<float(&)[1][kBlockM / 8][4]>(s), p.softcap_scale);
            }
            if (info.needs_mask(m_block, walk.n_block)) {
                apply_mask_transposed(reinterpret_cast<Tiles&>(s), info.mask, first_key, query0);
            }
            uint32_t pt[kBlockM / 4];
            recompute_probabilities_transposed(reinterpret_cast<Tiles&>(s), lse_log2,
                                               scale_log2);
#pragma unroll
            for (int j = 0; j < kBlockM / 4; ++j) pt[j] = pack_f32x2<kBf16>(s[2 * j], s[2 * j + 1]);
            // FP8: 256 P^T as e4m3 fragments, from the 16-bit pairs (from S^T's registers, held
            // longer, it spilled up to 232 bytes at head_dim 64), and dV's accumulator in the
            // units of this step's dO descale.
            uint32_t pt8[Cfg::kFp8 ? kBlockM / 8 : 1];
            if constexpr (Cfg::kFp8) {
                dv_unit = rescale_to<-1>(dv, dv_unit, scales.dout);
                pairs_to_e4m3_fragments<!kBf16>(pt8, pt, Cfg::kPScale, Cfg::kPScale);
            }
            // D likewise, once S^T's registers are free, ahead of dV's GEMM.
            ColumnValues<kEarly, kBlockM / 8> dpsum{row_values + 4 * kBlockM};
            dpsum.read_ahead();
            wgmma_fence();
            if constexpr (Cfg::kFp8) {
                gemm_fragments_e4m3(dv, pt8, do_tile + Cfg::kQ8Bytes + dkv_rows_t());
            } else {
                gemm_fragments(dv, pt, do_tile + dkv_cols);
            }
            wgmma_commit();
            wgmma_wait<1>();
            wgmma_fence_operand(dp);
            // dS^T = P^T (dP^T - D), as A fragments of dK's GEMM and, transposed, into dS.
            uint32_t dst[kBlockM / 4];
            // FP8: also as e4m3 fragments for dK's GEMM, each key row scaled by its unit.
            uint32_t dst8[Cfg::kFp8 ? kBlockM / 8 : 1];
            if constexpr (Cfg::kFp8) {
                score_gradient_e4m3(dst, dst8, reinterpret_cast<const Tiles&>(dp), pt, dpsum,
                                    scales);
            } else if (Cfg::kOptions && p.softcap_scale != 0.0f) {
                // The LSE again, from shared memory: held from P's recompute, it would take
                // registers through dV's GEMM.
                using Lse = ColumnValues<false, kBlockM / 8>;
                score_gradient_transposed<kBf16>(
                    dst, reinterpret_cast<const Tiles&>(dp), pt, dpsum,
                    SoftcapColumns<Lse>{Lse{row_values}, SoftcapSlope{__frcp_rn(p.scale_log2)}});
            } else {
                score_gradient_transposed<kBf16>(dst, reinterpret_cast<const Tiles&>(dp), pt,
                                                 dpsum);
            }
            // dS^T's 8x8 matrices (keys 16 warp + 8 h.., queries 8 i..) land transposed in this
            // warpgroup's slab of the step's dS buffer: stmatrix x4 number x takes i = 2x, 2x + 1.
            const uint32_t ds =
                smem_addr(smem + kDsOffset + (step_index % Cfg::kDsBuffers) * kDsBytes);
            if constexpr (Cfg::kSharedKeys) {
                // The warpgroup's dS slab is also its dQ staging: the step before's reduces must
                // have read it.
                if constexpr (Cfg::kDqWriter) {
                    if (step_index > 0) {
                        named_barrier_sync(writer_free(wg, Cfg::kDqRounds - 1),
                                           kWriterSyncThreads);
                    }
                } else {
                    if (dq_issuer()) tma_store_wait_read<0>();
                    named_barrier_sync(kDqBarrier + wg, 128);
                }
            }
            {
                const int matrix = lane / 8;
                const uint32_t slab = ds + wg * kDsSlabBytes;
#pragma unroll
                for (int x = 0; x < kBlockM / 16; ++x) {
                    const int i = 2 * x + matrix / 2;
                    stmatrix_x4_trans(slab + swizzled_offset<128>(8 * i + lane % 8,
                                                                  2 * warp + matrix % 2),
                                      dst[4 * x], dst[4 * x + 1], dst[4 * x + 2],
                                      dst[4 * x + 3]);
                }
            }
            fence_proxy_async();
            // The dS barrier also tells the warpgroup that its dQ staging is free again: its
            // last TMA reduce has read it (kDqWriter: the writer warp's barriers do).
            if (!Cfg::kDqWriter && !Cfg::kSharedKeys && dq_issuer()) tma_store_wait_read<0>();
            if constexpr (Cfg::kOwnDs) {
                named_barrier_sync(kDsBarrier + wg, 128);
            } else {
                named_barrier_sync(kDsBarrier, 128 * Cfg::kConsumers);
            }
            // dQ's accumulators take P^T's registers once dV's GEMM is done with them (at 128
            // rows a step, holding both spilled). dQ goes first and dK after it, so that dQ is
            // staged and its reduce issued while dK's GEMM runs on; dK's reads Q, so the ring
            // slot is released only after it.
            wgmma_wait<0>();
            wgmma_fence_operand(dv);
            DqTiles dq;
            wgmma_fence();
            gemm_dq(dq, ds + (Cfg::kDqSplitRows ? wg * 64 * 128 : 0), k_tile,
                    Cfg::kOwnDs ? 64 * wg : 0, Cfg::kDqSplitRows ? 0 : wg * (Cfg::kDqCols / 64));
            wgmma_commit();
            if constexpr (Cfg::kFp8) {
                gemm_fragments_e4m3(dk, dst8, q_tile + Cfg::kQ8Bytes + dkv_rows_t());
            } else {
                gemm_fragments(dk, dst, q_tile + dkv_cols);
            }
            wgmma_commit();
            wgmma_wait<1>();
#pragma unroll
            for (int r = 0; r < Cfg::kDqRowBlocks; ++r) wgmma_fence_operand(dq[r]);
            if constexpr (Cfg::kDqWriter) {
                hand_dq_to_writer(dq, step_index == 0);
            } else {
                reduce_dq(p, dq, m_block, head, seq);
            }
            wgmma_wait<0>();
            wgmma_fence_operand(dk);
            release();
            ++ring.count;
        }

        // The first of the warpgroup's keys within the block.
        __device__ __forceinline__ int key0() const {
            return Cfg::kSharedKeys ? 0 : 64 * wg;
        }

        // FP8: this warpgroup's dK / dV columns as rows of a transposed (Q^T, dO^T) tile.
        __device__ __forceinline__ uint32_t dkv_rows_t() const {
            return Cfg::kSharedKeys ? wg * Cfg::kDkvCols * kBlockM : 0;
        }

        // FP8: dK's and dV's accumulators are kept in the units of their last step (a unit
        // times an e4m3 product is the true value): the thread's row kRow (0 or 1; -1 both)
        // moves from `unit` to the step's `next` before the step adds into it. A `next` of 0 (a
        // step that adds nothing there: a row of dS all zero) keeps the unit. (Units that only
        // grow, rescaling in few steps, measured level: the kernel is not bound by its
        // instructions; and fresh units are the recipe the tests emulate, up to the FP32
        // rounding of the amax.)
        template <int kRow>
        static __device__ __forceinline__ float rescale_to(float (&acc)[Cfg::kDkvCols / 2],
                                                           float unit, float next) {
            if (next == 0.0f) return unit;
            const float ratio = unit / next;  // 0 before the first step: the row is 0
#pragma unroll
            for (int i = 0; i < Cfg::kDkvCols / 8; ++i) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (kRow < 0 || c / 2 == kRow) acc[4 * i + c] *= ratio;
                }
            }
            return next;
        }

        // FP8: dS^T = P^T (dP^T v dO - D) (dP^T from the e4m3 GEMM, v and dO its descales),
        // as the 16-bit pairs dQ's GEMM reads (score_gradient_transposed's) and as dK's e4m3 A
        // fragments, each key row divided by its scale: its amax over the step's queries (held
        // by the quad's four threads) / 448, rounded up to a power of two so that the division
        // is exact; dK's row unit is that times Q's descale. The fragments are made from the
        // pairs: dS^T held in FP32 until the amax is known spilled up to 176 bytes.
        template <class Dpsum>
        __device__ __forceinline__ void score_gradient_e4m3(
            uint32_t (&dst)[kBlockM / 4], uint32_t (&dst8)[kBlockM / 8], const Tiles& dp,
            const uint32_t (&pt)[kBlockM / 4], const Dpsum& dpsum_of, const Fp8Scales& scales) {
            float amax[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < kBlockM / 8; ++i) {
                const float2 dpsum = dpsum_of(i);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 pair = unpack_f32x2<kBf16>(pt[2 * i + h]);
                    const float x = pair.x * fmaf(dp[i][2 * h], scales.dp, -dpsum.x);
                    const float y = pair.y * fmaf(dp[i][2 * h + 1], scales.dp, -dpsum.y);
                    amax[h] = fmaxf(amax[h], fmaxf(fabsf(x), fabsf(y)));
                    dst[2 * i + h] = pack_f32x2<kBf16>(x, y);
                }
            }
            float inv[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
                amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // the least power of two at least amax / 448, and at least the least normal
                // float (where amax / 448 is subnormal or 0 the bits would not round up)
                const float row_scale = __uint_as_float(
                    (__float_as_uint(fmaxf(amax[h] * (1.0f / kE4m3Max), Cfg::kLeastNormal)) +
                     0x007fffffu) &
                    0xff800000u);
                inv[h] = amax[h] > 0.0f ? __frcp_rn(row_scale) : 0.0f;
                const float next = amax[h] > 0.0f ? row_scale * scales.q : 0.0f;
                dk_unit[h] = h ? rescale_to<1>(dk, dk_unit[h], next)
                               : rescale_to<0>(dk, dk_unit[h], next);
            }
            pairs_to_e4m3_fragments(dst8, dst, inv[0], inv[1]);
        }

        // FP8: an accumulator tile's 16-bit pairs (pair 2 i + h: row h of column tile i) times
        // scale_h as e4m3 A fragments, in accumulator_to_e4m3_a's order: b32 4 kk + 2 x + h
        // holds row h of column tiles 4 kk + 2 x and 4 kk + 2 x + 1.
        // kF16Scale: f16 pairs scaled in f16 (scale0 == scale1, and every product within f16:
        // P's, at most 256), two instructions a pair.
        template <bool kF16Scale = false>
        static __device__ __forceinline__ void pairs_to_e4m3_fragments(
            uint32_t (&fragments)[kBlockM / 8], const uint32_t (&pairs)[kBlockM / 4],
            float scale0, float scale1) {
            static_assert(!kF16Scale || !kBf16, "f16 pairs");
#pragma unroll
            for (int kk = 0; kk < kBlockM / 32; ++kk) {
                if constexpr (kF16Scale) {
                    const uint32_t scale = pack_f32x2<false>(scale0, scale0);
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            fragments[4 * kk + 2 * x + h] = scaled_f16x2_to_e4m3x4(
                                pairs[2 * (4 * kk + 2 * x) + h],
                                pairs[2 * (4 * kk + 2 * x + 1) + h], scale);
                        }
                    }
                    continue;
                }
#pragma unroll
                for (int x = 0; x < 2; ++x) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float scale = h ? scale1 : scale0;
                        const float2 a = unpack_f32x2<kBf16>(pairs[2 * (4 * kk + 2 * x) + h]);
                        const float2 b = unpack_f32x2<kBf16>(pairs[2 * (4 * kk + 2 * x + 1) + h]);
                        fragments[4 * kk + 2 * x + h] =
                            e4m3x4(a.x * scale, a.y * scale, b.x * scale, b.y * scale);
                    }
                }
            }
        }

        // The thread of each consumer warpgroup that issues its dQ reduces.
        __device__ __forceinline__ bool dq_issuer() const {
            return warp == 0 && lane == 0;
        }

        // dQ of the step staged in shared memory (the TMA box layout: 128-byte rows of 32
        // floats, 16-byte chunks swizzled by row % 8, so a warp's stores hit distinct banks) and
        // added into the accumulator by one TMA reduce a box, round by round; rows past
        // seqlen_q are clipped. (Deterministic sums are the writer warp's.)
        __device__ __forceinline__ void reduce_dq(const BwdParams& p, DqTiles& dq, int m_block,
                                                  int head, const BwdSeq& seq) const {
            static_assert(Cfg::kSharedKeys && !Cfg::kDeterministic,
                          "head_dim 256 only: the writer warp reduces the others' dQ and takes "
                          "the turns");
            uint8_t* staging = smem + kDqStagingOffset + wg * kDqStagingStride;
            const int col0 = Cfg::kDqCols * wg;
#pragma unroll
            for (int round = 0; round < Cfg::kDqRounds; ++round) {
                if (round > 0) {
                    if (dq_issuer()) tma_store_wait_read<0>();
                    named_barrier_sync(kDqBarrier + wg, 128);
                }
                stage_dq(staging, dq, round);
                fence_proxy_async();
                named_barrier_sync(kDqBarrier + wg, 128);
                if (dq_issuer()) {
                    issue_dq_reduce(p, staging, col0 + round * Cfg::kDqRoundCols,
                                    m_block * kBlockM, head, seq);
                    tma_store_commit();
                }
            }
        }

        // Rows 64 r + 8 h + (16 warp + g) of the warpgroup's dQ in the staging layout, each
        // thread's columns 8 i + 2 t, + 1 at chunk (2 (i % 4) + t / 2) ^ g, g = lane / 4 being
        // every row of the thread mod 8: the chunk takes four values, and the rest are constants.
        // (Left to swizzled_offset, ptxas kept one address per store live across the loop and
        // spilled at 128 rows a step.) A 64-bit store is served by half-warps, and rows g and
        // g ^ 1 of one half put the same i on the same two chunks, which made every store two-way
        // conflicted (ncu: 2^27 excess wavefronts, 9% of the head_dim 128 kernel's shared-memory
        // traffic). So in store i the threads of odd g store their columns 8 (i ^ 2) + 2 t, the
        // others 8 i + 2 t: each half-warp's sixteen 8-byte stores then fill the 32 banks once.
        // Round `round` stages columns kDqRoundCols round.. .
        __device__ __forceinline__ void stage_dq(uint8_t* staging, DqTiles& dq,
                                                 int round = 0) const {
            if constexpr (Cfg::kDqTransposed) {
                static_assert(Cfg::kDqRounds == 1, "dQ^T is staged whole, as it is");
                stage_dq_transposed(staging, dq[0]);
                return;
            }
            static_assert(Cfg::kDqRoundCols % 32 == 0, "i ^ 2 stays in i's box of 32 columns");
            const int g = lane / 4;
            const bool flip = g & 1;
            const uint32_t thread_row = smem_addr(staging) + (16 * warp + g) * 128 + 8 * (lane % 2);
            uint32_t chunk[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                chunk[c] = 16 * ((2 * (flip ? c ^ 2 : c) + (lane % 4) / 2) ^ g);
            }
#pragma unroll
            for (int r = 0; r < Cfg::kDqRowBlocks; ++r) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int i = 0; i < Cfg::kDqRoundCols / 8; ++i) {
                        const uint32_t addr = thread_row + chunk[i % 4] +
                                              (i / 4) * kDqBoxStride + (64 * r + 8 * h) * 128;
                        const int j = round * (Cfg::kDqRoundCols / 8) + i;
                        const int j_flipped = round * (Cfg::kDqRoundCols / 8) + (i ^ 2);
                        const int at = 4 * j + 2 * h;
                        const int at_flipped = 4 * j_flipped + 2 * h;
                        const float x = flip ? dq[r][at_flipped] : dq[r][at];
                        const float y = flip ? dq[r][at_flipped + 1] : dq[r][at + 1];
                        st_shared_f32x2(addr, x, y);
                    }
                }
            }
        }

        // dQ^T's accumulators, dq_t[4 i + 2 h + e] = dQ[query 8 i + 2 t + e][column 16 warp +
        // 8 h + g], staged in the same box layout one float a store (the columns a thread holds
        // are 8 apart, no pair adjacent): column c of the warpgroup's 64 is word c % 4 of chunk
        // c % 32 / 4 in box c / 32, of row q, at chunk (c % 32 / 4) ^ (q % 8). A store's 32
        // lanes write rows 2 t + e (mod 8), columns g of two chunks: the swizzle puts them on 32
        // distinct banks.
        __device__ __forceinline__ void stage_dq_transposed(
            uint8_t* staging, const float (&dq_t)[kBlockM / 2]) const {
            const int g = lane / 4;
            const int t = lane % 4;
            const uint32_t base =
                smem_addr(staging) + (warp / 2) * Cfg::kDqBoxBytes + 4 * (g % 4);
            uint32_t offset[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int row = 2 * t + e;
                    const int chunk = 4 * (warp % 2) + 2 * h + g / 4;
                    offset[h][e] = row * 128 + 16 * (chunk ^ row);
                }
            }
#pragma unroll
            for (int i = 0; i < kBlockM / 8; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        st_shared_b32(base + offset[h][e] + 1024 * i,
                                      __float_as_uint(dq_t[4 * i + 2 * h + e]));
                    }
                }
            }
        }

        // kDqWriter: the block's dQ of the step staged for the writer warp (write_dq) once it
        // has freed the staging of the step before. Split by columns or rows (head_dims 128 and
        // 64), each warpgroup stages its part. Over shared keys (256, deterministic sums) each
        // stages its columns in two rounds, in its dS slab (freed before the step wrote dS) and
        // box.
        __device__ __forceinline__ void hand_dq_to_writer(DqTiles& dq, bool first_step) const {
            if constexpr (Cfg::kSharedKeys) {
#pragma unroll
                for (int round = 0; round < Cfg::kDqRounds; ++round) {
                    if (round > 0) {
                        named_barrier_sync(writer_free(wg, round - 1), kWriterSyncThreads);
                    }
                    stage_dq(smem + kDqStagingOffset + wg * kDqStagingStride, dq, round);
                    fence_proxy_async();
                    named_barrier_arrive(writer_full(wg, round), kWriterSyncThreads);
                }
                return;
            }
            if (!first_step) named_barrier_sync(writer_free(wg, 0), kWriterSyncThreads);
            stage_dq(smem + kDqOffset + wg * Cfg::kDqStageBytes, dq);
            fence_proxy_async();
            named_barrier_arrive(writer_full(wg, 0), kWriterSyncThreads);
        }

        // kDqWriter, after the last step: the stagings are free for dK and dV (the writer's
        // last reduces have read them; at head_dim 256, which stages dK and dV in the ring, this
        // closes the writer's last round).
        __device__ __forceinline__ void wait_dq_staging_free() const {
            named_barrier_sync(writer_free(wg, Cfg::kDqRounds - 1), kWriterSyncThreads);
        }

        // dK (times softmax_scale) and dV of the warpgroup's 64 keys, staged in its dQ staging
        // (free once its last reduce has read it) and written by TMA stores, which clip keys
        // past seqlen_k. (From registers, 4-byte stores, the epilogue of a seqlen-2048 block took
        // a few percent of its time.)
        // kSharedKeys has no dQ staging: once both warpgroups are past their last step, the
        // (Q, dO) ring's first stage is free (every load was waited for) and stages both.
        // Packed sequences end before the arrays do, so the block that runs past its sequence's
        // last key stores from registers, keys past it dropped (the forward's output likewise).
        __device__ __forceinline__ void store(const BwdParams& p, int n_block, int kv_head,
                                              const BwdSeq& seq) const {
            if (Cfg::kOptions && p.cu_seqlens_k != nullptr &&
                (n_block + 1) * kBlockN > seq.lens.seqlen_k) {
                store_from_registers(p, n_block, kv_head, seq);
                return;
            }
            using Output = StagedTmaStore<Cfg::kDkvCols, kBf16>;
            using Rows = float[Cfg::kDkvCols / 8][4];
            uint8_t* staging;
            if constexpr (Cfg::kSharedKeys) {
                static_assert(Cfg::kConsumers * Output::kBytes <= kQBytes, "dK / dV staging");
                named_barrier_sync(kConsumersDone, 128 * Cfg::kConsumers);
                staging = smem + kQOffset + wg * Output::kBytes;
            } else {
                static_assert(Output::kBytes <= Cfg::kDqStageBytes, "dK / dV staging");
                staging = smem + kDqOffset + wg * Cfg::kDqStageBytes;
            }
            const Output output{staging, kDqBarrier + wg};
            const int first_key = n_block * kBlockN + key0();
            const int col0 = Cfg::kSharedKeys ? wg * Cfg::kDkvCols : 0;
            // FP8: the accumulators' units
            const float dk_scale[2] = {p.softmax_scale * (Cfg::kFp8 ? dk_unit[0] : 1.0f),
                                       p.softmax_scale * (Cfg::kFp8 ? dk_unit[1] : 1.0f)};
            const float dv_unit_scale = Cfg::kFp8 ? dv_unit / Cfg::kPScale : 1.0f;
            const float dv_scale[2] = {dv_unit_scale, dv_unit_scale};
            const int first_row = seq.lens.offset_k + first_key;
            output.store(reinterpret_cast<const Rows&>(dk), dk_scale, &p.dk_map, kv_head,
                         first_row, seq.batch_coord, col0);
            output.store(reinterpret_cast<const Rows&>(dv), dv_scale, &p.dv_map, kv_head,
                         first_row, seq.batch_coord, col0);
            output.finish();
        }

        // store()'s direct path: the thread's rows 16 warp + lane / 4 (+ 8) of the warpgroup's
        // keys, 4 bytes of a row at a time.
        __device__ __forceinline__ void store_from_registers(const BwdParams& p, int n_block,
                                                             int kv_head,
                                                             const BwdSeq& seq) const {
            using Rows = float[Cfg::kDkvCols / 8][4];
            const int col0 = Cfg::kSharedKeys ? wg * Cfg::kDkvCols : 0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = n_block * kBlockN + key0() + 16 * warp + lane / 4 + 8 * h;
                if (key >= seq.lens.seqlen_k) continue;
                const int64_t row = seq.lens.offset_k + key;
                uint16_t* dk_row = static_cast<uint16_t*>(p.dk) + seq.batch_coord * p.dk_stride_b +
                                   row * p.dk_stride_s + kv_head * p.dk_stride_h + col0;
                uint16_t* dv_row = static_cast<uint16_t*>(p.dv) + seq.batch_coord * p.dv_stride_b +
                                   row * p.dv_stride_s + kv_head * p.dv_stride_h + col0;
                store_accumulator_row<kBf16>(dk_row, reinterpret_cast<const Rows&>(dk), h,
                                             p.softmax_scale, lane, p.head_dim - col0);
                store_accumulator_row<kBf16>(dv_row, reinterpret_cast<const Rows&>(dv), h, 1.0f,
                                             lane, p.head_dim_v - col0);
            }
        }

        // Every step of the block's walk, then nothing pending in the ring. K and V are waited for
        // even with no step, so no TMA load outlives the block.
        __device__ __forceinline__ void run(const BwdParams& p, const Info& info,
                                            const BwdWalk& walk, const BwdSteps& steps,
                                            int kv_head, const BwdSeq& seq) {
#pragma unroll
            for (int i = 0; i < Cfg::kDkvCols / 2; ++i) {
                dk[i] = 0.0f;
                dv[i] = 0.0f;
            }
            dk_unit[0] = dk_unit[1] = dv_unit = 0.0f;
            bars.kv_full.wait(0);
            // The walk as a cursor: a causal step needs its tile for the mask as soon as S^T
            // lands, and m_block()'s division sat on that path (with the cursor head_dim 64
            // causal measured 1.01-1.04x, 256 1.00-1.03x). The producer and the writers keep the
            // divisions: the cursor there measured 0.97-0.99x at head_dim 128 and spilled the
            // writer's registers.
            BwdSteps::Cursor at = steps.start(kv_head, p.q_per_kv);
#pragma unroll 1
            for (int i = 0; i < steps.count; ++i, steps.next(at)) {
                step(p, info, walk, kv_head, at.head, at.m_block, seq, i);
            }
            if constexpr (Cfg::kDqWriter) {
                if (steps.count > 0) wait_dq_staging_free();
            } else {
                // The last reduces must be done before the block exits (and the postprocess
                // reads).
                if (dq_issuer()) tma_store_wait<0>();
            }
        }
    };
};

}  // namespace ptxattn
