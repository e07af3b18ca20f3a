// The two short kernels around every backward main kernel (bwd_mma_sync.cu, bwd_sm90.cu), one
// thread per 16-byte chunk of a (batch, head, row) row of head_dim values, rows taken (batch,
// head, row) major to minor so that the dense workspace is written in order:
//   bwd_preprocess:  dpsum[row] = sum(dO * O) over head_dim_v in FP32 (the D of dS = P (dP - D)),
//                    lse_log2[row] = LSE log2(e) (+inf for a row that saw no key), both 0 / +inf
//                    on the padding rows after the sequence's (to seqlen_q_rounded, or packed to
//                    its rows rounded up to row_padding), the row's FP32 dQ accumulator zeroed,
//                    and with sinks the row's dL/dsink, -exp(sink - LSE) D (the sink's
//                    probability times -D: the sink adds nothing to O, only to the denominator);
//   bwd_postprocess: dq = softmax_scale * dq_accum, rounded to the input dtype, into dq's
//                    strides, its head_dim columns.
// kHeadDim is the compiled head dim (the workspace's row), at least the arrays' head dims.
// Rows are those of each sequence (BwdSeq, block_info.cuh: packed sequences at their offsets),
// and the workspace's are its padded rows.
// A row's kHeadDim / 8 threads are adjacent lanes of one warp; the dot product is reduced with
// xor-shuffles among them.
#include "ptx/mma_sync.cuh"
#include "roles/block_info.cuh"
#include "roles/params.cuh"

namespace ptxattn {

struct RowChunk {
    int head;
    int row;    // within the sequence
    int chunk;
    BwdSeq seq;
    bool in_range;  // one of the sequence's workspace rows (padding rows included)
    bool valid;     // a row of the arrays: in range and below the sequence's seqlen_q

    // Walks rows_per_head rows of every (batch, head): at least each sequence's query rows, or
    // its workspace rows, whose padding the preprocess writes too (`padding`).
    template <int kChunks>
    __device__ __forceinline__ static RowChunk of_thread(const BwdParams& p, int rows_per_head,
                                                         bool padding) {
        const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        const int64_t walked = index / kChunks;
        RowChunk c;
        c.chunk = static_cast<int>(index % kChunks);
        c.row = static_cast<int>(walked % rows_per_head);
        const int64_t batch_head = walked / rows_per_head;
        c.head = static_cast<int>(batch_head % p.heads_q);
        const int batch = min(static_cast<int>(batch_head / p.heads_q), p.batch - 1);
        c.seq = BwdSeq::of(p, batch);
        const int seqlen_q = c.seq.lens.seqlen_q;
        const int rows = !padding ? seqlen_q
                         : p.cu_seqlens_q == nullptr
                             ? p.seqlen_q_rounded
                             : (seqlen_q + p.row_padding - 1) / p.row_padding * p.row_padding;
        c.in_range = batch_head < static_cast<int64_t>(p.batch) * p.heads_q && c.row < rows;
        c.valid = c.in_range && c.row < seqlen_q;
        return c;
    }
    __device__ __forceinline__ int64_t workspace_row(const BwdParams& p) const {
        return seq.workspace_row(p, head, row);
    }
    __device__ __forceinline__ int64_t array_row() const { return seq.lens.offset_q + row; }
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
    // Every workspace row of a fixed-length batch; packed, the longest sequence's rounded up.
    const int walked = p.cu_seqlens_q == nullptr
                           ? p.seqlen_q_rounded
                           : (p.seqlen_q + p.row_padding - 1) / p.row_padding * p.row_padding;
    const RowChunk c = RowChunk::of_thread<kChunks>(p, walked, true);
    const int batch = c.seq.batch_coord;
    float sum = 0.0f;
    if (c.valid && 8 * c.chunk < p.head_dim_v) {
        const uint4 o = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.out) + batch * p.out_stride_b +
            c.array_row() * p.out_stride_s + c.head * p.out_stride_h + 8 * c.chunk);
        const uint4 d = *reinterpret_cast<const uint4*>(
            static_cast<const uint16_t*>(p.dout) + batch * p.dout_stride_b +
            c.array_row() * p.dout_stride_s + c.head * p.dout_stride_h + 8 * c.chunk);
        sum = dot8<kBf16>(o, d);
    }
    if (c.valid) {
        float4* acc =
            reinterpret_cast<float4*>(p.dq_accum + c.workspace_row(p) * kHeadDim + 8 * c.chunk);
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
        float dsink = 0.0f;
        if (c.valid) {
            const float lse =
                p.lse[batch * p.lse_stride_b + c.head * p.lse_stride_h + c.array_row()];
            if (lse != -pos_inf) {
                lse_log2 = lse * 1.4426950408889634f;
                if (p.sinks != nullptr) dsink = -expf(p.sinks[c.head] - lse) * sum;
            }
        }
        p.dpsum[c.workspace_row(p)] = sum;
        p.lse_log2[c.workspace_row(p)] = lse_log2;
        if (p.dsink_rows != nullptr) p.dsink_rows[c.workspace_row(p)] = dsink;
    }
}

template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256) bwd_postprocess(const __grid_constant__ BwdParams p) {
    constexpr int kChunks = kHeadDim / 8;
    const RowChunk c = RowChunk::of_thread<kChunks>(p, p.seqlen_q, false);
    if (!c.valid || 8 * c.chunk >= p.head_dim) return;
    const float4* acc =
        reinterpret_cast<const float4*>(p.dq_accum + c.workspace_row(p) * kHeadDim + 8 * c.chunk);
    const float4 lo = acc[0];
    const float4 hi = acc[1];
    const float s = p.softmax_scale;
    uint4 packed;
    packed.x = pack_f32x2<kBf16>(lo.x * s, lo.y * s);
    packed.y = pack_f32x2<kBf16>(lo.z * s, lo.w * s);
    packed.z = pack_f32x2<kBf16>(hi.x * s, hi.y * s);
    packed.w = pack_f32x2<kBf16>(hi.z * s, hi.w * s);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.dq) + c.seq.batch_coord * p.dq_stride_b +
                              c.array_row() * p.dq_stride_s + c.head * p.dq_stride_h +
                              8 * c.chunk) = packed;
}

}  // namespace ptxattn
