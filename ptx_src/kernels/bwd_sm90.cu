// Attention backward for Hopper (sm_90a): TMA + mbarrier ring, wgmma, warp specialisation.
//
// Runs between bwd_preprocess (dpsum = rowsum(dO * O), dq_accum zeroed) and bwd_postprocess
// (dq = softmax_scale * dq_accum in the input dtype), both in bwd_prepost.cu, as the portable
// backward (bwd_mma_sync.cu) does.
//
// Grid (key blocks, kv heads, batch), 384 threads: block (n, kv head, b) owns keys
// [128 n, 128 n + 128) and walks the query tiles that see them for every q head sharing the kv
// head (BwdSteps), in BwdWalk's order:
//   warpgroup 0   the producer: gives most of its registers away (setmaxnreg); one thread loads
//                 K and V once and every step's Q and dO through TMA (mainloops/bwd_sm90.cuh);
//                 writer warps add each step's dQ at head_dims 64 and 128 and with
//                 deterministic sums: warp 1 alone, or with deterministic sums warps 1 and 2,
//                 one a consumer warpgroup (64, 128) or a dQ round (256), each in its own turns;
//   warpgroups 1-2 the consumers: 64 keys each, the step's five GEMMs, dQ added into the FP32
//                 accumulator, and at the end dK and dV staged in shared memory and written by
//                 TMA stores (mainloops/bwd_sm90.cuh).
// The launcher (ptxattn/launchers/hopper_backward.py) instantiates
// attn_bwd_sm90<BwdSm90Config<...>> by name; every runtime argument is in BwdParams (params.cuh),
// whose q/k/v/dout maps are 4-d with coordinates (d, head, row, batch) and boxes of 64 columns x
// kBlockM (q, dout) or 128 (k, v) rows; rows past the end load as zeros.
#include "mainloops/bwd_sm90.cuh"
#include "roles/params.cuh"
#include "roles/tile_scheduler.cuh"
#include "ptx/warpgroup.cuh"

namespace ptxattn {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
attn_bwd_sm90(const __grid_constant__ BwdParams p) {
    using Mainloop = BwdSm90Mainloop<Cfg>;
    using Barriers = typename Mainloop::Barriers;

    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = align_smem<Cfg::kSwizzleAtomBytes>(smem_raw);
    Barriers& bars = *reinterpret_cast<Barriers*>(smem + Mainloop::kBarrierOffset);
    const int kv_head = blockIdx.y;
    const int batch = blockIdx.z;
    const BwdSeq seq = BwdSeq::of<Cfg::kOptions>(p, batch);
    // The options build: the grid covers the longest sequence's keys, and a packed sequence's
    // may end before this block; the window is the call's. Otherwise the grid is the call's
    // and nothing is windowed.
    const int n_blocks =
        Cfg::kOptions ? ceil_div(seq.lens.seqlen_k, Mainloop::kBlockN) : int(gridDim.x);
    if (Cfg::kOptions && static_cast<int>(blockIdx.x) >= n_blocks) return;
    const int window_left = Cfg::kOptions ? p.window_left : -1;
    const int window_right = Cfg::kOptions ? p.window_right : -1;
    const typename Mainloop::Info info(seq.lens.seqlen_q, seq.lens.seqlen_k, Cfg::kCausal,
                                       window_left, window_right);
    const bool banded = !Cfg::kCausal && (window_left >= 0 || window_right >= 0);
    const BwdWalk walk = BwdWalk::make(
        blockIdx.x, n_blocks,
        Cfg::kOptions ? ceil_div(seq.lens.seqlen_q, Cfg::kBlockM) : p.num_m_blocks, Cfg::kCausal,
        Cfg::kDeterministic, p.dq_turn_group, Cfg::kStaggeredWalk, banded);
    const BwdSteps steps = BwdSteps::make(info, walk, p.q_per_kv);

    if (threadIdx.x == 0) {
        bars.kv_full.init(1);
        bars.q_do.init(1, Cfg::kConsumerWarps);
        fence_barrier_init();
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        warpgroup_reg_dealloc<Cfg::kProducerRegs>();
        if (threadIdx.x == 0) {
            Mainloop::load(p, smem, bars, steps, walk.n_block, kv_head, seq);
        } else if (Cfg::kDqWriter && threadIdx.x / 32 == 1) {
            Mainloop::template write_dq<0>(p, smem, info, walk, steps, kv_head, batch, seq);
        } else if (threadIdx.x / 32 == 2) {
            if constexpr (Cfg::kDqWriter && Mainloop::kWriterWarps > 1) {
                Mainloop::template write_dq<1>(p, smem, info, walk, steps, kv_head, batch, seq);
            }
        }
        return;
    }

    warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int thread = threadIdx.x;
    typename Mainloop::Consumer consumer{smem, bars, thread / 128 - 1, (thread % 128) / 32,
                                         thread % 32};
    consumer.run(p, info, walk, steps, kv_head, seq);
    consumer.store(p, walk.n_block, kv_head, seq);
}

}  // namespace ptxattn
