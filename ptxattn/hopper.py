"""Launcher of the Hopper (sm_90a) forward kernel, ``ptx_src/fwd_sm90.cu``.

TMA descriptors are built here: 4-d maps over the (batch, seqlen, heads, head_dim) arrays with a
box of 64 head_dim columns (128 bytes, the 128-byte swizzle span) by a tile of rows, so the kernel
loads a tile of head_dim 128 as two boxes; rows past seqlen are zero-filled by the TMA unit. The
output is stored from registers with the strides passed here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np

from . import runtime

ARCHS = ("sm_90a",)
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}

BLOCK_M = 128          # query rows per tile: two consumer warpgroups of 64
BOX_COLS = 64          # head_dim columns per TMA box (128 bytes of 16-bit data)
THREADS = 384          # producer warpgroup + two consumer warpgroups

@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tuned per (head_dim, causal) on an H100 SXM, bf16, batch*seqlen = 16384 (see
    scripts/check_hopper.py --sweep).

    block_n, stages: keys per K/V tile and ring depth. Registers per consumer thread grow with
      head_dim / 2 (O) + 3/4 * block_n (S in fp32, P in 16 bits); shared memory is
      (128 + 2 * stages * block_n) * head_dim * 2 bytes (227 KB at most).
    persistent: one block per SM striding over the tiles, instead of one block per tile.
    l2_sections: group (batch, head) pairs whose K/V fit in L2 together and run each group's
      query tiles longest-first across the group; otherwise pair by pair.
    """
    block_n: int
    stages: int
    persistent: bool
    l2_sections: bool


SCHEDULES = {
    (64, False): Schedule(192, 2, persistent=True, l2_sections=False),
    (64, True): Schedule(192, 2, persistent=True, l2_sections=True),
    (128, False): Schedule(128, 2, persistent=False, l2_sections=False),
    (128, True): Schedule(128, 2, persistent=False, l2_sections=False),
    (256, False): Schedule(64, 2, persistent=False, l2_sections=False),
    (256, True): Schedule(64, 2, persistent=False, l2_sections=False),
}

# K/V bytes that the heads of one scheduling section may keep in L2 together (H100: 50 MB).
L2_SECTION_BYTES = 32 << 20


def _smem_bytes(head_dim: int, block_n: int, stages: int) -> int:
    tiles = (BLOCK_M + 2 * stages * block_n) * head_dim * 2
    barriers = 8 * (2 + 4 * stages)
    return tiles + barriers + 1024  # + alignment of the base to the 1024-byte swizzle atom


def spec(dtype: str, head_dim: int, causal: bool, tiles: tuple[int, int] | None = None
         ) -> runtime.KernelSpec:
    schedule = SCHEDULES[head_dim, causal]
    block_n, stages = tiles or (schedule.block_n, schedule.stages)
    return runtime.KernelSpec(
        name=f"fwd_sm90_{dtype}_d{head_dim}_n{block_n}_s{stages}{'_causal' if causal else ''}",
        source="fwd_sm90.cu",
        entry="attn_fwd_sm90",
        defines={"HEAD_DIM": head_dim, "BLOCK_N": block_n, "STAGES": stages,
                 "IS_BF16": DTYPES[dtype], "IS_CAUSAL": int(causal),
                 "SMEM_BYTES": _smem_bytes(head_dim, block_n, stages)},
        smem_bytes=_smem_bytes(head_dim, block_n, stages),
        archs=ARCHS,
    )


def variants() -> list[runtime.KernelSpec]:
    return [spec(dtype, head_dim, causal)
            for dtype in DTYPES for head_dim in HEAD_DIMS for causal in (False, True)]


def section_heads(batch: int, heads_q: int, heads_kv: int, seqlen_k: int, head_dim: int,
                  itemsize: int) -> int:
    """How many (batch, head) pairs the kernel schedules together (see fwd_sm90.cu)."""
    kv_bytes_per_q_head = 2 * seqlen_k * head_dim * itemsize * heads_kv / heads_q
    return int(max(1, min(batch * heads_q, L2_SECTION_BYTES // max(kv_bytes_per_q_head, 1))))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy
    return cupy.cuda.runtime.deviceGetAttribute(
        cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def launcher(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
             tiles: tuple[int, int] | None = None, sections: int | None = None,
             persistent: bool | None = None, grid_blocks: int | None = None
             ) -> Callable[[], None]:
    """Everything forward() does except the launch itself, which the returned callable performs
    (benchmarks time that alone). ``tiles`` (keys per tile, stages), ``sections``,
    ``persistent`` and ``grid_blocks`` (blocks striding over the tiles) override the tuned
    defaults, for tests and benchmarks."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    kernel_spec = spec(str(q.dtype), head_dim, causal, tiles)
    block_n = kernel_spec.defines["BLOCK_N"]
    kernel = runtime.load(kernel_spec)
    q_map = runtime.tensor_map(q, (1, BLOCK_M, 1, BOX_COLS), swizzle=128)
    k_map = runtime.tensor_map(k, (1, block_n, 1, BOX_COLS), swizzle=128)
    v_map = runtime.tensor_map(v, (1, block_n, 1, BOX_COLS), swizzle=128)
    num_tiles = batch * heads_q * math.ceil(seqlen_q / BLOCK_M)
    schedule = SCHEDULES[head_dim, causal]
    if sections is None:
        sections = (section_heads(batch, heads_q, heads_kv, seqlen_k, head_dim, q.itemsize)
                    if schedule.l2_sections else 1)
    if persistent is None:
        persistent = schedule.persistent
    blocks = num_tiles
    if persistent:
        blocks = min(num_tiles, _sm_count(q.device.id))
    if grid_blocks is not None:
        blocks = min(num_tiles, grid_blocks)
    stride_b, stride_s, stride_h, _ = (s // out.itemsize for s in out.strides)
    args = [q_map, k_map, v_map, out, np.int64(stride_b), np.int64(stride_s), np.int64(stride_h),
            lse, np.int32(seqlen_q), np.int32(seqlen_k), np.int32(batch), np.int32(heads_q),
            np.int32(heads_q // heads_kv), np.int32(sections),
            np.float32(softmax_scale * math.log2(math.e))]
    return lambda: runtime.launch(kernel, grid=(blocks, 1, 1), block=(THREADS, 1, 1), args=args)


def forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float, **overrides) -> None:
    launcher(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **overrides)()
