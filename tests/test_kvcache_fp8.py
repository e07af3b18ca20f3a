"""FP8 (e4m3) KV caches in ptxattn.attention_with_kvcache: k_cache and v_cache as
fp8.E4M3Array, whose real values are their bytes times k_descale / v_descale (float32, per
tensor or per (batch, kv head)); bf16/fp16 queries, output in q's dtype; k_new and v_new
quantized into the cache with those descales.

CPU: the argument checks through the public entry point, on MetaArray stand-ins
(tests/meta_array.py) wrapped in fp8.E4M3Array: each bad call is refused with an error naming
the argument before anything needs a GPU.

GPU: against the FP32 reference of attention over the dequantized cache (decoded with
ml_dtypes, not ptxattn), sequence by sequence over the rows it fills, with the tolerance of
tests/test_serving.py (inputs.assert_within_naive_error): the max error at most twice that of the
same math done naively in the input precision, plus the rounding noise of one value. The
descales have at most 3 significant bits, so every dequantized value is exact in bf16 and fp16:
the naive computation on the 16-bit cache of those values is the 16-bit cache tests' yardstick.
A row that sees no key has output 0 and LSE -inf. Paged caches have their pages shuffled over a
pool whose spare pages are e4m3 NaN (never to be read). Appended rows must hold
e4m3(clip(x / descale, +-448)) (round to nearest even) byte for byte.
"""

import ml_dtypes
import numpy as np
import pytest

import ptxattn
from inputs import (assert_descales_exact_in_16_bits, assert_sequence_within_naive_error,
                    cache_descales, e4m3_values, outlying, standard_normal)
from meta_array import MetaArray
from ptxattn import fp8

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_NAN = 0x7F
# e4m3's values decoded by ml_dtypes, not by ptxattn: what a byte means
E4M3_VALUES = e4m3_values()
DESCALES = cache_descales()  # tests/inputs.py: why these

gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------
# CPU: argument checks, before any launch

Q = (2, 4, 8, 64)  # batch, seqlen_q, heads_q, head_dim
CACHE = (2, 64, 2, 64)  # contiguous: batch, capacity, heads_kv, head_dim
POOL = (10, 16, 2, 64)  # paged: num_pages, page_size, heads_kv, head_dim; 4 pages a sequence
TABLE = (2, 4)
NEW = (2, 2, 2, 64)  # k_new, v_new: batch, seqlen_new, heads_kv, head_dim


def _at(mib, shape, dtype="bfloat16", **kwargs):
    """A stand-in at its own MiB, so that it overlaps no other unless a test means it to."""
    return MetaArray(shape, dtype, ptr=mib << 20, **kwargs)


class _MetaBytes(MetaArray):
    """A uint8 stand-in that fp8.E4M3Array can wrap (it takes a view of its data as uint8)."""

    def view(self, dtype):
        return MetaArray(self.shape, dtype, self.strides, self.data.ptr, self.device.id)


def _e4m3_at(mib, shape):
    return fp8.E4M3Array(_MetaBytes(shape, np.uint8, ptr=mib << 20))


def _fp8_args(paged=False):
    """A good FP8 attention_with_kvcache call: GQA 8:2, 64 keys a sequence, 32 filled, one
    descale per tensor."""
    shape = POOL if paged else CACHE
    args = dict(q=_at(1, Q), k_cache=_e4m3_at(2, shape), v_cache=_e4m3_at(3, shape),
                cache_seqlens=32, k_descale=_at(5, (), "float32"),
                v_descale=_at(6, (), "float32"))
    if paged:
        args["block_table"] = _at(4, TABLE, "int32")
    return args


def _call(paged=False, **overrides):
    return ptxattn.attention_with_kvcache(**{**_fp8_args(paged), **overrides})


def _sixteen_bit(paged=False):
    shape = POOL if paged else CACHE
    return dict(k_cache=_at(2, shape), v_cache=_at(3, shape))


@pytest.mark.parametrize("paged,overrides,error,match", [
    # both descales are required with e4m3 caches
    pytest.param(False, dict(k_descale=None), TypeError, r"k_descale is required",
                 id="k_descale_missing"),
    pytest.param(False, dict(v_descale=None), TypeError, r"v_descale is required",
                 id="v_descale_missing"),
    pytest.param(True, dict(k_descale=None), TypeError, r"k_descale is required",
                 id="paged_k_descale_missing"),
    pytest.param(True, dict(v_descale=None), TypeError, r"v_descale is required",
                 id="paged_v_descale_missing"),
    # and refused with 16-bit caches
    pytest.param(False, dict(_sixteen_bit(), v_descale=None), ValueError, r"k_descale",
                 id="k_descale_with_16_bit_caches"),
    pytest.param(False, dict(_sixteen_bit(), k_descale=None), ValueError, r"v_descale",
                 id="v_descale_with_16_bit_caches"),
    pytest.param(True, dict(_sixteen_bit(True), v_descale=None), ValueError, r"k_descale",
                 id="k_descale_with_16_bit_pools"),
    # shapes: (), (1,) or (batch, heads_kv)
    *(pytest.param(False, {name: _at(mib, shape, "float32")}, ValueError, name,
                   id=f"{name}_shape_{'x'.join(map(str, shape))}")
      for name, mib in (("k_descale", 5), ("v_descale", 6))
      for shape in ((2,), (2, 8), (3, 2), (2, 2, 1), (1, 1, 1))),
    # per (batch, kv head) follows q's batch, not the pool's pages
    pytest.param(True, dict(k_descale=_at(5, (10, 2), "float32")), ValueError, r"k_descale",
                 id="k_descale_per_page"),
    pytest.param(False, dict(k_descale=_at(5, (2, 2), "float64")), TypeError, r"k_descale",
                 id="k_descale_float64"),
    pytest.param(False, dict(v_descale=_at(6, (), "float16")), TypeError, r"v_descale",
                 id="v_descale_float16"),
    # dtypes: q, k_new, v_new and out 16-bit; both caches e4m3
    pytest.param(False, dict(q=_e4m3_at(1, Q)), TypeError, r"\bq\b", id="q_e4m3"),
    pytest.param(False, dict(v_cache=_at(3, CACHE)), TypeError, r"k_cache|v_cache",
                 id="v_cache_16_bit_under_e4m3_k_cache"),
    pytest.param(False, dict(k_cache=_at(2, CACHE)), TypeError, r"k_cache|v_cache",
                 id="k_cache_16_bit_under_e4m3_v_cache"),
    pytest.param(False, dict(k_new=_e4m3_at(7, NEW), v_new=_e4m3_at(8, NEW)), TypeError,
                 r"k_new", id="k_new_e4m3"),
    pytest.param(False, dict(k_new=_at(7, NEW), v_new=_at(8, NEW, "float16")), TypeError,
                 r"v_new", id="v_new_float16_under_bfloat16_q"),
    pytest.param(False, dict(out=_e4m3_at(9, Q)), TypeError, r"\bout\b", id="out_e4m3"),
    # FP8 head dims: multiples of 16 up to 256, v's head_dim the same as k's
    *(pytest.param(False, dict(q=_at(1, (2, 4, 8, dim)), k_cache=_e4m3_at(2, (2, 64, 2, dim)),
                               v_cache=_e4m3_at(3, (2, 64, 2, dim))),
                   ValueError, r"head_dim", id=f"head_dim_{dim}")
      for dim in (8, 40, 72)),
    pytest.param(False, dict(v_cache=_e4m3_at(3, (2, 64, 2, 32))), ValueError,
                 r"head_dim_v|v_cache", id="head_dim_v_narrower"),
    # the metadata checks of 16-bit caches hold for e4m3 ones
    pytest.param(False, dict(cache_seqlens=65), ValueError, r"cache_seqlens",
                 id="cache_seqlens_beyond_capacity"),
    pytest.param(False, dict(cache_seqlens=63, k_new=_at(7, NEW), v_new=_at(8, NEW)),
                 ValueError, r"cache_seqlens", id="new_tokens_beyond_capacity"),
    pytest.param(True, dict(k_cache=_e4m3_at(2, (10, 24, 2, 64)),
                            v_cache=_e4m3_at(3, (10, 24, 2, 64))),
                 ValueError, r"page_size", id="page_size_24"),
    pytest.param(False, dict(v_cache=_e4m3_at(3, (2, 48, 2, 64))), ValueError,
                 r"v_cache", id="v_cache_shape"),
    pytest.param(False, dict(q=_at(1, (2, 4, 5, 64))), ValueError, r"heads",
                 id="heads_not_a_multiple"),
])
def test_bad_fp8_cache_arguments_name_the_argument(paged, overrides, error, match):
    with pytest.raises(error, match=match):
        _call(paged, **overrides)


def test_host_descales_are_a_type_error():
    host = np.ones((), np.float32)
    with pytest.raises(TypeError, match=r"k_descale must be a CUDA array .*, got numpy.ndarray"):
        _call(k_descale=host)
    with pytest.raises(TypeError, match=r"v_descale must be a CUDA array .*, got numpy.ndarray"):
        _call(v_descale=host)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86"])
def test_appends_into_e4m3_caches_need_the_gpu_quantizer(monkeypatch, arch):
    """The quantizer behind k_new (cvt.rn.satfinite.e4m3x2.f32) is sm_89+: below, an append is
    refused, naming k_new, before anything is written or launched."""
    from ptxattn import runtime
    from ptxattn.quant.fp8 import QUANTIZER_ARCHS

    assert arch not in QUANTIZER_ARCHS
    monkeypatch.setattr(runtime, "device_arch", lambda device=None: arch)
    new = dict(k_new=_at(7, (2, 1, 2, 64)), v_new=_at(8, (2, 1, 2, 64)))
    with pytest.raises(ValueError, match=r"k_new: appending into an e4m3 cache .*'sm_89'"):
        _call(check_contents=False, **new)


def test_the_quantizer_runs_wherever_e4m3_conversion_does():
    from ptxattn import archs
    from ptxattn.quant.fp8 import QUANTIZER_ARCHS

    assert set(QUANTIZER_ARCHS) == {name for name, arch in archs.ARCHS.items()
                                    if arch.capability >= (8, 9)}
    assert {"sm_100a", "sm_103a", "sm_121a"} <= set(QUANTIZER_ARCHS)


def test_descales_are_exact_in_16_bits():
    assert_descales_exact_in_16_bits()


# ---------------------------------------------------------------------------------------------
# GPU helpers


def _descale(kind, batch, heads_kv, rng):
    """A host float32 descale of DESCALES' values: "tensor0" shape (), "tensor1" shape (1,),
    "head" (batch, heads_kv) cycling through them in random order (neighbours differ)."""
    if kind == "head":
        return np.resize(rng.permutation(DESCALES), (batch, heads_kv)).astype(np.float32)
    shape = {"tensor0": (), "tensor1": (1,)}[kind]
    return np.asarray(rng.choice(DESCALES, size=shape), dtype=np.float32)


def _rows(descale):
    """A host descale broadcast over (batch, rows, heads_kv, head_dim)."""
    return descale.reshape(1, 1, 1, 1) if descale.ndim < 2 else descale[:, None, :, None]


def _quantize(x, descale):
    """e4m3 bytes of float32 x / descale, clipped to +-448, rounded to nearest even (ml_dtypes)."""
    return np.clip(x / _rows(descale), -448, 448).astype(E4M3).view(np.uint8)


class _Caches:
    """An e4m3 k and v cache (batch, capacity, heads_kv, head_dim) of standard normal values
    quantized with descales of kind ``scales`` (each its own), contiguous or paged (layout
    "paged<size>": each sequence's pages spread over a pool in random order, one table for
    both, with 3 spare pages of NaN between); ``unfilled`` lengths make the rows past them NaN.
    ``bytes`` holds the contiguous host bytes of each, ``descales`` the host descales."""

    def __init__(self, shape, rng, layout="contiguous", scales="head", unfilled=None):
        import cupy

        batch, capacity, heads_kv, head_dim = shape
        self.descales = [_descale(scales, batch, heads_kv, rng) for _ in range(2)]
        self.bytes = [_quantize(rng.standard_normal(shape, dtype=np.float32), d)
                      for d in self.descales]
        for host in self.bytes:
            for b, length in enumerate(unfilled or []):
                host[b, length:] = E4M3_NAN
        self.page_size = None if layout == "contiguous" else int(layout.removeprefix("paged"))
        self.block_table = None
        stores = self.bytes
        if self.page_size is not None:
            assert capacity % self.page_size == 0
            per_seq = capacity // self.page_size
            num_pages = batch * per_seq + 3
            order = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq)
            stores = []
            for host in self.bytes:
                pool = np.full((num_pages, self.page_size, heads_kv, head_dim), E4M3_NAN,
                               np.uint8)
                pool[order.ravel()] = host.reshape(batch * per_seq, self.page_size, heads_kv,
                                                   head_dim)
                stores.append(pool)
            self.block_table = cupy.asarray(order.astype(np.int32))
        self.k, self.v = (fp8.E4M3Array(cupy.asarray(store)) for store in stores)

    def kwargs(self):
        import cupy
        k_descale, v_descale = (cupy.asarray(d) for d in self.descales)
        return dict(block_table=self.block_table, k_descale=k_descale, v_descale=v_descale)

    def real(self):
        """The float32 host values of k and v: their bytes decoded times their descales."""
        return [E4M3_VALUES[host] * _rows(d) for host, d in zip(self.bytes, self.descales)]

    def storage(self):
        return [self.k.bytes.copy(), self.v.bytes.copy()]

    def append(self, k_new, v_new, lengths):
        """What the caches must hold after appending k_new, v_new at rows lengths[b]..: updates
        the host bytes and returns both storages as they must then be."""
        import cupy

        expected = self.storage()
        seqlen_new = k_new.shape[1]
        table = None if self.block_table is None else self.block_table.get()
        for store, host, d, new in zip(expected, self.bytes, self.descales, (k_new, v_new)):
            new_bytes = _quantize(cupy.asnumpy(new.astype(cupy.float32)), d)
            for b, length in enumerate(lengths):
                positions = np.arange(length, length + seqlen_new)
                if table is None:
                    slots = (b, cupy.asarray(positions))
                else:
                    slots = (cupy.asarray(table[b, positions // self.page_size]),
                             cupy.asarray(positions % self.page_size))
                store[slots] = cupy.asarray(new_bytes[b])
                host[b, positions] = new_bytes[b]
        return expected


def _check(q, caches, lengths, out, lse, **masks):
    """out, lse against the reference, sequence by sequence, over the first lengths[b] rows of
    the dequantized caches, in q's dtype (exact: they are its values)."""
    import cupy

    batch, seqlen_q, heads_q, head_dim = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == cupy.float32
    k_real, v_real = caches.real()
    for b, length in enumerate(lengths):
        k, v = (cupy.asarray(real[b:b + 1, :length]) for real in (k_real, v_real))
        k16, v16 = k.astype(q.dtype), v.astype(q.dtype)
        assert bool((k16.astype(cupy.float32) == k).all() and (v16.astype(cupy.float32) == v)
                    .all()), "the dequantized cache is not exact in q's dtype"
        assert_sequence_within_naive_error(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k16, v16,
                                           **masks)


def _attend(q, caches, lengths, **kwargs):
    """attention_with_kvcache over the e4m3 caches with int32 lengths: (out, lse)."""
    import cupy
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    return ptxattn.attention_with_kvcache(q, caches.k, caches.v, cache_seqlens=seqlens,
                                          return_lse=True, **caches.kwargs(), **kwargs)


# ---------------------------------------------------------------------------------------------
# GPU: decode over e4m3 caches


@gpu
@pytest.mark.parametrize("seqlen_q, scales", [(1, "tensor0"), (1, "head"), (4, "head")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8), (16, 2), (16, 1), (8, 8)])
def test_decode_contiguous(heads, head_dim, seqlen_q, scales, rng):
    """Ragged lengths: the whole cache, none, one key, and one not a multiple of 64."""
    heads_q, heads_kv = heads
    lengths = [300, 0, 1, 157]
    caches = _Caches((len(lengths), 300, heads_kv, head_dim), rng, scales=scales)
    q = standard_normal((len(lengths), seqlen_q, heads_q, head_dim), rng)
    out, lse = _attend(q, caches, lengths)
    _check(q, caches, lengths, out, lse, causal=True)


@gpu
@pytest.mark.parametrize("head_dim", [64, 256])
def test_query_rows_of_any_magnitude(head_dim, rng):
    """bf16 queries run as f16 rows scaled by powers of two (e4m3_gemms.cuh's prepare_q): rows
    from 2^-24 to 2^24 times standard normal (beyond f16's range), and a row of zeros, in one
    tile."""
    import cupy

    lengths = [96, 33]
    caches = _Caches((len(lengths), 96, 1, head_dim), rng, scales="tensor0")
    q = rng.standard_normal((len(lengths), 1, 8, head_dim), dtype=np.float32)
    q *= np.array([2.0 ** -24, 2.0 ** -12, 1.0, 2.0 ** 12, 2.0 ** 24, 0.0, 2.0 ** 6, 2.0 ** -6],
                  dtype=np.float32)[None, None, :, None]
    q = cupy.asarray(q).astype("bfloat16")
    out, lse = _attend(q, caches, lengths)
    _check(q, caches, lengths, out, lse, causal=True)


@gpu
@pytest.mark.parametrize("dtype, scales", [("bfloat16", "head"), ("float16", "tensor1")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_decode_paged(page_size, head_dim, dtype, scales, rng):
    capacity = 512 if page_size == 256 else 320
    lengths = [capacity, 0, 1, 193, capacity - page_size + 5]
    caches = _Caches((len(lengths), capacity, 8, head_dim), rng, f"paged{page_size}", scales)
    q = standard_normal((len(lengths), 2, 32, head_dim), rng, dtype)
    out, lse = _attend(q, caches, lengths)
    _check(q, caches, lengths, out, lse, causal=True)


@gpu
@pytest.mark.parametrize("head_dim", [16, 48, 96, 208])
def test_other_head_dims(head_dim, rng):
    """Multiples of 16 between the compiled head dims, paged."""
    lengths = [256, 77, 1]
    caches = _Caches((len(lengths), 256, 2, head_dim), rng, "paged64")
    q = standard_normal((len(lengths), 2, 8, head_dim), rng)
    out, lse = _attend(q, caches, lengths)
    _check(q, caches, lengths, out, lse, causal=True)


@gpu
@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7, 128])
def test_every_split_count(num_splits, rng):
    lengths = [1500, 701, 1, 0]
    caches = _Caches((len(lengths), 1500, 2, 128), rng, scales="head")
    q = standard_normal((len(lengths), 1, 16, 128), rng)
    out, lse = _attend(q, caches, lengths, num_splits=num_splits)
    _check(q, caches, lengths, out, lse, causal=True)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_unfilled_rows_are_not_read(layout, rng):
    """Rows past each filled length hold e4m3 NaN (an unwritten cache): none may reach an
    output."""
    lengths = [320, 100, 1, 0, 63]
    caches = _Caches((len(lengths), 320, 2, 128), rng, layout, unfilled=lengths)
    q = standard_normal((len(lengths), 2, 8, 128), rng)
    out, lse = _attend(q, caches, lengths)
    _check(q, caches, lengths, out, lse, causal=True)


# ---------------------------------------------------------------------------------------------
# GPU: appending into e4m3 caches


@gpu
@pytest.mark.parametrize("seqlen_new", [1, 3])
@pytest.mark.parametrize("scales", ["tensor0", "head"])
@pytest.mark.parametrize("layout, dtype", [
    ("contiguous", "bfloat16"), ("paged16", "float16"), ("paged64", "bfloat16"),
])
def test_append_quantizes_into_the_cache(layout, dtype, scales, seqlen_new, rng):
    """k_new and v_new (with values that saturate) land at rows
    cache_seqlens.. as e4m3(clip(x / descale, +-448)), each (batch, kv head) with its own
    descale, across page boundaries (from 63 and 15) and into an empty cache (from 0); every
    other byte stays; cache_seqlens is not advanced; the queries see the new rows."""
    import cupy

    lengths = [0, 63, 250, 15]
    caches = _Caches((len(lengths), 256, 4, 128), rng, layout, scales)
    q = standard_normal((len(lengths), seqlen_new, 16, 128), rng, dtype)
    k_new, v_new = (outlying((len(lengths), seqlen_new, 4, 128), rng, dtype)
                    for _ in range(2))
    expected = caches.append(k_new, v_new, lengths)
    seqlens = cupy.asarray(np.array(lengths, dtype=np.int32))
    out, lse = ptxattn.attention_with_kvcache(q, caches.k, caches.v, cache_seqlens=seqlens,
                                              k_new=k_new, v_new=v_new, return_lse=True,
                                              **caches.kwargs())
    for name, got, want in zip(("k", "v"), caches.storage(), expected):
        assert bool((got == want).all()), (f"{name}_new not quantized into the cache as "
                                           "e4m3(clip(x / descale, +-448))",
                                           int((got != want).sum()))
    assert seqlens.get().tolist() == lengths, "cache_seqlens was advanced"
    _check(q, caches, [n + seqlen_new for n in lengths], out, lse, causal=True)


@gpu
def test_out_buffer(rng):
    """out= is written and returned; without return_lse the same output alone; an int
    cache_seqlens stands for every sequence."""
    import cupy

    caches = _Caches((3, 128, 2, 64), rng, "paged16")
    q = standard_normal((3, 2, 8, 64), rng)
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    got, lse = ptxattn.attention_with_kvcache(q, caches.k, caches.v, cache_seqlens=77, out=out,
                                              return_lse=True, num_splits=2, **caches.kwargs())
    assert got is out
    _check(q, caches, [77] * 3, out, lse, causal=True)
    alone = ptxattn.attention_with_kvcache(q, caches.k, caches.v, cache_seqlens=77,
                                           num_splits=2, **caches.kwargs())
    assert isinstance(alone, cupy.ndarray) and bool((alone == out).all())


# ---------------------------------------------------------------------------------------------
# GPU: windows, softcap and sinks over e4m3 caches


@gpu
@pytest.mark.parametrize("masks", [
    dict(causal=True, window=(100, -1)),
    dict(causal=False, window=(50, 7)),
    dict(causal=True, softcap=20.0),
    dict(causal=True, sinks=True),
    dict(causal=False, window=(300, 0), softcap=5.0, sinks=True),
])
@pytest.mark.parametrize("layout, num_splits", [("contiguous", 1), ("paged64", 5)])
def test_masks_softcap_sinks(masks, layout, num_splits, rng):
    import cupy

    lengths = [896, 450, 0]
    caches = _Caches((len(lengths), 896, 2, 128), rng, layout)
    q = standard_normal((len(lengths), 8, 8, 128), rng, scale=2.0)
    masks = dict(masks)
    if masks.pop("sinks", False):
        masks["sinks"] = cupy.asarray(rng.standard_normal(8, dtype=np.float32) * 3)
    out, lse = _attend(q, caches, lengths, num_splits=num_splits, **masks)
    _check(q, caches, lengths, out, lse, **masks)


# ---------------------------------------------------------------------------------------------
# GPU: contents checks (a copy of cache_seqlens and block_table to the host)


@gpu
@pytest.mark.parametrize("lengths, bad_page, match", [
    pytest.param([40, 10], ((1, 0), -1), r"block_table\[1\]", id="negative_page_in_use"),
    pytest.param([40, 30], ((1, 1), 99), r"block_table\[1\]", id="page_past_the_pool"),
    pytest.param([63, 10], None, r"cache_seqlens", id="new_tokens_beyond_capacity"),
])
def test_bad_contents_are_refused_before_launch(lengths, bad_page, match, rng):
    """Refused with the caches untouched (k_new, v_new not written)."""
    import cupy

    caches = _Caches((2, 64, 2, 64), rng, "paged16")
    if bad_page is not None:
        table = caches.block_table.get()
        table[bad_page[0]] = bad_page[1]
        caches.block_table = cupy.asarray(table)
    q = standard_normal((2, 2, 8, 64), rng)
    k_new, v_new = standard_normal((2, 2, 2, 64), rng), standard_normal((2, 2, 2, 64), rng)
    before = caches.storage()
    with pytest.raises(ValueError, match=match):
        _attend(q, caches, lengths, k_new=k_new, v_new=v_new)
    for got, want in zip(caches.storage(), before):
        assert bool((got == want).all()), "a refused call wrote the cache"
