"""The serving entry points: attention over variable-length batches and over KV caches
(contiguous or paged, with new keys appended in place), and the merge of partial attention
states. Each checks its call once (ptxattn.problem), picks a route (ptxattn.dispatch) and
launches (ptxattn.launchers)."""

from __future__ import annotations

import numbers

import numpy as np

from .interop import framework_arrays
from .problem import (AttentionProblem, check_kvcache_contents, check_positive_strides,
                      check_varlen_contents, dtype_of)

__all__ = ["attention_with_kvcache", "attention_varlen", "merge_attention_states"]


@framework_arrays
def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k_new=None,
                           v_new=None, causal: bool = True, window=(-1, -1), softcap: float = 0.0,
                           sinks=None, softmax_scale: float | None = None, num_splits: int = 0,
                           return_lse: bool = False, out=None, check_contents: bool = True,
                           backend: str | None = None):
    """Attention of new query tokens over a KV cache: decoding (one token a sequence),
    speculative decoding and chunked prefill (several).

    q: (batch, seqlen_q, heads_q, head_dim). The cache is contiguous, k_cache and v_cache of
    shape (batch, seqlen_cache, heads_kv, head_dim), or paged, (num_pages, page_size, heads_kv,
    head_dim) with ``block_table`` an int32 (batch, max_pages) array naming each sequence's
    pages in order (page_size a multiple of 16 up to 256). ``cache_seqlens`` (an int, or int32
    (batch,)) is each sequence's filled length. ``k_new``/``v_new`` (batch, seqlen_new, heads_kv,
    head_dim), if given, are first written into the cache at cache_seqlens, in place, and the
    queries then see cache_seqlens + seqlen_new keys. ``causal`` (the default) aligns the
    queries with the last keys; ``window`` = (left, right) keys around that diagonal (-1:
    unbounded); ``softcap`` > 0 caps the scaled scores at softcap * tanh(s / softcap); ``sinks``,
    float32 (heads_q,), are logits that join every row's softmax denominator.

    ``num_splits`` = 0 splits the keys over as many blocks as fill the GPU (1: no split).
    ``check_contents`` copies cache_seqlens and block_table to the host to check them against
    the cache (a synchronization); pass False in a hot loop whose values are known good: out of
    range values then read or write out of bounds. Returns the output like q and, with
    ``return_lse``, the float32 log-sum-exp (batch, heads_q, seqlen_q), sinks included.
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
        v_new=v_new, causal=causal, window=window, softcap=softcap, sinks=sinks,
        softmax_scale=softmax_scale, num_splits=num_splits, out=out)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, features=problem.features, backend=backend)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    with cupy.cuda.Device(problem.device):
        if check_contents:
            check_kvcache_contents(problem, cache_seqlens, block_table, k_cache.shape[0],
                                   seqlen_new)
        lengths = (cupy.full(problem.batch, cache_seqlens, dtype=cupy.int32)
                   if isinstance(cache_seqlens, numbers.Integral) else cache_seqlens)
        if k_new is not None:
            _append(k_cache, v_cache, k_new, v_new, lengths, block_table)
            lengths = lengths + seqlen_new
        if out is None:
            out = cupy.empty(problem.out_shape, dtype=problem.out_dtype)
        lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
        route.launcher.serve(problem, q, k_cache, v_cache, out, lse, seqused_k=lengths,
                             block_table=block_table, sinks=sinks)
    return (out, lse) if return_lse else out


def _append(k_cache, v_cache, k_new, v_new, lengths, block_table) -> None:
    """k_new, v_new into rows lengths[b] .. of each sequence's cache (its pages, if paged), as
    16-bit words so that any 16-bit dtype scatters alike."""
    import cupy

    batch, seqlen_new = k_new.shape[:2]
    positions = lengths[:, None] + cupy.arange(seqlen_new, dtype=cupy.int32)[None, :]
    if block_table is None:
        slots = cupy.broadcast_to(cupy.arange(batch, dtype=cupy.int32)[:, None], positions.shape)
        rows = positions
    else:
        page_size = k_cache.shape[1]
        slots = cupy.take_along_axis(block_table, positions // page_size, axis=1)
        rows = positions % page_size
    k_cache.view(cupy.uint16)[slots, rows] = k_new.view(cupy.uint16)
    v_cache.view(cupy.uint16)[slots, rows] = v_new.view(cupy.uint16)


@framework_arrays
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     *, causal: bool = False, softmax_scale: float | None = None,
                     window=(-1, -1), softcap: float = 0.0, sinks=None, return_lse: bool = False,
                     out=None, check_contents: bool = True, backend: str | None = None):
    """Attention over a batch of sequences of their own lengths, packed back to back.

    q: (total_q, heads_q, head_dim), k and v: (total_k, heads_kv, head_dim); sequence b holds
    rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and likewise of k and v (int32, batch + 1
    entries, from 0; empty sequences allowed). ``max_seqlen_q/k`` bound the lengths. Masks,
    softcap and sinks as in :func:`attention_with_kvcache` (``causal`` defaults to False here,
    aligned bottom-right per sequence). ``check_contents`` copies the cu_seqlens to the host to
    check them (pass False in a hot loop with known-good values). Returns the output like q
    and, with ``return_lse``, the float32 LSE of shape (heads_q, total_q).
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        window=window, softcap=softcap, sinks=sinks, softmax_scale=softmax_scale, out=out)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, features=problem.features, backend=backend)
    with cupy.cuda.Device(problem.device):
        if check_contents:
            check_varlen_contents(problem, cu_seqlens_q, cu_seqlens_k, k.shape[0])
        if out is None:
            out = cupy.empty(q.shape, dtype=problem.out_dtype)
        lse = cupy.empty((problem.heads_q, problem.total_q), dtype=cupy.float32)
        route.launcher.serve(problem, q[None], k[None], v[None], out[None], lse[None],
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    return (out, lse) if return_lse else out


MERGE_DTYPES = ("float16", "bfloat16", "float32")


@framework_arrays
def merge_attention_states(out_parts, lse_parts, *, sinks=None):
    """The attention output over the union of disjoint key sets, from the outputs and LSEs
    computed over each set alone (split-KV decoding, context-parallel ring steps, a cached
    prefix and new tokens).

    out_parts: (num_parts, batch, seqlen, heads, head_dim), float16, bfloat16 or float32, unit
    stride in head_dim (head_dim a multiple of 4), or a sequence of such (batch, seqlen, heads,
    head_dim) arrays; lse_parts: float32 (num_parts, batch, heads, seqlen), natural log, -inf
    for a part without keys (its output is then ignored), or a sequence of (batch, heads,
    seqlen) arrays. ``sinks`` (float32 (heads,)) join the denominators. Returns (out, lse): out
    in the parts' dtype, lse float32 (batch, heads, seqlen); a row no part saw gives zeros and
    -inf. Sums run in part order: the result is deterministic.
    """
    import cupy

    from .launchers import split_kv

    for name, parts in (("out_parts", out_parts), ("lse_parts", lse_parts)):
        if isinstance(parts, (list, tuple)):
            for i, x in enumerate(parts):
                if not isinstance(x, cupy.ndarray):
                    raise TypeError(f"{name}[{i}] must be a cupy.ndarray (a list of parts is "
                                    f"stacked with CuPy; pass one stacked array of another "
                                    f"framework), got {type(x).__module__}.{type(x).__name__}")
    if isinstance(out_parts, (list, tuple)):
        out_parts = cupy.stack(out_parts)
    if isinstance(lse_parts, (list, tuple)):
        lse_parts = cupy.stack(lse_parts)
    dtype = dtype_of("out_parts", out_parts)
    if dtype.name not in MERGE_DTYPES:
        raise TypeError(f"out_parts must have dtype float16, bfloat16 or float32, got {dtype}")
    if dtype_of("lse_parts", lse_parts) != np.float32:
        raise TypeError(f"lse_parts must have dtype float32, got {lse_parts.dtype}")
    if out_parts.ndim != 5 or out_parts.size == 0:
        raise ValueError(f"out_parts must be a non-empty (num_parts, batch, seqlen, heads, "
                         f"head_dim) array, got shape {tuple(out_parts.shape)}")
    num_parts, batch, seqlen, heads, head_dim = out_parts.shape
    if tuple(lse_parts.shape) != (num_parts, batch, heads, seqlen):
        raise ValueError(f"lse_parts must have shape (num_parts, batch, heads, seqlen) = "
                         f"{(num_parts, batch, heads, seqlen)}, got {tuple(lse_parts.shape)}")
    if head_dim % 4 or out_parts.strides[-1] != out_parts.itemsize:
        raise ValueError(f"out_parts must have unit stride in a head_dim that is a multiple of "
                         f"4, got head_dim {head_dim} and strides {out_parts.strides}")
    vector = 4 * out_parts.itemsize
    if out_parts.data.ptr % vector or any(s % vector for s in out_parts.strides[:-1]):
        raise ValueError(f"out_parts must have a base and strides that are multiples of "
                         f"{vector} bytes (4 elements), got strides {out_parts.strides}")
    for name, x in (("out_parts", out_parts), ("lse_parts", lse_parts)):
        check_positive_strides(name, x)
    device = out_parts.device.id
    others = {"lse_parts": lse_parts}
    if sinks is not None:
        if dtype_of("sinks", sinks) != np.float32:
            raise TypeError(f"sinks must have dtype float32, got {sinks.dtype}")
        if tuple(sinks.shape) != (heads,):
            raise ValueError(f"sinks must have shape (heads,) = ({heads},), got "
                             f"{tuple(sinks.shape)}")
        others["sinks"] = sinks
    for name, x in others.items():
        if x.device.id != device:
            raise ValueError(f"{name} must be on out_parts' device {device}, got "
                             f"{x.device.id}")
    if sinks is not None:
        sinks = cupy.ascontiguousarray(sinks)
    with cupy.cuda.Device(device):
        out = cupy.empty((batch, seqlen, heads, head_dim), dtype=out_parts.dtype)
        lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
        split_kv.combine(out_parts, lse_parts, out, lse, sinks)
    return out, lse
