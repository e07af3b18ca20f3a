// Warpgroup register reallocation: setmaxnreg (PTX ISA 9.7.19.5), sm_90a.
//
// A block launched with R registers per thread can hand registers from one warpgroup to
// another: setmaxnreg.dec.sync.aligned.u32 N releases a warpgroup's registers down to N per
// thread, setmaxnreg.inc.sync.aligned.u32 N blocks until the pool can raise it to N. N is a
// multiple of 8 in [24, 256]; all warps of a warpgroup must execute the same instruction. The
// kernel must be compiled with a register cap (__launch_bounds__) so the pool is known, and the
// sum over warpgroups of the new counts must not exceed what the block was launched with, or the
// increase waits forever.
#pragma once
#include "ptx/common.cuh"

namespace ptxattn {

// threadIdx.x / 128, broadcast from lane 0 (shfl.sync.idx) so that ptxas knows it is
// warp-uniform: wgmma descriptors derived from it then live in uniform registers, instead of in
// per-thread registers copied over (R2UR) before every wgmma.
__device__ __forceinline__ int warpgroup_index() {
    return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg count");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg count");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace ptxattn
