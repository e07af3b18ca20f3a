"""The entry points for 16-bit inputs of fixed length: ``attention`` and ``attention_backward``,
exported as ``ptxattn.attention`` and ``ptxattn.attention_backward``.

Each checks its call once (ptxattn/problem/), picks a route (ptxattn/dispatch.py) and launches it
(ptxattn/launchers/). The serving entry points are in ptxattn/serving.py, FP8 in ptxattn/fp8.py,
block-scaled formats in ptxattn/blockscaled.py.
"""

from __future__ import annotations

from .interop import framework_arrays
from .problem import AttentionProblem

__all__ = ["attention", "attention_backward"]


def __dir__():
    return sorted(__all__)


@framework_arrays
def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, out=None, lse=None, backend: str | None = None,
              window=(-1, -1), softcap: float = 0.0, sinks=None):
    """Scaled dot-product attention forward, ``softmax(softmax_scale * q k^T) v``.

    Takes CUDA arrays of any framework, zero-copy: CuPy, torch, JAX, or anything with
    ``__dlpack__`` or ``__cuda_array_interface__``; the results come back as q's kind of array.
    The kernels are queued on the caller's current stream with no synchronization added
    (torch's current stream for torch tensors, CuPy's current stream otherwise;
    ptxattn.interop). Torch tensors that require grad are refused: ``ptxattn.torch.attention``
    is the differentiable form.

    Every array (q, k, v, out) is non-empty and 4-d with unit stride in head_dim, a 16-byte
    aligned base address, and batch/seqlen/heads strides that are positive multiples of
    16 bytes (a zero or negative stride along a dimension longer than 1, a broadcast or reversed
    view, is refused); the strides are otherwise free. All are on one device.

    Calls with a ``window``, a ``softcap`` or ``sinks`` run on a serving build over all of k and
    v (``ptxattn.dispatch.forward``), as the fixed-length kernels take none of the three: on
    Hopper the serving build of the Hopper forward for a window or sinks with at least 64 query
    rows, the portable decode kernel otherwise (a softcap, fewer query rows, another GPU, or
    ``backend="portable"``).

    Parameters
    ----------
    q : CUDA array
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16; head_dim a
        multiple of 8 from 8 to 256 (it runs on the least compiled head_dim that holds it,
        nothing padded in memory; docs/design/head-dims.md lists them).
    k : CUDA array
        Keys, (batch, seqlen_k, heads_kv, head_dim), q's dtype, batch and head_dim as q's.
        heads_q must be a multiple of heads_kv (GQA/MQA: each k/v head serves
        heads_q / heads_kv consecutive q heads).
    v : CUDA array
        Values, (batch, seqlen_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a
        multiple of 8 at most head_dim (narrower value heads, as in multi-head latent
        attention); the output has head_dim_v.
    causal : bool, default False
        Masks key j from query i unless j <= i + seqlen_k - seqlen_q (bottom-right aligned,
        as FlashAttention 2.1+). A row that sees no key gives output 0 and LSE -inf.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    return_lse : bool, default False
        Also return the log-sum-exp.
    out : CUDA array, optional
        The buffer to write the output into: (batch, seqlen_q, heads_q, head_dim_v), q's
        dtype, laid out as above, on q's device, its memory apart from q's, k's and v's.
    lse : CUDA array, optional
        The buffer to write the log-sum-exp into: float32, C-contiguous, (batch, heads_q,
        seqlen_q), on q's device.
    backend : {'hopper', 'portable'}, optional
        The kernel family: 'hopper' (sm_90a: wgmma and TMA) or 'portable' (mma.sync, sm_80
        and newer). By default the first that runs the call on the current GPU, which is
        'hopper' on sm_90a.
    window : tuple of (int, int), default (-1, -1)
        (left, right): query i sees keys i + seqlen_k - seqlen_q - left up to
        i + seqlen_k - seqlen_q + right, -1 meaning unbounded (right is 0 when causal).
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap); 0 turns it off.
    sinks : CUDA array, optional
        float32 (heads_q,), contiguous, on q's device: one logit per q head that joins every
        row's softmax denominator (and its log-sum-exp) and adds nothing to the output.

    Returns
    -------
    out : array
        The output, (batch, seqlen_q, heads_q, head_dim_v) in q's dtype: ``out`` itself if
        given.
    lse : array
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), the natural log of each
        row's sum of exp(scaled score), sinks included; -inf for a row that sees no key.
        ``lse`` itself if given.

    Raises
    ------
    TypeError
        An array argument in host memory (NumPy, a CPU tensor) or no array at all; q, k, v
        not float16 or bfloat16, or not of one dtype; ``out`` not of q's dtype; ``lse`` or
        ``sinks`` not float32; ``causal`` not a bool; a torch tensor that requires grad.
    ValueError
        A shape (not 4-d, empty, k and v unlike but for head_dim_v, batch or k's head_dim
        unlike q's, heads_q not a multiple of heads_kv, ``out``, ``lse`` or ``sinks`` of the
        wrong shape); head_dim or head_dim_v outside the rule above; a stride or alignment
        above; arrays on different devices; ``out`` or
        ``lse`` overlapping an input; a bad ``softmax_scale``, ``window`` or ``softcap``; an
        unknown ``backend``; or a GPU, head_dim or
        option that no kernel (of the chosen backend) runs (the message names what runs where).

    Examples
    --------
    >>> import cupy, ptxattn
    >>> q = cupy.random.standard_normal((4, 2048, 32, 128)).astype("bfloat16")
    >>> k = cupy.random.standard_normal((4, 2048, 8, 128)).astype("bfloat16")  # 8 kv heads
    >>> v = cupy.random.standard_normal((4, 2048, 8, 128)).astype("bfloat16")
    >>> out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, out.dtype, lse.shape
    ((4, 2048, 32, 128), dtype(bfloat16), (4, 32, 2048))

    A sliding window (each query sees its own key and the 256 before it), on a serving build:

    >>> out = ptxattn.attention(q, k, v, causal=True, window=(256, 0))
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          out=out, lse=lse, window=window, softcap=softcap,
                                          sinks=sinks)
    arch = runtime.device_arch(problem.device)
    # refuses the call before anything is allocated
    route = dispatch.select(arch, problem.format, problem.head_dim,
                            head_dim_v=problem.head_dim_v, features=problem.features,
                            backend=backend)
    with cupy.cuda.Device(problem.device):
        if out is None:
            out = cupy.empty(problem.out_shape, dtype=problem.out_dtype)
        if lse is None:
            lse = cupy.empty(problem.lse_shape, dtype=cupy.float32)
        dispatch.forward(route, problem, q, k, v, out, lse, sinks=sinks)
    return (out, lse) if return_lse else out


@framework_arrays
def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False,
                       softmax_scale: float | None = None, window=(-1, -1),
                       softcap: float = 0.0, sinks=None, deterministic: bool = False,
                       dq=None, dk=None, dv=None, dsinks=None, backend: str | None = None):
    """The gradients of ``ptxattn.attention`` with respect to q, k and v (and the sinks).

    ``out`` and ``lse`` are what ``attention(q, k, v, causal=..., softmax_scale=...,
    window=..., softcap=..., sinks=..., return_lse=True)`` returned for these inputs, with the
    same options. Arrays, kinds of array, layouts and streams as in the forward (every 16-bit
    array non-empty, 4-d, unit stride in head_dim, 16-byte aligned base and batch/seqlen/heads
    strides). The gradients are computed with FP32 accumulation and come back in the input
    dtype. With GQA, dk and dv are summed over the q heads that share a k/v head. The window,
    causal mask and softcap are the forward's (the same mask code), and key blocks no query
    sees are skipped, so a window's backward takes time in proportion to the pairs it sees.

    Parameters
    ----------
    dout : CUDA array
        The gradient of the loss with respect to ``out``: out's shape, (batch, seqlen_q,
        heads_q, head_dim_v), q's dtype, its own strides (by the layout rules).
    q, k, v : CUDA array
        The forward's inputs.
    out : CUDA array
        The forward's output: (batch, seqlen_q, heads_q, head_dim_v), q's dtype.
    lse : CUDA array
        The forward's log-sum-exp: float32 (batch, heads_q, seqlen_q), positive strides, unit
        stride along seqlen_q.
    causal : bool, default False
        As in the forward (bottom-right aligned).
    softmax_scale : float, optional
        As in the forward; 1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        As in the forward.
    softcap : float, default 0.0
        As in the forward.
    sinks : CUDA array, optional
        As in the forward: float32 (heads_q,). Its gradient is returned too.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run: dQ's sum over key blocks then runs
        in a fixed order.
    dq, dk, dv : CUDA array, optional
        Buffers to write the gradients into: the shapes and dtype of q, k and v, laid out by
        the same rules, on q's device, overlapping no input. They may interleave (slices of one
        packed buffer) but not share a byte.
    dsinks : CUDA array, optional
        With ``sinks``: the buffer for their gradient, float32 (heads_q,), contiguous.
    backend : {'hopper', 'portable'}, optional
        As in the forward: on Hopper 'hopper' (the default there) or 'portable'.

    Returns
    -------
    dq, dk, dv : tuple of array
        The gradients, like q, k and v (``dq``, ``dk``, ``dv`` themselves if given).
    dsinks : array
        Only with ``sinks``: float32 (heads_q,), the gradient summed over the batch and the
        rows (``dsinks`` itself if given), the fourth element of the tuple.

    Raises
    ------
    TypeError
        As in the forward, and: ``dout``, ``out``, ``dq``, ``dk`` or ``dv`` not of q's dtype;
        ``lse`` or ``dsinks`` not float32; ``deterministic`` not a bool.
    ValueError
        As in the forward, and: ``dout`` or ``out`` not of the output's shape (q's with v's
        head_dim_v); ``lse`` not (batch, heads_q, seqlen_q) or without unit stride along
        seqlen_q; a gradient buffer of the wrong shape, overlapping an input, or sharing memory
        with another gradient buffer; ``dsinks`` without ``sinks``.

    Examples
    --------
    >>> import cupy, ptxattn
    >>> q, k, v = (cupy.random.standard_normal((2, 1024, 16, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> out, lse = ptxattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = cupy.ones_like(out)
    >>> dq, dk, dv = ptxattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape == q.shape and dk.dtype == k.dtype
    True

    A sliding window with sinks, as gpt-oss trains:

    >>> sinks = cupy.zeros(16, dtype=cupy.float32)
    >>> out, lse = ptxattn.attention(q, k, v, causal=True, window=(127, 0), sinks=sinks,
    ...                              return_lse=True)
    >>> dq, dk, dv, dsinks = ptxattn.attention_backward(
    ...     dout, q, k, v, out, lse, causal=True, window=(127, 0), sinks=sinks)
    """
    import cupy

    from . import dispatch, runtime

    problem = AttentionProblem.from_backward(dout, q, k, v, out, lse, causal=causal,
                                             softmax_scale=softmax_scale, window=window,
                                             softcap=softcap, sinks=sinks,
                                             deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                                             dsinks=dsinks)
    route = dispatch.select(runtime.device_arch(problem.device), problem.format,
                            problem.head_dim, head_dim_v=problem.head_dim_v,
                            features=problem.backward_features,
                            backend=backend)
    with cupy.cuda.Device(problem.device):
        dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
        workspace = route.launcher.backward(problem, dout, q, k, v, out, lse, dq, dk, dv,
                                            deterministic=deterministic, sinks=sinks)
        if sinks is None:
            return dq, dk, dv
        return dq, dk, dv, workspace.dsinks(problem, out=dsinks)
