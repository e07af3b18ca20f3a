// Swizzled row tiles in shared memory for the mma.sync kernels: where a 16-byte chunk lives,
// how a block fills a tile with cp.async, and where each lane points ldmatrix.
//
// A tile holds rows of kRowBytes (a multiple of 128: at least eight 16-byte chunks). Chunk c of
// row r sits at r * kRowBytes + ((c ^ (r % 8)) << 4): one logical chunk of eight consecutive rows
// falls into eight different bank groups, so ldmatrix (eight rows of one chunk), ldmatrix.trans
// and cp.async are free of bank conflicts.
//
// ldmatrix.x4 reads four 8x8 matrices of 16-bit values; lanes 8i..8i+7 address the rows of
// matrix i. Two lane patterns cover every operand the kernels read from such tiles (fragment
// layouts: mma_sync.cuh), each over 16 tile rows from `row` and the two chunks from `chunk`:
//   rows_then_chunks (lane row = lane % 16, chunk + lane / 16):
//     plain:  the A fragment of a row-major 16x16 tile (A[m][k] = tile[m][k]);
//     .trans: two B fragments (8 columns each) of B[k][n] = tile[k][n];
//   chunks_then_rows (lane row = lane % 8 + 8 (lane / 16), chunk + (lane / 8) % 2):
//     plain:  two B fragments of B[k][n] = tile[n][k] (rows are n);
//     .trans: the A fragment of A[m][k] = tile[k][m] (a transposed operand: rows are k).
// Every fragment load starts at a row that is a multiple of 8 and at an even chunk, so a lane's
// address splits into a per-lane part fixed for the whole kernel (its row offset, and `swizzle`
// = its chunk bit ^ row % 8) plus compile-time offsets after unrolling.
//
// SlabbedTile (below) keeps rows wider than 128 bytes as 128-byte slabs, each a SwizzledTile<128>:
// the layout TMA writes, for tiles that are loaded both ways.
#pragma once
#include "ptx/common.cuh"
#include "ptx/cp_async.cuh"

namespace ptxattn {

// st.shared.b32: a 32-bit shared-window address keeps the store's address arithmetic in 32 bits.
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(value) : "memory");
}

// ld.shared.f32: one float at a 32-bit shared-window address.
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

// st.shared.v2.f32 / ld.shared.v2.f32: two adjacent floats at a 32-bit shared-window address.
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

// cp.async of rows [0, kRows) of a Tile (its kChunksPerRow 16-byte chunks a row, each at
// Tile::offset) from consecutive sequence positions, `rows` pointing at the first. Each of
// kThreads threads moves one chunk of every (kThreads / chunks)-th row. With kCheckRows, rows at
// or past `valid_rows` are zero-filled and their source never read. Chunks at or past
// `valid_chunks` (the array's head_dim / 8, where it is narrower than the tile) are zero-filled
// in every row: the padding to the compiled head dim, which the source does not have.
template <class Tile, int kRows, int kThreads, bool kCheckRows>
__device__ __forceinline__ void copy_rows(uint32_t tile, const uint16_t* rows, int64_t seq_stride,
                                          int valid_rows, int valid_chunks, int tid) {
    constexpr int kChunksPerRow = Tile::kChunksPerRow;
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowsPerPass == 0,
                  "every thread moves the same number of whole chunks");
    static_assert(kRowsPerPass <= 32,
                  "a thread's row within a pass times the seq stride (< 2^26, checked by the "
                  "launchers) must fit in 32 bits");
    const int chunk = tid % kChunksPerRow;
    const int first = tid / kChunksPerRow;
    // a 32-bit per-thread offset is cheap to recompute per tile, where 64-bit per-thread
    // pointers would stay live through the main loop and cost registers
    const int thread_offset = first * static_cast<int>(seq_stride) + chunk * 8;
    const bool column = chunk < valid_chunks;
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
        const int row = first + pass * kRowsPerPass;
        const bool row_valid = !kCheckRows || row < valid_rows;
        const uint16_t* src = rows + pass * kRowsPerPass * seq_stride + thread_offset;
        // A padding chunk copies no bytes from its address (a source size of 0), so only rows
        // past the end need a substitute one (selecting it per chunk too took 14 registers more
        // in the portable forward, and spills).
        cp_async_16(tile + Tile::offset(row, chunk), row_valid ? src : rows, row_valid && column);
    }
}

template <int kRowBytes>
struct SwizzledTile {
    static_assert(kRowBytes % 128 == 0, "the swizzle permutes 8 chunks of 16 bytes");
    static constexpr int kChunksPerRow = kRowBytes / 16;

    static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
        return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
    }

    // Byte offset of 16-bit column `col` of row `row` (stores of accumulator pairs).
    static __device__ __forceinline__ uint32_t element_offset(int row, int col) {
        return offset(row, col >> 3) + ((col & 7) << 1);
    }

    // cp.async of tile rows [0, kRows) from consecutive sequence positions (copy_rows, above).
    template <int kRows, int kThreads, bool kCheckRows>
    static __device__ __forceinline__ void load(uint32_t tile, const uint16_t* rows,
                                                int64_t seq_stride, int valid_rows,
                                                int valid_chunks, int tid) {
        copy_rows<SwizzledTile, kRows, kThreads, kCheckRows>(tile, rows, seq_stride, valid_rows,
                                                             valid_chunks, tid);
    }

    // A lane's ldmatrix address of tile rows row.., chunks chunk.. (row % 8 == 0, chunk even).
    struct LaneAddr {
        uint32_t row_bytes;
        uint32_t swizzle;

        __device__ __forceinline__ uint32_t at(uint32_t tile, int row, int chunk) const {
            return tile + row_bytes + row * kRowBytes + ((chunk & ~7) << 4) +
                   (((chunk & 7) ^ swizzle) << 4);
        }
    };

    static __device__ __forceinline__ LaneAddr rows_then_chunks(int lane) {
        return {static_cast<uint32_t>((lane & 15) * kRowBytes),
                static_cast<uint32_t>((lane >> 4) ^ (lane & 7))};
    }

    static __device__ __forceinline__ LaneAddr chunks_then_rows(int lane) {
        return {static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * kRowBytes),
                static_cast<uint32_t>(((lane >> 3) & 1) ^ (lane & 7))};
    }
};

// Rows of kRowBytes e4m3 bytes (64 or a multiple of 128), their 16-byte units XOR-swizzled by
// row: unit u of row r at r * kRowBytes + ((u ^ swizzle(r)) << 4), swizzle(r) = r % 8 for rows
// of 128 bytes or more and (r / 2) % 4 for 64-byte rows (two to a 128-byte span). The serving
// kernels read an e4m3 cache's fragments from such tiles (mainloops/e4m3_gemms.cuh): a 4-byte
// word of one unit in eight consecutive rows (K), and 4-byte words of one 32-byte column group in
// rows 2t + c (t < 4, one c a load; V). With 128-byte rows or wider both fall into 32 different
// banks; 64-byte rows leave V's loads two-way conflicted. The swizzle depends on the row mod 16
// alone, so a tile's rows offset by a multiple of 16 keep it.
template <int kRowBytes>
struct E4m3Tile {
    static_assert(kRowBytes == 64 || kRowBytes % 128 == 0, "64-byte rows or whole 128-byte spans");
    static __device__ __forceinline__ uint32_t offset(int row, int unit) {
        const int swizzle = kRowBytes >= 128 ? (row & 7) : ((row >> 1) & 3);
        return static_cast<uint32_t>(row * kRowBytes + ((unit ^ swizzle) << 4));
    }
};

// A tile of kRows rows of kRowBytes kept as kRowBytes / 128 slabs: slab s holds chunks 8s..8s+7
// of every row, as a SwizzledTile<128> of kRows rows at s * kRows * 128. It is the layout TMA
// writes with SWIZZLE_128B and one box of 128-byte rows per slab (from a 1024-byte aligned
// tile), which a SwizzledTile of rows wider than 128 bytes is not (TMA's swizzle follows the
// shared-memory address, whose 1024-byte atom then spans fewer than eight rows); within a slab
// ldmatrix and cp.async stay free of bank conflicts as in any SwizzledTile<128>. Lane addresses
// are the slab's, so tiles of any row count share them.
template <int kRowBytes, int kRows>
struct SlabbedTile {
    static_assert(kRowBytes % 128 == 0, "whole 128-byte slabs");
    using Slab = SwizzledTile<128>;
    using LaneAddr = Slab::LaneAddr;
    static constexpr int kChunksPerRow = kRowBytes / 16;
    static constexpr int kSlabs = kRowBytes / 128;
    static constexpr uint32_t kSlabBytes = kRows * 128;

    static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
        return (chunk >> 3) * kSlabBytes + Slab::offset(row, chunk & 7);
    }

    template <int kThreads, bool kCheckRows>
    static __device__ __forceinline__ void load(uint32_t tile, const uint16_t* rows,
                                                int64_t seq_stride, int valid_rows,
                                                int valid_chunks, int tid) {
        copy_rows<SlabbedTile, kRows, kThreads, kCheckRows>(tile, rows, seq_stride, valid_rows,
                                                            valid_chunks, tid);
    }

    // A lane's ldmatrix address of rows row.., chunks chunk.. (row % 8 == 0, chunk even).
    static __device__ __forceinline__ uint32_t at(const LaneAddr& lane, uint32_t tile, int row,
                                                  int chunk) {
        return lane.at(tile + (chunk >> 3) * kSlabBytes, row, chunk & 7);
    }
};

}  // namespace ptxattn
