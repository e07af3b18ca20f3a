// FlashAttention-2 style backward pass on mma.sync tensor cores: the portable kernel (sm_80+).
//
// Runs between bwd_preprocess (dpsum = rowsum(dO * O), dq_accum zeroed) and bwd_postprocess
// (dq = softmax_scale * dq_accum in the input dtype), both in bwd_prepost.cu.
//
// Grid (key blocks, kv heads, batch): block (n, kv head, b) loads its kBlockN keys of K and V
// once, then for every q head sharing the kv head walks the query tiles that see those keys
// (block_info.cuh), first to last, through a ring of (Q, dO) stages, and runs the
// three phases of mainloops/bwd_mma_sync.cuh (whose header also says how warps synchronise). dK
// and dV are sums over the block's own walk (GQA heads included) and stay in registers until the
// end; dQ crosses key blocks, so each block adds its part into the FP32 accumulator: with
// red.global.add in any order, or, with dq_semaphore, in key-block order (atomics.cuh) so that
// the sums are bit-reproducible. A block passes its turn at a tile right after its adds, or in
// builds with deferred turns (sm_90+ deterministic) at the next step's score barrier.
// Q, dO and the rows' values reach the ring by cp.async from every thread, or with overlapping
// steps (sm_90+) by one thread's TMA and bulk copies, issued once every warp is past the step
// before (P and dS then alternate between two buffers).
// The order of the walk and of the deterministic sums is BwdWalk's (tile_scheduler.cuh).
//
// The launcher (ptxattn/launchers/portable_backward.py) instantiates
// attn_bwd_mma_sync<BwdMmaSyncConfig<...>> by name; every runtime argument is in BwdParams
// (params.cuh).
#include "mainloops/bwd_mma_sync.cuh"
#include "roles/params.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
attn_bwd_mma_sync(const __grid_constant__ BwdParams p) {
    BwdMmaSyncMainloop<Cfg>::run(p, threadIdx.x);
}

}  // namespace ptxattn
