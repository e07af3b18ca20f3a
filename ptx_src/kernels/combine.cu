// The merge of partial attention states: split-KV's partial outputs (fwd_decode_mma_sync.cu),
// and ptxattn.merge_attention_states for any caller that attended to disjoint key sets
// separately (context-parallel ring steps, a cached prefix plus new tokens).
//
// Part i of a row holds o_i, the attention output over its keys alone, and lse_i, their
// log-sum-exp (-inf: no keys, o_i ignored). Over the union of the keys, with M = max_i lse_i:
//   L = sum_i e^(lse_i - M) (+ e^(sink - M) with attention sinks: a logit that joins the
//   denominator and adds nothing to the output),  lse = M + log L,  o = sum_i e^(lse_i - lse) o_i.
// Sums run in part order, so the result is deterministic. A row with no keys (and no sink)
// gives zeros and -inf.
//
// One warp per (batch, position, head) row: each lane holds four columns per 128; the part
// weights are recomputed per column group from the (cached) LSEs. Formats: 0 float16,
// 1 bfloat16, 2 float32, for the parts and the output separately (CombineParams, params.cuh).
#include "ptx/common.cuh"
#include "ptx/mma_sync.cuh"
#include "roles/params.cuh"

namespace ptxattn {

template <int kFormat>
__device__ __forceinline__ float4 load4(const void* base, int64_t at) {
    if constexpr (kFormat == 2) {
        return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + at);
    } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + at);
        const float2 lo = unpack_f32x2<kFormat == 1>(raw.x);
        const float2 hi = unpack_f32x2<kFormat == 1>(raw.y);
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
}

template <int kFormat>
__device__ __forceinline__ void store4(void* base, int64_t at, float4 x) {
    if constexpr (kFormat == 2) {
        *reinterpret_cast<float4*>(static_cast<float*>(base) + at) = x;
    } else {
        *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + at) =
            make_uint2(pack_f32x2<kFormat == 1>(x.x, x.y), pack_f32x2<kFormat == 1>(x.z, x.w));
    }
}

template <int kPartFormat, int kOutFormat>
__global__ void __launch_bounds__(128) combine_states(const __grid_constant__ CombineParams p) {
    constexpr int kWarps = 4;
    const float neg_inf = -__int_as_float(0x7f800000);
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= static_cast<int64_t>(p.batch) * p.seqlen * p.heads) return;
    const int head = static_cast<int>(row % p.heads);
    const int pos = static_cast<int>((row / p.heads) % p.seqlen);
    const int batch = static_cast<int>(row / (static_cast<int64_t>(p.heads) * p.seqlen));
    const float* lse_row = p.lse_parts + batch * p.lse_parts_stride_b +
                           head * p.lse_parts_stride_h + pos * p.lse_parts_stride_s;

    float top = neg_inf;
    for (int i = lane; i < p.num_parts; i += 32) top = fmaxf(top, lse_row[i * p.lse_parts_stride_p]);
#pragma unroll
    for (int width = 16; width > 0; width /= 2) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, width));
    }
    const float sink = p.sinks != nullptr ? p.sinks[head] : neg_inf;
    top = fmaxf(top, sink);
    const float bias = top == neg_inf ? 0.0f : top;
    float total = 0.0f;
    for (int i = lane; i < p.num_parts; i += 32) {
        total += expf(lse_row[i * p.lse_parts_stride_p] - bias);
    }
#pragma unroll
    for (int width = 16; width > 0; width /= 2) total += __shfl_xor_sync(0xffffffffu, total, width);
    total += expf(sink - bias);
    const float lse = total > 0.0f ? bias + logf(total) : neg_inf;
    if (p.lse != nullptr && lane == 0) {
        p.lse[batch * p.lse_stride_b + head * p.lse_stride_h + pos * p.lse_stride_s] = lse;
    }

    const int64_t part_row =
        batch * p.parts_stride_b + pos * p.parts_stride_s + head * p.parts_stride_h;
    const int64_t out_row = batch * p.out_stride_b + pos * p.out_stride_s + head * p.out_stride_h;
    for (int col = 4 * lane; col < p.head_dim; col += 128) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int i = 0; i < p.num_parts; ++i) {
            const float weight = total > 0.0f ? expf(lse_row[i * p.lse_parts_stride_p] - lse) : 0.0f;
            if (weight == 0.0f) continue;  // a part without keys: its output may be anything
            const float4 x = load4<kPartFormat>(p.parts, i * p.parts_stride_p + part_row + col);
            acc.x = fmaf(weight, x.x, acc.x);
            acc.y = fmaf(weight, x.y, acc.y);
            acc.z = fmaf(weight, x.z, acc.z);
            acc.w = fmaf(weight, x.w, acc.w);
        }
        store4<kOutFormat>(p.out, out_row + col, acc);
    }
}

}  // namespace ptxattn
