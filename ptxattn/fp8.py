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

import functools
import math
from typing import NamedTuple

import numpy as np

from . import dispatch, runtime
from .interop import CUDA_ARRAY, framework_arrays
from .problem import (E4M3, SCALE_BLOCK_ROWS, AttentionProblem, check_e4m3, check_rows,
                      descale_shapes)

E4M3_MAX = 448.0
GRANULARITIES = ("tensor", "head", "block")
HEAD_DIMS = (64, 128, 256)
ARCHS = dispatch.archs_for("e4m3")  # the FP8 attention kernel's; the quantizers run on more
INPUT_DTYPES = {"bfloat16": 1, "float16": 0}

_QUANTIZER_ARCHS = ("sm_89", "sm_90a", "sm_120a")
_WARPS_PER_BLOCK = 8


def quantizer_spec(entry: str, dtype: str, head_dim: int) -> runtime.KernelSpec:
    return runtime.KernelSpec(
        name=f"{entry}_{dtype}_d{head_dim}", source="kernels/quantize_fp8.cu", entry=entry,
        defines={"HEAD_DIM": head_dim, "IS_BF16": INPUT_DTYPES[dtype]}, archs=_QUANTIZER_ARCHS)


def variants() -> list[runtime.KernelSpec]:
    return [quantizer_spec(entry, dtype, head_dim) for entry in ("fp8_amax", "fp8_quantize")
            for dtype in INPUT_DTYPES for head_dim in HEAD_DIMS]


class E4M3Array:
    """FP8 e4m3 data on the GPU: a CuPy uint8 array of e4m3 bytes, tagged with that format.

    Has the array metadata the kernels check (shape, strides in bytes, dtype ``float8_e4m3fn``,
    data pointer, device); indexing gives an E4M3Array view; ``get()`` copies to NumPy as
    ml_dtypes ``float8_e4m3fn``; ``bytes`` is the uint8 storage.
    """

    __slots__ = ("bytes",)
    dtype = None  # set below to E4M3
    itemsize = 1

    def __init__(self, data):
        if np.dtype(data.dtype) not in (np.dtype(np.uint8), E4M3):
            raise TypeError(f"E4M3Array holds uint8 e4m3 bytes, got dtype {data.dtype}")
        self.bytes = data.view(np.uint8)

    @classmethod
    def from_host(cls, x) -> "E4M3Array":
        """Uploads a NumPy float8_e4m3fn (or uint8) array."""
        import cupy
        return cls(cupy.asarray(np.asarray(x).view(np.uint8)))

    shape = property(lambda self: self.bytes.shape)
    strides = property(lambda self: self.bytes.strides)
    ndim = property(lambda self: self.bytes.ndim)
    size = property(lambda self: self.bytes.size)
    data = property(lambda self: self.bytes.data)
    device = property(lambda self: self.bytes.device)

    def __getitem__(self, index) -> "E4M3Array":
        return E4M3Array(self.bytes[index])

    def get(self) -> np.ndarray:
        return self.bytes.get().view(E4M3)

    def __repr__(self) -> str:
        return f"E4M3Array(shape={self.shape}, strides={self.strides})"


E4M3Array.dtype = E4M3


def as_e4m3(name: str, x) -> E4M3Array:
    """``x`` as an E4M3Array, or a TypeError naming the argument (its layout is checked by
    AttentionProblem.from_fp8)."""
    if isinstance(x, E4M3Array):
        return x
    import cupy
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a ptxattn.fp8.E4M3Array, a torch float8_e4m3fn tensor "
                        f"or a CuPy float8_e4m3fn view, got {type(x).__module__}."
                        f"{type(x).__name__}")
    check_e4m3(name, x)
    return E4M3Array(x)


@functools.lru_cache(maxsize=None)
def e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 e4m3 bytes (0x7f and 0xff are NaN)."""
    return np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Rotation


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix, H[i, j] = (-1)^popcount(i & j), float64, unnormalised."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


class HadamardRotation(NamedTuple):
    """x -> (x * signs) H / sqrt(D) along the last axis: orthogonal, so it keeps q k^T."""

    signs: np.ndarray  # float32 (head_dim,), entries +-1

    @property
    def head_dim(self) -> int:
        return self.signs.shape[0]

    def matrix(self) -> np.ndarray:
        """The rotation as a float64 (D, D) matrix R, applied as x @ R."""
        return self.signs[:, None].astype(np.float64) * hadamard_matrix(self.head_dim) / math.sqrt(
            self.head_dim)


def hadamard_rotation(head_dim: int, seed: int | None = None) -> HadamardRotation:
    """A random-sign Hadamard rotation of size head_dim (a power of two)."""
    hadamard_matrix(head_dim)
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), head_dim)
    return HadamardRotation(signs.astype(np.float32))


# ---------------------------------------------------------------------------------------------
# Descales as the kernels read them


class Descale(NamedTuple):
    """A float32 device array with element strides over (batch, head, 128-row block); a stride
    is 0 along a dimension the scale does not vary in."""

    array: object
    stride_b: int
    stride_h: int
    stride_block: int


def descale_operand(d, batch: int, heads: int, seqlen: int) -> Descale:
    import cupy

    if not hasattr(d, "shape"):
        return Descale(cupy.full((1,), d, dtype=cupy.float32), 0, 0, 0)
    granularity = descale_shapes(batch, heads, seqlen, True)[tuple(d.shape)]
    steps = [s // d.itemsize for s in d.strides]
    if granularity == "tensor":
        return Descale(d, 0, 0, 0)
    if granularity == "head":
        return Descale(d, steps[0], steps[1], 0)
    return Descale(d, steps[0], steps[1], steps[2])


def descale_rows(d, batch: int, seqlen: int, heads: int):
    """A descale of any granularity broadcast to (batch, seqlen, heads, 1), float32 on device."""
    import cupy

    if not hasattr(d, "shape"):
        return cupy.full((1, 1, 1, 1), d, dtype=cupy.float32)
    d = cupy.asarray(d, dtype=cupy.float32)
    if d.ndim <= 1:
        return d.reshape(1, 1, 1, 1)
    if d.ndim == 2:
        return d[:, None, :, None]
    rows = cupy.repeat(d, SCALE_BLOCK_ROWS, axis=2)[:, :, :seqlen]
    return rows.transpose(0, 2, 1)[..., None]


# ---------------------------------------------------------------------------------------------
# Quantizers


def _check_quantizer_input(x) -> None:
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"x must be {CUDA_ARRAY}, got {type(x).__module__}.{type(x).__name__}")
    if np.dtype(x.dtype).name not in INPUT_DTYPES:
        raise TypeError(f"x must have dtype bfloat16 or float16, got {x.dtype}")
    check_rows("x", x)
    if x.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {x.shape[3]}")
    if x.size >= 2 ** 31 * x.shape[3]:
        raise ValueError(f"x has too many rows ({x.size // x.shape[3]}) for the quantizer")


def _rotation_signs(rotation: HadamardRotation | None, head_dim: int):
    """The kernel argument for ``rotation``: its signs on the device, or a null pointer."""
    import cupy

    if rotation is None:
        return np.uint64(0)
    if not isinstance(rotation, HadamardRotation):
        raise TypeError(f"rotation must be a HadamardRotation or None, got "
                        f"{type(rotation).__name__}")
    if rotation.head_dim != head_dim:
        raise ValueError(f"rotation is for head_dim {rotation.head_dim}, x has {head_dim}")
    return cupy.asarray(rotation.signs, dtype=cupy.float32)


@framework_arrays
def quantize(x, granularity: str = "tensor", rotation: HadamardRotation | None = None):
    """bf16/fp16 x (batch, seqlen, heads, head_dim) -> (x8, descale) on the GPU.

    x8 is an :class:`E4M3Array` of x's shape (contiguous) holding e4m3(x / descale) (rounded
    to nearest even); descale is float32 of the granularity's shape (module docstring), amax /
    448 over each group (1 for an all-zero group). With ``rotation`` the rows are first rotated,
    x8 * descale then approximates x @ rotation.matrix(). x may be any framework's CUDA array
    (ptxattn.interop); for a torch x, x8 is a float8_e4m3fn tensor and descale a tensor.
    """
    import cupy

    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    _check_quantizer_input(x)
    batch, seqlen, heads, head_dim = x.shape
    dtype = np.dtype(x.dtype).name
    signs_arg = _rotation_signs(rotation, head_dim)
    strides = [np.int64(s // x.itemsize) for s in x.strides[:3]]
    rows = batch * seqlen * heads
    grid = (-(-rows // _WARPS_PER_BLOCK), 1, 1)
    block = (32 * _WARPS_PER_BLOCK, 1, 1)
    blocks = -(-seqlen // SCALE_BLOCK_ROWS)
    with cupy.cuda.Device(x.device.id):
        amax_bits = cupy.zeros((batch, heads, blocks), dtype=cupy.uint32)
        runtime.launch(runtime.load(quantizer_spec("fp8_amax", dtype, head_dim)), grid, block,
                       [x, *strides, np.int32(seqlen), np.int32(heads), np.int64(rows), signs_arg,
                        amax_bits])
        amax = amax_bits.view(cupy.float32)
        if granularity == "head":
            amax = amax.max(axis=2)
        elif granularity == "tensor":
            amax = amax.max()
        descale = cupy.where(amax > 0, amax / cupy.float32(E4M3_MAX), cupy.float32(1.0))
        descale = descale.astype(cupy.float32)
        d = descale_operand(descale, batch, heads, seqlen)
        x8 = cupy.empty(x.shape, dtype=cupy.uint8)
        runtime.launch(runtime.load(quantizer_spec("fp8_quantize", dtype, head_dim)), grid, block,
                       [x, *strides, np.int32(seqlen), np.int32(heads), np.int64(rows), signs_arg,
                        d.array, np.int64(d.stride_b), np.int64(d.stride_h),
                        np.int64(d.stride_block), x8])
    return E4M3Array(x8), descale


@framework_arrays
def dequantize(x8, descale):
    """float32 x8 * descale (any granularity) for e4m3 data (batch, seqlen, heads, dim)."""
    import cupy

    x8 = as_e4m3("x8", x8)
    batch, seqlen, heads, _ = x8.shape
    with cupy.cuda.Device(x8.device.id):
        values = cupy.asarray(e4m3_values())[x8.bytes]
        return values * descale_rows(descale, batch, seqlen, heads)


def quantize_qkv(q, k, v, granularity: str = "block", rotate: bool = False,
                 seed: int | None = None):
    """Quantizes attention inputs: returns (q8, k8, v8, descales), descales a dict to pass as
    ``fp8_attention(q8, k8, v8, **descales)``. q and k get ``granularity`` (and, with
    ``rotate``, one shared random-sign Hadamard rotation drawn from ``seed``); v gets the same
    granularity except "block", for which it is quantized per (batch, head)."""
    rotation = hadamard_rotation(q.shape[3], seed) if rotate else None
    q8, q_descale = quantize(q, granularity, rotation)
    k8, k_descale = quantize(k, granularity, rotation)
    v8, v_descale = quantize(v, "head" if granularity == "block" else granularity)
    return q8, k8, v8, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}


# ---------------------------------------------------------------------------------------------
# Attention


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
    route = dispatch.select(runtime.device_arch(p.device), p.format, p.head_dim,
                            features=p.features)
    with cupy.cuda.Device(p.device):
        descales = (descale_operand(q_descale, p.batch, p.heads_q, p.seqlen_q),
                    descale_operand(k_descale, p.batch, p.heads_kv, p.seqlen_k),
                    descale_operand(v_descale, p.batch, p.heads_kv, p.seqlen_k))
        if out is None:
            out = cupy.empty(p.out_shape, dtype=p.out_dtype)
        lse = cupy.empty(p.lse_shape, dtype=cupy.float32)
        route.module().forward_fp8(q.bytes, k.bytes, v.bytes, out, lse, descales,
                                   causal=p.causal, softmax_scale=p.softmax_scale)
    return (out, lse) if return_lse else out


def round_to_e4m3(x):
    """float32 array (NumPy or CuPy) rounded to the nearest e4m3 value, ties to even, saturating
    at +-448, returned as float32: what cvt.rn.satfinite.e4m3x2.f32 does, in exact steps."""
    if isinstance(x, np.ndarray):
        xp = np
    else:
        import cupy as xp
    x = xp.asarray(x, dtype=xp.float32)
    mag = xp.minimum(xp.abs(x), xp.float32(E4M3_MAX))
    mantissa, exponent = xp.frexp(mag)  # mag = mantissa * 2^exponent, mantissa in [0.5, 1)
    normal = xp.ldexp(xp.rint(mantissa * 16), exponent - 4)
    subnormal = xp.rint(mag * 512) / 512  # step 2^-9 below 2^-6
    rounded = xp.where(mag < 2.0 ** -6, subnormal, normal).astype(xp.float32)
    return xp.copysign(xp.minimum(rounded, xp.float32(E4M3_MAX)), x)


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
