"""Head dims other than the compiled ones, and value heads narrower than the query/key heads,
against the FP32 reference.

A 16-bit call may have any head_dim that is a multiple of 8 from 8 to 256: it runs on the least
of its kernel family's compiled head dims that holds it, the kernels' loads filling the columns
past the arrays' own with zeros and their stores leaving those columns alone (dispatch.py's
docstring).
v, and with it out, dout and dv, may have fewer columns than q and k (head_dim_v <= head_dim,
16-bit only). FP8 takes any multiple of 16 up to 256, v like k.

Tolerances are the suite's: outputs and gradients within twice the max error of the same math
done naively in the input precision, plus the rounding noise of one value, against the FP32
reference (tests/inputs.py, test_backward_features.py); FP8 within test_fp8.py's bounds on the
dequantized inputs. Contiguous inputs show that the kernels zero-fill a tile's columns past the
arrays' rows instead of reading on into the next row. The other tests pass views of wider
buffers whose columns past the view are NaN, and outputs that are views of NaN-filled buffers:
a load past an array's head dim comes back as NaN in the results, a store past it as a written
column of the output's buffer.

The argument checks at the end read only array metadata and run without a GPU.
"""

import numpy as np
import pytest

from inputs import assert_matches_finite_differences, assert_within_naive_error, normal
from meta_array import MetaArray
from ptxattn.problem import AttentionProblem
from test_backward_features import _assert_close as assert_gradients_close
from test_backward_features import _assert_varlen_close as assert_varlen_gradients_close
from test_backward_features import _cu_seqlens, _same_bytes
from test_fp8 import _assert_close as assert_fp8_close
from test_serving_validation import Packed

BACKENDS = ("portable", "hopper")
HEADS = (8, 2)  # (heads_q, heads_kv): GQA 4:1
# (head_dim, head_dim_v): below, between and at the compiled head dims, then value heads
# narrower than the keys'
HEAD_DIMS = [(d, d) for d in (8, 40, 72, 80, 96, 112, 160, 192, 200, 256)]
NARROW_V = [(192, 128), (160, 96), (128, 64), (96, 64), (80, 40)]
# Tails of every tile; causal 131x77 (bottom-right aligned) leaves its first 54 rows without keys.
SEQLENS = [(131, 77), (131, 200)]
CAUSAL_SEQLENS = [pytest.param(True, (131, 77), id="causal-131x77"),
                  pytest.param(False, (131, 200), id="full-131x200")]


def _dims_id(dims):
    head_dim, head_dim_v = dims
    return f"d{head_dim}" if head_dim_v == head_dim else f"d{head_dim}-v{head_dim_v}"


def _seqlens_id(seqlens):
    return f"{seqlens[0]}x{seqlens[1]}"


def _backend(backend):
    """``backend`` if it runs on this GPU; skips the test otherwise (inputs.backward_backend
    also skips the head dims that are not compiled, most of those here)."""
    from ptxattn import archs
    from ptxattn.runtime import device_arch

    if device_arch() not in archs.running(backend):
        pytest.skip(f"backend {backend} does not run on {device_arch()}")
    return backend


def _inputs(rows_q, rows_k, dims, dtype, rng):
    """dout, q, k, v of standard normal values: q (*rows_q, 8, head_dim), k (*rows_k, 2,
    head_dim), v (*rows_k, 2, head_dim_v) and dout like the output, (*rows_q, 8, head_dim_v)."""
    (head_dim, head_dim_v), (heads_q, heads_kv) = dims, HEADS
    q = normal((*rows_q, heads_q, head_dim), dtype, rng)
    k = normal((*rows_k, heads_kv, head_dim), dtype, rng)
    v = normal((*rows_k, heads_kv, head_dim_v), dtype, rng)
    return normal((*rows_q, heads_q, head_dim_v), dtype, rng), q, k, v


def _assert_output_close(out, lse, q, k, v, **masks):
    """out, of q's shape with v's head dim, and lse against the FP32 reference by the rule of
    tests/inputs.py."""
    from ptxattn import reference

    assert out.shape == (*q.shape[:-1], v.shape[-1]), out.shape
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **masks)
    naive, naive_lse = reference.attention(q, k, v, return_lse=True, precision="input", **masks)
    assert_within_naive_error(out, lse, ref, ref_lse, naive, naive_lse, q.dtype)


def _buffer_columns(dtype):
    """Columns of a buffer whose rows hold every column of the widest compiled tile and one
    16-byte piece more."""
    from ptxattn import dispatch
    return max(dispatch.head_dims("bfloat16")) + 16 // np.dtype(dtype).itemsize


def _in_nan_buffer(x):
    """x copied into the first columns of a NaN-filled buffer of _buffer_columns(); returns the
    view of x's columns."""
    import cupy

    buffer = cupy.full((*x.shape[:-1], _buffer_columns(x.dtype)), cupy.nan,
                       dtype=cupy.float32).astype(x.dtype)
    view = buffer[..., :x.shape[-1]]
    view[...] = x
    return view


def _nan_view(shape, dtype):
    """An output buffer: a NaN-filled view of ``shape`` into a wider NaN-filled buffer."""
    import cupy
    return _in_nan_buffer(cupy.full(shape, cupy.nan, dtype=cupy.float32).astype(dtype))


def _assert_columns_past_untouched(name, view):
    """The columns of ``view``'s buffer past the view still NaN."""
    import cupy

    past = view.base[..., view.shape[-1]:]
    assert bool(cupy.isnan(past.astype(cupy.float32)).all()), (
        f"{name}: a column past its head_dim was written")


# ---------------------------------------------------------------------------------------------
# Fixed length


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", HEAD_DIMS + NARROW_V, ids=_dims_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=_seqlens_id)
def test_forward_and_backward_match_fp32_reference(backend, dims, causal, seqlens, rng):
    """Contiguous bf16 arrays, GQA 4:1: the output, its LSE and the gradients of one backend."""
    _check_forward_and_backward(backend, dims, causal, seqlens, "bfloat16", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(40, 40), (96, 96), (200, 200), (192, 128)], ids=_dims_id)
@pytest.mark.parametrize("causal,seqlens", CAUSAL_SEQLENS)
def test_float16(backend, dims, causal, seqlens, rng):
    _check_forward_and_backward(backend, dims, causal, seqlens, "float16", rng)


def _check_forward_and_backward(backend, dims, causal, seqlens, dtype, rng):
    """One backend's output, LSE and gradients over contiguous ``dtype`` arrays, GQA 4:1."""
    import ptxattn

    backend = _backend(backend)
    seqlen_q, seqlen_k = seqlens
    dout, q, k, v = _inputs((2, seqlen_q), (2, seqlen_k), dims, dtype, rng)
    out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    _assert_output_close(out, lse, q, k, v, causal=causal)
    grads = ptxattn.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)
    assert_gradients_close(grads, dout, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(40, 40), (192, 128)], ids=_dims_id)
def test_deterministic_backward_is_bitwise_reproducible(backend, dims, rng):
    """The deterministic dQ sums over 700 keys, in a workspace whose rows have the compiled head
    dim's columns, bit for bit from run to run."""
    import ptxattn

    backend = _backend(backend)
    dout, q, k, v = _inputs((2, 131), (2, 700), dims, "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, backend=backend)
    first, again = (ptxattn.attention_backward(dout, q, k, v, out, lse, deterministic=True,
                                               backend=backend) for _ in range(2))
    assert _same_bytes(first, again), "deterministic gradients differ from run to run"
    assert_gradients_close(first, dout, q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(40, 40), (96, 96), (192, 192), (192, 128), (160, 96)],
                         ids=_dims_id)
@pytest.mark.parametrize("causal,seqlens", CAUSAL_SEQLENS)
def test_columns_past_the_head_dims_are_neither_read_nor_written(backend, dims, causal,
                                                                 seqlens, rng):
    """q, k, v, dout as views of buffers whose columns past them are NaN, and out, dq, dk, dv
    as views of NaN-filled ones: every result finite and correct, no column past a view
    written."""
    import ptxattn

    backend = _backend(backend)
    seqlen_q, seqlen_k = seqlens
    dout, q, k, v = (_in_nan_buffer(x) for x in _inputs((2, seqlen_q), (2, seqlen_k), dims,
                                                        "bfloat16", rng))
    out = _nan_view(dout.shape, dout.dtype)
    got, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True, out=out,
                                 backend=backend)
    assert got is out
    _assert_columns_past_untouched("out", out)
    _assert_output_close(out, lse, q, k, v, causal=causal)
    buffers = {name: _nan_view(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = ptxattn.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend,
                                       **buffers)
    assert all(grad is buffer for grad, buffer in zip(grads, buffers.values()))
    for name, buffer in buffers.items():
        _assert_columns_past_untouched(name, buffer)
    assert_gradients_close(grads, dout, q, k, v, causal=causal)


# ---------------------------------------------------------------------------------------------
# Varlen and KV caches

# A sequence of keys and no queries (dk = dv = 0), one-token sequences, tails of every tile and
# a sequence of queries and no keys (output 0, LSE -inf, no gradient).
VARLEN_SEQLENS_Q = (0, 1, 131, 300, 57)
VARLEN_SEQLENS_K = (5, 1, 77, 200, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims", [(80, 80), (192, 128)], ids=_dims_id)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_backward_match_each_sequence(backend, dims, causal, rng):
    """attention_varlen and attention_varlen_backward over packed views of NaN-padded buffers,
    into views of NaN-filled ones, sequence by sequence against the fixed-length reference."""
    import cupy
    import ptxattn

    backend = _backend(backend)
    seqlens_q, seqlens_k = VARLEN_SEQLENS_Q, VARLEN_SEQLENS_K
    dout, q, k, v = (_in_nan_buffer(x) for x in _inputs((sum(seqlens_q),), (sum(seqlens_k),),
                                                        dims, "bfloat16", rng))
    layout = (_cu_seqlens(seqlens_q), _cu_seqlens(seqlens_k), max(seqlens_q), max(seqlens_k))
    out = _nan_view(dout.shape, dout.dtype)
    got, lse = ptxattn.attention_varlen(q, k, v, *layout, causal=causal, return_lse=True,
                                        out=out, backend=backend)
    assert got is out
    _assert_columns_past_untouched("out", out)
    starts_q, starts_k = np.cumsum([0, *seqlens_q]), np.cumsum([0, *seqlens_k])
    for b, (seqlen_q, seqlen_k) in enumerate(zip(seqlens_q, seqlens_k)):
        rows = slice(starts_q[b], starts_q[b + 1])
        if seqlen_q and not seqlen_k:
            assert not bool(out[rows].astype(cupy.float32).any()), f"sequence {b}: output not 0"
            assert bool(cupy.isneginf(lse[:, rows]).all()), f"sequence {b}: LSE not -inf"
        elif seqlen_q:
            keys = slice(starts_k[b], starts_k[b + 1])
            _assert_output_close(out[None, rows], lse[None, :, rows], q[None, rows],
                                 k[None, keys], v[None, keys], causal=causal)
    buffers = {name: _nan_view(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = ptxattn.attention_varlen_backward(dout, q, k, v, out, lse, *layout, causal=causal,
                                              backend=backend, **buffers)
    assert all(grad is buffer for grad, buffer in zip(grads, buffers.values()))
    for name, buffer in buffers.items():
        _assert_columns_past_untouched(name, buffer)
    assert_varlen_gradients_close(grads, dout, q, k, v, seqlens_q, seqlens_k, causal=causal)


PAGE_SIZE = 16
CACHE_LENGTHS = (0, 77, 200)  # each sequence's filled rows before the append
CAPACITY = 19 * PAGE_SIZE  # the longest plus 70 new tokens, in whole pages
# (layout, seqlen_q = the tokens appended, num_splits, backend): one query row a sequence,
# paged caches and the portable backend run on the decode kernel, 70 query rows over a
# contiguous cache on Hopper's serving build.
KVCACHE_CASES = [
    pytest.param("contiguous", 1, 1, None, id="decode-contiguous"),
    pytest.param("contiguous", 1, 3, None, id="decode-contiguous-3-splits"),
    pytest.param("paged", 1, 3, None, id="decode-paged-3-splits"),
    pytest.param("paged", 70, 1, None, id="prefill-paged"),
    pytest.param("paged", 70, 3, None, id="prefill-paged-3-splits"),
    pytest.param("contiguous", 70, 1, None, id="prefill-contiguous"),
    pytest.param("contiguous", 70, 3, None, id="prefill-contiguous-3-splits"),
    pytest.param("contiguous", 70, 3, "portable", id="prefill-contiguous-3-splits-portable"),
]


def _paged(caches, rng):
    """Paged copies of contiguous caches (batch, CAPACITY, heads, D) under one block table:
    each sequence's pages shuffled over a pool with spare pages between, each pool a view of a
    NaN-padded buffer. Returns (pools, block_table)."""
    import cupy

    batch = caches[0].shape[0]
    per_seq = CAPACITY // PAGE_SIZE
    num_pages = batch * per_seq + 3
    order = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq)
    pools = []
    for cache in caches:
        pool = _in_nan_buffer(normal((num_pages, PAGE_SIZE, *cache.shape[2:]), cache.dtype, rng))
        pool[cupy.asarray(order.ravel())] = cache.reshape(-1, PAGE_SIZE, *cache.shape[2:])
        pools.append(pool)
    return pools, cupy.asarray(order.astype(np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(96, 96), (192, 128)], ids=_dims_id)
@pytest.mark.parametrize("layout,seqlen_q,num_splits,backend", KVCACHE_CASES)
def test_kvcache_with_appended_tokens_matches_the_dense_reference(dims, layout, seqlen_q,
                                                                  num_splits, backend, rng):
    """attention_with_kvcache appending seqlen_q tokens a sequence (one sequence's cache empty
    before), every array a view of a NaN-padded buffer: the cache holds the new tokens, the
    output is the dense reference's over each sequence's filled rows; three splits merge
    partial rows of the compiled head dim into head_dim_v columns."""
    import cupy
    import ptxattn

    head_dim, head_dim_v = dims
    batch, (heads_q, heads_kv) = len(CACHE_LENGTHS), HEADS
    q = _in_nan_buffer(normal((batch, seqlen_q, heads_q, head_dim), "bfloat16", rng))
    k_dense = normal((batch, CAPACITY, heads_kv, head_dim), "bfloat16", rng)
    v_dense = normal((batch, CAPACITY, heads_kv, head_dim_v), "bfloat16", rng)
    k_new = _in_nan_buffer(normal((batch, seqlen_q, heads_kv, head_dim), "bfloat16", rng))
    v_new = _in_nan_buffer(normal((batch, seqlen_q, heads_kv, head_dim_v), "bfloat16", rng))
    if layout == "paged":
        (k_cache, v_cache), block_table = _paged((k_dense, v_dense), rng)
    else:
        k_cache, v_cache, block_table = _in_nan_buffer(k_dense), _in_nan_buffer(v_dense), None
    out = _nan_view((batch, seqlen_q, heads_q, head_dim_v), q.dtype)
    got, lse = ptxattn.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cupy.asarray(np.array(CACHE_LENGTHS, np.int32)),
        block_table=block_table, k_new=k_new, v_new=v_new, num_splits=num_splits,
        return_lse=True, out=out, backend=backend)
    assert got is out
    for b, length in enumerate(CACHE_LENGTHS):
        k_dense[b, length:length + seqlen_q] = k_new[b]
        v_dense[b, length:length + seqlen_q] = v_new[b]
    for name, cache, dense in (("k_cache", k_cache, k_dense), ("v_cache", v_cache, v_dense)):
        rows = cache if block_table is None else cache[block_table].reshape(dense.shape)
        assert bool((rows == dense).all()), f"{name} does not hold the appended tokens"
        _assert_columns_past_untouched(name, cache)
    _assert_columns_past_untouched("out", out)
    for b, length in enumerate(CACHE_LENGTHS):
        seen = slice(0, length + seqlen_q)
        _assert_output_close(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_dense[b:b + 1, seen],
                             v_dense[b:b + 1, seen], causal=True)


# ---------------------------------------------------------------------------------------------
# FP8


def _e4m3_in_nan_buffer(shape, rng):
    """An E4M3Array view of ``shape``: e4m3 roundings of standard normal values in the first
    columns of a buffer whose other columns are e4m3 NaN (0x7f)."""
    import cupy
    from ptxattn import fp8

    host = rng.standard_normal(shape, dtype=np.float32).astype(fp8.E4M3).view(np.uint8)
    buffer = cupy.full((*shape[:-1], _buffer_columns(np.uint8)), 0x7f, dtype=cupy.uint8)
    buffer[..., :shape[-1]] = cupy.asarray(host)
    return fp8.E4M3Array(buffer[..., :shape[-1]])


def _descales(granularity, batch, seqlens, rng):
    """Descales in [0.5, 2] per (batch, head), or with ``granularity`` "block" per 128 rows of
    q and k (v per head, as quantize_qkv gives it)."""
    import cupy
    from ptxattn import fp8

    def draw(*shape):
        return cupy.asarray(rng.uniform(0.5, 2.0, shape).astype(np.float32))

    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, HEADS
    if granularity == "head":
        return dict(q_descale=draw(batch, heads_q), k_descale=draw(batch, heads_kv),
                    v_descale=draw(batch, heads_kv))
    return dict(q_descale=draw(batch, heads_q, -(-seqlen_q // fp8.SCALE_BLOCK_ROWS)),
                k_descale=draw(batch, heads_kv, -(-seqlen_k // fp8.SCALE_BLOCK_ROWS)),
                v_descale=draw(batch, heads_kv))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [80, 96, 192])
@pytest.mark.parametrize("causal,seqlens", CAUSAL_SEQLENS)
@pytest.mark.parametrize("granularity", ["head", "block"])
def test_fp8_matches_fp32_on_dequantized_inputs(head_dim, causal, seqlens, granularity, rng):
    """fp8.attention over views of e4m3 buffers whose columns past them are NaN, into a view of
    a NaN-filled buffer; per-block k descales run on tiles of their own."""
    from ptxattn import fp8, runtime

    if runtime.device_arch() not in fp8.ARCHS:
        pytest.skip(f"FP8 attention runs on {', '.join(fp8.ARCHS)}")
    batch, (seqlen_q, seqlen_k), (heads_q, heads_kv) = 2, seqlens, HEADS
    q8 = _e4m3_in_nan_buffer((batch, seqlen_q, heads_q, head_dim), rng)
    k8 = _e4m3_in_nan_buffer((batch, seqlen_k, heads_kv, head_dim), rng)
    v8 = _e4m3_in_nan_buffer((batch, seqlen_k, heads_kv, head_dim), rng)
    descales = _descales(granularity, batch, seqlens, rng)
    out = _nan_view(q8.shape, "bfloat16")
    got, lse = fp8.attention(q8, k8, v8, **descales, causal=causal, return_lse=True, out=out)
    assert got is out
    _assert_columns_past_untouched("out", out)
    assert_fp8_close(q8, k8, v8, descales, out, lse, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 80, 96, 192])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_fp8_quantizer_at_head_dims_between_the_compiled_ones(head_dim, granularity, rng):
    """fp8.quantize of a view of a NaN-padded buffer (the kernel of the next compiled head
    dim up reads none of the NaN columns): the host encoding byte for byte, and its bytes and
    descales run fp8.attention."""
    import cupy

    from ptxattn import fp8, runtime
    from test_fp8 import _host_quantize

    shape = (2, 300, 2, head_dim)
    buffer = cupy.full((*shape[:3], head_dim + 32), cupy.nan, dtype="bfloat16")
    x = buffer[..., :head_dim]
    x[...] = normal(shape, "bfloat16", rng, scale=3.0)
    x8, descale = fp8.quantize(x, granularity)
    assert x8.shape == shape and x8.bytes.flags.c_contiguous
    expected_bytes, expected_descale = _host_quantize(cupy.asnumpy(x.astype(cupy.float32)),
                                                      granularity)
    np.testing.assert_array_equal(descale.get(), expected_descale)
    np.testing.assert_array_equal(x8.bytes.get(), expected_bytes)
    if runtime.device_arch() in fp8.ARCHS:
        out = fp8.attention(x8, x8, x8, q_descale=descale, k_descale=descale,
                            v_descale=descale if granularity == "tensor" else 1.0, causal=True)
        assert out.shape == shape and bool(cupy.isfinite(out).all())


# ---------------------------------------------------------------------------------------------
# The reference itself


@pytest.mark.gpu
def test_reference_with_narrower_values_matches_float64(rng):
    """The FP32 reference at head_dim 16, head_dim_v 8, causal with GQA: its output against a
    float64 attention written apart from reference.py, its gradients against central
    differences of that attention."""
    from ptxattn import reference

    q = normal((1, 5, 2, 16), "float16", rng)
    k = normal((1, 7, 1, 16), "float16", rng)
    v = normal((1, 7, 1, 8), "float16", rng)
    dout = normal((1, 5, 2, 8), "float16", rng)
    scale = 0.25
    d64 = dout.get().astype(np.float64)

    def attention64(q64, k64, v64):
        s = np.einsum("bqhd,bkhd->bhqk", q64, np.repeat(k64, 2, axis=2)) * scale
        s = np.where(np.arange(7)[None, :] > np.arange(5)[:, None] + 2, -np.inf, s)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v64, 2, axis=2))

    args = [x.get().astype(np.float64) for x in (q, k, v)]
    out = reference.attention(q, k, v, causal=True, softmax_scale=scale)
    np.testing.assert_allclose(out.get(), attention64(*args), atol=2e-5)
    grads = reference.attention_backward(dout, q, k, v, causal=True, softmax_scale=scale)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_matches_finite_differences(lambda *a: float((attention64(*a) * d64).sum()), args,
                                      grads, ("dq", "dk", "dv"))


# ---------------------------------------------------------------------------------------------
# Head dims refused before anything needs a GPU

ENTRIES = ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache")


def _rows(shape, ptr, dtype="bfloat16", cls=MetaArray, padded=True):
    """A stand-in of ``shape``, contiguous or with its rows padded to whole 16-byte pieces (as
    those of a view of a wider buffer are, whose strides the checks take)."""
    item = np.dtype(dtype).itemsize
    width = -(-shape[-1] * item // 16) * 16 // item if padded else shape[-1]
    strides, step = [], item
    for n in reversed((*shape[:-1], width)):
        strides.insert(0, step)
        step *= n
    return cls(shape, dtype, strides=strides, ptr=ptr)


def _call(entry, head_dim, head_dim_v, padded):
    """ptxattn.<entry> on stand-ins (_rows), each at its own MiB: GQA 4:2, q and k of head_dim
    columns, v, out and dout of head_dim_v."""
    import ptxattn

    def at(mib, shape, cls=MetaArray):
        return _rows(shape, mib << 20, cls=cls, padded=padded)

    if entry == "attention_with_kvcache":
        return ptxattn.attention_with_kvcache(at(1, (2, 1, 4, head_dim)),
                                              at(2, (2, 64, 2, head_dim)),
                                              at(3, (2, 64, 2, head_dim_v)), cache_seqlens=8)
    packed = entry.startswith("attention_varlen")
    rows_q, rows_k, cls = ((32,), (48,), Packed) if packed else ((2, 16), (2, 24), MetaArray)
    q = at(1, (*rows_q, 4, head_dim), cls)
    k = at(2, (*rows_k, 2, head_dim), cls)
    v = at(3, (*rows_k, 2, head_dim_v), cls)
    if packed:
        layout = (MetaArray((3,), "int32", ptr=4 << 20), MetaArray((3,), "int32", ptr=5 << 20),
                  16, 24)
        lse = MetaArray((4, 32), "float32", ptr=6 << 20)
    else:
        layout, lse = (), MetaArray((2, 4, 16), "float32", ptr=6 << 20)
    if not entry.endswith("_backward"):
        return getattr(ptxattn, entry)(q, k, v, *layout)
    dout = at(7, (*rows_q, 4, head_dim_v), cls)
    out = at(8, (*rows_q, 4, head_dim_v), cls)
    return getattr(ptxattn, entry)(dout, q, k, v, out, lse, *layout)


# A contiguous array whose head dim breaks the rule has strides that break theirs: the head dim
# is what the error names either way.
LAYOUTS = [pytest.param(False, id="contiguous"), pytest.param(True, id="rows-padded")]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("head_dim", [4, 100, 264])
@pytest.mark.parametrize("padded", LAYOUTS)
def test_head_dims_off_the_rule_are_refused(entry, head_dim, padded):
    with pytest.raises(ValueError, match=rf"head_dim must be a multiple of 8 from 8 to 256 for "
                                         rf"bfloat16 inputs, got {head_dim}$"):
        _call(entry, head_dim, head_dim, padded)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("padded", LAYOUTS)
def test_value_heads_wider_than_the_keys_are_refused(entry, padded):
    with pytest.raises(ValueError, match=r"head_dim_v\) must be at most head_dim \(64\)"
                                         r".*, got 72$"):
        _call(entry, 64, 72, padded)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("padded", LAYOUTS)
def test_value_head_dims_off_the_rule_are_refused(entry, padded):
    with pytest.raises(ValueError, match=r"\bv(_cache)?\b.* a multiple of 8 from 8 to "
                                         r"(64|256)\b.*, got 60$"):
        _call(entry, 64, 60, padded)


def _fp8_problem(head_dim, head_dim_v, padded=False):
    from ptxattn import fp8

    def at(mib, shape):
        return _rows(shape, mib << 20, fp8.E4M3, padded=padded)

    return AttentionProblem.from_fp8(at(1, (2, 16, 4, head_dim)), at(2, (2, 24, 2, head_dim)),
                                     at(3, (2, 24, 2, head_dim_v)), q_descale=1.0,
                                     k_descale=1.0, v_descale=1.0)


@pytest.mark.parametrize("head_dim", [16, 80, 96, 192])
def test_fp8_head_dims_that_are_multiples_of_16_pass(head_dim):
    problem = _fp8_problem(head_dim, head_dim)
    assert (problem.head_dim, problem.head_dim_v) == (head_dim, head_dim)
    assert problem.softmax_scale == pytest.approx(head_dim ** -0.5)


@pytest.mark.parametrize("head_dim", [8, 40, 264])
@pytest.mark.parametrize("padded", LAYOUTS)
def test_fp8_head_dims_off_the_rule_are_refused(head_dim, padded):
    with pytest.raises(ValueError, match=rf"head_dim must be a multiple of 16 from 16 to 256 "
                                         rf"for e4m3 inputs, got {head_dim}$"):
        _fp8_problem(head_dim, head_dim, padded)


def test_fp8_rotation_needs_a_compiled_head_dim():
    """A Hadamard rotation spans the quantizer's compiled rows: at 96 it is refused before any
    launch (the rotation itself is made for powers of two only, so this asks with 32)."""
    from ptxattn import fp8
    from ptxattn.quant.fp8 import _rotation_signs

    with pytest.raises(ValueError, match=r"a rotation needs head_dim one of \(64, 128, 256\)"):
        _rotation_signs(fp8.hadamard_rotation(32, seed=0), 32)


def test_fp8_values_must_have_the_keys_head_dim():
    with pytest.raises(ValueError, match=r"head_dim_v\) must be head_dim \(128\) for e4m3 "
                                         r"inputs, got 64$"):
        _fp8_problem(128, 64)


def test_mxfp8_runs_its_compiled_head_dims_only():
    """head_dim 96, three 32-column scale blocks a row, in operands laid out as
    ptxattn.blockscaled's docstring says."""
    def at(mib, shape):
        return MetaArray(shape, "uint8", ptr=mib << 20)

    keys = 3 * 128  # 300 keys, rounded up to whole 128-key blocks in V's layout
    operands = dict(q=at(1, (2, 100, 4, 96)), k=at(2, (2, 300, 2, 96)), v=at(3, (2, 2, 96, keys)),
                    q_scale=at(4, (2, 100, 4, 3)), k_scale=at(5, (2, 300, 2, 3)),
                    v_scale=at(6, (2, 2, 96, keys // 32)))
    with pytest.raises(ValueError, match=r"^head_dim must be one of \[64, 128\] for mxfp8 "
                                         r"inputs, got 96"):
        AttentionProblem.from_blockscaled(**operands, format="mxfp8")
