"""Launcher of the multi-head latent attention decode kernel (mma.sync),
``ptx_src/kernels/fwd_mla_mma_sync.cu``: DeepSeek-V3's and Kimi K2's decode step over one latent
cache row per token (576 columns, the first 512 also the values), contiguous or paged, of the
queries' dtype or e4m3, with the keys split over blocks as the decode kernel's are
(launchers/split_kv.py merges the partials).

A tile is 16 or 32 packed (token, head) rows of one sequence; its four warps split a stage's
keys for the scores and the 512 value columns for the output (mainloops/mla_mma_sync.cuh). A
stage of 64 latent rows is 72 KB (e4m3: 40 KB) and the ring holds two (four), so the kernel runs
where a block may have 201 KB of shared memory (``SMEM_PER_BLOCK``, ``ARCHS``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .. import archs, params, runtime
from .split_kv import launch_with_splits, serving_splits

HEAD_DIM = 576
HEAD_DIM_V = 512
HEAD_DIMS = (HEAD_DIM,)
DTYPES = {"bfloat16": 1, "float16": 0}
SOURCE = "kernels/fwd_mla_mma_sync.cu"


@dataclasses.dataclass(frozen=True)
class MlaTile:
    """Compile-time shape of one MLA variant (mainloops/mla_mma_sync.cuh)."""

    m_tiles: int       # 16-row groups of packed query rows per tile
    stages: int        # depth of the cp.async ring
    block_n: int = 64  # keys per ring stage; each of the warps scores block_n / warps of them
    warps: int = 4     # each owns HEAD_DIM_V / warps output columns
    min_blocks: int = 1

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    def smem_bytes(self, kv_fp8: bool, bf16: bool = True) -> int:
        row_bytes = HEAD_DIM * 2
        q_tile = self.rows * row_bytes
        p_tile = self.rows * self.block_n * 2
        exchange = self.warps * self.rows * 4
        staged_pages = 2 * self.stages * (self.block_n // 16 + 1) * 4  # kv_cache.cuh StagedPages
        row_scales = self.rows * 4 if kv_fp8 and bf16 else 0
        ring_offset = -(-(q_tile + p_tile + exchange + staged_pages + row_scales) // 128) * 128
        # an e4m3 row padded to whole 128-byte spans (smem_tile.cuh's E4m3Tile)
        row = -(-HEAD_DIM // 128) * 128 if kv_fp8 else row_bytes
        return ring_offset + self.stages * self.block_n * row

    def label(self) -> str:
        return f"m{self.m_tiles}_n{self.block_n}_w{self.warps}_s{self.stages}_b{self.min_blocks}"


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """The template arguments of ``MlaConfig`` (mainloops/mla_mma_sync.cuh), in its order."""

    head_dim: int
    head_dim_v: int
    m_tiles: int
    block_n: int
    warps: int
    stages: int
    bf16: bool
    kv_fp8: bool
    min_blocks_per_sm: int


# (kv_fp8, m_tiles) -> tile: a 16-bit ring holds two 72 KB stages of 64 keys next to the Q
# tile, an e4m3 ring four 40 KB ones. (Stages of 32 keys, five of them, read 16 heads' 16-bit
# cache at 0.48-0.56 of copy bandwidth against 0.60-0.70 with these; H200, 2026-12-02.)
TILES = {(False, 1): MlaTile(1, 2), (False, 2): MlaTile(2, 2),
         (True, 1): MlaTile(1, 4), (True, 2): MlaTile(2, 4)}


# The shared memory a block needs: the largest tile's (201 KB), which rules out the 163 KB and
# 99 KB parts.
SMEM_PER_BLOCK = max(tile.smem_bytes(kv_fp8, bf16) for (kv_fp8, _), tile in TILES.items()
                     for bf16 in (True, False))
ARCHS = tuple(a for a in archs.running("portable")
              if archs.get(a).smem_per_block >= SMEM_PER_BLOCK)


def tile_for(rows: int, kv_fp8: bool) -> MlaTile:
    """The tile for a sequence of ``rows`` packed query rows (seqlen_q x heads_q): 16-row tiles
    only where one holds them all, so that more rows share each stage."""
    return TILES[(kv_fp8, 1 if rows <= 16 else 2)]


def spec(dtype: str, tile: MlaTile, kv_fp8: bool,
         archs: tuple[str, ...] = ARCHS) -> runtime.KernelSpec:
    config = MlaConfig(HEAD_DIM, HEAD_DIM_V, tile.m_tiles, tile.block_n, tile.warps, tile.stages,
                       bool(DTYPES[dtype]), kv_fp8, tile.min_blocks)
    return runtime.KernelSpec(
        name=f"fwd_mla_{dtype}{'_e4m3kv' if kv_fp8 else ''}_{tile.label()}",
        source=SOURCE,
        entry=f"ptxattn::attn_fwd_mla<ptxattn::MlaConfig<"
              f"{runtime.template_arguments(config)}>>",
        smem_bytes=tile.smem_bytes(kv_fp8, config.bf16),
        archs=archs,
    )


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, tile, kv_fp8) for dtype in DTYPES
            for (kv_fp8, _), tile in TILES.items()]


def serve(problem, q, k, v, out, lse, *, seqused_k=None, block_table=None, cu_seqlens_q=None,
          cu_seqlens_k=None, sinks=None, k_descale=None, v_descale=None) -> None:
    """MLA decode of ``problem`` (AttentionProblem.from_mla_decode) into ``out`` and ``lse``:
    q (batch, seqlen_q, heads_q, 576), k the latent cache (contiguous, or paged with
    block_table; of q's dtype, or uint8 e4m3 bytes with ``k_descale``, a quant.fp8.Descale per
    tensor or per sequence), v its first 512 columns (not read: the kernel takes V from k's
    rows), out (batch, seqlen_q, heads_q, 512). Prepared once per set of arrays and stream, as
    portable_decode.serve's launches are. Dispatch sends no packed sequences or sinks here
    (dispatch.MLA); the arguments exist for the Launcher protocol."""
    descale = k_descale.array if k_descale is not None else None
    optional = (seqused_k, block_table, descale)
    key = runtime.launch_key(
        (q, k, out, lse, *(x for x in optional if x is not None)),
        tuple(x is None for x in optional), problem.format, problem.kv_format, problem.batch,
        problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.causal,
        problem.softmax_scale, problem.num_splits,
        k_descale.stride_b if k_descale is not None else None)
    _launches.get(key, lambda: _prepare(problem, q, k, out, lse, seqused_k=seqused_k,
                                        block_table=block_table, k_descale=k_descale))()


_launches = runtime.LaunchCache()


def _prepare(problem, q, k, out, lse, *, seqused_k, block_table,
             k_descale) -> Callable[[], None]:
    arch = runtime.device_arch()
    kv_fp8 = problem.kv_format == "e4m3"
    rows = problem.seqlen_q * problem.heads_q
    tile = tile_for(rows, kv_fp8)
    kernel = runtime.load(spec(problem.format, tile, kv_fp8, (arch,)))
    m_blocks = math.ceil(rows / tile.rows)
    splits = serving_splits(problem, m_blocks * problem.batch,
                            max(1, math.ceil(problem.seqlen_k / tile.block_n)), tile.min_blocks)
    scale_log2, _ = params.score_scales(problem.softmax_scale, 0.0)
    p = params.FwdParams(
        q=q, k=k, v=k, out=out, lse=lse, batch=problem.batch, seqlen_q=problem.seqlen_q,
        seqlen_k=problem.seqlen_k, heads_q=problem.heads_q, heads_kv=1,
        q_per_kv=problem.heads_q, scale_log2=scale_log2, causal=int(problem.causal),
        window_left=-1, window_right=-1, total_q=problem.total_q, num_splits=splits)
    params.set_strides(p, q, k, k[..., :HEAD_DIM_V], out, lse)
    if seqused_k is not None:
        p.seqused_k = seqused_k
    if kv_fp8:
        p.k_descale = k_descale.array
        p.k_descale_stride_b = k_descale.stride_b
    if block_table is not None:
        params.set_block_table(p, block_table, k)
    return launch_with_splits(kernel, p, (m_blocks * splits, 1, problem.batch), 32 * tile.warps,
                              splits, problem, HEAD_DIM_V, out, lse)
