// The mbarrier pipeline: a ring of kStages shared-memory buffers, each guarded by a `full`
// barrier (the producer's copy landed) and an `empty` barrier (every consumer is done with it).
//
// Phases: a barrier completes one phase per use of its slot, and a waiter names the parity of
// the phase it waits for. PipelineState is a position in the ring counted from the start, so
// slot = count % kStages and the slot's use parity = (count / kStages) & 1; it runs on across
// tiles and never resets. Consumers wait on full with that parity; the producer waits on empty
// with the opposite one, because a fresh barrier counts as having completed the phase before
// its first: the first pass over the ring does not wait.
#pragma once
#include "ptx/common.cuh"
#include "ptx/mbarrier.cuh"

namespace ptxattn {

template <int kStages>
struct PipelineState {
    int count = 0;

    __device__ __forceinline__ int stage() const { return count % kStages; }
    __device__ __forceinline__ uint32_t phase() const { return (count / kStages) & 1; }
};

template <int kStages>
struct Pipeline {
    MBarrier full[kStages];
    MBarrier empty[kStages];

    // One thread, before the block's __syncthreads: `producers` arrivals complete a full phase
    // (one expect_tx arrival for a TMA copy), `consumers` arrivals an empty one.
    __device__ __forceinline__ void init(uint32_t producers, uint32_t consumers) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            full[s].init(producers);
            empty[s].init(consumers);
        }
    }

    // Producer: waits until every consumer released the slot of `state`.
    __device__ __forceinline__ void producer_acquire(const PipelineState<kStages>& state) {
        empty[state.stage()].wait(state.phase() ^ 1);
    }

    __device__ __forceinline__ MBarrier& full_barrier(const PipelineState<kStages>& state) {
        return full[state.stage()];
    }

    // Consumer: waits until the slot of `state` holds its data.
    __device__ __forceinline__ void consumer_wait(const PipelineState<kStages>& state) {
        full[state.stage()].wait(state.phase());
    }

    // Consumer: one of the `consumers` arrivals that free the slot of `state`.
    __device__ __forceinline__ void consumer_release(const PipelineState<kStages>& state) {
        empty[state.stage()].arrive();
    }
};

}  // namespace ptxattn
