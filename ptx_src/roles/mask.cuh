// Mask application: which keys a query row may see, and -inf for the scores it may not.
//
// Bottom-right alignment (FlashAttention 2.1+): query row i sits at key position
// i + seqlen_k - seqlen_q. Row i sees key j iff j < seqlen_k and
//   j <= i + seqlen_k - seqlen_q + window_right   (causal: window_right = 0)
//   j >= i + seqlen_k - seqlen_q - window_left
// where a window size of -1 is unbounded. A row that sees no key gives output 0, LSE -inf.
//
// Scores arrive in the mma.sync / wgmma accumulator layout: a thread holds, per 16-row group m,
// rows r and r + 8 (h = 0, 1) and per 8-column tile j two columns (e = 0, 1) at [m][j][2h + e].
// Which key a column is differs between kernels (the block-scaled kernel permutes keys), so the
// caller passes it as a functor column(j, e), an offset from key0.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

struct SeqMask {
    int seqlen_k;
    int diag;  // seqlen_k - seqlen_q
    int window_left;   // -1: unbounded
    int window_right;  // -1: unbounded; 0 when causal

    __device__ __forceinline__ static SeqMask make(int seqlen_q, int seqlen_k, bool causal,
                                                   int window_left = -1,
                                                   int window_right = -1) {
        return {seqlen_k, seqlen_k - seqlen_q, window_left, causal ? 0 : window_right};
    }

    // One past the last key row `row` sees (may be <= 0).
    __device__ __forceinline__ int key_end(int row) const {
        return window_right < 0 ? seqlen_k : min(seqlen_k, row + diag + window_right + 1);
    }

    // The first key row `row` sees (may be past key_end: no key).
    __device__ __forceinline__ int key_begin(int row) const {
        return window_left < 0 ? 0 : max(0, row + diag - window_left);
    }
};

// Column j, e of an accumulator tile is key 8 j + e past the thread's first column (mma.sync and
// wgmma C fragments: the thread's first column is 2 * (lane % 4)).
struct AccumulatorColumns {
    __device__ __forceinline__ constexpr int operator()(int j, int e) const { return 8 * j + e; }
};

// Sets s[m][j][2h + e] to -inf where row first_row + kRowGroupStride * m + 8 h may not see key
// key0 + column(j, e). With GQA packing (kv_cache.cuh) a tile row is query token row /
// rows_per_token; the default 1 folds away.
template <int kRowGroupStride, int kRowGroups, int kTiles, class Columns>
__device__ __forceinline__ void apply_mask(float (&s)[kRowGroups][kTiles][4], const SeqMask& mask,
                                           int first_row, int key0, Columns column,
                                           int rows_per_token = 1) {
    const float neg_inf = -__int_as_float(0x7f800000);
#pragma unroll
    for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = (first_row + kRowGroupStride * m + 8 * h) / rows_per_token;
            const int end = mask.key_end(row) - key0;
            const int begin = mask.key_begin(row) - key0;
#pragma unroll
            for (int j = 0; j < kTiles; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = column(j, e);
                    if (key >= end || (mask.window_left >= 0 && key < begin)) {
                        s[m][j][2 * h + e] = neg_inf;
                    }
                }
            }
        }
    }
}

// The transposed tile of the Hopper backward, S^T = K Q^T: rows are keys, columns queries. Sets
// s[j][2h + e] to -inf where query query0 + 8 j + e may not see key first_key + 8 h (the thread's
// two key rows), in the accumulator layout of one 16-row group.
template <int kTiles>
__device__ __forceinline__ void apply_mask_transposed(float (&s)[kTiles][4], const SeqMask& mask,
                                                      int first_key, int query0) {
    const float neg_inf = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int query = query0 + 8 * j + e;
            const int end = mask.key_end(query);
            const int begin = mask.key_begin(query);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = first_key + 8 * h;
                if (key >= end || (mask.window_left >= 0 && key < begin)) {
                    s[j][2 * h + e] = neg_inf;
                }
            }
        }
    }
}

}  // namespace ptxattn
