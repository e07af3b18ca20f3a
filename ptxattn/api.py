"""The public entry point for 16-bit inputs: check the call (problem.py), pick a kernel family
(dispatch.py), launch it."""

from __future__ import annotations

from .dispatch import BACKENDS, backend_module  # noqa: F401  the 16-bit backends, by name
from .problem import AttentionProblem, require_cupy


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, out=None, backend: str | None = None):
    """Scaled dot-product attention forward, ``softmax(scale * q k^T) v``.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), CuPy
    arrays of float16 or bfloat16 with unit stride in head_dim (other strides are free). heads_q
    must be a multiple of heads_kv (GQA/MQA). ``causal`` masks key j from query i unless
    j <= i + seqlen_k - seqlen_q (bottom-right aligned); rows that see no key give 0.
    ``softmax_scale`` defaults to 1/sqrt(head_dim). Returns the output in q's dtype (written into
    ``out`` if given, which must not overlap q, k or v) and, with ``return_lse``, the float32
    log-sum-exp of shape (batch, heads_q, seqlen_q) in natural log. ``backend`` picks a kernel
    family ('hopper', 'portable'); by default the fastest one for the current GPU.
    """
    import cupy

    from . import dispatch, runtime

    require_cupy(q=q, k=k, v=v, out=out)
    problem = AttentionProblem.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          out=out)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, features=problem.features, backend=backend)
    with cupy.cuda.Device(problem.device):
        if out is None:
            out = cupy.empty(problem.out_shape, dtype=problem.out_dtype)
        lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
        route.module().forward(q, k, v, out, lse, causal=problem.causal,
                               softmax_scale=problem.softmax_scale)
    return (out, lse) if return_lse else out
