// The two short kernels around every backward main kernel (bwd_mma_sync.cu), one thread per
// 16-byte chunk of a (batch, head, row) row of head_dim values, rows taken (batch, head, row)
// major to minor so that the dense workspace is written in order:
//   bwd_preprocess:  dpsum[row] = sum(dO * O) over head_dim in FP32 (the D of dS = P (dP - D)),
//                    and the row's FP32 dQ accumulator zeroed;
//   bwd_postprocess: dq = softmax_scale * dq_accum, rounded to the input dtype, into dq's
//                    strides.
// A row's kHeadDim / 8 threads are adjacent lanes of one warp; the dot product is reduced with
// xor-shuffles among them.
#include "mma_sync.cuh"
#include "params.cuh"

namespace ptxattn {

struct RowChunk {
    int batch;
    int head;
    int row;
    int chunk;
    int64_t dense_row;  // (batch * heads_q + head) * seqlen_q + row
    bool valid;

    template <int kChunks>
    __device__ __forceinline__ static RowChunk of_thread(const BwdParams& p) {
        const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        RowChunk c;
        c.dense_row = index / kChunks;
        c.chunk = static_cast<int>(index % kChunks);
        c.valid = c.dense_row < static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
        c.row = static_cast<int>(c.dense_row % p.seqlen_q);
        const int64_t bh = c.dense_row / p.seqlen_q;
        c.head = static_cast<int>(bh % p.heads_q);
        c.batch = static_cast<int>(bh / p.heads_q);
        return c;
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
    const RowChunk c = RowChunk::of_thread<kChunks>(p);
    float sum = 0.0f;
    if (c.valid) {
        const uint4 o = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.out) + c.batch * p.out_stride_b +
            c.row * p.out_stride_s + c.head * p.out_stride_h + 8 * c.chunk);
        const uint4 d = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.dout) + c.batch * p.dout_stride_b +
            c.row * p.dout_stride_s + c.head * p.dout_stride_h + 8 * c.chunk);
        sum = dot8<kBf16>(o, d);
        float4* acc = reinterpret_cast<float4*>(p.dq_accum + c.dense_row * kHeadDim + 8 * c.chunk);
        acc[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        acc[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int offset = 1; offset < kChunks; offset *= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (c.valid && c.chunk == 0) p.dpsum[c.dense_row] = sum;
}

template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256) bwd_postprocess(const __grid_constant__ BwdParams p) {
    constexpr int kChunks = kHeadDim / 8;
    const RowChunk c = RowChunk::of_thread<kChunks>(p);
    if (!c.valid) return;
    const float4* acc =
        reinterpret_cast<const float4*>(p.dq_accum + c.dense_row * kHeadDim + 8 * c.chunk);
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
