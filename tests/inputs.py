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
