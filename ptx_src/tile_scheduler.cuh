// Tile schedulers: which (query block, head, batch) tiles a thread block computes, and in which
// order.
//
// TileOrder numbers the tiles: (batch, head) pairs are taken in sections of `section_heads`
// whose K/V fit in L2 together; within a section the query blocks go from the last (the longest
// when causal) to the first, all pairs of the section at each step. Handing tiles out in index
// order therefore starts long causal tiles first and lets short ones fill the tail
// (longest-processing-time first). section_heads = 1 is plain pair-by-pair order.
//
// A scheduler gives each thread block a sequence of tile indices, ending with one at or past
// num_tiles(). Its interface is what a kernel's warps call:
//   next()            the producer (or, with no producer, every thread): the block's next tile,
//                     its first on the first call;
//   receive()         every other warp: the same sequence, as the producer took it.
// GridTiles: one block per tile (tile = blockIdx.x). PersistentTiles: fewer blocks than tiles,
// each going through them in a static stride or, given a counter, dynamically: each next tile
// is the next unclaimed index, so blocks that drew short (causal) tiles take more of them; the
// producer thread passes the index to the other warps through a two-slot mailbox in shared
// memory. A varlen or split-KV scheduler implements the same calls over its own numbering.
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"

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

    __device__ __forceinline__ int num_tiles() const { return num_pairs * num_m_blocks; }

    __device__ __forceinline__ TileCoord decode(int tile) const {
        const int tiles_per_section = section_heads * num_m_blocks;
        const int first_pair = (tile / tiles_per_section) * section_heads;
        const int in_section = tile % tiles_per_section;
        const int pairs_here = min(section_heads, num_pairs - first_pair);
        const int pair = first_pair + in_section % pairs_here;
        return {num_m_blocks - 1 - in_section / pairs_here, pair % heads_q, pair / heads_q};
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

// The producer's tile indices, handed to the other warps.
struct TileMailbox {
    MBarrier full[2];
    MBarrier empty[2];
    int tile[2];

    // One thread, before the block's __syncthreads.
    __device__ __forceinline__ void init(uint32_t receiving_warps) {
        for (int s = 0; s < 2; ++s) {
            full[s].init(1);
            empty[s].init(receiving_warps);
        }
    }
};

struct PersistentTiles {
    int* counter;  // dynamic order: two zeroed ints in global memory; static order: null
    TileMailbox& mailbox;
    int taken = 0;

    // The producer thread. The last block to run out resets the counters for the next launch
    // on the stream (launches on one stream never overlap).
    __device__ __forceinline__ int next(int num_tiles) {
        if (counter == nullptr) return blockIdx.x + gridDim.x * taken++;
        const int tile = taken == 0 ? blockIdx.x : gridDim.x + atomicAdd(counter, 1);
        const int slot = taken % 2;
        mailbox.empty[slot].wait(((taken / 2) & 1) ^ 1);
        mailbox.tile[slot] = tile;
        mailbox.full[slot].arrive();
        ++taken;
        if (tile >= num_tiles) {
            __threadfence();
            if (atomicAdd(counter + 1, 1) == gridDim.x - 1) {
                counter[0] = 0;
                counter[1] = 0;
            }
        }
        return tile;
    }

    // Every other warp taking part (all of its lanes call this; lane 0 frees the slot).
    __device__ __forceinline__ int receive(int /*num_tiles*/) {
        if (counter == nullptr) return blockIdx.x + gridDim.x * taken++;
        const int slot = taken % 2;
        mailbox.full[slot].wait((taken / 2) & 1);
        const int tile = mailbox.tile[slot];
        __syncwarp();
        if (threadIdx.x % 32 == 0) mailbox.empty[slot].arrive();
        ++taken;
        return tile;
    }
};

// The backward's walk: which key block a thread block owns, the order in which it visits its
// query tiles (ascending), and, when dQ is summed deterministically, its turn at each tile's
// accumulator.
//
// Every key block adds into the dQ of each query tile it visits; deterministic mode fixes the
// order of those adds (atomics.cuh). A block may only wait for blocks of lower blockIdx.x: the
// hardware launched those earlier, so they are running or done, and the wait ends whatever the
// occupancy. Within that rule the order follows the blocks' natural progress:
//   causal:     key blocks in reverse (block n = num_n_blocks - 1 - blockIdx.x). Tile m is
//               visited by blocks [0, n_max(m)); block n starts at its diagonal tile, one or two
//               tiles past block n + 1's first, and takes turn n_max(m) - 1 - n, so the blocks
//               advance in lockstep, each a step behind the one above.
//   non-causal: blocks in index order, turn n: block n waits for n blocks ahead of it.
// Without deterministic sums, blocks go in index order (the longest causal walk first).
struct BwdWalk {
    int n_block;
    bool reversed;

    __device__ __forceinline__ static BwdWalk make(int block, int num_n_blocks, bool causal,
                                                   bool deterministic) {
        const bool reversed = deterministic && causal;
        return {reversed ? num_n_blocks - 1 - block : block, reversed};
    }

    // How many key blocks add into query tile m's dQ before this one; n_max: one past the last
    // key block tile m visits.
    __device__ __forceinline__ int turn(int n_max) const {
        return reversed ? n_max - 1 - n_block : n_block;
    }
};

// The (q head, query tile) steps of a backward key block, head-major: every q head that shares
// its kv head, each over the query tiles [m_first, m_first + m_count) holding a row that sees one
// of its keys (BlockInfo::m_min, m_max). Both backward kernels walk them in this order.
struct BwdSteps {
    int m_first;
    int m_count;
    int count;

    template <class Info>
    __device__ __forceinline__ static BwdSteps make(const Info& info, int n_block, int q_per_kv) {
        const int m_first = info.m_min(n_block);
        const int m_count = max(0, info.m_max() - m_first);
        return {m_first, m_count, m_count * q_per_kv};
    }
    __device__ __forceinline__ int head(int step, int kv_head, int q_per_kv) const {
        return kv_head * q_per_kv + step / m_count;
    }
    __device__ __forceinline__ int m_block(int step) const { return m_first + step % m_count; }
};

}  // namespace ptxattn

