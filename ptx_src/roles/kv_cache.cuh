// Serving layouts: where a KV cache keeps key j of a sequence, and which (token, head) a row of a
// GQA-packed query tile is.
//
// KvRows: the K and V caches are (slots, rows, heads_kv, head_dim) arrays. A contiguous cache has
// one slot per sequence (or, varlen, one slot holding every sequence back to back from
// cu_seqlens_k), so key j of sequence b is row first_row + j of slot b. A paged cache has pages
// of page_size rows as its slots: key j is row j % page_size of page block_table[b][j /
// page_size]. Page sizes need not divide the kernels' key blocks: a thread steps through its
// rows of a stage from the stage's pages that StagedPages brought to shared memory, with one
// division a stage (a division and a table load per row kept four warps an SM 30% below a
// contiguous cache's copy rate).
//
// StagedPages: the table entries of a ring stage arrive by cp.async in the ring's commit groups,
// kStages - 1 groups ahead of the stage's own K/V copies, so no copy waits on a global load of
// the table. Loaded just before the copies, those loads queued behind the stream of copies
// already in flight: at one block an SM a paged cache read 35% below a contiguous one
// (H100 SXM, 2026-11-25; docs/design/serving.md#block-table-loads).
//
// PackedRows: the q heads that share a kv head run in one tile, so K and V are read once for all
// of them. Row r of the tile is token r / group of q head kv_head * group + r % group; the
// mask (mask.cuh) follows the token.
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"
#include "roles/params.cuh"

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

    // Where one thread's rows of a ring stage are: keys key0 + first, then every `step` keys
    // (step <= 16 <= page_size, so a step crosses at most one page boundary).
    struct StageRows {
        const int* page;  // the row's entry among the stage's staged pages; null: contiguous
        int slot;         // contiguous: the sequence's slot
        int row;          // the row in the page (contiguous: in the slot)
        int page_size;    // contiguous: never reached

        __device__ __forceinline__ int2 at() const {
            return make_int2(page != nullptr ? *page : slot, row);
        }
        __device__ __forceinline__ void advance(int step) {
            row += step;
            if (row >= page_size) {
                row -= page_size;
                ++page;
            }
        }
    };

    // The rows from key key0 + first (first < 16) of the stage whose keys start at key0, its
    // pages staged at `staged` (StagedPages::slot; not read for a contiguous cache): one
    // division a stage instead of one a row.
    __device__ __forceinline__ StageRows stage_rows(int key0, int first,
                                                    const int* staged) const {
        if (pages == nullptr) return {nullptr, slot, first_row + key0 + first, 0x7fffffff};
        StageRows rows{staged, 0, key0 % page_size + first, page_size};
        rows.advance(0);
        return rows;
    }
};

// The table entries of a paged cache's ring stages in shared memory: kSlots slots of kPerStage
// words, a stage of kBlockN keys touching at most kBlockN / 16 + 1 pages (page_size >= 16).
// Slot reuse: a stage's entries are written kStages - 1 groups before its copies read them, and
// the prologue writes 2 kStages - 2 slots before the first read, so kSlots = 2 kStages keeps
// every slot written only after all threads have read it (the ring's __syncthreads between).
template <int kBlockN, int kStages>
struct StagedPages {
    static constexpr int kPerStage = kBlockN / 16 + 1;
    static constexpr int kSlots = 2 * kStages;
    static constexpr int kBytes = kSlots * kPerStage * 4;

    int* slots;  // shared memory, kBytes

    __device__ __forceinline__ const int* slot(int stage) const {
        return slots + (stage % kSlots) * kPerStage;
    }

    // The pages of the ring's first kStages - 1 stages (the split's key blocks from n_begin, of
    // kBlockN keys), landed and visible to the block before the prologue issues their copies;
    // nothing for a contiguous cache.
    __device__ __forceinline__ void prefetch_prologue(const KvRows& kv, int n_begin, int n_blocks,
                                                      int keys, int tid) const {
        if (kv.pages == nullptr) return;
#pragma unroll
        for (int iter = 0; iter < kStages - 1 && iter < n_blocks; ++iter) {
            prefetch(kv, iter, (n_begin + iter) * kBlockN, keys, tid);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }

    // cp.async (not committed) the pages of ring stage `stage`, whose keys start at key0, of a
    // sequence of `keys` keys: threads 0 .. kPerStage - 1 one word each, pages past the
    // sequence's last zero-filled. Nothing for a contiguous cache.
    __device__ __forceinline__ void prefetch(const KvRows& kv, int stage, int key0, int keys,
                                             int tid) const {
        if (kv.pages == nullptr || tid >= kPerStage) return;
        const int page = key0 / kv.page_size + tid;
        const bool valid = page * kv.page_size < keys;
        cp_async_4(smem_addr(slots + (stage % kSlots) * kPerStage + tid),
                   kv.pages + (valid ? page : 0), valid);
    }
};

struct PackedRows {
    int group;       // q heads per kv head
    int first_head;  // the tile's kv head times group

    __device__ __forceinline__ int token(int row) const { return row / group; }
    __device__ __forceinline__ int head(int row) const { return first_head + row % group; }
};

}  // namespace ptxattn
