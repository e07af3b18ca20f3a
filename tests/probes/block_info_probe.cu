// Probe of block_info.cuh and mask.cuh, run by tests/test_primitives.py against a NumPy model of
// which keys a query row sees.
//
// block_info_probe<kBlockM, kBlockN>: grid (query blocks, key blocks), kBlockM threads: warp w
// owns rows 32 w .. 32 w + 31 of the tile as two 16-row groups, in the mma.sync / wgmma
// accumulator layout (mask.cuh: a thread holds rows g, g + 8 of each group and columns
// 8 j + 2 t + e, g = lane / 4, t = lane % 4). Every block
//   * fills an accumulator of kBlockN keys with 1.0, runs apply_mask (AccumulatorColumns) over
//     it and stores it at scores[row][key], a row-major (gridDim.x * kBlockM) x
//     (gridDim.y * kBlockN) matrix: 1.0 where the mask lets (row, key) through, -inf elsewhere;
//   * with blockIdx.y == 0, stores its query block's n_min, n_max, n_right_masked,
//     n_left_unmasked at info[4 * blockIdx.x ..].
//
// seqlens_probe: thread b < batch stores SeqLens::of(b, ...) as four ints at lens[4 b ..].
#include "roles/block_info.cuh"
#include "roles/mask.cuh"

namespace ptxattn {
namespace probe {

template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kBlockM)
block_info_probe(int seqlen_q, int seqlen_k, int causal, int window_left, int window_right,
                 int* __restrict__ info, float* __restrict__ scores) {
    static_assert(kBlockM % 32 == 0 && kBlockN % 8 == 0, "whole warps, whole 8-key tiles");
    const BlockInfo<kBlockM, kBlockN> block(seqlen_q, seqlen_k, causal != 0, window_left,
                                            window_right);
    const int m_block = blockIdx.x;
    const int n_block = blockIdx.y;
    if (n_block == 0 && threadIdx.x == 0) {
        info[4 * m_block + 0] = block.n_min(m_block);
        info[4 * m_block + 1] = block.n_max(m_block);
        info[4 * m_block + 2] = block.n_right_masked(m_block);
        info[4 * m_block + 3] = block.n_left_unmasked(m_block);
    }

    const int lane = threadIdx.x % 32;
    const int first_row = m_block * kBlockM + (threadIdx.x / 32) * 32 + lane / 4;
    const int key0 = n_block * kBlockN + 2 * (lane % 4);
    float s[2][kBlockN / 8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) s[m][j][c] = 1.0f;
        }
    }
    apply_mask<16>(s, block.mask, first_row, key0, AccumulatorColumns{});

    const int row_elems = gridDim.y * kBlockN;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float* row = scores + static_cast<int64_t>(first_row + 16 * m + 8 * h) * row_elems;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
                row[key0 + 8 * j] = s[m][j][2 * h];
                row[key0 + 8 * j + 1] = s[m][j][2 * h + 1];
            }
        }
    }
}

}  // namespace probe
}  // namespace ptxattn

// cu_seqlens_q / cu_seqlens_k may be null (fixed lengths).
extern "C" __global__ void seqlens_probe(int batch, int seqlen_q, int seqlen_k,
                                         const int* cu_seqlens_q, const int* cu_seqlens_k,
                                         int* __restrict__ lens) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    const ptxattn::SeqLens l =
        ptxattn::SeqLens::of(b, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k);
    lens[4 * b + 0] = l.seqlen_q;
    lens[4 * b + 1] = l.seqlen_k;
    lens[4 * b + 2] = l.offset_q;
    lens[4 * b + 3] = l.offset_k;
}
