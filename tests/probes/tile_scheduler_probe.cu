// Probe of tile_scheduler.cuh, run by tests/test_primitives.py.
//
// tile_order_probe: thread i < num_tiles stores TileOrder::decode(i) as (m_block, head, batch)
// at coords[3 i ..].
//
// grid_tiles_probe, persistent_tiles_probe: the calls a kernel's warps make. Warp 0 is the
// producer, of which thread 0 alone takes the block's tiles with next(); warps 1 ..
// blockDim.x / 32 - 1 receive them, every lane calling receive(). Each warp's lane 0 logs the
// sequence it got, the closing index (>= num_tiles) included, at
// log[(blockIdx.x * warps + warp) * cap ..] (the first `cap` entries) and its length at
// taken[blockIdx.x * warps + warp]. persistent_tiles_probe sets its TileMailbox up as the Hopper
// kernel does; counter is null (static order) or two zeroed ints (dynamic order).
//
// bwd_walk_probe<kBlockM, kBlockN>: thread i < ceil(seqlen_k / kBlockN) plays the backward's
// block i: it stores its BwdWalk key block at n_block[i], its step count at counts[i], and per
// step s (the first `cap`) the q head offset from the kv head's first, the query tile, its turn
// at that tile's dQ, and the q head offset and query tile of BwdSteps::Cursor at that step at
// steps[(i * cap + s) * 5 ..].
#include "roles/block_info.cuh"
#include "ptx/mbarrier.cuh"
#include "roles/tile_scheduler.cuh"

namespace ptxattn {
namespace probe {

// take(producer): the warp's next tile index.
template <class Take>
__device__ __forceinline__ void log_tiles(Take take, int num_tiles, int cap, int* log,
                                          int* taken) {
    const bool producer = threadIdx.x < 32;
    const int entry = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const bool logs = threadIdx.x % 32 == 0;
    int count = 0;
    for (;;) {
        const int tile = take(producer);
        if (logs && count < cap) log[entry * cap + count] = tile;
        ++count;
        if (tile >= num_tiles) break;
    }
    if (logs) taken[entry] = count;
}

template <int kBlockM, int kBlockN>
__global__ void bwd_walk_probe(int seqlen_q, int seqlen_k, int causal, int deterministic,
                               int group, int q_per_kv, int cap, int window_left,
                               int window_right, int* __restrict__ n_block,
                               int* __restrict__ counts, int* __restrict__ steps) {
    const BlockInfo<kBlockM, kBlockN> info(seqlen_q, seqlen_k, causal != 0, window_left,
                                           window_right);
    const int num_n_blocks = ceil_div(seqlen_k, kBlockN);
    const int block = blockIdx.x * blockDim.x + threadIdx.x;
    if (block >= num_n_blocks) return;
    // As the backward kernels make it (bwd_sm90.cu, bwd_mma_sync.cuh).
    const bool banded = causal == 0 && (window_left >= 0 || window_right >= 0);
    const BwdWalk walk = BwdWalk::make(block, num_n_blocks, ceil_div(seqlen_q, kBlockM),
                                       causal != 0, deterministic != 0, group, false, banded);
    const BwdSteps walk_steps = BwdSteps::make(info, walk, q_per_kv);
    n_block[block] = walk.n_block;
    counts[block] = walk_steps.count;
    BwdSteps::Cursor cursor = walk_steps.start(0, q_per_kv);
    for (int s = 0; s < min(cap, walk_steps.count); ++s) {
        const int m_block = walk_steps.m_block(s);
        int* out = steps + (static_cast<int64_t>(block) * cap + s) * 5;
        out[0] = walk_steps.head(s, 0, q_per_kv);
        out[1] = m_block;
        out[2] = walk.turn(m_block, info.n_min(m_block), info.n_max(m_block));
        out[3] = cursor.head;
        out[4] = cursor.m_block;
        walk_steps.next(cursor);
    }
}

}  // namespace probe
}  // namespace ptxattn

using namespace ptxattn;

extern "C" __global__ void tile_order_probe(int num_m_blocks, int num_pairs, int section_heads,
                                            int heads_q, int alternate_sections,
                                            int* __restrict__ coords) {
    const TileOrder order{num_m_blocks, num_pairs, section_heads, heads_q,
                          alternate_sections != 0};
    const int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= order.num_tiles()) return;
    const TileCoord c = order.decode(tile);
    coords[3 * tile + 0] = c.m_block;
    coords[3 * tile + 1] = c.head;
    coords[3 * tile + 2] = c.batch;
}

extern "C" __global__ void grid_tiles_probe(int num_tiles, int cap, int* __restrict__ log,
                                            int* __restrict__ taken) {
    GridTiles tiles;
    if (threadIdx.x < 32 && threadIdx.x != 0) return;
    probe::log_tiles(
        [&](bool producer) { return producer ? tiles.next(num_tiles) : tiles.receive(num_tiles); },
        num_tiles, cap, log, taken);
}

extern "C" __global__ void persistent_tiles_probe(int num_tiles, int* counter, int cap,
                                                  int* __restrict__ log, int* __restrict__ taken) {
    __shared__ TileMailbox<TileIndex> mailbox;
    if (threadIdx.x == 0) {
        mailbox.init(blockDim.x / 32 - 1);
        fence_barrier_init();
    }
    __syncthreads();
    PersistentTiles<TileIndex> tiles{counter, mailbox};
    if (threadIdx.x < 32 && threadIdx.x != 0) return;
    probe::log_tiles(
        [&](bool producer) {
            if (producer) return tiles.next(num_tiles, [](int tile) { return TileIndex{tile}; }).tile;
            const int tile = tiles.receive().tile;
            tiles.release();
            return tile;
        },
        num_tiles, cap, log, taken);
}
