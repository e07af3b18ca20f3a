// The GEMMs of attention over an e4m3 (FP8) KV cache on mma.sync, for the serving kernels
// (fwd_decode_mma_sync.cu, fwd_mla_mma_sync.cu): f16 MMAs whose B fragments are read from an e4m3
// stage (E4m3Tile, smem_tile.cuh) as 4-byte words and dequantized in registers
// (e4m3x4_to_16bit, exact), and whose A fragments are Q's, in f16, and P's.
//
// f16 whatever the queries' dtype: bf16 queries are converted to f16 in the Q tile first
// (prepare_q), each row scaled by a power of two that brings its largest value to [2^14, 2^15),
// and the scores scaled back (unscale_scores): f16 holds a bf16 value of the row's top 32 binades
// exactly (smaller ones lose bits as f16 subnormals, below 2^-24 of the scaled max they flush),
// and P in f16 is more precise than in bf16. A bf16 GEMM would need bf16 B fragments,
// which no instruction converts e4m3 to in one step (e4m3x4_to_16bit's integer path), and those
// instructions set the kernel's pace (docs/design/serving.md#fp8-caches).
//
// Fragment layouts: mma_sync.cuh; g = lane / 4, t = lane % 4.
//   S = Q K^T: a k step's 16 columns are summed in any order, so logical k = 2t, 2t+1 (b0) and
//     2t+8, 2t+9 (b1) are taken as columns 4t .. 4t+3 of the step: one word of K row g, one
//     8-byte load of each Q row for (a0, a2) and (a1, a3).
//   O += P V: P's keys are 2t, 2t+1, 2t+8, 2t+9 of a 16-key step (S's accumulator layout);
//     thread (g, t) loads the word of columns 4g .. 4g+3 of a 32-column group in each of those
//     four keys' rows and transposes the 4 x 4 bytes (prmt) into the B fragments of four 8-column
//     tiles, so that tile 4c + q, column n of O holds V's column 32c + 4n + q (output_column).
//
// Cfg names the shapes: kMTiles (16-row groups of Q), kSTiles (a warp's 8-key S tiles), kKSteps
// (Q K^T's k steps), kPSteps (P V's 16-key steps), kOTiles (a warp's 8-column O tiles, a multiple
// of 4), kRows, kWarps, kRowBytes and kChunksPerRow (the 16-bit Q tile's), kFp8RowBytes (the e4m3
// tile's rows) and kBf16 (the queries').
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/e4m3.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/smem_tile.cuh"
#include "roles/softmax.cuh"

namespace ptxattn {

template <class Cfg>
struct E4m3Gemms {
    using QTile = SwizzledTile<Cfg::kRowBytes>;
    using Fp8Tile = E4m3Tile<Cfg::kFp8RowBytes>;
    // Q K^T's k steps whose K words are loaded at a time (one group ahead of their use)
    static constexpr int kKGroup = Cfg::kKSteps % 8 == 0 ? 8 : 4;
    static_assert(Cfg::kKSteps % kKGroup == 0 && Cfg::kOTiles % 4 == 0, "whole groups");

    // Every load is issued before the conversions and MMAs that use it: ld.shared, like the
    // MMAs, is volatile asm, kept in program order, so a load placed after an MMA would wait for
    // that MMA's operands and each k step would pay a load's latency.
    static __device__ __forceinline__ uint32_t load_word(uint32_t addr) {
        uint32_t word;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(word) : "r"(addr));
        return word;
    }

    // bf16 queries: the landed Q tile (rows past the tile's are zeros) to f16 in place, row r
    // times 2^-e_r with 2^14 <= max |q_r| 2^-e_r < 2^15, and 2^e_r into row_scale[r]; warp w
    // converts rows w, w + kWarps, ... Call between barriers. Nothing for f16 queries.
    static __device__ __forceinline__ void prepare_q(uint8_t* q_tile, float* row_scale,
                                                     int warp, int lane) {
        if constexpr (Cfg::kBf16) {
            constexpr int kChunks = Cfg::kChunksPerRow;
            for (int row = warp; row < Cfg::kRows; row += Cfg::kWarps) {
                float amax = 0.0f;
                for (int c = lane; c < kChunks; c += 32) {
                    const uint4 x = *reinterpret_cast<const uint4*>(q_tile + QTile::offset(row, c));
                    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 pair = unpack_f32x2<true>(words[i]);
                        amax = fmaxf(amax, fmaxf(fabsf(pair.x), fabsf(pair.y)));
                    }
                }
#pragma unroll
                for (int bit = 16; bit >= 1; bit /= 2) {
                    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, bit));
                }
                // floor(log2 amax) - 14 from the exponent field, at least -100 (2^e and 2^-e stay
                // normal floats; a row whose max is below 2^-86 keeps less headroom in f16); a
                // zero row keeps 1
                const int e = amax > 0.0f
                                  ? max(((__float_as_int(amax) >> 23) & 0xff) - 127 - 14, -100)
                                  : 0;
                const float down = __int_as_float((127 - e) << 23);  // 2^-e
                if (lane == 0) row_scale[row] = __int_as_float((127 + e) << 23);
                for (int c = lane; c < kChunks; c += 32) {
                    uint4* chunk = reinterpret_cast<uint4*>(q_tile + QTile::offset(row, c));
                    const uint4 x = *chunk;
                    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
                    uint32_t out[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 pair = unpack_f32x2<true>(words[i]);
                        out[i] = pack_f32x2<false>(pair.x * down, pair.y * down);
                    }
                    *chunk = make_uint4(out[0], out[1], out[2], out[3]);
                }
            }
        }
    }

    // Before the main loop, once the prologue has committed its kStages - 1 groups (Q's copies
    // in the first): Q landed and prepared (prepare_q), and this thread's rows' scales.
    template <int kStages>
    static __device__ __forceinline__ void ready_q(float (&scale)[Cfg::kMTiles][2], uint8_t* q_tile,
                                                   float* row_scale, int warp, int lane) {
        if constexpr (Cfg::kBf16) {
            cp_async_wait<kStages - 2>();
            __syncthreads();
            prepare_q(q_tile, row_scale, warp, lane);
            __syncthreads();
        }
        row_scales(scale, row_scale, lane);
    }

    // This thread's rows' scales (prepare_q's row_scale, after a barrier); 1 for f16 queries.
    static __device__ __forceinline__ void row_scales(float (&scale)[Cfg::kMTiles][2],
                                                      const float* row_scale, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                scale[m][h] = Cfg::kBf16 ? row_scale[16 * m + (lane >> 2) + 8 * h] : 1.0f;
            }
        }
    }

    // bf16 queries: scores times their rows' scales, exactly.
    static __device__ __forceinline__ void unscale_scores(
        float (&s)[Cfg::kMTiles][Cfg::kSTiles][4], const float (&scale)[Cfg::kMTiles][2]) {
        if constexpr (Cfg::kBf16) scale_rows(s, scale);
    }

    // Q's A fragments of k step ks: columns 4t .. 4t+3 of the step in rows g, g + 8.
    static __device__ __forceinline__ void load_q(uint32_t (&a)[Cfg::kMTiles][4], uint32_t q_tile,
                                                  int ks, int lane) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t at = q_tile + QTile::element_offset(16 * m + (lane >> 2) + 8 * h,
                                                                   16 * ks + 4 * (lane & 3));
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];"
                             : "=r"(a[m][h]), "=r"(a[m][h + 2]) : "r"(at));
            }
        }
    }

    // K's words of k steps kKGroup * group .. of this warp's keys (rows from k_tile).
    static __device__ __forceinline__ void load_k_group(uint32_t (&words)[kKGroup][Cfg::kSTiles],
                                                        uint32_t k_tile, int group, int lane) {
#pragma unroll
        for (int i = 0; i < kKGroup; ++i) {
#pragma unroll
            for (int j = 0; j < Cfg::kSTiles; ++j) {
                words[i][j] = load_word(k_tile +
                                        Fp8Tile::offset(8 * j + (lane >> 2), kKGroup * group + i) +
                                        4 * (lane & 3));
            }
        }
    }

    // S (all rows x this warp's keys, K rows from k_tile, a multiple of 16 rows into its tile)
    // = Q K^T, scores raw (before unscale_scores).
    static __device__ __forceinline__ void gemm_qk(float (&s)[Cfg::kMTiles][Cfg::kSTiles][4],
                                                   uint32_t q_tile, uint32_t k_tile, int lane) {
        constexpr int kGroups = Cfg::kKSteps / kKGroup;
        uint32_t words[2][kKGroup][Cfg::kSTiles];
        uint32_t a[2][Cfg::kMTiles][4];  // k steps ks and ks + 1
        load_k_group(words[0], k_tile, 0, lane);
        load_q(a[0], q_tile, 0, lane);
        zero_fill(s);
#pragma unroll
        for (int group = 0; group < kGroups; ++group) {
            if (group + 1 < kGroups) load_k_group(words[(group + 1) % 2], k_tile, group + 1, lane);
#pragma unroll
            for (int i = 0; i < kKGroup; ++i) {
                const int ks = kKGroup * group + i;
                if (ks + 1 < Cfg::kKSteps) load_q(a[(ks + 1) % 2], q_tile, ks + 1, lane);
#pragma unroll
                for (int j = 0; j < Cfg::kSTiles; ++j) {
                    const uint2 b = e4m3x4_to_16bit<false>(words[group % 2][i][j]);
                    const uint32_t b_frag[2] = {b.x, b.y};
#pragma unroll
                    for (int m = 0; m < Cfg::kMTiles; ++m) {
                        mma_m16n8k16<false>(s[m][j], a[ks % 2][m], b_frag);
                    }
                }
            }
        }
    }

    // P as f16 A fragments (MmaSyncMainloop::pack_probabilities' layout).
    static __device__ __forceinline__ void pack_probabilities(
        uint32_t (&a)[Cfg::kMTiles][Cfg::kPSteps][4],
        const float (&p)[Cfg::kMTiles][Cfg::kSTiles][4]) {
#pragma unroll
        for (int m = 0; m < Cfg::kMTiles; ++m) {
#pragma unroll
            for (int ks = 0; ks < Cfg::kPSteps; ++ks) {
                a[m][ks][0] = pack_f32x2<false>(p[m][2 * ks][0], p[m][2 * ks][1]);
                a[m][ks][1] = pack_f32x2<false>(p[m][2 * ks][2], p[m][2 * ks][3]);
                a[m][ks][2] = pack_f32x2<false>(p[m][2 * ks + 1][0], p[m][2 * ks + 1][1]);
                a[m][ks][3] = pack_f32x2<false>(p[m][2 * ks + 1][2], p[m][2 * ks + 1][3]);
            }
        }
    }

    // O (this warp's kOTiles * 8 columns, from V's column 16 first_unit) += P V over kPSteps
    // steps of 16 keys, V rows from v_tile (a multiple of 16 rows into its tile).
    static __device__ __forceinline__ void gemm_pv(
        float (&o)[Cfg::kMTiles][Cfg::kOTiles][4],
        const uint32_t (&p)[Cfg::kMTiles][Cfg::kPSteps][4], uint32_t v_tile, int first_unit,
        int lane) {
        const int g = lane >> 2;
        const int t = lane & 3;
#pragma unroll
        for (int ks = 0; ks < Cfg::kPSteps; ++ks) {
            // columns 32c + 4g .. + 3 of keys 16ks + 2t, +1, +8, +9, every group c
            uint32_t w[Cfg::kOTiles / 4][4];
#pragma unroll
            for (int c = 0; c < Cfg::kOTiles / 4; ++c) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = 16 * ks + 2 * t + (i & 1) + 8 * (i >> 1);
                    w[c][i] = load_word(v_tile +
                                        Fp8Tile::offset(row, first_unit + 2 * c + (g >> 2)) +
                                        4 * (g & 3));
                }
            }
#pragma unroll
            for (int c = 0; c < Cfg::kOTiles / 4; ++c) {
                const uint32_t lo01 = __byte_perm(w[c][0], w[c][1], 0x5140);
                const uint32_t hi01 = __byte_perm(w[c][0], w[c][1], 0x7362);
                const uint32_t lo23 = __byte_perm(w[c][2], w[c][3], 0x5140);
                const uint32_t hi23 = __byte_perm(w[c][2], w[c][3], 0x7362);
                const uint32_t column[4] = {
                    __byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                    __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const uint2 b = e4m3x4_to_16bit<false>(column[q]);
                    const uint32_t b_frag[2] = {b.x, b.y};
#pragma unroll
                    for (int m = 0; m < Cfg::kMTiles; ++m) {
                        mma_m16n8k16<false>(o[m][4 * c + q], p[m][ks], b_frag);
                    }
                }
            }
        }
    }

    // V's column (from gemm_pv's first one) of accumulator tile j, column `col` (< 8).
    static __device__ __forceinline__ constexpr int output_column(int j, int col) {
        return 32 * (j >> 2) + 4 * col + (j & 3);
    }
};

}  // namespace ptxattn
