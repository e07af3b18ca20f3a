"""Launcher of the Hopper kernel's serving build (``ptx_src/kernels/fwd_sm90.cu`` with
``Sm90Config::kServing``) for prefill: packed varlen batches and KV caches (new query tokens over
a contiguous cache's filled rows), with a local window, at the fixed-length kernel's tiles.

Split-KV when the tiles cannot fill the GPU, and attention sinks, as the decode launcher does.
Decoding (a few query rows a sequence, where reading K and V once per kv head matters more than
the tensor cores), softcap and paged caches run in the portable decode launcher
(ptxattn/decode.py); dispatch.py routes each call to one or the other by its features.
"""

from __future__ import annotations

from . import hopper, runtime

ARCHS = hopper.ARCHS
HEAD_DIMS = hopper.HEAD_DIMS


def variants() -> list[runtime.KernelSpec]:
    return [hopper.spec(dtype, head_dim, causal, serving=True) for dtype in hopper.DTYPES
            for head_dim in HEAD_DIMS for causal in (False, True)]


def forward(problem, q, k, v, out, lse, *, seqused_k=None, block_table=None, cu_seqlens_q=None,
            cu_seqlens_k=None, sinks=None) -> None:
    """Attention of ``problem`` (from AttentionProblem.from_kvcache or from_varlen) into ``out``
    and ``lse``, with decode.forward's arguments and layouts: q and out (batch, seqlen_q,
    heads_q, D), or with cu_seqlens_q (1, total_q, heads_q, D) and lse (1, heads_q, total_q);
    k and v the contiguous cache (batch, capacity, heads_kv, D) or, with cu_seqlens_k, (1,
    total_k, heads_kv, D)."""
    if block_table is not None or problem.softcap > 0:
        raise runtime.PtxattnError("the Hopper serving build takes no paged cache or softcap "
                                   "(dispatch routes those to the decode launcher)")
    seqs = hopper.Sequences(problem.batch, problem.seqlen_q, problem.seqlen_k, problem.total_q,
                            problem.window, cu_seqlens_q, cu_seqlens_k, seqused_k, sinks)
    hopper.forward_serving(q, k, v, out, lse, seqs, causal=problem.causal,
                           softmax_scale=problem.softmax_scale, num_splits=problem.num_splits)
