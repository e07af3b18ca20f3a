"""The backward of a window, a softcap and sinks, fixed-length and varlen, against the FP32
reference gradients (issue "training coverage").

Tolerance as in test_backward.py: each gradient's max error against the FP32 reference
(reference.attention_backward) must be at most twice the max error of the same math done naively
in the input precision (precision="input"), plus twice the rounding noise of one value of that
gradient in its own dtype; dsinks is float32 in both, so its noise is nothing. Varlen gradients
are held to the rule sequence by sequence, against the fixed-length reference on that sequence's
rows. Rows that see no key must get dq exactly 0, and keys that no query sees dk = dv = 0.

The GPU tests are marked one by one: the argument checks at the end read only array metadata
and run without a GPU.
"""

import math

import numpy as np
import pytest

from inputs import assert_matches_finite_differences, backward_backend, normal

from meta_array import MetaArray

BACKENDS = ("portable", "hopper")
HEAD_DIMS = (64, 128, 256)
GRADIENTS = ("dq", "dk", "dv", "dsinks")
# dsinks holds one value a q head, so its max error is a max over the heads: steady over 16 heads
# whose sinks weigh alike, a toss-up over a few (or over one sink that outweighs the others).
# Calls with sinks take these (heads_q, heads_kv).
SINK_HEADS = (16, 4)
# Every backward tile's key block is 64 or 128 keys, so rows a multiple of 128 apart bound whole
# blocks of each: the poison tests NaN only whole blocks, which a kernel skips or loads whole.
KEY_BLOCK = 128


def _nan_like(x):
    """A buffer of x's shape and dtype full of NaN: a gradient the kernel does not write stays
    NaN, so it cannot pass for a zero left in freshly allocated memory."""
    import cupy
    return cupy.full(x.shape, cupy.nan, dtype=cupy.float32).astype(x.dtype)


def _fixed_inputs(seqlens, heads, head_dim, dtype, rng, batch=2):
    """dout, q, k, v (batch, seqlen, heads, head_dim) of standard normal values."""
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    q = normal((batch, seqlen_q, heads_q, head_dim), dtype, rng)
    k = normal((batch, seqlen_k, heads_kv, head_dim), dtype, rng)
    v = normal((batch, seqlen_k, heads_kv, head_dim), dtype, rng)
    return normal(q.shape, dtype, rng), q, k, v


def _masks(spec, heads_q, head_dim, rng):
    """A case's keyword arguments from its spec. ``sinks=True`` draws one sink logit per q head
    in [1, 5], about the log-sum-exp of a row of a few to a thousand unit-scale scores: every
    sink takes a share of its rows' weight, within a factor e^4 of the other heads' (see
    SINK_HEADS). A softcap comes with a softmax_scale that spreads the scaled scores to a third
    of the cap, so their tail (which decides the softmax) reaches it and tanh bends it."""
    import cupy

    masks = dict(spec)
    if masks.pop("sinks", False):
        masks["sinks"] = cupy.asarray(rng.uniform(1, 5, heads_q).astype(np.float32))
    if masks.get("softcap"):
        masks["softmax_scale"] = masks["softcap"] / (3 * math.sqrt(head_dim))
    return masks


def _gradients(dout, q, k, v, *, backend, masks):
    import ptxattn

    out, lse = ptxattn.attention(q, k, v, return_lse=True, **masks)
    return ptxattn.attention_backward(dout, q, k, v, out, lse, backend=backend, **masks)


def _rows_that_see_no_key(seqlen_q, seqlen_k, causal=False, window=(-1, -1)):
    """Host bool (seqlen_q,): the query rows whose window (bottom-right aligned, right 0 when
    causal) holds no key, from the definition rather than from the reference."""
    left, right = window
    right = 0 if causal else right
    diagonal = np.arange(seqlen_q) + seqlen_k - seqlen_q
    first = np.maximum(diagonal - left, 0) if left >= 0 else np.zeros(seqlen_q, np.int64)
    last = (np.minimum(diagonal + right, seqlen_k - 1) if right >= 0
            else np.full(seqlen_q, seqlen_k - 1))
    return first > last


def _assert_within(name, got, ref, naive, dtype):
    """got against the FP32 reference ``ref``: max error at most twice naive's plus twice the
    rounding noise of ref in ``dtype`` (none for float32)."""
    import cupy

    assert got.dtype == dtype, (name, got.dtype)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert bool(cupy.isfinite(got).all()), f"{name} has NaN/Inf (or was not written)"
    noise = float(cupy.abs(ref.astype(dtype).astype(cupy.float32) - ref).max())
    err = float(cupy.abs(got.astype(cupy.float32) - ref).max())
    naive_err = float(cupy.abs(naive - ref).max())
    assert err <= 2 * naive_err + 2 * noise + 1e-6, (name, err, naive_err, noise)


def _assert_no_gradient_without_keys(name, dq, seqlen_k, masks):
    """dq (batch, seqlen_q, heads, head_dim) exactly 0 on the rows that see no key."""
    import cupy

    blind = _rows_that_see_no_key(dq.shape[1], seqlen_k, masks.get("causal", False),
                                  masks.get("window", (-1, -1)))
    assert not bool(dq.astype(cupy.float32)[:, cupy.asarray(blind)].any()), (
        f"{name}: rows that see no key have a gradient")


def _assert_close(grads, dout, q, k, v, **masks):
    import cupy
    from ptxattn import reference

    ref = reference.attention_backward(dout, q, k, v, **masks)
    naive = reference.attention_backward(dout, q, k, v, precision="input", **masks)
    assert len(grads) == len(ref), "dsinks comes back exactly when sinks are given"
    for name, got, r, n in zip(GRADIENTS, grads, ref, naive):
        _assert_within(name, got, r, n, cupy.float32 if name == "dsinks" else q.dtype)
    _assert_no_gradient_without_keys("dq", grads[0], k.shape[1], masks)


def _same_bytes(first, again):
    import cupy
    return all(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8))
               for a, b in zip(first, again, strict=True))


# ---------------------------------------------------------------------------------------------
# Fixed length

# (window, causal, (seqlen_q, seqlen_k), (heads_q, heads_kv))
WINDOW_CASES = [
    pytest.param((100, -1), False, (300, 300), (4, 4), id="left"),
    pytest.param((-1, 50), False, (300, 1100), (8, 2), id="right-gqa-300x1100"),
    pytest.param((200, 70), False, (1000, 1000), (8, 2), id="both-gqa"),
    pytest.param((-1, 0), False, (17, 1000), (4, 4), id="right-0-17x1000"),
    pytest.param((3, 0), True, (257, 257), (4, 4), id="narrow-causal"),
    pytest.param((5, 7), False, (129, 300), (8, 2), id="narrow-both-gqa-129x300"),
    pytest.param((0, 0), False, (300, 300), (4, 4), id="diagonal-only"),
    pytest.param((2000, 2000), False, (100, 1100), (4, 4), id="wider-than-the-keys-100x1100"),
    pytest.param((3000, -1), True, (1100, 1100), (8, 2), id="wider-causal-gqa"),
    # the first 800 rows see no key
    pytest.param((100, 0), True, (1100, 300), (4, 4), id="causal-1100x300"),
    pytest.param((50, -1), True, (300, 1100), (8, 2), id="causal-gqa-300x1100"),
    # rows below 919 see no key
    pytest.param((64, 64), False, (1000, 17), (4, 4), id="both-1000x17"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window,causal,seqlens,heads", WINDOW_CASES)
def test_window_matches_fp32_reference(backend, head_dim, window, causal, seqlens, heads, rng):
    """Left, right and both sides; windows narrower than a key block and wider than the
    sequence; with and without causal; seqlen_q below and above seqlen_k; tails of every
    tile."""
    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _fixed_inputs(seqlens, heads, head_dim, "bfloat16", rng)
    masks = dict(causal=causal, window=window)
    grads = _gradients(dout, q, k, v, backend=backend, masks=masks)
    _assert_close(grads, dout, q, k, v, **masks)


# (spec for _masks, (seqlen_q, seqlen_k), (heads_q, heads_kv))
FEATURE_CASES = [
    pytest.param(dict(softcap=30.0), (300, 300), (4, 4), id="softcap"),
    pytest.param(dict(causal=True, softcap=30.0), (1000, 1000), (8, 2), id="softcap-causal-gqa"),
    pytest.param(dict(softcap=10.0, window=(64, 32)), (129, 300), (4, 4), id="softcap-window"),
    pytest.param(dict(sinks=True), (300, 1100), SINK_HEADS, id="sinks-300x1100"),
    # the first 800 rows see only their sink: LSE = sink, no gradient
    pytest.param(dict(causal=True, sinks=True), (1100, 300), (16, 16),
                 id="sinks-causal-1100x300"),
    pytest.param(dict(causal=True, window=(100, 0), sinks=True), (1000, 1000), SINK_HEADS,
                 id="sinks-window-causal"),
    pytest.param(dict(window=(5, 7), sinks=True), (257, 257), (16, 16),
                 id="sinks-narrow-window"),
    pytest.param(dict(causal=True, window=(200, -1), softcap=5.0, sinks=True), (300, 1100),
                 SINK_HEADS, id="window-softcap-sinks"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("spec,seqlens,heads", FEATURE_CASES)
def test_softcap_and_sinks_match_fp32_reference(backend, head_dim, spec, seqlens, heads, rng):
    """A softcap alone and with a window; sinks alone, with a window, and with rows that see
    only their sink; all three together. dsinks is held to the same rule as dq, dk, dv."""
    _check_with_masks(backend, head_dim, spec, seqlens, heads, "bfloat16", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("spec", [
    pytest.param(dict(window=(100, 30), sinks=True), id="window-sinks"),
    pytest.param(dict(causal=True, window=(300, -1), softcap=20.0), id="causal-window-softcap"),
])
def test_float16(backend, head_dim, spec, rng):
    """float16 inputs, more queries than keys: a window with sinks, and causal with a window
    and a softcap (its first 217 rows see no key)."""
    _check_with_masks(backend, head_dim, spec, (517, 300), SINK_HEADS, "float16", rng, batch=1)


def _check_with_masks(backend, head_dim, spec, seqlens, heads, dtype, rng, batch=2):
    """One backend's gradients (and dsinks) of a call with ``spec``'s options against the
    FP32 reference."""
    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _fixed_inputs(seqlens, heads, head_dim, dtype, rng, batch=batch)
    masks = _masks(spec, heads[0], head_dim, rng)
    grads = _gradients(dout, q, k, v, backend=backend, masks=masks)
    _assert_close(grads, dout, q, k, v, **masks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("spec", [
    pytest.param(dict(window=(300, 200)), id="window"),
    pytest.param(dict(causal=True, sinks=True), id="sinks"),
])
def test_deterministic_is_bitwise_reproducible(backend, head_dim, spec, rng):
    """Windows several key blocks wide and GQA 4:1, so that each dq row and each dk/dv row sums
    over many blocks; dsinks too (a sum over every row). The backward runs twice on one
    forward's out and lse."""
    import ptxattn

    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _fixed_inputs((1000, 1000), SINK_HEADS, head_dim, "bfloat16", rng)
    masks = _masks(spec, SINK_HEADS[0], head_dim, rng)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, **masks)
    first, again = (ptxattn.attention_backward(dout, q, k, v, out, lse, backend=backend,
                                               deterministic=True, **masks) for _ in range(2))
    assert _same_bytes(first, again), "deterministic gradients differ from run to run"
    _assert_close(first, dout, q, k, v, **masks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_window_backward_reads_no_key_block_outside_every_window(backend, head_dim, rng):
    """128 queries over 1024 keys, causal with window (100, 0): the rows see keys 796..1023
    only, so the whole key blocks below 768 are NaN here. No block may load them, yet their
    dk, dv must be written, as 0, into buffers that start out NaN; dq and the visible keys'
    dk, dv must be correct. The forward runs on the clean keys: only the backward is on
    trial."""
    import cupy
    import ptxattn

    backend = backward_backend(backend, head_dim)
    seqlen_q, seqlen_k, left = 128, 1024, 100
    masks = dict(causal=True, window=(left, 0))
    dout, q, k, v = _fixed_inputs((seqlen_q, seqlen_k), (8, 2), head_dim, "bfloat16", rng)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, **masks)
    first_seen = seqlen_k - seqlen_q - left
    hidden = first_seen // KEY_BLOCK * KEY_BLOCK
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, :hidden] = cupy.nan
    poisoned_v[:, :hidden] = cupy.nan
    dq, dk, dv = (_nan_like(x) for x in (q, k, v))
    ptxattn.attention_backward(dout, q, poisoned_k, poisoned_v, out, lse, backend=backend,
                               dq=dq, dk=dk, dv=dv, **masks)
    for name, grad in (("dk", dk), ("dv", dv)):
        assert not bool(grad[:, :hidden].astype(cupy.float32).any()), (
            f"{name} of keys no query sees is not 0")
    _assert_close((dq, dk, dv), dout, q, k, v, **masks)


# ---------------------------------------------------------------------------------------------
# Varlen

# A zero-length sequence, a one-token one, one of 1000+ tokens, more queries than keys, keys
# without queries, queries without keys, and fewer queries than keys.
SEQLENS_Q = (0, 1, 1100, 300, 0, 57, 129)
SEQLENS_K = (0, 1, 1030, 129, 200, 0, 700)


def _packed_inputs(seqlens_q, seqlens_k, heads, head_dim, dtype, rng):
    """dout, q, k, v packed (tokens, heads, head_dim) for sequences of these lengths."""
    heads_q, heads_kv = heads
    q = normal((sum(seqlens_q), heads_q, head_dim), dtype, rng)
    k = normal((sum(seqlens_k), heads_kv, head_dim), dtype, rng)
    v = normal((sum(seqlens_k), heads_kv, head_dim), dtype, rng)
    return normal(q.shape, dtype, rng), q, k, v


def _cu_seqlens(seqlens):
    import cupy
    return cupy.asarray(np.cumsum([0, *seqlens]).astype(np.int32))


def _varlen_forward(q, k, v, seqlens_q, seqlens_k, masks, max_seqlens=None):
    """attention_varlen's out and lse, and the varlen arguments both directions take:
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k (the longest sequences' lengths
    unless ``max_seqlens`` bounds them more loosely)."""
    import ptxattn

    layout = (_cu_seqlens(seqlens_q), _cu_seqlens(seqlens_k),
              *(max_seqlens or (max(seqlens_q), max(seqlens_k))))
    out, lse = ptxattn.attention_varlen(q, k, v, *layout, return_lse=True, **masks)
    return out, lse, layout


def _varlen_gradients(dout, q, k, v, seqlens_q, seqlens_k, *, backend, masks, max_seqlens=None):
    import ptxattn

    out, lse, layout = _varlen_forward(q, k, v, seqlens_q, seqlens_k, masks, max_seqlens)
    return ptxattn.attention_varlen_backward(dout, q, k, v, out, lse, *layout, backend=backend,
                                             **masks)


def _assert_varlen_close(grads, dout, q, k, v, seqlens_q, seqlens_k, **masks):
    """Sequence by sequence against the fixed-length reference on its rows (batch 1): a
    sequence without queries leaves its keys dk = dv = 0, one without keys its rows dq = 0;
    dsinks against the sum of the sequences' reference dsinks."""
    import cupy
    from ptxattn import reference

    with_sinks = masks.get("sinks") is not None
    assert len(grads) == (4 if with_sinks else 3), (
        "dsinks comes back exactly when sinks are given")
    dq, dk, dv = grads[:3]
    starts_q, starts_k = np.cumsum([0, *seqlens_q]), np.cumsum([0, *seqlens_k])
    dsinks_ref = cupy.zeros(q.shape[1], dtype=cupy.float32)
    dsinks_naive = cupy.zeros(q.shape[1], dtype=cupy.float32)
    for b, (seqlen_q, seqlen_k) in enumerate(zip(seqlens_q, seqlens_k)):
        rows_q = slice(starts_q[b], starts_q[b + 1])
        rows_k = slice(starts_k[b], starts_k[b + 1])
        if seqlen_q == 0:
            for name, grad in (("dk", dk), ("dv", dv)):
                assert not bool(grad[rows_k].astype(cupy.float32).any()), (
                    f"{name} of sequence {b}, which has no queries, is not 0")
            continue
        _assert_no_gradient_without_keys(f"dq of sequence {b}", dq[None, rows_q], seqlen_k,
                                         masks)
        if seqlen_k == 0:
            continue
        args = (dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k])
        ref = reference.attention_backward(*args, **masks)
        naive = reference.attention_backward(*args, precision="input", **masks)
        for name, got, r, n in zip(GRADIENTS, (dq[None, rows_q], dk[None, rows_k],
                                               dv[None, rows_k]), ref, naive):
            _assert_within(f"{name} of sequence {b}", got, r, n, q.dtype)
        if with_sinks:
            dsinks_ref += ref[3]
            dsinks_naive += naive[3]
    if with_sinks:
        _assert_within("dsinks", grads[3], dsinks_ref, dsinks_naive, cupy.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("spec", [
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window=(100, -1)), id="causal-window"),
    pytest.param(dict(window=(50, 7), sinks=True), id="window-sinks"),
    pytest.param(dict(causal=True, softcap=20.0, sinks=True), id="causal-softcap-sinks"),
    pytest.param(dict(window=(300, 0), softcap=10.0), id="window-softcap"),
])
def test_varlen_matches_each_sequence(backend, head_dim, spec, rng):
    """Per-sequence lengths of their own (cu_seqlens_q unlike cu_seqlens_k), GQA 4:1."""
    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _packed_inputs(SEQLENS_Q, SEQLENS_K, SINK_HEADS, head_dim, "bfloat16", rng)
    masks = _masks(spec, SINK_HEADS[0], head_dim, rng)
    grads = _varlen_gradients(dout, q, k, v, SEQLENS_Q, SEQLENS_K, backend=backend, masks=masks)
    _assert_varlen_close(grads, dout, q, k, v, SEQLENS_Q, SEQLENS_K, **masks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_max_seqlens_above_the_longest(backend, dtype, causal, rng):
    """max_seqlen_q and max_seqlen_k are bounds, not the maxima: with bounds well past the
    longest sequences (more tiles than any sequence fills) the gradients are still each
    sequence's own; float16 here too."""
    backend = backward_backend(backend, 128)
    dout, q, k, v = _packed_inputs(SEQLENS_Q, SEQLENS_K, SINK_HEADS, 128, dtype, rng)
    masks = _masks(dict(causal=causal, window=(100, -1), sinks=True), SINK_HEADS[0], 128, rng)
    loose = (max(SEQLENS_Q) + 333, max(SEQLENS_K) + 1000)
    grads = _varlen_gradients(dout, q, k, v, SEQLENS_Q, SEQLENS_K, backend=backend, masks=masks,
                              max_seqlens=loose)
    _assert_varlen_close(grads, dout, q, k, v, SEQLENS_Q, SEQLENS_K, **masks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_deterministic_is_bitwise_reproducible(backend, head_dim, rng):
    """The varlen layout with a window several key blocks wide and sinks: dq, dk, dv and
    dsinks (a sum over every sequence's rows) bit for bit from run to run."""
    import ptxattn

    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _packed_inputs(SEQLENS_Q, SEQLENS_K, SINK_HEADS, head_dim, "bfloat16", rng)
    masks = _masks(dict(causal=True, window=(300, -1), sinks=True), SINK_HEADS[0], head_dim,
                   rng)
    out, lse, layout = _varlen_forward(q, k, v, SEQLENS_Q, SEQLENS_K, masks)
    first, again = (ptxattn.attention_varlen_backward(dout, q, k, v, out, lse, *layout,
                                                      backend=backend, deterministic=True,
                                                      **masks) for _ in range(2))
    assert _same_bytes(first, again), "deterministic gradients differ from run to run"
    _assert_varlen_close(first, dout, q, k, v, SEQLENS_Q, SEQLENS_K, **masks)


# Sequence 1 has no queries and 3 whole key blocks, starting on a block (sequence 0's keys fill
# 2 blocks): no other sequence's block reaches its keys, so they are NaN in the poison test.
POISON_SEQLENS_Q = (300, 0, 1100, 1)
POISON_SEQLENS_K = (2 * KEY_BLOCK, 3 * KEY_BLOCK, 1030, 1)
POISONED_SEQUENCE = 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("spec", [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(window=(100, 20), sinks=True), id="window-sinks"),
])
def test_varlen_backward_reads_no_keys_of_a_sequence_without_queries(backend, head_dim, spec,
                                                                     rng):
    """The keys of a sequence with no queries are NaN: no block may load them, every gradient
    stays finite and correct, and that sequence's dk, dv are written 0 (in buffers that start
    out NaN). The forward runs on the clean keys: only the backward is on trial."""
    import cupy
    import ptxattn

    backend = backward_backend(backend, head_dim)
    dout, q, k, v = _packed_inputs(POISON_SEQLENS_Q, POISON_SEQLENS_K, SINK_HEADS, head_dim,
                                   "bfloat16", rng)
    masks = _masks(spec, SINK_HEADS[0], head_dim, rng)
    out, lse, layout = _varlen_forward(q, k, v, POISON_SEQLENS_Q, POISON_SEQLENS_K, masks)
    start = sum(POISON_SEQLENS_K[:POISONED_SEQUENCE])
    poisoned = slice(start, start + POISON_SEQLENS_K[POISONED_SEQUENCE])
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[poisoned] = cupy.nan
    poisoned_v[poisoned] = cupy.nan
    buffers = dict(dq=_nan_like(q), dk=_nan_like(k), dv=_nan_like(v))
    grads = ptxattn.attention_varlen_backward(dout, q, poisoned_k, poisoned_v, out, lse, *layout,
                                              backend=backend, **masks, **buffers)
    assert all(got is buffer for got, buffer in zip(grads, buffers.values()))
    _assert_varlen_close(grads, dout, q, k, v, POISON_SEQLENS_Q, POISON_SEQLENS_K, **masks)


# ---------------------------------------------------------------------------------------------
# The reference itself


def _attention64(q, k, v, sinks, *, scale, causal, window, softcap):
    """float64 NumPy attention (batch, seqlen, heads, head_dim) with a window, a softcap and
    sinks, written from the definitions apart from reference.py: the function the finite
    differences take."""
    group = q.shape[2] // k.shape[2]
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, group, axis=2)) * scale
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    key = np.arange(seqlen_k)[None, :]
    diagonal = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    hidden = np.zeros((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        hidden |= key > diagonal + right
    if left >= 0:
        hidden |= key < diagonal - left
    scores = np.where(hidden, -np.inf, scores)
    sink_column = np.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
    logits = np.concatenate([scores, sink_column], axis=-1)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs[..., :-1], np.repeat(v, group, axis=2))


@pytest.mark.gpu
@pytest.mark.parametrize("masks,seqlens", [
    pytest.param(dict(causal=False, window=(2, 1), softcap=1.0), (5, 7), id="window-softcap"),
    # rows 0..3 see no key, only their sink
    pytest.param(dict(causal=True, window=(1, -1), softcap=0.0), (7, 3),
                 id="causal-window-rows-without-keys"),
])
def test_reference_gradients_match_finite_differences(masks, seqlens, rng):
    """The float32 reference's dq, dk, dv and dsinks with a window, a softcap, sinks and GQA
    against central differences of a float64 attention: the yardstick the kernels are held to
    is itself right."""
    import cupy
    from ptxattn import reference

    seqlen_q, seqlen_k = seqlens
    q = normal((1, seqlen_q, 2, 64), "float16", rng)
    k = normal((1, seqlen_k, 1, 64), "float16", rng)
    v = normal((1, seqlen_k, 1, 64), "float16", rng)
    dout = normal(q.shape, "float16", rng)
    sinks = cupy.asarray(rng.standard_normal(2, dtype=np.float32))
    scale = 0.125
    d64 = dout.get().astype(np.float64)

    def loss(q64, k64, v64, sinks64):
        return float((_attention64(q64, k64, v64, sinks64, scale=scale, **masks) * d64).sum())

    args = [x.get().astype(np.float64) for x in (q, k, v, sinks)]
    grads = reference.attention_backward(dout, q, k, v, softmax_scale=scale, sinks=sinks,
                                         **masks)
    assert len(grads) == len(args)
    assert_matches_finite_differences(loss, args, grads, GRADIENTS)


# ---------------------------------------------------------------------------------------------
# Bad options, refused before anything is launched

HEADS_Q, HEADS_KV = 4, 2
# sinks as (dtype, shape): built as stand-ins on the CPU, as CuPy arrays on the GPU
BAD_OPTIONS = [
    pytest.param(dict(window=(-2, 0)), ValueError, "window", id="window-below-unbounded"),
    pytest.param(dict(window=(0, -5)), ValueError, "window", id="window-right-below-unbounded"),
    pytest.param(dict(window=(4,)), ValueError, "window", id="window-not-a-pair"),
    pytest.param(dict(window=(0.5, 0)), ValueError, "window", id="window-not-ints"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
    pytest.param(dict(softcap=float("nan")), ValueError, "softcap", id="softcap-nan"),
    pytest.param(dict(sinks=("float16", (HEADS_Q,))), TypeError, "sinks", id="sinks-float16"),
    pytest.param(dict(sinks=("bfloat16", (HEADS_Q,))), TypeError, "sinks", id="sinks-bfloat16"),
    pytest.param(dict(sinks=("float32", (HEADS_KV,))), ValueError, "sinks",
                 id="sinks-per-kv-head"),
    pytest.param(dict(sinks=("float32", (1, HEADS_Q))), ValueError, "sinks", id="sinks-2d"),
]


def _with_sinks(options, make):
    """options with a sinks spec (dtype, shape) turned into an array by make(shape, dtype)."""
    if "sinks" not in options:
        return options
    dtype, shape = options["sinks"]
    return {**options, "sinks": make(shape, dtype)}


@pytest.mark.parametrize("options,error,name", BAD_OPTIONS)
def test_bad_options_are_refused_before_anything_needs_a_gpu(options, error, name):
    """attention_backward on array stand-ins (tests/meta_array.py): the option is checked with
    the arrays' metadata, before the GPU is even asked its arch. The message names the option
    (an unknown keyword's TypeError does not pass for it)."""
    import ptxattn

    shape_q, shape_kv = (2, 16, HEADS_Q, 64), (2, 16, HEADS_KV, 64)
    arrays = dict(dout=MetaArray(shape_q, ptr=1 << 20), q=MetaArray(shape_q, ptr=2 << 20),
                  k=MetaArray(shape_kv, ptr=3 << 20), v=MetaArray(shape_kv, ptr=4 << 20),
                  out=MetaArray(shape_q, ptr=5 << 20),
                  lse=MetaArray((2, HEADS_Q, 16), "float32", ptr=6 << 20))
    options = _with_sinks(options, lambda shape, dtype: MetaArray(shape, dtype, ptr=7 << 20))
    with pytest.raises(error, match=rf"\b{name} must\b"):
        ptxattn.attention_backward(**arrays, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("options,error,name", BAD_OPTIONS)
def test_varlen_backward_refuses_bad_options_before_launch(options, error, name, rng):
    """attention_varlen_backward on real arrays: the refusal names the option and leaves the
    gradient buffers as they were (NaN)."""
    import cupy
    import ptxattn

    seqlens_q, seqlens_k = (3, 5), (4, 6)
    dout, q, k, v = _packed_inputs(seqlens_q, seqlens_k, (HEADS_Q, HEADS_KV), 64, "bfloat16",
                                   rng)
    out, lse, layout = _varlen_forward(q, k, v, seqlens_q, seqlens_k, {})
    buffers = dict(dq=_nan_like(q), dk=_nan_like(k), dv=_nan_like(v))
    options = _with_sinks(options, lambda shape, dtype: cupy.zeros(shape, dtype=dtype))
    with pytest.raises(error, match=rf"\b{name} must\b"):
        ptxattn.attention_varlen_backward(dout, q, k, v, out, lse, *layout, **options,
                                          **buffers)
    for buffer_name, buffer in buffers.items():
        assert bool(cupy.isnan(buffer.astype(cupy.float32)).all()), (
            f"{buffer_name} was written by a refused call")
