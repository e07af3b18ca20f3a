// Moves one tile global -> shared -> global through TMA, so a test can check the runtime's
// tensor maps and the tma.cuh wrappers bit for bit.
#include "ptx/tma.cuh"

extern "C" __global__ void tma_copy_probe(const __grid_constant__ ptxattn::TensorMap src,
                                          const __grid_constant__ ptxattn::TensorMap dst,
                                          int c0, int c1, int c2, int c3, int tile_bytes) {
    extern __shared__ __align__(1024) unsigned char tile[];
    __shared__ ptxattn::MBarrier loaded;
    if (threadIdx.x == 0) {
        loaded.init(1);
        ptxattn::fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        loaded.arrive_expect_tx(tile_bytes);
        ptxattn::tma_load_4d(tile, &src, loaded, c0, c1, c2, c3);
        loaded.wait(0);
        ptxattn::tma_store_4d(&dst, tile, c0, c1, c2, c3);
        ptxattn::tma_store_commit();
        ptxattn::tma_store_wait<0>();
    }
}
