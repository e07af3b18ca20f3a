// FlashAttention-2 style forward pass on mma.sync tensor cores: the portable kernel (sm_80+).
//
// A block computes BLOCK_M query rows of one (batch, head); its NUM_WARPS warps each own
// BLOCK_M / NUM_WARPS consecutive rows (a multiple of 16, one mma M tile per 16). K/V blocks of
// BLOCK_N keys stream through a STAGES-deep cp.async ring in shared memory while the warps run
// S = Q K^T, the online softmax and O += P V with P kept in registers (C fragment -> A fragment).
// Q is loaded once and its A fragments are re-read from shared memory for every block: a warp
// owning 32 rows has no registers to spare for them next to O (D/2 floats per row pair) and S.
//
// KV blocks are visited from the last to the first, so the blocks that need a mask (the
// sequence tail, the causal diagonal) come first and a single uniform test per block decides
// whether to mask; causal blocks entirely above the diagonal are never visited. Causal with
// Sq != Sk is aligned bottom-right: query i sees key j iff j <= i + Sk - Sq.
//
// Shared-memory tiles hold rows of HEAD_DIM 16-bit values, 16-byte chunks XOR-swizzled by
// row % 8 (see tile_offset), which keeps ldmatrix, cp.async and the epilogue's stores free of
// bank conflicts. Layout: [Q: BLOCK_M rows][stage 0: K, V: BLOCK_N rows each][stage 1]...
// The epilogue stages each warp's normalised output in that warp's own Q rows and writes it
// out with 16-byte stores, predicated on the sequence length.
//
// Compile-time parameters (all required): HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES,
// IS_BF16 (else fp16), IS_CAUSAL, MIN_BLOCKS_PER_SM.
#include "common.cuh"
#include "cp_async.cuh"
#include "mma_sync.cuh"
#include "softmax.cuh"

#if !defined(HEAD_DIM) || !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(NUM_WARPS) || \
    !defined(STAGES) || !defined(IS_BF16) || !defined(IS_CAUSAL) || !defined(MIN_BLOCKS_PER_SM)
#error "fwd_mma_sync.cu needs HEAD_DIM BLOCK_M BLOCK_N NUM_WARPS STAGES IS_BF16 IS_CAUSAL MIN_BLOCKS_PER_SM"
#endif

namespace ptxattn {
namespace {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kBlockM = BLOCK_M;
constexpr int kBlockN = BLOCK_N;
constexpr int kWarps = NUM_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = STAGES;
constexpr bool kBf16 = IS_BF16 != 0;
constexpr bool kCausal = IS_CAUSAL != 0;

constexpr int kWarpRows = kBlockM / kWarps;
constexpr int kMTiles = kWarpRows / 16;      // 16-row mma tiles per warp
constexpr int kKSteps = kHeadDim / 16;       // k steps of S = Q K^T
constexpr int kSTiles = kBlockN / 8;         // 8-column tiles of S
constexpr int kPSteps = kBlockN / 16;        // k steps of O += P V
constexpr int kOTiles = kHeadDim / 8;        // 8-column tiles of O
constexpr int kRowBytes = kHeadDim * 2;
constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row
constexpr int kQTileBytes = kBlockM * kRowBytes;
constexpr int kKVTileBytes = kBlockN * kRowBytes;
constexpr int kStageBytes = 2 * kKVTileBytes;

static_assert(kWarpRows % 16 == 0, "each warp owns whole 16-row mma tiles");
static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes: HEAD_DIM >= 64");
static_assert(kBlockN % 16 == 0, "BLOCK_N is a whole number of PV k steps");
static_assert(kThreads % kChunksPerRow == 0 &&
                  kBlockN % (kThreads / kChunksPerRow) == 0 &&
                  kBlockM % (kThreads / kChunksPerRow) == 0,
              "tile loads give every thread the same number of whole chunks");
static_assert(kThreads / kChunksPerRow <= 32,
              "a thread's row within a load pass times the seq stride (< 2^26, checked by the "
              "launcher) must fit in 32 bits");
static_assert(32 % kChunksPerRow == 0 || kChunksPerRow % 32 == 0, "epilogue row split");
static_assert(kStages >= 2, "the ring needs a stage in flight while one is computed");

// Byte offset of 16-byte chunk `chunk` of tile row `row`: the chunk index is XORed with row % 8
// so that one logical chunk of eight consecutive rows falls into eight different bank groups.
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// cp.async of tile rows [0, kRows) from consecutive sequence positions of one head, `rows`
// pointing at the first. Each thread moves one 16-byte column chunk of every
// (kThreads / kChunksPerRow)-th row. With kCheckRows, rows at or past `valid_rows` are
// zero-filled and never read; only the Q block and the first K/V block visited can be partial.
template <int kRows, bool kCheckRows>
__device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* rows, int64_t seq_stride,
                                          int valid_rows, int tid) {
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    const int chunk = tid % kChunksPerRow;
    const int first = tid / kChunksPerRow;
    // a 32-bit per-thread offset is cheap to recompute per block, where 64-bit per-thread
    // pointers would stay live through the main loop and cost registers
    const int thread_offset = first * static_cast<int>(seq_stride) + chunk * 8;
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
        const int row = first + pass * kRowsPerPass;
        const bool valid = !kCheckRows || row < valid_rows;
        const uint16_t* src = rows + pass * kRowsPerPass * seq_stride + thread_offset;
        cp_async_16(tile + tile_offset(row, chunk), valid ? src : rows, valid);
    }
}

// The K and V tiles of one ring stage, keys first_key.. of the K/V head.
template <bool kCheckRows>
__device__ __forceinline__ void load_kv(uint32_t stage, const uint16_t* k_head,
                                        const uint16_t* v_head, int64_t k_seq_stride,
                                        int64_t v_seq_stride, int first_key, int seq_len_k,
                                        int tid) {
    load_tile<kBlockN, kCheckRows>(stage, k_head + first_key * k_seq_stride, k_seq_stride,
                                   seq_len_k - first_key, tid);
    load_tile<kBlockN, kCheckRows>(stage + kKVTileBytes, v_head + first_key * v_seq_stride,
                                   v_seq_stride, seq_len_k - first_key, tid);
}

// ldmatrix addressing. Every fragment load below starts at a tile row that is a multiple of 8 and
// at an even chunk, so a lane's address splits into a per-lane part fixed for the whole kernel
// (its row within the 16-row group, and `swizzle` = its chunk bit ^ row % 8) plus compile-time
// row and chunk offsets after unrolling. Writing the XOR on the low three chunk bits only lets
// the compiler keep four per-lane offsets per operand instead of one per chunk.
struct LaneAddr {
    uint32_t row_bytes;
    uint32_t swizzle;

    __device__ __forceinline__ uint32_t at(uint32_t tile, int row, int chunk) const {
        return tile + row_bytes + row * kRowBytes + ((chunk & ~7) << 4) +
               (((chunk & 7) ^ swizzle) << 4);
    }
};

// A fragment, 16 rows x 16 columns: lanes 0-15 address rows 0-15 of the left 8 columns, lanes
// 16-31 the right ones (registers: rows 0-7 left, 8-15 left, 0-7 right, 8-15 right).
__device__ __forceinline__ LaneAddr a_frag_lane(int lane) {
    return {static_cast<uint32_t>((lane & 15) * kRowBytes),
            static_cast<uint32_t>((lane >> 4) ^ (lane & 7))};
}

// Two K-side B fragments (8 keys each, 16 head columns): lanes 0-7 address keys 0-7 left,
// 8-15 keys 0-7 right, 16-23 keys 8-15 left, 24-31 keys 8-15 right.
__device__ __forceinline__ LaneAddr k_frag_lane(int lane) {
    return {static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * kRowBytes),
            static_cast<uint32_t>(((lane >> 3) & 1) ^ (lane & 7))};
}

// Two V-side B fragments read with .trans (16 keys, head-dim tiles of 8): lanes 0-15 address
// keys 0-15 of the left tile, 16-31 of the right one; same split as the A fragment.
__device__ __forceinline__ LaneAddr v_frag_lane(int lane) { return a_frag_lane(lane); }

// S (this warp's rows x kBlockN keys) = Q K^T, scores raw.
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kSTiles][4], uint32_t q_tile,
                                        uint32_t k_tile, int warp_row,
                                        const LaneAddr& q_lane, const LaneAddr& k_lane) {
    zero_fill(s);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
            ldmatrix_x4(a[m], q_lane.at(q_tile, warp_row + 16 * m, 2 * ks));
        }
#pragma unroll
        for (int p = 0; p < kSTiles / 2; ++p) {
            uint32_t b[4];
            ldmatrix_x4(b, k_lane.at(k_tile, 16 * p, 2 * ks));
#pragma unroll
            for (int m = 0; m < kMTiles; ++m) {
                mma_m16n16k16<kBf16>(s[m][2 * p], s[m][2 * p + 1], a[m], b);
            }
        }
    }
}

// Probabilities as the A fragments of O += P V: S tiles 2k, 2k+1 of a 16-row group are exactly
// the A fragment of k step k once packed to 16-bit pairs.
__device__ __forceinline__ void pack_probabilities(uint32_t (&a)[kMTiles][kPSteps][4],
                                                   const float (&p)[kMTiles][kSTiles][4]) {
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int ks = 0; ks < kPSteps; ++ks) {
            a[m][ks][0] = pack_f32x2<kBf16>(p[m][2 * ks][0], p[m][2 * ks][1]);
            a[m][ks][1] = pack_f32x2<kBf16>(p[m][2 * ks][2], p[m][2 * ks][3]);
            a[m][ks][2] = pack_f32x2<kBf16>(p[m][2 * ks + 1][0], p[m][2 * ks + 1][1]);
            a[m][ks][3] = pack_f32x2<kBf16>(p[m][2 * ks + 1][2], p[m][2 * ks + 1][3]);
        }
    }
}

__device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kOTiles][4],
                                        const uint32_t (&p)[kMTiles][kPSteps][4], uint32_t v_tile,
                                        const LaneAddr& v_lane) {
#pragma unroll
    for (int ks = 0; ks < kPSteps; ++ks) {
#pragma unroll
        for (int dp = 0; dp < kOTiles / 2; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_lane.at(v_tile, 16 * ks, 2 * dp));
#pragma unroll
            for (int m = 0; m < kMTiles; ++m) {
                mma_m16n16k16<kBf16>(o[m][2 * dp], o[m][2 * dp + 1], p[m][ks], b);
            }
        }
    }
}

// Sets to -inf the scores of keys that rows of this thread may not see: keys at or past
// seq_len_k, and with kCausal keys past row + diag.
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kSTiles][4], int first_key,
                                            int first_row, int seq_len_k, int diag, int lane) {
    const float neg_inf = -__int_as_float(0x7f800000);
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = first_row + 16 * m + (lane >> 2) + 8 * h;
            const int key_end = kCausal ? min(seq_len_k, row + diag + 1) : seq_len_k;
#pragma unroll
            for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = first_key + 8 * j + 2 * (lane & 3) + c;
                    if (key >= key_end) s[m][j][2 * h + c] = neg_inf;
                }
            }
        }
    }
}

}  // namespace
}  // namespace ptxattn

using namespace ptxattn;

// q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out like q: element strides per (batch, seq, head),
// unit stride in D, 16-byte aligned rows. lse (B, Hq, Sq) float32 contiguous. The grid is 1-D,
// num_m_blocks consecutive blocks per (batch, head) so that blocks sharing K/V run together;
// under kCausal the longest (last) query blocks of each head are issued first.
extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS_PER_SM)
fwd_mma_sync(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
             const uint16_t* __restrict__ v, uint16_t* __restrict__ out, float* __restrict__ lse,
             int64_t q_batch_stride, int64_t q_seq_stride, int64_t q_head_stride,
             int64_t k_batch_stride, int64_t k_seq_stride, int64_t k_head_stride,
             int64_t v_batch_stride, int64_t v_seq_stride, int64_t v_head_stride,
             int64_t o_batch_stride, int64_t o_seq_stride, int64_t o_head_stride,
             int seq_len_q, int seq_len_k, int num_heads_q, int q_heads_per_kv,
             int num_m_blocks, float scale_log2) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp_row = (tid >> 5) * kWarpRows;

    const int head_index = blockIdx.x / num_m_blocks;
    const int m_index = blockIdx.x % num_m_blocks;
    const int m_block = kCausal ? num_m_blocks - 1 - m_index : m_index;
    const int batch = head_index / num_heads_q;
    const int head = head_index % num_heads_q;
    const int kv_head = head / q_heads_per_kv;
    const int first_row = m_block * kBlockM;
    const int diag = seq_len_k - seq_len_q;

    const uint16_t* q_head = q + batch * q_batch_stride + head * q_head_stride;
    const uint16_t* k_head = k + batch * k_batch_stride + kv_head * k_head_stride;
    const uint16_t* v_head = v + batch * v_batch_stride + kv_head * v_head_stride;

    int n_blocks = (seq_len_k + kBlockN - 1) / kBlockN;
    if constexpr (kCausal) {
        // keys [0, last_row + diag] are visible to the block's last real row
        const int visible = min(first_row + kBlockM, seq_len_q) + diag;
        n_blocks = visible <= 0 ? 0 : min(n_blocks, (visible + kBlockN - 1) / kBlockN);
    }

    const uint32_t q_tile = smem_addr(smem);
    const uint32_t ring = q_tile + kQTileBytes;
    load_tile<kBlockM, true>(q_tile, q_head + first_row * q_seq_stride, q_seq_stride,
                             seq_len_q - first_row, tid);
#pragma unroll
    for (int iter = 0; iter < kStages - 1; ++iter) {
        if (iter < n_blocks) {
            load_kv<true>(ring + iter * kStageBytes, k_head, v_head, k_seq_stride, v_seq_stride,
                          (n_blocks - 1 - iter) * kBlockN, seq_len_k, tid);
        }
        cp_async_commit();
    }

    const LaneAddr q_lane = a_frag_lane(lane);
    const LaneAddr k_lane = k_frag_lane(lane);
    const LaneAddr v_lane = v_frag_lane(lane);

    float o[kMTiles][kOTiles][4];
    zero_fill(o);
    OnlineSoftmax<kMTiles> softmax;
    softmax.init();

#pragma unroll 1
    for (int iter = 0; iter < n_blocks; ++iter) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // the block's data has landed and every warp is done with iter - 1
        const int next = iter + kStages - 1;
        if (next < n_blocks) {
            load_kv<false>(ring + (next % kStages) * kStageBytes, k_head, v_head, k_seq_stride,
                           v_seq_stride, (n_blocks - 1 - next) * kBlockN, seq_len_k, tid);
        }
        cp_async_commit();

        const uint32_t k_tile = ring + (iter % kStages) * kStageBytes;
        const int first_key = (n_blocks - 1 - iter) * kBlockN;
        float s[kMTiles][kSTiles][4];
        gemm_qk(s, q_tile, k_tile, warp_row, q_lane, k_lane);
        const bool tail = first_key + kBlockN > seq_len_k;
        const bool diagonal = kCausal && first_key + kBlockN - 1 > first_row + diag;
        if (tail || diagonal) {
            mask_scores(s, first_key, first_row + warp_row, seq_len_k, diag, lane);
        }
        float rescale[kMTiles][2];
        if (softmax.update(s, scale_log2, rescale)) scale_rows(o, rescale);
        uint32_t p[kMTiles][kPSteps][4];
        pack_probabilities(p, s);
        gemm_pv(o, p, k_tile + kKVTileBytes, v_lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // every copy has landed (also when no block was visited) before Q is reused

    float inv_sum[kMTiles][2];
    float row_lse[kMTiles][2];
    softmax.finalize(inv_sum, row_lse);
    scale_rows(o, inv_sum);

#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row + 16 * m + (lane >> 2) + 8 * h;
#pragma unroll
            for (int j = 0; j < kOTiles; ++j) {
                *reinterpret_cast<uint32_t*>(smem + tile_offset(row, j) + 4 * (lane & 3)) =
                    pack_f32x2<kBf16>(o[m][j][2 * h], o[m][j][2 * h + 1]);
            }
            if ((lane & 3) == 0 && first_row + row < seq_len_q) {
                lse[static_cast<int64_t>(head_index) * seq_len_q + first_row + row] = row_lse[m][h];
            }
        }
    }
    __syncwarp();

    constexpr int kLanesPerRow = kChunksPerRow < 32 ? kChunksPerRow : 32;
    constexpr int kRowsPerPass = 32 / kLanesPerRow;
    uint16_t* o_head = out + batch * o_batch_stride + head * o_head_stride;
#pragma unroll
    for (int pass = 0; pass < kWarpRows / kRowsPerPass; ++pass) {
        const int row = warp_row + pass * kRowsPerPass + lane / kLanesPerRow;
        if (first_row + row < seq_len_q) {
#pragma unroll
            for (int chunk = lane % kLanesPerRow; chunk < kChunksPerRow; chunk += kLanesPerRow) {
                *reinterpret_cast<uint4*>(o_head + (first_row + row) * o_seq_stride + chunk * 8) =
                    *reinterpret_cast<const uint4*>(smem + tile_offset(row, chunk));
            }
        }
    }
}
