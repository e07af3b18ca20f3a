"""Launcher of the portable serving kernel (mma.sync, sm_80+),
``ptx_src/kernels/fwd_decode_mma_sync.cu``: attention over a KV cache (contiguous or paged) or a
varlen batch, with the query heads of a kv head packed in one tile and the keys split over
blocks, whose partial states launchers/split_kv.py merges. Caches hold the queries' dtype or
e4m3 (FP8), the latter dequantized in the kernel.

The decode kernel's cost is reading K and V; its warps split each stage's keys, so a tile needs
only as many query rows as one token's GQA group. The split count is chosen so that the grid
fills the GPU in whole waves (split_kv.serving_splits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .. import archs, params, runtime
from . import kernel_head_dim
from .split_kv import launch_with_splits, serving_splits

ARCHS = archs.running("portable")
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
SOURCE = "kernels/fwd_decode_mma_sync.cu"


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """Compile-time shape of one decode variant (mainloops/decode_mma_sync.cuh)."""

    block_n: int       # keys per ring stage; each warp scores block_n / warps of them
    warps: int
    stages: int        # depth of the cp.async K/V ring
    min_blocks: int    # __launch_bounds__ minimum blocks per SM
    m_tiles: int = 1   # 16-row groups of packed query rows per tile

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    def smem_bytes(self, head_dim: int, kv_fp8: bool = False, bf16: bool = True) -> int:
        ring = self.stages * 2 * self.block_n * head_dim * (1 if kv_fp8 else 2)
        merge = 2 * self.warps * self.rows * 4 + self.warps * self.rows * head_dim * 4
        staged_pages = 2 * self.stages * (self.block_n // 16 + 1) * 4  # kv_cache.cuh StagedPages
        row_scales = self.rows * 4 if kv_fp8 and bf16 else 0  # decode_mma_sync.cuh
        return self.rows * head_dim * 2 + max(ring, merge) + staged_pages + row_scales

    def label(self) -> str:
        return (f"m{self.m_tiles}_n{self.block_n}_w{self.warps}_s{self.stages}"
                f"_b{self.min_blocks}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The template arguments of ``DecodeConfig`` (mainloops/decode_mma_sync.cuh), in its
    order."""

    head_dim: int
    m_tiles: int
    block_n: int
    warps: int
    stages: int
    bf16: bool
    kv_fp8: bool
    min_blocks_per_sm: int


_SMEM_200K = tuple(a for a in ARCHS if archs.get(a).smem_per_block >= 200 * 1024)
_SMEM_163K = tuple(a for a in ARCHS if 160 * 1024 <= archs.get(a).smem_per_block < 200 * 1024)
_SMEM_99K = tuple(a for a in ARCHS if archs.get(a).smem_per_block < 160 * 1024)

# head_dim -> [(archs, tile)]: 64-key stages over 4 warps, and as deep a ring as two blocks per
# SM (one for head_dim 256) leave room for. On the H100 (head_dim 128, 32/8 heads) this tile
# read 3015 and 2918 GB/s at batch 64 x 8192 and 8 x 32768 keys; 128-key stages over 8 warps
# 3028 and 2881, 2-warp and 2-stage tiles 2-8% less (docs/design/serving.md#split-kv-decode).
TILES: dict[int, list[tuple[tuple[str, ...], DecodeTile]]] = {
    64: [(_SMEM_200K + _SMEM_163K, DecodeTile(64, 4, 4, 2)), (_SMEM_99K, DecodeTile(64, 4, 3, 2))],
    128: [(_SMEM_200K, DecodeTile(64, 4, 3, 2)), (_SMEM_163K, DecodeTile(64, 4, 4, 1)),
          (_SMEM_99K, DecodeTile(64, 4, 2, 1))],
    256: [(_SMEM_200K + _SMEM_163K, DecodeTile(64, 4, 2, 1)), (_SMEM_99K, DecodeTile(32, 2, 2, 1))],
}


# e4m3 caches: an e4m3 stage is half a 16-bit one, so the same shared memory holds a ring twice
# as deep. (Three blocks an SM of four stages each read within the noise of this at head_dim
# 128: 2971 against 2850 GB/s; docs/design/serving.md#fp8-caches.)
FP8_TILES: dict[int, list[tuple[tuple[str, ...], DecodeTile]]] = {
    head_dim: [(tile_archs, dataclasses.replace(tile, stages=2 * tile.stages))
               for tile_archs, tile in tiles]
    for head_dim, tiles in TILES.items()}

HEAD_DIMS = tuple(sorted(TILES))


def tile_for(head_dim: int, arch: str, kv_fp8: bool = False) -> DecodeTile:
    """The tile of a call of ``head_dim`` columns (run on the compiled head dim that holds
    them), over a cache of the queries' dtype or (``kv_fp8``) an e4m3 one."""
    for tile_archs, tile in (FP8_TILES if kv_fp8 else TILES)[kernel_head_dim(HEAD_DIMS,
                                                                             head_dim)]:
        if arch in tile_archs:
            return tile
    raise runtime.PtxattnError(f"no decode tile for head_dim {head_dim} on {arch}")


def spec(dtype: str, head_dim: int, tile: DecodeTile, archs: tuple[str, ...] = ARCHS,
         kv_fp8: bool = False) -> runtime.KernelSpec:
    config = DecodeConfig(head_dim, tile.m_tiles, tile.block_n, tile.warps, tile.stages,
                          bool(DTYPES[dtype]), kv_fp8, tile.min_blocks)
    return runtime.KernelSpec(
        name=f"fwd_decode_{dtype}{'_e4m3kv' if kv_fp8 else ''}_d{head_dim}_{tile.label()}",
        source=SOURCE,
        entry=f"ptxattn::attn_fwd_decode<ptxattn::DecodeConfig<"
              f"{runtime.template_arguments(config)}>>",
        smem_bytes=tile.smem_bytes(head_dim, kv_fp8, config.bf16),
        archs=archs,
    )


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, head_dim, tile, tile_archs, kv_fp8)
            for kv_fp8, table in ((False, TILES), (True, FP8_TILES))
            for dtype in DTYPES for head_dim, tiles in table.items()
            for tile_archs, tile in tiles]


def key_blocks(problem, tile: DecodeTile) -> int:
    return max(1, math.ceil(problem.seqlen_k / tile.block_n))


def serve(problem, q, k, v, out, lse, *, seqused_k=None, block_table=None, cu_seqlens_q=None,
          cu_seqlens_k=None, sinks=None, k_descale=None, v_descale=None,
          tile: DecodeTile | None = None) -> None:
    """Attention of ``problem`` (an AttentionProblem from the kv-cache or varlen constructors)
    into ``out`` and ``lse``. q and out are (batch, seqlen_q, heads_q, D) and lse (batch,
    heads_q, seqlen_q), or with cu_seqlens_q (1, total_q, heads_q, D) and (1, heads_q, total_q);
    k, v the caches (kv_cache.cuh): of q's dtype, or uint8 arrays of e4m3 bytes with
    ``k_descale`` and ``v_descale`` (quant.fp8.Descale, per tensor or per (batch, kv head)) when
    problem.kv_format is "e4m3". The launches (and the split partials' buffers) are prepared
    once per set of arrays and stream, as hopper_forward.serve's are: the kernel reads the
    lengths, tables and offsets when it runs."""
    descales = tuple(d.array for d in (k_descale, v_descale) if d is not None)
    optional = (seqused_k, block_table, cu_seqlens_q, cu_seqlens_k, sinks, *descales)
    key = runtime.launch_key(
        (q, k, v, out, lse, *(x for x in optional if x is not None)),
        tuple(x is None for x in optional), tile, problem.format, problem.batch,
        problem.seqlen_q, problem.seqlen_k, problem.total_q, problem.heads_q, problem.heads_kv,
        problem.head_dim, problem.causal, problem.window, problem.softcap, problem.softmax_scale,
        problem.num_splits, problem.kv_format, problem.head_dim_v,
        tuple((d.stride_b, d.stride_h) for d in (k_descale, v_descale) if d is not None))
    _launches.get(key, lambda: _prepare(problem, q, k, v, out, lse, seqused_k=seqused_k,
                                        block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, sinks=sinks,
                                        k_descale=k_descale, v_descale=v_descale, tile=tile))()


_launches = runtime.LaunchCache()


def _prepare(problem, q, k, v, out, lse, *, seqused_k, block_table, cu_seqlens_q, cu_seqlens_k,
             sinks, k_descale, v_descale, tile: DecodeTile | None) -> Callable[[], None]:
    arch = runtime.device_arch()
    head_dim = kernel_head_dim(HEAD_DIMS, problem.head_dim)
    kv_fp8 = problem.kv_format == "e4m3"
    tile = tile or tile_for(head_dim, arch, kv_fp8)
    kernel = runtime.load(spec(problem.format, head_dim, tile, (arch,), kv_fp8))
    m_blocks = math.ceil(problem.seqlen_q * problem.gqa_ratio / tile.rows)
    if m_blocks == 0:
        return lambda: None  # no query rows (varlen with max_seqlen_q 0)
    splits = serving_splits(problem, m_blocks * problem.heads_kv * problem.batch,
                            key_blocks(problem, tile), tile.min_blocks)
    scale_log2, softcap_scale = params.score_scales(problem.softmax_scale, problem.softcap)
    p = params.FwdParams(
        q=q, k=k, v=v, out=out, lse=lse, batch=problem.batch, seqlen_q=problem.seqlen_q,
        seqlen_k=problem.seqlen_k, heads_q=problem.heads_q, heads_kv=problem.heads_kv,
        q_per_kv=problem.gqa_ratio, scale_log2=scale_log2, causal=int(problem.causal),
        window_left=problem.window[0], window_right=problem.window[1],
        total_q=problem.total_q, num_splits=splits,
        softcap_scale=softcap_scale)
    params.set_strides(p, q, k, v, out, lse)
    for name, value in (("seqused_k", seqused_k), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k), ("sinks", sinks)):
        if value is not None:
            setattr(p, name, value)
    if cu_seqlens_q is not None:
        # rows are located from cu_seqlens_q (SeqLens), not from the sequence index
        p.q_stride_b = p.out_stride_b = p.lse_stride_b = 0
    if kv_fp8:
        p.k_descale, p.v_descale = k_descale.array, v_descale.array
        p.k_descale_stride_b, p.k_descale_stride_h = k_descale.stride_b, k_descale.stride_h
        p.v_descale_stride_b, p.v_descale_stride_h = v_descale.stride_b, v_descale.stride_h
    if block_table is not None:
        params.set_block_table(p, block_table, k)
    return launch_with_splits(kernel, p, (m_blocks * splits, problem.heads_kv, problem.batch),
                              32 * tile.warps, splits, problem, head_dim, out, lse, sinks,
                              packed=cu_seqlens_q is not None)
