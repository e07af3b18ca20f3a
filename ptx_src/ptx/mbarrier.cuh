// mbarrier: a shared-memory transaction barrier (PTX ISA 9.7.13.15), sm_90+.
//
// Wraps mbarrier.init / arrive / arrive.expect_tx / try_wait.parity. A barrier is a small type
// holding its shared-memory address; the phase bit a waiter expects is kept by the caller (it
// flips each time the stage it guards is reused), because it belongs to the pipeline, not the
// barrier.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

struct MBarrier {
    uint64_t word;

    __device__ __forceinline__ uint32_t addr() const { return smem_addr(&word); }

    // mbarrier.init.shared::cta.b64 [addr], count
    __device__ __forceinline__ void init(uint32_t arrive_count) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr()), "r"(arrive_count));
    }

    // mbarrier.arrive.shared::cta.b64 _, [addr]
    __device__ __forceinline__ void arrive() {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr()) : "memory");
    }

    // mbarrier.arrive.expect_tx: arrive and announce `bytes` that async copies will complete.
    __device__ __forceinline__ void arrive_expect_tx(uint32_t bytes) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(addr()), "r"(bytes) : "memory");
    }

    // mbarrier.try_wait.parity: returns once the phase with parity `phase` has completed.
    __device__ __forceinline__ void wait(uint32_t phase) {
        asm volatile(
            "{\n"
            ".reg .pred done;\n"
            "WAIT_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra WAIT_%=;\n"
            "}\n" ::"r"(addr()), "r"(phase) : "memory");
    }
};

// Makes barrier initialisation visible to the async proxy (TMA) before the first copy uses it.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (wgmma operands, TMA stores). fence.proxy.async.shared::cta
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barrier among `threads` threads of the block: bar.sync id, threads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` without waiting (bar.arrive id, threads): the producer side of a
// hand-off whose consumer waits with named_barrier_sync on the same id and count.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Whether `pred` holds in every one of the `threads` threads meeting at named barrier `id`
// (bar.red.and.pred): a vote across warps, e.g. one warpgroup.
__device__ __forceinline__ bool named_barrier_all(uint32_t id, uint32_t threads, bool pred) {
    uint32_t all;
    asm volatile(
        "{\n"
        ".reg .pred p, q;\n"
        "setp.ne.u32 q, %1, 0;\n"
        "bar.red.and.pred p, %2, %3, q;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(all) : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads) : "memory");
    return all != 0;
}

}  // namespace ptxattn
