"""Input generators shared by the GPU tests."""


def growing_keys(k, ramp_height: float = 12.0):
    """k with its rows scaled up towards key 0, so that the kernel, which visits key blocks from
    the last to the first, sees row maxima grow by more than 2^8 within a tile (the softmax's
    slow path) besides the usual case of maxima that settle early."""
    import cupy
    seqlen = k.shape[1]
    ramp = 1 + ramp_height * (1 - cupy.arange(seqlen, dtype=cupy.float32) / seqlen)
    return (k.astype(cupy.float32) * ramp[None, :, None, None]).astype(k.dtype)


def grouped_qkv(seqlen_q: int, seqlen_k: int, head_dim: int, keys: str, rng):
    """bf16 q (2, seqlen_q, 4, head_dim), k and v (2, seqlen_k, 2, head_dim) of standard normal
    values; keys "growing" passes k through growing_keys()."""
    import cupy
    import numpy as np

    def normal(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")

    q = normal((2, seqlen_q, 4, head_dim))
    k = normal((2, seqlen_k, 2, head_dim))
    v = normal((2, seqlen_k, 2, head_dim))
    return q, growing_keys(k) if keys == "growing" else k, v


def assert_within_naive_error(out, lse, ref, ref_lse, naive, naive_lse, dtype):
    """A kernel's output and LSE against the FP32 reference (ref, ref_lse): the max error at most
    twice that of the same math done naively in the input precision (naive, naive_lse), plus
    the rounding noise of one value in ``dtype``; the LSE's -inf pattern (rows that see no key)
    exactly the reference's."""
    import cupy

    assert bool(cupy.isfinite(out).all()), "output has NaN/Inf (or was not written)"
    noise = float(cupy.abs((ref + 0.3 - 0.3).astype(dtype).astype(cupy.float32) - ref).max())
    err = float(cupy.abs(out.astype(cupy.float32) - ref).max())
    naive_err = float(cupy.abs(naive - ref).max())
    assert err <= 2 * naive_err + 2 * noise + 1e-6, (err, naive_err, noise)

    visible = cupy.isfinite(ref_lse)
    assert bool((cupy.isfinite(lse) == visible).all()), "LSE -inf pattern differs"
    lse_err = float(cupy.abs(cupy.where(visible, lse - ref_lse, 0)).max())
    naive_lse_err = float(cupy.abs(cupy.where(visible, naive_lse - ref_lse, 0)).max())
    assert lse_err <= 2 * naive_lse_err + 1e-4, (lse_err, naive_lse_err)


def backward_backend(backend: str, head_dim: int) -> str:
    """``backend`` if its backward runs on this GPU at ``head_dim``; skips the test otherwise."""
    import pytest
    from ptxattn import dispatch
    from ptxattn.runtime import device_arch

    routes = [route for route in dispatch.TABLE if route.backend == backend
              and route.call == "backward"]
    if device_arch() not in routes[0].archs:
        pytest.skip(f"backend {backend} does not run on {device_arch()}")
    if not any(route.takes("bfloat16", head_dim, head_dim) for route in routes):
        pytest.skip(f"backend {backend} has no backward at head_dim {head_dim}")
    return backend


def normal(shape, dtype, rng, scale=1.0):
    """A CuPy array of standard normal values times ``scale``, in ``dtype``."""
    import cupy
    import numpy as np
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def assert_matches_finite_differences(loss, args, grads, names, eps=1e-6):
    """Each of ``grads`` (CuPy arrays) against central differences of ``loss`` (a float of the
    float64 NumPy ``args``) at every element of its argument."""
    import cupy
    import numpy as np
    for index, (arg, grad) in enumerate(zip(args, grads)):
        numeric = np.zeros_like(arg)
        for pos in np.ndindex(arg.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[index][pos] += eps
            minus[index][pos] -= eps
            numeric[pos] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(cupy.asnumpy(grad), numeric, rtol=1e-4, atol=1e-4,
                                   err_msg=names[index])


# The FP8 cache tests (test_kvcache_fp8.py, test_mla_decode.py): the float32 value of every e4m3
# byte, and descales of at most 3 significant bits, so that e4m3 (4 significant bits) times one
# is exact in bf16 (8) and fp16 (11, and subnormal steps of 2^-24 below the least product,
# 2^-18); about amax / 448 of standard normal data, so that some values saturate at 448.
def e4m3_values():
    import ml_dtypes
    import numpy as np
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def cache_descales():
    import numpy as np
    return np.float32([2.0 ** -6, 3 * 2.0 ** -8, 2.0 ** -5, 5 * 2.0 ** -9])


def standard_normal(shape, rng, dtype="bfloat16", scale=1.0):
    """A CuPy array of standard normal values times ``scale`` in ``dtype``."""
    import cupy
    import numpy as np
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def outlying(shape, rng, dtype):
    """Twice standard normal values but for the first column, of magnitude 1.5 x 448 times the
    largest of cache_descales(), so that quantizing saturates there."""
    import cupy
    import numpy as np
    x = rng.standard_normal(shape, dtype=np.float32) * 2
    x[..., 0] = np.where(x[..., 0] < 0, -1.5, 1.5) * 448 * cache_descales().max()
    return cupy.asarray(x).astype(dtype)


def assert_descales_exact_in_16_bits():
    """The FP8 cache tests' premise: every e4m3 value times every descale is a bf16 and an fp16
    value."""
    import ml_dtypes
    import numpy as np
    values = e4m3_values()
    finite = values[np.isfinite(values)]
    products = (finite[:, None] * cache_descales()[None, :]).ravel()
    for dtype in (ml_dtypes.bfloat16, np.float16):
        np.testing.assert_array_equal(products.astype(dtype).astype(np.float32), products)


def reference_of_sequence(q, k, v, precision, **masks):
    """ptxattn.reference.attention of one sequence (batch 1) with its LSE, in ``precision``,
    also when it has no keys (zeros out, LSE -inf, or the sinks' logits)."""
    import cupy
    from ptxattn import reference

    if k.shape[1] == 0:
        batch, seqlen_q, heads, _ = q.shape
        lse = cupy.full((batch, heads, seqlen_q), -cupy.inf, dtype=cupy.float32)
        if masks.get("sinks") is not None:
            lse[:] = masks["sinks"][None, :, None]
        return cupy.zeros((batch, seqlen_q, heads, v.shape[3]), dtype=cupy.float32), lse
    return reference.attention(q, k, v, return_lse=True, precision=precision, **masks)


def assert_sequence_within_naive_error(out, lse, q, k, v, **masks):
    """One sequence's out and lse (batch 1) against the FP32 reference over k and v, by
    assert_within_naive_error, and its rows that see no key exactly 0."""
    import cupy

    ref, ref_lse = reference_of_sequence(q, k, v, "float32", **masks)
    naive, naive_lse = reference_of_sequence(q, k, v, "input", **masks)
    assert_within_naive_error(out, lse, ref, ref_lse, naive, naive_lse, q.dtype)
    unseeing = ~cupy.isfinite(ref_lse[0]).T  # (seqlen_q, heads_q): rows that see no key
    assert bool((out[0][unseeing] == 0).all()), "a row that sees no key is not 0"


def fp8_backward_accuracy_script():
    """scripts/fp8_backward_accuracy.py as a module: the FP8 backward's emulation."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "fp8_backward_accuracy.py"
    spec = importlib.util.spec_from_file_location("fp8_backward_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
