"""Launcher of the Hopper (sm_90a) backward kernel, ``ptx_src/kernels/bwd_sm90.cu``, between the
pre- and postprocess every backward family shares (launchers/backward_prepost.py).

A block owns 128 keys (64 at head_dim 256) of one (batch, kv head) and walks the query tiles (64,
80 or 128 rows) that see them (through the window, per sequence of a packed batch), for every q head sharing its kv head, so dK and dV are complete in
its registers at the end and GQA needs no second reduction; dQ is summed into the FP32 accumulator
across blocks by TMA reduces through a 3-d map of the accumulator. Q, dO, K and V arrive through
4-d TMA maps (batch, seqlen, heads, head_dim) with boxes of 64 head_dim columns (128 bytes,
128-byte swizzle) by the variant's query rows a step (Q, dO) or its block's keys (K, V).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import archs, runtime
from . import backward_prepost, kernel_head_dim

SOURCE = "kernels/bwd_sm90.cu"
ARCHS = archs.running("hopper")
HEAD_DIMS = (64, 128, 256)
# The FP8 build's, run as they are (no padded head_dim): an e4m3 row is whole 64- or 128-byte
# TMA boxes and whole 32-byte k-steps.
FP8_HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
BOX_COLS = 64   # head_dim columns per TMA box
THREADS = 384   # the producer warpgroup and two consumer warpgroups


@dataclasses.dataclass(frozen=True)
class BwdSm90Config:
    """The template arguments of one ``attn_bwd_sm90<BwdSm90Config<...>>``, in its order
    (ptx_src/mainloops/bwd_sm90.cuh documents each)."""
    head_dim: int
    bf16: bool
    causal: bool
    block_m: int
    stages: int
    deterministic: bool
    options: bool  # the options build: window, softcap, packed sequences
    fp8: bool      # the FP8 backward: e4m3 q, k, v (and dout, quantized by the launcher)
    smem_bytes: int

    # The layout of BwdSm90Config and BwdSm90Mainloop (mainloops/bwd_sm90.cuh), whose
    # static_assert refuses to compile a kernel whose smem_bytes differs from it: at head_dim 256
    # both consumer warpgroups hold the same 64 keys (kSharedKeys), read only the dS each wrote
    # (kOwnDs; the other head dims double-buffer dS, which both read) and stage dQ in two rounds;
    # at head_dim 64 each warpgroup reduces 64 query rows (kDqSplitRows), a box of 64 rows.
    @property
    def shared_keys(self) -> bool:
        return self.head_dim == 256

    @property
    def block_n(self) -> int:
        return 64 if self.shared_keys else 128

    @property
    def turns_per_tile(self) -> int:
        """Deterministic sums: the writer warps (BwdSm90Mainloop::kWriterWarps), each taking
        turns of its own at a tile's dQ: one a dQ round (head_dim 256) or a consumer warpgroup
        (64, 128). Only deterministic builds take turns, and all of them have two writers."""
        return 2

    @property
    def dq_rows(self) -> int:
        """Rows of one warpgroup's dQ reduce (the accumulator map's box)."""
        return 64 if self.head_dim == 64 else self.block_m

    def spec(self) -> runtime.KernelSpec:
        dtype = "bfloat16" if self.bf16 else "float16"
        return runtime.KernelSpec(
            name=f"bwd_sm90_{dtype}_d{self.head_dim}_m{self.block_m}_s{self.stages}"
                 f"{'_causal' if self.causal else ''}{'_det' if self.deterministic else ''}"
                 f"{'_opt' if self.options else ''}{'_fp8' if self.fp8 else ''}",
            source=SOURCE, entry=f"ptxattn::attn_bwd_sm90<ptxattn::BwdSm90Config<"
                                 f"{runtime.template_arguments(self)}>>",
            smem_bytes=self.smem_bytes, archs=ARCHS)


def smem_bytes(head_dim: int, block_m: int, stages: int, fp8: bool = False) -> int:
    """The shared memory of BwdSm90Mainloop's layout (its static_assert holds the launcher's
    request to it)."""
    shared_keys = head_dim == 256
    block_n = 64 if shared_keys else 128
    dq_rows = 64 if head_dim == 64 else block_m
    k_v = 2 * block_n * head_dim * 2
    q_do = 2 * stages * block_m * head_dim * 2
    row_values = stages * (2 * block_m * 4 + (16 if fp8 else 0))  # LSE, D (, FP8's scales)
    ds_buffers = 1 if shared_keys else 2
    ds = ds_buffers * 2 * block_m * 64 * 2  # a [block_m x 64] slab per warpgroup
    # both warpgroups: two boxes of [dq_rows x 32] float32 each, one at head_dim 256 (whose
    # other box is its dS slab)
    dq_staging = 2 * (1 if shared_keys else 2) * dq_rows * 32 * 4
    barriers = 8 * (1 + 2 * stages)
    # + aligning the base to the swizzle atom
    return k_v + q_do + row_values + ds + dq_staging + barriers + 1024


# Per head_dim: (query rows per step, (Q, dO) ring depth). head_dim 128 has the registers for
# 80 rows at most (dK, dV, S^T and dP^T take 256 at 128; 80 rather than 64 measured +1-4%, causal
# -2% at seqlen 2048 and +3-7% at 8192-16384), and 256 for 64 (the half columns' dK and dV take
# 128); shared memory holds two stages.
TILES = {64: (128, 2), 128: (80, 2), 256: (64, 2)}


# The FP8 backward's: whole 32-query k-steps over whole swizzle spans (64 or 128 rows a step).
FP8_TILES = {64: (128, 2), 128: (64, 2), 256: (64, 2)}


def variant(dtype: str, head_dim: int, causal: bool, deterministic: bool = False,
            options: bool = False, fp8: bool = False) -> BwdSm90Config:
    """``dtype`` is the 16-bit type of the gradients (and of dout and out)."""
    block_m, stages = (FP8_TILES if fp8 else TILES)[head_dim]
    return BwdSm90Config(head_dim, bool(DTYPES[dtype]), causal, block_m, stages, deterministic,
                         options, fp8, smem_bytes(head_dim, block_m, stages, fp8))


def variants() -> list[runtime.KernelSpec]:
    return [variant(dtype, head_dim, causal, deterministic, options, fp8).spec()
            for dtype in DTYPES for head_dim in HEAD_DIMS for causal in (False, True)
            for deterministic in (False, True)
            for options, fp8 in ((False, False), (True, False), (False, True))] + [
        operand_spec("fp8_transpose_rows", head_dim) for head_dim in FP8_HEAD_DIMS] + [
        operand_spec("fp8_dequantize", head_dim, dtype) for head_dim in FP8_HEAD_DIMS
        for dtype in DTYPES]


def backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic: bool,
             cu_seqlens_q=None, cu_seqlens_k=None, sinks=None, descales=None):
    """The gradients of the forward into dq, dk, dv; returns the workspace (for its size and
    the sinks' gradient). Arrays are 4-d, packed sequences as views of batch extent 1 with their
    cu_seqlens; the window, softcap and sinks are the problem's. An FP8 problem (format "e4m3",
    AttentionProblem.from_fp8_backward) takes E4M3Array q, k, v and their ``descales``, the
    (q, k, v) descales as ptxattn.fp8.attention takes them."""
    if problem.format == "e4m3":
        return _backward_fp8(problem, dout, q, k, v, out, lse, dq, dk, dv, descales,
                             deterministic=deterministic)
    head_dim = kernel_head_dim(HEAD_DIMS, problem.head_dim)
    v_info = variant(problem.format, head_dim, problem.causal, deterministic,
                     backward_prepost.takes_options(problem))
    kernel = runtime.load(v_info.spec())
    block_m = v_info.block_m
    ws = backward_prepost.Workspace.allocate(problem, block_m, deterministic, head_dim,
                                             turns_per_tile=v_info.turns_per_tile)
    p = backward_prepost.make_params(problem, dout, q, k, v, out, lse, dq, dk, dv, ws, block_m,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     sinks=sinks)
    swizzle = BOX_COLS * q.itemsize
    p.q_map = runtime.tensor_map(q, (1, block_m, 1, BOX_COLS), swizzle=swizzle)
    p.dout_map = runtime.tensor_map(dout, (1, block_m, 1, BOX_COLS), swizzle=swizzle)
    p.k_map = runtime.tensor_map(k, (1, v_info.block_n, 1, BOX_COLS), swizzle=swizzle)
    p.v_map = runtime.tensor_map(v, (1, v_info.block_n, 1, BOX_COLS), swizzle=swizzle)
    # dK and dV leave through TMA stores of each consumer warpgroup's 64 keys
    p.dk_map = runtime.tensor_map(dk, (1, 64, 1, BOX_COLS), swizzle=swizzle)
    p.dv_map = runtime.tensor_map(dv, (1, 64, 1, BOX_COLS), swizzle=swizzle)
    # dQ sums: TMA reduces of [dq_rows x 32 float32] boxes into the workspace rows of each
    # (batch, head), or of each head (packed sequences), whose padding takes the rows past a
    # sequence's end.
    sets, rows = backward_prepost.workspace_rows(problem, block_m)
    p.dq_accum_map = runtime.tensor_map(ws.dq_accum.reshape(sets, rows, head_dim),
                                        (1, v_info.dq_rows, 32), swizzle=128)
    grid = (math.ceil(problem.seqlen_k / v_info.block_n), problem.heads_kv, problem.batch)
    main = (runtime.PreparedLaunch(kernel, grid=grid, block=(THREADS,), args=[p])
            if grid[0] > 0 else None)
    backward_prepost.run(problem, p, main, ws)
    return ws


def operand_spec(entry: str, head_dim: int, dtype: str = "bfloat16") -> runtime.KernelSpec:
    """A kernel of ptx_src/kernels/fp8_operands.cu: "fp8_transpose_rows" or "fp8_dequantize"
    (into ``dtype``)."""
    suffix = f"_{dtype}" if entry == "fp8_dequantize" else ""
    return runtime.KernelSpec(name=f"{entry}_d{head_dim}{suffix}", source="kernels/fp8_operands.cu",
                              entry=entry, defines={"HEAD_DIM": head_dim,
                                                    "IS_BF16": DTYPES[dtype]}, archs=ARCHS)


_OPERAND_THREADS = 256  # fp8_operands.cu's kThreads
_GROUP_ROWS = 32        # rows a transposing block moves (its key-order group)


def transposed_e4m3(x, rows: int):
    """e4m3 bytes x (batch, seqlen, heads, head_dim) as the FP8 backward's Q^T and dO^T:
    (batch, heads, head_dim, seqlen rounded up to ``rows``), zeros past seqlen, each 32 rows in
    the key order of ptx_src/roles/transpose_e4m3.cuh (byte 16 h + 4 t + 2 a + e holds row
    16 h + 8 a + 2 t + e), which the accumulators' e4m3 A fragments follow."""
    import cupy

    batch, seqlen, heads, head_dim = x.shape
    padded = -(-seqlen // rows) * rows
    out = cupy.empty((batch, heads, head_dim, padded), dtype=cupy.uint8)
    runtime.launch(runtime.load(operand_spec("fp8_transpose_rows", head_dim)),
                   (padded // _GROUP_ROWS, heads, batch), (_OPERAND_THREADS, 1, 1),
                   [x, *(np.int64(st) for st in x.strides[:3]), np.int32(seqlen),
                    np.int32(padded), out])
    return out


def dequantized(x8, descale, dtype: str):
    """e4m3 x8 (an E4M3Array, batch, seqlen, heads, head_dim) times its descale (a
    ptxattn.quant.fp8.Descale operand) in ``dtype``, contiguous: dQ's K."""
    import cupy

    batch, seqlen, heads, head_dim = x8.shape
    rows = batch * seqlen * heads
    out = cupy.empty(x8.shape, dtype=dtype)
    chunks = rows * (head_dim // 16)
    runtime.launch(runtime.load(operand_spec("fp8_dequantize", head_dim, dtype)),
                   (-(-chunks // _OPERAND_THREADS), 1, 1), (_OPERAND_THREADS, 1, 1),
                   [x8.bytes, *(np.int64(st) for st in x8.strides[:3]), np.int32(seqlen),
                    np.int32(heads), np.int64(rows), descale.array, np.int64(descale.stride_b),
                    np.int64(descale.stride_h), np.int64(descale.stride_block), out])
    return out


def _set_descale(p, name: str, descale) -> None:
    """p's {name}_descale fields (a ptxattn.quant.fp8.Descale operand)."""
    setattr(p, f"{name}_descale", descale.array)
    setattr(p, f"{name}_descale_stride_b", descale.stride_b)
    setattr(p, f"{name}_descale_stride_h", descale.stride_h)
    if name != "v":
        setattr(p, f"{name}_descale_stride_block", descale.stride_block)


def _backward_fp8(problem, dout, q8, k8, v8, out, lse, dq, dk, dv, descales, *,
                  deterministic: bool):
    """The FP8 backward (the kernel's kFp8 build): dout quantized per 128 rows, Q^T and dO^T
    transposed, K dequantized to the gradients' dtype for dQ's GEMM, then the pre- and
    postprocess of every backward around the kernel."""
    from ..quant import fp8 as quant_fp8

    grads = dataclasses.replace(problem, format=problem.out_dtype)
    head_dim = problem.head_dim
    v_info = variant(problem.out_dtype, head_dim, problem.causal, deterministic, fp8=True)
    kernel = runtime.load(v_info.spec())
    block_m, block_n = v_info.block_m, v_info.block_n
    ws = backward_prepost.Workspace.allocate(grads, block_m, deterministic, head_dim,
                                             turns_per_tile=v_info.turns_per_tile)
    batch, heads_q, heads_kv = problem.batch, problem.heads_q, problem.heads_kv
    operands = {"q": quant_fp8.descale_operand(descales["q_descale"], batch, heads_q,
                                               problem.seqlen_q),
                "k": quant_fp8.descale_operand(descales["k_descale"], batch, heads_kv,
                                               problem.seqlen_k),
                "v": quant_fp8.descale_operand(descales["v_descale"], batch, heads_kv,
                                               problem.seqlen_k)}
    dout8, dout_descale = quant_fp8.quantize(dout, "block")
    operands["dout"] = quant_fp8.descale_operand(dout_descale, batch, heads_q, problem.seqlen_q)
    k16 = dequantized(k8, operands["k"], problem.out_dtype)
    qt = transposed_e4m3(q8.bytes, block_m)
    doutt = transposed_e4m3(dout8.bytes, block_m)
    # the preprocess reads the 16-bit dout and out (D = rowsum(dO * O)); the kernel reads its
    # operands through the maps
    p = backward_prepost.make_params(grads, dout, q8.bytes, k16, v8.bytes, out, lse, dq, dk, dv,
                                     ws, block_m)
    row_bytes = min(head_dim, 128)
    p.q_map = runtime.tensor_map(q8.bytes, (1, block_m, 1, row_bytes), swizzle=row_bytes)
    p.dout_map = runtime.tensor_map(dout8.bytes, (1, block_m, 1, row_bytes), swizzle=row_bytes)
    p.k8_map = runtime.tensor_map(k8.bytes, (1, block_n, 1, row_bytes), swizzle=row_bytes)
    p.v_map = runtime.tensor_map(v8.bytes, (1, block_n, 1, row_bytes), swizzle=row_bytes)
    p.qt_map = runtime.tensor_map(qt, (1, 1, head_dim, block_m), swizzle=block_m)
    p.doutt_map = runtime.tensor_map(doutt, (1, 1, head_dim, block_m), swizzle=block_m)
    swizzle = BOX_COLS * dout.itemsize
    p.k_map = runtime.tensor_map(k16, (1, block_n, 1, BOX_COLS), swizzle=swizzle)
    p.dk_map = runtime.tensor_map(dk, (1, 64, 1, BOX_COLS), swizzle=swizzle)
    p.dv_map = runtime.tensor_map(dv, (1, 64, 1, BOX_COLS), swizzle=swizzle)
    sets, rows = backward_prepost.workspace_rows(grads, block_m)
    p.dq_accum_map = runtime.tensor_map(ws.dq_accum.reshape(sets, rows, head_dim),
                                        (1, v_info.dq_rows, 32), swizzle=128)
    for name, operand in operands.items():
        _set_descale(p, name, operand)
    grid = (math.ceil(problem.seqlen_k / block_n), heads_kv, batch)
    main = (runtime.PreparedLaunch(kernel, grid=grid, block=(THREADS,), args=[p])
            if grid[0] > 0 else None)
    backward_prepost.run(grads, p, main, ws)
    return ws
