"""ptxattn.attention_mla_decode: multi-head latent attention decode (DeepSeek-V3, Kimi K2 after
weight absorption), every q head over one latent cache head of 576 columns whose first 512 are
also the values.

CPU: the argument checks through the public entry point, on MetaArray stand-ins
(tests/meta_array.py) and fp8.E4M3Array wrappers of them: each bad call is refused with an error
naming the argument before anything needs a GPU.

GPU: against the FP32 reference of the same attention (reference.attention with k the cache
rows, v their first 512 columns, one kv head, causal bottom-right aligned), sequence by
sequence over the rows it fills; tolerance as in tests/test_serving.py
(inputs.assert_within_naive_error): the max error at most twice that of the same math done
naively in the input precision, plus the rounding noise of one value; a row that sees no key
has output 0 and LSE -inf. Paged caches have their pages shuffled over a pool whose spare pages
are NaN (never to be read). FP8 caches: the reference runs on the dequantized cache, whose
values (e4m3 times a descale of at most 3 significant bits) are exact in bf16 and fp16, so the
same rule holds; appended rows must hold e4m3(clip(x / descale, +-448)) byte for byte.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import ptxattn
from inputs import (assert_descales_exact_in_16_bits, assert_sequence_within_naive_error,
                    cache_descales, e4m3_values, outlying, standard_normal)
from meta_array import MetaArray
from ptxattn import fp8

HEAD_DIM, HEAD_DIM_V = 576, 512
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_NAN = 0x7F
# e4m3's values decoded by ml_dtypes, not by ptxattn: what a byte means
E4M3_VALUES = e4m3_values()
DESCALES = cache_descales()  # tests/inputs.py: why these

gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------
# CPU: argument checks, before any launch

Q = (2, 1, 16, HEAD_DIM)  # batch, seqlen_q, heads_q, 576
CACHE = (2, 128, 1, HEAD_DIM)  # contiguous: batch, capacity, 1 head, 576
POOL = (8, 64, 1, HEAD_DIM)  # paged: num_pages, page_size, 1 head, 576; 2 pages a sequence
TABLE = (2, 2)
NEW = (2, 1, 1, HEAD_DIM)  # kv_new: batch, seqlen_new, 1 head, 576


class _Meta(MetaArray):
    """A stand-in that also takes x[..., :n] as CuPy does (a view of the first n columns: V of
    a latent cache) and, for fp8.E4M3Array to wrap one, a view as another dtype of one byte."""

    def __getitem__(self, index):
        assert (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
                and isinstance(index[1], slice) and index[1].start in (None, 0)
                and index[1].step in (None, 1)), index
        columns = len(range(self.shape[-1])[index[1]])
        return _Meta((*self.shape[:-1], columns), self.dtype, self.strides, self.data.ptr,
                     self.device.id)

    def view(self, dtype):
        assert np.dtype(dtype).itemsize == self.itemsize == 1
        return _Meta(self.shape, dtype, self.strides, self.data.ptr, self.device.id)


def _at(mib, shape, dtype="bfloat16", **kwargs):
    """A stand-in at its own MiB, so that it overlaps no other unless a test means it to."""
    return _Meta(shape, dtype, ptr=mib << 20, **kwargs)


def _e4m3_at(mib, shape):
    return fp8.E4M3Array(_at(mib, shape, np.uint8))


def _mla_args(paged=False, fp8_cache=False):
    """A good attention_mla_decode call: 16 heads, 128 keys a sequence, 32 filled."""
    shape = POOL if paged else CACHE
    kv_cache = _e4m3_at(2, shape) if fp8_cache else _at(2, shape)
    args = dict(q=_at(1, Q), kv_cache=kv_cache, cache_seqlens=32)
    if paged:
        args["block_table"] = _at(4, TABLE, "int32")
    if fp8_cache:
        args["kv_descale"] = _at(5, (), "float32")
    return args


def _mla(paged=False, fp8_cache=False, **overrides):
    return ptxattn.attention_mla_decode(**{**_mla_args(paged, fp8_cache), **overrides})


@pytest.mark.parametrize("paged,fp8_cache,overrides,error,match", [
    # the latent width
    pytest.param(False, False, dict(q=_at(1, (2, 1, 16, 512)), kv_cache=_at(2, (2, 128, 1, 512))),
                 ValueError, r"576", id="q_512_wide"),
    pytest.param(False, False, dict(q=_at(1, (2, 1, 16, 128)), kv_cache=_at(2, (2, 128, 1, 128))),
                 ValueError, r"576", id="q_128_wide"),
    pytest.param(False, False, dict(kv_cache=_at(2, (2, 128, 1, 512))), ValueError, r"\bkv_cache\b",
                 id="kv_cache_512_wide"),
    pytest.param(True, False, dict(kv_cache=_at(2, (8, 64, 1, 640))), ValueError, r"\bkv_cache\b",
                 id="pool_640_wide"),
    # one latent head
    pytest.param(False, False, dict(kv_cache=_at(2, (2, 128, 2, HEAD_DIM))), ValueError,
                 r"\bkv_cache\b", id="kv_cache_2_heads"),
    pytest.param(True, False, dict(kv_cache=_at(2, (8, 64, 16, HEAD_DIM))), ValueError,
                 r"\bkv_cache\b", id="pool_16_heads"),
    *(pytest.param(False, False, dict(head_dim_v=value), ValueError, r"head_dim_v",
                   id=f"head_dim_v_{value}")
      for value in (600, 256, 128)),
    # dtypes
    pytest.param(False, False, dict(q=_at(1, Q, "float32")), TypeError, r"\bq\b",
                 id="q_float32"),
    pytest.param(False, False, dict(kv_cache=_at(2, CACHE, "float16")), TypeError, r"\bkv_cache\b",
                 id="kv_cache_float16_under_bfloat16_q"),
    # the contiguous cache's batch, the paged cache's table and page size
    pytest.param(False, False, dict(kv_cache=_at(2, (3, 128, 1, HEAD_DIM))), ValueError,
                 r"\bkv_cache\b", id="contiguous_cache_batch"),
    pytest.param(True, False, dict(block_table=_at(4, TABLE, "int64")), TypeError,
                 r"\bblock_table\b", id="block_table_int64"),
    pytest.param(True, False, dict(block_table=_at(4, (3, 2), "int32")), ValueError,
                 r"\bblock_table\b", id="block_table_batch"),
    *(pytest.param(True, False, dict(kv_cache=_at(2, (8, size, 1, HEAD_DIM))), ValueError,
                   r"page_size", id=f"page_size_{size}")
      for size in (8, 24, 272)),
    # lengths (an int: checked against the capacity with the metadata)
    pytest.param(False, False, dict(cache_seqlens=129), ValueError, r"\bcache_seqlens\b",
                 id="cache_seqlens_beyond_capacity"),
    pytest.param(True, False, dict(cache_seqlens=129), ValueError, r"\bcache_seqlens\b",
                 id="cache_seqlens_beyond_pages"),
    pytest.param(False, False, dict(cache_seqlens=-1), ValueError, r"\bcache_seqlens\b",
                 id="cache_seqlens_negative"),
    pytest.param(False, False, dict(cache_seqlens=128, kv_new=_at(6, NEW)), ValueError,
                 r"\bcache_seqlens\b", id="kv_new_beyond_capacity"),
    pytest.param(False, False, dict(cache_seqlens=_at(9, (2,), "int64")), TypeError,
                 r"\bcache_seqlens\b", id="cache_seqlens_int64"),
    pytest.param(False, False, dict(cache_seqlens=_at(9, (3,), "int32")), ValueError,
                 r"\bcache_seqlens\b", id="cache_seqlens_length"),
    # kv_new
    pytest.param(False, False, dict(kv_new=_at(6, (2, 1, 1, HEAD_DIM_V))), ValueError,
                 r"\bkv_new\b", id="kv_new_512_wide"),
    pytest.param(False, False, dict(kv_new=_at(6, (2, 1, 2, HEAD_DIM))), ValueError, r"\bkv_new\b",
                 id="kv_new_2_heads"),
    pytest.param(False, False, dict(kv_new=_at(6, (3, 1, 1, HEAD_DIM))), ValueError, r"\bkv_new\b",
                 id="kv_new_batch"),
    pytest.param(False, False, dict(kv_new=_at(6, NEW, "float16")), TypeError, r"\bkv_new\b",
                 id="kv_new_dtype"),
    # FP8 cache and its descale
    pytest.param(False, True, dict(kv_descale=None), TypeError, r"\bkv_descale\b is required",
                 id="fp8_cache_without_kv_descale"),
    pytest.param(True, True, dict(kv_descale=None), TypeError, r"\bkv_descale\b is required",
                 id="fp8_pool_without_kv_descale"),
    pytest.param(False, False, dict(kv_descale=_at(5, (), "float32")), ValueError,
                 r"\bkv_descale\b", id="kv_descale_with_a_16_bit_cache"),
    pytest.param(True, False, dict(kv_descale=_at(5, (2, 1), "float32")), ValueError,
                 r"\bkv_descale\b", id="kv_descale_with_a_16_bit_pool"),
    *(pytest.param(False, True, dict(kv_descale=_at(5, shape, "float32")), ValueError,
                   r"\bkv_descale\b", id=f"kv_descale_shape_{'x'.join(map(str, shape))}")
      for shape in ((2,), (2, 16), (3, 1), (1, 1, 1), (2, 1, 1))),
    # a per-batch descale follows q's batch, not the pool's pages
    pytest.param(True, True, dict(kv_descale=_at(5, (8, 1), "float32")), ValueError,
                 r"\bkv_descale\b", id="kv_descale_per_page"),
    pytest.param(False, True, dict(kv_descale=_at(5, (2, 1), "float64")), TypeError,
                 r"\bkv_descale\b", id="kv_descale_float64"),
    # options and out
    *(pytest.param(False, False, dict(num_splits=value), ValueError, r"num_splits",
                   id=f"num_splits_{value}")
      for value in (-1, 129)),
    pytest.param(False, False, dict(softmax_scale=-1.0), ValueError, r"softmax_scale",
                 id="softmax_scale_negative"),
    pytest.param(False, False, dict(causal=1), TypeError, r"causal", id="causal_int"),
    pytest.param(False, False, dict(out=_at(7, Q)), ValueError, r"\bout\b",
                 id="out_576_wide"),
    pytest.param(False, False, dict(out=_at(7, (*Q[:3], HEAD_DIM_V), "float16")), TypeError,
                 r"\bout\b", id="out_dtype"),
    pytest.param(False, False, dict(out=_Meta((*Q[:3], HEAD_DIM_V), ptr=1 << 20)),
                 ValueError, r"\bout\b.*overlap.*\bq\b", id="out_overlapping_q"),
])
def test_bad_arguments_name_the_argument(paged, fp8_cache, overrides, error, match):
    with pytest.raises(error, match=match) as caught:
        _mla(paged, fp8_cache, **overrides)
    # in attention_mla_decode's own names, not attention_with_kvcache's (k_cache, v_new, ...)
    assert not _FOREIGN_NAME.search(str(caught.value)), str(caught.value)


_FOREIGN_NAME = re.compile(r"(?<![\w.])[kv]_(cache|new|descale)\b"
                           r"|\w(kv_cache|kv_new|kv_descale)")


def test_host_arrays_are_a_type_error():
    q = np.zeros(Q, np.float16)
    with pytest.raises(TypeError, match=r"^q must be a CUDA array .*, got numpy.ndarray in host"):
        ptxattn.attention_mla_decode(q, q, cache_seqlens=0)
    with pytest.raises(TypeError, match=r"kv_descale must be a CUDA array .*, got numpy.ndarray"):
        _mla(fp8_cache=True, kv_descale=np.ones((), np.float32))


# ---------------------------------------------------------------------------------------------
# GPU helpers


def _page_size(layout: str):
    """None for "contiguous", else the page size of "paged<size>"."""
    return None if layout == "contiguous" else int(layout.removeprefix("paged"))


def _descale(kind, batch, rng):
    """A host float32 descale: "tensor0" shape (), "tensor1" shape (1,), "batch" (batch, 1)
    cycling through DESCALES in random order (neighbours differ)."""
    if kind == "batch":
        return np.resize(rng.permutation(DESCALES), (batch, 1)).astype(np.float32)
    shape = {"tensor0": (), "tensor1": (1,)}[kind]
    return np.asarray(rng.choice(DESCALES, size=shape), dtype=np.float32)


def _rows(descale):
    """A host descale broadcast to (batch or 1, 1, 1, 1) over the cache's rows."""
    return descale.reshape(-1, 1, 1, 1)


def _quantize(x, descale):
    """e4m3 bytes of float32 x / descale, clipped to +-448, rounded to nearest even (ml_dtypes)."""
    return np.clip(x / _rows(descale), -448, 448).astype(E4M3).view(np.uint8)


class _Cache:
    """A latent cache of standard normal values in one layout: ``arg`` what attention_mla_decode
    takes (a CuPy array, or an E4M3Array with ``descale``), ``block_table`` (None when
    contiguous), ``real`` the float32 (batch, capacity, 1, 576) values it holds on the host.

    A paged cache spreads each sequence's pages over a pool in random order, with 3 spare pages
    between of NaN; ``unfilled`` lengths make the rows past them NaN as well."""

    def __init__(self, batch, capacity, dtype, rng, layout="contiguous", scales=None,
                 unfilled=None):
        import cupy

        x = rng.standard_normal((batch, capacity, 1, HEAD_DIM), dtype=np.float32)
        self.fp8 = scales is not None
        if self.fp8:
            self.descale_host = _descale(scales, batch, rng)
            self.descale = cupy.asarray(self.descale_host)
            host = _quantize(x, self.descale_host)
            nan = E4M3_NAN
        else:
            self.descale = None
            host = x.astype(dtype).astype(np.float32)
            nan = np.nan
        for b, length in enumerate(unfilled or []):
            host[b, length:] = nan
        self.page_size = _page_size(layout)
        self.block_table = None
        store = host
        if self.page_size is not None:
            assert capacity % self.page_size == 0
            per_seq = capacity // self.page_size
            num_pages = batch * per_seq + 3
            order = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq)
            store = np.full((num_pages, self.page_size, 1, HEAD_DIM), nan, host.dtype)
            store[order.ravel()] = host.reshape(batch * per_seq, self.page_size, 1, HEAD_DIM)
            self.block_table = cupy.asarray(order.astype(np.int32))
        if self.fp8:
            self.arg = fp8.E4M3Array(cupy.asarray(store))
        else:
            self.arg = cupy.asarray(store).astype(dtype)
        self.host = host

    @property
    def real(self):
        """The cache's values as float32 on the host (e4m3 bytes dequantized)."""
        if self.fp8:
            return E4M3_VALUES[self.host] * _rows(self.descale_host)
        return self.host

    def kwargs(self):
        return dict(block_table=self.block_table, kv_descale=self.descale)

    def storage(self):
        """The cache's memory as raw bits, to compare byte for byte."""
        import cupy
        return self.arg.bytes.copy() if self.fp8 else self.arg.view(cupy.uint16).copy()

    def slots(self, b, positions):
        """Indices into the storage of sequence b's rows at ``positions``."""
        import cupy
        if self.page_size is None:
            return b, cupy.asarray(positions)
        table = self.block_table.get()
        return (cupy.asarray(table[b, positions // self.page_size]),
                cupy.asarray(positions % self.page_size))

    def append(self, kv_new, lengths):
        """What the cache must hold after appending kv_new at rows lengths[b]..: updates the
        host values and returns the storage as it must then be."""
        import cupy

        expected = self.storage()
        new = cupy.asnumpy(kv_new.astype(cupy.float32))
        if self.fp8:
            new_bits = _quantize(new, self.descale_host)
        else:
            new_bits = cupy.asnumpy(kv_new.view(cupy.uint16))
        for b, length in enumerate(lengths):
            positions = np.arange(length, length + kv_new.shape[1])
            expected[self.slots(b, positions)] = cupy.asarray(new_bits[b])
            self.host[b, positions] = new_bits[b] if self.fp8 else new[b]
        return expected


def _check(q, real, lengths, out, lse, causal=True, softmax_scale=None):
    """out, lse of attention_mla_decode against the reference, sequence by sequence, over the
    first lengths[b] rows of ``real`` (host float32 (batch, capacity, 1, 576)): k those rows,
    v their first 512 columns, in q's dtype (exact: they are its values)."""
    import cupy

    batch, seqlen_q, heads_q, _ = q.shape
    assert out.shape == (batch, seqlen_q, heads_q, HEAD_DIM_V) and out.dtype == q.dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == cupy.float32
    for b, length in enumerate(lengths):
        k = cupy.asarray(real[b:b + 1, :length]).astype(q.dtype)
        assert bool((k.astype(cupy.float32) == cupy.asarray(real[b:b + 1, :length])).all()), \
            "the cache's values are not exact in q's dtype: the tolerance would not hold"
        v = k[..., :HEAD_DIM_V]
        assert_sequence_within_naive_error(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k, v,
                                           causal=causal, softmax_scale=softmax_scale)


def _decode(q, cache, lengths, **kwargs):
    """attention_mla_decode over ``cache`` with int32 lengths, returning (out, lse)."""
    import cupy
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    return ptxattn.attention_mla_decode(q, cache.arg, cache_seqlens=seqlens, return_lse=True,
                                        **cache.kwargs(), **kwargs)


# ---------------------------------------------------------------------------------------------
# GPU: contiguous and paged caches, query rows, heads, dtypes, splits


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seqlen_q", [1, 2, 4, 8])
@pytest.mark.parametrize("heads_q", [16, 32, 64, 128])
def test_contiguous_cache(heads_q, seqlen_q, dtype, rng):
    """Ragged lengths: the whole cache, none, one key, and one not a multiple of 64; more
    query rows than keys leave the causal rows above the diagonal empty."""
    lengths = [200, 0, 1, 131]
    cache = _Cache(len(lengths), 200, dtype, rng)
    q = standard_normal((len(lengths), seqlen_q, heads_q, HEAD_DIM), rng, dtype)
    out, lse = _decode(q, cache, lengths)
    _check(q, cache.real, lengths, out, lse)


@gpu
@pytest.mark.parametrize("layout, scales", [("contiguous", None), ("paged64", "batch")])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("heads_q", [1, 8, 20])
def test_partial_tiles(heads_q, seqlen_q, layout, scales, rng):
    """Packed rows (seqlen_q x heads_q) that fill no whole 16- or 32-row tile: the tile's last
    rows are zero-filled queries whose results are dropped."""
    lengths = [130, 1, 64]
    cache = _Cache(len(lengths), 192, "bfloat16", rng, layout, scales)
    q = standard_normal((len(lengths), seqlen_q, heads_q, HEAD_DIM), rng, "bfloat16")
    out, lse = _decode(q, cache, lengths)
    _check(q, cache.real, lengths, out, lse)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads_q, seqlen_q", [(16, 1), (128, 2), (64, 4)])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_cache_with_shuffled_pages(page_size, heads_q, seqlen_q, dtype, rng):
    capacity = 2 * page_size if page_size == 256 else 320
    lengths = [capacity, 0, 1, 193, capacity - page_size + 5]
    cache = _Cache(len(lengths), capacity, dtype, rng, f"paged{page_size}")
    q = standard_normal((len(lengths), seqlen_q, heads_q, HEAD_DIM), rng, dtype)
    out, lse = _decode(q, cache, lengths)
    _check(q, cache.real, lengths, out, lse)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 16, 128])
def test_every_split_count(num_splits, layout, rng):
    """Forced splits of the keys of 1024, 577, 1 and 0 (128 splits: most of them empty), and
    the automatic choice."""
    lengths = [1024, 577, 1, 0]
    cache = _Cache(len(lengths), 1024, "bfloat16", rng, layout)
    q = standard_normal((len(lengths), 2, 64, HEAD_DIM), rng)
    out, lse = _decode(q, cache, lengths, num_splits=num_splits)
    _check(q, cache.real, lengths, out, lse)


@gpu
@pytest.mark.parametrize("causal, softmax_scale", [(False, None), (True, 0.07), (False, 0.02)])
def test_softmax_scale_and_causal(causal, softmax_scale, rng):
    lengths = [150, 3, 0]
    cache = _Cache(len(lengths), 192, "bfloat16", rng, "paged64")
    q = standard_normal((len(lengths), 4, 32, HEAD_DIM), rng)
    out, lse = _decode(q, cache, lengths, causal=causal, softmax_scale=softmax_scale)
    _check(q, cache.real, lengths, out, lse, causal=causal, softmax_scale=softmax_scale)


@gpu
@pytest.mark.parametrize("scales", [None, "batch"])
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_unfilled_rows_are_not_read(layout, scales, rng):
    """Rows past each filled length hold NaN (an unwritten cache): none may reach an output."""
    lengths = [320, 100, 1, 0, 63]
    cache = _Cache(len(lengths), 320, "bfloat16", rng, layout, scales, unfilled=lengths)
    q = standard_normal((len(lengths), 2, 64, HEAD_DIM), rng)
    out, lse = _decode(q, cache, lengths)
    _check(q, cache.real, lengths, out, lse)


# ---------------------------------------------------------------------------------------------
# GPU: appending, out=, return_lse


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seqlen_new", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "paged16", "paged64"])
def test_append_then_attend(layout, seqlen_new, dtype, rng):
    """kv_new lands at rows cache_seqlens.. (across a page boundary from 63 and 15, into an
    empty cache from 0), every other row of the storage stays as it was, cache_seqlens is not
    advanced, and the queries see the new rows."""
    import cupy

    lengths = [0, 63, 250, 15]
    cache = _Cache(len(lengths), 256, dtype, rng, layout)
    q = standard_normal((len(lengths), seqlen_new, 32, HEAD_DIM), rng, dtype)
    kv_new = standard_normal((len(lengths), seqlen_new, 1, HEAD_DIM), rng, dtype)
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    expected = cache.append(kv_new, lengths)
    out, lse = ptxattn.attention_mla_decode(q, cache.arg, cache_seqlens=seqlens, kv_new=kv_new,
                                            return_lse=True, **cache.kwargs())
    assert bool((cache.storage() == expected).all()), "kv_new not where the cache expects it"
    assert seqlens.get().tolist() == lengths, "cache_seqlens was advanced"
    _check(q, cache.real, [n + seqlen_new for n in lengths], out, lse)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_out_buffer_and_return_lse(layout, rng):
    """out= is written and returned; without return_lse the same output alone; an int
    cache_seqlens stands for every sequence."""
    import cupy

    batch, length = 3, 77
    cache = _Cache(batch, 128, "bfloat16", rng, layout)
    q = standard_normal((batch, 2, 16, HEAD_DIM), rng)
    out = cupy.full((batch, 2, 16, HEAD_DIM_V), cupy.nan, dtype="bfloat16")
    got, lse = ptxattn.attention_mla_decode(q, cache.arg, cache_seqlens=length, out=out,
                                            return_lse=True, num_splits=2, **cache.kwargs())
    assert got is out
    _check(q, cache.real, [length] * batch, out, lse)
    alone = ptxattn.attention_mla_decode(q, cache.arg, cache_seqlens=length, num_splits=2,
                                         **cache.kwargs())
    assert isinstance(alone, cupy.ndarray), "without return_lse the output alone"
    assert bool((alone == out).all())


# ---------------------------------------------------------------------------------------------
# GPU: FP8 caches


@gpu
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("scales", ["tensor0", "tensor1", "batch"])
@pytest.mark.parametrize("layout, heads_q, dtype", [
    ("contiguous", 16, "float16"), ("paged64", 128, "bfloat16"), ("paged16", 32, "bfloat16"),
])
def test_fp8_cache(layout, heads_q, dtype, scales, append, rng):
    """An e4m3 cache whose real values are its bytes times kv_descale; kv_new (with values
    that saturate) is quantized into it with that descale."""
    import cupy

    lengths = [320, 0, 1, 190]
    seqlen_q = 2
    capacity = 384 if append else 320
    cache = _Cache(len(lengths), capacity, dtype, rng, layout, scales)
    q = standard_normal((len(lengths), seqlen_q, heads_q, HEAD_DIM), rng, dtype)
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    kwargs = cache.kwargs()
    if append:
        kwargs["kv_new"] = outlying((len(lengths), seqlen_q, 1, HEAD_DIM), rng, dtype)
        expected = cache.append(kwargs["kv_new"], lengths)
    out, lse = ptxattn.attention_mla_decode(q, cache.arg, cache_seqlens=seqlens,
                                            return_lse=True, **kwargs)
    if append:
        got = cache.storage()
        assert bool((got == expected).all()), (
            "kv_new not quantized into the cache as e4m3(clip(x / descale, +-448))",
            int((got != expected).sum()))
    _check(q, cache.real, [n + seqlen_q * append for n in lengths], out, lse)


# ---------------------------------------------------------------------------------------------
# GPU: contents checks (a copy of cache_seqlens and block_table to the host)


@gpu
@pytest.mark.parametrize("lengths, table_fix, match", [
    pytest.param([100, 10], lambda t: t.__setitem__((1, 0), -1), r"block_table\[1\]",
                 id="negative_page_in_use"),
    pytest.param([100, 70], lambda t: t.__setitem__((1, 1), 99), r"block_table\[1\]",
                 id="page_past_the_pool"),
    # the page kv_new goes into is in use too: 63 + 1 keys fill page 0, 64 + 1 need page 1
    pytest.param([100, 64], lambda t: t.__setitem__((1, 1), -1), r"block_table\[1\]",
                 id="page_for_kv_new"),
    pytest.param([129, 10], None, r"\bcache_seqlens\b", id="length_beyond_capacity"),
    pytest.param([128, 10], None, r"\bcache_seqlens\b", id="kv_new_beyond_capacity"),
    pytest.param([-1, 10], None, r"\bcache_seqlens\b", id="negative_length"),
])
def test_bad_contents_are_refused_before_launch(lengths, table_fix, match, rng):
    """Refused with the cache untouched (kv_new not written)."""
    import cupy

    cache = _Cache(2, 128, "bfloat16", rng, "paged64")
    if table_fix is not None:
        table = cache.block_table.get()
        table_fix(table)
        cache.block_table = cupy.asarray(table)
    q = standard_normal((2, 1, 16, HEAD_DIM), rng)
    kv_new = standard_normal((2, 1, 1, HEAD_DIM), rng)
    before = cache.storage()
    with pytest.raises(ValueError, match=match):
        _decode(q, cache, lengths, kv_new=kv_new)
    assert bool((cache.storage() == before).all()), "a refused call wrote the cache"


# ---------------------------------------------------------------------------------------------
# GPU: torch tensors


@gpu
def test_torch_tensors_in_torch_tensors_out(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cupy

    lengths = [100, 5]
    cache = _Cache(len(lengths), 128, "bfloat16", rng, "paged64")
    q = standard_normal((2, 1, 32, HEAD_DIM), rng)
    kv_new = standard_normal((2, 1, 1, HEAD_DIM), rng)
    expected = cache.append(kv_new, lengths)
    tq, tcache, tnew, ttable = (torch.from_dlpack(x) for x in (q, cache.arg, kv_new,
                                                                cache.block_table))
    tlengths = torch.tensor(lengths, dtype=torch.int32, device=tq.device)
    out, lse = ptxattn.attention_mla_decode(tq, tcache, cache_seqlens=tlengths,
                                            block_table=ttable, kv_new=tnew, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.device == tq.device and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the torch cache is the CuPy one's memory: written in place
    assert bool((cache.storage() == expected).all()), "kv_new not written into the torch cache"
    _check(q, cache.real, [n + 1 for n in lengths], cupy.from_dlpack(out),
           cupy.from_dlpack(lse))


def test_descales_are_exact_in_16_bits():
    assert_descales_exact_in_16_bits()
