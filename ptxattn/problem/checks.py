"""The argument checks every entry point's problem is built from, on array metadata only
(shape, dtype, strides, itemsize, ``data.ptr``, ``device.id``), so that they run without a GPU
on stand-ins (tests/meta_array.py). Each raises TypeError (the wrong kind of thing) or
ValueError (a wrong value) naming the argument and saying what was expected.
"""

from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from .. import dispatch

# Every kernel moves rows of head_dim in 16-byte vectors (cp.async, TMA), so base addresses and
# the batch/seqlen/heads strides must be multiples of 16 bytes.
ALIGN_BYTES = 16
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_OUT_DTYPES = ("bfloat16", "float16")
SCALE_BLOCK_ROWS = 128  # rows (of one batch and head) that share an FP8 "block" descale



def dtype_of(name: str, x) -> np.dtype:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__module__}.{type(x).__name__}")
    return np.dtype(x.dtype)


def check_16bit(name: str, x) -> str:
    """The dtype name of a float16 or bfloat16 array, or a TypeError."""
    dtype = dtype_of(name, x)
    if dtype.name not in dispatch.SIXTEEN_BIT:
        raise TypeError(f"{name} must have dtype float16 or bfloat16, got {dtype}"
                        + integer_hint(dtype))
    return dtype.name


def check_e4m3(name: str, x) -> None:
    """Refuses anything but float8_e4m3fn data (an E4M3Array or a CuPy float8_e4m3fn view)."""
    dtype = dtype_of(name, x)
    if dtype == E4M3:
        return
    if dtype in (np.dtype(np.uint8), np.dtype(np.int8)):
        hint = ("raw bytes are ambiguous (e4m3, e5m2 or integers); if they hold e4m3 values "
                f"pass ptxattn.fp8.E4M3Array({name})")
    elif dtype.name in dispatch.SIXTEEN_BIT or dtype == np.float32:
        hint = ("quantize it first (ptxattn.fp8.quantize / quantize_qkv), or call "
                "ptxattn.attention for 16-bit inputs")
    else:
        hint = "only e4m3 (float8_e4m3fn) is supported"
    raise TypeError(f"{name} must have dtype float8_e4m3fn (FP8 e4m3), got {dtype}: {hint}")


def integer_hint(dtype: np.dtype) -> str:
    if dtype.kind == "b":
        return " (a boolean array; attention takes floating-point values)"
    if dtype.kind in "iu":
        return " (an integer array; attention takes floating-point values)"
    return ""


def check_positive_strides(name: str, x) -> None:
    """Kernels step forward through memory: a zero stride (a broadcast view) or a negative one
    (a reversed view) along a dimension of more than one element would be misread."""
    if any(n > 1 and s <= 0 for n, s in zip(x.shape, x.strides)):
        raise ValueError(f"{name} must have positive strides along every dimension longer than "
                         f"1, got strides {x.strides} (bytes) for shape {tuple(x.shape)}; pass "
                         f"a copy (cupy.ascontiguousarray) of a broadcast or reversed view")


def check_rows(name: str, x) -> None:
    """A non-empty 4-d (batch, seqlen, heads, head_dim) array that the kernels can read in
    16-byte vectors: unit stride in head_dim, other strides free but positive multiples of
    16 bytes, base 16-byte aligned."""
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                         f"got shape {tuple(x.shape)}")
    if x.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    check_positive_strides(name, x)
    if x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must have unit stride in head_dim, got strides {x.strides} "
                         f"(bytes) for shape {tuple(x.shape)}")
    if x.data.ptr % ALIGN_BYTES or any(s % ALIGN_BYTES for s in x.strides[:-1]):
        raise ValueError(f"{name} must have a 16-byte aligned base and batch/seqlen/heads strides "
                         f"that are multiples of 16 bytes, got strides {x.strides}")


def is_c_contiguous(x) -> bool:
    step = x.itemsize
    for n, stride in zip(reversed(x.shape), reversed(x.strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def byte_extent(x) -> tuple[int, int]:
    """The bytes [start, stop) that the elements of a non-empty array ``x`` lie in."""
    start = stop = x.data.ptr
    for n, stride in zip(x.shape, x.strides):
        if stride < 0:
            start += (n - 1) * stride
        else:
            stop += (n - 1) * stride
    return start, stop + x.itemsize


def check_no_overlap(name: str, x, inputs: dict) -> None:
    """Refuses an output whose byte extent meets that of any array in ``inputs`` (name ->
    array; numbers and None are skipped): the kernels write it while still reading them. The
    test is on extents, so an output interleaved with an input, sharing no element, is refused
    too."""
    start, stop = byte_extent(x)
    for other_name, other in inputs.items():
        if not hasattr(other, "data") or other.size == 0:
            continue
        other_start, other_stop = byte_extent(other)
        if start < other_stop and other_start < stop:
            raise ValueError(f"{name} must not overlap {other_name} in memory: {name} spans "
                             f"bytes [{start:#x}, {stop:#x}) and {other_name} "
                             f"[{other_start:#x}, {other_stop:#x}); the kernels write {name} "
                             f"while still reading {other_name}, so pass a separate buffer")


def rows_overlap(a, b) -> bool:
    """Whether two (batch, seqlen, heads, head_dim) arrays with positive strides and unit stride
    in head_dim share a byte: each is a set of contiguous rows, so this compares row intervals,
    row by row (only asked when their extents meet: packed gradient buffers, say)."""
    def row_starts(x):
        starts = np.asarray(x.data.ptr, dtype=np.int64)
        for n, stride in zip(x.shape[:-1], x.strides[:-1]):
            starts = (starts[..., None] + np.arange(n, dtype=np.int64) * stride)
        return np.sort(starts.ravel())

    starts_a, starts_b = row_starts(a), row_starts(b)
    len_a, len_b = a.shape[-1] * a.itemsize, b.shape[-1] * b.itemsize
    # the nearest row of b at or after each row of a, and the one before it
    after = np.searchsorted(starts_b, starts_a)
    hits_after = (after < len(starts_b)) & (starts_b[np.minimum(after, len(starts_b) - 1)]
                                            < starts_a + len_a)
    before = after - 1
    hits_before = (before >= 0) & (starts_b[np.maximum(before, 0)] + len_b > starts_a)
    return bool((hits_after | hits_before).any())


def check_device(name: str, x, device: int) -> None:
    if x.device.id != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device.id}")


def check_qkv_shapes(q, k, v) -> tuple[int, int, int, int, int, int]:
    """What every (batch, seqlen, heads, head_dim) attention needs of q, k, v: one device, k and
    v alike but for v's head dim (head_dim_v, which check_head_dim checks), batch and head_dim
    matching q's, q's heads a multiple of k's. Returns (batch, seqlen_q, seqlen_k, heads_q,
    heads_kv, head_dim)."""
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices {sorted(devices)}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the last axis (v's "
                         f"head_dim_v), got {k.shape} and {v.shape}")
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch {batch} like q, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have head_dim {head_dim} like q, got {k.shape[3]}")
    if heads_q % heads_kv:
        raise ValueError(f"q's heads ({heads_q}) must be a multiple of k/v's heads ({heads_kv})")
    return batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim


def check_head_dim(input_format: str, head_dim: int, detail: str = "",
                   head_dim_v: int | None = None) -> None:
    """Refuses a head_dim (and v's head_dim_v, if given) that no GPU runs for this format
    (which GPU runs it is dispatch's question, once the device is known)."""
    try:
        dispatch.check_head_dims(input_format, head_dim, head_dim_v)
    except ValueError as error:
        raise ValueError(f"{error}{detail}") from None


def check_last_axis(name: str, x, input_format: str) -> None:
    """The head-dim rule on an operand's last axis (q's and k's head_dim, v's head_dim_v),
    before its strides are: a contiguous array whose head dim breaks the rule has strides that
    break theirs, and the head dim is the reason to name."""
    if getattr(x, "ndim", 0):
        try:
            dispatch.check_head_dims(input_format, x.shape[-1])
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None


def check_output(name: str, x, shape: tuple, device: int, inputs: dict,
                 shape_name: str = "q's shape") -> None:
    """An output array of ``shape`` on ``device`` that overlaps none of ``inputs``; its dtype
    and layout are the caller's to check first."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have {shape_name} {tuple(shape)}, got {tuple(x.shape)}")
    check_device(name, x, device)
    check_no_overlap(name, x, inputs)


def check_lse(lse, shape: tuple, device: int, inputs: dict,
              layout: str = "(batch, heads_q, seqlen_q)") -> None:
    """A float32 C-contiguous buffer for the log-sum-exp of ``shape`` (``layout``: (batch,
    heads_q, seqlen_q), or (heads_q, total_q) for packed sequences), apart from every array in
    ``inputs``: the kernels write one row of values per (batch, head) or head."""
    dtype = dtype_of("lse", lse)
    if dtype != np.float32:
        raise TypeError(f"lse must have dtype float32, got {dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse must have shape {layout} = {tuple(shape)}, got "
                         f"{tuple(lse.shape)}")
    if not is_c_contiguous(lse):
        raise ValueError(f"lse must be C-contiguous, got strides {lse.strides} for shape "
                         f"{tuple(lse.shape)}")
    check_device("lse", lse, device)
    check_no_overlap("lse", lse, inputs)


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite positive number or None, "
                         f"got {softmax_scale!r}")
    return float(softmax_scale)


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


# ---------------------------------------------------------------------------------------------
# FP8 descales


def descale_shapes(batch: int, heads: int, seqlen: int, allow_block: bool) -> dict:
    """Descale shape -> granularity name (ptxattn.fp8's docstring describes them)."""
    shapes = {(): "tensor", (1,): "tensor", (batch, heads): "head"}
    if allow_block:
        shapes[(batch, heads, -(-seqlen // SCALE_BLOCK_ROWS))] = "block"
    return shapes


def check_descale(name: str, d, batch: int, heads: int, seqlen: int, allow_block: bool,
                  device: int) -> str:
    """The granularity of descale ``d`` (a positive number or a float32 array on ``device``),
    or an error."""
    if d is None:
        raise TypeError(f"{name} is required: the float32 factor that turns the e4m3 values "
                        "back into real ones (per tensor, or per (batch, head)); quantize() "
                        "returns it")
    if isinstance(d, numbers.Real) and not isinstance(d, bool):
        if not (math.isfinite(d) and d > 0):
            raise ValueError(f"{name} must be finite and positive, got {d!r}")
        return "tensor"
    if not hasattr(d, "shape") or not hasattr(d, "dtype") or isinstance(d, np.ndarray):
        raise TypeError(f"{name} must be a positive number or a float32 cupy.ndarray, got "
                        f"{type(d).__module__}.{type(d).__name__}")
    if np.dtype(d.dtype) != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {d.dtype}")
    shapes = descale_shapes(batch, heads, seqlen, allow_block)
    if tuple(d.shape) not in shapes:
        raise ValueError(f"{name} must have one of the shapes {sorted(shapes, key=len)} "
                         f"({', '.join(dict.fromkeys(shapes.values()))}), got {tuple(d.shape)}")
    check_device(name, d, device)
    return shapes[tuple(d.shape)]


# ---------------------------------------------------------------------------------------------
# Block-scaled operands


def check_uint8_layout(name: str, x, shape: tuple, what: str) -> None:
    dtype = dtype_of(name, x)
    if dtype != np.uint8:
        raise TypeError(f"{name} must be uint8 ({what}), got dtype {dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}), got {tuple(x.shape)}")
    if not is_c_contiguous(x):
        raise ValueError(f"{name} must be C-contiguous, got strides {x.strides} for shape "
                         f"{tuple(x.shape)}")


def check_tensor_scale(name: str, value, fmt: str, device: int) -> None:
    if fmt == "mxfp8":
        if value is not None:
            raise ValueError(f"{name} is an NVFP4 argument; MXFP8 has no per-tensor scale")
        return
    if value is None:
        raise ValueError(f"format='nvfp4' needs {name}, the per-tensor FP32 scale")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and positive, got {value!r}")
        return
    if getattr(value, "size", None) != 1 or str(getattr(value, "dtype", "")) != "float32":
        raise TypeError(f"{name} must be a positive float or a 1-element float32 array, got "
                        f"{type(value).__name__} {getattr(value, 'dtype', '')} "
                        f"{getattr(value, 'shape', '')}")
    check_device(name, value, device)


# ---------------------------------------------------------------------------------------------
# Memo of checked calls

def check_int32(name: str, x, ndim: int, device: int) -> None:
    """An int32 array of ``ndim`` dimensions on ``device`` (sequence lengths, page tables)."""
    dtype = dtype_of(name, x)
    if dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got "
                         f"shape {tuple(x.shape)}")
    check_positive_strides(name, x)
    if ndim == 1 and x.shape[0] > 1 and x.strides[0] != x.itemsize:
        raise ValueError(f"{name} must be contiguous, got strides {x.strides}")
    check_device(name, x, device)


def check_window(window) -> tuple[int, int]:
    """(left, right) key counts around the diagonal, -1 = unbounded."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1
                   for w in window)):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1 (-1: unbounded), "
                         f"got {window!r}")
    return (int(window[0]), int(window[1]))


def check_softcap(softcap) -> float:
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
            or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, heads_q: int, device: int) -> bool:
    """Attention sinks: float32 (heads_q,) logits, contiguous. Returns whether they are given."""
    if sinks is None:
        return False
    dtype = dtype_of("sinks", sinks)
    if dtype != np.float32:
        raise TypeError(f"sinks must have dtype float32, got {dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},), got "
                         f"{tuple(sinks.shape)}")
    if heads_q > 1 and sinks.strides[0] != sinks.itemsize:
        raise ValueError(f"sinks must be contiguous, got strides {sinks.strides}")
    check_device("sinks", sinks, device)
    return True


MAX_SPLITS = 128


def check_num_splits(num_splits) -> int:
    if (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
            or not 0 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int from 0 (chosen for the GPU) to "
                         f"{MAX_SPLITS}, got {num_splits!r}")
    return int(num_splits)
