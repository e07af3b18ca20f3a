"""Launcher of the Hopper (sm_90a) forward kernel, ``ptx_src/fwd_sm90.cu``.

TMA descriptors are built here: 4-d maps over the (batch, seqlen, heads, head_dim) arrays with a
box of 64 head_dim columns (128 bytes, the 128-byte swizzle span) by a tile of rows, so the kernel
loads a tile of head_dim 128 as two boxes. Tiles hanging past seqlen are zero-filled on load and
clipped on store by the TMA unit.
"""

from __future__ import annotations

import math

import numpy as np

from . import runtime

ARCHS = ("sm_90a",)
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}

BLOCK_M = 128          # query rows per block: two consumer warpgroups of 64
STORE_ROWS = 64        # each consumer warpgroup stores its own rows
BOX_COLS = 64          # head_dim columns per TMA box (128 bytes of 16-bit data)
THREADS = 384          # producer warpgroup + two consumer warpgroups

# head_dim -> (keys per tile, K/V ring depth). Registers per consumer thread grow with
# head_dim / 2 (O) + 3/4 * BLOCK_N (S in fp32 and P in 16 bits); shared memory with
# (128 + 2 * STAGES * BLOCK_N) * head_dim * 2 bytes.
TILES = {64: (128, 4), 128: (128, 2), 256: (64, 2)}


def _smem_bytes(head_dim: int, block_n: int, stages: int) -> int:
    tiles = (BLOCK_M + 2 * stages * block_n) * head_dim * 2
    barriers = 8 * (1 + 4 * stages)
    return tiles + barriers + 1024  # + alignment of the base to the 1024-byte swizzle atom


def spec(dtype: str, head_dim: int, causal: bool) -> runtime.KernelSpec:
    block_n, stages = TILES[head_dim]
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


def forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float) -> None:
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    block_n, _ = TILES[head_dim]
    kernel = runtime.load(spec(str(q.dtype), head_dim, causal))
    q_map = runtime.tensor_map(q, (1, BLOCK_M, 1, BOX_COLS), swizzle=128)
    k_map = runtime.tensor_map(k, (1, block_n, 1, BOX_COLS), swizzle=128)
    v_map = runtime.tensor_map(v, (1, block_n, 1, BOX_COLS), swizzle=128)
    o_map = runtime.tensor_map(out, (1, STORE_ROWS, 1, BOX_COLS), swizzle=128)
    runtime.launch(
        kernel,
        grid=(math.ceil(seqlen_q / BLOCK_M), heads_q, batch),
        block=(THREADS, 1, 1),
        args=[q_map, k_map, v_map, o_map, lse, np.int32(seqlen_q), np.int32(seqlen_k),
              np.int32(heads_q), np.int32(heads_q // heads_kv),
              np.float32(softmax_scale * math.log2(math.e))],
    )
