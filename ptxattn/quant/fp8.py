"""FP8 (e4m3) data and its quantizers: the carrier type, the descales as the kernels read
them, and the GPU quantizers (``ptx_src/kernels/quantize_fp8.cu``). ptxattn.fp8 documents the
formats and granularities and re-exports the public names.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .. import archs, runtime
from ..interop import CUDA_ARRAY, framework_arrays
from ..launchers import kernel_head_dim
from ..problem import E4M3, SCALE_BLOCK_ROWS, check_e4m3, check_rows, descale_shapes
from ..problem.checks import check_last_axis
from .hadamard import HadamardRotation, hadamard_rotation

E4M3_MAX = 448.0
"""e4m3's largest finite value: a descale is amax / E4M3_MAX."""
GRANULARITIES = ("tensor", "head", "block")
"""The descale granularities: one per tensor, per (batch, head), per 128 rows of one head."""
HEAD_DIMS = (64, 128, 256)
"""The head dims the FP8 kernels and the quantizers are compiled for: any multiple of 16 up to
256 runs on the least that holds it, a Hadamard rotation on these alone."""
INPUT_DTYPES = {"bfloat16": 1, "float16": 0}

# cvt.rn.satfinite.e4m3x2.f32 (ptx/e4m3.cuh) is sm_89+
QUANTIZER_ARCHS = tuple(name for name, arch in archs.ARCHS.items() if arch.capability >= (8, 9))
"""The architectures the quantizers (and so appends into an e4m3 cache) run on."""
_WARPS_PER_BLOCK = 8


def quantizer_spec(entry: str, dtype: str, head_dim: int) -> runtime.KernelSpec:
    return runtime.KernelSpec(
        name=f"{entry}_{dtype}_d{head_dim}", source="kernels/quantize_fp8.cu", entry=entry,
        defines={"HEAD_DIM": head_dim, "IS_BF16": INPUT_DTYPES[dtype]}, archs=QUANTIZER_ARCHS)


def variants() -> list[runtime.KernelSpec]:
    return [quantizer_spec(entry, dtype, head_dim) for entry in ("fp8_amax", "fp8_quantize")
            for dtype in INPUT_DTYPES for head_dim in HEAD_DIMS]


class E4M3Array:
    """FP8 e4m3 data on the GPU: a CuPy uint8 array of e4m3 bytes, tagged with that format.

    CuPy has no FP8 dtype, so the FP8 entry points take this (or a float8_e4m3fn view or torch
    tensor) and refuse raw uint8, which could hold any 8-bit format. It has the array metadata
    the kernels check (shape, strides in bytes, dtype ``float8_e4m3fn``, data pointer,
    device); indexing gives an E4M3Array view of the same bytes.

    Parameters
    ----------
    data : cupy.ndarray
        uint8 storage holding e4m3 bytes, or a CuPy float8_e4m3fn view; not copied.

    Attributes
    ----------
    bytes : cupy.ndarray
        The uint8 storage.
    dtype : numpy.dtype
        ``float8_e4m3fn`` (ml_dtypes).
    shape, strides, ndim, size, data, device
        Those of ``bytes`` (strides in bytes).

    Raises
    ------
    TypeError
        ``data`` of a dtype other than uint8 or float8_e4m3fn.

    Examples
    --------
    >>> import cupy, ml_dtypes, numpy as np
    >>> from ptxattn.fp8 import E4M3Array
    >>> host = np.ones((1, 128, 8, 64), dtype=ml_dtypes.float8_e4m3fn)
    >>> x8 = E4M3Array.from_host(host)           # uploaded
    >>> x8 = E4M3Array(cupy.asarray(host.view(np.uint8)))   # the same, from device bytes
    >>> x8[:, :64].shape
    (1, 64, 8, 64)
    >>> x8.get().dtype
    dtype(float8_e4m3fn)
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
        """An E4M3Array on the current device from a NumPy float8_e4m3fn (or uint8) array."""
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
        """A NumPy copy, of dtype ml_dtypes ``float8_e4m3fn``."""
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
# Descales as the kernels read them


class Descale(NamedTuple):
    """A float32 device array with element strides over (batch, head, 128-row block); a stride
    is 0 along a dimension the scale does not vary in."""

    array: object
    stride_b: int
    stride_h: int
    stride_block: int


def descale_operand(d, batch: int, heads: int, seqlen: int) -> Descale:
    if not hasattr(d, "shape"):
        return Descale(_scalar_descale(float(d)), 0, 0, 0)
    granularity = descale_shapes(batch, heads, seqlen, True)[tuple(d.shape)]
    steps = [s // d.itemsize for s in d.strides]
    if granularity == "tensor":
        return Descale(d, 0, 0, 0)
    if granularity == "head":
        return Descale(d, steps[0], steps[1], 0)
    return Descale(d, steps[0], steps[1], steps[2])


_scalar_descales: dict = {}
_SCALAR_DESCALES_KEPT = 256


def _scalar_descale(value: float):
    """A descale given as a number, as a float32 (1,) array on the current device: one per
    (device, value) for the first _SCALAR_DESCALES_KEPT values, so that a decode loop passing
    the same number allocates and fills nothing per call and its prepared launches find the same
    address; past those, a new array a call (a caller drawing ever new numbers gains nothing
    from keeping them)."""
    import cupy

    key = (cupy.cuda.Device().id, value)
    array = _scalar_descales.get(key)
    if array is None:
        array = cupy.full((1,), value, dtype=cupy.float32)
        if len(_scalar_descales) < _SCALAR_DESCALES_KEPT:
            _scalar_descales[key] = array
    return array


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
    check_last_axis("x", x, "e4m3")
    check_rows("x", x)
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
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"a rotation needs head_dim one of {HEAD_DIMS} (the rows the "
                         f"quantizer's butterfly spans), x has {head_dim}")
    return cupy.asarray(rotation.signs, dtype=cupy.float32)


@framework_arrays
def quantize(x, granularity: str = "tensor", rotation: HadamardRotation | None = None):
    """Quantizes bf16/fp16 x to e4m3 on the GPU: returns (x8, descale).

    descale is amax / 448 over each group of the granularity (1 for an all-zero group), and x8
    holds e4m3(x / descale), rounded to nearest even, so that x8 * descale approximates x.
    With ``rotation`` the rows are rotated first, and x8 * descale approximates
    ``x @ rotation.matrix()``. Kinds of array as in ``ptxattn.attention``: for a torch x, x8 is
    a float8_e4m3fn tensor and descale a tensor.

    Parameters
    ----------
    x : CUDA array
        bfloat16 or float16, (batch, seqlen, heads, head_dim), non-empty, head_dim a multiple
        of 16 up to 256, unit stride in head_dim, a 16-byte aligned base and batch/seqlen/heads
        strides that are positive multiples of 16 bytes.
    granularity : {'tensor', 'head', 'block'}, default 'tensor'
        One descale per tensor (shape ()), per (batch, head) (shape (batch, heads)), or per 128
        rows of one head (shape (batch, heads, ceil(seqlen / 128))).
    rotation : HadamardRotation, optional
        A rotation of x's head_dim (``hadamard_rotation``), which must be 64, 128 or 256; the
        same one for q and k keeps q k^T.

    Returns
    -------
    x8 : E4M3Array
        e4m3 data of x's shape, contiguous (a float8_e4m3fn tensor for torch callers).
    descale : array
        float32, of the granularity's shape.

    Raises
    ------
    TypeError
        x not a CUDA array, or not bfloat16 or float16; ``rotation`` not a HadamardRotation.
    ValueError
        An unknown ``granularity``; x not 4-d, empty, or not laid out as above; head_dim not a
        multiple of 16 up to 256; a rotation of another head_dim, or at a head_dim other than
        64, 128 or 256; 2**31 rows or more.

    Examples
    --------
    >>> import cupy
    >>> from ptxattn import fp8
    >>> x = cupy.random.standard_normal((2, 1000, 8, 128)).astype("bfloat16")
    >>> x8, descale = fp8.quantize(x, "block")
    >>> x8.shape, descale.shape, descale.dtype
    ((2, 1000, 8, 128), (2, 8, 8), dtype('float32'))
    >>> x_again = fp8.dequantize(x8, descale)  # float32, close to x
    """
    import cupy

    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    _check_quantizer_input(x)
    batch, seqlen, heads, head_dim = x.shape
    dtype = np.dtype(x.dtype).name
    signs_arg = _rotation_signs(rotation, head_dim)
    kernel_dim = kernel_head_dim(HEAD_DIMS, head_dim)
    strides = [np.int64(s // x.itemsize) for s in x.strides[:3]]
    rows = batch * seqlen * heads
    grid = (-(-rows // _WARPS_PER_BLOCK), 1, 1)
    block = (32 * _WARPS_PER_BLOCK, 1, 1)
    blocks = -(-seqlen // SCALE_BLOCK_ROWS)
    with cupy.cuda.Device(x.device.id):
        amax_bits = cupy.zeros((batch, heads, blocks), dtype=cupy.uint32)
        runtime.launch(runtime.load(quantizer_spec("fp8_amax", dtype, kernel_dim)), grid,
                       block, [x, *strides, np.int32(seqlen), np.int32(heads), np.int64(rows),
                               signs_arg, amax_bits, np.int32(head_dim)])
        amax = amax_bits.view(cupy.float32)
        if granularity == "head":
            amax = amax.max(axis=2)
        elif granularity == "tensor":
            amax = amax.max()
        descale = cupy.where(amax > 0, amax / cupy.float32(E4M3_MAX), cupy.float32(1.0))
        descale = descale.astype(cupy.float32)
        x8 = quantize_rows(x, descale_operand(descale, batch, heads, seqlen), signs_arg)
    return E4M3Array(x8), descale


def quantize_rows(x, d: Descale, signs=np.uint64(0)):
    """e4m3(x / d) of a checked 16-bit x (batch, seqlen, heads, head_dim), d read through its
    strides, rows rotated first with ``signs`` (a device array, or a null pointer): a contiguous
    uint8 array of x's shape. The FP8 caches quantize the keys they append with it."""
    import cupy

    batch, seqlen, heads, head_dim = x.shape
    strides = [np.int64(s // x.itemsize) for s in x.strides[:3]]
    rows = batch * seqlen * heads
    spec = quantizer_spec("fp8_quantize", np.dtype(x.dtype).name,
                          kernel_head_dim(HEAD_DIMS, head_dim))
    x8 = cupy.empty(x.shape, dtype=cupy.uint8)
    runtime.launch(runtime.load(spec), (-(-rows // _WARPS_PER_BLOCK), 1, 1),
                   (32 * _WARPS_PER_BLOCK, 1, 1),
                   [x, *strides, np.int32(seqlen), np.int32(heads), np.int64(rows), signs,
                    d.array, np.int64(d.stride_b), np.int64(d.stride_h), np.int64(d.stride_block),
                    x8, np.int32(head_dim)])
    return x8


@framework_arrays
def dequantize(x8, descale):
    """The real values of e4m3 data: float32 x8 * descale, on the GPU.

    Parameters
    ----------
    x8 : E4M3Array or float8_e4m3fn CUDA array
        e4m3 data, (batch, seqlen, heads, head_dim).
    descale : float or CUDA array
        Its descale, of any granularity: a number, or float32 of shape () or (1,), (batch,
        heads) or (batch, heads, ceil(seqlen / 128)).

    Returns
    -------
    array
        float32 (batch, seqlen, heads, head_dim), the caller's kind of array.

    Raises
    ------
    TypeError
        x8 not e4m3 data (raw uint8 is refused: wrap it in ``E4M3Array``).

    Examples
    --------
    >>> x8, descale = fp8.quantize(x, "head")
    >>> fp8.dequantize(x8, descale).dtype
    dtype('float32')
    """
    import cupy

    x8 = as_e4m3("x8", x8)
    batch, seqlen, heads, _ = x8.shape
    with cupy.cuda.Device(x8.device.id):
        values = cupy.asarray(e4m3_values())[x8.bytes]
        return values * descale_rows(descale, batch, seqlen, heads)


def quantize_qkv(q, k, v, granularity: str = "block", rotate: bool = False,
                 seed: int | None = None):
    """Quantizes attention inputs for ``ptxattn.fp8.attention``: returns (q8, k8, v8, descales).

    q and k get ``granularity`` and, with ``rotate``, one shared random-sign Hadamard rotation
    (which leaves q k^T unchanged, so the attention call is the same); v gets the same
    granularity except "block", for which it is quantized per (batch, head), and is never
    rotated.

    Parameters
    ----------
    q, k, v : CUDA array
        bfloat16 or float16 (batch, seqlen, heads, head_dim), as ``quantize`` takes them.
    granularity : {'tensor', 'head', 'block'}, default 'block'
        The descale granularity of q and k (v: 'head' for 'block').
    rotate : bool, default False
        Rotate q and k by one ``hadamard_rotation`` drawn from ``seed``.
    seed : int, optional
        The rotation's seed (None: fresh entropy).

    Returns
    -------
    q8, k8, v8 : E4M3Array
        The e4m3 data (float8_e4m3fn tensors for torch callers).
    descales : dict
        {"q_descale": ..., "k_descale": ..., "v_descale": ...}, to pass as
        ``fp8.attention(q8, k8, v8, **descales)``.

    Raises
    ------
    TypeError, ValueError
        As ``quantize`` raises them.

    Examples
    --------
    >>> q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "block", rotate=True, seed=0)
    >>> out = fp8.attention(q8, k8, v8, causal=True, **descales)
    """
    rotation = hadamard_rotation(q.shape[3], seed) if rotate else None
    q8, q_descale = quantize(q, granularity, rotation)
    k8, k_descale = quantize(k, granularity, rotation)
    v8, v_descale = quantize(v, "head" if granularity == "block" else granularity)
    return q8, k8, v8, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}


def round_to_e4m3(x):
    """Values rounded to the nearest e4m3 value, returned as float32.

    Ties go to even and magnitudes saturate at 448: what ``cvt.rn.satfinite.e4m3x2.f32`` does,
    in exact steps.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Values (converted to float32).

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        float32, of x's shape, NumPy for a NumPy x and CuPy otherwise.

    Examples
    --------
    >>> import numpy as np
    >>> from ptxattn import fp8
    >>> fp8.round_to_e4m3(np.array([0.3, 500.0, -1e-9], np.float32))
    array([ 3.125e-01,  4.480e+02, -0.000e+00], dtype=float32)
    """
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
