"""Launcher of the portable kernels (mma.sync, sm_80+): the forward ``ptx_src/kernels/fwd_mma_sync.cu``
and the backward ``ptx_src/kernels/bwd_mma_sync.cu`` (between ptxattn/backward.py's pre- and
postprocess).

The kernel takes raw pointers and element strides, so any (batch, seqlen, heads) strides work
as long as rows are 16-byte aligned (ptxattn/problem.py checks that). Tiles are compile-time: one
:class:`Tile` per (head dim, causal) and shared-memory class, chosen by measurement on the H100
(see TILES). The 1-D grid runs the query blocks of one (batch, head) next to each other so that
they share K/V in L2.
"""

from __future__ import annotations

import dataclasses
import math

from . import archs, params, runtime
from . import backward as shared_backward

# The kernel needs only sm_80 features, so it runs on every architecture ptxattn knows.
ARCHS = archs.running("portable")
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
SOURCE = "kernels/fwd_mma_sync.cu"
BWD_SOURCE = "kernels/bwd_mma_sync.cu"


@dataclasses.dataclass(frozen=True)
class Tile:
    """Compile-time shape of one kernel variant."""

    block_m: int       # query rows per block
    block_n: int       # keys per K/V block
    warps: int         # each owns block_m / warps rows, a multiple of 16
    stages: int        # depth of the cp.async K/V ring
    min_blocks: int    # __launch_bounds__ minimum blocks per SM

    def smem_bytes(self, head_dim: int) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * head_dim * 2

    def label(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_w{self.warps}_s{self.stages}_b{self.min_blocks}"


# Where a block may have the 196 KB that head_dim 256's widest tile takes.
_LARGE_SMEM = tuple(a for a in ARCHS if archs.get(a).smem_per_block >= 196 * 1024)

# (head_dim, causal) -> [(archs, tile)], chosen with scripts/check_portable.py on the H100 (bf16,
# batch * seqlen = 8192-16384, seqlen 2048). A warp owning 32 rows halves K/V shared-memory
# reads against one owning 16, so 4-warp tiles of 128 rows win wherever O and S fit in 255
# registers without spills: for D=128 that caps S at 32 keys (64 keys measured 10% faster but
# spills). D=256 leaves room only for 16 rows per warp; its 196 KB non-causal tile is
# sm_90a-only.
TILES: dict[tuple[int, bool], list[tuple[tuple[str, ...], Tile]]] = {
    (64, False): [(ARCHS, Tile(128, 64, 4, 2, 2))],
    (64, True): [(ARCHS, Tile(128, 64, 4, 2, 2))],
    (128, False): [(ARCHS, Tile(128, 32, 4, 3, 2))],
    (128, True): [(ARCHS, Tile(128, 32, 4, 3, 2))],
    (256, False): [(_LARGE_SMEM, Tile(128, 64, 8, 2, 1)),
                   (tuple(a for a in ARCHS if a not in _LARGE_SMEM), Tile(64, 32, 4, 2, 2))],
    (256, True): [(ARCHS, Tile(64, 32, 4, 2, 2))],
}


def tile_for(head_dim: int, causal: bool, arch: str) -> Tile:
    for archs, tile in TILES[(head_dim, causal)]:
        if arch in archs:
            return tile
    raise runtime.PtxattnError(f"no portable tile for head_dim {head_dim} on {arch}")


def spec(dtype: str, head_dim: int, causal: bool, tile: Tile,
         archs: tuple[str, ...] = ARCHS) -> runtime.KernelSpec:
    config = (f"{head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.stages}, "
              f"{str(bool(DTYPES[dtype])).lower()}, {str(causal).lower()}, {tile.min_blocks}, "
              f"{tile.smem_bytes(head_dim)}")
    return runtime.KernelSpec(
        name=f"fwd_mma_sync_{dtype}_d{head_dim}_{tile.label()}{'_causal' if causal else ''}",
        source=SOURCE,
        entry=f"ptxattn::attn_fwd_mma_sync<ptxattn::MmaSyncConfig<{config}>>",
        smem_bytes=tile.smem_bytes(head_dim),
        archs=archs,
    )


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


_SMEM_163K = tuple(a for a in ARCHS if archs.get(a).smem_per_block >= 160 * 1024)
_SMEM_99K = tuple(a for a in ARCHS if a not in _SMEM_163K)
# Where red.global.add.v2.f32 exists (sm_90+): the dQ sums take half the instructions, and the
# widest tiles fit in 255 registers without spills; sm_80's scalar adds need smaller tiles.
_VECTOR_RED = tuple(a for a in _SMEM_163K if archs.get(a).capability >= (9, 0))
_SCALAR_RED_163K = tuple(a for a in _SMEM_163K if a not in _VECTOR_RED)

# (head_dim, causal) -> [(archs, tile)], chosen with .diag-style sweeps on the H100 (bf16,
# batch * seqlen = 16k, seqlen 2048 and 8192; docs/hopper-tuning.md has the numbers). dK and dV
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
# docs/hopper-tuning.md). Head dim 256 needs more shared memory than the 99 KB of sm_86/89/120
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
# (docs/hopper-tuning.md, session 38): head_dim 128 1.016-1.036, GQA 1.003-1.035; head_dim 64
# non-causal 1.015, causal 0.970-0.977 (its turns follow each other within a step or two);
# head_dim 256 1.004-1.014, but racecheck flags its waiting warp's named barrier then, and
# without that barrier 0.983-0.998.
DEFERRED_TURNS = {(128, False), (128, True), (64, False)}


def bwd_tile_for(head_dim: int, causal: bool, arch: str) -> BwdTile:
    for tile_archs, tile in BWD_TILES[(head_dim, causal)]:
        if arch in tile_archs:
            return tile
    raise ValueError(f"the portable backward does not run head_dim {head_dim} on {arch} (its "
                     f"{archs.get(arch).smem_per_block // 1024} KB of shared memory per block "
                     "is too little)")


def bwd_spec(dtype: str, head_dim: int, causal: bool, tile: BwdTile,
             archs: tuple[str, ...] = ARCHS, deferred_turns: bool = False) -> runtime.KernelSpec:
    """deferred_turns: the deterministic build that passes each dQ turn at the next step's
    barrier (DEFERRED_TURNS; elsewhere deterministic sums run in the default build, which passes
    each turn right after the adds)."""
    config = (f"{head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, {tile.score_rows}, "
              f"{tile.dkv_rows}, {tile.dq_rows}, {tile.stages}, "
              f"{str(tile.overlap_steps).lower()}, "
              f"{str(bool(DTYPES[dtype])).lower()}, {str(causal).lower()}, "
              f"{str(deferred_turns).lower()}, {tile.min_blocks}, {tile.smem_bytes(head_dim)}")
    return runtime.KernelSpec(
        name=(f"bwd_mma_sync_{dtype}_d{head_dim}_{tile.label()}{'_causal' if causal else ''}"
              f"{'_det' if deferred_turns else ''}"),
        source=BWD_SOURCE,
        entry=f"ptxattn::attn_bwd_mma_sync<ptxattn::BwdMmaSyncConfig<{config}>>",
        smem_bytes=tile.smem_bytes(head_dim),
        archs=archs,
    )


def _deferred_turns(head_dim: int, causal: bool, tile: BwdTile) -> bool:
    return tile.overlap_steps and (head_dim, causal) in DEFERRED_TURNS


def variants() -> list[runtime.KernelSpec]:
    fwd = [spec(dtype, head_dim, causal, tile, archs)
           for dtype in DTYPES for (head_dim, causal), tiles in TILES.items()
           for archs, tile in tiles]
    bwd = [bwd_spec(dtype, head_dim, causal, tile, archs, deferred_turns)
           for dtype in DTYPES for (head_dim, causal), tiles in BWD_TILES.items()
           for archs, tile in tiles
           for deferred_turns in ((False, True) if _deferred_turns(head_dim, causal, tile)
                                  else (False,))]
    return fwd + bwd


# The kernel forms a thread's offset within a load pass, (row < 32) * seq_stride, in 32 bits.
MAX_SEQ_STRIDE = 2 ** 26


_launches = runtime.LaunchCache()


def run(q, k, v, out, lse, *, causal: bool, softmax_scale: float, tile: Tile) -> None:
    """forward() with an explicit tile (benchmarks try tiles outside the table). Launches are
    prepared once per set of arrays, arguments and stream."""
    key = runtime.launch_key((q, k, v, out, lse), causal, softmax_scale, tile)
    _launches.get(key, lambda: _prepare(q, k, v, out, lse, causal=causal,
                                        softmax_scale=softmax_scale, tile=tile))()


def _prepare(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
             tile: Tile) -> runtime.PreparedLaunch:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.strides[1] // x.itemsize >= MAX_SEQ_STRIDE:
            raise ValueError(f"{name}'s seqlen stride must be below {MAX_SEQ_STRIDE} elements, "
                             f"got {x.strides[1] // x.itemsize}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    arch = runtime.device_arch()
    kernel = runtime.load(spec(str(q.dtype), head_dim, causal, tile, (arch,)))
    num_m_blocks = math.ceil(seqlen_q / tile.block_m)
    p = params.FwdParams(
        q=q, k=k, v=v, out=out, lse=lse, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        heads_q=heads_q, heads_kv=heads_kv, q_per_kv=heads_q // heads_kv,
        scale_log2=softmax_scale * math.log2(math.e), causal=int(causal),
        num_m_blocks=num_m_blocks, section_heads=1)
    params.set_strides(p, q, k, v, out, lse)
    return runtime.PreparedLaunch(kernel, grid=(num_m_blocks * batch * heads_q,),
                                  block=(32 * tile.warps,), args=[p])


def forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float) -> None:
    tile = tile_for(q.shape[3], causal, runtime.device_arch())
    run(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, tile=tile)


def backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic: bool,
             tile: BwdTile | None = None):
    """The gradients of forward() into dq, dk, dv; returns the workspace (for its size)."""
    arch = runtime.device_arch()
    tile = tile or bwd_tile_for(problem.head_dim, problem.causal, arch)
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if x.strides[1] // x.itemsize >= MAX_SEQ_STRIDE:
            raise ValueError(f"{name}'s seqlen stride must be below {MAX_SEQ_STRIDE} elements, "
                             f"got {x.strides[1] // x.itemsize}")
    padded_rows = problem.batch * problem.heads_q * shared_backward.rounded_rows(
        problem.seqlen_q, tile.block_m)
    if padded_rows >= 2 ** 31:  # the kernel indexes dpsum and lse_log2 in 32 bits
        raise ValueError(f"batch * heads * seqlen_q must be below 2**31 for the portable "
                         f"backward, got {padded_rows} (rows padded to whole tiles)")
    ws = shared_backward.Workspace.allocate(problem, tile.block_m, deterministic)
    p = shared_backward.make_params(problem, dout, q, k, v, out, lse, dq, dk, dv, ws,
                                      tile.block_m)
    if tile.overlap_steps:
        # boxes of a tile's rows x 64 columns (one 128-byte slab), coordinates (column, head,
        # row, batch); rows past seqlen_q arrive zero-filled
        box = (1, tile.block_m, 1, 64)
        p.q_map = runtime.tensor_map(q, box, swizzle=128)
        p.dout_map = runtime.tensor_map(dout, box, swizzle=128)
    kernel = runtime.load(bwd_spec(problem.format, problem.head_dim, problem.causal, tile,
                                   (arch,),
                                   deterministic and _deferred_turns(problem.head_dim,
                                                                     problem.causal, tile)))
    grid = (math.ceil(problem.seqlen_k / tile.block_n), problem.heads_kv, problem.batch)
    shared_backward.preprocess(problem, p)()
    runtime.PreparedLaunch(kernel, grid=grid, block=(32 * tile.warps,), args=[p])()
    shared_backward.postprocess(problem, p)()
    return ws

