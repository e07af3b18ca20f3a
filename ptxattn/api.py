"""The entry points for 16-bit inputs: check the call once (ptxattn.problem), pick a route
(ptxattn.dispatch), launch it (ptxattn.launchers)."""

from __future__ import annotations

from .interop import framework_arrays
from .problem import AttentionProblem

__all__ = ["attention", "attention_backward"]


@framework_arrays
def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, out=None, lse=None, backend: str | None = None,
              window=(-1, -1), softcap: float = 0.0, sinks=None):
    """Scaled dot-product attention forward, ``softmax(scale * q k^T) v``.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), of
    float16 or bfloat16 with unit stride in head_dim (other strides are free). CUDA arrays of any
    framework (CuPy, torch, JAX, any with ``__dlpack__`` or ``__cuda_array_interface__``): the
    results come back as q's kind, and the work goes on the caller's current stream
    (ptxattn.interop). heads_q must be a multiple of heads_kv (GQA/MQA). ``causal`` masks key j
    from query i unless j <= i + seqlen_k - seqlen_q (bottom-right aligned); rows that see no key
    give 0. ``softmax_scale`` defaults to 1/sqrt(head_dim). Returns the output in q's dtype
    (written into ``out`` if given, which must not overlap q, k or v) and, with ``return_lse``,
    the float32 log-sum-exp of shape (batch, heads_q, seqlen_q) in natural log (written into
    ``lse`` if given: float32, C-contiguous). ``backend`` picks a kernel family ('hopper',
    'portable'); by default the fastest one for the current GPU. ``window``, ``softcap`` and
    ``sinks`` as in :func:`ptxattn.attention_with_kvcache`, whose kernel (the portable decode
    kernel, slower than the fixed-length ones for long queries) runs such calls.
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          out=out, lse=lse, window=window, softcap=softcap,
                                          sinks=sinks)
    arch = runtime.device_arch(problem.device)
    dispatch.select(arch, problem.format, problem.head_dim, features=problem.features,
                    backend=backend)  # refuses the call before anything is allocated
    with cupy.cuda.Device(problem.device):
        if out is None:
            out = cupy.empty(problem.out_shape, dtype=problem.out_dtype)
        if lse is None:
            lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
        dispatch.forward(arch, problem, q, k, v, out, lse, backend=backend, sinks=sinks)
    return (out, lse) if return_lse else out


@framework_arrays
def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False,
                       softmax_scale: float | None = None, deterministic: bool = False,
                       dq=None, dk=None, dv=None, backend: str | None = None):
    """The gradients of :func:`attention` with respect to q, k and v: returns (dq, dk, dv).

    dout is the gradient of the loss with respect to ``out``; ``out`` and ``lse`` are what
    ``attention(q, k, v, causal=..., softmax_scale=..., return_lse=True)`` returned for these
    inputs (lse: float32 (batch, heads_q, seqlen_q), unit stride along seqlen_q). Layouts, dtypes,
    kinds of array, causal and softmax_scale as in the forward; dout may have other strides than
    out. With GQA dk and dv are summed over the q heads that share a k/v head. Gradients come
    back in the input dtype (written into ``dq``, ``dk``, ``dv`` if given), computed with FP32
    accumulation. ``deterministic=True`` makes them bit-identical from run to run: dQ's sum over
    key blocks then runs in a fixed order. ``backend`` as in the forward: on Hopper 'hopper'
    (the default there) or 'portable'.
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_backward(dout, q, k, v, out, lse, causal=causal,
                                             softmax_scale=softmax_scale,
                                             deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, features=problem.features | {"backward"},
                            backend=backend)
    with cupy.cuda.Device(problem.device):
        dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
        route.launcher.backward(problem, dout, q, k, v, out, lse, dq, dk, dv,
                                deterministic=deterministic)
    return dq, dk, dv
