// Mainloop of the block-scaled forward (fwd_blockscaled.cu): MXFP8 or NVFP4 Q and K, MXFP8 V, on
// block-scaled mma.sync (sm_120a), or its exact emulation (block_scale_mma.cuh) on sm_90a.
//
// A block of 8 warps owns 128 query rows; warp w owns rows 16w..16w+15, so every MMA is one
// m16 tile and the K/V tiles are shared by all warps. Each K/V tile of 128 keys is consumed in
// two softmax steps of 64 keys, which halves the live S accumulator (the emulation build needs
// those registers). Per step:
//   S = Q K^T      block-scaled MMAs with the Q and K scales (one register per lane holds a
//                  row's scales for four k blocks, or a column's for four n tiles through
//                  thread-id-b)
//   online softmax with an exact running max (RowSoftmax), the mask only where a step needs it
//   O += P V       P is requantized to e4m3 as 2^8 p (0 < p <= 1 then sits in e4m3's normal
//                  range down to p = 2^-14) and its scale_A byte 2^-8 undoes the factor; V's
//                  UE8M0 scales run along the keys, P V's contraction axis, so the MMA's scale_B
//                  applies them exactly.
// Shared-memory tiles are TMA-swizzled (swizzle span = row bytes: 32, 64 or 128; tma.cuh's
// swizzled_offset) and read with ldmatrix: a 16-bit ldmatrix fragment is exactly the 8-bit and
// the packed 4-bit MMA fragment.
//
// Key order. The S accumulator gives a lane columns 2t, 2t+1 of each 8-key tile, but the P
// operand of an m16n8k32 wants keys 4t..4t+3 and 16+4t..16+4t+3 of each 32-key chunk. Rather
// than shuffling P, column n of S tile j is made key 16 (j / 2) + 2 (j % 2) + 4 (n / 2) + n % 2
// by choosing which K rows ldmatrix reads (key_of); a lane's S values of tiles 4c..4c+3 are then
// exactly its P fragment of key chunk c, in order.
#pragma once
#include "roles/block_info.cuh"
#include "ptx/block_scale_mma.cuh"
#include "ptx/common.cuh"
#include "roles/mask.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/softmax.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {

// HeadDim 64 or 128; Nvfp4: NVFP4 Q/K (else MXFP8).
template <int HeadDim, bool Nvfp4>
struct BlockScaledMainloop {
    static constexpr int kHeadDim = HeadDim;
    static constexpr bool kNvfp4 = Nvfp4;
    static constexpr int kBlockM = 128;
    static constexpr int kBlockN = 128;  // keys per pipeline stage
    static constexpr int kStepN = 64;    // keys per softmax step
    static constexpr int kWarps = kBlockM / 16;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kStages = 2;

    static constexpr int kQKRowBytes = kNvfp4 ? kHeadDim / 2 : kHeadDim;
    static constexpr int kQKSteps = kQKRowBytes / 32;                           // MMAs along head_dim
    static constexpr int kScaleBytes = kNvfp4 ? kHeadDim / 16 : kHeadDim / 32;  // per Q/K row
    static constexpr int kScaleRegs = kNvfp4 ? kQKSteps : 1;                    // b32 per Q/K row
    static constexpr int kSTiles = kStepN / 8;     // 8-key tiles of S per softmax step
    static constexpr int kOTiles = kHeadDim / 8;   // 8-wide d tiles of O
    static constexpr int kPVChunks = kStepN / 32;  // 32-key MMAs of P V per softmax step
    static constexpr int kVRowBytes = kBlockN;

    static constexpr uint32_t kQTileBytes = kBlockM * kQKRowBytes;
    static constexpr uint32_t kKTileBytes = kBlockN * kQKRowBytes;
    static constexpr uint32_t kVTileBytes = kHeadDim * kVRowBytes;
    static constexpr uint32_t kKOffset = kQTileBytes;
    static constexpr uint32_t kVOffset = kKOffset + kStages * kKTileBytes;
    static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kVTileBytes;

    // Scale bytes of value 1 (UE4M3 0x38, UE8M0 0x7f), and P's 2^-8 (UE8M0 119) in every byte.
    static constexpr uint32_t kUnitScales = kNvfp4 ? 0x38383838u : 0x7f7f7f7fu;
    static constexpr uint32_t kPScales = 0x77777777u;
    static constexpr float kPFactor = 256.0f;
    static constexpr float kLog2e = 1.4426950408889634f;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kScaleBytes == 2 || kScaleBytes == 4 || kScaleBytes == 8, "row scale load width");
    static_assert(kSTiles % 4 == 0 && kOTiles % 4 == 0, "scale_B registers hold four n tiles each");
    static_assert(kBlockN == 2 * kStepN && kPVChunks == 2, "a tile is two softmax steps of two chunks");
    static_assert(kQKSteps == 1 || kQKSteps == 2 || kQKSteps == 4, "head_dim steps are unrolled below");
    static_assert(kQTileBytes % 1024 == 0 && kKTileBytes % 1024 == 0,
                  "tiles keep the 1024-byte alignment of the swizzle pattern");

    // Byte offset of byte column `col` (a multiple of 16) of tile row `row`.
    template <int kRowBytes>
    static __device__ __forceinline__ uint32_t swizzled_col(int row, int col) {
        return swizzled_offset<kRowBytes>(row, col / 16);
    }

    // Key (within a softmax step) of column n of S tile j; see "Key order" above.
    static __device__ __forceinline__ constexpr int key_of(int j, int n) {
        return 16 * (j / 2) + 2 * (j % 2) + 4 * (n / 2) + n % 2;
    }

    // kScaleBytes scale bytes of `row` into b32 registers (byte i of register r = scale 4r + i);
    // rows past the end get unit scales, which keeps the zero-filled data they scale finite.
    static __device__ __forceinline__ void load_row_scales(uint32_t (&r)[kScaleRegs], const uint8_t* scales,
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
    static __device__ __forceinline__ void mma_qk(float (&s)[4], const uint32_t (&q)[4],
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
    static __device__ __forceinline__ void qk_tiles(float (&s)[kSTiles][4], const uint32_t (&q)[4],
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
    static __device__ __forceinline__ void pv_tiles(float (&o)[kOTiles][4], const uint32_t (&p)[4],
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
        int n_step_masked;               // softmax steps from this one on need the mask
        SeqMask mask;                    // which keys each row sees
        int t;
        float scale_log2;

        __device__ __forceinline__ bool step_masked(int step) const { return step >= n_step_masked; }
    };

    // The key offset (from key0 + 4t) of column (j, e) of S: see "Key order" above.
    struct StepColumns {
        __device__ __forceinline__ constexpr int operator()(int j, int e) const { return key_of(j, e); }
    };

    // Softmax step kStep (keys kStep * kStepN.. of K/V tile `tile`, in shared memory at k_tile,
    // v_tile): S, mask, online softmax, O += P V.
    template <int kStep>
    static __device__ __forceinline__ void softmax_step(const StepContext& c, int tile, uint32_t k_tile,
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

        if (c.step_masked(key0 / kStepN)) {
            apply_mask<16>(reinterpret_cast<float(&)[1][kSTiles][4]>(s), c.mask, c.first_row,
                           key0 + 4 * c.t, StepColumns{});
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
};

}  // namespace ptxattn
