"""Input generators shared by the GPU tests."""


def growing_keys(k, ramp_height: float = 12.0):
    """k with its rows scaled up towards key 0, so that the kernel, which visits key blocks from
    the last to the first, sees row maxima grow by more than 2^8 within a tile (the softmax's
    slow path) besides the usual case of maxima that settle early."""
    import cupy
    seqlen = k.shape[1]
    ramp = 1 + ramp_height * (1 - cupy.arange(seqlen, dtype=cupy.float32) / seqlen)
    return (k.astype(cupy.float32) * ramp[None, :, None, None]).astype(k.dtype)
