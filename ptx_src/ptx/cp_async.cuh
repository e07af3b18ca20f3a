// cp.async: per-thread asynchronous global -> shared copies (PTX ISA 9.7.9.3), sm_80+.
//
// Wraps cp.async.cg.shared.global with a 16-byte size (and cp.async.ca with 8 and 4 bytes,
// for narrow rows and single words) and a run-time source size: a source size of 0 copies
// nothing and zero-fills the destination bytes, which is how rows past a sequence's end are
// loaded without reading out of bounds. Copies are grouped with commit_group and retired with
// wait_group N (at most N groups still in flight).
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

__device__ __forceinline__ void cp_async_16(uint32_t dst_smem, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 ::"r"(dst_smem), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_8(uint32_t dst_smem, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
                 ::"r"(dst_smem), "l"(src), "r"(valid ? 8 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst_smem, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 ::"r"(dst_smem), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace ptxattn
