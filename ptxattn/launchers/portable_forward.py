"""Launcher of the portable forward kernel (mma.sync, sm_80+), ``ptx_src/kernels/fwd_mma_sync.cu``.

The kernel takes raw pointers and element strides, so any (batch, seqlen, heads) strides work
as long as rows are 16-byte aligned (ptxattn/problem checks that). Tiles are compile-time: one
:class:`Tile` per (head dim, causal) and shared-memory class, chosen by measurement on the H100
(see TILES). The 1-D grid runs the query blocks of one (batch, head) next to each other so that
they share K/V in L2.
"""

from __future__ import annotations

import dataclasses
import math

from .. import archs, params, runtime
from . import kernel_head_dim

# The kernel needs only sm_80 features, so it runs on every architecture ptxattn knows.
ARCHS = archs.running("portable")
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
SOURCE = "kernels/fwd_mma_sync.cu"


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


@dataclasses.dataclass(frozen=True)
class MmaSyncConfig:
    """The template arguments of ``MmaSyncConfig`` (mainloops/fwd_mma_sync.cuh), in its order."""

    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    bf16: bool
    causal: bool
    min_blocks_per_sm: int
    smem_bytes: int


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


HEAD_DIMS = tuple(sorted({head_dim for head_dim, _ in TILES}))


def tile_for(head_dim: int, causal: bool, arch: str) -> Tile:
    """The tile of a call of ``head_dim`` columns (run on the compiled head dim that holds
    them)."""
    for tile_archs, tile in TILES[(kernel_head_dim(HEAD_DIMS, head_dim), causal)]:
        if arch in tile_archs:
            return tile
    raise runtime.PtxattnError(f"no portable tile for head_dim {head_dim} on {arch}")


def spec(dtype: str, head_dim: int, causal: bool, tile: Tile,
         archs: tuple[str, ...] = ARCHS) -> runtime.KernelSpec:
    config = MmaSyncConfig(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                           bool(DTYPES[dtype]), causal, tile.min_blocks,
                           tile.smem_bytes(head_dim))
    return runtime.KernelSpec(
        name=f"fwd_mma_sync_{dtype}_d{head_dim}_{tile.label()}{'_causal' if causal else ''}",
        source=SOURCE,
        entry=f"ptxattn::attn_fwd_mma_sync<ptxattn::MmaSyncConfig<"
              f"{runtime.template_arguments(config)}>>",
        smem_bytes=config.smem_bytes,
        archs=archs,
    )


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, head_dim, causal, tile, tile_archs)
            for dtype in DTYPES for (head_dim, causal), tiles in TILES.items()
            for tile_archs, tile in tiles]


# The kernel forms a thread's offset within a load pass, (row < 32) * seq_stride, in 32 bits.
MAX_SEQ_STRIDE = 2 ** 26


def check_seq_strides(**arrays) -> None:
    """Refuses arrays whose seqlen stride the kernels cannot form in 32 bits."""
    for name, x in arrays.items():
        if x.strides[1] // x.itemsize >= MAX_SEQ_STRIDE:
            raise ValueError(f"{name}'s seqlen stride must be below {MAX_SEQ_STRIDE} elements, "
                             f"got {x.strides[1] // x.itemsize}")


_launches = runtime.LaunchCache()


def run(q, k, v, out, lse, *, causal: bool, softmax_scale: float, tile: Tile) -> None:
    """The forward with an explicit tile (benchmarks try tiles outside the table). Launches are
    prepared once per set of arrays, arguments and stream."""
    key = runtime.launch_key((q, k, v, out, lse), causal, softmax_scale, tile)
    _launches.get(key, lambda: _prepare(q, k, v, out, lse, causal=causal,
                                        softmax_scale=softmax_scale, tile=tile))()


def _prepare(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
             tile: Tile) -> runtime.PreparedLaunch:
    check_seq_strides(q=q, k=k, v=v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    head_dim = kernel_head_dim(HEAD_DIMS, head_dim)
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


def forward(problem, q, k, v, out, lse) -> None:
    """Attention of ``problem`` (AttentionProblem.from_16bit) into ``out`` and ``lse``."""
    tile = tile_for(problem.head_dim, problem.causal, runtime.device_arch())
    run(q, k, v, out, lse, causal=problem.causal, softmax_scale=problem.softmax_scale, tile=tile)
