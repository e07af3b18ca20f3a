// The arguments of every attention forward kernel: one struct, passed by value as
// `const __grid_constant__ FwdParams` and filled once on the host by ptxattn/params.py, which
// mirrors this layout field for field (tests/test_params.py compiles a check of every offset).
//
// Each family reads the fields it needs: the Hopper and block-scaled kernels load through the
// tensor maps, the portable kernels through the pointers and strides. Strides are in elements,
// 64-bit, per (batch, seqlen, head); head_dim has unit stride. The mask is described by
// `causal` and the window (mask.cuh): the block-scaled and decode kernels read `causal`, the
// others take it as a template parameter; the serving kernels (the decode kernel, the Hopper
// serving build) read the window and the per-sequence lengths `cu_seqlens_*` and `seqused_k`
// (block_info.cuh's SeqLens; null for fixed-length batches), which the fixed-length kernels
// leave alone.
#pragma once
#include "ptx/common.cuh"
#include "ptx/tma.cuh"

namespace ptxattn {

struct alignas(64) FwdParams {
    // TMA descriptors (sm_90+ kernels): 4-d maps over (batch, seqlen, heads, head_dim), or the
    // layouts ptxattn/launchers/hopper_forward.py and launchers/blockscaled.py document.
    TensorMap q_map;
    TensorMap k_map;
    TensorMap v_map;
    TensorMap out_map;

    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;  // float32, [batch * lse_stride_b + head * lse_stride_h + row]

    int64_t q_stride_b, q_stride_s, q_stride_h;
    int64_t k_stride_b, k_stride_s, k_stride_h;
    int64_t v_stride_b, v_stride_s, v_stride_h;
    int64_t out_stride_b, out_stride_s, out_stride_h;
    int64_t lse_stride_b, lse_stride_h;

    int batch;
    int seqlen_q;
    int seqlen_k;
    int heads_q;
    int heads_kv;
    int q_per_kv;  // heads_q / heads_kv (GQA/MQA)
    float scale_log2;  // softmax_scale * log2(e)

    // Mask: bottom-right aligned causal; window sizes, -1 = unbounded (mask.cuh).
    int causal;
    int window_left;
    int window_right;

    // Per-sequence lengths (varlen), null for a fixed-length batch.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;

    // Tile schedule (tile_scheduler.cuh).
    int num_m_blocks;
    int section_heads;
    int* tile_counter;  // dynamic persistent order: two zeroed ints, or null

    // FP8 descales, float32 at [b * stride_b + h * stride_h + block * stride_block]: h the q head
    // for q's, the kv head for k's and v's; stride 0 where a scale does not vary.
    const float* q_descale;
    int64_t q_descale_stride_b, q_descale_stride_h, q_descale_stride_block;
    const float* k_descale;
    int64_t k_descale_stride_b, k_descale_stride_h, k_descale_stride_block;
    const float* v_descale;
    int64_t v_descale_stride_b, v_descale_stride_h;

    // Block-scaled formats (fwd_blockscaled.cu): per-row / per-key-chunk scale bytes and the
    // NVFP4 per-tensor scales (1 for MXFP8).
    const uint8_t* q_scale;
    const uint8_t* k_scale;
    const uint8_t* v_scale;
    const float* q_tensor_scale;
    const float* k_tensor_scale;
    int v_scale_row;  // V scale bytes per head_dim row: padded seqlen_k / 32

    // Serving (fwd_decode_mma_sync.cu; null / 0 where unused). Keys of sequence b: seqused_k[b]
    // when given (a KV cache's filled length), else its cu_seqlens_k / seqlen_k length. A paged
    // cache (kv_cache.cuh) keeps key j of sequence b in page block_table[b * block_table_stride
    // + j / page_size], row j % page_size, the k/v batch strides stepping over pages.
    const int* seqused_k;
    const int* block_table;
    int64_t block_table_stride;
    int page_size;  // 0: contiguous cache
    int total_q;    // rows of q over the batch: batch * seqlen_q, or cu_seqlens_q[batch]
    // Split-KV: num_splits > 1 writes each split's partial output (normalised
    // over its own keys) and LSE, float32, dense [split][total_q][heads_q][head_dim] and
    // [split][heads_q][total_q], for combine.cu to merge.
    int num_splits;
    float* out_accum;
    float* lse_accum;
    // Logit softcap: scores become tanh(softcap_scale * s) before the softmax (softcap_scale =
    // softmax_scale / softcap, and scale_log2 = softcap * log2(e)); 0 = off.
    float softcap_scale;
    // Attention sinks: one float32 logit per q head (natural log) that joins each row's softmax
    // denominator; null = none.
    const float* sinks;
    // The columns of q and k (head_dim) and of v and out (head_dim_v), at most the kernel's
    // compiled head dim: loads fill the columns past them with zeros and stores leave them
    // alone, so a call runs on the next compiled head dim up without padding its arrays.
    int head_dim;
    int head_dim_v;
};

// The arguments of combine.cu's merge of partial attention states: parts (num_parts, batch,
// seqlen, heads, head_dim) with their log-sum-exps (num_parts, batch, heads, seqlen), into one
// output and LSE. Element strides; unit stride in head_dim.
struct CombineParams {
    const void* parts;
    const float* lse_parts;
    void* out;
    float* lse;         // may be null
    const float* sinks;  // per head, natural log, or null
    int64_t parts_stride_p, parts_stride_b, parts_stride_s, parts_stride_h;
    int64_t lse_parts_stride_p, lse_parts_stride_b, lse_parts_stride_h, lse_parts_stride_s;
    int64_t out_stride_b, out_stride_s, out_stride_h;
    int64_t lse_stride_b, lse_stride_h, lse_stride_s;
    int num_parts;
    int batch;
    int seqlen;
    int heads;
    int head_dim;  // a multiple of 4
};

// The arguments of every backward kernel (preprocess, main, postprocess), mirrored by
// ptxattn/params.py's BwdParams like FwdParams. Strides are in elements per (batch, seqlen,
// head) with unit stride in head_dim; the workspace arrays are dense, indexed by
// (batch * heads_q + head) * seqlen_q + row (times head_dim) for dq_accum and by
// (batch * heads_q + head) * seqlen_q_rounded + row for dpsum and lse_log2, whose padding rows
// let a kernel copy whole query tiles of rows.
struct alignas(64) BwdParams {
    // 4-d TMA maps of q, k, v and dout, coordinates (d, head, row, batch), boxes of 64 columns x
    // the kernel's rows: the Hopper kernel's (bwd_sm90.cu), and q's and dout's for the portable
    // kernel where it loads them by TMA (overlapping steps, sm_90+); zero where unused.
    TensorMap q_map;
    TensorMap k_map;
    TensorMap v_map;
    TensorMap dout_map;
    TensorMap dq_accum_map;  // dq_accum as (batch * heads_q, seqlen_q, head_dim) float32
    TensorMap dk_map;        // dk, dv like k and v: boxes of 64 columns x 64 rows
    TensorMap dv_map;

    const void* q;
    const void* k;
    const void* v;
    const void* out;
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    const float* lse;   // the forward's, natural log, unit stride along seqlen_q
    float* dq_accum;    // float32 dQ summed over key blocks, before softmax_scale
    float* dpsum;       // per row: sum over head_dim of dO * O; 0 on padding rows
    float* lse_log2;    // per row: LSE * log2(e), +inf where LSE is -inf and on padding rows
    int* dq_semaphore;  // deterministic order of the dQ sums: zeroed ints, one per (b, h, m block)
                        // and writer (the Hopper kernel's kWriterWarps, the portable's one), or
                        // null (atomic adds in any order)

    int64_t q_stride_b, q_stride_s, q_stride_h;
    int64_t k_stride_b, k_stride_s, k_stride_h;
    int64_t v_stride_b, v_stride_s, v_stride_h;
    int64_t out_stride_b, out_stride_s, out_stride_h;
    int64_t dout_stride_b, dout_stride_s, dout_stride_h;
    int64_t dq_stride_b, dq_stride_s, dq_stride_h;
    int64_t dk_stride_b, dk_stride_s, dk_stride_h;
    int64_t dv_stride_b, dv_stride_s, dv_stride_h;
    int64_t lse_stride_b, lse_stride_h;

    int batch;
    int seqlen_q;
    int seqlen_k;
    int heads_q;
    int heads_kv;
    int q_per_kv;
    float softmax_scale;
    float scale_log2;  // softmax_scale * log2(e)
    int causal;
    int num_m_blocks;  // query blocks of the main kernel's tile
    int seqlen_q_rounded;  // rows per (batch, head) in dpsum, lse_log2 (backward.rounded_rows)
    int dq_turn_group;     // deterministic sums: key blocks that may wait on each other, at most
                           // the blocks the GPU holds at once (BwdWalk, tile_scheduler.cuh)

    // The forward's mask and scores, read by the same block-info / mask code (block_info.cuh):
    // window sizes, -1 = unbounded (the right one 0 when causal); the logit softcap as in
    // FwdParams (softcap_scale = softmax_scale / softcap, and scale_log2 = softcap log2(e); 0 =
    // off; softmax.cuh's SoftcapSlope).
    int window_left;
    int window_right;
    float softcap_scale;
    // Packed sequences (varlen), null for a fixed-length batch: sequence b holds rows
    // cu_seqlens_q[b].. of q, out, dout, dq and the lse, and cu_seqlens_k[b].. of k, v, dk, dv
    // (the arrays' batch extent 1); its workspace rows start at its padded offset (BwdSeq), where
    // seqlen_q_rounded is the rows per head and row_padding the tile the offsets are rounded to.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int row_padding;
    // Attention sinks (one float32 logit per q head, natural log), null = none: the preprocess
    // writes each row's share of dL/dsink, -exp(sink - LSE) D, into dsink_rows (workspace rows,
    // zeroed), which the launcher sums per head.
    const float* sinks;
    float* dsink_rows;
    // The columns of q, k, dq, dk (head_dim) and of v, out, dout, dv (head_dim_v), as in
    // FwdParams; the workspace's dq_accum rows have the compiled head dim's.
    int head_dim;
    int head_dim_v;

    // The FP8 backward (BwdSm90Config::kFp8): q_map, k_map's e4m3 twin k8_map, v_map and
    // dout_map are e4m3 maps (boxes of head_dim bytes, up to 128, x the kernel's rows), k_map
    // the 16-bit K that dQ's GEMM reads; qt_map and doutt_map the transposed e4m3 Q and dO
    // (batch, heads_q, head_dim, rows padded to whole query tiles), each 32 rows in the key
    // order of transpose_e4m3.cuh, boxes of head_dim x the tile's rows. Descales as FwdParams'
    // (h the q head for q's and dout's, the kv head for k's and v's); dout's per 128 rows.
    TensorMap k8_map;
    TensorMap qt_map;
    TensorMap doutt_map;
    const float* q_descale;
    int64_t q_descale_stride_b, q_descale_stride_h, q_descale_stride_block;
    const float* k_descale;
    int64_t k_descale_stride_b, k_descale_stride_h, k_descale_stride_block;
    const float* v_descale;
    int64_t v_descale_stride_b, v_descale_stride_h;
    const float* dout_descale;
    int64_t dout_descale_stride_b, dout_descale_stride_h, dout_descale_stride_block;
};

}  // namespace ptxattn
