"""What every backward kernel family shares: the workspace, the BwdParams of a call, and the two
short kernels around the main one (``ptx_src/kernels/bwd_prepost.cu``).

A backward call runs three kernels on one stream:

1. ``bwd_preprocess``: dpsum = rowsum(dO * O) in FP32 (per query row: the D of
   dS = P * (dP - D)), and the FP32 dQ accumulator zeroed;
2. the family's main kernel: dK and dV written, dQ summed into the accumulator;
3. ``bwd_postprocess``: dq = softmax_scale * accumulator, in the input dtype.

The workspace is, per query row, the FP32 dQ accumulator (head_dim floats), dpsum and the LSE in
log2 units, and with sinks each row's share of dL/dsink, all in one row layout: per (batch, head)
seqlen_q rows padded to ROW_PADDING and to whole query tiles (rounded_rows), so that a kernel may
copy or add whole tiles of rows; for packed sequences (varlen) per head every sequence's rows at
its padded offset (BwdSeq in ptx_src/roles/block_info.cuh; packed_rows). For
``deterministic=True`` it adds turns_per_tile ints per (batch, head, query tile) (the Hopper
kernel's writer warps take turns of their own). Nothing is of O(seqlen^2).
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


def takes_options(problem) -> bool:
    """Whether a call needs a main kernel's options build (a window, a softcap or packed
    sequences; sinks need only the preprocess): the plain build reads none of them, which
    measured 1-5% faster (docs/design/backward.md#options-build)."""
    return problem.window != (-1, -1) or problem.softcap > 0 or "varlen" in problem.layouts


def packed_rows(problem, block_m: int) -> int:
    """Workspace rows per head of a packed (varlen) call: sequence b's rows start at
    (cu_seqlens_q[b] + b * block_m) rounded down to block_m, and the last one's padding ends
    before total_q + batch * block_m."""
    return -(-(problem.total_q + problem.batch * block_m) // block_m) * block_m


def workspace_rows(problem, block_m: int) -> tuple[int, int]:
    """(row sets, rows per set) of the workspace: (batch * heads_q, rounded_rows) for a
    fixed-length call, (heads_q, packed_rows) for packed sequences."""
    if "varlen" in problem.layouts:
        return problem.heads_q, packed_rows(problem, block_m)
    return problem.batch * problem.heads_q, rounded_rows(problem.seqlen_q, block_m)


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
    dsink_rows: object | None  # with sinks: zeroed, each row's -exp(sink - LSE) D
    rows: int                  # rows per (batch, head), or per head when packed
    head_dim: int              # dq_accum's columns: the main kernel's compiled head dim

    @staticmethod
    def sizes(problem, block_m: int, deterministic: bool, head_dim: int,
              turns_per_tile: int = 1) -> tuple[int, int, int]:
        """Elements of the accumulator, of dpsum (and of lse_log2, and of dsink_rows with
        sinks) and semaphores, for a main kernel of block_m query rows and compiled head_dim a
        tile that takes turns_per_tile turns at each tile's dQ (deterministic sums): all 4
        bytes each."""
        sets, rows = workspace_rows(problem, block_m)
        semaphores = (problem.batch * problem.heads_q * math.ceil(problem.seqlen_q / block_m)
                      * turns_per_tile if deterministic else 0)
        return sets * rows * head_dim, sets * rows, semaphores

    @classmethod
    def allocate(cls, problem, block_m: int, deterministic: bool, head_dim: int,
                 turns_per_tile: int = 1) -> "Workspace":
        import cupy
        accum, padded_rows, semaphores = cls.sizes(problem, block_m, deterministic, head_dim,
                                                   turns_per_tile)
        return cls(cupy.empty(accum, dtype=cupy.float32),
                   cupy.empty(padded_rows, dtype=cupy.float32),
                   cupy.empty(padded_rows, dtype=cupy.float32),
                   cupy.zeros(semaphores, dtype=cupy.int32) if deterministic else None,
                   cupy.zeros(padded_rows, dtype=cupy.float32) if problem.sinks else None,
                   workspace_rows(problem, block_m)[1], head_dim)

    def dsinks(self, problem, out=None):
        """dL/dsinks, float32 (heads_q,): the rows' shares summed per head, in a fixed order
        (the same bits on every run)."""
        import cupy
        shares = self.dsink_rows.reshape(-1, problem.heads_q, self.rows)
        return cupy.sum(shares, axis=(0, 2), out=out)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.dq_accum, self.dpsum, self.lse_log2,
                                      self.dq_semaphore, self.dsink_rows) if x is not None)


def make_params(problem, dout, q, k, v, out, lse, dq, dk, dv, workspace: Workspace,
                block_m: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
                sinks=None) -> params.BwdParams:
    """The BwdParams of a call: 4-d arrays (packed sequences as views of batch extent 1, with
    their cu_seqlens), lse (batch, heads_q, seqlen_q) (packed: (1, heads_q, total_q))."""
    p = params.BwdParams(
        q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, lse=lse,
        dq_accum=workspace.dq_accum, dpsum=workspace.dpsum, lse_log2=workspace.lse_log2,
        dq_semaphore=workspace.dq_semaphore if workspace.dq_semaphore is not None else 0,
        batch=problem.batch, seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k,
        heads_q=problem.heads_q, heads_kv=problem.heads_kv, q_per_kv=problem.gqa_ratio,
        softmax_scale=problem.softmax_scale, causal=int(problem.causal),
        num_m_blocks=math.ceil(problem.seqlen_q / block_m),
        seqlen_q_rounded=workspace_rows(problem, block_m)[1], row_padding=block_m,
        window_left=problem.window[0], window_right=0 if problem.causal else problem.window[1],
        cu_seqlens_q=0 if cu_seqlens_q is None else cu_seqlens_q,
        cu_seqlens_k=0 if cu_seqlens_k is None else cu_seqlens_k,
        sinks=0 if sinks is None else sinks,
        dsink_rows=0 if workspace.dsink_rows is None else workspace.dsink_rows,
        # blocks that may wait on one another must fit on the GPU at once: one per SM is a
        # lower bound for every backward kernel
        dq_turn_group=runtime.sm_count(problem.device))
    # the forward's scores (softcap tanh(softmax_scale s / softcap) under a softcap)
    p.scale_log2, p.softcap_scale = params.score_scales(problem.softmax_scale, problem.softcap)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        for dim, stride in zip("bsh", params.strides(x)):
            setattr(p, f"{name}_stride_{dim}", stride)
    p.head_dim, p.head_dim_v = q.shape[-1], v.shape[-1]
    p.lse_stride_b, p.lse_stride_h = params.strides(lse, 2)
    return p


def _row_grid(problem, rows_per_head: int, head_dim: int) -> tuple[int]:
    chunks = problem.batch * problem.heads_q * rows_per_head * (head_dim // 8)
    return (math.ceil(chunks / _THREADS),)


def preprocess(problem, p: params.BwdParams, ws: Workspace) -> runtime.PreparedLaunch:
    kernel = runtime.load(_spec("preprocess", problem.format, ws.head_dim))
    # every workspace row; packed, each sequence's rows padded to whole tiles (bwd_prepost.cu)
    walked = (p.seqlen_q_rounded if "varlen" not in problem.layouts
              else -(-problem.seqlen_q // p.row_padding) * p.row_padding)
    return runtime.PreparedLaunch(kernel, grid=_row_grid(problem, walked, ws.head_dim),
                                  block=(_THREADS,), args=[p])


def postprocess(problem, p: params.BwdParams, ws: Workspace) -> runtime.PreparedLaunch:
    kernel = runtime.load(_spec("postprocess", problem.format, ws.head_dim))
    return runtime.PreparedLaunch(kernel, grid=_row_grid(problem, problem.seqlen_q, ws.head_dim),
                                  block=(_THREADS,), args=[p])


def run(problem, p: params.BwdParams, main: runtime.PreparedLaunch | None,
        ws: Workspace) -> None:
    """The preprocess, the family's main kernel (None when no block has a key: every packed
    sequence empty of keys) and the postprocess, in order on the current stream, over the
    workspace ``ws``. A launch of no rows (packed sequences of no queries) is left out."""
    for launch in (preprocess(problem, p, ws), main, postprocess(problem, p, ws)):
        if launch is not None and min(launch.grid) > 0:
            launch()
