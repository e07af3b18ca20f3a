"""The serving paths against the FP32 reference, on the GPU: attention over KV caches
(contiguous and paged, appended in place, split over blocks), variable-length batches, masks,
softcap and sinks, and merge_attention_states.

Tolerance as in test_attention.py: the kernel's max error against FP32 is at most twice that of
the same math done naively in the input precision, plus the rounding noise of one value.
"""

import math

import numpy as np
import pytest

from inputs import assert_within_naive_error, reference_of_sequence

pytestmark = pytest.mark.gpu


def _random(shape, rng, dtype="bfloat16", scale=1.0):
    import cupy
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def _paged(k_contig, page_size, rng):
    """A paged copy of a contiguous cache (batch, capacity, heads, D): every sequence's pages
    shuffled over one pool, with spare pages between. Returns (pages, block_table)."""
    import cupy

    batch, capacity, heads, head_dim = k_contig.shape
    per_seq = math.ceil(capacity / page_size)
    num_pages = batch * per_seq + 3
    order = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq)
    padded = cupy.zeros((batch, per_seq * page_size, heads, head_dim), dtype=k_contig.dtype)
    padded[:, :capacity] = k_contig
    pool = _random((num_pages, page_size, heads, head_dim), rng, k_contig.dtype)
    pool[cupy.asarray(order.ravel())] = padded.reshape(batch * per_seq, page_size, heads,
                                                       head_dim)
    return pool, cupy.asarray(order.astype(np.int32))


def _check_kvcache(q, k, v, lengths, out, lse, **masks):
    """out, lse of attention_with_kvcache against the reference, sequence by sequence, over
    the first lengths[b] keys of the contiguous caches k, v."""
    import cupy

    dtype = q.dtype
    for b, length in enumerate(lengths):
        args = (q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length])
        ref, ref_lse = reference_of_sequence(*args, "float32", **masks)
        naive, naive_lse = reference_of_sequence(*args, "input", **masks)
        assert_within_naive_error(out[b:b + 1], lse[b:b + 1], ref, ref_lse, naive, naive_lse,
                                  dtype)
    assert out.dtype == dtype and lse.dtype == cupy.float32


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (16, 2), (32, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_contiguous(seqlen_q, heads, head_dim, rng):
    import cupy
    import ptxattn

    heads_q, heads_kv = heads
    batch, capacity = 3, 700
    q = _random((batch, seqlen_q, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    lengths = [700, 1 + seqlen_q, 333]
    cache_seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    out, lse = ptxattn.attention_with_kvcache(q, k, v, cache_seqlens=cache_seqlens,
                                              return_lse=True)
    _check_kvcache(q, k, v, lengths, out, lse, causal=True)


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_paged_matches_reference(page_size, dtype, rng):
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv, head_dim = 4, 600, 16, 4, 128
    q = _random((batch, 2, heads_q, head_dim), rng, dtype)
    k = _random((batch, capacity, heads_kv, head_dim), rng, dtype)
    v = _random((batch, capacity, heads_kv, head_dim), rng, dtype)
    k_pages, table = _paged(k, page_size, rng)
    v_pages = cupy.zeros_like(k_pages)
    v_pages[table.ravel()] = cupy.pad(v, ((0, 0), (0, table.shape[1] * page_size - capacity),
                                          (0, 0), (0, 0))).reshape(-1, page_size, heads_kv,
                                                                   head_dim)
    lengths = [600, 2, 17, 301]
    # the split count follows the capacity, which page rounding changes: fix it to compare
    out, lse = ptxattn.attention_with_kvcache(
        q, k_pages, v_pages, block_table=table, num_splits=3,
        cache_seqlens=cupy.asarray(np.array(lengths, dtype=np.int32)), return_lse=True)
    _check_kvcache(q, k, v, lengths, out, lse, causal=True)
    contiguous = ptxattn.attention_with_kvcache(
        q, k, v, cache_seqlens=cupy.asarray(np.array(lengths, dtype=np.int32)), num_splits=3)
    assert bool((contiguous == out).all()), "paged and contiguous caches differ"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 48])
def test_decode_paged_long_sequences(page_size, head_dim, rng):
    """One block walks 1500 keys (one split): the staged page table's slots (kv_cache.cuh
    StagedPages) wrap many times, and every head_dim steps its rows through the pages at its
    own stride. Then the launcher's own split: 64 tiles take one wave of one block an SM (two
    splits on an H100)."""
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv = 8, 1500, 16, 8
    q = _random((batch, 1, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    k_pages, table = _paged(k, page_size, rng)
    v_pages = cupy.zeros_like(k_pages)
    v_pages[table.ravel()] = cupy.pad(v, ((0, 0), (0, table.shape[1] * page_size - capacity),
                                          (0, 0), (0, 0))).reshape(-1, page_size, heads_kv,
                                                                   head_dim)
    lengths = [1500, 1377, 1500, 900, 1499, 1200, 1, 1450]
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    for splits in (1, 0):
        out, lse = ptxattn.attention_with_kvcache(q, k_pages, v_pages, block_table=table,
                                                  num_splits=splits, cache_seqlens=seqlens,
                                                  return_lse=True)
        _check_kvcache(q, k, v, lengths, out, lse, causal=True)
        contiguous = ptxattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                    num_splits=splits)
        assert bool((contiguous == out).all()), (splits, "paged and contiguous caches differ")


def test_every_split_count_gives_the_same_answer(rng):
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv, head_dim = 2, 2000, 8, 2, 128
    q = _random((batch, 1, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    lengths = [2000, 1100]
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    max_splits = math.ceil(capacity / 64)  # one key block each
    for splits in [1, 2, 3, 7, 16, max_splits, 128]:
        out, lse = ptxattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                  num_splits=splits, return_lse=True)
        _check_kvcache(q, k, v, lengths, out, lse, causal=True)


@pytest.mark.parametrize("launcher, seqlen_q", [("portable_decode", 1), ("hopper_forward", 128)])
def test_a_repeated_split_launch_keeps_its_partials_to_itself(launcher, seqlen_q, rng):
    """The second launch over the same arrays reuses the prepared split launch (through the
    launcher, so that out and lse stay the same arrays): its partials' buffers must still be its
    own, so memory allocated between the calls stays untouched and the answer is the same."""
    import importlib

    import cupy
    from ptxattn import problem as problem_module, runtime

    module = importlib.import_module(f"ptxattn.launchers.{launcher}")
    if runtime.device_arch() not in module.ARCHS:
        pytest.skip(f"launchers.{launcher} does not run on {runtime.device_arch()}")
    batch, capacity, heads_q, heads_kv, head_dim = 2, 2000, 8, 2, 128
    q = _random((batch, seqlen_q, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    seqlens = cupy.asarray(np.array([2000, 1100], dtype=np.int32))
    problem = problem_module.AttentionProblem.from_kvcache(q, k, v, cache_seqlens=seqlens,
                                                           num_splits=4)
    out = cupy.empty_like(q)
    lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
    module.serve(problem, q, k, v, out, lse, seqused_k=seqlens)
    first = out.copy()
    # as large as the partials: the pool hands out what it got back
    fillers = [cupy.full((4, batch * seqlen_q, heads_q, head_dim), 7.0, dtype=cupy.float32)
               for _ in range(4)]
    fillers += [cupy.full((4, heads_q, batch * seqlen_q), 7.0, dtype=cupy.float32)
                for _ in range(4)]
    module.serve(problem, q, k, v, out, lse, seqused_k=seqlens)
    assert all(bool((f == 7.0).all()) for f in fillers), "a cached launch wrote freed memory"
    assert bool((out == first).all())
    _check_kvcache(q, k, v, [2000, 1100], out, lse, causal=True)


def test_append_then_attend(rng):
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv, head_dim, page_size = 3, 320, 8, 2, 64, 32
    q = _random((batch, 3, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    k_new = _random((batch, 3, heads_kv, head_dim), rng)
    v_new = _random((batch, 3, heads_kv, head_dim), rng)
    lengths = [0, 100, 317]
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    k_pages, table = _paged(k, page_size, rng)
    v_pages, _ = _paged(v, page_size, rng)
    # v_pages must follow k_pages' table: rebuild it from the same order
    v_pages[table.ravel()] = v.reshape(-1, page_size, heads_kv, head_dim)
    out, lse = ptxattn.attention_with_kvcache(q, k_pages, v_pages, block_table=table,
                                              cache_seqlens=seqlens, k_new=k_new, v_new=v_new,
                                              return_lse=True)
    for b, length in enumerate(lengths):
        k[b, length:length + 3] = k_new[b]
        v[b, length:length + 3] = v_new[b]
    _check_kvcache(q, k, v, [n + 3 for n in lengths], out, lse, causal=True)
    pages_back = k_pages[table].reshape(batch, -1, heads_kv, head_dim)[:, :capacity]
    assert bool((pages_back == k).all()), "k_new was not written where the cache expects it"


@pytest.mark.parametrize("masks", [
    dict(causal=True, window=(100, -1)),
    dict(causal=False, window=(50, 7)),
    dict(causal=True, softcap=20.0),
    dict(causal=True, sinks=True),
    dict(causal=False, window=(300, 0), softcap=5.0, sinks=True),
])
@pytest.mark.parametrize("splits", [1, 5])
def test_masks_softcap_sinks_over_a_cache(masks, splits, rng):
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv, head_dim = 2, 900, 8, 2, 128
    q = _random((batch, 8, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng, scale=2.0)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    masks = dict(masks)
    if masks.pop("sinks", False):
        masks["sinks"] = cupy.asarray(rng.standard_normal(heads_q, dtype=np.float32) * 3)
    lengths = [900, 450]
    out, lse = ptxattn.attention_with_kvcache(
        q, k, v, cache_seqlens=cupy.asarray(np.array(lengths, dtype=np.int32)),
        num_splits=splits, return_lse=True, **masks)
    _check_kvcache(q, k, v, lengths, out, lse, **masks)


def _check_varlen(seqlens_q, seqlens_k, heads, head_dim, rng, backend=None, dtype="bfloat16",
                  **masks):
    """attention_varlen over sequences of these lengths against the reference, sequence by
    sequence (``sinks=True``: random sinks)."""
    import cupy
    import ptxattn

    heads_q, heads_kv = heads
    if masks.pop("sinks", False):
        masks["sinks"] = cupy.asarray(rng.standard_normal(heads_q, dtype=np.float32) * 3)
    cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
    q = _random((int(cu_q[-1]), heads_q, head_dim), rng, dtype)
    k = _random((int(cu_k[-1]), heads_kv, head_dim), rng, dtype)
    v = _random((int(cu_k[-1]), heads_kv, head_dim), rng, dtype)
    out, lse = ptxattn.attention_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                        max(seqlens_q), max(seqlens_k), return_lse=True,
                                        backend=backend, **masks)
    assert lse.shape == (heads_q, int(cu_q[-1]))
    for b in range(len(seqlens_q)):
        if seqlens_q[b] == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        args = (q[None, rows], k[None, keys], v[None, keys])
        ref, ref_lse = reference_of_sequence(*args, "float32", **masks)
        naive, naive_lse = reference_of_sequence(*args, "input", **masks)
        assert_within_naive_error(out[None, rows], lse[None, :, rows], ref, ref_lse, naive,
                                  naive_lse, q.dtype)


@pytest.mark.parametrize("backend", [None, "portable"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_varlen_matches_each_sequence(backend, causal, heads, rng):
    """Zero-length, length-1 and very unequal sequences; on Hopper the default backend runs
    the Hopper kernel's serving build, "portable" the decode kernel."""
    _check_varlen([0, 1, 300, 5, 1000, 64], [7, 1, 300, 0, 1200, 64], heads, 128, rng,
                  backend=backend, causal=causal)


@pytest.mark.parametrize("masks", [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window=(100, -1)),
    dict(causal=False, window=(50, 7)),
    dict(causal=False, window=(300, 0)),
    dict(causal=False, window=(-1, 20)),
    dict(causal=True, sinks=True),
    dict(causal=False, window=(200, 0), sinks=True),
])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_prefill_with_windows(masks, head_dim, rng):
    """Sequences of a tile and longer, partial tiles and windows narrower than a key block;
    max_seqlen_q is large enough for the prefill route."""
    _check_varlen([129, 64, 700, 1, 383], [129, 300, 700, 2000, 383], (8, 2), head_dim, rng,
                  **masks)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_over_a_cache_reads_only_filled_rows(dtype, causal, head_dim, rng):
    """Chunked prefill: new query tokens over a contiguous cache whose rows past each
    sequence's filled length are NaN (an unwritten cache); those rows must not reach any
    output. Lengths below the query count leave the causal rows above the diagonal empty."""
    _check_unfilled_rows_unread([1100, 517, 200, 64], 1100, 200, head_dim, rng, dtype, causal)


def _check_unfilled_rows_unread(lengths, capacity, seqlen_q, head_dim, rng, dtype, causal):
    """attention_with_kvcache over caches that are NaN past each sequence's filled length (an
    unwritten cache) against the reference over the filled rows: no NaN may reach an output."""
    import cupy
    import ptxattn

    batch, heads_q, heads_kv = len(lengths), 8, 2
    q = _random((batch, seqlen_q, heads_q, head_dim), rng, dtype)
    k = _random((batch, capacity, heads_kv, head_dim), rng, dtype)
    v = _random((batch, capacity, heads_kv, head_dim), rng, dtype)
    garbage_k, garbage_v = k.copy(), v.copy()
    for b, length in enumerate(lengths):
        garbage_k[b, length:] = cupy.nan
        garbage_v[b, length:] = cupy.nan
    out, lse = ptxattn.attention_with_kvcache(
        q, garbage_k, garbage_v, cache_seqlens=cupy.asarray(np.array(lengths, dtype=np.int32)),
        causal=causal, return_lse=True)
    _check_kvcache(q, k, v, lengths, out, lse, causal=causal)


def test_merge_attention_states_equals_attention_over_all_keys(rng):
    import cupy
    import ptxattn
    from ptxattn import reference

    q = _random((2, 33, 4, 64), rng)
    k = _random((2, 300, 4, 64), rng)
    v = _random((2, 300, 4, 64), rng)
    bounds = [0, 10, 10, 200, 300]  # one empty part
    outs, lses = [], []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if start == stop:
            outs.append(cupy.full(q.shape, cupy.nan, dtype=cupy.float32))
            lses.append(cupy.full((2, 4, 33), -cupy.inf, dtype=cupy.float32))
            continue
        out, lse = reference.attention(q, k[:, start:stop], v[:, start:stop], return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = ptxattn.merge_attention_states(outs, lses)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert float(cupy.abs(out - ref).max()) < 1e-5
    assert float(cupy.abs(lse - ref_lse).max()) < 1e-5
    again, _ = ptxattn.merge_attention_states(cupy.stack(outs), cupy.stack(lses))
    assert bool((again == out).all()), "the merge is not deterministic"


@pytest.mark.parametrize("head_dim", [64, 256])
def test_prefill_split_counts_agree(head_dim, rng):
    """The Hopper serving build's split-KV (and the decode kernel's, on other GPUs): every
    forced split count, and the automatic one, against the reference, sinks included."""
    import cupy
    import ptxattn

    batch, capacity, heads_q, heads_kv = 2, 1500, 4, 1
    lengths = [1500, 700]
    q = _random((batch, 100, heads_q, head_dim), rng)
    k = _random((batch, capacity, heads_kv, head_dim), rng)
    v = _random((batch, capacity, heads_kv, head_dim), rng)
    sinks = cupy.asarray(rng.standard_normal(heads_q, dtype=np.float32))
    for splits in (0, 1, 2, 3, 7, 24):
        out, lse = ptxattn.attention_with_kvcache(
            q, k, v, cache_seqlens=cupy.asarray(np.array(lengths, dtype=np.int32)),
            num_splits=splits, sinks=sinks, return_lse=True)
        _check_kvcache(q, k, v, lengths, out, lse, causal=True, sinks=sinks)


def test_decode_reads_only_filled_rows(rng):
    """Single-token decode over a cache that is NaN past each filled length."""
    _check_unfilled_rows_unread([700, 333, 1], 700, 1, 128, rng, "bfloat16", causal=True)


def test_attention_with_a_window_alone(rng):
    import ptxattn

    q = _random((2, 300, 8, 128), rng)
    k = _random((2, 300, 2, 128), rng, scale=2.0)
    v = _random((2, 300, 2, 128), rng)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, causal=True, window=(64, -1))
    _check_kvcache(q, k, v, [300, 300], out, lse, causal=True, window=(64, -1))


def test_attention_with_sinks_and_few_query_rows(rng):
    """Fixed-length calls of a few query rows with sinks or a window take the decode kernel
    (dispatch's "decode" feature), over all of k and v, called twice on the same arrays (the
    second launch prepared once)."""
    import cupy
    import ptxattn

    q = _random((3, 5, 8, 64), rng)
    k = _random((3, 700, 2, 64), rng, scale=2.0)
    v = _random((3, 700, 2, 64), rng)
    sinks = cupy.asarray(rng.standard_normal(8, dtype=np.float32))
    for masks in (dict(causal=True, sinks=sinks), dict(causal=False, window=(100, 20))):
        for _ in range(2):
            out, lse = ptxattn.attention(q, k, v, return_lse=True, **masks)
            _check_kvcache(q, k, v, [700, 700, 700], out, lse, **masks)


def test_attention_with_window_softcap_sinks(rng):
    import cupy
    import ptxattn

    q = _random((2, 300, 8, 128), rng)
    k = _random((2, 300, 2, 128), rng, scale=2.0)
    v = _random((2, 300, 2, 128), rng)
    sinks = cupy.asarray(rng.standard_normal(8, dtype=np.float32))
    masks = dict(causal=True, window=(64, -1), softcap=10.0, sinks=sinks)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, **masks)
    _check_kvcache(q, k, v, [300, 300], out, lse, **masks)
