// Tile schedulers: which (query block, head, batch) tiles a thread block computes, and in which
// order.
//
// TileOrder numbers the tiles: (batch, head) pairs are taken in sections of `section_heads`
// whose K/V fit in L2 together; within a section the query blocks go from the last (the longest
// when causal) to the first, all pairs of the section at each step. Handing tiles out in index
// order therefore starts long causal tiles first and lets short ones fill the tail
// (longest-processing-time first). section_heads = 1 is plain pair-by-pair order.
// With alternate_sections (the causal Hopper forward on long sequences) only the last section
// goes longest-first, for the tail; the ones before it alternate, shortest-first just before
// it. Each section then starts with tiles as long as those that end the section before: blocks
// move to the new section's K and V one at a time as their long tiles end, or from short tiles
// to short ones that read few key blocks. Longest-first throughout, every block leaves the
// short end of one section for the long end of the next within a few microseconds, and all of
// them wait on DRAM for the same new K and V (GQA causal 4 x 4096 x 32/8: +2.4%;
// H100 SXM, 2026-11-27; docs/design/scheduling.md#alternating-section-order).
//
// A scheduler gives each thread block a sequence of tiles, ending with one at or past
// num_tiles(). GridTiles: one block per tile (tile = blockIdx.x), its indices through next(n)
// and receive(n). PersistentTiles: fewer blocks than tiles, each going through them in a static
// stride or, given a counter, dynamically: each next tile is the next unclaimed index, so blocks
// that drew short (causal) tiles take more of them. Its producer thread claims a tile and
// resolves it into the kernel's Work (next(n, resolve)); the other warps get that Work through a
// two-slot mailbox in shared memory (receive()) and free the slot when done (release()).
#pragma once
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"

namespace ptxattn {

struct TileCoord {
    int m_block;
    int head;
    int batch;
    int split = 0;  // split-KV: which share of the keys (Sm90Mainloop::tile_coord)
};

struct TileOrder {
    int num_m_blocks;
    int num_pairs;  // batch * heads_q
    int section_heads;
    int heads_q;
    bool alternate_sections = false;

    __device__ __forceinline__ int num_tiles() const { return num_pairs * num_m_blocks; }

    __device__ __forceinline__ TileCoord decode(int tile) const {
        const int tiles_per_section = section_heads * num_m_blocks;
        const int section = tile / tiles_per_section;
        const int first_pair = section * section_heads;
        const int in_section = tile % tiles_per_section;
        const int pairs_here = min(section_heads, num_pairs - first_pair);
        const int pair = first_pair + in_section % pairs_here;
        const int step = in_section / pairs_here;
        const int sections_after = (num_pairs - 1) / section_heads - section;
        const bool shortest_first = alternate_sections && sections_after % 2 == 1;
        return {shortest_first ? step : num_m_blocks - 1 - step, pair % heads_q, pair / heads_q};
    }
};

// One thread block per tile.
struct GridTiles {
    int taken = 0;

    __device__ __forceinline__ int next(int num_tiles) {
        return taken++ == 0 ? static_cast<int>(blockIdx.x) : num_tiles;
    }
    __device__ __forceinline__ int receive(int num_tiles) { return next(num_tiles); }
};

// The producer's tiles, handed to the other warps with what it resolved about each: a Work
// holds the tile index (`tile`, at or past num_tiles to close) and whatever the kernel computes
// once per tile (Sm90Mainloop's TileWork: coordinates, the sequence's lengths, the key blocks).
// The producer resolves a tile ahead of the consumers, while they still compute the one before,
// so they start each tile with a few shared-memory loads instead of divisions and global loads.
template <class Work>
struct TileMailbox {
    MBarrier full[2];
    MBarrier empty[2];
    Work work[2];

    // One thread, before the block's __syncthreads.
    __device__ __forceinline__ void init(uint32_t receiving_warps) {
        for (int s = 0; s < 2; ++s) {
            full[s].init(1);
            empty[s].init(receiving_warps);
        }
    }
};

// The work of a scheduler that resolves nothing beyond the index (the probe's).
struct TileIndex {
    int tile;
};

template <class Work>
struct PersistentTiles {
    int* counter;  // dynamic order: two zeroed ints in global memory; static order: null
    TileMailbox<Work>& mailbox;
    int taken = 0;

    // The producer thread: claims the block's next tile and posts resolve(tile) (called only for
    // tiles before num_tiles) to the mailbox. The last block to run out resets the counters for
    // the next launch on the stream (launches on one stream never overlap).
    template <class Resolve>
    __device__ __forceinline__ Work next(int num_tiles, Resolve resolve) {
        int tile;
        if (counter == nullptr) {
            tile = blockIdx.x + gridDim.x * taken;
        } else {
            tile = taken == 0 ? blockIdx.x : gridDim.x + atomicAdd(counter, 1);
        }
        Work work{};
        if (tile < num_tiles) work = resolve(tile);
        work.tile = tile;
        const int slot = taken % 2;
        mailbox.empty[slot].wait(((taken / 2) & 1) ^ 1);
        mailbox.work[slot] = work;
        mailbox.full[slot].arrive();
        ++taken;
        if (counter != nullptr && tile >= num_tiles) {
            __threadfence();
            if (atomicAdd(counter + 1, 1) == gridDim.x - 1) {
                counter[0] = 0;
                counter[1] = 0;
            }
        }
        return work;
    }

    // Every other warp taking part (all of its lanes call both): the producer's next work, which
    // stays in the mailbox until the warp releases it (lane 0 frees the slot).
    __device__ __forceinline__ const Work& receive() {
        const int slot = taken % 2;
        mailbox.full[slot].wait((taken / 2) & 1);
        return mailbox.work[slot];
    }
    __device__ __forceinline__ void release() {
        __syncwarp();
        if (threadIdx.x % 32 == 0) mailbox.empty[taken % 2].arrive();
        ++taken;
    }
};

// The backward's walk: which key block a thread block owns, the order in which it visits its
// query tiles, and, when dQ is summed deterministically, its turn at each tile's accumulator.
//
// Every key block adds into the dQ of each query tile it visits; deterministic mode fixes the
// order of those adds (atomics.cuh) to the order in which the blocks, advancing in lockstep,
// reach the tile, so that a block seldom waits:
//   causal:     key blocks in reverse (block n = num_n_blocks - 1 - blockIdx.x). Tile m is
//               visited by blocks [0, n_max(m)); block n starts at its diagonal tile, one or two
//               tiles past block n + 1's first, and takes turn n_max(m) - 1 - n, so each block
//               waits only for blocks of lower blockIdx.x, which the hardware launched earlier.
//   non-causal: every block visits every tile of its sequence (num_m_blocks: the sequence's
//               tiles, num_n_blocks its key blocks). Key blocks form groups of `group` consecutive
//               blocks (at most one per SM: a group is resident together); block l of a group
//               of G starts at tile l r, r = num_m_blocks / G, and walks the tiles round from
//               there, so at any step the group's blocks are at distinct tiles, and tile m's adds
//               come in the order the blocks reach it: block l at step (m - l r) mod
//               num_m_blocks, after every block of the groups before. A block may wait for a
//               later block of its own group, which can be resident beside it, so the wait ends.
//               (In index order block n would wait n steps at its first tile, and every block
//               after it as long: a quarter to a half of a head's time.) With fewer tiles than
//               the group's blocks, the tiles are walked from 0 in index order.
//   banded:     a non-causal window (left, right or both): block n visits tiles [m_min(n),
//               m_max(n)), key blocks [n_min(m), n_max(m)) visit tile m, and block n takes turn
//               n - n_min(m) in index order; with a right window its first tile moves down with
//               n, so it waits about as long as the band's tiles shift from one block to the next.
//               (Causal windows walk as causal: turn n_max(m) - 1 - n still counts the blocks
//               after n that visit m.)
// Without deterministic sums, blocks walk from their first tile in index order, or, non-causal,
// unbanded and asked to (`staggered`), round from the same staggered starts as above, so that at any
// step the blocks of a head add into different tiles' dQ rather than all into tile 0, then all
// into tile 1, ... (the Hopper kernel at head_dim 64: +5-7% at seqlen 16384; at 128 it cost 2%).
struct BwdWalk {
    int n_block;
    bool reversed;
    int rotation;    // tiles walked round from m_first + rotation (non-causal, staggered)
    int spacing;     // r: tiles between the starts of consecutive blocks of a group; 0: none
    int group_rank;  // l: the block's place in its group
    int group_size;  // G
    int group_base;  // blocks of the groups before

    __device__ __forceinline__ static BwdWalk make(int block, int num_n_blocks, int num_m_blocks,
                                                   bool causal, bool deterministic, int group,
                                                   bool staggered = false, bool banded = false) {
        BwdWalk w{block, false, 0, 0, 0, 0, 0};
        if (causal) {
            if (deterministic) {
                w.n_block = num_n_blocks - 1 - block;
                w.reversed = true;
            }
            return w;
        }
        if (banded || (!deterministic && !staggered)) return w;
        w.group_base = block / group * group;
        w.group_rank = block - w.group_base;
        w.group_size = min(group, num_n_blocks - w.group_base);
        if (num_m_blocks >= w.group_size) {
            w.spacing = num_m_blocks / w.group_size;
            w.rotation = w.group_rank * w.spacing;
        }
        return w;
    }

    // How many key blocks add into query tile m's dQ before this one; [n_min, n_max): the key
    // blocks tile m visits.
    __device__ __forceinline__ int turn(int m_block, int n_min, int n_max) const {
        if (reversed) return n_max - 1 - n_block;
        if (spacing == 0) return n_block - n_min;
        // Blocks 0..a of the group reach tile m at steps m - l r (later blocks first); the rest
        // after wrapping round, at m - l r + num_m_blocks, again later blocks first.
        const int a = min(m_block / spacing, group_size - 1);
        const int l = group_rank;
        return group_base + (l <= a ? a - l : a + group_size - l);
    }
};

// The (q head, query tile) steps of a backward key block, head-major: every q head that shares
// its kv head, each over the query tiles [m_first, m_first + m_count) holding a row that sees one
// of its keys (BlockInfo::m_min, m_max), from m_first + the walk's rotation round. Both backward
// kernels walk them in this order.
struct BwdSteps {
    int m_first;
    int m_count;
    int count;
    int rotation;

    template <class Info>
    __device__ __forceinline__ static BwdSteps make(const Info& info, const BwdWalk& walk,
                                                    int q_per_kv) {
        const int m_first = info.m_min(walk.n_block);
        const int m_count = max(0, info.m_max(walk.n_block) - m_first);
        return {m_first, m_count, m_count * q_per_kv, walk.rotation};
    }
    __device__ __forceinline__ int head(int step, int kv_head, int q_per_kv) const {
        return kv_head * q_per_kv + step / m_count;
    }
    __device__ __forceinline__ int m_block(int step) const {
        return m_first + (step + rotation) % m_count;
    }
    // The same walk a step at a time, without head()'s and m_block()'s divisions: start() is
    // step 0's (head, tile), next() moves to the following step's.
    struct Cursor {
        int head;
        int m_block;
        int head_steps_left;  // steps of this head from this one on
    };
    __device__ __forceinline__ Cursor start(int kv_head, int q_per_kv) const {
        return {kv_head * q_per_kv, m_first + rotation, m_count};
    }
    __device__ __forceinline__ void next(Cursor& c) const {
        c.m_block = c.m_block + 1 == m_first + m_count ? m_first : c.m_block + 1;
        if (--c.head_steps_left == 0) {
            c.head_steps_left = m_count;
            ++c.head;
        }
    }
};

}  // namespace ptxattn

