"""The serving entry points, exported as ``ptxattn.attention_varlen``,
``ptxattn.attention_varlen_backward``, ``ptxattn.attention_with_kvcache``,
``ptxattn.attention_mla_decode`` and ``ptxattn.merge_attention_states``: attention over
variable-length batches (and its gradients) and over KV caches (contiguous or paged, 16-bit or
FP8, with new keys appended in place), multi-head latent attention over a latent cache, and the
merge of partial attention states.

Each checks its call once (ptxattn/problem/), picks a route (ptxattn/dispatch.py) and launches it
(ptxattn/launchers/; the merge runs kernels/combine.cu through ptxattn/launchers/split_kv.py).
"""

from __future__ import annotations

import numbers

import numpy as np

from .interop import framework_arrays
from .problem import (AttentionProblem, check_kvcache_contents, check_positive_strides,
                      check_varlen_contents, dtype_of)

__all__ = ["attention_with_kvcache", "attention_mla_decode", "attention_varlen",
           "attention_varlen_backward", "merge_attention_states"]


def __dir__():
    return sorted(__all__)


@framework_arrays
def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k_new=None,
                           v_new=None, causal: bool = True, window=(-1, -1), softcap: float = 0.0,
                           sinks=None, softmax_scale: float | None = None, num_splits: int = 0,
                           return_lse: bool = False, out=None, check_contents: bool = True,
                           backend: str | None = None, k_descale=None, v_descale=None):
    """Attention of new query tokens over a KV cache, contiguous or paged, new keys appended.

    For decoding (one query token a sequence), speculative decoding and chunked prefill
    (several). If ``k_new`` and ``v_new`` are given they are first written into the cache in
    place, at rows cache_seqlens .. cache_seqlens + seqlen_new of each sequence (its pages if
    paged), and the queries then see cache_seqlens + seqlen_new keys; ``cache_seqlens`` itself
    is not advanced (the caller adds seqlen_new for the next step). Arrays, kinds of array and
    streams as in ``ptxattn.attention``: every 16-bit array non-empty and 4-d with unit stride
    in head_dim, a 16-byte aligned base and batch/seqlen/heads strides that are positive
    multiples of 16 bytes, all on q's device.

    On Hopper a contiguous cache with at least 64 query rows a sequence and no softcap runs on
    the serving build of the Hopper forward; paged caches, a softcap and decode steps (fewer
    than 64 query rows) run on the portable split-KV decode kernel, as do all calls on other
    GPUs.

    Parameters
    ----------
    q : CUDA array
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16; head_dim a
        multiple of 8 from 8 to 256; heads_q a multiple of heads_kv (GQA/MQA).
    k_cache, v_cache : CUDA array or ptxattn.fp8.E4M3Array
        The cache, in q's dtype or FP8 (e4m3: ``fp8.E4M3Array``, a torch float8_e4m3fn tensor
        or a CuPy float8_e4m3fn view, both caches, with ``k_descale`` and ``v_descale``):
        contiguous, (batch, seqlen_cache, heads_kv, head_dim), or paged, (num_pages,
        page_size, heads_kv, head_dim) with ``block_table``, page_size a multiple of 16 from
        16 to 256. v_cache has k_cache's shape but for its last axis, head_dim_v: a multiple of
        8 at most head_dim, the output's head_dim (an e4m3 cache: head_dim itself, a multiple
        of 16).
    cache_seqlens : int or CUDA array
        Each sequence's filled length: one int for every sequence, or an int32 (batch,)
        contiguous array. In [0, capacity], capacity seqlen_cache (contiguous) or max_pages *
        page_size (paged).
    block_table : CUDA array, optional
        For a paged cache: int32 (batch, max_pages), unit stride along the pages, naming each
        sequence's pages in order.
    k_new, v_new : CUDA array, optional
        Keys and values to append, given together: (batch, seqlen_new, heads_kv, head_dim) of
        q's dtype, v_new's last axis head_dim_v as v_cache's; cache_seqlens + seqlen_new must
        not exceed the capacity. Into an e4m3 cache they are quantized with the cache's
        descales: e4m3(k_new / k_descale), rounded to nearest even and saturated at +-448.
    causal : bool, default True
        Aligns the queries with the last keys: query i of a sequence of L keys (cache_seqlens
        + seqlen_new) sees key j only if j <= i + L - seqlen_q (bottom-right aligned). A row
        that sees no key gives output 0 and LSE -inf.
    window : tuple of (int, int), default (-1, -1)
        (left, right) keys around that diagonal: query i sees keys i + L - seqlen_q - left up
        to i + L - seqlen_q + right; -1 is unbounded (right is 0 when causal).
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap); 0 turns it off.
    sinks : CUDA array, optional
        float32 (heads_q,), contiguous: one logit per q head that joins every row's softmax
        denominator (and its log-sum-exp) and adds nothing to the output.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    num_splits : int, default 0
        How many blocks the keys of a sequence are split over: 0 chooses as many as fill the
        GPU, 1 splits nothing; at most 128.
    return_lse : bool, default False
        Also return the log-sum-exp.
    out : CUDA array, optional
        The buffer to write the output into: (batch, seqlen_q, heads_q, head_dim_v), q's
        dtype, laid out as q, its memory apart from every input's.
    check_contents : bool, default True
        Copy ``cache_seqlens`` and ``block_table`` to the host (a synchronization) to check
        that the lengths fit the cache and that the pages each sequence uses exist. Pass False
        in a hot loop whose values are known good: out of range values then read or write out
        of bounds.
    backend : {'hopper', 'portable'}, optional
        The kernel family, as in ``ptxattn.attention``; by default the first that runs the
        call on the current GPU.
    k_descale, v_descale : float or CUDA array, optional
        For e4m3 caches, and only for them: the float32 factors that turn the caches' values
        back into real ones, a value being e4m3(byte) * descale. Per tensor (a positive number,
        or shape () or (1,)) or per (sequence, kv head) (shape (batch, heads_kv)). The kernel
        dequantizes the cache in registers after loading it and applies the descales to the
        scores and the output.

    Returns
    -------
    out : array
        The output, (batch, seqlen_q, heads_q, head_dim_v) in q's dtype: ``out`` itself if
        given.
    lse : array
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log, sinks
        included; -inf for a row that sees no key.

    Raises
    ------
    TypeError
        An array argument in host memory or no array; q, the caches, k_new, v_new or out not
        of one float16 or bfloat16 dtype; ``cache_seqlens`` neither an int nor an array;
        ``cache_seqlens`` or ``block_table`` not int32; ``sinks`` not float32; ``causal`` not a
        bool; an e4m3 cache without its descales, or a descale not float32.
    ValueError
        A shape, stride or alignment above (the cache's head_dim or heads unlike q's, a
        contiguous cache of another batch than q, page_size, ``block_table``'s shape); head_dim
        or head_dim_v outside the rule above; ``k_new`` without ``v_new``; lengths beyond the
        cache's capacity (with ``check_contents``, also per sequence, and pages outside
        [0, num_pages)); ``num_splits`` outside [0, 128]; descales for a 16-bit cache, or of
        another shape; ``k_new`` into an e4m3 cache on a GPU below sm_89; a bad ``softmax_scale``, ``window``
        or ``softcap``; arrays on different devices; ``out`` overlapping an input; an unknown
        ``backend``, or a GPU on which no kernel runs the call.

    Examples
    --------
    One decoding step over a paged cache of 16-key pages, appending each sequence's new key:

    >>> import cupy, ptxattn
    >>> batch, heads_q, heads_kv, head_dim = 4, 32, 8, 128
    >>> k_cache = cupy.zeros((64, 16, heads_kv, head_dim), dtype="bfloat16")  # 64 pages
    >>> v_cache = cupy.zeros_like(k_cache)
    >>> block_table = cupy.arange(64, dtype=cupy.int32).reshape(batch, 16)
    >>> lengths = cupy.array([100, 7, 250, 31], dtype=cupy.int32)
    >>> q = cupy.random.standard_normal((batch, 1, heads_q, head_dim)).astype("bfloat16")
    >>> k_new = cupy.random.standard_normal((batch, 1, heads_kv, head_dim)).astype("bfloat16")
    >>> v_new = cupy.random.standard_normal((batch, 1, heads_kv, head_dim)).astype("bfloat16")
    >>> out = ptxattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
    ...                                      block_table=block_table, k_new=k_new, v_new=v_new)
    >>> lengths += 1  # the cache now holds one more key a sequence
    """
    problem = AttentionProblem.from_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
        v_new=v_new, causal=causal, window=window, softcap=softcap, sinks=sinks,
        softmax_scale=softmax_scale, num_splits=num_splits, out=out, k_descale=k_descale,
        v_descale=v_descale)
    out, lse = _serve_cache(problem, backend, q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                            block_table=block_table, k_new=k_new, v_new=v_new, sinks=sinks,
                            k_descale=k_descale, v_descale=v_descale, out=out,
                            check_contents=check_contents)
    return (out, lse) if return_lse else out


@framework_arrays
def attention_mla_decode(q, kv_cache, *, cache_seqlens, block_table=None, head_dim_v: int = 512,
                         softmax_scale: float | None = None, causal: bool = True,
                         num_splits: int = 0, return_lse: bool = False, out=None, kv_new=None,
                         kv_descale=None, check_contents: bool = True):
    """Multi-head latent attention (MLA) decoding over a latent cache, new rows appended.

    DeepSeek-V3/R1's and Kimi K2's attention at decode time, after the up-projections are
    absorbed into the queries and the output: every query head attends to one cache row per
    token of 576 columns (a 512-column compressed latent and 64 rotary ones), the row being the
    key and its first 512 columns the value. The cache is read once for all the heads of a
    tile, as FlashMLA's ``flash_mla_with_kvcache`` and FlashInfer's MLA decode do. Arrays,
    kinds of array, streams and the checks of lengths and pages as in
    ``ptxattn.attention_with_kvcache``, whose semantics this is with k_cache = kv_cache,
    v_cache = kv_cache[..., :head_dim_v] and one kv head.

    Parameters
    ----------
    q : CUDA array
        Queries, (batch, seqlen_q, heads_q, 576), float16 or bfloat16: the absorbed latent
        part then the rotary part, as the cache's rows. seqlen_q >= 1 tokens a sequence (more
        than one for speculative decoding), any number of heads (16 to 128 in DeepSeek-V3
        shards).
    kv_cache : CUDA array or ptxattn.fp8.E4M3Array
        The latent cache, one head: contiguous, (batch, seqlen_cache, 1, 576), or paged,
        (num_pages, page_size, 1, 576) with ``block_table``, page_size a multiple of 16 from 16
        to 256 (FlashMLA's is 64). In q's dtype, or FP8 (e4m3: ``fp8.E4M3Array``, a torch
        float8_e4m3fn tensor or a CuPy float8_e4m3fn view) with ``kv_descale``.
    cache_seqlens : int or CUDA array
        Each sequence's filled length: one int, or an int32 (batch,) contiguous array.
    block_table : CUDA array, optional
        For a paged cache: int32 (batch, max_pages), unit stride along the pages.
    head_dim_v : int, default 512
        The columns of a row that are the value: 512, the latent.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(576) by default (DeepSeek-V3
        passes its own, 1 / sqrt(192) times its YaRN factor).
    causal : bool, default True
        Bottom-right aligned, as in attention_with_kvcache: with seqlen_q > 1, query i of a
        sequence of L keys sees keys j <= i + L - seqlen_q.
    num_splits : int, default 0
        How many blocks the keys of a sequence are split over: 0 chooses, 1 splits nothing; at
        most 128.
    return_lse : bool, default False
        Also return the log-sum-exp.
    out : CUDA array, optional
        The output buffer, (batch, seqlen_q, heads_q, 512), q's dtype, laid out as q.
    kv_new : CUDA array, optional
        Rows to append, (batch, seqlen_new, 1, 576) in q's dtype, written at rows
        cache_seqlens .. of each sequence (quantized, e4m3(kv_new / kv_descale) saturated at
        +-448, into an e4m3 cache) before the queries attend; ``cache_seqlens`` is not advanced.
    kv_descale : float or CUDA array, optional
        For an e4m3 cache, and only for one: the float32 factor that turns its values back into
        real ones, per tensor (a positive number, or shape () or (1,)) or per sequence (shape
        (batch, 1)). It scales the scores and the output; the cache is dequantized in registers
        after it is loaded.
    check_contents : bool, default True
        Copy ``cache_seqlens`` and ``block_table`` to the host to check them, as in
        attention_with_kvcache.

    Returns
    -------
    out : array
        (batch, seqlen_q, heads_q, 512) in q's dtype: ``out`` itself if given.
    lse : array
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log; -inf (with
        zeros out) for a row that sees no key.

    Raises
    ------
    TypeError
        As attention_with_kvcache's; an e4m3 cache without ``kv_descale``.
    ValueError
        q's or kv_cache's last axis not 576, kv_cache with more than one head, head_dim_v other
        than 512, ``kv_descale`` for a 16-bit cache or of another shape, and
        attention_with_kvcache's layout, length and page checks; a GPU without the shared
        memory the kernel needs (201 KB a block: sm_90a, sm_100a, sm_103a), or kv_new into an
        e4m3 cache on a GPU below sm_89.

    Examples
    --------
    One decode step of 128 heads over a paged latent cache of 64-row pages:

    >>> import cupy, ptxattn
    >>> batch, heads = 4, 128
    >>> kv_cache = cupy.zeros((64, 64, 1, 576), dtype="bfloat16")  # 64 pages of 64 rows
    >>> block_table = cupy.arange(64, dtype=cupy.int32).reshape(batch, 16)
    >>> lengths = cupy.array([700, 1, 1000, 64], dtype=cupy.int32)
    >>> q = cupy.random.standard_normal((batch, 1, heads, 576)).astype("bfloat16")
    >>> kv_new = cupy.random.standard_normal((batch, 1, 1, 576)).astype("bfloat16")
    >>> out = ptxattn.attention_mla_decode(q, kv_cache, cache_seqlens=lengths,
    ...                                    block_table=block_table, kv_new=kv_new,
    ...                                    softmax_scale=192 ** -0.5)
    >>> out.shape
    (4, 1, 128, 512)
    """
    problem = AttentionProblem.from_mla_decode(
        q, kv_cache, cache_seqlens=cache_seqlens, block_table=block_table, head_dim_v=head_dim_v,
        kv_new=kv_new, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
        out=out, kv_descale=kv_descale)
    out, lse = _serve_cache(problem, None, q, kv_cache, kv_cache[..., :head_dim_v],
                            cache_seqlens=cache_seqlens, block_table=block_table, k_new=kv_new,
                            v_new=None, sinks=None, k_descale=kv_descale, v_descale=kv_descale,
                            out=out, check_contents=check_contents)
    return (out, lse) if return_lse else out


def _serve_cache(problem, backend, q, k_cache, v_cache, *, cache_seqlens, block_table, k_new,
                 v_new, sinks, k_descale, v_descale, out, check_contents):
    """attention_with_kvcache's and attention_mla_decode's work once their problem is built:
    the contents checked, the new keys appended, the route launched. Returns (out, lse)."""
    import cupy

    from . import dispatch, runtime
    from .quant.fp8 import QUANTIZER_ARCHS, descale_operand

    arch = runtime.device_arch(problem.device)
    route = dispatch.select(arch, problem.format, problem.head_dim,
                            head_dim_v=problem.head_dim_v, features=problem.features,
                            backend=backend)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    fp8 = problem.kv_format == "e4m3"
    if fp8 and k_new is not None and arch not in QUANTIZER_ARCHS:
        raise ValueError(f"{'kv_new' if 'mla' in problem.layouts else 'k_new'}: appending into an "
                         f"e4m3 cache quantizes on the GPU, which needs one of "
                         f"{list(QUANTIZER_ARCHS)}; this GPU is {arch}. Quantize the new rows "
                         "on the host, write them into the cache and pass cache_seqlens past them")
    with cupy.cuda.Device(problem.device):
        if check_contents:
            check_kvcache_contents(problem, cache_seqlens, block_table, k_cache.shape[0],
                                   seqlen_new)
        lengths = (cupy.full(problem.batch, cache_seqlens, dtype=cupy.int32)
                   if isinstance(cache_seqlens, numbers.Integral) else cache_seqlens)
        descales = {}
        if fp8:
            k_cache, v_cache = _e4m3_bytes(k_cache), _e4m3_bytes(v_cache)
            descales = {name: descale_operand(d, problem.batch, problem.heads_kv, 0)
                        for name, d in (("k_descale", k_descale), ("v_descale", v_descale))}
        if k_new is not None:
            _append(k_cache, v_cache, k_new, v_new, lengths, block_table, **descales)
            lengths = lengths + seqlen_new
        if out is None:
            out = cupy.empty(problem.out_shape, dtype=problem.out_dtype)
        lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
        route.launcher.serve(problem, q, k_cache, v_cache, out, lse, seqused_k=lengths,
                             block_table=block_table, sinks=sinks, **descales)
    return out, lse


def _e4m3_bytes(cache):
    """The uint8 storage of an e4m3 cache (an E4M3Array or a float8_e4m3fn view)."""
    import cupy

    return cache.bytes if hasattr(cache, "bytes") else cache.view(cupy.uint8)


def _append(k_cache, v_cache, k_new, v_new, lengths, block_table, k_descale=None,
            v_descale=None) -> None:
    """k_new, v_new into rows lengths[b] .. of each sequence's cache (its pages, if paged), as
    16-bit words so that any 16-bit dtype scatters alike; into uint8 e4m3 caches, quantized
    with their descales (quant.fp8.Descale) first. v_new None: v_cache is a view of k_cache's
    first columns (an MLA cache), written with k_new."""
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
    for cache, new, descale in ((k_cache, k_new, k_descale), (v_cache, v_new, v_descale)):
        if new is None:
            continue
        if descale is not None:
            cache[slots, rows] = _quantize_new(new, descale)
        else:
            cache.view(cupy.uint16)[slots, rows] = new.view(cupy.uint16)


def _quantize_new(x, descale):
    """e4m3(x / descale) of new cache rows (batch, seqlen_new, heads, head_dim), uint8. Rows wider
    than the quantizer's (an MLA cache's 576 columns, one head) go as pieces of 64 columns,
    the descale then per tensor or per sequence (its head stride unused)."""
    from .quant.fp8 import HEAD_DIMS, Descale, quantize_rows

    batch, seqlen_new, heads, head_dim = x.shape
    if head_dim <= max(HEAD_DIMS):
        return quantize_rows(x, descale)
    pieces = x.reshape(batch, seqlen_new, heads * head_dim // 64, 64)
    x8 = quantize_rows(pieces, Descale(descale.array, descale.stride_b, 0, 0))
    return x8.reshape(x.shape)


@framework_arrays
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     *, causal: bool = False, softmax_scale: float | None = None,
                     window=(-1, -1), softcap: float = 0.0, sinks=None, return_lse: bool = False,
                     out=None, lse=None, check_contents: bool = True,
                     backend: str | None = None):
    """Attention over a batch of sequences of their own lengths, packed back to back.

    Sequence b holds rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and rows cu_seqlens_k[b]
    .. cu_seqlens_k[b + 1] of k and v; empty sequences are allowed. Arrays, kinds of array and
    streams as in ``ptxattn.attention``: q, k, v and out are non-empty and 3-d with unit stride
    in head_dim, a 16-byte aligned base and token/heads strides that are positive multiples of
    16 bytes, all on q's device. On Hopper, calls with max_seqlen_q >= 64 and no softcap run on
    the serving build of the Hopper forward, the others on the portable decode kernel.

    Parameters
    ----------
    q : CUDA array
        Queries, (total_q, heads_q, head_dim), float16 or bfloat16; head_dim a multiple of 8
        from 8 to 256.
    k : CUDA array
        Keys, (total_k, heads_kv, head_dim), q's dtype; heads_q a multiple of heads_kv
        (GQA/MQA).
    v : CUDA array
        Values, (total_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a multiple of 8
        at most head_dim; the output has head_dim_v.
    cu_seqlens_q, cu_seqlens_k : CUDA array
        int32, contiguous, batch + 1 >= 2 entries each: the sequences' cumulative lengths,
        from 0, never decreasing, ending at total_q and total_k.
    max_seqlen_q, max_seqlen_k : int
        Non-negative bounds on the sequences' query and key lengths.
    causal : bool, default False
        Masks key j from query i of a sequence unless j <= i + seqlen_k - seqlen_q, with that
        sequence's lengths (bottom-right aligned per sequence). A row that sees no key gives
        output 0 and LSE -inf.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        (left, right) keys around each sequence's diagonal, as in ``attention_with_kvcache``;
        -1 is unbounded.
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap); 0 turns it off.
    sinks : CUDA array, optional
        float32 (heads_q,), contiguous: one logit per q head that joins every row's softmax
        denominator (and its log-sum-exp) and adds nothing to the output.
    return_lse : bool, default False
        Also return the log-sum-exp.
    out : CUDA array, optional
        The buffer to write the output into: (total_q, heads_q, head_dim_v), q's dtype, laid
        out as q, its memory apart from every input's.
    lse : CUDA array, optional
        The buffer to write the log-sum-exp into: float32, C-contiguous, (heads_q, total_q),
        apart from every input's.
    check_contents : bool, default True
        Copy the cu_seqlens to the host (a synchronization) to check them against the token
        counts and the maxima. Pass False in a hot loop whose values are known good.
    backend : {'hopper', 'portable'}, optional
        The kernel family, as in ``ptxattn.attention``.

    Returns
    -------
    out : array
        The output, (total_q, heads_q, head_dim_v) in q's dtype: ``out`` itself if given.
    lse : array
        Only with ``return_lse``: float32 (heads_q, total_q), natural log, sinks included;
        -inf for a row that sees no key (``lse`` itself if given). What
        ``attention_varlen_backward`` takes.

    Raises
    ------
    TypeError
        An array argument in host memory or no array; q, k, v or out not of one float16 or
        bfloat16 dtype; the cu_seqlens not int32; ``sinks`` not float32; ``causal`` not a
        bool.
    ValueError
        A shape, stride or alignment above; head_dim or head_dim_v outside the rule above;
        cu_seqlens of unlike shapes or fewer than 2 entries; a negative or non-int max_seqlen;
        with ``check_contents``, cu_seqlens that do not start at 0, decrease, miss the token
        count or hold a sequence longer than its maximum; a bad ``softmax_scale``, ``window``
        or ``softcap``; arrays on different devices; ``out`` overlapping an input; an unknown
        ``backend``, or a GPU on which no kernel runs the call.

    Examples
    --------
    Three sequences of 5, 0 and 11 tokens, causal self-attention:

    >>> import cupy, ptxattn
    >>> cu_seqlens = cupy.array([0, 5, 5, 16], dtype=cupy.int32)
    >>> q = cupy.random.standard_normal((16, 32, 128)).astype("bfloat16")
    >>> k = cupy.random.standard_normal((16, 8, 128)).astype("bfloat16")
    >>> v = cupy.random.standard_normal((16, 8, 128)).astype("bfloat16")
    >>> out, lse = ptxattn.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 11, 11,
    ...                                     causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((16, 32, 128), (32, 16))
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        window=window, softcap=softcap, sinks=sinks, softmax_scale=softmax_scale, out=out,
        lse=lse)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, head_dim_v=problem.head_dim_v,
                            features=problem.features, backend=backend)
    with cupy.cuda.Device(problem.device):
        if check_contents:
            check_varlen_contents(problem, cu_seqlens_q, cu_seqlens_k, k.shape[0])
        if out is None:
            out = cupy.empty((*q.shape[:2], problem.head_dim_v), dtype=problem.out_dtype)
        if lse is None:
            lse = cupy.empty((problem.heads_q, problem.total_q), dtype=cupy.float32)
        route.launcher.serve(problem, q[None], k[None], v[None], out[None], lse[None],
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks)
    return (out, lse) if return_lse else out


@framework_arrays
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                              softmax_scale: float | None = None, window=(-1, -1),
                              softcap: float = 0.0, sinks=None, deterministic: bool = False,
                              dq=None, dk=None, dv=None, dsinks=None,
                              check_contents: bool = True, backend: str | None = None):
    """The gradients of ``ptxattn.attention_varlen`` with respect to q, k and v (and the sinks).

    ``out`` and ``lse`` are what ``attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, ..., return_lse=True)`` returned, with the same options. Layouts,
    kinds of array and streams as there: q, k, v, out and dout 3-d, packed back to back. Each
    sequence's gradients are its own: a sequence with no keys gets dq = 0, one with no queries
    dk = dv = 0. The kernels, accumulation and ``deterministic`` are ``attention_backward``'s.

    Parameters
    ----------
    dout : CUDA array
        The gradient of the loss with respect to ``out``: out's shape, (total_q, heads_q,
        head_dim_v), and q's dtype.
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        The forward's arguments.
    out : CUDA array
        The forward's output, (total_q, heads_q, head_dim_v) in q's dtype.
    lse : CUDA array
        The forward's log-sum-exp: float32 (heads_q, total_q), unit stride along total_q.
    causal, softmax_scale, window, softcap, sinks
        As in the forward.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.
    dq, dk, dv : CUDA array, optional
        Buffers for the gradients, the shapes and dtype of q, k and v, overlapping no input.
    dsinks : CUDA array, optional
        With ``sinks``: the buffer for their gradient, float32 (heads_q,), contiguous.
    check_contents : bool, default True
        Check the cu_seqlens on the host first, as the forward does (a synchronization).
    backend : {'hopper', 'portable'}, optional
        The kernel family.

    Returns
    -------
    dq, dk, dv : tuple of array
        The gradients, like q, k and v (the buffers themselves if given).
    dsinks : array
        Only with ``sinks``: float32 (heads_q,), summed over every sequence's rows, the fourth
        element of the tuple.

    Raises
    ------
    TypeError, ValueError
        As ``attention_varlen`` and ``attention_backward`` raise them, for the arrays here.

    Examples
    --------
    >>> import cupy, ptxattn
    >>> cu_seqlens = cupy.array([0, 5, 5, 16], dtype=cupy.int32)
    >>> q, k, v = (cupy.random.standard_normal((16, 8, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> out, lse = ptxattn.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 11, 11,
    ...                                     causal=True, return_lse=True)
    >>> dq, dk, dv = ptxattn.attention_varlen_backward(
    ...     cupy.ones_like(out), q, k, v, out, lse, cu_seqlens, cu_seqlens, 11, 11, causal=True)
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, sinks=sinks,
        deterministic=deterministic, dq=dq, dk=dk, dv=dv, dsinks=dsinks)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, head_dim_v=problem.head_dim_v,
                            features=problem.backward_features,
                            backend=backend)
    with cupy.cuda.Device(problem.device):
        if check_contents:
            check_varlen_contents(problem, cu_seqlens_q, cu_seqlens_k, k.shape[0])
        dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
        workspace = route.launcher.backward(
            problem, dout[None], q[None], k[None], v[None], out[None], lse[None], dq[None],
            dk[None], dv[None], deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, sinks=sinks)
        if sinks is None:
            return dq, dk, dv
        return dq, dk, dv, workspace.dsinks(problem, out=dsinks)


MERGE_DTYPES = ("float16", "bfloat16", "float32")


@framework_arrays
def merge_attention_states(out_parts, lse_parts, *, sinks=None):
    """The attention output over the union of disjoint key sets, from each set's output and LSE.

    For split-KV decoding, context-parallel ring steps, or a cached prefix and new tokens: the
    parts are attention over disjoint sets of keys for the same queries, as
    ``ptxattn.attention(..., return_lse=True)`` returns them. Over the union, with M the
    largest lse_i of a row, lse = M + log(sum_i exp(lse_i - M)) and out = sum_i
    exp(lse_i - lse) out_i. Sums run in part order in FP32, so the result is deterministic.
    Arrays, kinds of array and streams as in ``ptxattn.attention`` (a list of parts must be of
    CuPy arrays).

    Parameters
    ----------
    out_parts : CUDA array or sequence of cupy.ndarray
        The parts' outputs, (num_parts, batch, seqlen, heads, head_dim) in float16, bfloat16
        or float32, non-empty, positive strides, unit stride in head_dim, head_dim a multiple
        of 4, base and strides multiples of 4 elements; or a list or tuple of (batch, seqlen,
        heads, head_dim) CuPy arrays, stacked here.
    lse_parts : CUDA array or sequence of cupy.ndarray
        The parts' log-sum-exps, float32 (num_parts, batch, heads, seqlen), natural log, or a
        list or tuple of (batch, heads, seqlen) CuPy arrays. -inf marks a part without keys
        for that row: its output is then ignored.
    sinks : CUDA array, optional
        float32 (heads,): logits that join every row's softmax denominator.

    Returns
    -------
    out : array
        (batch, seqlen, heads, head_dim) in the parts' dtype; zeros for a row no part saw.
    lse : array
        float32 (batch, heads, seqlen), sinks included; -inf for a row no part saw (its sink
        with sinks).

    Raises
    ------
    TypeError
        A list of parts holding anything but CuPy arrays; ``out_parts`` not float16, bfloat16
        or float32; ``lse_parts`` or ``sinks`` not float32; an array in host memory.
    ValueError
        ``out_parts`` not 5-d or empty; ``lse_parts`` not (num_parts, batch, heads, seqlen);
        head_dim not a multiple of 4, no unit stride in it, a base or stride not a multiple of
        4 elements, or a zero or negative stride; ``sinks`` not (heads,); arrays on different
        devices.

    Examples
    --------
    Attention over 4096 keys from two halves computed apart:

    >>> import cupy, ptxattn
    >>> q = cupy.random.standard_normal((2, 64, 16, 128)).astype("bfloat16")
    >>> k, v = (cupy.random.standard_normal((2, 4096, 16, 128)).astype("bfloat16")
    ...         for _ in range(2))
    >>> o1, l1 = ptxattn.attention(q, k[:, :2048], v[:, :2048], return_lse=True)
    >>> o2, l2 = ptxattn.attention(q, k[:, 2048:], v[:, 2048:], return_lse=True)
    >>> out, lse = ptxattn.merge_attention_states([o1, o2], [l1, l2])
    >>> out.shape, lse.shape
    ((2, 64, 16, 128), (2, 16, 64))
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
