"""Every attention backend against the FP32 reference, on the GPU.

Tolerance, as FlashAttention's own tests justify it: the kernel's max error against FP32 must be
at most twice the max error of the same math done naively in the input precision
(reference.attention(precision="input")), plus the rounding noise of one value in that dtype.
"""

import math

import numpy as np
import pytest

from inputs import assert_within_naive_error, grouped_qkv

pytestmark = pytest.mark.gpu

BACKENDS = ("portable", "hopper")
SEQLEN_PAIRS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000),
                (1000, 17), (127, 4097)]


def _module(backend):
    """The fixed-length forward launcher of ``backend``, as the dispatch table names it."""
    from ptxattn import dispatch
    from ptxattn.runtime import device_arch

    module = next(route.launcher for route in dispatch.TABLE if route.backend == backend
                  and route.call == "forward" and "bfloat16" in route.formats)
    if device_arch() not in module.ARCHS:
        pytest.skip(f"backend {backend} does not run on {device_arch()}")
    return module


def _random(shape, dtype, rng, scale=1.0):
    import cupy
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def _assert_close(q, k, v, out, lse, *, causal, softmax_scale=None):
    from ptxattn import reference

    ref, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                       return_lse=True)
    naive, naive_lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                           return_lse=True, precision="input")
    assert_within_naive_error(out, lse, ref, ref_lse, naive, naive_lse, q.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_matches_fp32_reference(backend, dtype, causal, head_dim, seqlens, rng):
    import cupy
    import ptxattn

    module = _module(backend)
    if head_dim not in module.HEAD_DIMS:
        pytest.skip(f"backend {backend} supports head dims {module.HEAD_DIMS}")
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k < 10 ** 6 else 1
    q = _random((batch, seqlen_q, 2, head_dim), dtype, rng)
    k = _random((batch, seqlen_k, 2, head_dim), dtype, rng)
    v = _random((batch, seqlen_k, 2, head_dim), dtype, rng)
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    _, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True, out=out, backend=backend)
    _assert_close(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_heads(backend, heads, causal, rng):
    import ptxattn

    _module(backend)
    heads_q, heads_kv = heads
    q = _random((3, 300, heads_q, 128), "bfloat16", rng)
    k = _random((3, 257, heads_kv, 128), "bfloat16", rng)
    v = _random((3, 257, heads_kv, 128), "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    _assert_close(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_and_output(backend, causal, rng):
    """q/k/v sliced out of one packed (batch, seqlen, 3, heads, dim) buffer, out a strided view."""
    import cupy
    import ptxattn

    _module(backend)
    packed = _random((2, 333, 3, 4, 64), "float16", rng)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    assert not q.flags.c_contiguous
    big_out = cupy.full((2, 333, 8, 64), cupy.nan, dtype=cupy.float16)
    out = big_out[:, :, 1::2]
    _, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True, out=out,
                               softmax_scale=0.3, backend=backend)
    _assert_close(q, k, v, out, lse, causal=causal, softmax_scale=0.3)
    assert bool(cupy.isnan(big_out[:, :, 0::2]).all()), "wrote outside the out view"


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_stay_finite(backend, rng):
    """Scores around +-60 overflow a naive exp; the online softmax must keep them finite."""
    import ptxattn

    _module(backend)
    q = _random((1, 513, 2, 64), "bfloat16", rng, scale=8.0)
    k = _random((1, 700, 2, 64), "bfloat16", rng, scale=8.0)
    v = _random((1, 700, 2, 64), "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, backend=backend)
    _assert_close(q, k, v, out, lse, causal=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_rows_that_see_no_key(backend, rng):
    """seqlen_q > seqlen_k, bottom-right aligned: the first rows see nothing -> 0 and -inf."""
    import cupy
    import ptxattn

    _module(backend)
    q = _random((1, 200, 2, 64), "bfloat16", rng)
    k = _random((1, 50, 2, 64), "bfloat16", rng)
    v = _random((1, 50, 2, 64), "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert bool((out[:, :150] == 0).all())
    assert bool(cupy.isneginf(lse[:, :, :150]).all())
    _assert_close(q, k, v, out, lse, causal=True)


def test_default_backend_follows_the_gpu():
    from ptxattn import dispatch
    from ptxattn.runtime import device_arch

    expected = "hopper" if device_arch() == "sm_90a" else "portable"
    assert dispatch.select(device_arch(), "bfloat16", 128).backend == expected


def test_reference_matches_a_float64_softmax(rng):
    """The yardstick itself, against a direct float64 NumPy computation."""
    import cupy
    from ptxattn import reference

    q = _random((1, 37, 3, 64), "float16", rng)
    k = _random((1, 53, 3, 64), "float16", rng)
    v = _random((1, 53, 3, 64), "float16", rng)
    out = reference.attention(q, k, v, causal=True).get()
    qh, kh, vh = (cupy.asnumpy(x).astype(np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    s = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(64)
    s[..., np.arange(53)[None, :] > np.arange(37)[:, None] + 16] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    expected = (p / p.sum(-1, keepdims=True)) @ vh
    np.testing.assert_allclose(out, expected.transpose(0, 2, 1, 3), atol=2e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_dynamic_tile_order_matches_one_block_per_tile(head_dim, rng):
    """Persistent causal grids take tiles in a dynamic order; every tile's arithmetic is the same
    whichever block runs it, so the result is bitwise that of one block per tile, launch after
    launch (the kernel leaves its tile counter zeroed for the next one)."""
    import cupy

    hopper = _module("hopper")
    q = _random((2, 1000, 4, head_dim), "bfloat16", rng)
    k = _random((2, 1000, 2, head_dim), "bfloat16", rng)
    v = _random((2, 1000, 2, head_dim), "bfloat16", rng)
    results = []
    for persistent in (False, True, True):
        out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
        lse = cupy.full((2, 4, 1000), cupy.nan, dtype=cupy.float32)
        hopper.run(q, k, v, out, lse, causal=True, softmax_scale=head_dim ** -0.5,
                   persistent=persistent)
        results.append((out, lse))
    for out, lse in results[1:]:
        assert bool(cupy.array_equal(out, results[0][0])), "output differs from static order"
        assert bool(cupy.array_equal(lse, results[0][1])), "LSE differs from static order"
    assert hopper._tile_counter(q.device.id).get().tolist() == [0, 0]
    _assert_close(q, k, v, *results[0], causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, consumers", [(64, 3), (128, 2)])
@pytest.mark.parametrize("seqlens", [(17, 17), (300, 457), (1000, 1000), (1000, 300)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("keys", ["normal", "growing"])
def test_hopper_stale_max_fast_path_matches_the_max_pass(causal, head_dim, consumers, seqlens,
                                                         keys, rng):
    """The softmax's fast path (keep the row maxima, check the probabilities' sums) with its
    slow path (Q K^T again, then the max pass) gives bitwise the results of the max pass alone."""
    import cupy

    hopper = _module("hopper")
    seqlen_q, seqlen_k = seqlens
    q, k, v = grouped_qkv(seqlen_q, seqlen_k, head_dim, keys, rng)
    results = []
    for fast in (False, True):
        out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
        lse = cupy.full((2, 4, seqlen_q), cupy.nan, dtype=cupy.float32)
        hopper.run(q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5,
                   tiles=(128, 2), consumers=consumers, stale_max_first=fast)
        results.append((out, lse))
    (plain_out, plain_lse), (fast_out, fast_lse) = results
    assert bool(cupy.array_equal(fast_out, plain_out)), "output differs from the max pass"
    assert bool(cupy.array_equal(fast_lse, plain_lse)), "LSE differs from the max pass"
    _assert_close(q, k, v, fast_out, fast_lse, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, consumers", [(64, 3), (128, 2), (256, 2)])
@pytest.mark.parametrize("seqlens", [(17, 17), (300, 457), (1000, 1000), (1000, 300)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
def test_hopper_blocks_in_turn_match_the_intra_warpgroup_overlap(causal, head_dim, consumers,
                                                                 seqlens, rng):
    """Each key block's Q K^T, softmax and P V in turn (a schedule the tuner may pick) gives
    bitwise what the overlapped mainloop gives: O takes the same rescales and the same adds in
    the same order."""
    import cupy

    hopper = _module("hopper")
    seqlen_q, seqlen_k = seqlens
    q, k, v = grouped_qkv(seqlen_q, seqlen_k, head_dim, "growing", rng)
    results = []
    for overlap in (True, False):
        out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
        lse = cupy.full((2, 4, seqlen_q), cupy.nan, dtype=cupy.float32)
        hopper.run(q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5,
                   consumers=consumers, stale_max_first=False, intra_overlap=overlap)
        results.append((out, lse))
    (overlap_out, overlap_lse), (in_turn_out, in_turn_lse) = results
    assert bool(cupy.array_equal(in_turn_out, overlap_out)), "output differs from the overlap"
    assert bool(cupy.array_equal(in_turn_lse, overlap_lse)), "LSE differs from the overlap"
    _assert_close(q, k, v, in_turn_out, in_turn_lse, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(17, 17), (1000, 1000), (300, 1000), (1000, 300)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("persistent", [False, True])
def test_hopper_three_consumer_warpgroups(causal, seqlens, persistent, rng):
    """Tiles of 192 query rows (three consumer warpgroups handing the tensor cores round),
    whichever schedule the tuned table picks for head_dim 64."""
    import cupy

    hopper = _module("hopper")
    seqlen_q, seqlen_k = seqlens
    q = _random((2, seqlen_q, 4, 64), "bfloat16", rng)
    k = _random((2, seqlen_k, 2, 64), "bfloat16", rng)
    v = _random((2, seqlen_k, 2, 64), "bfloat16", rng)
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    lse = cupy.full((2, 4, seqlen_q), cupy.nan, dtype=cupy.float32)
    hopper.run(q, k, v, out, lse, causal=causal, softmax_scale=64 ** -0.5, tiles=(128, 2),
               consumers=3, persistent=persistent)
    _assert_close(q, k, v, out, lse, causal=causal)
