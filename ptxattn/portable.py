"""Launcher of the portable forward kernel, ``ptx_src/fwd_mma_sync.cu`` (mma.sync, sm_80+).

The kernel takes raw pointers and element strides, so any (batch, seqlen, heads) strides work
as long as rows are 16-byte aligned (api.validate checks that). Tiles are compile-time: one
:class:`Tile` per head dim and shared-memory class, chosen by measurement on the H100 (see the
table in TILES). The 1-D grid runs the query blocks of one (batch, head) next to each other so
that they share K/V in L2.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import runtime

# The kernel needs only sm_80 features; sm_86/sm_89 have the small shared memory of sm_120a.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a")
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
SOURCE = "fwd_mma_sync.cu"
ENTRY = "fwd_mma_sync"


@dataclasses.dataclass(frozen=True)
class Tile:
    """Compile-time shape of one kernel variant."""

    block_m: int       # query rows per block
    block_n: int       # keys per K/V block
    warps: int         # each owns block_m / warps rows, a multiple of 16
    stages: int        # depth of the cp.async K/V ring
    q_in_regs: bool    # keep Q's A fragments in registers instead of re-reading shared memory
    min_blocks: int = 1  # __launch_bounds__ minimum blocks per SM

    def smem_bytes(self, head_dim: int) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * head_dim * 2

    def label(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_w{self.warps}_s{self.stages}"
                f"{'_qr' if self.q_in_regs else ''}_b{self.min_blocks}")


# head_dim -> [(archs, tile)]: the archs each tile ships for (shared memory per block decides).
TILES: dict[int, list[tuple[tuple[str, ...], Tile]]] = {
    64: [(ARCHS, Tile(128, 64, 4, 2, False, 2))],
    128: [(ARCHS, Tile(128, 32, 4, 2, False, 2))],
    256: [(("sm_80", "sm_90a"), Tile(128, 32, 8, 2, False, 1)),
          (("sm_86", "sm_89", "sm_120a"), Tile(64, 32, 4, 2, False, 2))],
}


def tile_for(head_dim: int, arch: str) -> Tile:
    for archs, tile in TILES[head_dim]:
        if arch in archs:
            return tile
    raise runtime.PtxattnError(f"no portable tile for head_dim {head_dim} on {arch}")


def spec(dtype: str, head_dim: int, causal: bool, tile: Tile,
         archs: tuple[str, ...] = ARCHS) -> runtime.KernelSpec:
    return runtime.KernelSpec(
        name=f"fwd_mma_sync_{dtype}_d{head_dim}_{tile.label()}{'_causal' if causal else ''}",
        source=SOURCE,
        entry=ENTRY,
        defines={"HEAD_DIM": head_dim, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
                 "NUM_WARPS": tile.warps, "STAGES": tile.stages,
                 "Q_IN_REGS": int(tile.q_in_regs), "IS_BF16": DTYPES[dtype],
                 "IS_CAUSAL": int(causal), "MIN_BLOCKS_PER_SM": tile.min_blocks},
        smem_bytes=tile.smem_bytes(head_dim),
        archs=archs,
    )


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, head_dim, causal, tile, archs)
            for dtype in DTYPES for head_dim in HEAD_DIMS for causal in (False, True)
            for archs, tile in TILES[head_dim]]


def _element_strides(x) -> list[np.int64]:
    return [np.int64(s // x.itemsize) for s in x.strides[:3]]


def run(q, k, v, out, lse, *, causal: bool, softmax_scale: float, tile: Tile) -> None:
    """forward() with an explicit tile (benchmarks try tiles outside the table)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    arch = runtime.device_arch()
    kernel = runtime.load(spec(str(q.dtype), head_dim, causal, tile, (arch,)))
    num_m_blocks = math.ceil(seqlen_q / tile.block_m)
    runtime.launch(
        kernel,
        grid=(num_m_blocks * batch * heads_q,),
        block=(32 * tile.warps,),
        args=[q, k, v, out, lse, *_element_strides(q), *_element_strides(k),
              *_element_strides(v), *_element_strides(out), np.int32(seqlen_q),
              np.int32(seqlen_k), np.int32(heads_q), np.int32(heads_q // heads_kv),
              np.int32(num_m_blocks), np.float32(softmax_scale * math.log2(math.e))],
    )


def forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float) -> None:
    tile = tile_for(q.shape[3], runtime.device_arch())
    run(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, tile=tile)
