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
checks run without a GPU on stand-ins (tests/meta_array.py). The operand checks are the functions
of ptxattn/problem/checks.py (check_rows, check_output, check_lse, ...), so that every entry
point builds its problem from the same rules.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import re
import threading

import numpy as np

from .. import dispatch
from ..launchers.portable_mla import HEAD_DIM as MLA_HEAD_DIM
from ..launchers.portable_mla import HEAD_DIM_V as MLA_HEAD_DIM_V
from ..quant.blockscaled import padded_seqlen
from .checks import (ALIGN_BYTES, E4M3, FP8_OUT_DTYPES, check_16bit, check_causal, check_descale,
                     check_device, check_e4m3, check_head_dim, check_int32, check_last_axis,
                     check_lse, check_num_splits, check_output, check_positive_strides,
                     check_qkv_shapes, check_rows, check_sinks, check_softcap,
                     check_tensor_scale, check_uint8_layout, check_window, dtype_of,
                     integer_hint, is_c_contiguous, rows_overlap, softmax_scale_or_default)

# A serving call with fewer query rows than this per sequence (max_seqlen_q for varlen) is a
# decode step: its K and V reads, once per kv head in the decode kernel, cost more than its GEMMs.
DECODE_QUERIES = 64


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
    # v's and the output's head dim, 0: head_dim (at most head_dim; dispatch's rule).
    head_dim_v: int = 0
    # A KV cache's format where it is not the queries' (``format``): "e4m3" for an FP8 cache.
    kv_format: str = ""

    def __post_init__(self):
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)

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
        if self.kv_format == "e4m3":
            needs.add("fp8_kv")
        # a call that runs on a serving build (a layout of its own, or an option the
        # fixed-length kernels lack) with few query rows a sequence is a decode step
        if (self.layouts or needs & dispatch.SERVING_OPTIONS) and self.seqlen_q < DECODE_QUERIES:
            needs.add("decode")
        return frozenset(needs) | self.layouts

    @property
    def backward_features(self) -> frozenset[str]:
        """What the gradients of the call need (dispatch.FEATURES): its features, few query rows
        being no decode step there, and "backward"."""
        return (self.features - {"decode"}) | {"backward"}

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

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
                   lse=None, window=(-1, -1), softcap=0.0, sinks=None) -> "AttentionProblem":
        """ptxattn.attention's arguments: float16 or bfloat16 q, k, v (and ``out``) with unit
        stride in head_dim and 16-byte aligned strides; ``lse``, if given, the buffer for the
        log-sum-exp; the window, softcap and sinks as the serving entry points take them."""
        check_causal(causal)
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_last_axis(name, x, check_16bit(name, x))
            check_rows(name, x)
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        dims = check_qkv_shapes(q, k, v)
        fmt = np.dtype(q.dtype).name
        head_dim_v = v.shape[3]
        check_head_dim(fmt, dims[-1], head_dim_v=head_dim_v)
        inputs = {"q": q, "k": k, "v": v}
        device = q.device.id
        if out is not None:
            if check_16bit("out", out) != fmt:
                raise TypeError(f"out must have q's dtype {fmt}, got {out.dtype}")
            check_rows("out", out)
            check_output("out", out, (*q.shape[:3], head_dim_v), device, inputs,
                         "q's shape with v's head_dim_v")
        window = check_window(window)
        problem = cls(fmt, *dims, causal,
                      softmax_scale_or_default(softmax_scale, dims[-1]), fmt, device,
                      window=window, softcap=check_softcap(softcap),
                      sinks=check_sinks(sinks, dims[3], device), total_q=dims[0] * dims[1],
                      head_dim_v=head_dim_v)
        if lse is not None:
            check_lse(lse, problem.lse_shape, device, {**inputs, "out": out})
        return problem

    @classmethod
    @_memoized
    def from_backward(cls, dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale=None,
                      window=(-1, -1), softcap=0.0, sinks=None, deterministic: bool = False,
                      dq=None, dk=None, dv=None, dsinks=None) -> "AttentionProblem":
        """ptxattn.attention_backward's arguments: the forward's 16-bit q, k, v, options, output
        and float32 log-sum-exp (batch, heads_q, seqlen_q) with unit stride along seqlen_q, dout
        like out (its own strides), and optional gradient buffers like q, k and v (and sinks)
        that overlap no input nor each other."""
        problem = cls.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 window=window, softcap=softcap, sinks=sinks)
        _check_backward_operands(problem, dout, q, k, v, out, lse, sinks, deterministic,
                                 {"dq": dq, "dk": dk, "dv": dv, "dsinks": dsinks},
                                 "(batch, heads_q, seqlen_q)", rank=4)
        return problem

    @classmethod
    @_memoized
    def from_varlen_backward(cls, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                             softmax_scale=None, window=(-1, -1), softcap=0.0, sinks=None,
                             deterministic: bool = False, dq=None, dk=None, dv=None,
                             dsinks=None) -> "AttentionProblem":
        """ptxattn.attention_varlen_backward's arguments: attention_varlen's, its output and
        float32 log-sum-exp (heads_q, total_q) with unit stride along total_q, dout like out,
        and optional gradient buffers as from_backward's, 3-d as q, k and v."""
        problem = cls.from_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal=causal, window=window, softcap=softcap,
                                  sinks=sinks, softmax_scale=softmax_scale)
        _check_backward_operands(problem, dout, q, k, v, out, lse, sinks, deterministic,
                                 {"dq": dq, "dk": dk, "dv": dv, "dsinks": dsinks},
                                 "(heads_q, total_q)", rank=3,
                                 others={"cu_seqlens_q": cu_seqlens_q,
                                         "cu_seqlens_k": cu_seqlens_k})
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
            check_last_axis(name, x, "e4m3")
            check_rows(name, x)
        batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = check_qkv_shapes(q, k, v)
        check_head_dim("e4m3", head_dim, head_dim_v=v.shape[3])
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
                                + integer_hint(np.dtype(out.dtype)))
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
    @_memoized
    def from_fp8_backward(cls, dout, q, k, v, out, lse, *, q_descale, k_descale, v_descale,
                          causal: bool = False, softmax_scale=None, deterministic: bool = False,
                          dq=None, dk=None, dv=None) -> "AttentionProblem":
        """ptxattn.fp8.attention_backward's arguments: fp8.attention's (e4m3 q, k, v and their
        descales), its bfloat16 or float16 output and float32 log-sum-exp, dout like out, and
        optional gradient buffers of out's dtype shaped like q, k and v. The problem's format
        is "e4m3", its out_dtype the gradients'."""
        # lse as every backward takes it (unit stride along seqlen_q), not as the forward's
        # output buffer (contiguous)
        problem = cls.from_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale, causal=causal, softmax_scale=softmax_scale,
                               out=out)
        _check_backward_operands(dataclasses.replace(problem, format=problem.out_dtype), dout,
                                 q, k, v, out, lse, None, deterministic,
                                 {"dq": dq, "dk": dk, "dv": dv}, "(batch, heads_q, seqlen_q)",
                                 rank=4)
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
        check_uint8_layout("q", q, (batch, seqlen_q, heads_q, q_row),
                            f"{data_kind}, (B, Sq, Hq, {row})")
        check_uint8_layout("k", k, (batch, seqlen_k, heads_kv, q_row),
                            f"{data_kind}, (B, Sk, Hkv, {row}) like q")
        check_uint8_layout("v", v, (batch, heads_kv, head_dim, padded),
                            "MXFP8 e4m3 V transposed: (B, Hkv, D, Sk rounded up to 128)")
        check_uint8_layout("q_scale", q_scale, (batch, seqlen_q, heads_q, head_dim // per_scale),
                            f"{scale_kind}, one per {per_scale} of head_dim")
        check_uint8_layout("k_scale", k_scale, (batch, seqlen_k, heads_kv, head_dim // per_scale),
                            f"{scale_kind}, one per {per_scale} of head_dim")
        check_uint8_layout("v_scale", v_scale, (batch, heads_kv, head_dim, padded // 32),
                            "UE8M0, one per 32 keys of each head_dim column")
        for name, x in operands.items():
            if x.data.ptr % ALIGN_BYTES:
                raise ValueError(f"{name} must start at a 16-byte aligned address")
        devices = {x.device.id for x in operands.values()}
        if len(devices) != 1:
            raise ValueError(f"all operands must be on one device, got devices {sorted(devices)}")
        device = q.device.id
        check_tensor_scale("q_tensor_scale", q_tensor_scale, format, device)
        check_tensor_scale("k_tensor_scale", k_tensor_scale, format, device)
        inputs = {**operands, "q_tensor_scale": q_tensor_scale, "k_tensor_scale": k_tensor_scale}
        if out is not None:
            out_dtype = dtype_of("out", out)
            if out_dtype.name != "bfloat16":
                raise TypeError(f"out must have dtype bfloat16, got {out_dtype}"
                                + integer_hint(out_dtype))
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
                     softmax_scale=None, num_splits=0, out=None, k_descale=None,
                     v_descale=None, mla: bool = False) -> "AttentionProblem":
        """ptxattn.attention_with_kvcache's arguments (metadata only; check_kvcache_contents
        reads the values). ``seqlen_k`` is the cache's capacity per sequence. ``mla``: the
        caches are from_mla_decode's views of one latent cache, whose head dims it checked."""
        check_causal(causal)
        fmt = check_16bit("q", q)
        kv_format = _cache_format({"k_cache": k_cache, "v_cache": v_cache}, q.dtype)
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not mla:
                if name != "q" and kv_format:
                    _check_e4m3_cache_dim(name, x)
                else:
                    check_last_axis(name, x, fmt)
            check_rows(name, x)
        batch, seqlen_q, heads_q, head_dim = q.shape
        if k_cache.shape[:-1] != v_cache.shape[:-1]:
            raise ValueError(f"k_cache and v_cache must have the same shape but for the last "
                             f"axis (v's head_dim_v), got {k_cache.shape} and {v_cache.shape}")
        slots, slot_rows, heads_kv, cache_dim = k_cache.shape
        head_dim_v = v_cache.shape[3]
        if cache_dim != head_dim:
            raise ValueError(f"k_cache must have head_dim {head_dim} like q, got {cache_dim}")
        if heads_q % heads_kv:
            raise ValueError(f"q's heads ({heads_q}) must be a multiple of the cache's heads "
                             f"({heads_kv})")
        if not mla:
            check_head_dim(fmt, head_dim, head_dim_v=head_dim_v)
        if kv_format and head_dim_v != head_dim and not mla:
            raise ValueError(f"v_cache's head_dim (head_dim_v) must be k_cache's ({head_dim}) in "
                             f"an e4m3 cache, got {head_dim_v}")
        device = q.device.id
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_device(name, x, device)
        _check_cache_descales(kv_format, {"k_descale": k_descale, "v_descale": v_descale},
                              batch, heads_kv, device)
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
        if mla:
            layouts.add("mla")
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
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_descale": k_descale,
                  "v_descale": v_descale}
        if k_new is not None:
            for name, x, dim in (("k_new", k_new, head_dim), ("v_new", v_new, head_dim_v)):
                if check_16bit(name, x) != fmt:
                    raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
                check_rows(name, x)
                check_device(name, x, device)
                if x.shape[0] != batch or x.shape[2:] != (heads_kv, dim):
                    axis = "head_dim" if name == "k_new" else "head_dim_v"
                    raise ValueError(f"{name} must have shape (batch, seqlen_new, heads_kv, "
                                     f"{axis}) = ({batch}, *, {heads_kv}, {dim}), got "
                                     f"{tuple(x.shape)}")
            if k_new.shape[1] != v_new.shape[1]:
                raise ValueError(f"k_new and v_new must have the same seqlen_new, got "
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
            check_output("out", out, (*q.shape[:3], head_dim_v), device,
                         {**inputs, "k_new": k_new, "v_new": v_new, "block_table": block_table,
                          "cache_seqlens": cache_seqlens, "sinks": sinks},
                         "q's shape with v_cache's head_dim_v")
        window = check_window(window)
        return cls(fmt, batch, seqlen_q, capacity, heads_q, heads_kv, head_dim, causal,
                   softmax_scale_or_default(softmax_scale, head_dim), fmt, device,
                   window=window, softcap=check_softcap(softcap),
                   sinks=check_sinks(sinks, heads_q, device),
                   num_splits=check_num_splits(num_splits), total_q=batch * seqlen_q,
                   layouts=frozenset(layouts), head_dim_v=head_dim_v, kv_format=kv_format)

    @classmethod
    @_memoized
    def from_mla_decode(cls, q, kv_cache, *, cache_seqlens, block_table=None, head_dim_v=512,
                        kv_new=None, causal: bool = True, softmax_scale=None, num_splits=0,
                        out=None, kv_descale=None) -> "AttentionProblem":
        """ptxattn.attention_mla_decode's arguments: attention over one latent cache, whose
        rows are both the keys (all MLA_HEAD_DIM columns) and the values (the first
        head_dim_v), shared by every query head. The problem is that of
        attention_with_kvcache over k_cache = kv_cache, v_cache = kv_cache[..., :head_dim_v],
        with the layout "mla"."""
        check_16bit("q", q)
        for name, x in (("kv_cache", kv_cache), ("kv_new", kv_new)):
            if x is not None:
                dtype_of(name, x)  # the TypeError for a non-array
        for name, x in (("q", q), ("kv_cache", kv_cache)):
            if x.ndim != 4:
                raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
        if q.shape[3] != MLA_HEAD_DIM:
            raise ValueError(f"q's head_dim must be {MLA_HEAD_DIM} (a {MLA_HEAD_DIM_V}-column "
                             f"latent and {MLA_HEAD_DIM - MLA_HEAD_DIM_V} rotary columns), "
                             f"got {q.shape[3]}")
        if kv_cache.shape[2:] != (1, MLA_HEAD_DIM):
            raise ValueError(f"kv_cache must have one head of q's head_dim {MLA_HEAD_DIM}: "
                             f"(batch, seqlen_cache, 1, {MLA_HEAD_DIM}) or (num_pages, "
                             f"page_size, 1, {MLA_HEAD_DIM}), got {tuple(kv_cache.shape)}")
        if not isinstance(head_dim_v, numbers.Integral) or isinstance(head_dim_v, bool) or (
                head_dim_v != MLA_HEAD_DIM_V):
            raise ValueError(f"head_dim_v must be {MLA_HEAD_DIM_V} (the latent columns of "
                             f"kv_cache that are also the values), got {head_dim_v!r}")
        if kv_new is not None and kv_new.ndim == 4 and kv_new.shape[2:] != (1, MLA_HEAD_DIM):
            raise ValueError(f"kv_new must have shape (batch, seqlen_new, 1, {MLA_HEAD_DIM}), "
                             f"got {tuple(kv_new.shape)}")
        fp8 = _cache_format({"kv_cache": kv_cache}, q.dtype) == "e4m3"
        if fp8 and kv_descale is None:
            raise TypeError("kv_descale is required for an e4m3 kv_cache: the float32 factor "
                            "that turns its values back into real ones (per tensor, or per "
                            "(batch, 1))")
        if not fp8 and kv_descale is not None:
            raise ValueError("kv_descale is for an e4m3 kv_cache; this one has q's dtype "
                             f"{np.dtype(q.dtype).name}")
        v_cache = kv_cache[..., :head_dim_v]
        v_new = None if kv_new is None else kv_new[..., :head_dim_v]
        try:
            problem = cls.from_kvcache(
                q, kv_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                k_new=kv_new, v_new=v_new, causal=causal, softmax_scale=softmax_scale,
                num_splits=num_splits, out=out, k_descale=kv_descale, v_descale=kv_descale,
                mla=True)
        except (TypeError, ValueError) as error:
            raise type(error)(_mla_names(str(error))) from None
        return problem

    @classmethod
    @_memoized
    def from_varlen(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal: bool = False, window=(-1, -1), softcap=0.0, sinks=None,
                    softmax_scale=None, out=None, lse=None) -> "AttentionProblem":
        """ptxattn.attention_varlen's arguments: q (total_q, heads_q, D), k and v (total_k,
        heads_kv, D), int32 cumulative lengths of batch + 1 entries, and optional out and lse
        (heads_q, total_q) buffers. ``batch`` is the number of sequences, seqlen_q/k the given
        maxima."""
        check_causal(causal)
        for name, x in (("q", q), ("k", k), ("v", v)):
            fmt = check_16bit(name, x)
            if x.ndim != 3:
                raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, "
                                 f"head_dim), got shape {tuple(x.shape)}")
            check_last_axis(name, x, fmt)
            check_rows(name, x[None])
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        _, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = check_qkv_shapes(q[None], k[None],
                                                                             v[None])
        fmt = np.dtype(q.dtype).name
        head_dim_v = v.shape[2]
        check_head_dim(fmt, head_dim, head_dim_v=head_dim_v)
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
            out_shape = (*q.shape[:2], head_dim_v)
            if out.ndim != 3:
                raise ValueError(f"out must have q's shape with v's head_dim_v {out_shape}, "
                                 f"got {tuple(out.shape)}")
            check_rows("out", out[None])
            check_output("out", out, out_shape, device,
                         {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                          "cu_seqlens_k": cu_seqlens_k, "sinks": sinks},
                         "q's shape with v's head_dim_v")
        if lse is not None:
            check_lse(lse, (heads_q, q.shape[0]), device,
                      {"q": q, "k": k, "v": v, "out": out, "cu_seqlens_q": cu_seqlens_q,
                       "cu_seqlens_k": cu_seqlens_k, "sinks": sinks}, "(heads_q, total_q)")
        return cls(fmt, cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), heads_q,
                   heads_kv, head_dim, causal, softmax_scale_or_default(softmax_scale, head_dim),
                   fmt, device, window=check_window(window), softcap=check_softcap(softcap),
                   sinks=check_sinks(sinks, heads_q, device), total_q=q.shape[0],
                   layouts=frozenset({"varlen"}), head_dim_v=head_dim_v)


def _check_backward_operands(problem: AttentionProblem, dout, q, k, v, out, lse, sinks,
                             deterministic, grads: dict, lse_layout: str, rank: int,
                             others: dict | None = None) -> None:
    """What a backward entry point takes beyond its forward's arguments: dout and out like q,
    the forward's float32 lse (lse_layout; unit stride along the rows), and the optional
    gradient buffers dq, dk, dv like q, k, v and dsinks like sinks (float32, contiguous), each
    written, so overlapping no input nor another gradient."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    fmt = problem.format

    def rows_view(x):  # packed (3-d) arrays are checked as 4-d views of batch extent 1
        return x if rank == 4 else x[None]

    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, x in (("out", out), ("dout", dout)):
        if check_16bit(name, x) != fmt:
            raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
        if tuple(x.shape) != out_shape:
            raise ValueError(f"{name} must have q's shape with v's head_dim_v {out_shape}, "
                             f"got {tuple(x.shape)}")
        check_rows(name, rows_view(x))
        check_device(name, x, problem.device)
    lse_shape = (problem.lse_shape if rank == 4 else (problem.heads_q, problem.total_q))
    if dtype_of("lse", lse) != np.float32:
        raise TypeError(f"lse must have dtype float32 (the forward's, return_lse=True), got "
                        f"{lse.dtype}")
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse must have shape {lse_layout} = {lse_shape}, got "
                         f"{tuple(lse.shape)}")
    check_positive_strides("lse", lse)
    if lse_shape[-1] > 1 and lse.strides[-1] != lse.itemsize:
        raise ValueError(f"lse must have unit stride along {'seqlen_q' if rank == 4 else 'total_q'}"
                         f", got strides {lse.strides} (bytes)")
    check_device("lse", lse, problem.device)
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **(others or {})}
    if sinks is not None:
        inputs["sinks"] = sinks
    written = {}
    for name, x in grads.items():
        if x is None:
            continue
        if name == "dsinks":
            if sinks is None:
                raise ValueError("dsinks is the gradient of sinks: pass it with sinks")
            if dtype_of("dsinks", x) != np.float32:
                raise TypeError(f"dsinks must have dtype float32, got {x.dtype}")
            check_output("dsinks", x, (problem.heads_q,), problem.device, inputs,
                         "(heads_q,)")
            if not is_c_contiguous(x):
                raise ValueError(f"dsinks must be contiguous, got strides {x.strides}")
        else:
            like = {"dq": q, "dk": k, "dv": v}[name]
            if check_16bit(name, x) != fmt:
                raise TypeError(f"{name} must have q's dtype {fmt}, got {x.dtype}")
            if x.ndim != rank:
                raise ValueError(f"{name} must have the shape {tuple(like.shape)}, got "
                                 f"{tuple(x.shape)}")
            check_rows(name, rows_view(x))
            check_output(name, x, like.shape, problem.device, inputs,
                         f"the shape of {'q' if like is q else name[1:]}")
        # Gradients may interleave (slices of one packed dqkv buffer) but not share a byte.
        for other_name, other in written.items():
            if rows_overlap(rows_view(x) if x.ndim == rank else x,
                            rows_view(other) if other.ndim == rank else other):
                raise ValueError(f"{name} must not share memory with {other_name}: both are "
                                 f"written")
        written[name] = x


# from_kvcache's argument names, as attention_mla_decode's caller knows them
_MLA_NAMES = (("k_cache", "kv_cache"), ("v_cache", "kv_cache[..., :head_dim_v]"),
              ("k_new", "kv_new"), ("v_new", "kv_new[..., :head_dim_v]"),
              ("k_descale", "kv_descale"), ("v_descale", "kv_descale"))


def _mla_names(message: str) -> str:
    names = dict(_MLA_NAMES)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda match: names[match[1]], message)


def _cache_format(caches: dict, q_dtype) -> str:
    """"e4m3" for FP8 caches (E4M3Array or float8_e4m3fn views, all of them), "" for caches of
    the queries' dtype; a TypeError for anything else."""
    dtypes = [dtype_of(name, x) for name, x in caches.items()]
    if all(dtype == E4M3 for dtype in dtypes):
        return "e4m3"
    if any(dtype != np.dtype(q_dtype) for dtype in dtypes):
        names = ["q", *caches]
        raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share a dtype, got "
                        f"{', '.join(str(d) for d in (np.dtype(q_dtype), *dtypes))}; an FP8 "
                        "cache is e4m3 throughout (ptxattn.fp8.E4M3Array or float8_e4m3fn)")
    return ""


def _check_e4m3_cache_dim(name: str, cache) -> None:
    """An e4m3 cache's head dim: whole 16-byte pieces up to the decode kernel's largest compiled
    head dim (launchers/portable_decode.py), whose e4m3 rows land in 16-byte chunks."""
    from ..launchers import portable_decode

    dim = cache.shape[-1] if getattr(cache, "ndim", 0) else None
    largest = max(portable_decode.HEAD_DIMS)
    if dim is not None and not (dispatch.takes_head_dim("e4m3", dim) and dim <= largest):
        raise ValueError(f"{name}: head_dim must be {dispatch.head_dim_rule('e4m3', largest)} "
                         f"for an e4m3 cache, got {dim}")


def _check_cache_descales(kv_format: str, descales: dict, batch: int, heads_kv: int,
                          device: int) -> None:
    """An e4m3 cache's descales: each given, per tensor or per (batch, kv head) (a cache has no
    fixed rows for per-block scales); none for a 16-bit cache."""
    for name, d in descales.items():
        if not kv_format:
            if d is not None:
                raise ValueError(f"{name} is for an e4m3 cache; these caches have q's dtype")
            continue
        check_descale(name, d, batch, heads_kv, 0, False, device)

