"""The serving entry points refuse bad arguments with a clear error before launch (issue #16),
without a GPU.

attention_with_kvcache and attention_varlen check metadata in AttentionProblem.from_kvcache /
from_varlen, tested here on MetaArray stand-ins as test_api_validation.py does, and contents
(lengths, page numbers) in check_kvcache_contents / check_varlen_contents, tested on stand-ins
whose .get() returns NumPy values. merge_attention_states checks inline; its tests and the
"checked before launch" tests pass MetaArrays, which interop.framework_arrays lets through as it
lets CuPy arrays through (no DLPack or array interface to convert).
"""

import numpy as np
import pytest

import ptxattn
from meta_array import MetaArray
from ptxattn import serving
from ptxattn.problem import AttentionProblem, check_kvcache_contents, check_varlen_contents

Q = (2, 4, 8, 64)  # batch, seqlen_q, heads_q, head_dim
CACHE = (2, 64, 2, 64)  # contiguous: batch, capacity, heads_kv, head_dim
POOL = (10, 16, 2, 64)  # paged: num_pages, page_size, heads_kv, head_dim; 4 pages a sequence
NEW = (2, 8, 2, 64)  # k_new, v_new: batch, seqlen_new, heads_kv, head_dim
CAPACITY = 64
NUM_PAGES = POOL[0]
Q_TOKENS, K_TOKENS = 10, 24  # varlen: rows of q and of k/v over the batch


def _at(mib, shape, dtype="bfloat16", **kwargs):
    """A stand-in at its own MiB, so that it overlaps no other unless a test means it to."""
    return MetaArray(shape, dtype, ptr=mib << 20, **kwargs)


class Packed(MetaArray):
    """A varlen (tokens, heads, head_dim) stand-in that takes x[None] as CuPy does (a leading
    axis of one with stride 0): from_varlen checks its operands' rows through that view."""

    def __getitem__(self, index):
        assert index is None
        return MetaArray((1, *self.shape), self.dtype, (0, *self.strides), self.data.ptr,
                         self.device.id)


class OnDevice:
    """A device array for the contents checks: the shape they read and, through .get(), the
    values that CuPy would copy to the host."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int32)
        self.shape = self.values.shape

    def get(self):
        return self.values


def _kvcache_args(paged=False):
    """A good attention_with_kvcache call: GQA 8:2, 64 keys a sequence, 32 filled."""
    args = dict(q=_at(1, Q), k_cache=_at(2, CACHE), v_cache=_at(3, CACHE), cache_seqlens=32)
    if paged:
        args.update(k_cache=_at(2, POOL), v_cache=_at(3, POOL),
                    block_table=_at(4, (2, CAPACITY // POOL[1]), "int32"))
    return args


def _kvcache(paged=False, **overrides):
    return AttentionProblem.from_kvcache(**{**_kvcache_args(paged), **overrides})


def _varlen_args():
    """A good attention_varlen call: two sequences, at most 6 queries and 16 keys each."""
    return dict(q=Packed((Q_TOKENS, 8, 64), ptr=1 << 20), k=Packed((K_TOKENS, 2, 64), ptr=2 << 20),
                v=Packed((K_TOKENS, 2, 64), ptr=3 << 20), cu_seqlens_q=_at(4, (3,), "int32"),
                cu_seqlens_k=_at(5, (3,), "int32"), max_seqlen_q=6, max_seqlen_k=16)


def _varlen(**overrides):
    return AttentionProblem.from_varlen(**{**_varlen_args(), **overrides})


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache: metadata


def test_good_kvcache_calls_pass():
    p = _kvcache()
    assert (p.format, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (
        "bfloat16", 2, 4, CAPACITY, 8, 2, 64)
    assert p.features == {"causal", "gqa", "kvcache", "decode"}
    p = _kvcache(paged=True, cache_seqlens=_at(9, (2,), "int32"), k_new=_at(5, NEW),
                 v_new=_at(6, NEW), out=_at(7, Q), sinks=_at(8, (8,), "float32"), causal=False,
                 window=(16, 0), softcap=30.0, num_splits=4)
    assert p.seqlen_k == CAPACITY and p.num_splits == 4 and p.window == (16, 0)
    assert p.features == {"gqa", "window", "softcap", "sinks", "kvcache", "paged", "decode"}


@pytest.mark.parametrize("paged,overrides", [
    pytest.param(False, dict(cache_seqlens=0), id="empty_cache"),
    pytest.param(False, dict(cache_seqlens=CAPACITY), id="full_cache"),
    pytest.param(False, dict(cache_seqlens=CAPACITY - 8, k_new=_at(5, NEW), v_new=_at(6, NEW)),
                 id="new_tokens_fill_the_cache"),
    pytest.param(True, dict(k_cache=_at(2, (10, 256, 2, 64)), v_cache=_at(3, (10, 256, 2, 64))),
                 id="page_size_256"),
    pytest.param(True, dict(block_table=_at(4, (2, 1), "int32"), cache_seqlens=POOL[1]),
                 id="one_page"),
    pytest.param(True, dict(block_table=_at(4, (2, 4), "int32", strides=(40, 4))),
                 id="table_sliced_from_a_wider_one"),
    pytest.param(False, dict(window=[-1, 0], softcap=0.0, num_splits=0), id="options_at_0"),
    pytest.param(False, dict(window=(0, 0), num_splits=128), id="options_at_the_top"),
])
def test_boundary_values_pass(paged, overrides):
    _kvcache(paged, **overrides)


@pytest.mark.parametrize("paged,overrides,error,match", [
    pytest.param(False, dict(causal=1), TypeError, r"causal must be a bool", id="causal_int"),
    pytest.param(False, dict(q=_at(1, Q, "float32")), TypeError,
                 r"q must have dtype float16 or bfloat16, got float32", id="q_float32"),
    pytest.param(False, dict(k_cache=_at(2, CACHE, "float16"), v_cache=_at(3, CACHE, "float16")),
                 TypeError, r"q, k_cache and v_cache must share a dtype, got bfloat16, float16",
                 id="cache_dtype_differs_from_q"),
    pytest.param(False, dict(v_cache=_at(3, (2, 48, 2, 64))), ValueError,
                 r"k_cache and v_cache must have the same shape", id="v_cache_shape"),
    pytest.param(False, dict(k_cache=_at(2, (2, 64, 2, 128)), v_cache=_at(3, (2, 64, 2, 128))),
                 ValueError, r"k_cache must have head_dim 64 like q, got 128",
                 id="cache_head_dim"),
    pytest.param(False, dict(q=_at(1, (2, 4, 8, 100)), k_cache=_at(2, (2, 64, 2, 100)),
                             v_cache=_at(3, (2, 64, 2, 100))),
                 ValueError, r"head_dim must be a multiple of 8 from 8 to 256 for bfloat16 "
                 r"inputs, got 100", id="head_dim_unsupported"),
    pytest.param(False, dict(v_cache=_at(3, (2, 64, 2, 72))), ValueError,
                 r"v's head_dim \(head_dim_v\) must be at most head_dim \(64\)",
                 id="v_cache_wider"),
    pytest.param(False, dict(q=_at(1, (2, 4, 6, 64)), k_cache=_at(2, (2, 64, 4, 64)),
                             v_cache=_at(3, (2, 64, 4, 64))),
                 ValueError, r"q's heads \(6\) must be a multiple of the cache's heads \(4\)",
                 id="heads_not_a_multiple"),
    pytest.param(False, dict(v_cache=_at(3, CACHE, device=1)), ValueError,
                 r"v_cache must be on q's device 0, got 1", id="cache_device"),
    pytest.param(False, dict(k_cache=_at(2, (3, 64, 2, 64)), v_cache=_at(3, (3, 64, 2, 64))),
                 ValueError, r"k_cache must have q's batch 2 \(a contiguous cache.*got 3; pass "
                 r"block_table for a paged cache", id="contiguous_cache_batch"),
    # cache_seqlens: an int, checked against the capacity here, or an int32 (batch,) array
    pytest.param(False, dict(cache_seqlens=32.0), TypeError,
                 r"cache_seqlens must be an int or an int32 array of shape \(batch,\), got float",
                 id="cache_seqlens_float"),
    pytest.param(False, dict(cache_seqlens=True), TypeError,
                 r"cache_seqlens must be an int or an int32 array", id="cache_seqlens_bool"),
    pytest.param(False, dict(cache_seqlens=_at(9, (2,), "int64")), TypeError,
                 r"cache_seqlens must have dtype int32, got int64", id="cache_seqlens_int64"),
    pytest.param(False, dict(cache_seqlens=_at(9, (3,), "int32")), ValueError,
                 r"cache_seqlens must have shape \(batch,\) = \(2,\), got \(3,\)",
                 id="cache_seqlens_length"),
    pytest.param(False, dict(cache_seqlens=_at(9, (2, 1), "int32")), ValueError,
                 r"cache_seqlens must have 1 dimension, got shape \(2, 1\)",
                 id="cache_seqlens_2d"),
    pytest.param(False, dict(cache_seqlens=_at(9, (2,), "int32", strides=(8,))), ValueError,
                 r"cache_seqlens must be contiguous", id="cache_seqlens_strided"),
    pytest.param(False, dict(cache_seqlens=_at(9, (2,), "int32", device=1)), ValueError,
                 r"cache_seqlens must be on q's device 0", id="cache_seqlens_device"),
    pytest.param(False, dict(cache_seqlens=-1), ValueError,
                 r"cache_seqlens must be in \[0, 64\] \(the cache's capacity\), got -1",
                 id="cache_seqlens_negative"),
    pytest.param(True, dict(cache_seqlens=CAPACITY + 1), ValueError,
                 r"cache_seqlens must be in \[0, 64\] \(the cache's capacity\), got 65",
                 id="cache_seqlens_beyond_pages"),
    pytest.param(False, dict(cache_seqlens=CAPACITY - 7, k_new=_at(5, NEW), v_new=_at(6, NEW)),
                 ValueError, r"cache_seqlens \+ seqlen_new = 65 exceeds the cache's capacity of "
                 r"64 keys", id="new_tokens_beyond_capacity"),
    pytest.param(True, dict(cache_seqlens=CAPACITY, k_new=_at(5, NEW), v_new=_at(6, NEW)),
                 ValueError, r"cache_seqlens \+ seqlen_new = 72 exceeds the cache's capacity of "
                 r"64 keys", id="new_tokens_beyond_pages"),
    # paged cache: block_table and page_size
    pytest.param(True, dict(block_table=_at(4, (2, 4), "int64")), TypeError,
                 r"block_table must have dtype int32, got int64", id="block_table_int64"),
    pytest.param(True, dict(block_table=_at(4, (2, 4), "float32")), TypeError,
                 r"block_table must have dtype int32, got float32", id="block_table_float32"),
    pytest.param(True, dict(block_table=_at(4, (8,), "int32")), ValueError,
                 r"block_table must have 2 dimensions, got shape \(8,\)", id="block_table_1d"),
    pytest.param(True, dict(block_table=_at(4, (3, 4), "int32")), ValueError,
                 r"block_table must have shape \(batch, max_pages\) with batch 2, got \(3, 4\)",
                 id="block_table_batch"),
    # strides of a slice: a fresh (2, 0) array's may be 0, which the strides check refuses first
    pytest.param(True, dict(block_table=_at(4, (2, 0), "int32", strides=(16, 4))), ValueError,
                 r"block_table must have shape \(batch, max_pages\) with batch 2, got \(2, 0\)",
                 id="block_table_without_pages"),
    pytest.param(True, dict(block_table=_at(4, (2, 4), "int32", strides=(32, 8))), ValueError,
                 r"block_table must have unit stride along its pages", id="block_table_strided"),
    pytest.param(True, dict(block_table=_at(4, (2, 4), "int32", device=1)), ValueError,
                 r"block_table must be on q's device 0", id="block_table_device"),
    *(pytest.param(True, dict(k_cache=_at(2, (10, size, 2, 64)), v_cache=_at(3, (10, size, 2, 64))),
                   ValueError, r"page_size \(k_cache.shape\[1\] of a paged cache\) must be a "
                   rf"multiple of 16 from 16 to 256, got {size}", id=f"page_size_{size}")
      for size in (8, 24, 272, 512)),
    # k_new / v_new
    pytest.param(False, dict(k_new=_at(5, NEW)), ValueError,
                 r"k_new and v_new must be given together", id="k_new_without_v_new"),
    pytest.param(False, dict(v_new=_at(6, NEW)), ValueError,
                 r"k_new and v_new must be given together", id="v_new_without_k_new"),
    pytest.param(False, dict(k_new=_at(5, NEW, "float16"), v_new=_at(6, NEW, "float16")),
                 TypeError, r"k_new must have q's dtype bfloat16, got float16", id="k_new_dtype"),
    pytest.param(False, dict(k_new=_at(5, NEW), v_new=_at(6, NEW, "int16")), TypeError,
                 r"v_new must have dtype float16 or bfloat16, got int16", id="v_new_int16"),
    pytest.param(False, dict(k_new=_at(5, (2, 8, 8, 64)), v_new=_at(6, (2, 8, 8, 64))),
                 ValueError, r"k_new must have shape \(batch, seqlen_new, heads_kv, head_dim\) = "
                 r"\(2, \*, 2, 64\), got \(2, 8, 8, 64\)", id="k_new_heads"),
    pytest.param(False, dict(k_new=_at(5, (3, 8, 2, 64)), v_new=_at(6, (3, 8, 2, 64))),
                 ValueError, r"k_new must have shape .* = \(2, \*, 2, 64\), got \(3, 8, 2, 64\)",
                 id="k_new_batch"),
    pytest.param(False, dict(k_new=_at(5, NEW), v_new=_at(6, (2, 8, 2, 128))), ValueError,
                 r"v_new must have shape .* = \(2, \*, 2, 64\)", id="v_new_head_dim"),
    pytest.param(False, dict(k_new=_at(5, NEW), v_new=_at(6, (2, 4, 2, 64))), ValueError,
                 r"k_new and v_new must have the same seqlen_new", id="v_new_seqlen"),
    pytest.param(False, dict(k_new=_at(5, (2, 8, 128)), v_new=_at(6, NEW)), ValueError,
                 r"k_new must have 4 dimensions \(batch, seqlen, heads, head_dim\)",
                 id="k_new_3d"),
    # out
    pytest.param(False, dict(out=_at(7, Q, "float16")), TypeError,
                 r"out must have q's dtype bfloat16, got float16", id="out_dtype"),
    pytest.param(False, dict(out=_at(7, (2, 4, 8, 128))), ValueError,
                 r"out must have q's shape with v_cache's head_dim_v \(2, 4, 8, 64\), got "
                 r"\(2, 4, 8, 128\)", id="out_shape"),
    pytest.param(False, dict(num_splits=129), ValueError,
                 r"num_splits must be an int from 0 \(chosen for the GPU\) to 128, got 129",
                 id="num_splits_129"),
    # Like softmax_scale, the option scalars answer any bad value, of a wrong type too, with
    # ValueError.
    *(pytest.param(False, dict(num_splits=value), ValueError,
                   rf"num_splits must be an int from 0 .* to 128, got {value!r}",
                   id=f"num_splits_{value!r}")
      for value in (-1, 2.0, True)),
])
def test_bad_kvcache_arguments_name_the_argument(paged, overrides, error, match):
    with pytest.raises(error, match=match):
        _kvcache(paged, **overrides)


def _every_kvcache_input():
    """A paged call with every optional input: what out must not overlap."""
    return dict(_kvcache_args(paged=True), k_new=_at(5, NEW), v_new=_at(6, NEW),
                sinks=_at(8, (8,), "float32"), cache_seqlens=_at(9, (2,), "int32"))




@pytest.mark.parametrize("name", [
    "q", "k_cache", "v_cache", "k_new", "v_new", "block_table", "cache_seqlens", "sinks",
])
def test_kvcache_out_overlapping_an_input_is_refused(name):
    args = _every_kvcache_input()
    with pytest.raises(ValueError, match=rf"out must not overlap {name} in memory"):
        AttentionProblem.from_kvcache(**args, out=MetaArray(Q, ptr=args[name].data.ptr))


# a NumPy integer is a numbers.Integral: an int, as serving.py and check_kvcache_contents see it
@pytest.mark.parametrize("integer", [np.int32, np.int64])
def test_a_numpy_integer_cache_seqlens_is_an_int(integer):
    assert _kvcache(cache_seqlens=integer(CAPACITY)).seqlen_k == CAPACITY
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 64\]"):
        _kvcache(cache_seqlens=integer(CAPACITY + 1))


# ---------------------------------------------------------------------------------------------
# attention_varlen: metadata


def test_a_good_varlen_call_passes():
    p = _varlen(out=Packed((Q_TOKENS, 8, 64), ptr=7 << 20), causal=True)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.total_q) == (
        2, 6, 16, 8, 2, Q_TOKENS)
    assert p.features == {"causal", "gqa", "varlen", "decode"}


@pytest.mark.parametrize("overrides,error,match", [
    pytest.param(dict(q=Packed((1, Q_TOKENS, 8, 64), ptr=1 << 20)), ValueError,
                 r"q must have 3 dimensions \(total_tokens, heads, head_dim\), got shape "
                 r"\(1, 10, 8, 64\)", id="q_4d"),
    pytest.param(dict(k=Packed((K_TOKENS, 2, 64), "float32", ptr=2 << 20)), TypeError,
                 r"k must have dtype float16 or bfloat16, got float32", id="k_float32"),
    pytest.param(dict(v=Packed((K_TOKENS, 2, 64), "float16", ptr=3 << 20)), TypeError,
                 r"q, k and v must share a dtype", id="v_float16"),
    pytest.param(dict(v=Packed((K_TOKENS - 1, 2, 64), ptr=3 << 20)), ValueError,
                 r"k and v must have the same shape", id="v_tokens"),
    pytest.param(dict(k=Packed((K_TOKENS, 2, 128), ptr=2 << 20),
                      v=Packed((K_TOKENS, 2, 128), ptr=3 << 20)), ValueError,
                 r"k must have head_dim 64 like q, got 128", id="kv_head_dim"),
    pytest.param(dict(q=Packed((Q_TOKENS, 8, 100), ptr=1 << 20),
                      k=Packed((K_TOKENS, 2, 100), ptr=2 << 20),
                      v=Packed((K_TOKENS, 2, 100), ptr=3 << 20)), ValueError,
                 r"head_dim must be a multiple of 8 from 8 to 256 for bfloat16 inputs, got 100",
                 id="head_dim_unsupported"),
    pytest.param(dict(q=Packed((Q_TOKENS, 6, 64), ptr=1 << 20),
                      k=Packed((K_TOKENS, 4, 64), ptr=2 << 20),
                      v=Packed((K_TOKENS, 4, 64), ptr=3 << 20)), ValueError,
                 r"q's heads \(6\) must be a multiple of k/v's heads \(4\)",
                 id="heads_not_a_multiple"),
    # cu_seqlens: int32, batch + 1 entries each (at least 2), contiguous
    pytest.param(dict(cu_seqlens_q=_at(4, (3,), "int64")), TypeError,
                 r"cu_seqlens_q must have dtype int32, got int64", id="cu_seqlens_q_int64"),
    pytest.param(dict(cu_seqlens_k=_at(5, (3,), "float32")), TypeError,
                 r"cu_seqlens_k must have dtype int32, got float32", id="cu_seqlens_k_float32"),
    pytest.param(dict(cu_seqlens_k=_at(5, (3, 1), "int32")), ValueError,
                 r"cu_seqlens_k must have 1 dimension, got shape \(3, 1\)",
                 id="cu_seqlens_k_2d"),
    pytest.param(dict(cu_seqlens_q=_at(4, (4,), "int32")), ValueError,
                 r"cu_seqlens_q and cu_seqlens_k must both have batch \+ 1 >= 2 entries, got "
                 r"shapes \(4,\) and \(3,\)", id="cu_seqlens_lengths_differ"),
    pytest.param(dict(cu_seqlens_q=_at(4, (1,), "int32"), cu_seqlens_k=_at(5, (1,), "int32")),
                 ValueError, r"cu_seqlens_q and cu_seqlens_k must both have batch \+ 1 >= 2 "
                 r"entries", id="cu_seqlens_without_a_sequence"),
    pytest.param(dict(cu_seqlens_q=_at(4, (3,), "int32", strides=(8,))), ValueError,
                 r"cu_seqlens_q must be contiguous", id="cu_seqlens_q_strided"),
    pytest.param(dict(cu_seqlens_k=_at(5, (3,), "int32", device=1)), ValueError,
                 r"cu_seqlens_k must be on q's device 0", id="cu_seqlens_k_device"),
    *(pytest.param({name: value}, ValueError, rf"{name} must be a non-negative int, got {value!r}",
                   id=f"{name}_{value!r}")
      for name in ("max_seqlen_q", "max_seqlen_k") for value in (-1, 6.0, True)),
    # out
    pytest.param(dict(out=Packed((Q_TOKENS, 8, 64), "float16", ptr=7 << 20)), TypeError,
                 r"out must have q's dtype bfloat16, got float16", id="out_dtype"),
    pytest.param(dict(out=Packed((1, Q_TOKENS, 8, 64), ptr=7 << 20)), ValueError,
                 r"out must have q's shape with v's head_dim_v \(10, 8, 64\), got "
                 r"\(1, 10, 8, 64\)", id="out_4d"),
    pytest.param(dict(out=Packed((Q_TOKENS, 8, 128), ptr=7 << 20)), ValueError,
                 r"out must have q's shape with v's head_dim_v \(10, 8, 64\), got "
                 r"\(10, 8, 128\)", id="out_shape"),
])
def test_bad_varlen_arguments_name_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _varlen(**overrides)


@pytest.mark.parametrize("name", [
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks",
])
def test_varlen_out_overlapping_an_input_is_refused(name):
    args = dict(_varlen_args(), sinks=_at(8, (8,), "float32"))
    with pytest.raises(ValueError, match=rf"out must not overlap {name} in memory"):
        AttentionProblem.from_varlen(**args, out=Packed((Q_TOKENS, 8, 64),
                                                        ptr=args[name].data.ptr))


# ---------------------------------------------------------------------------------------------
# Options both take: window, softcap, sinks


@pytest.mark.parametrize("build", [_kvcache, _varlen], ids=["kvcache", "varlen"])
@pytest.mark.parametrize("overrides,error,match", [
    *(pytest.param(dict(window=window), ValueError,
                   r"window must be a pair \(left, right\) of ints >= -1 \(-1: unbounded\)",
                   id=f"window_{window!r}")
      for window in ((-2, 0), (0, -5), (4,), (1, 2, 3), 4, None, (0.5, 0), (True, 0), "ab")),
    *(pytest.param(dict(softcap=softcap), ValueError,
                   r"softcap must be a finite number >= 0 \(0: off\)", id=f"softcap_{softcap!r}")
      for softcap in (-1.0, float("nan"), float("inf"), "30", None, True)),
    pytest.param(dict(sinks=_at(8, (8,), "float16")), TypeError,
                 r"sinks must have dtype float32, got float16", id="sinks_float16"),
    pytest.param(dict(sinks=_at(8, (2,), "float32")), ValueError,
                 r"sinks must have shape \(heads_q,\) = \(8,\), got \(2,\)",
                 id="sinks_heads_kv_long"),
    pytest.param(dict(sinks=_at(8, (1, 8), "float32")), ValueError,
                 r"sinks must have shape \(heads_q,\) = \(8,\), got \(1, 8\)", id="sinks_2d"),
    pytest.param(dict(sinks=_at(8, (8,), "float32", strides=(8,))), ValueError,
                 r"sinks must be contiguous", id="sinks_strided"),
    pytest.param(dict(sinks=_at(8, (8,), "float32", device=1)), ValueError,
                 r"sinks must be on q's device 0", id="sinks_device"),
])
def test_bad_options_name_the_option(build, overrides, error, match):
    with pytest.raises(error, match=match):
        build(**overrides)


# ---------------------------------------------------------------------------------------------
# Contents: what only the values tell, read with one copy to the host


def _check_kvcache_contents(lengths, table=None, seqlen_new=0):
    """check_kvcache_contents as attention_with_kvcache calls it: lengths an int or the values
    of an int32 (batch,) array, table the values of block_table or None (contiguous cache)."""
    problem = _kvcache(paged=table is not None, cache_seqlens=_at(9, (2,), "int32"))
    cache_seqlens = lengths if isinstance(lengths, int) else OnDevice(lengths)
    block_table = None if table is None else OnDevice(table)
    check_kvcache_contents(problem, cache_seqlens, block_table, NUM_PAGES, seqlen_new)


@pytest.mark.parametrize("lengths,table,seqlen_new", [
    pytest.param([0, CAPACITY], None, 0, id="contiguous_empty_and_full"),
    pytest.param([CAPACITY - 8, 0], None, 8, id="new_tokens_fill_the_cache"),
    pytest.param(20, [[0, 1, -1, -1], [2, 3, -1, -1]], 0, id="int_lengths"),
    pytest.param([0, 0], [[-1] * 4, [-1] * 4], 0, id="no_pages_in_use"),
    # entries past the pages in use are never read: padding (-1 here) or stale page numbers
    pytest.param([16, 48], [[0, -1, 99, -7], [1, 2, 3, -1]], 0, id="entries_past_use_are_free"),
    pytest.param([15, 0], [[0, -1, -1, -1], [1, -1, -1, -1]], 1, id="new_token_ends_a_page"),
    pytest.param([CAPACITY, 0], [[9, 8, 7, 6], [0, -1, -1, -1]], 0, id="last_page_number"),
])
def test_good_kvcache_contents_pass(lengths, table, seqlen_new):
    _check_kvcache_contents(lengths, table, seqlen_new)


@pytest.mark.parametrize("lengths,table,seqlen_new,match", [
    pytest.param([-1, 3], None, 0, r"cache_seqlens must be >= 0, got -1 for sequence 0",
                 id="negative_length"),
    pytest.param([10, CAPACITY + 1], None, 0,
                 r"cache_seqlens \+ seqlen_new must not exceed the cache's capacity of 64 keys, "
                 r"got 65 for sequence 1", id="length_beyond_capacity"),
    pytest.param([CAPACITY - 4, 10], None, 8,
                 r"cache_seqlens \+ seqlen_new must not exceed the cache's capacity of 64 keys, "
                 r"got 68 for sequence 0", id="new_tokens_beyond_capacity"),
    pytest.param([20, 0], [[0, -1, 2, 3], [4, 5, 6, 7]], 0,
                 r"block_table\[0\] names page -1 among its first 2 \(the pages sequence 0 "
                 r"uses\); pages must be in \[0, 10\)", id="negative_page_in_use"),
    pytest.param([16, 33], [[0, 1, 2, 3], [4, 5, NUM_PAGES, 7]], 0,
                 r"block_table\[1\] names page 10 among its first 3 .* pages must be in \[0, 10\)",
                 id="page_past_the_pool"),
    pytest.param(20, [[0, 1, -1, -1], [2, -1, -1, -1]], 0,
                 r"block_table\[1\] names page -1 among its first 2", id="int_lengths"),
    # the page the new tokens are written into is in use too
    pytest.param([16, 0], [[0, -1, -1, -1], [1, -1, -1, -1]], 1,
                 r"block_table\[0\] names page -1 among its first 2", id="page_for_new_tokens"),
])
def test_bad_kvcache_contents_are_refused(lengths, table, seqlen_new, match):
    with pytest.raises(ValueError, match=match):
        _check_kvcache_contents(lengths, table, seqlen_new)


def _check_varlen_contents(cu_q, cu_k):
    """check_varlen_contents as attention_varlen calls it, on these cu_seqlens values."""
    problem = _varlen(cu_seqlens_q=_at(4, (len(cu_q),), "int32"),
                      cu_seqlens_k=_at(5, (len(cu_k),), "int32"))
    check_varlen_contents(problem, OnDevice(cu_q), OnDevice(cu_k), K_TOKENS)


@pytest.mark.parametrize("cu_q,cu_k", [
    pytest.param([0, 4, 10], [0, 8, 24], id="two_sequences"),
    pytest.param([0, 4, 4, 10], [0, 8, 8, 24], id="an_empty_sequence"),
    pytest.param([0, 6, 10], [0, 16, 24], id="sequences_at_the_maxima"),
])
def test_good_varlen_contents_pass(cu_q, cu_k):
    _check_varlen_contents(cu_q, cu_k)


@pytest.mark.parametrize("cu_q,cu_k,match", [
    pytest.param([1, 4, 10], [0, 8, 24], r"cu_seqlens_q must start at 0, never decrease and end "
                 r"at the number of tokens \(10\), got \[1, 4, 10\]", id="start_not_0"),
    pytest.param([0, 11, 10], [0, 8, 24], r"cu_seqlens_q must start at 0, never decrease and "
                 r"end at the number of tokens \(10\)", id="decreasing"),
    pytest.param([0, 4, 12], [0, 8, 24], r"cu_seqlens_q must start at 0, never decrease and end "
                 r"at the number of tokens \(10\), got .* ending at 12", id="past_the_total"),
    pytest.param([0, 4, 8], [0, 8, 24], r"cu_seqlens_q .* end at the number of tokens \(10\), "
                 r"got .* ending at 8", id="short_of_the_total"),
    pytest.param([0, 4, 10], [0, 25, 24], r"cu_seqlens_k must start at 0, never decrease and "
                 r"end at the number of tokens \(24\)", id="k_decreasing"),
    pytest.param([0, 4, 10], [0, 8, 30], r"cu_seqlens_k .* \(24\), got .* ending at 30",
                 id="k_past_the_total"),
    pytest.param([0, 3, 10], [0, 8, 24], r"cu_seqlens_q holds a sequence of 7 tokens, more than "
                 r"max_seqlen_q = 6", id="longer_than_max_seqlen_q"),
    pytest.param([0, 4, 10], [0, 4, 24], r"cu_seqlens_k holds a sequence of 20 tokens, more than "
                 r"max_seqlen_k = 16", id="longer_than_max_seqlen_k"),
])
def test_bad_varlen_contents_are_refused(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        _check_varlen_contents(cu_q, cu_k)


# ---------------------------------------------------------------------------------------------
# The entry points themselves


def test_numpy_arrays_are_a_type_error():
    x, packed = np.zeros((1, 16, 2, 64), np.float16), np.zeros((16, 2, 64), np.float16)
    cu = np.array([0, 16], np.int32)
    with pytest.raises(TypeError, match=r"q must be a CUDA array .*, got numpy.ndarray in host"):
        ptxattn.attention_with_kvcache(x, x, x, cache_seqlens=0)
    with pytest.raises(TypeError, match=r"q must be a CUDA array .*, got numpy.ndarray in host"):
        ptxattn.attention_varlen(packed, packed, packed, cu, cu, 16, 16)
    lse = np.zeros((2, 1, 2, 16), np.float32)
    with pytest.raises(TypeError, match=r"out_parts must be a CUDA array .*, got numpy.ndarray"):
        ptxattn.merge_attention_states(np.stack([x, x]), lse)
    with pytest.raises(TypeError, match=r"out_parts\[0\] must be a cupy.ndarray"):
        ptxattn.merge_attention_states([x, x], list(lse))


def test_entry_points_check_before_launch():
    """The public functions reach their checks before anything needs a GPU."""
    with pytest.raises(ValueError, match=r"num_splits must be an int from 0"):
        ptxattn.attention_with_kvcache(**_kvcache_args(paged=True), num_splits=129)
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new = 72 exceeds"):
        ptxattn.attention_with_kvcache(**{**_kvcache_args(), "cache_seqlens": CAPACITY},
                                       k_new=_at(5, NEW), v_new=_at(6, NEW))
    with pytest.raises(TypeError, match=r"cu_seqlens_q must have dtype int32"):
        ptxattn.attention_varlen(**{**_varlen_args(), "cu_seqlens_q": _at(4, (3,), "int64")})


# ---------------------------------------------------------------------------------------------
# merge_attention_states (its checks come before its first allocation)

PARTS = (3, 2, 4, 8, 64)  # num_parts, batch, seqlen, heads, head_dim
PARTS_LSE = (3, 2, 8, 4)  # num_parts, batch, heads, seqlen


def _merge(out_parts=None, lse_parts=None, sinks=None):
    serving.merge_attention_states(_at(1, PARTS, "float32") if out_parts is None else out_parts,
                                   _at(2, PARTS_LSE, "float32") if lse_parts is None
                                   else lse_parts, sinks=sinks)


@pytest.mark.parametrize("overrides,error,match", [
    pytest.param(dict(out_parts=_at(1, PARTS, "int32")), TypeError,
                 r"out_parts must have dtype float16, bfloat16 or float32, got int32",
                 id="out_parts_int32"),
    pytest.param(dict(lse_parts=_at(2, PARTS_LSE, "bfloat16")), TypeError,
                 r"lse_parts must have dtype float32, got bfloat16", id="lse_parts_bfloat16"),
    pytest.param(dict(out_parts=_at(1, PARTS[1:], "float32")), ValueError,
                 r"out_parts must be a non-empty \(num_parts, batch, seqlen, heads, head_dim\) "
                 r"array, got shape \(2, 4, 8, 64\)", id="out_parts_4d"),
    pytest.param(dict(out_parts=_at(1, (0, *PARTS[1:]), "float32")), ValueError,
                 r"out_parts must be a non-empty \(num_parts, .*\) array, got shape "
                 r"\(0, 2, 4, 8, 64\)", id="out_parts_empty"),
    pytest.param(dict(lse_parts=_at(2, (3, 2, 4, 8), "float32")), ValueError,
                 r"lse_parts must have shape \(num_parts, batch, heads, seqlen\) = "
                 r"\(3, 2, 8, 4\), got \(3, 2, 4, 8\)", id="lse_parts_seqlen_major"),
    pytest.param(dict(out_parts=_at(1, (*PARTS[:-1], 66), "float32")), ValueError,
                 r"out_parts must have unit stride in a head_dim that is a multiple of 4, got "
                 r"head_dim 66", id="head_dim_66"),
    pytest.param(dict(out_parts=_at(1, PARTS, "float32",
                                    strides=(131072, 65536, 4096, 512, 8))), ValueError,
                 r"out_parts must have unit stride in a head_dim", id="head_dim_strided"),
    pytest.param(dict(out_parts=MetaArray(PARTS, "float32", ptr=(1 << 20) + 8)), ValueError,
                 r"out_parts must have a base and strides that are multiples of 16 bytes",
                 id="out_parts_misaligned"),
    pytest.param(dict(lse_parts=_at(2, PARTS_LSE, "float32", strides=(-256, 128, 16, 4))),
                 ValueError, r"lse_parts must have positive strides", id="lse_parts_reversed"),
    pytest.param(dict(sinks=_at(8, (4,), "float32")), ValueError,
                 r"sinks must have shape \(heads,\) = \(8,\), got \(4,\)",
                 id="sinks_shape"),
    pytest.param(dict(sinks=_at(8, (8,), "float16")), TypeError,
                 r"sinks must have dtype float32, got float16", id="sinks_float16"),
    *(pytest.param(dict({name: _at(mib, shape, "float32", device=1)}), ValueError,
                   rf"{name} must be on out_parts' device 0", id=f"{name}_device")
      for name, mib, shape in (("lse_parts", 2, PARTS_LSE), ("sinks", 8, (8,)))),
])
def test_bad_merge_arguments_name_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _merge(**overrides)
