// GPU-scope semaphores: blocks taking turns on a shared sum, in a fixed order.
//
// The deterministic backward adds each key block's dQ into the FP32 accumulator in key-block
// order: block n waits until the tile's counter reads n, adds, and bumps it. The wait is
// ld.acquire.gpu (the adds of earlier blocks are visible once the count is), the bump
// red.release.gpu after a __threadfence by every adding thread. Blocks wait only on blocks of
// lower index, which the hardware launched earlier, so the wait cannot deadlock.
#pragma once
#include "common.cuh"

namespace ptxattn {

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
