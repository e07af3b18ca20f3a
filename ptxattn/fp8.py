"""FP8 (e4m3) attention on Hopper: the data carrier, quantizers, descales and a reference.

``ptxattn.fp8.attention`` is also exported as ``ptxattn.fp8_attention``. docs/guide/fp8.md is
the guide; docs/design/fp8.md says what bounds the kernel's speed.

Carrier. CuPy 14 does not support FP8 dtypes: ``cupy.empty(..., dtype=float8_e4m3fn)`` and
``cupy.asarray`` of an ml_dtypes float8 array raise "Unsupported dtype" (only ``.view`` slips
through). So FP8 data is uint8 storage with an explicit format: ``E4M3Array`` wraps a CuPy
uint8 array of e4m3 bytes (shape, strides, slicing, ``.get()`` to an ml_dtypes
``float8_e4m3fn`` NumPy array). The FP8 entry points take E4M3Array (or a CuPy view, or a torch
tensor, whose dtype is ``float8_e4m3fn``, which names the format too) and refuse anything else by
type: a bf16/fp16 array, and raw uint8, which could hold e4m3, e5m2 or integers (wrap it:
``E4M3Array(x)``). Torch callers get their FP8 results as float8_e4m3fn tensors
(ptxattn/interop.py).

Scales. An FP8 tensor comes with a float32 *descale* d: the real value of a byte b is
``e4m3(b) * d``. Granularities, as arrays a kernel reads through strides (0 where constant):

    "tensor"  shape () (or (1,))              one scale
    "head"    shape (batch, heads)            one per (batch, head): per (batch, kv-head) for K, V
    "block"   shape (batch, heads, ceil(seqlen / 128))   one per 128 rows of one head

``attention`` takes any of the three for q and k, and "tensor" or "head" for v: V's rows are
the keys, the axis P V sums over, so a per-block V scale would have to rescale the accumulator
every key block. The quantizer picks d = amax / 448 (448 is e4m3's largest finite value) over
each group.

Rotation. ``hadamard_rotation`` gives a random-sign Hadamard transform R = diag(s) H / sqrt(D)
along head_dim. Quantizing ``q R`` and ``k R`` (same R) leaves ``q k^T`` unchanged while spreading
outlier channels over the whole row, so FP8 rounds the product's terms more evenly; v is not
rotated and the attention call is the same as without rotation.

Accuracy (RMSE against FP32, measured by tests/test_fp8.py, docs/guide/fp8.md): on
standard normal inputs the three schemes agree; with 0.1% large outliers per-block + rotation is
clearly the most accurate.

Constants: ``E4M3`` is the NumPy dtype ``float8_e4m3fn`` (ml_dtypes); ``E4M3_MAX`` = 448.0,
e4m3's largest finite value; ``GRANULARITIES`` = ("tensor", "head", "block"), the descale
granularities; ``HEAD_DIMS`` = (64, 128, 256), the head dims the quantizers take and the
attention kernel is compiled for (it takes any multiple of 16 from 16 to 256, on the least of
them that holds it); ``SCALE_BLOCK_ROWS`` = 128, the rows of one batch and head that share a
"block" descale.
"""

from __future__ import annotations

import math

from . import dispatch, runtime
from .interop import framework_arrays
from .problem import SCALE_BLOCK_ROWS, AttentionProblem
from .quant.fp8 import (E4M3, E4M3_MAX, GRANULARITIES, HEAD_DIMS, E4M3Array, as_e4m3,
                        dequantize, descale_operand, quantize, quantize_qkv, round_to_e4m3)
from .quant.hadamard import HadamardRotation, hadamard_rotation
from .quant.recipe import Fp8Recipe

__all__ = ["attention", "attention_backward", "reference", "Fp8Recipe", "quantize", "dequantize",
           "quantize_qkv", "E4M3Array", "hadamard_rotation", "HadamardRotation", "round_to_e4m3",
           "E4M3", "E4M3_MAX", "GRANULARITIES", "HEAD_DIMS", "SCALE_BLOCK_ROWS"]


def __dir__():
    return sorted(__all__)

ARCHS = dispatch.archs_for("e4m3")  # the FP8 attention kernel's; the quantizers run on more


@framework_arrays
def attention(q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False,
              softmax_scale: float | None = None, out_dtype=None, return_lse: bool = False,
              out=None):
    """FP8 attention forward, ``softmax(scale * (q dq)(k dk)^T) (v dv)``, on Hopper (sm_90a).

    Q K^T and P V run on FP8 tensor cores with FP32 accumulation; the probabilities P are
    rounded to e4m3 for the second product; the descales are applied in FP32. Kinds of array
    and streams as in ``ptxattn.attention``. Every operand is non-empty and 4-d with unit stride
    in head_dim, a 16-byte aligned base and batch/seqlen/heads strides that are positive
    multiples of 16 bytes, all on one device.

    Parameters
    ----------
    q : E4M3Array or float8_e4m3fn CUDA array
        Queries, (batch, seqlen_q, heads_q, head_dim): an ``E4M3Array``, a torch
        float8_e4m3fn tensor or a CuPy float8_e4m3fn view; head_dim a multiple of 16 from 16
        to 256.
    k, v : E4M3Array or float8_e4m3fn CUDA array
        Keys and values, (batch, seqlen_k, heads_kv, head_dim), of one shape (v's head_dim is
        k's: FP8 takes no narrower value heads), batch and head_dim as q's; heads_q a multiple
        of heads_kv (GQA/MQA).
    q_descale, k_descale : float or CUDA array
        Required. A finite positive number, or a float32 array on q's device of shape () or
        (1,) (per tensor), (batch, heads) (per head: heads_kv for k) or (batch, heads,
        ceil(seqlen / 128)) (per 128 rows of one head).
    v_descale : float or CUDA array
        Required. A finite positive number, or a float32 array of shape (), (1,) or (batch,
        heads_kv): no per-block V scale.
    causal : bool, default False
        Bottom-right aligned, as in ``ptxattn.attention``: key j is masked from query i unless
        j <= i + seqlen_k - seqlen_q; a row that sees no key gives 0 and LSE -inf.
    softmax_scale : float, optional
        The scale of the (dequantized) scores, finite and positive; 1 / sqrt(head_dim) by
        default.
    out_dtype : {'bfloat16', 'float16'}, optional
        The output's dtype: bfloat16 by default, ``out``'s dtype when ``out`` is given.
    return_lse : bool, default False
        Also return the log-sum-exp.
    out : CUDA array, optional
        The buffer to write the output into: bfloat16 or float16, q's shape, laid out as q, on
        q's device, its memory apart from every input's.

    Returns
    -------
    out : array
        The output, (batch, seqlen_q, heads_q, head_dim) in ``out_dtype``: ``out`` itself if
        given.
    lse : array
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log.

    Raises
    ------
    TypeError
        q, k or v not e4m3 (raw uint8, a 16-bit or float32 array: wrap or quantize it first);
        an array in host memory; a descale missing, or neither a number nor a float32 array;
        ``out`` not bfloat16 or float16; ``causal`` not a bool.
    ValueError
        A shape, stride or alignment above; head_dim not a multiple of 16 from 16 to 256, or
        v's unlike it; a descale that is not positive or of none of its shapes; ``out_dtype``
        not bfloat16 or float16, or unlike ``out``'s dtype; arrays on different devices;
        ``out`` overlapping an input; a bad ``softmax_scale``; a GPU other than sm_90a.

    Examples
    --------
    >>> import cupy
    >>> from ptxattn import fp8
    >>> q, k, v = (cupy.random.standard_normal((2, 4096, 16, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "block", rotate=True)
    >>> out = fp8.attention(q8, k8, v8, causal=True, **descales)
    >>> out.shape, out.dtype
    ((2, 4096, 16, 128), dtype(bfloat16))
    """
    import cupy

    q, k, v = as_e4m3("q", q), as_e4m3("k", k), as_e4m3("v", v)
    p = AttentionProblem.from_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale,
                                  v_descale=v_descale, causal=causal, softmax_scale=softmax_scale,
                                  out_dtype=out_dtype, out=out)
    arch = runtime.device_arch(p.device)
    route = dispatch.select(arch, p.format, p.head_dim, features=p.features)  # before allocating
    with cupy.cuda.Device(p.device):
        descales = (descale_operand(q_descale, p.batch, p.heads_q, p.seqlen_q),
                    descale_operand(k_descale, p.batch, p.heads_kv, p.seqlen_k),
                    descale_operand(v_descale, p.batch, p.heads_kv, p.seqlen_k))
        if out is None:
            out = cupy.empty(p.out_shape, dtype=p.out_dtype)
        lse = cupy.empty(p.lse_shape, dtype=cupy.float32)
        dispatch.forward(route, p, q.bytes, k.bytes, v.bytes, out, lse, descales=descales)
    return (out, lse) if return_lse else out


@framework_arrays
def attention_backward(dout, q, k, v, out, lse, *, q_descale, k_descale, v_descale,
                       causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, dq=None, dk=None, dv=None):
    """The gradients of ``fp8.attention`` with respect to its dequantized inputs, on sm_90a.

    The dequantized inputs are q · q_descale, k · k_descale and v · v_descale. ``out`` and
    ``lse`` are what ``attention(q, k, v, ..., return_lse=True)`` returned for these inputs and
    options. Four of the five GEMMs run on FP8 tensor cores with FP32 accumulation
    (docs/design/fp8.md#the-fp8-backward): S = Q K^T from the e4m3 inputs; dP = dO V^T and
    dV = P^T dO with dO quantized per 128 rows (amax / 448) and P as e4m3(256 P); dK = dS^T Q
    with dS scaled per key row and query tile to its amax. dQ = dS K runs in ``out``'s 16-bit
    dtype, on K dequantized. The gradients come back in out's dtype. With GQA, dk and dv are
    summed over the q heads that share a k/v head.

    Parameters
    ----------
    dout : CUDA array
        The gradient of the loss with respect to ``out``: out's shape and dtype, laid out by
        the forward's rules.
    q, k, v : E4M3Array or float8_e4m3fn CUDA array
        The forward's inputs; head_dim 64, 128 or 256.
    out : CUDA array
        The forward's output, bfloat16 or float16.
    lse : CUDA array
        The forward's log-sum-exp, float32 (batch, heads_q, seqlen_q), unit stride along
        seqlen_q.
    q_descale, k_descale, v_descale, causal, softmax_scale
        As in the forward.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run: dQ's sum over key blocks then runs
        in a fixed order.
    dq, dk, dv : CUDA array, optional
        Buffers for the gradients: out's dtype, the shapes of q, k and v, laid out by the same
        rules, on q's device, overlapping no input nor each other.

    Returns
    -------
    dq, dk, dv : tuple of array
        The gradients in out's dtype, shaped like q, k and v (``dq``, ``dk``, ``dv``
        themselves if given).

    Raises
    ------
    TypeError, ValueError
        As the forward raises them, and: ``dout`` unlike ``out``; ``lse`` not the forward's
        shape or float32; a gradient buffer of the wrong dtype or shape, or overlapping an
        input or another gradient; ``deterministic`` not a bool; head_dim other than 64, 128,
        256.

    Examples
    --------
    >>> q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "block")
    >>> out, lse = fp8.attention(q8, k8, v8, causal=True, return_lse=True, **descales)
    >>> dq, dk, dv = fp8.attention_backward(dout, q8, k8, v8, out, lse, causal=True,
    ...                                     **descales)
    """
    import cupy

    q, k, v = as_e4m3("q", q), as_e4m3("k", k), as_e4m3("v", v)
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    p = AttentionProblem.from_fp8_backward(dout, q, k, v, out, lse, causal=causal,
                                           softmax_scale=softmax_scale,
                                           deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                                           **descales)
    route = dispatch.select(runtime.device_arch(p.device), p.format, p.head_dim,
                            features=p.backward_features)
    with cupy.cuda.Device(p.device):
        dq = cupy.empty(q.shape, dtype=out.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, dtype=out.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, dtype=out.dtype) if dv is None else dv
        route.launcher.backward(p, dout, q, k, v, out, lse, dq, dk, dv,
                                deterministic=deterministic, descales=descales)
    return dq, dk, dv


def reference(q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False,
              precision: str = "float32", query_chunk: int = 1024):
    """FP32 attention of the dequantized inputs: what ``attention`` approximates.

    With ``precision="fp8"`` it is the same math with the probabilities exp(s - max) rounded
    to e4m3 before P V, as the kernel does (it keeps the exact running max for FP8): the naive
    FP8 yardstick for tolerances. Runs in CuPy; causal masking aligns bottom-right.

    Parameters
    ----------
    q, k, v : E4M3Array or float8_e4m3fn CuPy array
        As ``attention`` takes them: (batch, seqlen, heads, head_dim), heads_q a multiple of
        heads_kv.
    q_descale, k_descale, v_descale : float or CUDA array
        Their descales, of any granularity (module docstring).
    causal : bool, default False
        Bottom-right aligned, as in ``attention``.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    return_lse : bool, default False
        Also return the log-sum-exp.
    precision : {'float32', 'fp8'}, default 'float32'
        'float32': every step in FP32. 'fp8': the probabilities rounded to e4m3 before P V.
    query_chunk : int, default 1024
        Query rows computed at a time with ``precision="fp8"`` (bounds the scores' memory).

    Returns
    -------
    out : cupy.ndarray
        float32 (batch, seqlen_q, heads_q, head_dim).
    lse : cupy.ndarray
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log.

    Raises
    ------
    ValueError
        ``precision`` neither 'float32' nor 'fp8'.
    TypeError
        q, k or v not e4m3 data.

    Examples
    --------
    >>> q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "head")
    >>> out = fp8.attention(q8, k8, v8, **descales)
    >>> ref = fp8.reference(q8, k8, v8, **descales)
    >>> error = cupy.abs(out.astype(cupy.float32) - ref).max()
    >>> ref.shape, ref.dtype
    ((2, 4096, 16, 128), dtype('float32'))
    """
    import cupy

    from . import reference as fp32

    qf, kf, vf = (dequantize(x, d) for x, d in ((q, q_descale), (k, k_descale), (v, v_descale)))
    if precision == "float32":
        return fp32.attention(qf, kf, vf, causal=causal, softmax_scale=softmax_scale,
                              return_lse=return_lse)
    if precision != "fp8":
        raise ValueError(f"precision must be 'float32' or 'fp8', got {precision!r}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    qh = qf.transpose(0, 2, 1, 3)
    kh = cupy.repeat(kf.transpose(0, 2, 1, 3), heads_q // heads_kv, axis=1)
    vh = cupy.repeat(vf.transpose(0, 2, 1, 3), heads_q // heads_kv, axis=1)
    out = cupy.empty((batch, heads_q, seqlen_q, head_dim), dtype=cupy.float32)
    lse = cupy.empty((batch, heads_q, seqlen_q), dtype=cupy.float32)
    for start in range(0, seqlen_q, query_chunk):
        stop = min(start + query_chunk, seqlen_q)
        scores = cupy.matmul(qh[:, :, start:stop], kh.transpose(0, 1, 3, 2)) * scale
        if causal:
            hidden = (cupy.arange(seqlen_k)[None, :]
                      > cupy.arange(start, stop)[:, None] + (seqlen_k - seqlen_q))
            scores = cupy.where(hidden, -cupy.inf, scores)
        row_max = scores.max(axis=-1, keepdims=True)
        safe_max = cupy.where(cupy.isfinite(row_max), row_max, 0.0)
        probs = cupy.exp(scores - safe_max)
        row_sum = probs.sum(axis=-1, keepdims=True)
        numerator = cupy.matmul(round_to_e4m3(probs), vh)
        out[:, :, start:stop] = numerator / cupy.where(row_sum > 0, row_sum, 1.0)
        lse[:, :, start:stop] = (cupy.log(row_sum) + safe_max)[..., 0]
    out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out
