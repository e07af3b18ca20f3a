"""Split-KV: the keys of each query tile spread over several blocks, and the merge of their
partial states by ``ptx_src/kernels/combine.cu`` (also ``ptxattn.merge_attention_states`` and
the ring steps of ptxattn.distributed).

How many splits fill the GPU (:func:`choose_splits`, :func:`splits_one_wave`), the partials'
buffers (:func:`split_accumulators`), and the merge (:func:`combine`): the serving launchers of
both families split their keys this way.
"""

from __future__ import annotations

import dataclasses
import math

from .. import archs, params, runtime

ARCHS = archs.running("portable")
SOURCE = "kernels/combine.cu"
# combine.cu's format codes
FORMATS = {"float16": 0, "bfloat16": 1, "float32": 2}
COMBINE_WARPS = 4  # rows per combine block, one warp each
MAX_SPLITS = 128


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """The template arguments of ``combine_states`` (combine.cu): the formats of the parts and
    of the output."""

    part_format: int
    out_format: int


def combine_spec(part_dtype: str, out_dtype: str,
                 archs: tuple[str, ...] = ARCHS) -> runtime.KernelSpec:
    config = CombineConfig(FORMATS[part_dtype], FORMATS[out_dtype])
    return runtime.KernelSpec(
        name=f"combine_{part_dtype}_to_{out_dtype}", source=SOURCE,
        entry=f"ptxattn::combine_states<{runtime.template_arguments(config)}>", archs=archs)


# (part dtype, output dtype) pairs: the split-KV path's float32 partials into the output's
# dtype, and merge_attention_states, which keeps its parts' dtype.
COMBINE_PAIRS = (("float32", "bfloat16"), ("float32", "float16"), ("float32", "float32"),
                 ("bfloat16", "bfloat16"), ("float16", "float16"))


def variants() -> list[runtime.KernelSpec]:
    return [combine_spec(part, out) for part, out in COMBINE_PAIRS]


def choose_splits(tiles: int, key_blocks: int, slots: int) -> int:
    """How many blocks share the keys of each of ``tiles`` (query tile, kv head, sequence)
    tiles, given ``key_blocks`` key blocks per tile and ``slots`` blocks resident at once (SMs
    times blocks per SM): 1 when the tiles fill most slots; else the fewest splits whose waves
    are at least 85% as full as the best count's (FlashAttention's rule), no split holding less
    than one block. (One-token decode with few tiles counts one block an SM instead,
    splits_one_wave: this rule counted that way read 2918 and then 2053 GB/s at batch 8 x 32768
    on an H100 SXM, 2026-11-24, and the one-wave count 2896-2970 in four runs, 2026-11-25;
    docs/design/serving.md#decode-split-counts.)"""
    if tiles >= 0.8 * slots or key_blocks <= 1:
        return 1
    candidates = range(1, min(MAX_SPLITS, key_blocks) + 1)

    def efficiency(splits: int) -> float:
        waves = tiles * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


def splits_one_wave(tiles: int, key_blocks: int, sms: int) -> int:
    """Splits for tiles of one token's query rows, at most ``sms`` / 2 tiles: as many as keep
    all blocks in one wave of one block an SM. Such a block reads at memory speed alone, and an
    SM holding more blocks than another finishes later: on the H100 (32/8 heads, head_dim 128)
    batch 8 x 32768 keys read 2896-2970 GB/s at 2 splits (128 blocks) against 2810-2881 at 4
    (two an SM), batch 1 x 131072 2628-2803 at 16 (128 blocks) against 2574-2698 at 15.
    (Between sms / 2 and sms tiles it would leave SMs idle; the launcher takes choose_splits
    there.)"""
    return max(1, min(MAX_SPLITS, key_blocks, sms // tiles))


def serving_splits(problem, tiles: int, key_blocks: int, blocks_per_sm: int) -> int:
    """The split count of a serving kernel's launch (the decode and MLA kernels): ``tiles``
    (query tile, kv head, sequence) tiles of ``key_blocks`` key blocks each, ``blocks_per_sm``
    resident at once on an SM. problem.num_splits if given; one token a sequence with its tiles
    at most half the SMs: one wave of one block an SM (splits_one_wave), over contiguous and
    paged caches alike; otherwise whole waves of resident blocks (choose_splits): chunks of
    queries need a second block an SM to hide their query work (one an SM, 16 and 64 tokens over
    16k lost 35-40% on the H100), and so do tiles that could not fill the GPU taking two SMs
    each. Never more splits than key blocks."""
    sms = runtime.sm_count(problem.device)
    if problem.num_splits:
        splits = problem.num_splits
    elif problem.seqlen_q == 1 and 2 * tiles <= sms:
        splits = splits_one_wave(tiles, key_blocks, sms)
    else:
        splits = choose_splits(tiles, key_blocks, sms * blocks_per_sm)
    return min(splits, key_blocks)


@dataclasses.dataclass(frozen=True)
class SplitLaunch:
    """A split-KV launch and the merge of its partials, holding the partials' buffers: prepared
    launches keep only addresses, so without this reference a cached launch would write into
    memory the pool had handed to someone else."""
    attend: runtime.PreparedLaunch
    merge: runtime.PreparedLaunch
    accum: tuple

    def __call__(self) -> None:
        self.attend()
        self.merge()


def launch_with_splits(kernel, p, grid, threads: int, splits: int, problem, head_dim: int, out,
                       lse, sinks=None, packed: bool = False):
    """A serving kernel's prepared launch of FwdParams ``p`` and, with ``splits`` > 1, its
    partials' buffers (set into p, dense over problem.total_q rows of ``head_dim`` columns) and
    their merge into out and lse (a SplitLaunch)."""
    accum = None
    if splits > 1:
        accum = split_accumulators(splits, problem.total_q, problem.heads_q, head_dim)
        p.out_accum, p.lse_accum = accum
    attend = runtime.PreparedLaunch(kernel, grid=grid, block=(threads,), args=[p])
    if accum is None:
        return attend
    return SplitLaunch(attend, prepare_combine_splits(accum, out, lse, sinks, problem.batch,
                                                      problem.seqlen_q, packed=packed), accum)


def split_accumulators(splits: int, total_q: int, heads_q: int, head_dim: int):
    """The float32 partial outputs and LSEs of a split-KV launch, dense [split][total_q][heads_q]
    [head_dim] and [split][heads_q][total_q] (FwdParams::out_accum, lse_accum)."""
    import cupy
    return (cupy.empty((splits, total_q, heads_q, head_dim), dtype=cupy.float32),
            cupy.empty((splits, heads_q, total_q), dtype=cupy.float32))


def combine_splits(accum, out, lse, sinks, batch: int, seqlen_q: int, packed: bool) -> None:
    """out, lse <- the merge of a split-KV launch's partials (split_accumulators); ``packed``:
    the rows are a varlen batch's (out (1, total_q, heads_q, D)), else (batch, seqlen_q)."""
    prepare_combine_splits(accum, out, lse, sinks, batch, seqlen_q, packed)()


def prepare_combine_splits(accum, out, lse, sinks, batch: int, seqlen_q: int,
                           packed: bool) -> runtime.PreparedLaunch:
    """combine_splits, prepared: the launch, to run as often as the partials are refilled."""
    parts, lse_parts = accum
    splits, _, heads_q, head_dim = parts.shape
    # the partials as (part, batch, seqlen, heads, D) and (part, batch, heads, seqlen)
    if packed:
        parts = parts[:, None]
        lse_parts = lse_parts[:, None]
    else:
        parts = parts.reshape(splits, batch, seqlen_q, heads_q, head_dim)
        lse_parts = lse_parts.reshape(splits, heads_q, batch, seqlen_q).transpose(0, 2, 1, 3)
    # the partials' rows have the kernel's compiled head dim; out's columns are those merged
    return prepare_combine(parts[..., :out.shape[-1]], lse_parts, out, lse, sinks)


def combine(parts, lse_parts, out, lse, sinks=None) -> None:
    """out, lse <- the merge of parts (P, B, S, H, D) and lse_parts (P, B, H, S) (combine.cu);
    lse may be None."""
    prepare_combine(parts, lse_parts, out, lse, sinks)()


def prepare_combine(parts, lse_parts, out, lse, sinks=None) -> runtime.PreparedLaunch:
    """combine, prepared."""
    num_parts, batch, seqlen, heads, head_dim = parts.shape
    kernel = runtime.load(combine_spec(str(parts.dtype), str(out.dtype),
                                       (runtime.device_arch(),)))
    p = params.CombineParams(parts=parts, lse_parts=lse_parts, out=out,
                             lse=lse if lse is not None else 0,
                             sinks=sinks if sinks is not None else 0, num_parts=num_parts,
                             batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim)
    (p.parts_stride_p, p.parts_stride_b, p.parts_stride_s,
     p.parts_stride_h) = params.strides(parts, 4)
    (p.lse_parts_stride_p, p.lse_parts_stride_b, p.lse_parts_stride_h,
     p.lse_parts_stride_s) = params.strides(lse_parts, 4)
    (p.out_stride_b, p.out_stride_s, p.out_stride_h) = params.strides(out)
    if lse is not None:
        (p.lse_stride_b, p.lse_stride_h, p.lse_stride_s) = params.strides(lse)
    rows = batch * seqlen * heads
    return runtime.PreparedLaunch(kernel, grid=(math.ceil(rows / COMBINE_WARPS),),
                                  block=(32 * COMBINE_WARPS,), args=[p])
