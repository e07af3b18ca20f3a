"""The host mirror of ``ptx_src/roles/params.cuh``: ``FwdParams``, the one argument of every attention
forward kernel, ``BwdParams``, that of every backward kernel, and ``CombineParams``, that of the
merge of partial attention states.

Field order, names and C types match the device structs; :func:`layout_check_source` turns a
layout into static_asserts that NVRTC checks against the header (tests/test_params.py), so the two
cannot drift apart unnoticed.
"""

from __future__ import annotations

import ctypes
import math

_TENSOR_MAP = ctypes.c_ubyte * 128
_ALIGN = 64  # alignas(64): CUtensorMap's alignment

# (name, ctypes type), in the device struct's order. Pointers travel as 64-bit addresses.
_FIELDS = [
    ("q_map", _TENSOR_MAP), ("k_map", _TENSOR_MAP), ("v_map", _TENSOR_MAP),
    ("out_map", _TENSOR_MAP),
    ("q", ctypes.c_uint64), ("k", ctypes.c_uint64), ("v", ctypes.c_uint64),
    ("out", ctypes.c_uint64), ("lse", ctypes.c_uint64),
    ("q_stride_b", ctypes.c_int64), ("q_stride_s", ctypes.c_int64), ("q_stride_h", ctypes.c_int64),
    ("k_stride_b", ctypes.c_int64), ("k_stride_s", ctypes.c_int64), ("k_stride_h", ctypes.c_int64),
    ("v_stride_b", ctypes.c_int64), ("v_stride_s", ctypes.c_int64), ("v_stride_h", ctypes.c_int64),
    ("out_stride_b", ctypes.c_int64), ("out_stride_s", ctypes.c_int64),
    ("out_stride_h", ctypes.c_int64),
    ("lse_stride_b", ctypes.c_int64), ("lse_stride_h", ctypes.c_int64),
    ("batch", ctypes.c_int32), ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
    ("heads_q", ctypes.c_int32), ("heads_kv", ctypes.c_int32), ("q_per_kv", ctypes.c_int32),
    ("scale_log2", ctypes.c_float),
    ("causal", ctypes.c_int32), ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
    ("cu_seqlens_q", ctypes.c_uint64), ("cu_seqlens_k", ctypes.c_uint64),
    ("num_m_blocks", ctypes.c_int32), ("section_heads", ctypes.c_int32),
    ("tile_counter", ctypes.c_uint64),
    ("q_descale", ctypes.c_uint64), ("q_descale_stride_b", ctypes.c_int64),
    ("q_descale_stride_h", ctypes.c_int64), ("q_descale_stride_block", ctypes.c_int64),
    ("k_descale", ctypes.c_uint64), ("k_descale_stride_b", ctypes.c_int64),
    ("k_descale_stride_h", ctypes.c_int64), ("k_descale_stride_block", ctypes.c_int64),
    ("v_descale", ctypes.c_uint64), ("v_descale_stride_b", ctypes.c_int64),
    ("v_descale_stride_h", ctypes.c_int64),
    ("q_scale", ctypes.c_uint64), ("k_scale", ctypes.c_uint64), ("v_scale", ctypes.c_uint64),
    ("q_tensor_scale", ctypes.c_uint64), ("k_tensor_scale", ctypes.c_uint64),
    ("v_scale_row", ctypes.c_int32),
    ("seqused_k", ctypes.c_uint64), ("block_table", ctypes.c_uint64),
    ("block_table_stride", ctypes.c_int64), ("page_size", ctypes.c_int32),
    ("total_q", ctypes.c_int32), ("num_splits", ctypes.c_int32),
    ("out_accum", ctypes.c_uint64), ("lse_accum", ctypes.c_uint64),
    ("softcap_scale", ctypes.c_float), ("sinks", ctypes.c_uint64),
    ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
]


_P = ctypes.c_uint64  # a device pointer
_STRIDES = [(f"{name}_stride_{dim}", ctypes.c_int64)
            for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv") for dim in "bsh"]
_BWD_FIELDS = [
    ("q_map", _TENSOR_MAP), ("k_map", _TENSOR_MAP), ("v_map", _TENSOR_MAP),
    ("dout_map", _TENSOR_MAP), ("dq_accum_map", _TENSOR_MAP), ("dk_map", _TENSOR_MAP),
    ("dv_map", _TENSOR_MAP),
    ("q", _P), ("k", _P), ("v", _P), ("out", _P), ("dout", _P), ("dq", _P), ("dk", _P),
    ("dv", _P), ("lse", _P), ("dq_accum", _P), ("dpsum", _P), ("lse_log2", _P),
    ("dq_semaphore", _P),
    *_STRIDES, ("lse_stride_b", ctypes.c_int64), ("lse_stride_h", ctypes.c_int64),
    ("batch", ctypes.c_int32), ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
    ("heads_q", ctypes.c_int32), ("heads_kv", ctypes.c_int32), ("q_per_kv", ctypes.c_int32),
    ("softmax_scale", ctypes.c_float), ("scale_log2", ctypes.c_float),
    ("causal", ctypes.c_int32), ("num_m_blocks", ctypes.c_int32),
    ("seqlen_q_rounded", ctypes.c_int32), ("dq_turn_group", ctypes.c_int32),
    ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
    ("softcap_scale", ctypes.c_float),
    ("cu_seqlens_q", _P), ("cu_seqlens_k", _P), ("row_padding", ctypes.c_int32),
    ("sinks", _P), ("dsink_rows", _P),
    ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
    ("k8_map", _TENSOR_MAP), ("qt_map", _TENSOR_MAP), ("doutt_map", _TENSOR_MAP),
    ("q_descale", _P), ("q_descale_stride_b", ctypes.c_int64),
    ("q_descale_stride_h", ctypes.c_int64), ("q_descale_stride_block", ctypes.c_int64),
    ("k_descale", _P), ("k_descale_stride_b", ctypes.c_int64),
    ("k_descale_stride_h", ctypes.c_int64), ("k_descale_stride_block", ctypes.c_int64),
    ("v_descale", _P), ("v_descale_stride_b", ctypes.c_int64),
    ("v_descale_stride_h", ctypes.c_int64),
    ("dout_descale", _P), ("dout_descale_stride_b", ctypes.c_int64),
    ("dout_descale_stride_h", ctypes.c_int64), ("dout_descale_stride_block", ctypes.c_int64),
]
_COMBINE_FIELDS = [
    ("parts", _P), ("lse_parts", _P), ("out", _P), ("lse", _P), ("sinks", _P),
    *[(f"parts_stride_{dim}", ctypes.c_int64) for dim in "pbsh"],
    *[(f"lse_parts_stride_{dim}", ctypes.c_int64) for dim in "pbhs"],
    *[(f"out_stride_{dim}", ctypes.c_int64) for dim in "bsh"],
    *[(f"lse_stride_{dim}", ctypes.c_int64) for dim in "bhs"],
    ("num_parts", ctypes.c_int32), ("batch", ctypes.c_int32), ("seqlen", ctypes.c_int32),
    ("heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
]


def _padded_fields(fields: list) -> list:
    """``fields`` with the padding that alignas(64) gives the device struct: before each tensor
    map that would not sit at a multiple of 64 from the start, and at the tail (ctypes cannot
    express the alignment)."""
    padded = []
    for name, kind in fields + [("_tail_padding", None)]:
        class Unpadded(ctypes.Structure):
            _fields_ = padded

        size = ctypes.sizeof(Unpadded)
        pad = math.ceil(size / _ALIGN) * _ALIGN - size
        if pad and kind in (_TENSOR_MAP, None):
            padded.append((f"_padding_{len(padded)}" if kind else name, ctypes.c_ubyte * pad))
        if kind is not None:
            padded.append((name, kind))
    return padded


class _Params(ctypes.Structure):
    """A params struct by value. Pointer fields take CuPy arrays (their device address) or 0,
    tensor-map fields take ``runtime.TensorMap``s; the rest are plain numbers. Unset fields are
    zero unless ``_defaults`` says otherwise."""

    _defaults: dict = {}

    def __init__(self, **fields):
        super().__init__(**self._defaults)
        for name, value in fields.items():
            setattr(self, name, value)

    def __setattr__(self, name, value):
        kind = dict(self._fields_).get(name)
        if kind is _TENSOR_MAP:
            value = _TENSOR_MAP.from_buffer_copy(value._buffer)
        elif kind is ctypes.c_uint64 and hasattr(value, "data"):
            value = value.data.ptr
        elif kind is None and not name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        super().__setattr__(name, value)


class FwdParams(_Params):
    """``FwdParams`` by value; the window defaults to unbounded (-1)."""

    _fields_ = _padded_fields(_FIELDS)
    _defaults = {"window_left": -1, "window_right": -1}


class BwdParams(_Params):
    """``BwdParams`` by value; the window defaults to unbounded (-1)."""

    _fields_ = _padded_fields(_BWD_FIELDS)
    _defaults = {"window_left": -1, "window_right": -1}


class CombineParams(_Params):
    """``CombineParams`` by value."""

    _fields_ = _COMBINE_FIELDS


def score_scales(softmax_scale: float, softcap: float = 0.0) -> tuple[float, float]:
    """The (scale_log2, softcap_scale) fields of FwdParams and BwdParams for ``softmax_scale``
    and a logit ``softcap`` (0: off). Under a softcap the scores are softcap tanh(softmax_scale
    s / softcap): the kernels take t = tanh(softcap_scale s) and scale t by scale_log2 = softcap
    log2(e); softcap_scale 0 leaves the scores as they are."""
    if softcap > 0:
        return softcap * math.log2(math.e), softmax_scale / softcap
    return softmax_scale * math.log2(math.e), 0.0


def strides(x, dims: int = 3) -> list[int]:
    """The element strides of an array's first ``dims`` dimensions."""
    return [s // x.itemsize for s in x.strides[:dims]]


def set_strides(p: "FwdParams", q, k, v, out, lse) -> None:
    """p's element strides of q, k, v, out (batch, seqlen, heads) and lse (batch, heads), and
    the arrays' head dims: q's (head_dim) and v's (head_dim_v)."""
    p.head_dim, p.head_dim_v = q.shape[-1], v.shape[-1]
    (p.q_stride_b, p.q_stride_s, p.q_stride_h) = strides(q)
    (p.k_stride_b, p.k_stride_s, p.k_stride_h) = strides(k)
    (p.v_stride_b, p.v_stride_s, p.v_stride_h) = strides(v)
    (p.out_stride_b, p.out_stride_s, p.out_stride_h) = strides(out)
    (p.lse_stride_b, p.lse_stride_h) = strides(lse, 2)


def set_block_table(p: "FwdParams", block_table, cache) -> None:
    """p's paged-cache fields for a ``block_table`` (int32 (batch, max_pages), unit stride along
    the pages) over ``cache`` (num_pages, page_size, heads, head_dim): kv_cache.cuh's KvRows."""
    p.block_table = block_table
    p.block_table_stride = block_table.strides[0] // block_table.itemsize
    p.page_size = cache.shape[1]


def layout_check_source(struct: str = "FwdParams") -> str:
    """CUDA source asserting that params.cuh's ``struct`` (FwdParams, BwdParams or
    CombineParams) has this module's layout."""
    host, fields = {"FwdParams": (FwdParams, _FIELDS), "BwdParams": (BwdParams, _BWD_FIELDS),
                    "CombineParams": (CombineParams, _COMBINE_FIELDS)}[struct]
    lines = ['#include "roles/params.cuh"', f"using ptxattn::{struct};",
             f"static_assert(sizeof({struct}) == {ctypes.sizeof(host)}, "
             f'"sizeof({struct}) differs from ptxattn/params.py");']
    for name, _ in fields:
        offset = getattr(host, name).offset
        lines.append(f"static_assert(__builtin_offsetof({struct}, {name}) == {offset}, "
                     f'"{struct}::{name} is not at offset {offset} as in ptxattn/params.py");')
    return "\n".join(lines) + "\n"
