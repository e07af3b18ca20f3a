"""Launcher of the portable backward kernel (mma.sync, sm_80+), ``ptx_src/kernels/bwd_mma_sync.cu``,
between the pre- and postprocess every backward family shares (launchers/backward_prepost.py).

Tiles are compile-time: one :class:`BwdTile` per (head dim, causal) and shared-memory class,
chosen by measurement on the H100 (see BWD_TILES).
"""

from __future__ import annotations

import dataclasses
import math

from .. import archs, runtime
from . import backward_prepost, kernel_head_dim
from .portable_forward import ARCHS, DTYPES, check_seq_strides

SOURCE = "kernels/bwd_mma_sync.cu"
HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class BwdTile:
    """Compile-time shape of one backward variant (mainloops/bwd_mma_sync.cuh): each phase
    spreads its GEMM's output over all warps as a grid of ``*_rows`` warp rows."""

    block_m: int       # query rows per tile
    block_n: int       # keys per block (the block's dK, dV rows)
    warps: int
    score_rows: int    # warp rows over S, dP (block_m x block_n)
    dkv_rows: int      # warp rows over dK, dV (block_n x head_dim)
    dq_rows: int       # warp rows over dQ (block_m x head_dim)
    stages: int        # depth of the (Q, dO) ring
    min_blocks: int
    # warps meet once a step instead of twice, the ring then filled by TMA and P and dS
    # double-buffered (sm_90+)
    overlap_steps: bool = False

    def smem_bytes(self, head_dim: int) -> int:
        """BwdMmaSyncConfig::kSmemBytes: K, V, the stages' Q and dO, P and dS (two of each with
        overlapping steps), the stages' row values (LSE, D), and with overlapping steps (Q and
        dO by TMA) the stages' mbarriers and the slack for aligning the base to 1024 bytes."""
        score_buffers = 2 if self.overlap_steps else 1
        return ((2 * self.block_n * head_dim + self.stages * 2 * self.block_m * head_dim
                 + score_buffers * 2 * self.block_m * self.block_n) * 2
                + self.stages * 2 * self.block_m * 4
                + (self.stages * 8 + 1024 - 16 if self.overlap_steps else 0))

    def label(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_w{self.warps}_g{self.score_rows}"
                f"{self.dkv_rows}{self.dq_rows}_s{self.stages}_b{self.min_blocks}"
                + ("_o" if self.overlap_steps else ""))


@dataclasses.dataclass(frozen=True)
class BwdMmaSyncConfig:
    """The template arguments of ``BwdMmaSyncConfig`` (mainloops/bwd_mma_sync.cuh), in its
    order."""

    head_dim: int
    block_m: int
    block_n: int
    warps: int
    score_warp_rows: int
    dkv_warp_rows: int
    dq_warp_rows: int
    stages: int
    overlap_steps: bool
    bf16: bool
    causal: bool
    deferred_turns: bool
    options: bool  # the options build: window, softcap, packed sequences
    min_blocks_per_sm: int
    smem_bytes: int


_SMEM_163K = tuple(a for a in ARCHS if archs.get(a).smem_per_block >= 160 * 1024)
_SMEM_99K = tuple(a for a in ARCHS if a not in _SMEM_163K)
# Where red.global.add.v2.f32 exists (sm_90+): the dQ sums take half the instructions, and the
# widest tiles fit in 255 registers without spills; sm_80's scalar adds need smaller tiles.
_VECTOR_RED = tuple(a for a in _SMEM_163K if archs.get(a).capability >= (9, 0))
_SCALAR_RED_163K = tuple(a for a in _SMEM_163K if a not in _VECTOR_RED)

# (head_dim, causal) -> [(archs, tile)], chosen with .diag-style sweeps on the H100 (bf16,
# batch * seqlen = 16k, seqlen 2048 and 8192; docs/design/backward.md#portable-warp-grids has the
# numbers). dK and dV
# live in registers: 8 warps over 128 keys x 128 columns is 128 floats a thread, the most that
# leaves room for S and dP, and 128-key blocks halve the dQ atomics per FLOP against 64-key ones
# (the kernel is bound by them and by shared-memory wavefronts). The warp grids are the ones that
# read the least shared memory without spilling: a GEMM spread over r x c warps reads its A
# operand c times and its B operand r times, so the grid follows the operands' sizes (head_dim
# 128: 4 x 2 warps over dK and dV, where 8 x 1 read 72K instead of 48K elements a step each,
# and FlashAttention-2's 2 x 4 over the scores and dQ, 288K elements a step in all against 4 x 2's
# 336K, which fits 255 registers since the walk is a cursor: 1.02-1.06x; head_dim 256: 4 x 2
# over the scores, 2 x 4 over dK, dV and dQ, with a second (Q, dO) stage, sm_90+). On sm_90+
# the (Q, dO) ring has a third stage at head_dim 128 (its TMA then leads by a step and a half:
# 1.00-1.03x) and P and dS are double-buffered (mainloops/bwd_mma_sync.cuh): the tiles then take
# 232,448 (head_dim 64, all a block may have, so the kernel must keep no static shared memory),
# 231,944 and 231,424 bytes.
# The smaller tiles of sm_80 and the 99 KB archs were timed on the H100 only (its vector adds;
# docs/design/backward.md#portable-warp-grids). Head dim 256 needs more shared memory than the
# 99 KB of sm_86/89/120
# allow for any tile of whole mma fragments.
# Causal head_dim 256 on sm_90+ keeps dQ over 4 x 2 warps: its 2 x 4 spills with the
# deterministic sums' named barriers (BwdMmaSyncConfig::kTurnWarpAlone), and measured 0.98-1.00x
# of it by default, 1.03-1.04x deterministic.
_BWD_TILES_BOTH_MASKS: dict[int, list[tuple[tuple[str, ...], BwdTile]]] = {
    64: [(_VECTOR_RED, BwdTile(128, 128, 8, 2, 4, 4, 2, 1, True)),
         (_SCALAR_RED_163K + _SMEM_99K, BwdTile(64, 128, 8, 2, 4, 2, 2, 1))],
    128: [(_VECTOR_RED, BwdTile(64, 128, 8, 2, 4, 2, 3, 1, True)),
          (_SCALAR_RED_163K, BwdTile(64, 64, 8, 4, 2, 2, 2, 1)),
          (_SMEM_99K, BwdTile(64, 64, 8, 4, 2, 2, 1, 1))],
}
BWD_TILES: dict[tuple[int, bool], list[tuple[tuple[str, ...], BwdTile]]] = {
    **{(head_dim, causal): tiles for head_dim, tiles in _BWD_TILES_BOTH_MASKS.items()
       for causal in (False, True)},
    (256, False): [(_VECTOR_RED, BwdTile(64, 64, 8, 4, 2, 2, 2, 1, True)),
                   (_SCALAR_RED_163K, BwdTile(64, 64, 8, 4, 2, 4, 1, 1))],
    (256, True): [(_VECTOR_RED, BwdTile(64, 64, 8, 4, 2, 4, 2, 1, True)),
                  (_SCALAR_RED_163K, BwdTile(64, 64, 8, 4, 2, 4, 1, 1))],
}


# Where deterministic sums pass each dQ turn at the next step's barrier (a build of its own,
# tiles with overlapping steps only): bwd_mma_sync.cu. Against passing it after the adds
# (H100 SXM, 2026-11-27; docs/design/backward.md#portable-deterministic-mode): head_dim 128
# 1.016-1.036, GQA 1.003-1.035; head_dim 64
# non-causal 1.015, causal 0.970-0.977 (its turns follow each other within a step or two);
# head_dim 256 1.004-1.014, but racecheck flags its waiting warp's named barrier then, and
# without that barrier 0.983-0.998.
DEFERRED_TURNS = {(128, False), (128, True), (64, False)}


HEAD_DIMS = tuple(sorted({head_dim for head_dim, _ in BWD_TILES}))


def tile_for(head_dim: int, causal: bool, arch: str) -> BwdTile:
    """The tile of a call of ``head_dim`` columns (run on the compiled head dim that holds
    them)."""
    for tile_archs, tile in BWD_TILES[(kernel_head_dim(HEAD_DIMS, head_dim), causal)]:
        if arch in tile_archs:
            return tile
    raise ValueError(f"the portable backward does not run head_dim {head_dim} on {arch} (its "
                     f"{archs.get(arch).smem_per_block // 1024} KB of shared memory per block "
                     "is too little)")


def spec(dtype: str, head_dim: int, causal: bool, tile: BwdTile,
         archs: tuple[str, ...] = ARCHS, deferred_turns: bool = False,
         options: bool = False) -> runtime.KernelSpec:
    """deferred_turns: the deterministic build that passes each dQ turn at the next step's
    barrier (DEFERRED_TURNS; elsewhere deterministic sums run in the default build, which passes
    each turn right after the adds). options: the build that takes a window, a softcap and
    packed sequences."""
    config = BwdMmaSyncConfig(head_dim, tile.block_m, tile.block_n, tile.warps, tile.score_rows,
                              tile.dkv_rows, tile.dq_rows, tile.stages, tile.overlap_steps,
                              bool(DTYPES[dtype]), causal, deferred_turns, options,
                              tile.min_blocks, tile.smem_bytes(head_dim))
    return runtime.KernelSpec(
        name=(f"bwd_mma_sync_{dtype}_d{head_dim}_{tile.label()}{'_causal' if causal else ''}"
              f"{'_det' if deferred_turns else ''}{'_opt' if options else ''}"),
        source=SOURCE,
        entry=f"ptxattn::attn_bwd_mma_sync<ptxattn::BwdMmaSyncConfig<"
              f"{runtime.template_arguments(config)}>>",
        smem_bytes=config.smem_bytes,
        archs=archs,
    )


def _deferred_turns(head_dim: int, causal: bool, tile: BwdTile) -> bool:
    return tile.overlap_steps and (head_dim, causal) in DEFERRED_TURNS


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, head_dim, causal, tile, tile_archs, deferred_turns, options)
            for dtype in DTYPES for (head_dim, causal), tiles in BWD_TILES.items()
            for tile_archs, tile in tiles
            for deferred_turns in ((False, True) if _deferred_turns(head_dim, causal, tile)
                                   else (False,))
            for options in (False, True)]


def backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic: bool,
             cu_seqlens_q=None, cu_seqlens_k=None, sinks=None, tile: BwdTile | None = None):
    """The gradients of the forward into dq, dk, dv; returns the workspace (for its size and
    the sinks' gradient). Arrays are 4-d, packed sequences as views of batch extent 1 with their
    cu_seqlens; the window, softcap and sinks are the problem's."""
    arch = runtime.device_arch()
    head_dim = kernel_head_dim(HEAD_DIMS, problem.head_dim)
    tile = tile or tile_for(head_dim, problem.causal, arch)
    check_seq_strides(q=q, k=k, v=v, dout=dout)
    sets, rows = backward_prepost.workspace_rows(problem, tile.block_m)
    if sets * rows >= 2 ** 31:  # the kernel's row indices are 32-bit within a (batch, head)
        raise ValueError(f"batch * heads * seqlen_q must be below 2**31 for the portable "
                         f"backward, got {sets * rows} (rows padded to whole tiles)")
    ws = backward_prepost.Workspace.allocate(problem, tile.block_m, deterministic, head_dim)
    p = backward_prepost.make_params(problem, dout, q, k, v, out, lse, dq, dk, dv, ws,
                                     tile.block_m, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    if tile.overlap_steps:
        # boxes of a tile's rows x 64 columns (one 128-byte slab), coordinates (column, head,
        # row, batch); rows past seqlen_q arrive zero-filled
        box = (1, tile.block_m, 1, 64)
        p.q_map = runtime.tensor_map(q, box, swizzle=128)
        p.dout_map = runtime.tensor_map(dout, box, swizzle=128)
    kernel = runtime.load(spec(problem.format, head_dim, problem.causal, tile, (arch,),
                               deterministic and _deferred_turns(head_dim, problem.causal, tile),
                               backward_prepost.takes_options(problem)))
    grid = (math.ceil(problem.seqlen_k / tile.block_n), problem.heads_kv, problem.batch)
    main = (runtime.PreparedLaunch(kernel, grid=grid, block=(32 * tile.warps,), args=[p])
            if grid[0] > 0 else None)
    backward_prepost.run(problem, p, main, ws)
    return ws
