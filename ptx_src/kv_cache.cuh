// Serving layouts: where a KV cache keeps key j of a sequence, and which (token, head) a row of a
// GQA-packed query tile is.
//
// KvRows: the K and V caches are (slots, rows, heads_kv, head_dim) arrays. A contiguous cache has
// one slot per sequence (or, varlen, one slot holding every sequence back to back from
// cu_seqlens_k), so key j of sequence b is row first_row + j of slot b. A paged cache has pages
// of page_size rows as its slots: key j is row j % page_size of page block_table[b][j /
// page_size]. Page sizes need not divide the kernels' key blocks: every row is located on its
// own, which costs one cached int load and one division per row moved, hidden under the copy.
//
// PackedRows: the q heads that share a kv head run in one tile, so K and V are read once for all
// of them. Row r of the tile is token r / group of q head kv_head * group + r % group; the
// mask (mask.cuh) follows the token.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace ptxattn {

struct KvRows {
    const int* pages;  // this sequence's block_table row, or null: a contiguous cache
    int page_size;
    int slot;          // contiguous: the sequence's slot
    int first_row;     // contiguous: the row of its key 0 (varlen packing)

    __device__ __forceinline__ static KvRows of(const FwdParams& p, int batch, int offset_k) {
        if (p.block_table != nullptr) {
            return {p.block_table + batch * p.block_table_stride, p.page_size, 0, 0};
        }
        return {nullptr, 0, p.cu_seqlens_k != nullptr ? 0 : batch, offset_k};
    }

    // The (slot, row) of key `key`; only called for keys the sequence has.
    __device__ __forceinline__ int2 locate(int key) const {
        if (pages == nullptr) return make_int2(slot, first_row + key);
        return make_int2(pages[key / page_size], key % page_size);
    }
};

struct PackedRows {
    int group;       // q heads per kv head
    int first_head;  // the tile's kv head times group

    __device__ __forceinline__ int token(int row) const { return row / group; }
    __device__ __forceinline__ int head(int row) const { return first_head + row % group; }
};

}  // namespace ptxattn
