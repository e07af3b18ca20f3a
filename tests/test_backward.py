"""attention_backward against the FP32 reference gradients, on the GPU.

Tolerance as in the forward's tests: each gradient's max error against the FP32 reference
(reference.attention_backward) must be at most twice the max error of the same math done naively
in the input precision (precision="input"), plus twice the rounding noise of one value of that
gradient in the input dtype. One tiny float64 case checks the reference itself by finite
differences.
"""

import numpy as np
import pytest

from inputs import assert_matches_finite_differences, backward_backend, normal

pytestmark = pytest.mark.gpu

BACKENDS = ("portable", "hopper")


def _gradients(dout, q, k, v, *, causal, backend, softmax_scale=None, deterministic=False,
               **buffers):
    import ptxattn

    out, lse = ptxattn.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 return_lse=True)
    return ptxattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                      softmax_scale=softmax_scale, deterministic=deterministic,
                                      backend=backend, **buffers)


def _assert_close(grads, dout, q, k, v, *, causal, softmax_scale=None):
    import cupy
    from ptxattn import reference

    ref = reference.attention_backward(dout, q, k, v, causal=causal,
                                       softmax_scale=softmax_scale)
    naive = reference.attention_backward(dout, q, k, v, causal=causal,
                                         softmax_scale=softmax_scale, precision="input")
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert got.dtype == q.dtype, name
        assert bool(cupy.isfinite(got).all()), f"{name} has NaN/Inf (or was not written)"
        noise = float(cupy.abs(r.astype(q.dtype).astype(cupy.float32) - r).max())
        err = float(cupy.abs(got.astype(cupy.float32) - r).max())
        naive_err = float(cupy.abs(n - r).max())
        assert err <= 2 * naive_err + 2 * noise + 1e-6, (name, err, naive_err, noise)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", [(1, 1), (17, 17), (129, 129), (1000, 1000), (17, 1000),
                                     (1000, 17), (129, 300)], ids=lambda p: f"{p[0]}x{p[1]}")
def test_matches_fp32_reference(backend, causal, head_dim, seqlens, rng):
    backend = backward_backend(backend, head_dim)
    seqlen_q, seqlen_k = seqlens
    q = normal((2, seqlen_q, 4, head_dim), "bfloat16", rng)
    k = normal((2, seqlen_k, 4, head_dim), "bfloat16", rng)
    v = normal((2, seqlen_k, 4, head_dim), "bfloat16", rng)
    dout = normal((2, seqlen_q, 4, head_dim), "bfloat16", rng)
    grads = _gradients(dout, q, k, v, causal=causal, backend=backend)
    _assert_close(grads, dout, q, k, v, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_float16(backend, head_dim, causal, rng):
    backend = backward_backend(backend, head_dim)
    q = normal((1, 300, 2, head_dim), "float16", rng)
    k = normal((1, 300, 2, head_dim), "float16", rng)
    v = normal((1, 300, 2, head_dim), "float16", rng)
    dout = normal((1, 300, 2, head_dim), "float16", rng)
    grads = _gradients(dout, q, k, v, causal=causal, backend=backend, softmax_scale=0.2)
    _assert_close(grads, dout, q, k, v, causal=causal, softmax_scale=0.2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_heads(backend, group, head_dim, causal, rng):
    backend = backward_backend(backend, head_dim)
    q = normal((2, 257, 8, head_dim), "bfloat16", rng)
    k = normal((2, 200, 8 // group, head_dim), "bfloat16", rng)
    v = normal((2, 200, 8 // group, head_dim), "bfloat16", rng)
    dout = normal((2, 257, 8, head_dim), "bfloat16", rng)
    grads = _gradients(dout, q, k, v, causal=causal, backend=backend)
    _assert_close(grads, dout, q, k, v, causal=causal)


def _portable_tiles():
    from ptxattn.launchers import portable_backward
    return sorted({(head_dim, tile) for (head_dim, _), tiles in portable_backward.BWD_TILES.items()
                   for _, tile in tiles}, key=lambda pair: (pair[0], pair[1].label()))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,tile", _portable_tiles(),
                         ids=lambda x: x.label() if hasattr(x, "label") else f"d{x}")
def test_every_portable_tile_runs_here(head_dim, tile, causal, rng):
    """Each portable backward tile, also those chosen for other GPUs (sm_80's, the 99 KB
    archs'), forced on this one where its shared memory fits: their warp grids are otherwise
    checked only on GPUs this suite may never see. Tails, GQA and seqlen_q != seqlen_k; the
    deterministic sums too, bit for bit from run to run."""
    import cupy
    import ptxattn
    from ptxattn import archs
    from ptxattn.launchers import portable_backward
    from ptxattn.problem import AttentionProblem
    from ptxattn.runtime import device_arch

    arch = device_arch()
    if arch not in portable_backward.ARCHS:
        pytest.skip(f"the portable family does not run on {arch}")
    if tile.smem_bytes(head_dim) > archs.get(arch).smem_per_block:
        pytest.skip(f"{tile.label()} needs more shared memory than {arch} has")
    q = normal((2, 257, 4, head_dim), "bfloat16", rng)
    k = normal((2, 300, 2, head_dim), "bfloat16", rng)
    v = normal((2, 300, 2, head_dim), "bfloat16", rng)
    dout = normal((2, 257, 4, head_dim), "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, causal=causal, return_lse=True)
    problem = AttentionProblem.from_backward(dout, q, k, v, out, lse, causal=causal)
    for deterministic in (False, True):
        grads = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        portable_backward.backward(problem, dout, q, k, v, out, lse, *grads,
                                   deterministic=deterministic, tile=tile)
        _assert_close(grads, dout, q, k, v, causal=causal)
    again = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    portable_backward.backward(problem, dout, q, k, v, out, lse, *again, deterministic=True,
                               tile=tile)
    for name, first, second in zip(("dq", "dk", "dv"), grads, again):
        assert cupy.array_equal(first.view(cupy.uint16), second.view(cupy.uint16)), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_gradients_and_dout(backend, causal, rng):
    """q, k, v slices of one packed (batch, seqlen, 3, heads, head_dim) array; dout a slice of a
    wider buffer, laid out unlike out; gradients written into strided slices."""
    import cupy

    backend = backward_backend(backend, 128)
    qkv = normal((2, 333, 3, 4, 128), "bfloat16", rng)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = normal((2, 4, 333, 256), "bfloat16", rng)[..., 64:192].transpose(0, 2, 1, 3)
    grads = cupy.zeros((2, 333, 3, 4, 128), dtype="bfloat16")
    dq, dk, dv = grads[:, :, 0], grads[:, :, 1], grads[:, :, 2]
    got = _gradients(dout, q, k, v, causal=causal, backend=backend, dq=dq, dk=dk, dv=dv)
    assert all(g is b for g, b in zip(got, (dq, dk, dv)))
    _assert_close((dq, dk, dv), dout, q, k, v, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_is_bitwise_reproducible(backend, head_dim, rng):
    import cupy

    backend = backward_backend(backend, head_dim)
    q = normal((2, 1000, 8, head_dim), "bfloat16", rng)
    k = normal((2, 1000, 2, head_dim), "bfloat16", rng)
    v = normal((2, 1000, 2, head_dim), "bfloat16", rng)
    dout = normal((2, 1000, 8, head_dim), "bfloat16", rng)
    runs = [_gradients(dout, q, k, v, causal=causal, backend=backend, deterministic=True)
            for causal in (True, True, False, False)]
    for first, again in ((runs[0], runs[1]), (runs[2], runs[3])):
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    _assert_close(runs[0], dout, q, k, v, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_have_zero_gradients(backend, rng):
    """Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key (LSE -inf)."""
    import cupy

    backend = backward_backend(backend, 64)
    q = normal((1, 300, 2, 64), "bfloat16", rng)
    k = normal((1, 100, 2, 64), "bfloat16", rng)
    v = normal((1, 100, 2, 64), "bfloat16", rng)
    dout = normal((1, 300, 2, 64), "bfloat16", rng)
    grads = _gradients(dout, q, k, v, causal=True, backend=backend)
    assert not bool(grads[0][:, :200].astype(cupy.float32).any())
    _assert_close(grads, dout, q, k, v, causal=True)


def test_reference_gradients_match_finite_differences(rng):
    """The float32 reference's gradients against central differences of a float64 attention,
    on a tiny problem with a causal mask and GQA: the yardstick the kernels are held to is
    itself right."""
    from ptxattn import reference

    shape_q, shape_kv = (1, 5, 2, 64), (1, 7, 1, 64)
    q = normal(shape_q, "float16", rng)
    k = normal(shape_kv, "float16", rng)
    v = normal(shape_kv, "float16", rng)
    dout = normal(shape_q, "float16", rng)
    scale = 0.125

    def loss(q64, k64, v64):
        s = np.einsum("bqhd,bkhd->bhqk", q64, np.repeat(k64, 2, axis=2)) * scale
        hidden = np.arange(7)[None, :] > np.arange(5)[:, None] + 2
        s = np.where(hidden, -np.inf, s)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", p, np.repeat(v64, 2, axis=2))
        return float((out * dout.get().astype(np.float64)).sum())

    args = [x.get().astype(np.float64) for x in (q, k, v)]
    grads = reference.attention_backward(dout, q, k, v, causal=True, softmax_scale=scale)
    assert_matches_finite_differences(loss, args, grads, ("dq", "dk", "dv"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_gradients_match_finite_differences(backend, rng):
    """The kernel's float16 gradients against float64 central differences directly, with the
    same yardstick as everywhere: twice the naive float16 reference's error, plus rounding."""
    import cupy

    from ptxattn import reference

    backend = backward_backend(backend, 64)
    q = normal((1, 3, 1, 64), "float16", rng)
    k = normal((1, 4, 1, 64), "float16", rng)
    v = normal((1, 4, 1, 64), "float16", rng)
    dout = normal((1, 3, 1, 64), "float16", rng)
    scale = 0.125
    args = [x.get().astype(np.float64) for x in (q, k, v)]
    d64 = dout.get().astype(np.float64)

    def loss(q64, k64, v64):
        s = np.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return float((np.einsum("bhqk,bkhd->bqhd", p, v64) * d64).sum())

    got = _gradients(dout, q, k, v, causal=False, backend=backend, softmax_scale=scale)
    naive = reference.attention_backward(dout, q, k, v, softmax_scale=scale, precision="input")
    eps = 1e-6
    for index, (g, n) in enumerate(zip(got, naive)):
        numeric = np.zeros_like(args[index])
        for pos in np.ndindex(numeric.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[index][pos] += eps
            minus[index][pos] -= eps
            numeric[pos] = (loss(*plus) - loss(*minus)) / (2 * eps)
        noise = np.abs(numeric.astype(np.float16).astype(np.float64) - numeric).max()
        err = np.abs(cupy.asnumpy(g).astype(np.float64) - numeric).max()
        naive_err = np.abs(cupy.asnumpy(n).astype(np.float64) - numeric).max()
        assert err <= 2 * naive_err + 2 * noise + 1e-6, (index, err, naive_err, noise)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_with_more_key_blocks_than_fit_on_the_gpu(backend, head_dim, causal, rng):
    """Hundreds of key blocks per (batch, kv head), more than the GPU holds at once: a block must
    never wait for one launched after it, or this hangs."""
    import cupy

    backend = backward_backend(backend, head_dim)
    q = normal((1, 300, 2, head_dim), "bfloat16", rng)
    k = normal((1, 20000, 1, head_dim), "bfloat16", rng)
    v = normal((1, 20000, 1, head_dim), "bfloat16", rng)
    dout = normal((1, 300, 2, head_dim), "bfloat16", rng)
    first = _gradients(dout, q, k, v, causal=causal, backend=backend, deterministic=True)
    again = _gradients(dout, q, k, v, causal=causal, backend=backend, deterministic=True)
    for a, b in zip(first, again):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    _assert_close(first, dout, q, k, v, causal=causal)
