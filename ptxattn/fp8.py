"""FP8 (e4m3) attention on Hopper: the data carrier, quantizers, descales and a reference.

Carrier. CuPy 14 does not support FP8 dtypes: ``cupy.empty(..., dtype=float8_e4m3fn)`` and
``cupy.asarray`` of an ml_dtypes float8 array raise "Unsupported dtype" (only ``.view`` slips
through). So FP8 data is uint8 storage with an explicit format: :class:`E4M3Array` wraps a CuPy
uint8 array of e4m3 bytes (shape, strides, slicing, ``.get()`` to an ml_dtypes
``float8_e4m3fn`` NumPy array). The FP8 entry points take E4M3Array (or a CuPy view, or a torch
tensor, whose dtype is ``float8_e4m3fn``, which names the format too) and refuse anything else by
type: a bf16/fp16 array, and raw uint8, which could hold e4m3, e5m2 or integers (wrap it:
``E4M3Array(x)``). Torch callers get their FP8 results as float8_e4m3fn tensors
(ptxattn.interop).

Scales. An FP8 tensor comes with a float32 *descale* d: the real value of a byte b is
``e4m3(b) * d``. Granularities, as arrays a kernel reads through strides (0 where constant):
    "tensor"  shape ()                       one scale
    "head"    shape (batch, heads)            one per (batch, head): per (batch, kv-head) for K, V
    "block"   shape (batch, heads, ceil(seqlen / 128))   one per 128 rows of one head
:func:`attention` takes any of the three for q and k, and "tensor" or "head" for v: V's rows are
the keys, the axis P V sums over, so a per-block V scale would have to rescale the accumulator
every key block. The quantizer picks d = amax / 448 (448 is e4m3's largest finite value) over
each group.

Rotation. :func:`hadamard_rotation` gives a random-sign Hadamard transform R = diag(s) H / sqrt(D)
along head_dim. Quantizing ``q R`` and ``k R`` (same R) leaves ``q k^T`` unchanged while spreading
outlier channels over the whole row, so FP8 rounds the product's terms more evenly; v is not
rotated and the attention call is the same as without rotation.

Accuracy (RMSE against FP32, measured by tests/test_fp8.py and reported in the README): on
standard normal inputs the three schemes agree; with 0.1% large outliers per-block + rotation is
clearly the most accurate.
"""

from __future__ import annotations

import math

from . import dispatch, runtime
from .interop import framework_arrays
from .problem import SCALE_BLOCK_ROWS, AttentionProblem
from .quant.fp8 import (E4M3, E4M3_MAX, GRANULARITIES, HEAD_DIMS, E4M3Array, as_e4m3,
                        dequantize, descale_operand, quantize, quantize_qkv, round_to_e4m3)
from .quant.hadamard import HadamardRotation, hadamard_rotation

__all__ = ["attention", "reference", "quantize", "dequantize", "quantize_qkv", "E4M3Array",
           "hadamard_rotation", "HadamardRotation", "round_to_e4m3", "E4M3", "E4M3_MAX",
           "GRANULARITIES", "HEAD_DIMS", "SCALE_BLOCK_ROWS"]

ARCHS = dispatch.archs_for("e4m3")  # the FP8 attention kernel's; the quantizers run on more


@framework_arrays
def attention(q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False,
              softmax_scale: float | None = None, out_dtype=None, return_lse: bool = False,
              out=None):
    """FP8 attention forward: ``softmax(scale * (q dq)(k dk)^T) (v dv)`` on Hopper (sm_90a).

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim):
    :class:`E4M3Array`, torch float8_e4m3fn tensors or CuPy float8_e4m3fn views, unit stride in
    head_dim, 16-byte aligned strides; head_dim 64,
    128 or 256; heads_q a multiple of heads_kv. q_descale, k_descale: a positive number or a
    float32 array of shape (), (batch, heads), or (batch, heads, ceil(seqlen / 128)) (the last
    per 128 rows); v_descale: a number, shape () or (batch, heads_kv). All three are required.
    ``causal`` aligns bottom-right like :func:`ptxattn.attention`. Q K^T and P V run on FP8
    tensor cores with FP32 accumulation; the probabilities P are rounded to e4m3 for the second
    product; the descales are applied in FP32. Returns the output in ``out_dtype`` (bfloat16
    by default, or float16; ``out``'s dtype when given) and, with ``return_lse``, the float32
    natural-log LSE (batch, heads_q, seqlen_q).
    """
    import cupy

    q, k, v = as_e4m3("q", q), as_e4m3("k", k), as_e4m3("v", v)
    p = AttentionProblem.from_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale,
                                  v_descale=v_descale, causal=causal, softmax_scale=softmax_scale,
                                  out_dtype=out_dtype, out=out)
    arch = runtime.device_arch(p.device)
    dispatch.select(arch, p.format, p.head_dim, features=p.features)  # before any allocation
    with cupy.cuda.Device(p.device):
        descales = (descale_operand(q_descale, p.batch, p.heads_q, p.seqlen_q),
                    descale_operand(k_descale, p.batch, p.heads_kv, p.seqlen_k),
                    descale_operand(v_descale, p.batch, p.heads_kv, p.seqlen_k))
        if out is None:
            out = cupy.empty(p.out_shape, dtype=p.out_dtype)
        lse = cupy.empty(p.lse_shape, dtype=cupy.float32)
        dispatch.forward(arch, p, q.bytes, k.bytes, v.bytes, out, lse, descales=descales)
    return (out, lse) if return_lse else out


def reference(q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False,
              precision: str = "float32", query_chunk: int = 1024):
    """FP32 attention of the dequantized inputs, what :func:`attention` approximates.

    ``precision="fp8"`` is the same math with the probabilities exp(s - max) rounded to e4m3
    before P V, as the kernel does (it keeps the exact running max for FP8): the naive FP8
    yardstick for tolerances. Returns float32 output (and LSE, natural log, (batch, heads,
    seqlen_q)).
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
