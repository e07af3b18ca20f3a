"""One attention call, checked and normalized once, from array metadata only.

Every entry point builds an :class:`AttentionProblem` from its arguments before anything reaches
a GPU: ``ptxattn.attention`` with :meth:`AttentionProblem.from_16bit`, ``ptxattn.fp8.attention``
with :meth:`~AttentionProblem.from_fp8`, ``blockscaled_attention`` with
:meth:`~AttentionProblem.from_blockscaled`. A bad argument raises TypeError (wrong kind of thing:
not an array, wrong dtype, causal not a bool) or ValueError (wrong value: shape, strides,
alignment, device, overlap, scale), naming the argument and saying what was expected. The
problem then carries what the rest of the call needs: sizes, format, scale, output dtype,
device, and the features dispatch.select() matches against.

Only metadata is read (shape, dtype, strides, itemsize, ``data.ptr``, ``device.id``), so the
checks run without a GPU on stand-ins (tests/meta_array.py). The operand checks are functions
(check_rows, check_output, check_lse, ...) so that later entry points (backward, varlen, kv
cache) can build their problems from the same rules.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import threading

import ml_dtypes
import numpy as np

from . import dispatch
from .quant import padded_seqlen

# Every kernel moves rows of head_dim in 16-byte vectors (cp.async, TMA), so base addresses and
# the batch/seqlen/heads strides must be multiples of 16 bytes.
ALIGN_BYTES = 16
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_OUT_DTYPES = ("bfloat16", "float16")
SCALE_BLOCK_ROWS = 128  # rows (of one batch and head) that share an FP8 "block" descale
# A serving call with fewer query rows than this per sequence (max_seqlen_q for varlen) is a
# decode step: its K and V reads, once per kv head in the decode kernel, cost more than its GEMMs.
DECODE_QUERIES = 64


# ---------------------------------------------------------------------------------------------
# Operand checks


def dtype_of(name: str, x) -> np.dtype:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__module__}.{type(x).__name__}")
    return np.dtype(x.dtype)


def check_16bit(name: str, x) -> str:
    """The dtype name of a float16 or bfloat16 array, or a TypeError."""
    dtype = dtype_of(name, x)
    if dtype.name not in dispatch.SIXTEEN_BIT:
        raise TypeError(f"{name} must have dtype float16 or bfloat16, got {dtype}"
                        + _integer_hint(dtype))
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


def _integer_hint(dtype: np.dtype) -> str:
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
    v alike, batch and head_dim matching q's, q's heads a multiple of k's. Returns (batch,
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)."""
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices {sorted(devices)}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch {batch} like q, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have head_dim {head_dim} like q, got {k.shape[3]}")
    if heads_q % heads_kv:
        raise ValueError(f"q's heads ({heads_q}) must be a multiple of k/v's heads ({heads_kv})")
    return batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim


def check_head_dim(input_format: str, head_dim: int, detail: str = "") -> None:
    """Refuses a head_dim that no GPU runs for this format (which GPU runs it is dispatch's
    question, once the device is known)."""
    dims = dispatch.head_dims(input_format)
    if head_dim not in dims:
        raise ValueError(f"head_dim must be one of {dims} for {input_format} inputs, got "
                         f"{head_dim}{detail}")


def check_output(name: str, x, shape: tuple, device: int, inputs: dict,
                 shape_name: str = "q's shape") -> None:
    """An output array of ``shape`` on ``device`` that overlaps none of ``inputs``; its dtype
    and layout are the caller's to check first."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have {shape_name} {tuple(shape)}, got {tuple(x.shape)}")
    check_device(name, x, device)
    check_no_overlap(name, x, inputs)


def check_lse(lse, shape: tuple, device: int, inputs: dict) -> None:
    """A float32 C-contiguous (batch, heads_q, seqlen_q) buffer for the log-sum-exp, apart from
    every array in ``inputs``: the kernels write one row of seqlen_q values per (batch, head)."""
    dtype = dtype_of("lse", lse)
    if dtype != np.float32:
        raise TypeError(f"lse must have dtype float32, got {dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse must have shape (batch, heads_q, seqlen_q) = {tuple(shape)}, got "
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


def _check_uint8_layout(name: str, x, shape: tuple, what: str) -> None:
    dtype = dtype_of(name, x)
    if dtype != np.uint8:
        raise TypeError(f"{name} must be uint8 ({what}), got dtype {dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}), got {tuple(x.shape)}")
    if not is_c_contiguous(x):
        raise ValueError(f"{name} must be C-contiguous, got strides {x.strides} for shape "
                         f"{tuple(x.shape)}")


def _check_tensor_scale(name: str, value, fmt: str, device: int) -> None:
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

# The checks cost tens of microseconds of Python per call, as much as a short kernel; a call
# whose arguments have the metadata of an earlier, accepted one (the common case: the same
# buffers every step) is the same problem.
_MEMO_SIZE = 256
_memo: collections.OrderedDict = collections.OrderedDict()
_memo_lock = threading.Lock()


class _Unkeyable(Exception):
    """An argument whose metadata is not known here: its call is checked afresh."""


def _metadata(x) -> tuple:
    """All that the checks read of one argument, hashable: the value of a scalar, the layout,
    address and device of an array."""
    if x is None or isinstance(x, (bool, numbers.Number, str, type)):
        return (type(x), x)
    if isinstance(x, tuple) and all(isinstance(e, (bool, numbers.Number, str)) for e in x):
        return (tuple, x)  # a window
    try:
        return (type(x), x.data.ptr, x.shape, x.strides, x.dtype, x.device.id)
    except (AttributeError, TypeError):
        raise _Unkeyable from None


def _memoized(build):
    """``build`` (an AttentionProblem constructor from call arguments), remembering the
    problems of accepted calls by their arguments' metadata. Refusals are not remembered."""

    @functools.wraps(build)
    def checked(cls, *args, **kwargs):
        try:
            key = (build.__name__, tuple(_metadata(a) for a in args),
                   tuple((name, _metadata(a)) for name, a in sorted(kwargs.items())))
        except _Unkeyable:
            return build(cls, *args, **kwargs)
        with _memo_lock:
            hit = _memo.get(key)
            if hit is not None:
                _memo.move_to_end(key)
                return hit
        problem = build(cls, *args, **kwargs)
        with _memo_lock:
            _memo[key] = problem
            if len(_memo) > _MEMO_SIZE:
                _memo.popitem(last=False)
        return problem

    return checked


# ---------------------------------------------------------------------------------------------
# The problem


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """softmax(softmax_scale * q k^T) v over (batch, seqlen, heads, head_dim) operands, as checked.

    ``format`` is the input format: "float16" or "bfloat16" (q, k and v's dtype), "e4m3" (FP8),
    "mxfp8" or "nvfp4" (block-scaled). ``out_dtype`` is the output's dtype name, ``device`` the
    CuPy device id of every operand.
    """

    format: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    softmax_scale: float
    out_dtype: str
    device: int
    # Serving (ptxattn.attention_varlen / attention_with_kvcache): the window (left, right), -1
    # unbounded; the logit softcap, 0 = off; whether sinks are given; the split count, 0 = chosen
    # by the launcher; rows of q over the batch; and the layouts among "varlen", "kvcache",
    # "paged".
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    num_splits: int = 0
    total_q: int = 0
    layouts: frozenset[str] = frozenset()

    @property
    def gqa_ratio(self) -> int:
        """q heads per k/v head."""
        return self.heads_q // self.heads_kv

    @property
    def features(self) -> frozenset[str]:
        """What the call needs of a kernel beyond plain attention (dispatch.FEATURES)."""
        needs = set()
        if self.causal:
            needs.add("causal")
        if self.heads_q != self.heads_kv:
            needs.add("gqa")
        if self.window != (-1, -1):
            needs.add("window")
        if self.softcap > 0:
            needs.add("softcap")
        if self.sinks:
            needs.add("sinks")
        if self.layouts and self.seqlen_q < DECODE_QUERIES:
            needs.add("decode")
        return frozenset(needs) | self.layouts

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        """The float32 log-sum-exp's shape, (batch, heads_q, seqlen_q)."""
        return (self.batch, self.heads_q, self.seqlen_q)

    @property
    def padded_seqlen_k(self) -> int:
        """seqlen_k rounded up to whole block-scaled key tiles: the last axis of block-scaled
        V^T (ptxattn.quant)."""
        return padded_seqlen(self.seqlen_k)

    @classmethod
    @_memoized
    def from_16bit(cls, q, k, v, *, causal: bool = False, softmax_scale=None, out=None,
                   lse=None) -> "AttentionProblem":
        """ptxattn.attention's arguments: float16 or bfloat16 q, k, v (and ``out``) with unit
        stride in head_dim and 16-byte aligned strides; ``lse``, if given, the buffer for the
        log-sum-exp."""
        check_causal(causal)
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_16bit(name, x)
            check_rows(name, x)
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        dims = check_qkv_shapes(q, k, v)
        fmt = np.dtype(q.dtype).name
        check_head_dim(fmt, dims[-1])
        inputs = {"q": q, "k": k, "v": v}
        device = q.device.id
        if out is not None:
            if check_16bit("out", out) != fmt:
                raise TypeError(f"out must have q's dtype {fmt}, got {out.dtype}")
            check_rows("out", out)
            check_output("out", out, q.shape, device, inputs)
        problem = cls(fmt, *dims, causal,
                      softmax_scale_or_default(softmax_scale, dims[-1]), fmt, device)
        if lse is not None:
            check_lse(lse, problem.lse_shape, device, {**inputs, "out": out})
        return problem

    @classmethod
    @_memoized
    def from_backward(cls, dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale=None,
                      deterministic: bool = False, dq=None, dk=None, dv=None
                      ) -> "AttentionProblem":
        """ptxattn.attention_backward's arguments: the forward's 16-bit q, k, v, its output and
        float32 log-sum-exp (batch, heads_q, seqlen_q) with unit stride along seqlen_q, dout
        like out (its own strides), and optional gradient buffers like q, k and v that overlap
        no input nor each other."""
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        problem = cls.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale)
        fmt = problem.format
        for name, x in (("out", out), ("dout", dout)):
            if check_16bit(name, x) != fmt:
                raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
            check_rows(name, x)
            if tuple(x.shape) != tuple(q.shape):
                raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got "
                                 f"{tuple(x.shape)}")
            check_device(name, x, problem.device)
        if dtype_of("lse", lse) != np.float32:
            raise TypeError(f"lse must have dtype float32 (attention(..., return_lse=True)), got "
                            f"{lse.dtype}")
        if tuple(lse.shape) != problem.lse_shape:
            raise ValueError(f"lse must have shape (batch, heads_q, seqlen_q) = "
                             f"{problem.lse_shape}, got {tuple(lse.shape)}")
        check_positive_strides("lse", lse)
        if problem.seqlen_q > 1 and lse.strides[2] != lse.itemsize:
            raise ValueError(f"lse must have unit stride along seqlen_q, got strides "
                             f"{lse.strides} (bytes)")
        check_device("lse", lse, problem.device)
        inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
        grads = {}
        for name, x, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if x is None:
                continue
            if check_16bit(name, x) != fmt:
                raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
            check_rows(name, x)
            check_output(name, x, like.shape, problem.device, inputs,
                         f"the shape of {'q' if like is q else 'k and v'}")
            # Gradients may interleave (slices of one packed dqkv buffer) but not share a byte.
            for other_name, other in grads.items():
                if rows_overlap(x, other):
                    raise ValueError(f"{name} must not share memory with {other_name}: both "
                                     f"are written")
            grads[name] = x
        return problem

    @classmethod
    @_memoized
    def from_fp8(cls, q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False,
                 softmax_scale=None, out_dtype=None, out=None, lse=None) -> "AttentionProblem":
        """ptxattn.fp8.attention's arguments: e4m3 q, k, v (E4M3Array or float8_e4m3fn views)
        laid out like 16-bit ones, their descales (required), and a bfloat16 or float16 output
        (``out_dtype``, or ``out``'s dtype)."""
        check_causal(causal)
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_e4m3(name, x)
            check_rows(name, x)
        batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = check_qkv_shapes(q, k, v)
        check_head_dim("e4m3", head_dim)
        device = q.device.id
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        check_descale("q_descale", q_descale, batch, heads_q, seqlen_q, True, device)
        check_descale("k_descale", k_descale, batch, heads_kv, seqlen_k, True, device)
        # V's rows are the keys P V sums over: a per-block V scale would rescale the accumulator
        # every key block.
        check_descale("v_descale", v_descale, batch, heads_kv, seqlen_k, False, device)
        inputs = {"q": q, "k": k, "v": v, **descales}
        if out is not None:
            out_name = dtype_of("out", out).name
            if out_name not in FP8_OUT_DTYPES:
                raise TypeError(f"out must have dtype bfloat16 or float16, got {out.dtype}"
                                + _integer_hint(np.dtype(out.dtype)))
            if out_dtype is not None and out_name != np.dtype(out_dtype).name:
                raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
            out_dtype = out_name
            check_rows("out", out)
            check_output("out", out, q.shape, device, inputs)
        out_name = np.dtype(out_dtype if out_dtype is not None else "bfloat16").name
        if out_name not in FP8_OUT_DTYPES:
            raise ValueError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
        problem = cls("e4m3", batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
                      softmax_scale_or_default(softmax_scale, head_dim), out_name, device)
        if lse is not None:
            check_lse(lse, problem.lse_shape, device, {**inputs, "out": out})
        return problem

    @classmethod
    def from_blockscaled(cls, q, k, v, q_scale, k_scale, v_scale, *,
                         format: str,  # noqa: A002 - the API's word
                         q_tensor_scale=None, k_tensor_scale=None, causal: bool = False,
                         softmax_scale=None, out=None, lse=None) -> "AttentionProblem":
        """blockscaled_attention's arguments: C-contiguous uint8 operands in the layouts of
        ptxattn.blockscaled's docstring, NVFP4's per-tensor scales, a C-contiguous bfloat16
        ``out``."""
        check_causal(causal)
        if format not in dispatch.BLOCK_SCALED:
            raise ValueError(f"format must be one of {dispatch.BLOCK_SCALED}, got {format!r}")
        nvfp4 = format == "nvfp4"
        operands = {"q": q, "k": k, "v": v, "q_scale": q_scale, "k_scale": k_scale,
                    "v_scale": v_scale}
        for name, x in operands.items():
            if getattr(x, "ndim", None) != 4:
                raise ValueError(f"{name} must be a 4-d array, got {type(x).__name__} of shape "
                                 f"{getattr(x, 'shape', None)}")
        batch, seqlen_q, heads_q, q_row = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
        head_dim = 2 * q_row if nvfp4 else q_row
        check_head_dim(format, head_dim, f" (q's last axis is {q_row}"
                                         f"{' packed e2m1 pairs' if nvfp4 else ''})")
        if min(batch, seqlen_q, heads_q, seqlen_k, heads_kv) < 1:
            raise ValueError(f"empty problem: q {tuple(q.shape)}, k {tuple(k.shape)}")
        if heads_q % heads_kv:
            raise ValueError(f"q's heads ({heads_q}) must be a multiple of k's heads ({heads_kv})")
        padded = padded_seqlen(seqlen_k)
        row = "D/2" if nvfp4 else "D"
        data_kind = "e2m1 pairs" if nvfp4 else "e4m3"
        per_scale, scale_kind = (16, "UE4M3") if nvfp4 else (32, "UE8M0")
        _check_uint8_layout("q", q, (batch, seqlen_q, heads_q, q_row),
                            f"{data_kind}, (B, Sq, Hq, {row})")
        _check_uint8_layout("k", k, (batch, seqlen_k, heads_kv, q_row),
                            f"{data_kind}, (B, Sk, Hkv, {row}) like q")
        _check_uint8_layout("v", v, (batch, heads_kv, head_dim, padded),
                            "MXFP8 e4m3 V transposed: (B, Hkv, D, Sk rounded up to 128)")
        _check_uint8_layout("q_scale", q_scale, (batch, seqlen_q, heads_q, head_dim // per_scale),
                            f"{scale_kind}, one per {per_scale} of head_dim")
        _check_uint8_layout("k_scale", k_scale, (batch, seqlen_k, heads_kv, head_dim // per_scale),
                            f"{scale_kind}, one per {per_scale} of head_dim")
        _check_uint8_layout("v_scale", v_scale, (batch, heads_kv, head_dim, padded // 32),
                            "UE8M0, one per 32 keys of each head_dim column")
        for name, x in operands.items():
            if x.data.ptr % ALIGN_BYTES:
                raise ValueError(f"{name} must start at a 16-byte aligned address")
        devices = {x.device.id for x in operands.values()}
        if len(devices) != 1:
            raise ValueError(f"all operands must be on one device, got devices {sorted(devices)}")
        device = q.device.id
        _check_tensor_scale("q_tensor_scale", q_tensor_scale, format, device)
        _check_tensor_scale("k_tensor_scale", k_tensor_scale, format, device)
        inputs = {**operands, "q_tensor_scale": q_tensor_scale, "k_tensor_scale": k_tensor_scale}
        if out is not None:
            out_dtype = dtype_of("out", out)
            if out_dtype.name != "bfloat16":
                raise TypeError(f"out must have dtype bfloat16, got {out_dtype}"
                                + _integer_hint(out_dtype))
            if not is_c_contiguous(out):
                raise ValueError(f"out must be C-contiguous, got strides {out.strides} for shape "
                                 f"{tuple(out.shape)}")
            check_output("out", out, (batch, seqlen_q, heads_q, head_dim), device, inputs,
                         "shape (B, Sq, Hq, D)")
        problem = cls(format, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
                      softmax_scale_or_default(softmax_scale, head_dim), "bfloat16", device)
        if lse is not None:
            check_lse(lse, problem.lse_shape, device, {**inputs, "out": out})
        return problem

    @classmethod
    @_memoized
    def from_kvcache(cls, q, k_cache, v_cache, *, cache_seqlens, block_table=None, k_new=None,
                     v_new=None, causal: bool = True, window=(-1, -1), softcap=0.0, sinks=None,
                     softmax_scale=None, num_splits=0, out=None) -> "AttentionProblem":
        """ptxattn.attention_with_kvcache's arguments (metadata only; check_kvcache_contents
        reads the values). ``seqlen_k`` is the cache's capacity per sequence."""
        check_causal(causal)
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_16bit(name, x)
            check_rows(name, x)
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, "
                            f"{k_cache.dtype}, {v_cache.dtype}")
        fmt = np.dtype(q.dtype).name
        batch, seqlen_q, heads_q, head_dim = q.shape
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got "
                             f"{k_cache.shape} and {v_cache.shape}")
        slots, slot_rows, heads_kv, cache_dim = k_cache.shape
        if cache_dim != head_dim:
            raise ValueError(f"k_cache must have head_dim {head_dim} like q, got {cache_dim}")
        if heads_q % heads_kv:
            raise ValueError(f"q's heads ({heads_q}) must be a multiple of the cache's heads "
                             f"({heads_kv})")
        check_head_dim(fmt, head_dim)
        device = q.device.id
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_device(name, x, device)
        layouts = {"kvcache"}
        if block_table is None:
            if slots != batch:
                raise ValueError(f"k_cache must have q's batch {batch} (a contiguous cache: "
                                 f"(batch, seqlen_cache, heads_kv, head_dim)), got {slots}; "
                                 "pass block_table for a paged cache")
            capacity = slot_rows
        else:
            check_int32("block_table", block_table, 2, device)
            if block_table.shape[0] != batch or block_table.shape[1] < 1:
                raise ValueError(f"block_table must have shape (batch, max_pages) with batch "
                                 f"{batch}, got {tuple(block_table.shape)}")
            if block_table.shape[1] > 1 and block_table.strides[1] != block_table.itemsize:
                raise ValueError("block_table must have unit stride along its pages")
            if slot_rows % 16 or not 16 <= slot_rows <= 256:
                raise ValueError(f"page_size (k_cache.shape[1] of a paged cache) must be a "
                                 f"multiple of 16 from 16 to 256, got {slot_rows}")
            capacity = block_table.shape[1] * slot_rows
            layouts.add("paged")
        if isinstance(cache_seqlens, bool) or not (
                isinstance(cache_seqlens, numbers.Integral) or hasattr(cache_seqlens, "dtype")):
            raise TypeError(f"cache_seqlens must be an int or an int32 array of shape (batch,), "
                            f"got {type(cache_seqlens).__name__}")
        if not isinstance(cache_seqlens, numbers.Integral):
            check_int32("cache_seqlens", cache_seqlens, 1, device)
            if cache_seqlens.shape != (batch,):
                raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got "
                                 f"{tuple(cache_seqlens.shape)}")
        seqlen_new = 0
        if (k_new is None) != (v_new is None):
            raise ValueError("k_new and v_new must be given together")
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        if k_new is not None:
            for name, x in (("k_new", k_new), ("v_new", v_new)):
                if check_16bit(name, x) != fmt:
                    raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
                check_rows(name, x)
                check_device(name, x, device)
                if x.shape[0] != batch or x.shape[2:] != (heads_kv, head_dim):
                    raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_kv, "
                                     f"head_dim) = ({batch}, *, {heads_kv}, {head_dim}), got "
                                     f"{tuple(x.shape)}")
            if k_new.shape != v_new.shape:
                raise ValueError(f"k_new and v_new must have the same shape, got "
                                 f"{k_new.shape} and {v_new.shape}")
            seqlen_new = k_new.shape[1]
            if (isinstance(cache_seqlens, numbers.Integral)
                    and cache_seqlens + seqlen_new > capacity):
                raise ValueError(f"cache_seqlens + seqlen_new = {cache_seqlens + seqlen_new} "
                                 f"exceeds the cache's capacity of {capacity} keys")
        if isinstance(cache_seqlens, numbers.Integral) and not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), "
                             f"got {cache_seqlens}")
        if out is not None:
            if check_16bit("out", out) != fmt:
                raise TypeError(f"out must have q's dtype {fmt}, got {out.dtype}")
            check_rows("out", out)
            check_output("out", out, q.shape, device,
                         {**inputs, "k_new": k_new, "v_new": v_new, "block_table": block_table,
                          "cache_seqlens": cache_seqlens, "sinks": sinks})
        window = check_window(window)
        return cls(fmt, batch, seqlen_q, capacity, heads_q, heads_kv, head_dim, causal,
                   softmax_scale_or_default(softmax_scale, head_dim), fmt, device,
                   window=window, softcap=check_softcap(softcap),
                   sinks=check_sinks(sinks, heads_q, device),
                   num_splits=check_num_splits(num_splits), total_q=batch * seqlen_q,
                   layouts=frozenset(layouts))

    @classmethod
    @_memoized
    def from_varlen(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal: bool = False, window=(-1, -1), softcap=0.0, sinks=None,
                    softmax_scale=None, out=None) -> "AttentionProblem":
        """ptxattn.attention_varlen's arguments: q (total_q, heads_q, D), k and v (total_k,
        heads_kv, D), int32 cumulative lengths of batch + 1 entries. ``batch`` is the number of
        sequences, seqlen_q/k the given maxima."""
        check_causal(causal)
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_16bit(name, x)
            if x.ndim != 3:
                raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, "
                                 f"head_dim), got shape {tuple(x.shape)}")
            check_rows(name, x[None])
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        _, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = check_qkv_shapes(q[None], k[None],
                                                                             v[None])
        fmt = np.dtype(q.dtype).name
        check_head_dim(fmt, head_dim)
        device = q.device.id
        for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check_int32(name, x, 1, device)
        if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 "
                             f"entries, got shapes {tuple(cu_seqlens_q.shape)} and "
                             f"{tuple(cu_seqlens_k.shape)}")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if out is not None:
            if check_16bit("out", out) != fmt:
                raise TypeError(f"out must have q's dtype {fmt}, got {out.dtype}")
            if out.ndim != 3:
                raise ValueError(f"out must have q's shape {tuple(q.shape)}, got "
                                 f"{tuple(out.shape)}")
            check_rows("out", out[None])
            check_output("out", out, q.shape, device,
                         {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                          "cu_seqlens_k": cu_seqlens_k, "sinks": sinks})
        return cls(fmt, cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), heads_q,
                   heads_kv, head_dim, causal, softmax_scale_or_default(softmax_scale, head_dim),
                   fmt, device, window=check_window(window), softcap=check_softcap(softcap),
                   sinks=check_sinks(sinks, heads_q, device), total_q=q.shape[0],
                   layouts=frozenset({"varlen"}))


# ---------------------------------------------------------------------------------------------
# Serving checks


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


def check_kvcache_contents(problem: AttentionProblem, cache_seqlens, block_table,
                           num_pages: int, seqlen_new: int) -> None:
    """The values a kv-cache call's metadata checks cannot see (one device-to-host copy):
    lengths within the cache and the page table's used entries naming real pages."""
    lengths = (np.full(problem.batch, cache_seqlens, dtype=np.int64)
               if isinstance(cache_seqlens, numbers.Integral)
               else cache_seqlens.get().astype(np.int64))
    if (lengths < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {lengths.min()} for sequence "
                         f"{int(np.argmin(lengths))}")
    total = lengths + seqlen_new
    if (total > problem.seqlen_k).any():
        b = int(np.argmax(total))
        raise ValueError(f"cache_seqlens + seqlen_new must not exceed the cache's capacity of "
                         f"{problem.seqlen_k} keys, got {int(total[b])} for sequence {b}")
    if block_table is None:
        return
    page_size = problem.seqlen_k // block_table.shape[1]
    table = block_table.get()
    used = -(-total // page_size)
    for b in range(problem.batch):
        pages = table[b, :used[b]]
        bad = pages[(pages < 0) | (pages >= num_pages)]
        if bad.size:
            raise ValueError(f"block_table[{b}] names page {int(bad[0])} among its first "
                             f"{int(used[b])} (the pages sequence {b} uses); pages must be in "
                             f"[0, {num_pages})")


def check_varlen_contents(problem: AttentionProblem, cu_seqlens_q, cu_seqlens_k,
                          total_k: int) -> None:
    """cu_seqlens that start at 0, never decrease, end at the token counts and stay within the
    given maxima (one device-to-host copy)."""
    for name, cu, total, most in (("cu_seqlens_q", cu_seqlens_q, problem.total_q,
                                   problem.seqlen_q),
                                  ("cu_seqlens_k", cu_seqlens_k, total_k, problem.seqlen_k)):
        values = cu.get().astype(np.int64)
        lengths = np.diff(values)
        if values[0] != 0 or (lengths < 0).any() or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the number of "
                             f"tokens ({total}), got {values.tolist()[:8]}"
                             f"{'...' if len(values) > 8 else ''} ending at {int(values[-1])}")
        if lengths.max() > most:
            raise ValueError(f"{name} holds a sequence of {int(lengths.max())} tokens, more "
                             f"than max_seqlen_{name[-1]} = {most}")
