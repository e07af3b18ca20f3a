// Probe of tma.cuh's swizzled_offset against the layout TMA really writes, run by
// tests/test_primitives.py.
//
// swizzle_probe<kRowBytes>: one block. Thread 0 TMA-loads the box at (c0, c1) (2-d tensor map
// whose box rows are kRowBytes bytes and whose swizzle span is kRowBytes, built by
// ptxattn.runtime.tensor_map) into a 1024-byte aligned tile of `rows` rows; then every thread
// reads 32-bit words back through swizzled_offset<kRowBytes>(row, chunk) and stores the tile
// unswizzled, row-major, at out[row * kRowBytes / 4 + word].
//
// slabbed_tile_probe<kRowBytes, kRows>: the same for smem_tile.cuh's SlabbedTile (the portable
// backward's K, V, Q and dO): thread 0 TMA-loads kRowBytes / 128 boxes of kRows rows x 128 bytes
// (float32), box s from column c0 + 32 s, into slab s; every thread reads the tile back through
// SlabbedTile::offset.
#include "ptx/mbarrier.cuh"
#include "roles/smem_tile.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {
namespace probe {

// The probes' common part: thread 0 fills the block's 1024-byte aligned tile with `bytes` bytes
// of TMA loads (load(tile, barrier)), then every thread reads it back through offset(row, chunk)
// (byte offsets of 16-byte chunks) and stores it row-major, rows of kRowBytes, at out.
template <int kRowBytes, class Load, class Offset>
__device__ __forceinline__ void read_back_loaded_tile(int rows, Load load, Offset offset,
                                                      uint32_t* __restrict__ out) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* tile = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;
    __shared__ MBarrier loaded;
    if (threadIdx.x == 0) {
        loaded.init(1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        loaded.arrive_expect_tx(rows * kRowBytes);
        load(tile, loaded);
    }
    loaded.wait(0);

    constexpr int kWords = kRowBytes / 4;
    for (int i = threadIdx.x; i < rows * kWords; i += blockDim.x) {
        const int row = i / kWords;
        const int word = i % kWords;
        out[i] = *reinterpret_cast<const uint32_t*>(tile + offset(row, word / 4) + 4 * (word % 4));
    }
}

template <int kRowBytes>
__global__ void swizzle_probe(const __grid_constant__ TensorMap src, int c0, int c1, int rows,
                              uint32_t* __restrict__ out) {
    read_back_loaded_tile<kRowBytes>(
        rows, [&](uint8_t* tile, MBarrier& loaded) { tma_load_2d(tile, &src, loaded, c0, c1); },
        [](int row, int chunk) { return swizzled_offset<kRowBytes>(row, chunk); }, out);
}

template <int kRowBytes, int kRows>
__global__ void slabbed_tile_probe(const __grid_constant__ TensorMap src, int c0, int c1,
                                   uint32_t* __restrict__ out) {
    using Tile = SlabbedTile<kRowBytes, kRows>;
    read_back_loaded_tile<kRowBytes>(
        kRows,
        [&](uint8_t* tile, MBarrier& loaded) {
            for (int slab = 0; slab < Tile::kSlabs; ++slab) {
                tma_load_2d(tile + slab * Tile::kSlabBytes, &src, loaded, c0 + 32 * slab, c1);
            }
        },
        [](int row, int chunk) { return Tile::offset(row, chunk); }, out);
}

}  // namespace probe
}  // namespace ptxattn
