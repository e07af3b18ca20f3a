// Block-scaled attention forward: MXFP8 or NVFP4 Q and K, MXFP8 V, bf16 output and LSE.
// Native on sm_120a (block-scaled mma.sync); built for sm_90a with PTXATTN_EMULATE_BLOCK_SCALE=1
// it runs the same code with block_scale_mma.cuh's exact emulation of each MMA.
//
// A block of 8 warps owns 128 query rows of one (batch, head); warp w owns rows 16w..16w+15, so
// every MMA is one m16 tile and the K/V tiles are shared by all warps. Thread 0 streams tiles of
// 128 keys (K and V^T) through a 2-stage TMA ring (full barrier: TMA bytes; empty barrier: one
// arrival per warp); Q comes once by TMA and is re-read from shared memory one head_dim step at
// a time. Each tile is consumed in two softmax steps of 64 keys, which halves the live S
// accumulator (the emulation build needs those registers). Per step:
//   S = Q K^T      block-scaled MMAs with the Q and K scales (one register per lane holds a
//                  row's scales for four k blocks, or a column's for four n tiles through
//                  thread-id-b)
//   online softmax with an exact running max (RowSoftmax), causal / sequence-tail mask only
//                  where a step needs it
//   O += P V       P is requantized to e4m3 as 2^8 p (0 < p <= 1 then sits in e4m3's normal
//                  range down to p = 2^-14) and its scale_A byte 2^-8 undoes the factor; V's
//                  UE8M0 scales run along the keys, P V's contraction axis, so the MMA's scale_B
//                  applies them exactly.
//
// Operands in global memory (uint8; ptxattn/blockscaled.py documents and checks the shapes):
//   Q, K    rows of head_dim: e4m3 bytes (MXFP8) or e2m1 pairs, low nibble first (NVFP4);
//           row scales: one UE8M0 per 32 (MXFP8) or one UE4M3 per 16 (NVFP4) along head_dim,
//           NVFP4 also one FP32 scale per tensor (q_tensor_scale, k_tensor_scale; 1 for MXFP8).
//   V^T     (batch, heads_kv, head_dim, seqlen padded to 128) e4m3, so a tile is head_dim rows
//           of 128 keys, K-major like K; scales (batch, heads_kv, head_dim, padded / 32) UE8M0.
// Shared-memory tiles are TMA-swizzled (swizzle span = row bytes: 32, 64 or 128) and read with
// ldmatrix: a 16-bit ldmatrix fragment is exactly the 8-bit and the packed 4-bit MMA fragment.
//
// Key order. The S accumulator gives a lane columns 2t, 2t+1 of each 8-key tile, but the P
// operand of an m16n8k32 wants keys 4t..4t+3 and 16+4t..16+4t+3 of each 32-key chunk. Rather
// than shuffling P, column n of S tile j is made key 16 (j / 2) + 2 (j % 2) + 4 (n / 2) + n % 2
// by choosing which K rows ldmatrix reads (key_of); a lane's S values of tiles 4c..4c+3 are then
// exactly its P fragment of key chunk c, in order.
//
// Compile-time parameters: HEAD_DIM (64 or 128), IS_NVFP4 (0: MXFP8 Q/K).
#include "common.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "mma_sync.cuh"
#include "softmax.cuh"
#include "block_scale_mma.cuh"

#if !defined(HEAD_DIM) || !defined(IS_NVFP4)
#error "fwd_blockscaled.cu needs HEAD_DIM and IS_NVFP4"
#endif

namespace ptxattn {
namespace {

constexpr int kHeadDim = HEAD_DIM;
constexpr bool kNvfp4 = IS_NVFP4 != 0;
constexpr int kBlockM = 128;
constexpr int kBlockN = 128;  // keys per pipeline stage
constexpr int kStepN = 64;    // keys per softmax step
constexpr int kWarps = kBlockM / 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 2;

constexpr int kQKRowBytes = kNvfp4 ? kHeadDim / 2 : kHeadDim;
constexpr int kQKSteps = kQKRowBytes / 32;                           // MMAs along head_dim
constexpr int kScaleBytes = kNvfp4 ? kHeadDim / 16 : kHeadDim / 32;  // per Q/K row
constexpr int kScaleRegs = kNvfp4 ? kQKSteps : 1;                    // b32 per Q/K row
constexpr int kSTiles = kStepN / 8;     // 8-key tiles of S per softmax step
constexpr int kOTiles = kHeadDim / 8;   // 8-wide d tiles of O
constexpr int kPVChunks = kStepN / 32;  // 32-key MMAs of P V per softmax step
constexpr int kVRowBytes = kBlockN;

constexpr uint32_t kQTileBytes = kBlockM * kQKRowBytes;
constexpr uint32_t kKTileBytes = kBlockN * kQKRowBytes;
constexpr uint32_t kVTileBytes = kHeadDim * kVRowBytes;
constexpr uint32_t kKOffset = kQTileBytes;
constexpr uint32_t kVOffset = kKOffset + kStages * kKTileBytes;
constexpr uint32_t kBarrierOffset = kVOffset + kStages * kVTileBytes;

// Scale bytes of value 1 (UE4M3 0x38, UE8M0 0x7f), and P's 2^-8 (UE8M0 119) in every byte.
constexpr uint32_t kUnitScales = kNvfp4 ? 0x38383838u : 0x7f7f7f7fu;
constexpr uint32_t kPScales = 0x77777777u;
constexpr float kPFactor = 256.0f;
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
static_assert(kScaleBytes == 2 || kScaleBytes == 4 || kScaleBytes == 8, "row scale load width");
static_assert(kSTiles % 4 == 0 && kOTiles % 4 == 0, "scale_B registers hold four n tiles each");
static_assert(kBlockN == 2 * kStepN && kPVChunks == 2, "a tile is two softmax steps of two chunks");
static_assert(kQKSteps == 1 || kQKSteps == 2 || kQKSteps == 4, "head_dim steps are unrolled below");
static_assert(kQTileBytes % 1024 == 0 && kKTileBytes % 1024 == 0,
              "tiles keep the 1024-byte alignment of the swizzle pattern");

// TMA swizzle of a tile of kRowBytes-byte rows with span kRowBytes: the 16-byte chunk bits of
// the column are XORed with address bits 7 and up, so (row, col) lives at
// row * kRowBytes + (col ^ swizzle_bits(row)). The pattern repeats every 8 rows, so ldmatrix
// addresses are a per-lane offset plus an immediate per 16-row group.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzle_bits(int row) {
    return static_cast<uint32_t>(((row * kRowBytes) >> 7) & (kRowBytes / 16 - 1)) << 4;
}

template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
    return static_cast<uint32_t>(row * kRowBytes) +
           (static_cast<uint32_t>(col) ^ swizzle_bits<kRowBytes>(row));
}

// Key (within a softmax step) of column n of S tile j; see "Key order" above.
__device__ __forceinline__ constexpr int key_of(int j, int n) {
    return 16 * (j / 2) + 2 * (j % 2) + 4 * (n / 2) + n % 2;
}

// kScaleBytes scale bytes of `row` into b32 registers (byte i of register r = scale 4r + i);
// rows past the end get unit scales, which keeps the zero-filled data they scale finite.
__device__ __forceinline__ void load_row_scales(uint32_t (&r)[kScaleRegs], const uint8_t* scales,
                                                int64_t row, bool valid) {
    if constexpr (kScaleBytes == 8) {
        const uint2 v = valid ? __ldg(reinterpret_cast<const uint2*>(scales) + row)
                              : make_uint2(kUnitScales, kUnitScales);
        r[0] = v.x;
        r[kScaleRegs - 1] = v.y;
    } else if constexpr (kScaleBytes == 4) {
        r[0] = valid ? __ldg(reinterpret_cast<const uint32_t*>(scales) + row) : kUnitScales;
    } else {
        r[0] = valid ? __ldg(reinterpret_cast<const unsigned short*>(scales) + row) : kUnitScales;
    }
}

// S tile j += Q K^T over head_dim step kQK; tile j's K scales are in register j / 4 of the
// lanes with t = j % 4 (thread-id-b).
template <int kQK, int kTile>
__device__ __forceinline__ void mma_qk(float (&s)[4], const uint32_t (&q)[4],
                                       const uint32_t (&k)[2], const uint32_t (&q_sf)[kScaleRegs],
                                       const uint32_t (&k_sf)[kScaleRegs][kSTiles / 4]) {
    if constexpr (kNvfp4) {
        mma_nvfp4<0, kTile % 4>(s, q, k, q_sf[kQK], k_sf[kQK][kTile / 4]);
    } else {
        mma_mxfp8<kQK, 0, kQK, kTile % 4>(s, q, k, q_sf[0], k_sf[0][kTile / 4]);
    }
}

// S += Q K^T for head_dim step kQK over S tiles 2 kPair.. of a softmax step; `k_rows` is the
// lane's ldmatrix address of the step's first 16 keys at this head_dim step.
template <int kQK, int kPair>
__device__ __forceinline__ void qk_tiles(float (&s)[kSTiles][4], const uint32_t (&q)[4],
                                         uint32_t k_rows, const uint32_t (&q_sf)[kScaleRegs],
                                         const uint32_t (&k_sf)[kScaleRegs][kSTiles / 4]) {
    if constexpr (kPair < kSTiles / 2) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_rows + 16 * kPair * kQKRowBytes);
        const uint32_t b_even[2] = {kb[0], kb[1]};
        const uint32_t b_odd[2] = {kb[2], kb[3]};
        mma_qk<kQK, 2 * kPair>(s[2 * kPair], q, b_even, q_sf, k_sf);
        mma_qk<kQK, 2 * kPair + 1>(s[2 * kPair + 1], q, b_odd, q_sf, k_sf);
        qk_tiles<kQK, kPair + 1>(s, q, k_rows, q_sf, k_sf);
    }
}

// O += P V for key chunk kChunk of the tile (the byte of the V scales) over O tiles 2 kPair..;
// `v_cols` is the lane's ldmatrix address of the chunk in the first 16 head_dim rows.
template <int kChunk, int kPair>
__device__ __forceinline__ void pv_tiles(float (&o)[kOTiles][4], const uint32_t (&p)[4],
                                         uint32_t v_cols, const uint32_t (&v_sf)[kOTiles / 4]) {
    if constexpr (kPair < kOTiles / 2) {
        constexpr int kEven = 2 * kPair;
        constexpr int kOdd = 2 * kPair + 1;
        uint32_t vb[4];
        ldmatrix_x4(vb, v_cols + 16 * kPair * kVRowBytes);
        const uint32_t b_even[2] = {vb[0], vb[1]};
        const uint32_t b_odd[2] = {vb[2], vb[3]};
        mma_mxfp8<kChunk, 0, kChunk, kEven % 4>(o[kEven], p, b_even, kPScales, v_sf[kEven / 4]);
        mma_mxfp8<kChunk, 0, kChunk, kOdd % 4>(o[kOdd], p, b_odd, kPScales, v_sf[kOdd / 4]);
        pv_tiles<kChunk, kPair + 1>(o, p, v_cols, v_sf);
    }
}

// Online softmax of the warp's rows g and g+8 with an exact running max (softmax.cuh with no
// growth allowed), so that probabilities stay in (0, 1] for their e4m3 requantization.
using RowSoftmax = OnlineSoftmax<1, 0>;

// What a thread needs for every softmax step, fixed before the K/V loop.
struct StepContext {
    uint32_t q_tile;
    uint32_t q_lane[kQKSteps];       // ldmatrix offsets of the warp's Q rows per head_dim step
    uint32_t k_lane[kQKSteps];       // of K rows (permuted by key_of) per head_dim step
    uint32_t v_lane[kBlockN / 32];   // of V^T rows per key chunk of a tile
    uint32_t q_sf[kScaleRegs];       // scale_A: row l/4 + 8 (l%2) of the warp's 16
    const uint8_t* k_scale;
    int64_t k_scale_row0;            // batch * seqlen_k
    int heads_kv, head_kv, seqlen_k;
    int k_sf_key;                    // key (in a step) whose scales this lane supplies for tile t
    int first_row;                   // query row g of this warp; the lane also owns row + 8
    int row0;                        // first query row of the block
    int diag;                        // causal: query i sees key j iff j <= i + diag
    int causal;
    int t;
    float scale_log2;
};

// Softmax step kStep (keys kStep * kStepN.. of K/V tile `tile`, in shared memory at k_tile,
// v_tile): S, mask, online softmax, O += P V.
template <int kStep>
__device__ __forceinline__ void softmax_step(const StepContext& c, int tile, uint32_t k_tile,
                                             uint32_t v_tile, const uint32_t (&v_sf)[kOTiles / 4],
                                             RowSoftmax& softmax, float (&o)[kOTiles][4]) {
    const int key0 = tile * kBlockN + kStep * kStepN;

    uint32_t k_sf[kScaleRegs][kSTiles / 4];
#pragma unroll
    for (int r = 0; r < kSTiles / 4; ++r) {
        const int key = key0 + 32 * r + c.k_sf_key;
        uint32_t regs[kScaleRegs];
        load_row_scales(regs, c.k_scale, (c.k_scale_row0 + key) * c.heads_kv + c.head_kv,
                        key < c.seqlen_k);
#pragma unroll
        for (int i = 0; i < kScaleRegs; ++i) k_sf[i][r] = regs[i];
    }

    float s[kSTiles][4];
#pragma unroll
    for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
    }
    const uint32_t k_rows = k_tile + kStep * kStepN * kQKRowBytes;
    uint32_t q_frag[4];
    ldmatrix_x4(q_frag, c.q_tile + c.q_lane[0]);
    qk_tiles<0, 0>(s, q_frag, k_rows + c.k_lane[0], c.q_sf, k_sf);
    if constexpr (kQKSteps > 1) {
        ldmatrix_x4(q_frag, c.q_tile + c.q_lane[1]);
        qk_tiles<1, 0>(s, q_frag, k_rows + c.k_lane[1], c.q_sf, k_sf);
    }
    if constexpr (kQKSteps > 2) {
        ldmatrix_x4(q_frag, c.q_tile + c.q_lane[2]);
        qk_tiles<2, 0>(s, q_frag, k_rows + c.k_lane[2], c.q_sf, k_sf);
        ldmatrix_x4(q_frag, c.q_tile + c.q_lane[3]);
        qk_tiles<3, 0>(s, q_frag, k_rows + c.k_lane[3], c.q_sf, k_sf);
    }

    const bool tail = key0 + kStepN > c.seqlen_k;
    const bool diagonal = c.causal && key0 + kStepN - 1 > c.row0 + c.diag;
    if (tail || diagonal) {
        // Column (j, e) of this lane holds key key0 + 4t + key_of(j, e).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = c.first_row + 8 * h;
            const int last = c.causal ? min(c.seqlen_k - 1, row + c.diag) : c.seqlen_k - 1;
            const int last_offset = last - key0 - 4 * c.t;
#pragma unroll
            for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (key_of(j, e) > last_offset) s[j][2 * h + e] = -__int_as_float(0x7f800000);
                }
            }
        }
    }

    float rescale[1][2];
    if (softmax.update(reinterpret_cast<float(&)[1][kSTiles][4]>(s), c.scale_log2, rescale)) {
        scale_rows(reinterpret_cast<float(&)[1][kOTiles][4]>(o), rescale);
    }

    // P fragment of chunk n: rows g / g+8 (h), keys 4t.. (S tiles 4n, 4n+1) and 16+4t.. (4n+2,
    // 4n+3).
    uint32_t p_frag[kPVChunks][4];
#pragma unroll
    for (int n = 0; n < kPVChunks; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int upper = 0; upper < 2; ++upper) {
                const float(&lo)[4] = s[4 * n + 2 * upper];
                const float(&hi)[4] = s[4 * n + 2 * upper + 1];
                p_frag[n][2 * upper + h] =
                    e4m3x4(kPFactor * lo[2 * h], kPFactor * lo[2 * h + 1],
                                kPFactor * hi[2 * h], kPFactor * hi[2 * h + 1]);
            }
        }
    }
    constexpr int kChunk0 = kStep * kPVChunks;  // first key chunk of this step within the tile
    pv_tiles<kChunk0, 0>(o, p_frag[0], v_tile + c.v_lane[kChunk0], v_sf);
    pv_tiles<kChunk0 + 1, 0>(o, p_frag[1], v_tile + c.v_lane[kChunk0 + 1], v_sf);
}

}  // namespace
}  // namespace ptxattn

using namespace ptxattn;

extern "C" __global__ void __launch_bounds__(kThreads, 1)
fwd_blockscaled(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
                const __grid_constant__ TensorMap v_map, const uint8_t* __restrict__ q_scale,
                const uint8_t* __restrict__ k_scale, const uint8_t* __restrict__ v_scale,
                const float* __restrict__ q_tensor_scale, const float* __restrict__ k_tensor_scale,
                uint16_t* __restrict__ out, float* __restrict__ lse, int seqlen_q, int seqlen_k,
                int heads_q, int heads_kv, int v_scale_row, float softmax_scale, int causal) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uint64_t>(smem_raw) + 1023) & ~static_cast<uint64_t>(1023));
    MBarrier* full = reinterpret_cast<MBarrier*>(smem + kBarrierOffset);
    MBarrier* empty = full + kStages;
    MBarrier& q_full = empty[kStages];

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_kv = head / (heads_q / heads_kv);
    const int row0 = blockIdx.x * kBlockM;
    const int diag = seqlen_k - seqlen_q;
    const int kv_end = causal ? min(seqlen_k, row0 + kBlockM + diag) : seqlen_k;
    const int n_tiles = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;

    const auto load_kv = [&](int stage, int tile) {
        full[stage].arrive_expect_tx(kKTileBytes + kVTileBytes);
        tma_load_4d(smem + kKOffset + stage * kKTileBytes, &k_map, full[stage], 0, head_kv,
                    tile * kBlockN, batch);
        tma_load_4d(smem + kVOffset + stage * kVTileBytes, &v_map, full[stage], tile * kBlockN, 0,
                    head_kv, batch);
    };
    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            full[s].init(1);
            empty[s].init(kWarps);
        }
        q_full.init(1);
        fence_barrier_init();
        tma_prefetch(&q_map);
        tma_prefetch(&k_map);
        tma_prefetch(&v_map);
    }
    __syncthreads();
    if (tid == 0) {
        q_full.arrive_expect_tx(kQTileBytes);
        tma_load_4d(smem, &q_map, q_full, 0, head, row0, batch);
        for (int s = 0; s < kStages && s < n_tiles; ++s) load_kv(s, s);
    }

    StepContext c;
    {
        // scale_A from lane l is row l/4 + 8 (l%2), which serves thread-id-a 0 and 1 alike.
        const int row = row0 + warp * 16 + g + 8 * (lane % 2);
        load_row_scales(c.q_sf, q_scale,
                        (static_cast<int64_t>(batch) * seqlen_q + row) * heads_q + head,
                        row < seqlen_q);
    }
    // ldmatrix lanes 8i..8i+7 address the rows of matrix i. Q (m16 A operand): matrices (rows
    // 0-7, bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31). K and V^T (B operands of two
    // 8-wide tiles): (tile 0, bytes 0-15), (0, 16-31), (1, 0-15), (1, 16-31), K's rows permuted
    // by key_of. One offset per head_dim step or key chunk; 16-row groups add an immediate.
    const int half_col = 16 * ((lane / 8) % 2);
    const int q_row = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
    const int k_row = key_of(lane / 16, lane % 8);
    const int v_row = 8 * (lane / 16) + lane % 8;
#pragma unroll
    for (int step = 0; step < kQKSteps; ++step) {
        c.q_lane[step] = swizzled<kQKRowBytes>(q_row, 32 * step + 16 * (lane / 16));
        c.k_lane[step] = swizzled<kQKRowBytes>(k_row, 32 * step + half_col);
    }
#pragma unroll
    for (int chunk = 0; chunk < kBlockN / 32; ++chunk) {
        c.v_lane[chunk] = swizzled<kVRowBytes>(v_row, 32 * chunk + half_col);
    }
    c.q_tile = smem_addr(smem);
    c.k_scale = k_scale;
    c.k_scale_row0 = static_cast<int64_t>(batch) * seqlen_k;
    c.heads_kv = heads_kv;
    c.head_kv = head_kv;
    c.seqlen_k = seqlen_k;
    // scale_B of S tile j (key_of(j, n) for n = lane/4) sits in register j / 4 of the lanes
    // with t = j % 4, and so does that of O tile j (d = 8j + lane/4).
    c.k_sf_key = key_of(t, g);
    c.first_row = row0 + warp * 16 + g;
    c.row0 = row0;
    c.diag = diag;
    c.causal = causal;
    c.t = t;
    c.scale_log2 = softmax_scale * kLog2e * *q_tensor_scale * *k_tensor_scale;
    const int v_sf_dim = 8 * t + g;
    const uint8_t* v_scale_head =
        v_scale + (static_cast<int64_t>(batch) * heads_kv + head_kv) * kHeadDim * v_scale_row;

    RowSoftmax softmax;
    softmax.init();
    float o[kOTiles][4];
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[j][i] = 0.0f;
    }
    q_full.wait(0);

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile % kStages;
        const uint32_t phase = (tile / kStages) & 1;
        const uint32_t k_tile = smem_addr(smem + kKOffset + stage * kKTileBytes);
        const uint32_t v_tile = smem_addr(smem + kVOffset + stage * kVTileBytes);

        // V scales: byte n of a register scales key chunk n of the tile (both softmax steps).
        uint32_t v_sf[kOTiles / 4];
#pragma unroll
        for (int r = 0; r < kOTiles / 4; ++r) {
            const int64_t row = 32 * r + v_sf_dim;
            v_sf[r] = __ldg(reinterpret_cast<const uint32_t*>(v_scale_head + row * v_scale_row) +
                            tile);
        }
        full[stage].wait(phase);
        softmax_step<0>(c, tile, k_tile, v_tile, v_sf, softmax, o);
        softmax_step<1>(c, tile, k_tile, v_tile, v_sf, softmax, o);

        __syncwarp();
        if (lane == 0) empty[stage].arrive();
        if (tid == 0 && tile + kStages < n_tiles) {
            empty[stage].wait(phase);
            load_kv(stage, tile + kStages);
        }
    }

    float inv_sum[1][2], row_lse[1][2];
    softmax.finalize(inv_sum, row_lse);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + warp * 16 + g + 8 * h;
        if (row >= seqlen_q) continue;
        const int64_t out_row = (static_cast<int64_t>(batch) * seqlen_q + row) * heads_q + head;
        uint32_t* dst = reinterpret_cast<uint32_t*>(out + out_row * kHeadDim + 2 * t);
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
            dst[4 * j] =
                pack_f32x2<true>(o[j][2 * h] * inv_sum[0][h], o[j][2 * h + 1] * inv_sum[0][h]);
        }
        if (t == 0) {
            lse[(static_cast<int64_t>(batch) * heads_q + head) * seqlen_q + row] = row_lse[0][h];
        }
    }
}
