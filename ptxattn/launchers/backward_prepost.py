"""What every backward kernel family shares: the workspace, the BwdParams of a call, and the two
short kernels around the main one (``ptx_src/kernels/bwd_prepost.cu``).

A backward call runs three kernels on one stream:

1. ``bwd_preprocess``: dpsum = rowsum(dO * O) in FP32 (per query row: the D of
   dS = P * (dP - D)), and the FP32 dQ accumulator zeroed;
2. the family's main kernel: dK and dV written, dQ summed into the accumulator;
3. ``bwd_postprocess``: dq = softmax_scale * accumulator, in the input dtype.

The workspace is the FP32 accumulator (batch * heads_q * seqlen_q * head_dim floats), dpsum and
the LSE in log2 units (batch * heads_q * seqlen_q floats each, seqlen_q padded to ROW_PADDING and
to whole query tiles, rounded_rows, so that a kernel may copy whole tiles of rows) and, for
``deterministic=True``, turns_per_tile ints per (batch, head, query tile) (the Hopper kernel's
writer warps take turns of their own): nothing of O(seqlen^2).
"""

from __future__ import annotations

import dataclasses
import math

from .. import archs, params, runtime

SOURCE = "kernels/bwd_prepost.cu"
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": 1, "float16": 0}
_THREADS = 256
ROW_PADDING = 128  # dpsum and lse_log2 rows per (batch, head): seqlen_q rounded up to this
# Every family's backward runs them, so they are built wherever one does.
ARCHS = archs.running("portable")


@dataclasses.dataclass(frozen=True)
class RowKernelConfig:
    """The template arguments of ``bwd_preprocess`` and ``bwd_postprocess`` (bwd_prepost.cu)."""

    head_dim: int
    bf16: bool


def _spec(kind: str, dtype: str, head_dim: int) -> runtime.KernelSpec:
    config = RowKernelConfig(head_dim, bool(DTYPES[dtype]))
    return runtime.KernelSpec(name=f"bwd_{kind}_{dtype}_d{head_dim}", source=SOURCE,
                              entry=f"ptxattn::bwd_{kind}<{runtime.template_arguments(config)}>",
                              archs=ARCHS)


def variants() -> list[runtime.KernelSpec]:
    return [_spec(kind, dtype, d) for kind in ("preprocess", "postprocess") for dtype in DTYPES
            for d in HEAD_DIMS]


def rounded_rows(seqlen_q: int, block_m: int = ROW_PADDING) -> int:
    """Rows per (batch, head) of dpsum and lse_log2: seqlen_q padded to ROW_PADDING, and to whole
    query tiles of block_m rows (80 at the Hopper head_dim 128)."""
    def up(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple
    return max(up(seqlen_q, ROW_PADDING), up(seqlen_q, block_m))


@dataclasses.dataclass
class Workspace:
    dq_accum: object
    dpsum: object
    lse_log2: object
    dq_semaphore: object | None

    @staticmethod
    def sizes(problem, block_m: int, deterministic: bool,
              turns_per_tile: int = 1) -> tuple[int, int, int]:
        """Elements of the accumulator, of dpsum (and of lse_log2) and semaphores, for a main
        kernel of block_m query rows a tile that takes turns_per_tile turns at each tile's dQ
        (deterministic sums): all 4 bytes each."""
        heads = problem.batch * problem.heads_q
        semaphores = (heads * math.ceil(problem.seqlen_q / block_m) * turns_per_tile
                      if deterministic else 0)
        return (heads * problem.seqlen_q * problem.head_dim,
                heads * rounded_rows(problem.seqlen_q, block_m), semaphores)

    @classmethod
    def allocate(cls, problem, block_m: int, deterministic: bool,
                 turns_per_tile: int = 1) -> "Workspace":
        import cupy
        accum, padded_rows, semaphores = cls.sizes(problem, block_m, deterministic,
                                                   turns_per_tile)
        return cls(cupy.empty(accum, dtype=cupy.float32),
                   cupy.empty(padded_rows, dtype=cupy.float32),
                   cupy.empty(padded_rows, dtype=cupy.float32),
                   cupy.zeros(semaphores, dtype=cupy.int32) if deterministic else None)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.dq_accum, self.dpsum, self.lse_log2,
                                      self.dq_semaphore) if x is not None)


def make_params(problem, dout, q, k, v, out, lse, dq, dk, dv, workspace: Workspace,
                block_m: int) -> params.BwdParams:
    p = params.BwdParams(
        q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, lse=lse,
        dq_accum=workspace.dq_accum, dpsum=workspace.dpsum, lse_log2=workspace.lse_log2,
        dq_semaphore=workspace.dq_semaphore if workspace.dq_semaphore is not None else 0,
        batch=problem.batch, seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k,
        heads_q=problem.heads_q, heads_kv=problem.heads_kv, q_per_kv=problem.gqa_ratio,
        softmax_scale=problem.softmax_scale,
        scale_log2=problem.softmax_scale * math.log2(math.e), causal=int(problem.causal),
        num_m_blocks=math.ceil(problem.seqlen_q / block_m),
        seqlen_q_rounded=rounded_rows(problem.seqlen_q, block_m),
        # blocks that may wait on one another must fit on the GPU at once: one per SM is a
        # lower bound for every backward kernel
        dq_turn_group=runtime.sm_count(problem.device))
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        for dim, stride in zip("bsh", params.strides(x)):
            setattr(p, f"{name}_stride_{dim}", stride)
    p.lse_stride_b, p.lse_stride_h = params.strides(lse, 2)
    return p


def _row_grid(problem, rows_per_head: int) -> tuple[int]:
    chunks = problem.batch * problem.heads_q * rows_per_head * (problem.head_dim // 8)
    return (math.ceil(chunks / _THREADS),)


def preprocess(problem, p: params.BwdParams) -> runtime.PreparedLaunch:
    kernel = runtime.load(_spec("preprocess", problem.format, problem.head_dim))
    return runtime.PreparedLaunch(kernel, grid=_row_grid(problem, p.seqlen_q_rounded),
                                  block=(_THREADS,), args=[p])


def postprocess(problem, p: params.BwdParams) -> runtime.PreparedLaunch:
    kernel = runtime.load(_spec("postprocess", problem.format, problem.head_dim))
    return runtime.PreparedLaunch(kernel, grid=_row_grid(problem, problem.seqlen_q),
                                  block=(_THREADS,), args=[p])
