// The two short kernels around every backward main kernel (bwd_mma_sync.cu, bwd_sm90.cu), one
// thread per 16-byte chunk of a (batch, head, row) row of head_dim values, rows taken (batch,
// head, row) major to minor so that the dense workspace is written in order:
//   bwd_preprocess:  dpsum[row] = sum(dO * O) over head_dim in FP32 (the D of dS = P (dP - D)),
//                    lse_log2[row] = LSE log2(e) (+inf for a row that saw no key), both 0 / +inf
//                    on the padding rows up to seqlen_q_rounded, and the row's FP32 dQ
//                    accumulator zeroed;
//   bwd_postprocess: dq = softmax_scale * dq_accum, rounded to the input dtype, into dq's
//                    strides.
// A row's kHeadDim / 8 threads are adjacent lanes of one warp; the dot product is reduced with
// xor-shuffles among them.
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"

namespace ptxattn {

struct RowChunk {
    int batch;
    int head;
    int row;
    int chunk;
    int64_t batch_head;  // batch * heads_q + head
    bool in_range;       // one of the rows walked (padding rows included)
    bool valid;          // a row of the arrays: in range and below seqlen_q

    // Walks rows_per_head rows of every (batch, head): seqlen_q, or seqlen_q_rounded to write
    // the padding rows of dpsum and lse_log2 too.
    template <int kChunks>
    __device__ __forceinline__ static RowChunk of_thread(const BwdParams& p, int rows_per_head) {
        const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        const int64_t walked = index / kChunks;
        RowChunk c;
        c.chunk = static_cast<int>(index % kChunks);
        c.in_range = walked < static_cast<int64_t>(p.batch) * p.heads_q * rows_per_head;
        c.row = static_cast<int>(walked % rows_per_head);
        c.batch_head = walked / rows_per_head;
        c.head = static_cast<int>(c.batch_head % p.heads_q);
        c.batch = static_cast<int>(c.batch_head / p.heads_q);
        c.valid = c.in_range && c.row < p.seqlen_q;
        return c;
    }
    __device__ __forceinline__ int64_t dense_row(const BwdParams& p) const {
        return batch_head * p.seqlen_q + row;
    }
    __device__ __forceinline__ int64_t padded_row(const BwdParams& p) const {
        return batch_head * p.seqlen_q_rounded + row;
    }
};

template <bool kBf16>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    const uint32_t x[4] = {a.x, a.y, a.z, a.w};
    const uint32_t y[4] = {b.x, b.y, b.z, b.w};
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fx = unpack_f32x2<kBf16>(x[i]);
        const float2 fy = unpack_f32x2<kBf16>(y[i]);
        sum = fmaf(fx.x, fy.x, sum);
        sum = fmaf(fx.y, fy.y, sum);
    }
    return sum;
}

template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256) bwd_preprocess(const __grid_constant__ BwdParams p) {
    constexpr int kChunks = kHeadDim / 8;
    const RowChunk c = RowChunk::of_thread<kChunks>(p, p.seqlen_q_rounded);
    float sum = 0.0f;
    if (c.valid) {
        const uint4 o = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.out) + c.batch * p.out_stride_b +
            c.row * p.out_stride_s + c.head * p.out_stride_h + 8 * c.chunk);
        const uint4 d = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.dout) + c.batch * p.dout_stride_b +
            c.row * p.dout_stride_s + c.head * p.dout_stride_h + 8 * c.chunk);
        sum = dot8<kBf16>(o, d);
        float4* acc =
            reinterpret_cast<float4*>(p.dq_accum + c.dense_row(p) * kHeadDim + 8 * c.chunk);
        acc[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        acc[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int offset = 1; offset < kChunks; offset *= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (c.in_range && c.chunk == 0) {
        const float pos_inf = __int_as_float(0x7f800000);
        float lse_log2 = pos_inf;
        if (c.valid) {
            const float lse = p.lse[c.batch * p.lse_stride_b + c.head * p.lse_stride_h + c.row];
            if (lse != -pos_inf) lse_log2 = lse * 1.4426950408889634f;
        }
        p.dpsum[c.padded_row(p)] = sum;
        p.lse_log2[c.padded_row(p)] = lse_log2;
    }
}

template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256) bwd_postprocess(const __grid_constant__ BwdParams p) {
    constexpr int kChunks = kHeadDim / 8;
    const RowChunk c = RowChunk::of_thread<kChunks>(p, p.seqlen_q);
    if (!c.valid) return;
    const float4* acc =
        reinterpret_cast<const float4*>(p.dq_accum + c.dense_row(p) * kHeadDim + 8 * c.chunk);
    const float4 lo = acc[0];
    const float4 hi = acc[1];
    const float s = p.softmax_scale;
    uint4 packed;
    packed.x = pack_f32x2<kBf16>(lo.x * s, lo.y * s);
    packed.y = pack_f32x2<kBf16>(lo.z * s, lo.w * s);
    packed.z = pack_f32x2<kBf16>(hi.x * s, hi.y * s);
    packed.w = pack_f32x2<kBf16>(hi.z * s, hi.w * s);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.dq) + c.batch * p.dq_stride_b +
                              c.row * p.dq_stride_s + c.head * p.dq_stride_h + 8 * c.chunk) =
        packed;
}

}  // namespace ptxattn
