// Block info: which key blocks a tile of query rows visits, and which of them need a mask.
//
// A tile holds query rows [m0, m0 + kBlockM) of one sequence; key blocks hold kBlockN keys.
// The tile visits key blocks [n_min, n_max): the blocks outside hold no key any of its rows
// sees (mask.cuh), so they are skipped, never loaded. Inside, a block needs the mask when some
// row of the tile may not see some key of it:
//   right side: blocks from n_right_masked up (the seqlen_k tail, the causal diagonal or the
//               window's right edge; the block's last key past the first row's last);
//   left side:  blocks below n_left_unmasked (the window's left edge).
// Kernels visit key blocks from the last to the first, so the right-masked blocks come first,
// then the unmasked ones, then (only with a left window) the left-masked ones.
//
// The backward walks the other way: a block of kBlockN keys visits the query tiles
// [m_min(n_block), m_max(n_block)) that hold a row seeing one of its keys, and the same
// n_right_masked and n_left_unmasked tests say which (tile, block) pairs need the mask
// (needs_mask), so both directions skip and mask exactly the same pairs.
//
// Per-sequence lengths: a BlockInfo holds one sequence's lengths (fixed-length kernels make one
// per block), so a varlen or KV-cache kernel makes one per tile from that sequence's (seqlen_q,
// seqlen_k), which SeqLens::of reads from cumulative offsets and filled lengths when the call has
// them.
#pragma once
#include "ptx/common.cuh"
#include "roles/mask.cuh"
#include "roles/params.cuh"

namespace ptxattn {

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The lengths of sequence `batch` and where its rows start: fixed for every sequence, or from
// cumulative offsets (int32, batch + 1 entries) when given.
struct SeqLens {
    int seqlen_q;
    int seqlen_k;
    int offset_q;  // first row of the sequence in the packed q / out (0 without offsets)
    int offset_k;

    __device__ __forceinline__ static SeqLens of(int batch, int seqlen_q, int seqlen_k,
                                                 const int* cu_seqlens_q,
                                                 const int* cu_seqlens_k) {
        SeqLens lens{seqlen_q, seqlen_k, 0, 0};
        if (cu_seqlens_q != nullptr) {
            lens.offset_q = cu_seqlens_q[batch];
            lens.seqlen_q = cu_seqlens_q[batch + 1] - lens.offset_q;
        }
        if (cu_seqlens_k != nullptr) {
            lens.offset_k = cu_seqlens_k[batch];
            lens.seqlen_k = cu_seqlens_k[batch + 1] - lens.offset_k;
        }
        return lens;
    }

    // Sequence `batch` of a serving call: its keys end at seqused_k[batch] (a KV cache's filled
    // length) when that is given.
    __device__ __forceinline__ static SeqLens of(const FwdParams& p, int batch) {
        SeqLens lens = of(batch, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k);
        if (p.seqused_k != nullptr) lens.seqlen_k = p.seqused_k[batch];
        return lens;
    }
};

// The key blocks of kBlockN keys that a serving kernel's tile of GQA-packed query rows sees
// (its tokens first_token .. last_token, under `mask`), the share of them that split `split` of
// `num_splits` visits (equal shares of whole blocks, the last ones possibly empty), and which of
// them need a mask.
template <int kBlockN>
struct SplitKeyBlocks {
    int begin;          // this split's first key block
    int count;          // how many it visits (0: none)
    int right_masked;   // blocks from this one up need the right-side (causal) mask
    int left_unmasked;  // blocks below this one need the window's left mask

    __device__ __forceinline__ static SplitKeyBlocks make(const SeqMask& mask, int first_token,
                                                          int last_token, int split,
                                                          int num_splits) {
        const int key_end = mask.key_end(last_token);
        const int lo = mask.key_begin(first_token) / kBlockN;
        const int hi = key_end <= 0 ? 0 : ceil_div(key_end, kBlockN);
        const int per_split = ceil_div(max(hi - lo, 0), num_splits);
        const int begin = lo + split * per_split;
        return {begin, max(min(hi, begin + per_split) - begin, 0),
                max(mask.key_end(first_token), 0) / kBlockN,
                mask.window_left < 0 ? 0 : ceil_div(mask.key_begin(last_token), kBlockN)};
    }
};

template <int kBlockM, int kBlockN>
struct BlockInfo {
    SeqMask mask;
    int seqlen_q;

    __device__ __forceinline__ BlockInfo(int seqlen_q_, int seqlen_k, bool causal,
                                         int window_left = -1, int window_right = -1)
        : mask(SeqMask::make(seqlen_q_, seqlen_k, causal, window_left, window_right)),
          seqlen_q(seqlen_q_) {}

    // The tile's last real row (rows past seqlen_q are padding whose results are dropped).
    __device__ __forceinline__ int last_row(int m_block) const {
        return min((m_block + 1) * kBlockM, seqlen_q) - 1;
    }

    // One past the last key block the tile visits (0: it visits none).
    __device__ __forceinline__ int n_max(int m_block) const {
        const int keys = mask.key_end(last_row(m_block));
        return keys <= 0 ? 0 : ceil_div(keys, kBlockN);
    }

    // The first key block the tile visits.
    __device__ __forceinline__ int n_min(int m_block) const {
        return mask.window_left < 0 ? 0 : mask.key_begin(m_block * kBlockM) / kBlockN;
    }

    // Blocks from this one up need the right-side mask.
    __device__ __forceinline__ int n_right_masked(int m_block) const {
        const int keys = mask.key_end(m_block * kBlockM);
        return keys <= 0 ? 0 : min(mask.seqlen_k / kBlockN, keys / kBlockN);
    }

    // The first query tile with a row that sees a key of block n_block (backward): the row
    // key - diag - window_right sees key `key` first.
    __device__ __forceinline__ int m_min(int n_block) const {
        return mask.window_right < 0
                   ? 0
                   : max(0, n_block * kBlockN - mask.diag - mask.window_right) / kBlockM;
    }

    // One past the last query tile with a row that sees a key of block n_block (backward): the
    // row last_key - diag + window_left sees key last_key last.
    __device__ __forceinline__ int m_max(int n_block) const {
        const int tiles = ceil_div(seqlen_q, kBlockM);
        if (mask.window_left < 0) return tiles;
        const int last_key = min((n_block + 1) * kBlockN, mask.seqlen_k) - 1;
        const int last_row = last_key - mask.diag + mask.window_left;
        return last_row < 0 ? 0 : min(tiles, last_row / kBlockM + 1);
    }

    // Blocks below this one need the left-side mask (none without a left window).
    __device__ __forceinline__ int n_left_unmasked(int m_block) const {
        return mask.window_left < 0 ? 0 : ceil_div(mask.key_begin(last_row(m_block)), kBlockN);
    }

    // Whether some row of tile m_block may not see some key of block n_block.
    __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
        return n_block >= n_right_masked(m_block) ||
               (mask.window_left >= 0 && n_block < n_left_unmasked(m_block));
    }
};

// Where sequence `batch` of a backward call lives. In a fixed-length batch every sequence has the
// call's lengths and its own batch index. Packed (BwdParams::cu_seqlens_q/k given), its rows start
// at lens.offset_q / offset_k of arrays whose batch extent is 1, and its workspace rows (dpsum,
// lse_log2, dsink_rows, dq_accum) at its padded offset, (cu_seqlens_q[b] + b row_padding) rounded
// down to row_padding: from one sequence's offset to the next there are more than its rows, a
// whole number of row_padding (the main kernel's query tile), so a tile read or added past the
// sequence's end stays in its own padding.
struct BwdSeq {
    SeqLens lens;
    int batch_coord;     // the batch index into the arrays and TMA maps: batch, or 0 when packed
    int workspace_row0;  // the sequence's first workspace row of a head: 0, or its padded offset

    // kPacked: the call may be packed (the backward's options build); otherwise it is not,
    // and the sequence's lengths and places are the call's, known without reading memory.
    template <bool kPacked = true>
    __device__ __forceinline__ static BwdSeq of(const BwdParams& p, int batch) {
        BwdSeq seq;
        if constexpr (!kPacked) {
            seq.lens = SeqLens{p.seqlen_q, p.seqlen_k, 0, 0};
            seq.batch_coord = batch;
            seq.workspace_row0 = 0;
            return seq;
        }
        seq.lens = SeqLens::of(batch, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k);
        const bool packed = p.cu_seqlens_q != nullptr;
        seq.batch_coord = packed ? 0 : batch;
        seq.workspace_row0 =
            packed ? (seq.lens.offset_q + batch * p.row_padding) / p.row_padding * p.row_padding
                   : 0;
        return seq;
    }

    // The workspace row of query row `row` of head `head` (times head_dim in dq_accum).
    __device__ __forceinline__ int64_t workspace_row(const BwdParams& p, int head, int row) const {
        return (static_cast<int64_t>(batch_coord) * p.heads_q + head) * p.seqlen_q_rounded +
               workspace_row0 + row;
    }
};

}  // namespace ptxattn
