// Probe of pipeline.cuh's phase bookkeeping, run by tests/test_primitives.py: `items` items of 32
// ints pass through a Pipeline<kStages> ring of shared-memory slots, many times round the ring.
//
// Warp 0's thread 0 is the producer: per item it waits for the slot (producer_acquire), writes
// src[32 i .. 32 i + 31] into it with plain shared-memory stores and arrives on the slot's full
// barrier (one arrival: init(1, consumers)). Every other warp consumes every item: it waits for
// the slot (consumer_wait), lane l copies word l to out[((warp - 1) * items + i) * 32 + l], and
// after __syncwarp lane 0 releases the slot (consumer_release; one arrival per consumer warp).
// Both sides advance a PipelineState of their own. The producer dawdles on some stretches of
// items and the consumers (each warp by a different amount) on others, so the ring runs both
// full (producer_acquire waits) and empty (consumer_wait waits).
#include "ptx/mbarrier.cuh"
#include "roles/pipeline.cuh"

namespace ptxattn {
namespace probe {

// Sleeps on alternate stretches of 64 items: the producer (who = 0) on even ones, consumer warp
// `who` on odd ones, varying with the item.
__device__ __forceinline__ void dawdle(int item, int who) {
    const bool producer_stretch = (item / 64) % 2 == 0;
    if (producer_stretch == (who == 0)) __nanosleep(64 * ((item * 7 + who * 3) % 5));
}

template <int kStages>
__global__ void __launch_bounds__(128)
pipeline_probe(const int* __restrict__ src, int items, int* __restrict__ out) {
    __shared__ Pipeline<kStages> pipe;
    __shared__ int slots[kStages][32];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        pipe.init(1, blockDim.x / 32 - 1);
        fence_barrier_init();
    }
    __syncthreads();

    PipelineState<kStages> state;
    if (warp == 0) {
        if (lane != 0) return;
        for (int i = 0; i < items; ++i, ++state.count) {
            pipe.producer_acquire(state);
            for (int w = 0; w < 32; ++w) slots[state.stage()][w] = src[32 * i + w];
            pipe.full_barrier(state).arrive();
            dawdle(i, 0);
        }
        return;
    }
    for (int i = 0; i < items; ++i, ++state.count) {
        pipe.consumer_wait(state);
        out[((warp - 1) * items + i) * 32 + lane] = slots[state.stage()][lane];
        dawdle(i, warp);
        __syncwarp();
        if (lane == 0) pipe.consumer_release(state);
    }
}

}  // namespace probe
}  // namespace ptxattn
