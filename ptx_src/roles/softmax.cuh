// Online softmax on tensor-core accumulator fragments, exp2 form (FlashAttention-2 recurrence).
//
// Fragment view: float frag[kRowPairs][kTiles][4]. Slab r covers one 16-row group of which this
// thread owns rows g and g+8 (g = lane / 4, t = lane % 4); tile j covers 8 columns, and its four
// values are (row g: columns 8j+2t, 8j+2t+1) then (row g+8: the same columns). This is the
// mma.sync m16n8 C/D layout repeated over M (kRowPairs) and N (kTiles), and also the accumulator
// of one warp of a wgmma m64nNk16 (kRowPairs = 1, kTiles = N / 8), so every kernel shares
// this file. The four threads of a quad own one row together: a row max is completed with two
// xor-shuffles (ex2 and shfl.sync.bfly PTX); row sums stay per thread until finalize(), because
// the rescale factors are already uniform across the quad.
//
// Scores enter raw (unscaled). With c = softmax_scale * log2(e) > 0, the reference max is kept
// scaled (m = c * max s, -inf while a row has seen no key) and probabilities are
// exp2(c * s - m): one FFMA and one ex2.approx per score.
#pragma once
#include "ptx/common.cuh"
#include "ptx/mma_sync.cuh"

namespace ptxattn {

// ex2.approx.ftz.f32: 2^x, 2 ulp, exp2(-inf) = +0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// rcp.approx.ftz.f32: 1/x, 1 ulp.
__device__ __forceinline__ float reciprocal_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Multiplies each owned row of an accumulator (same fragment view) by its factor.
template <int kRowPairs, int kTiles>
__device__ __forceinline__ void scale_rows(float (&acc)[kRowPairs][kTiles][4],
                                           const float (&factor)[kRowPairs][2]) {
#pragma unroll
    for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
            acc[r][j][0] *= factor[r][0];
            acc[r][j][1] *= factor[r][0];
            acc[r][j][2] *= factor[r][1];
            acc[r][j][3] *= factor[r][1];
        }
    }
}

struct Max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

struct Sum {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduces with `op` the 2 * kTiles values this thread holds of row h of a 16-row slab, as a
// balanced tree: a chain of dependent instructions log2(2 * kTiles) long instead of 2 * kTiles,
// which matters when few warps share a scheduler (the Hopper kernel runs two per scheduler).
template <int kTiles, typename Op>
__device__ __forceinline__ float row_reduce(const float (&tiles)[kTiles][4], int h, Op op) {
    float v[2 * kTiles];
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
        v[2 * j] = tiles[j][2 * h];
        v[2 * j + 1] = tiles[j][2 * h + 1];
    }
#pragma unroll
    for (int width = 1; width < 2 * kTiles; width *= 2) {
#pragma unroll
        for (int i = 0; i + width < 2 * kTiles; i += 2 * width) v[i] = op(v[i], v[i + width]);
    }
    return v[0];
}

// kMaxGrowthLog2: how far (log2 units) a row's maximum may climb past the reference it subtracts
// before the reference moves. 8 leaves most blocks without a rescale of the output; 0 keeps the
// reference the exact running maximum, so probabilities stay in (0, 1] and a row's largest is
// exactly 1: the kernels that round P to e4m3 (fwd_sm90.cu's FP8 build, fwd_blockscaled.cu) use
// that, since e4m3 would round a largest probability 2^d by up to 6%.
template <int kRowPairs, int kMaxGrowthLog2 = 8>
struct OnlineSoftmax {
    static constexpr float kMaxGrowth = kMaxGrowthLog2;

    float row_max[kRowPairs][2];  // scaled running max (log2 units), -inf before any key
    float row_sum[kRowPairs][2];  // this thread's share of the running denominator

    // The max subtracted in the exponent: 0 while a row has seen no key, so masked (-inf) scores
    // give exp2(-inf) = 0 instead of NaN.
    __device__ __forceinline__ static float bias(float max) {
        return max == -__int_as_float(0x7f800000) ? 0.0f : max;
    }

    // Overwrites this thread's scores of row h with exp2(c * s - m); returns their sum.
    template <int kTiles>
    __device__ __forceinline__ static float exp_row(float (&s)[kTiles][4], int h,
                                                    float scale_log2, float m) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; ++c) {
                s[j][c] = exp2_approx(fmaf(s[j][c], scale_log2, -m));
            }
        }
        return row_reduce<kTiles>(s, h, Sum{});
    }

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                row_max[r][h] = -__int_as_float(0x7f800000);
                row_sum[r][h] = 0.0f;
            }
        }
    }

    // Folds one block of raw scores into the running statistics and overwrites `s` with the
    // unnormalised probabilities exp2(c * s - m). The reference max m of a row only moves when
    // some row of the warp would gain more than kMaxGrowth over its own m; otherwise the stale m
    // is kept, which is exact (numerator and denominator share it) and keeps probabilities below
    // 2^kMaxGrowth, far from overflow in any of fp32, bf16 and fp16. Most blocks then leave the
    // output accumulator alone. Returns, uniformly across the warp, whether the output
    // accumulated so far must be multiplied by `rescale`.
    template <int kTiles>
    __device__ __forceinline__ bool update(float (&s)[kRowPairs][kTiles][4], float scale_log2,
                                           float (&rescale)[kRowPairs][2]) {
        float block_max[kRowPairs][2];
        bool grows = false;
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                block_max[r][h] = quad_max(row_reduce<kTiles>(s[r], h, Max{})) * scale_log2;
                grows |= block_max[r][h] > row_max[r][h] + kMaxGrowth;
            }
        }
        const bool move = __any_sync(0xffffffffu, grows);
        fold(s, scale_log2, block_max, move, rescale);
        return move;
    }

    // update() for warps that share rows but score different keys of a block (the MLA decode
    // kernel): `block_max` is each row's raw max over the whole block, which the warps agree on
    // (exchanged through shared memory), so every warp moves the same references and computes
    // the same `rescale`; the row sums stay this warp's share over its own keys.
    template <int kTiles>
    __device__ __forceinline__ bool update_with_max(float (&s)[kRowPairs][kTiles][4],
                                                    float scale_log2,
                                                    const float (&block_max)[kRowPairs][2],
                                                    float (&rescale)[kRowPairs][2]) {
        float scaled_max[kRowPairs][2];
        bool grows = false;
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                scaled_max[r][h] = block_max[r][h] * scale_log2;
                grows |= scaled_max[r][h] > row_max[r][h] + kMaxGrowth;
            }
        }
        const bool move = __any_sync(0xffffffffu, grows);
        fold(s, scale_log2, scaled_max, move, rescale);
        return move;
    }

    // The second half of update(), given each row's scaled block max and whether the references
    // move: the new references and `rescale` (if they move), the probabilities in place of `s`
    // and the row sums.
    template <int kTiles>
    __device__ __forceinline__ void fold(float (&s)[kRowPairs][kTiles][4], float scale_log2,
                                         const float (&block_max)[kRowPairs][2], bool move,
                                         float (&rescale)[kRowPairs][2]) {
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (move) {
                    const float new_max = fmaxf(row_max[r][h], block_max[r][h]);
                    rescale[r][h] = exp2_approx(row_max[r][h] - bias(new_max));
                    row_max[r][h] = new_max;
                }
                const float block_sum = exp_row<kTiles>(s[r], h, scale_log2, bias(row_max[r][h]));
                row_sum[r][h] = move ? fmaf(row_sum[r][h], rescale[r][h], block_sum)
                                     : row_sum[r][h] + block_sum;
            }
        }
    }

    // The common case of update(), without its max pass: probabilities exp2(c * s - m) with each
    // row's reference max m unchanged, in place, and this thread's share of their row sums in
    // `block_sum`. That is what update() does when no row max grew by more than kMaxGrowth,
    // i.e. when no probability exceeds 2^kMaxGrowth; returns whether this thread can vouch for
    // that: each of its shares is at most 2^kMaxGrowth (which a larger probability would
    // exceed; a share may exceed it with none larger, which only costs the slow path) and its
    // rows have a max already. If the caller's threads all vouch, it passes `block_sum` to
    // add_block_sums(); otherwise `s` is spoiled, and the caller recomputes the raw scores and
    // calls update(). Either way the results are bitwise those of update() alone.
    template <int kTiles>
    __device__ __forceinline__ bool exp_with_stale_max(float (&s)[kRowPairs][kTiles][4],
                                                       float scale_log2,
                                                       float (&block_sum)[kRowPairs][2]) const {
        bool holds = true;
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m = row_max[r][h];
                block_sum[r][h] = exp_row<kTiles>(s[r], h, scale_log2, m);
                holds &= block_sum[r][h] <= exp2f(kMaxGrowth) &&
                         m != -__int_as_float(0x7f800000);
            }
        }
        return holds;
    }

    __device__ __forceinline__ void add_block_sums(const float (&block_sum)[kRowPairs][2]) {
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) row_sum[r][h] += block_sum[r][h];
        }
    }

    // Completes the row sums across the quad. Returns per owned row the factor that normalises
    // the output (0 for a row that saw no key, so it comes out as zeros) and the log-sum-exp of
    // the scaled scores in natural-log units (-inf for such a row).
    __device__ __forceinline__ void finalize(float (&inv_sum)[kRowPairs][2],
                                             float (&lse)[kRowPairs][2]) const {
        constexpr float kLn2 = 0.693147180559945309f;
#pragma unroll
        for (int r = 0; r < kRowPairs; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = quad_sum(row_sum[r][h]);
                const bool seen = sum > 0.0f;
                inv_sum[r][h] = seen ? reciprocal_approx(sum) : 0.0f;
                lse[r][h] = seen ? (row_max[r][h] + log2f(sum)) * kLn2
                                 : -__int_as_float(0x7f800000);
            }
        }
    }
};

// An attention sink: a per-head logit `sink` (natural log; -inf: none) that joins a finished
// row's softmax denominator. The row's log-sum-exp becomes log(e^lse + e^sink) and its output
// scales by e^(lse - lse'), which `factor` is multiplied by.
__device__ __forceinline__ void fold_sink(float& lse, float& factor, float sink) {
    if (sink > -__int_as_float(0x7f800000)) {
        const float top = fmaxf(lse, sink);
        const float with_sink = top + logf(expf(lse - top) + expf(sink - top));
        factor *= expf(lse - with_sink);
        lse = with_sink;
    }
}

// The backward's softmax, in two steps so that S and dP need not be live together:
//   recompute_probabilities: P = 2^(scale_log2 S - lse_log2) in place of S, from the forward's
//     log-sum-exp (lse_log2 = LSE log2(e); +inf for a row that sees no key or lies past
//     seqlen_q, so that its P is 0);
//   score_gradient: dS = P (dP - dpsum) in place of dP, dpsum being the row's sum(dO * O) and P
//     given as the 16-bit pairs it is stored in (pack_f32x2), the precision dS's GEMMs see it in;
//     times factor(m, h, P), which a softcap gives (SoftcapSlope below) and which is 1 otherwise
//     (NoFactor, folded away).
// Rows h = 0, 1 of each 16-row group m, in the accumulator layout.
struct NoFactor {
    __device__ __forceinline__ constexpr float operator()(int, int, float) const { return 1.0f; }
    // The transposed tiles' form: the factor of column tile i, called with (e, P).
    __device__ __forceinline__ constexpr NoFactor column_tile(int) const { return {}; }
    __device__ __forceinline__ constexpr float operator()(int, float) const { return 1.0f; }
};

template <int kRowGroups, int kTiles>
__device__ __forceinline__ void recompute_probabilities(float (&s)[kRowGroups][kTiles][4],
                                                        const float (&lse_log2)[kRowGroups][2],
                                                        float scale_log2) {
#pragma unroll
    for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[m][j][c] = exp2_approx(fmaf(s[m][j][c], scale_log2, -lse_log2[m][c / 2]));
            }
        }
    }
}

template <bool kBf16, int kRowGroups, int kTiles, class Factor = NoFactor>
__device__ __forceinline__ void score_gradient(float (&dp)[kRowGroups][kTiles][4],
                                               const uint32_t (&p)[kRowGroups][kTiles][2],
                                               const float (&dpsum)[kRowGroups][2],
                                               Factor factor = {}) {
#pragma unroll
    for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 pair = unpack_f32x2<kBf16>(p[m][j][h]);
                dp[m][j][2 * h] =
                    pair.x * (dp[m][j][2 * h] - dpsum[m][h]) * factor(m, h, pair.x);
                dp[m][j][2 * h + 1] =
                    pair.y * (dp[m][j][2 * h + 1] - dpsum[m][h]) * factor(m, h, pair.y);
            }
        }
    }
}

// The same two steps on the Hopper backward's transposed tiles (S^T = K Q^T: rows are keys,
// columns queries), one 16-row group in the wgmma accumulator layout, where LSE and D belong to
// the columns: column_values(i) gives the float2 of columns 8 i + 2 t and 8 i + 2 t + 1.
//   recompute_probabilities_transposed: P^T in place of S^T;
//   score_gradient_transposed: dS^T = P^T (dP^T - D), P^T given as the 16-bit pairs dV's GEMM
//     read it in (pack_f32x2; pair 2 i + h holds row h of column tile i), returned in the same
//     pairs, the A fragments of dK's GEMM; times factor.column_tile(i)(e, P) for column
//     8 i + 2 t + e.
template <int kTiles, class ColumnValues>
__device__ __forceinline__ void recompute_probabilities_transposed(float (&s)[kTiles][4],
                                                                   ColumnValues lse_log2,
                                                                   float scale_log2) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
        const float2 lse = lse_log2(i);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            s[i][c] = exp2_approx(fmaf(s[i][c], scale_log2, c % 2 ? -lse.y : -lse.x));
        }
    }
}

template <bool kBf16, int kTiles, class ColumnValues, class Factor = NoFactor>
__device__ __forceinline__ void score_gradient_transposed(uint32_t (&ds)[2 * kTiles],
                                                          const float (&dp)[kTiles][4],
                                                          const uint32_t (&p)[2 * kTiles],
                                                          ColumnValues dpsum_of,
                                                          Factor factor = {}) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
        const float2 dpsum = dpsum_of(i);
        const auto column_factor = factor.column_tile(i);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 pair = unpack_f32x2<kBf16>(p[2 * i + h]);
            ds[2 * i + h] = pack_f32x2<kBf16>(
                pair.x * (dp[i][2 * h] - dpsum.x) * column_factor(0, pair.x),
                pair.y * (dp[i][2 * h + 1] - dpsum.y) * column_factor(1, pair.y));
        }
    }
}

// The backward under a logit softcap. The forward's score is softcap tanh(softmax_scale s /
// softcap): the backward recomputes t = tanh(softcap_scale s) (apply_softcap, before the mask,
// so that masked scores stay -inf) and P from t with scale_log2 = softcap log2(e) (BwdParams),
// and dS takes the factor dt/d(softcap_scale s) = 1 - t^2 (softmax_scale is applied with dQ's
// and dK's). t is not kept through dV's GEMM (its registers spill there): it is recovered from P
// as dS's GEMMs see it, t = (log2 P + lse_log2) / (softcap log2(e)), off by at most 2^-8 /
// (softcap ln 2) from the 16-bit rounding of P. Clamped to [-1, 1], a P of 0 (masked or
// underflowed, log2 -inf) gives a factor of 0 rather than NaN.
struct SoftcapSlope {
    float inv_scale_log2;  // 1 / (softcap log2(e))

    __device__ __forceinline__ float operator()(float p, float lse_log2) const {
        float lg;
        asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg) : "f"(p));
        const float t = fminf(fmaxf((lg + lse_log2) * inv_scale_log2, -1.0f), 1.0f);
        return (1.0f - t) * (1.0f + t);
    }
};

// score_gradient's factor under a softcap, rows in the accumulator layout: the slope of each
// row's P, from the caller's lse_log2 of the rows (rows h = 0, 1 of each 16-row group).
template <int kRowGroups>
struct SoftcapRows {
    const float (&lse_log2)[kRowGroups][2];
    SoftcapSlope slope;

    __device__ __forceinline__ float operator()(int m, int h, float p) const {
        return slope(p, lse_log2[m][h]);
    }
};

// score_gradient_transposed's factor under a softcap: the LSE belongs to the columns, read a
// column tile at a time (ColumnValues, mainloops/bwd_sm90.cuh).
template <class ColumnValues>
struct SoftcapColumns {
    ColumnValues lse_log2;
    SoftcapSlope slope;

    struct Tile {
        float2 lse;
        SoftcapSlope slope;
        __device__ __forceinline__ float operator()(int e, float p) const {
            return slope(p, e ? lse.y : lse.x);
        }
    };
    __device__ __forceinline__ Tile column_tile(int i) const { return {lse_log2(i), slope}; }
};

// scores <- tanh(softcap_scale * scores): the logit softcap (params.cuh), tanh.approx.f32.
template <int kRowGroups, int kTiles>
__device__ __forceinline__ void apply_softcap(float (&s)[kRowGroups][kTiles][4], float scale) {
#pragma unroll
    for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float t;
                asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s[m][j][c] * scale));
                s[m][j][c] = t;
            }
        }
    }
}

}  // namespace ptxattn
