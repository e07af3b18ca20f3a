// Attention forward for Hopper (sm_90a): TMA + mbarrier pipeline, wgmma, warp specialisation.
//
// A block computes tiles of kBlockM = 64 * CONSUMERS query rows (128 or 192) of one
// (batch, head) with 1 + CONSUMERS warpgroups:
//   warpgroup 0  producer: gives most of its registers away (setmaxnreg) and one thread issues
//                TMA loads: each tile's Q, then K and V tiles of kBlockN keys through a
//                kStages-deep ring of shared-memory buffers guarded by full/empty mbarriers.
//   warpgroups 1 ..  consumers: each owns 64 query rows. S = Q K^T is a wgmma with K in shared
//                memory and Q there too, or (Q_IN_REGISTERS) in registers; P = softmax(S) stays
//                in registers and O += P V is a wgmma with A from registers and V from shared
//                memory (16-bit: read transposed, MN-major; FP8: the transposed copy Vt).
// Schedule (FlashAttention-3): within a warpgroup the GEMMs of key block j+1 (Q K^T) and of
// block j (P V) are issued together and the softmax of block j+1 runs while P V is in flight
// (softmax.cuh only asks for O to be rescaled when a row max grew enough to matter);
// the consumer warpgroups run free of each other, so one's softmax overlaps the others' GEMMs
// on the tensor cores' queue. (FlashAttention-3 orders them strictly, warpgroup after
// warpgroup, with named barriers; measured here on an H100 that ordering cost 2-12%, most with
// FP8, so it is not used. Three consumers give each softmax more GEMMs to hide under, for head
// dims whose GEMMs are short next to the softmax.)
// Key blocks are visited from the last to the first, so the blocks that need a mask (the
// seqlen_k tail, the causal diagonal) come first and the rest run mask-free.
// Tiles: the grid is either one block per tile or persistent (fewer blocks going through the
// tile list, in a static order or taking the next unclaimed tile as they free up); the K/V
// ring and its phases run on across tiles, the producer loads the next tile's Q as soon as
// every consumer finished its last Q K^T (q_empty), and the epilogue hands O to a TMA store
// (or, where shared memory has no room to stage it, stores it straight from registers), so
// nothing waits for the output to drain.
//
// FP8 (IS_FP8 = 1): q, k, v are e4m3 and both GEMMs are e4m3 wgmmas (k-steps of 32) with FP32
// accumulation. FP8 wgmma reads B only K-major, so V is transposed in shared memory inside the
// pipeline: the producer warpgroup, idle apart from its TMA thread, turns each landed V tile
// [keys x d] into Vt [d x keys] (transpose_e4m3.cuh; one more ring of buffers with its own
// full/empty barriers) and the consumers read Vt. P is rounded to e4m3 in registers straight
// from the S accumulator; the key order transpose_e4m3 gives Vt makes that a pure conversion.
// The FP8 wgmma keeps fewer bits of its FP32 accumulator than an FP32 add would (about 14, and
// it truncates; the DeepSeek-V3 report measured this), so the error of S grows with the number
// of k-steps chained into one accumulator: head_dim 256's 8 k-steps lose about twice what
// head_dim 128's 4 do, visible in the LSE of large scores. So each 128-column slab of head_dim
// accumulates into its own registers and the slabs are summed with FP32 adds ("promotion").
// Descales are applied in FP32: q's (per tile) and k's (per key block) fold into the softmax's
// score scale, v's multiplies the output in the epilogue. k's may vary per 128 keys only when
// BLOCK_N divides 128 (the launcher picks such a variant then).
//
// Compile-time parameters (-D): HEAD_DIM (64, 128, 256), BLOCK_N (keys per tile, multiple of
// 16; FP8: of 32), STAGES (K/V ring depth), IS_FP8 (1: e4m3 inputs), IS_BF16 (1: bfloat16,
// 0: float16; the inputs' type, or with FP8 the output's), IS_CAUSAL, CONSUMERS (consumer
// warpgroups, 2 or 3), STAGED_OUT (1: the output goes through shared memory and a TMA store),
// STALE_MAX_FIRST (1: past a tile's masked blocks and its first unmasked one, the softmax first
// keeps the row maxima and skips its max pass, see Consumer::step), Q_IN_REGISTERS (1, FP8:
// Q K^T takes Q from registers, see Consumer::load_q), SMEM_BYTES (the dynamic
// shared memory the launcher requests, checked against the layout below).
//
// Global layouts: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D), read through 4-d tensor maps with
// coordinates (d, head, row, batch) and a box of one swizzle span of columns (128 bytes, or the
// whole 64-byte row of FP8 head_dim 64), so a row of head_dim takes kSlabs boxes ("slabs");
// rows past the end are zero-filled. out (B, Sq, Hq, D) 16-bit, through its own tensor map
// (STAGED_OUT; rows past the end are clipped) or its element strides;
// lse (B, Hq, Sq) fp32, contiguous. FP8 descales: float32 arrays read through element strides
// over (batch, head, 128-row block), 0 where a scale does not vary (ptxattn/fp8.py).
#include "common.cuh"
#include "mbarrier.cuh"
#include "mma_sync.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "transpose_e4m3.cuh"
#include "warpgroup.cuh"
#include "wgmma.cuh"
#include "wgmma_fp8.cuh"

namespace ptxattn {
namespace fwd_sm90 {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kBlockN = BLOCK_N;
constexpr int kStages = STAGES;
constexpr bool kFp8 = IS_FP8 != 0;
constexpr bool kBf16 = IS_BF16 != 0;
constexpr bool kCausal = IS_CAUSAL != 0;
constexpr bool kStaleMaxFirst = STALE_MAX_FIRST != 0;
constexpr bool kQInRegisters = Q_IN_REGISTERS != 0;
static_assert(!kQInRegisters || kFp8, "Q in registers: FP8 builds only (its A fragment layout)");

constexpr int kConsumers = CONSUMERS;  // consumer warpgroups
constexpr int kRowsPerConsumer = 64;  // one wgmma M
constexpr int kBlockM = kConsumers * kRowsPerConsumer;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kConsumerWarps = 4 * kConsumers;
static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");

constexpr int kElemBytes = kFp8 ? 1 : 2;
constexpr uint32_t kRowBytes = kHeadDim * kElemBytes;
constexpr uint32_t kSlabRowBytes = kRowBytes < 128 ? kRowBytes : 128;  // one swizzle span
constexpr int kSlabs = kRowBytes / kSlabRowBytes;
constexpr int kSlabCols = kSlabRowBytes / kElemBytes;
constexpr uint32_t kQSlabBytes = kBlockM * kSlabRowBytes;
constexpr uint32_t kQBytes = kQSlabBytes * kSlabs;
constexpr uint32_t kKVSlabBytes = kBlockN * kSlabRowBytes;
constexpr uint32_t kKVBytes = kKVSlabBytes * kSlabs;
// FP8 Vt: head_dim rows of keys, in regions of one swizzle span of keys (transpose_e4m3.cuh).
constexpr uint32_t kVtRowBytes = kBlockN < 128 ? kBlockN : 128;
constexpr uint32_t kVtRegionBytes = kHeadDim * kVtRowBytes;
constexpr uint32_t kVtBytes = kFp8 ? kVtRegionBytes * ((kBlockN + 127) / 128) : 0;
constexpr uint32_t kSwizzleAtomBytes = 1024;
constexpr int kScaleBlockRows = 128;  // rows sharing one FP8 "block" descale (ptxattn/fp8.py)

static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head_dim must be 64, 128 or 256");
static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "BLOCK_N must be a multiple of 16, <= 256");
static_assert(kKVSlabBytes % kSwizzleAtomBytes == 0, "tiles must stay 1024-byte aligned");
static_assert(!kFp8 || (kBlockN % 32 == 0 && (kBlockN >= 128 || kBlockN == 64)),
              "FP8: k-steps of 32 keys; Vt rows of 64 or 128 keys (one swizzle span)");

struct Barriers {
    MBarrier q_full;
    MBarrier q_empty;
    MBarrier k_full[kStages];
    MBarrier k_empty[kStages];
    MBarrier v_full[kStages];
    MBarrier v_empty[kStages];
    // Dynamic tile order (TileSource): the tile the producer took, for the other warps.
    MBarrier tile_full[2];
    MBarrier tile_empty[2];
    int tile[2];
    // FP8: the number of V tiles the producer loaded in all, set before its closing arrive on
    // the v_full barrier of the next ring position, which carries no tile: the V transposers
    // stop at that position (they follow the V ring alone, see transpose_v_tiles). Comparing
    // positions, not testing a flag, keeps a transposer still short of the last tile from
    // stopping early when the flag is already set. A transposer reads it while the producer may
    // write it, so both access it atomically (no data race, and racecheck stays quiet).
    int v_end;
};

// FP8 only: the transposed V ring, filled by the producer warpgroup, drained by the consumers.
struct VtBarriers {
    MBarrier full[kStages];
    MBarrier empty[kStages];
};

// Shared memory: [Q | K stage 0..S-1 | V stage 0..S-1 | (FP8) Vt stage 0..S-1 | barriers],
// after aligning the base to 1024 bytes (the swizzle atom), which may cost up to 1024 bytes of
// the allocation.
constexpr uint32_t kKOffset = kQBytes;
constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
constexpr uint32_t kVtOffset = kVOffset + kStages * kKVBytes;
// STAGED_OUT = 1: each consumer warpgroup stages its 64 x head_dim output tile here, in 128-byte
// swizzled slabs of 64 columns (one TMA box each), for a TMA store (see Consumer::epilogue).
constexpr bool kStagedOut = STAGED_OUT != 0;
constexpr uint32_t kOutSlabBytes = 64 * 128;
constexpr uint32_t kOutBytes = kOutSlabBytes * (kHeadDim / 64);  // per consumer warpgroup
constexpr uint32_t kOutOffset = kVtOffset + kStages * kVtBytes;
constexpr uint32_t kBarrierOffset = kOutOffset + (kStagedOut ? kConsumers * kOutBytes : 0);
constexpr uint32_t kVtBarrierOffset = kBarrierOffset + sizeof(Barriers);
static_assert(kVtBarrierOffset + (kFp8 ? sizeof(VtBarriers) : 0) + kSwizzleAtomBytes <= SMEM_BYTES,
              "SMEM_BYTES too small for this tile configuration");

// Named barriers (0 is __syncthreads): per consumer warpgroup, one around the staging of its
// output tile.
constexpr uint32_t kEpilogueBarrier = 1;
// STALE_MAX_FIRST: per consumer warpgroup, the vote on whether a key block keeps the row maxima.
constexpr uint32_t kVoteBarrier = kEpilogueBarrier + kConsumers;

// Key blocks a tile of query rows [m0, m0 + kBlockM) attends to: [0, end).
__device__ __forceinline__ int kv_block_end(int m0, int seqlen_q, int seqlen_k) {
    const int blocks = (seqlen_k + kBlockN - 1) / kBlockN;
    if (!kCausal) return blocks;
    // Bottom-right alignment: row i sees keys j <= i + seqlen_k - seqlen_q.
    const int keys_seen_by_last_row = m0 + kBlockM + seqlen_k - seqlen_q;
    if (keys_seen_by_last_row <= 0) return 0;
    return min(blocks, (keys_seen_by_last_row + kBlockN - 1) / kBlockN);
}

// Blocks from this index up need masking: they hold keys past seqlen_k or, when causal, keys
// that the tile's first row must not see.
__device__ __forceinline__ int kv_block_first_masked(int m0, int seqlen_q, int seqlen_k) {
    const int tail = seqlen_k / kBlockN;
    if (!kCausal) return tail;
    const int keys_seen_by_first_row = m0 + 1 + seqlen_k - seqlen_q;
    return min(tail, keys_seen_by_first_row <= 0 ? 0 : keys_seen_by_first_row / kBlockN);
}

// Tile order: (batch, head) pairs are taken in sections of `section_heads` whose K/V fit in L2
// together; within a section the query tiles go from the last (the longest when causal) to the
// first, all pairs of the section at each step. Tiles are handed out in index order, so long
// causal tiles start first and short ones fill the tail (longest-processing-time first).
// section_heads = 1 is plain pair-by-pair order.
struct TileScheduler {
    int num_m_blocks;
    int num_pairs;  // batch * heads_q
    int section_heads;
    int heads_q;

    __device__ __forceinline__ int num_tiles() const { return num_pairs * num_m_blocks; }

    __device__ __forceinline__ void decode(int tile, int& m_block, int& head, int& batch) const {
        const int tiles_per_section = section_heads * num_m_blocks;
        const int first_pair = (tile / tiles_per_section) * section_heads;
        const int in_section = tile % tiles_per_section;
        const int pairs_here = min(section_heads, num_pairs - first_pair);
        m_block = num_m_blocks - 1 - in_section / pairs_here;
        const int pair = first_pair + in_section % pairs_here;
        head = pair % heads_q;
        batch = pair / heads_q;
    }
};

// Position in the K/V ring, carried across tiles: slot and the parity of the slot's current use.
struct RingCursor {
    int count = 0;
    __device__ __forceinline__ int stage() const { return count % kStages; }
    __device__ __forceinline__ uint32_t phase() const { return (count / kStages) & 1; }
};

// The tiles of one block, in the order of TileScheduler's index. Static (no counter): tiles
// blockIdx.x, + gridDim.x, ... Dynamic (a zeroed pair of ints in global memory): the block's
// first tile is blockIdx.x and each next one the next unclaimed index, taken by the producer
// thread with an atomicAdd once it has issued the previous tile's loads, so blocks that drew
// short (causal) tiles take more of them; the producer passes each index to the other warps
// through a two-slot mailbox (bars.tile*). The last block to run out resets the counter pair for
// the next launch on the stream (launches on one stream never overlap).
struct TileSource {
    int* counter;
    Barriers& bars;
    int taken = 0;

    // Producer thread.
    __device__ __forceinline__ int take(int num_tiles) {
        if (counter == nullptr) return blockIdx.x + gridDim.x * taken++;
        const int tile = taken == 0 ? blockIdx.x : gridDim.x + atomicAdd(counter, 1);
        const int slot = taken % 2;
        bars.tile_empty[slot].wait(((taken / 2) & 1) ^ 1);
        bars.tile[slot] = tile;
        bars.tile_full[slot].arrive();
        ++taken;
        if (tile >= num_tiles) {
            __threadfence();
            if (atomicAdd(counter + 1, 1) == gridDim.x - 1) {
                counter[0] = 0;
                counter[1] = 0;
            }
        }
        return tile;
    }

    // Every other warp taking part (all of its lanes call this).
    __device__ __forceinline__ int receive() {
        if (counter == nullptr) return blockIdx.x + gridDim.x * taken++;
        const int slot = taken % 2;
        bars.tile_full[slot].wait((taken / 2) & 1);
        const int tile = bars.tile[slot];
        __syncwarp();
        if (threadIdx.x % 32 == 0) bars.tile_empty[slot].arrive();
        ++taken;
        return tile;
    }
};

__device__ __forceinline__ void load_kv_tile(uint8_t* tile, const TensorMap* map, MBarrier& full,
                                             int kv_head, int n_block, int batch) {
    full.arrive_expect_tx(kKVBytes);
#pragma unroll
    for (int j = 0; j < kSlabs; ++j) {
        tma_load_4d(tile + j * kKVSlabBytes, map, full, kSlabCols * j, kv_head, n_block * kBlockN,
                    batch);
    }
}

// Per tile: Q, then K of the first key block, then for each block the K of the next block
// before the V of this one, since consumers need K(j+1) (for S) before V(j) (for P V).
__device__ __forceinline__ void producer(const TensorMap* q_map, const TensorMap* k_map,
                                         const TensorMap* v_map, uint8_t* smem, Barriers& bars,
                                         const TileScheduler& sched, TileSource tiles,
                                         int seqlen_q, int seqlen_k, int q_per_kv) {
    tma_prefetch(q_map);
    tma_prefetch(k_map);
    tma_prefetch(v_map);
    // A fresh barrier passes a wait for parity 1, so the first pass over the ring (and the first
    // Q load) does not wait.
    RingCursor k_ring;
    RingCursor v_ring;
    int q_loads = 0;
#pragma unroll 1
    for (int tile = tiles.take(sched.num_tiles()); tile < sched.num_tiles();
         tile = tiles.take(sched.num_tiles())) {
        int m_block, head, batch;
        sched.decode(tile, m_block, head, batch);
        const int m0 = m_block * kBlockM;
        const int n_end = kv_block_end(m0, seqlen_q, seqlen_k);
        if (n_end == 0) continue;
        const int kv_head = head / q_per_kv;
        // The previous tile's Q is free once every consumer finished its last Q K^T.
        bars.q_empty.wait((q_loads & 1) ^ 1);
        bars.q_full.arrive_expect_tx(kQBytes);
#pragma unroll
        for (int j = 0; j < kSlabs; ++j) {
            tma_load_4d(smem + j * kQSlabBytes, q_map, bars.q_full, kSlabCols * j, head, m0, batch);
        }
        ++q_loads;
        bars.k_empty[k_ring.stage()].wait(k_ring.phase() ^ 1);
        load_kv_tile(smem + kKOffset + k_ring.stage() * kKVBytes, k_map,
                     bars.k_full[k_ring.stage()], kv_head, n_end - 1, batch);
        ++k_ring.count;
#pragma unroll 1
        for (int n_block = n_end - 1; n_block >= 0; --n_block) {
            if (n_block > 0) {
                bars.k_empty[k_ring.stage()].wait(k_ring.phase() ^ 1);
                load_kv_tile(smem + kKOffset + k_ring.stage() * kKVBytes, k_map,
                             bars.k_full[k_ring.stage()], kv_head, n_block - 1, batch);
                ++k_ring.count;
            }
            bars.v_empty[v_ring.stage()].wait(v_ring.phase() ^ 1);
            load_kv_tile(smem + kVOffset + v_ring.stage() * kKVBytes, v_map,
                         bars.v_full[v_ring.stage()], kv_head, n_block, batch);
            ++v_ring.count;
        }
    }
    if constexpr (kFp8) {
        bars.v_empty[v_ring.stage()].wait(v_ring.phase() ^ 1);
        atomicExch(&bars.v_end, static_cast<int>(v_ring.count));
        bars.v_full[v_ring.stage()].arrive();
    }
}

// FP8: warps 1-3 of the producer warpgroup transpose every V tile the producer loads into the
// Vt ring (same slots and phases), in ring order up to the producer's closing arrive (v_end), so
// they need no tile schedule. Each thread arrives on v_empty / vt.full itself, after its
// fence.proxy.async, so the consumers' wgmmas (async proxy) see all of Vt and TMA may overwrite
// V as soon as all reads are done.
constexpr int kTransposeWarps = 3;

// A template (instantiated with kKeys = BLOCK_N) so that 16-bit builds, which never call it,
// never instantiate the transposer, whose tile shape they need not satisfy.
template <int kKeys>
__device__ __forceinline__ void transpose_v_tiles(uint8_t* smem, Barriers& bars, VtBarriers& vt) {
    const TransposeE4m3<kKeys, kHeadDim, kSlabRowBytes, kVtRowBytes, kTransposeWarps> transpose(
        threadIdx.x / 32 - 1, threadIdx.x % 32);
#pragma unroll 1
    for (RingCursor ring;; ++ring.count) {
        const int stage = ring.stage();
        bars.v_full[stage].wait(ring.phase());
        // An atomic read: the producer may write v_end meanwhile (see Barriers::v_end).
        int v_end = 0;
        if (threadIdx.x % 32 == 0) v_end = atomicAdd(&bars.v_end, 0);
        if (__shfl_sync(0xffffffffu, v_end, 0) == ring.count) return;
        vt.empty[stage].wait(ring.phase() ^ 1);
        transpose(smem_addr(smem + kVOffset + stage * kKVBytes),
                  smem_addr(smem + kVtOffset + stage * kVtBytes));
        fence_proxy_async();
        bars.v_empty[stage].arrive();
        vt.full[stage].arrive();
    }
}

// The two GEMM instructions of this build's data type. Templates, so that the other type's
// shapes (which may not exist for this tile) are never instantiated.
template <int N>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                       uint32_t accumulate) {
    if constexpr (kFp8) {
        WgmmaE4m3<N>::ss(d, desc_a, desc_b, accumulate);
    } else {
        Wgmma16<N>::template ss<kBf16>(d, desc_a, desc_b, accumulate);
    }
}

// Accumulators S = Q K^T is computed into: one, or with FP8 one per slab of head_dim (see the
// top of the file), added into the first once the wgmmas completed.
constexpr int kScoreAccs = kFp8 ? kSlabs : 1;
static_assert(kScoreAccs <= 2, "the registers of one extra S accumulator at most");

// P (as A fragments, kPRegs b32 per thread) into an accumulator of the given width.
constexpr int kPRegs = kFp8 ? kBlockN / 8 : kBlockN / 4;

// Launched at 65536 / kThreads registers per thread (rounded down to 8: 168 with two consumer
// warpgroups, 128 with three); the producer keeps 24, or with FP8, where three of its warps
// transpose V, 56, or 40 when the consumers' S, O, P (and Q) fragments alone take 200 registers
// or more. The consumers share what the producer gives up.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kQRegs = kQInRegisters ? kHeadDim / 8 : 0;  // FP8: 64 rows x head_dim bytes
constexpr int kFragmentRegs = kScoreAccs * kBlockN / 2 + kHeadDim / 2 + kPRegs + kQRegs;
constexpr int kProducerRegs = !kFp8 ? 24 : kFragmentRegs >= 200 ? 40 : 56;
constexpr int kConsumerRegs = ((1 + kConsumers) * kLaunchRegs - kProducerRegs) / kConsumers / 8 * 8;

template <int N>
__device__ __forceinline__ void accumulator_to_p(uint32_t (&p)[kPRegs], const float (&s)[N / 2]) {
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
__device__ __forceinline__ void mma_pv(float (&o)[N / 2], const uint32_t (&p)[kPRegs],
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
        const uint64_t v_desc = wgmma_desc_sw128(v_tile, kKVSlabBytes, kSwizzleAtomBytes);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            Wgmma16<N>::template rs<kBf16>(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2],
                                           p[4 * kk + 3],
                                           wgmma_desc_advance(v_desc, kk * 16 * kSlabRowBytes), 1);
        }
    }
}

// Everything one consumer warpgroup needs to run its 64 rows through the key blocks.
struct Consumer {
    using ScoreTiles = float[1][kBlockN / 8][4];
    using OutTiles = float[1][kHeadDim / 8][4];

    uint8_t* smem;
    Barriers& bars;
    VtBarriers& vt;
    int wg;    // 0 or 1: which consumer warpgroup
    int lane;
    int seqlen_q;
    int seqlen_k;
    float scale_log2;  // softmax_scale * log2(e), times q's descale with FP8
    int row0;  // query row of this thread's first accumulator row in the tile (second: + 8)
    // FP8: this tile's k descales (one per 128 keys, k_descale_step apart) and v descale.
    const float* k_descale = nullptr;
    int64_t k_descale_step = 0;
    float v_descale = 1.0f;

    float o[kHeadDim / 2];
    uint32_t q[kQInRegisters ? kQRegs : 1];  // Q_IN_REGISTERS: this tile's Q as A fragments
    uint32_t p[kPRegs];  // P of the block whose P V is pending, as A fragments
    // FP8 keeps the exact running max. With a stale one (softmax.cuh lets a row's max grow by 2^8
    // before its reference moves), a row's dominant probability is 2^d for a fractional d, which
    // e4m3 rounds by up to 6%, while the row sum adds the unrounded value: a row that one key
    // dominates came out up to 6% off (3x the naive FP8 error; docs/hopper-tuning.md, session 9).
    // With the exact max it is 1, which e4m3 holds exactly.
    OnlineSoftmax<1, kFp8 ? 0 : 8> softmax;
    RingCursor ring;
    int q_loads = 0;

    __device__ __forceinline__ uint32_t q_addr() const {
        return smem_addr(smem) + wg * kRowsPerConsumer * kSlabRowBytes;
    }

    __device__ __forceinline__ void release(MBarrier& bar) const {
        if (lane == 0) bar.arrive();
    }

    // Q_IN_REGISTERS: this warpgroup's Q tile from shared memory into the A fragments of the
    // e4m3 wgmma (wgmma_fp8.cuh), once per tile, so that Q K^T reads only K from shared
    // memory: shared-memory bandwidth is about as busy as the tensor cores in the FP8 kernel
    // (Q, K, V, Vt and the transposer's traffic); measured at head_dim 128, this gains 0.2-2.6%
    // (docs/hopper-tuning.md). ldmatrix.x4 (16-bit elements, so 4 bytes a lane) of the 8-row x
    // 16-byte matrices (rows 0-7, chunk c), (rows 8-15, c), (0-7, c+1), (8-15, c+1) of the
    // warp's 16 rows gives a0..a3 of the k-step whose 32 bytes are chunks c, c+1. Q is then
    // free, and the producer may load the next tile's.
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
    // there are several accumulators; finish_qk sums them. Q comes from shared memory or
    // (Q_IN_REGISTERS) from the fragments load_q took.
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
    __device__ __forceinline__ void finish_qk(float (&s)[kScoreAccs][kBlockN / 2]) const {
#pragma unroll
        for (int a = 0; a < kScoreAccs; ++a) wgmma_fence_operand(s[a]);
#pragma unroll
        for (int a = 1; a < kScoreAccs; ++a) {
#pragma unroll
            for (int i = 0; i < kBlockN / 2; ++i) s[0][i] += s[a][i];
        }
    }

    __device__ __forceinline__ void issue_pv(int stage) {
        mma_pv<kHeadDim>(o, p, smem_addr(smem + (kFp8 ? kVtOffset + stage * kVtBytes
                                                      : kVOffset + stage * kKVBytes)));
    }

    // The barriers of the tile P V reads: Vt (FP8) or V.
    __device__ __forceinline__ MBarrier& pv_full(int stage) const {
        return kFp8 ? vt.full[stage] : bars.v_full[stage];
    }

    __device__ __forceinline__ MBarrier& pv_empty(int stage) const {
        return kFp8 ? vt.empty[stage] : bars.v_empty[stage];
    }

    // The score scale of key block n_block: with FP8 times k's descale of its (first) 128 keys.
    __device__ __forceinline__ float block_scale_log2(int n_block) const {
        if constexpr (kFp8) {
            return scale_log2 * k_descale[(n_block * kBlockN / kScaleBlockRows) * k_descale_step];
        } else {
            return scale_log2;
        }
    }

    __device__ __forceinline__ void mask(float (&s)[kBlockN / 2], int n_block) const {
        const int col0 = n_block * kBlockN + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            const int limit = kCausal ? min(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col0 + 8 * i + e >= limit) s[4 * i + 2 * h + e] = -__int_as_float(0x7f800000);
                }
            }
        }
    }

    __device__ __forceinline__ void to_p(const float (&s)[kBlockN / 2]) {
        accumulator_to_p<kBlockN>(p, s);
    }

    // One step: S for key block n_block (ring slot `cur`), P V for the block before it (`prev`).
    // kStaleMax: try the softmax's fast path first (STALE_MAX_FIRST builds).
    template <bool kMasked, bool kStaleMax = false>
    __device__ __forceinline__ void step(int n_block, float (&s)[kScoreAccs][kBlockN / 2],
                                         float (&rescale)[1][2]) {
        static_assert(!(kMasked && kStaleMax), "masked blocks take the max pass");
        const RingCursor prev = ring;
        ++ring.count;
        const float block_scale = block_scale_log2(n_block);
        bars.k_full[ring.stage()].wait(ring.phase());
        wgmma_fence_operand(o);
        wgmma_fence();
        issue_qk(s, ring.stage());
        wgmma_commit();
        pv_full(prev.stage()).wait(prev.phase());
        issue_pv(prev.stage());
        wgmma_commit();
        wgmma_wait<1>();
        finish_qk(s);
        // K is released once no Q K^T of this block can follow.
        if constexpr (!kStaleMax) release(bars.k_empty[ring.stage()]);
        if constexpr (kMasked) mask(s[0], n_block);
        bool rescale_o = false;
        float block_sum[1][2];
        if (kStaleMax &&
            named_barrier_all(kVoteBarrier + wg, 128,
                              softmax.exp_with_stale_max(reinterpret_cast<ScoreTiles&>(s[0]),
                                                         block_scale, block_sum))) {
            softmax.add_block_sums(block_sum);
        } else {
            if constexpr (kStaleMax) {
                // The fast path spoiled S: Q K^T again, by the whole warpgroup (hence the vote),
                // on its own (ptxas keeps wgmmas asynchronous only if none is issued
                // conditionally while another is in flight).
                wgmma_wait<0>();
                wgmma_fence();
                issue_qk(s, ring.stage());
                wgmma_commit();
                wgmma_wait<0>();
                finish_qk(s);
            }
            rescale_o = softmax.update(reinterpret_cast<ScoreTiles&>(s[0]), block_scale, rescale);
        }
        if constexpr (kStaleMax) release(bars.k_empty[ring.stage()]);
        wgmma_wait<0>();
        wgmma_fence_operand(o);
        release(pv_empty(prev.stage()));
        to_p(s[0]);
        if (rescale_o) scale_rows(reinterpret_cast<OutTiles&>(o), rescale);
    }

    // Runs the tile's key blocks n_end-1 .. 0; leaves the ring cursor past the tile's last slot.
    __device__ __forceinline__ void mainloop(int n_end, int n_first_masked) {
        float s[kScoreAccs][kBlockN / 2];
        float rescale[1][2];
        const float first_scale = block_scale_log2(n_end - 1);
        bars.q_full.wait(q_loads & 1);
        ++q_loads;
        if constexpr (kQInRegisters) load_q();
        bars.k_full[ring.stage()].wait(ring.phase());
        wgmma_fence();
        issue_qk(s, ring.stage());
        wgmma_commit();
        wgmma_wait<0>();
        finish_qk(s);
        release(bars.k_empty[ring.stage()]);
        if (n_end - 1 >= n_first_masked) mask(s[0], n_end - 1);
        // O is still zero, so whether it would need rescaling does not matter.
        softmax.update(reinterpret_cast<ScoreTiles&>(s[0]), first_scale, rescale);
        to_p(s[0]);

        int n_block = n_end - 2;
#pragma unroll 1
        for (; n_block >= 0 && n_block >= n_first_masked; --n_block) step<true>(n_block, s, rescale);
        if constexpr (kStaleMaxFirst) {
            // The masked blocks and the first unmasked one go through the max pass: that is
            // where a row max still grows (a causal row that saw few keys on the diagonal).
            if (n_block >= 0) step<false>(n_block--, s, rescale);
#pragma unroll 1
            for (; n_block >= 0; --n_block) step<false, true>(n_block, s, rescale);
        } else {
#pragma unroll 1
            for (; n_block >= 0; --n_block) step<false>(n_block, s, rescale);
        }
        // Every Q K^T of this tile has completed: the producer may load the next tile's Q (with
        // Q in registers, load_q freed it already).
        if constexpr (!kQInRegisters) release(bars.q_empty);

        pv_full(ring.stage()).wait(ring.phase());
        wgmma_fence_operand(o);
        wgmma_fence();
        issue_pv(ring.stage());
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(o);
        release(pv_empty(ring.stage()));
        ++ring.count;
    }

    // Normalises O and writes it, and the log-sum-exp of this thread's rows (rows past
    // seqlen_q are skipped or clipped). Staged: stmatrix into this warpgroup's staging slabs
    // (the accumulator layout is stmatrix's), then one thread issues the TMA store, so the
    // warpgroup goes on to the next tile while the copy drains; the staging buffer is reused
    // once that store has read it. Otherwise each quad writes 16 contiguous bytes of a row.
    __device__ __forceinline__ void epilogue(const TensorMap* out_map, uint16_t* out,
                                             int64_t out_stride_b, int64_t out_stride_s,
                                             int64_t out_stride_h, float* lse, int m0, int head,
                                             int heads_q, int batch) {
        float inv_sum[1][2];
        float row_lse[1][2];
        softmax.finalize(inv_sum, row_lse);
        float factor[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) factor[h] = kFp8 ? inv_sum[0][h] * v_descale : inv_sum[0][h];
        const int t = lane % 4;
        if constexpr (kStagedOut) {
            const bool issuer = threadIdx.x % 128 == 0;
            uint8_t* staging = smem + kOutOffset + wg * kOutBytes;
            if (issuer) tma_store_wait_read<0>();
            named_barrier_sync(kEpilogueBarrier + wg, 128);
            // Column chunk i and i + 1 of the warp's 16 rows (x4_row); 8 chunks a 64-column slab.
            const int row = 16 * ((threadIdx.x % 128) / 32) + x4_row(lane);
#pragma unroll
            for (int i = 0; i < kHeadDim / 8; i += 2) {
                const int chunk = i + lane / 16;
                const uint32_t addr = smem_addr(staging + (chunk / 8) * kOutSlabBytes +
                                                swizzled_offset<128>(row, chunk % 8));
                stmatrix_x4(addr, pack_f32x2<kBf16>(o[4 * i] * factor[0], o[4 * i + 1] * factor[0]),
                            pack_f32x2<kBf16>(o[4 * i + 2] * factor[1], o[4 * i + 3] * factor[1]),
                            pack_f32x2<kBf16>(o[4 * i + 4] * factor[0], o[4 * i + 5] * factor[0]),
                            pack_f32x2<kBf16>(o[4 * i + 6] * factor[1], o[4 * i + 7] * factor[1]));
            }
            fence_proxy_async();
            named_barrier_sync(kEpilogueBarrier + wg, 128);
            if (issuer) {
#pragma unroll
                for (int slab = 0; slab < kHeadDim / 64; ++slab) {
                    tma_store_4d(out_map, staging + slab * kOutSlabBytes, 64 * slab, head,
                                 m0 + wg * kRowsPerConsumer, batch);
                }
                tma_store_commit();
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row >= seqlen_q) continue;
            if constexpr (!kStagedOut) {
                uint16_t* out_row =
                    out + batch * out_stride_b + row * out_stride_s + head * out_stride_h;
#pragma unroll
                for (int i = 0; i < kHeadDim / 8; ++i) {
                    *reinterpret_cast<uint32_t*>(out_row + 8 * i + 2 * t) = pack_f32x2<kBf16>(
                        o[4 * i + 2 * h] * factor[h], o[4 * i + 2 * h + 1] * factor[h]);
                }
            }
            if (t == 0) lse[(static_cast<int64_t>(batch) * heads_q + head) * seqlen_q + row] =
                row_lse[0][h];
        }
    }

    // Staged output: the last TMA store must have read shared memory before the block exits.
    __device__ __forceinline__ void finish() const {
        if (kStagedOut && threadIdx.x % 128 == 0) tma_store_wait_read<0>();
    }
};

}  // namespace fwd_sm90
}  // namespace ptxattn

using namespace ptxattn;
using namespace ptxattn::fwd_sm90;

// grid: any number of blocks up to batch * heads_q * num_m_blocks, each taking tiles in static
// order or, given tile_counter (two zeroed ints, see TileSource), dynamically; block: 128 * (1 + CONSUMERS) threads; dynamic smem: SMEM_BYTES. out_map: a 4-d map over out with a box
// of 64 rows x 64 columns and the 128-byte swizzle (STAGED_OUT builds store through it, the
// others through out and its strides, in elements). The
// descales (FP8 only; 16-bit builds ignore them) are read at [b * stride_b + h * stride_h +
// block * stride_block] with h the q head for q's and the kv head for k's and v's.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
attn_fwd_sm90(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
              const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap out_map,
              uint16_t* __restrict__ out,
              int64_t out_stride_b, int64_t out_stride_s, int64_t out_stride_h,
              float* __restrict__ lse, int seqlen_q, int seqlen_k, int batch_size, int heads_q,
              int q_per_kv, int section_heads, int* __restrict__ tile_counter, float scale_log2,
              const float* __restrict__ q_descale, int64_t q_descale_stride_b,
              int64_t q_descale_stride_h, int64_t q_descale_stride_block,
              const float* __restrict__ k_descale, int64_t k_descale_stride_b,
              int64_t k_descale_stride_h, int64_t k_descale_stride_block,
              const float* __restrict__ v_descale, int64_t v_descale_stride_b,
              int64_t v_descale_stride_h) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((kSwizzleAtomBytes - (smem_addr(smem_raw) % kSwizzleAtomBytes)) %
                                kSwizzleAtomBytes);
    Barriers& bars = *reinterpret_cast<Barriers*>(smem + kBarrierOffset);
    VtBarriers& vt = *reinterpret_cast<VtBarriers*>(smem + kVtBarrierOffset);
    const TileScheduler sched{(seqlen_q + kBlockM - 1) / kBlockM, batch_size * heads_q,
                              section_heads, heads_q};

    if (threadIdx.x == 0) {
        bars.q_full.init(1);
        bars.q_empty.init(kConsumerWarps);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            bars.k_full[s].init(1);
            bars.v_full[s].init(1);
            bars.k_empty[s].init(kConsumerWarps);
            // FP8: V is read by the transposing threads, Vt by the consumers.
            bars.v_empty[s].init(kFp8 ? 32 * kTransposeWarps : kConsumerWarps);
            if constexpr (kFp8) {
                vt.full[s].init(32 * kTransposeWarps);
                vt.empty[s].init(kConsumerWarps);
            }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            bars.tile_full[s].init(1);
            bars.tile_empty[s].init(kConsumerWarps);
        }
        bars.v_end = -1;
        fence_barrier_init();
    }
    __syncthreads();
    TileSource tiles{tile_counter, bars};

    if (threadIdx.x < 128) {
        warpgroup_reg_dealloc<kProducerRegs>();
        if (threadIdx.x == 0) {
            producer(&q_map, &k_map, &v_map, smem, bars, sched, tiles, seqlen_q, seqlen_k,
                     q_per_kv);
        } else if (threadIdx.x >= 32) {
            if constexpr (kFp8) transpose_v_tiles<kBlockN>(smem, bars, vt);
        }
        return;
    }

    warpgroup_reg_alloc<kConsumerRegs>();
    const int wg = threadIdx.x / 128 - 1;
    const int lane = threadIdx.x % 32;
    const int row_in_tile = wg * kRowsPerConsumer + ((threadIdx.x % 128) / 32) * 16 + lane / 4;
    Consumer consumer{smem, bars, vt, wg, lane, seqlen_q, seqlen_k, scale_log2};
#pragma unroll 1
    for (int tile = tiles.receive(); tile < sched.num_tiles(); tile = tiles.receive()) {
        int m_block, head, batch;
        sched.decode(tile, m_block, head, batch);
        const int m0 = m_block * kBlockM;
        const int n_end = kv_block_end(m0, seqlen_q, seqlen_k);
        consumer.row0 = m0 + row_in_tile;
        if constexpr (kFp8) {
            const int kv_head = head / q_per_kv;
            // This warpgroup's 64 rows lie in one 128-row q descale block.
            const int q_block = (m0 + wg * kRowsPerConsumer) / kScaleBlockRows;
            consumer.scale_log2 = scale_log2 * q_descale[batch * q_descale_stride_b +
                                                         head * q_descale_stride_h +
                                                         q_block * q_descale_stride_block];
            consumer.k_descale =
                k_descale + batch * k_descale_stride_b + kv_head * k_descale_stride_h;
            consumer.k_descale_step = k_descale_stride_block;
            consumer.v_descale =
                v_descale[batch * v_descale_stride_b + kv_head * v_descale_stride_h];
        }
#pragma unroll
        for (int i = 0; i < kHeadDim / 2; ++i) consumer.o[i] = 0.0f;
        consumer.softmax.init();
        if (n_end > 0) consumer.mainloop(n_end, kv_block_first_masked(m0, seqlen_q, seqlen_k));
        consumer.epilogue(&out_map, out, out_stride_b, out_stride_s, out_stride_h, lse, m0, head,
                          heads_q, batch);
    }
    consumer.finish();
}
