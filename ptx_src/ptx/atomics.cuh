// Global-memory atomics: FP32 sums, and semaphores for blocks taking turns on a shared sum.
//
// red_add_f32x2: two adjacent floats added with one red.global.add.v2.f32 (sm_90+; two scalar
// reds before). An mma accumulator row pair of a warp is 8 rows x 32 bytes: the vector form
// makes it 8 sector updates instead of 16, and the backward's dQ sums are bound by those.
//
// The deterministic backward adds each key block's dQ into the FP32 accumulator in a fixed order
// (BwdWalk, tile_scheduler.cuh): a block waits until the tile's counter reads its turn, adds, and
// bumps it. The wait is ld.acquire.gpu (the adds of earlier blocks are visible once the count
// is); the bump is one thread's red.release.gpu after its block's adds: after a barrier for
// red.global adds by many threads (release is cumulative, so it publishes the adds of every
// thread that reached the barrier, with no fence per thread), after cp.async.bulk.wait_group 0
// for a TMA reduce. A block waits only for blocks that can be resident beside it or were
// launched before it (BwdWalk), so the wait ends.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b)
                 : "memory");
#else
    atomicAdd(addr, a);
    atomicAdd(addr + 1, b);
#endif
}

__device__ __forceinline__ int load_acquire(const int* flag) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

// Spins (one thread) until *flag == turn.
__device__ __forceinline__ void wait_turn(const int* flag, int turn) {
    while (load_acquire(flag) != turn) {
        __nanosleep(32);
    }
}

__device__ __forceinline__ void pass_turn(int* flag) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(flag) : "memory");
}

}  // namespace ptxattn
