// TMA: bulk tensor copies between global and shared memory (PTX ISA 9.7.9.25), sm_90+.
//
// Wraps cp.async.bulk.tensor.{2,3,4}d loads that complete on an mbarrier (complete_tx::bytes)
// and 4-d stores committed as bulk groups. The tensor map (CUtensorMap, 128 bytes) is built on
// the host by ptxattn.runtime.tensor_map and passed by value in a `const __grid_constant__`
// kernel parameter (the attention kernels' FwdParams), so its address here is a generic address
// of kernel-parameter space.
// Coordinates are element indices, innermost dimension first; boxes that hang over the tensor's
// edge are filled with zeros on load and clipped on store, which is how tails are handled.
#pragma once
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"

namespace ptxattn {

struct alignas(64) TensorMap {
    unsigned char opaque[128];
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRowBytes-byte rows as TMA
// writes (and reads) it with the swizzle span equal to the row (64 or 128 bytes): chunk c of row
// r lives at chunk c ^ ((r * kRowBytes / 128) % (kRowBytes / 16)) of the row.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
    constexpr int kChunks = kRowBytes / 16;
    return row * kRowBytes + 16 * (chunk ^ ((row * kRowBytes / 128) % kChunks));
}

// prefetch.tensormap: brings the descriptor into the cache before the first copy needs it.
__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, MBarrier& bar,
                                            int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_addr(dst)), "l"(map), "r"(bar.addr()), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, MBarrier& bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(smem_addr(dst)), "l"(map), "r"(bar.addr()), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes: `bytes` contiguous bytes
// (a multiple of 16, both addresses 16-byte aligned) from global to shared memory, no tensor map.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          MBarrier& bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar.addr()) : "memory");
}

// cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group: adds a shared-memory
// box into global memory element-wise (float32 adds, performed at L2), clipped at the tensor's
// edges; committed and waited for like a store.
__device__ __forceinline__ void tma_reduce_add_3d(const TensorMap* map, const void* src, int c0,
                                                  int c1, int c2) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
        " [%0, {%2, %3, %4}], [%1];"
        ::"l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

// cp.async.bulk.tensor.4d.global.shared::cta.bulk_group: shared -> global, clipped at the edges.
// The writing threads must fence_proxy_async() and synchronise before one thread issues this.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src,
                                             int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
        ::"l"(map), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

__device__ __forceinline__ void tma_store_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N committed store groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void tma_store_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace ptxattn
