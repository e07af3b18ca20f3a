"""The launchers: one module per kernel family and role, each turning a checked call
(:class:`ptxattn.problem.AttentionProblem`) into its kernel's params struct, grid and launch.

======================  ===================================================================
module                  runs
======================  ===================================================================
hopper_forward          kernels/fwd_sm90.cu: 16-bit and FP8 forward, and its serving build
hopper_backward         kernels/bwd_sm90.cu: the Hopper backward
portable_forward        kernels/fwd_mma_sync.cu: the mma.sync forward (sm_80+)
portable_backward       kernels/bwd_mma_sync.cu: the mma.sync backward (sm_80+)
portable_decode         kernels/fwd_decode_mma_sync.cu: decoding, paged and FP8 caches, softcap
portable_mla            kernels/fwd_mla_mma_sync.cu: multi-head latent attention decoding
backward_prepost        kernels/bwd_prepost.cu: what every backward runs around its main kernel
split_kv                kernels/combine.cu: the merge of split-KV partial states
blockscaled             kernels/fwd_blockscaled.cu: MXFP8 / NVFP4 (sm_120a, emulated on sm_90a)
======================  ===================================================================

Each of the first six and ``blockscaled`` is a :class:`Launcher`; ptxattn/dispatch.py's table
names the launcher and the call of each route. ``tune_table`` holds the Hopper forward's tuned
schedules.
"""

from __future__ import annotations

from typing import Protocol

from .. import runtime


def kernel_head_dim(head_dims, head_dim: int) -> int:
    """The compiled head dim that runs a call of ``head_dim`` columns: the least of
    ``head_dims`` that holds them. The kernels read the call's own columns (FwdParams.head_dim,
    head_dim_v) and fill the rest of a tile with zeros, so nothing is padded in memory and
    nothing past the arrays' columns is read or written."""
    fitting = [d for d in head_dims if d >= head_dim]
    if not fitting:
        raise ValueError(f"head_dim must be at most {max(head_dims)}, got {head_dim}")
    return min(fitting)


class Launcher(Protocol):
    """What a launcher module provides. Every launcher lists its kernel variants; each provides
    the calls that the dispatch table's routes make of it (``Route.call``), with these
    signatures. q, k, v, out and lse are CuPy arrays (or, for FP8, the e4m3 bytes) on the
    problem's device, which is current; the launch goes on CuPy's current stream."""

    __name__: str

    def variants(self) -> list[runtime.KernelSpec]:
        """Every kernel variant the launcher may load, for every architecture it runs on."""

    def forward(self, problem, q, k, v, out, lse, **operands) -> None:
        """Fixed-length attention of ``problem`` into ``out`` and ``lse``; ``operands`` are
        what the input format adds (FP8's descales, block-scaled scales)."""

    def backward(self, problem, dout, q, k, v, out, lse, dq, dk, dv, *, deterministic: bool,
                 cu_seqlens_q=None, cu_seqlens_k=None, sinks=None) -> object:
        """The gradients of the forward (AttentionProblem.from_backward or
        from_varlen_backward) into ``dq``, ``dk``, ``dv``: 4-d arrays, packed sequences as
        views of batch extent 1 with their cu_seqlens, lse (batch, heads_q, seqlen_q) (packed:
        (1, heads_q, total_q)). Returns the workspace it allocated (backward_prepost.Workspace),
        for its size and the sinks' gradient (Workspace.dsinks)."""

    def serve(self, problem, q, k, v, out, lse, *, seqused_k=None, block_table=None,
              cu_seqlens_q=None, cu_seqlens_k=None, sinks=None) -> None:
        """Attention over a KV cache or a varlen batch (AttentionProblem.from_kvcache or
        from_varlen): q and out (batch, seqlen_q, heads_q, D), or with cu_seqlens_q (1,
        total_q, heads_q, D) and lse (1, heads_q, total_q); k and v a cache (contiguous, or
        paged with block_table) or, with cu_seqlens_k, (1, total_k, heads_kv, D)."""
